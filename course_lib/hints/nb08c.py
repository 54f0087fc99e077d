"""Hints of notebook 08c (08c_hopper_appendix): warp specialisation on Hopper, in Gluon."""

HINTS = {
    "ping-pong speed-up": [
        "One warpgroup alone takes 2 (M + S) for two steps. With two, look at a pair of steps, one from each "
        "consumer: the tensor cores must run 2 M in it, and each consumer must run its own M + S.",
        "The pair takes the longer of those two durations; the speed-up is one warpgroup's 2 (M + S) over it.",
    ],
    "ping-pong speed-up, softmax longer than the products": [
        "With s > m the tensor cores are no longer the bottleneck: in a pair of steps each consumer's own "
        "M + S is longer than the tensor cores' 2 M.",
        "The same formula as the first check covers both cases if it takes the larger of 2 M and M + S.",
    ],
    "shared memory of a variant": [
        "Count rows of d elements: the Q block has 64 rows per consumer (hopper.QUERY_ROWS); each stage holds "
        "one K and one V tile of BLOCK_N rows.",
        "Rows: 64 per consumer plus 2 x BLOCK_N per stage; multiply by d elements and by 2 bytes each.",
    ],
    "round-robin loads": [
        "Program p takes every `programs`-th tile, starting at tile p.",
        "Python's slicing with a step, work[start::step], picks exactly those tiles; sum each program's.",
    ],
    "registers per thread of a dK/dV program": [
        "Four terms: 2 * keys * d / threads accumulator values (dK and dV); 2 * keys * q_rows / threads score "
        "values (two tiles); L and D; and, if in registers, the two 16-bit operand tiles.",
        "L and D: with the queries as columns (transposed) a thread holds a quarter of them, 2 * (q_rows / 4); "
        "as rows, two each, 2 * 2. The 16-bit operands: half the score count (two values per register).",
    ],
}
