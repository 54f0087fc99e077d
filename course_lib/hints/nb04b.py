"""Hints for notebook 04b (tiled attention in PyTorch: the backward pass), by exercise name."""

HINTS = {
    "tile_grads (one tile)": [
        "First rebuild the tile's probabilities from L: P = exp(S - L) with S = Qi Kj^T * scale and L "
        "broadcast along each row (Li[..., None]); no max and no division needed.",
        "Then dP = dOi Vj^T and dS = P * (dP - Di[..., None]); the three pieces are dS Kj * scale, "
        "dS^T Qi * scale and P^T dOi (transpose the last two dims with .mT).",
    ],
    "first_query_block": [
        "Query row r sees key j0 only if r >= j0. The first row that sees any key of the block is row j0 "
        "itself: start at the query block that contains it.",
        "The block that contains row j0 starts at j0 rounded down to a multiple of block_m.",
    ],
    "L_for_backward": [
        "The true P is exp(S - m) / l. Write the division by l inside the exponent.",
        "exp(S - m) / l = exp(S - m - log l): the backward must subtract m + log l, the logsumexp of each row.",
    ],
    "backward_fa2 (the whole backward)": [
        "Start without the mask: D = rowsum(dO * O) once; then for each K/V block j0 (clip j1 to n_k) zero "
        "dKj and dVj, loop over all query blocks i0, apply exercise 1's formulas to the tile, add the dQ "
        "piece into dQ[..., i0:i1, :], and write dKj, dVj into dK, dV after the inner loop.",
        "Causal: offset = N_k - N_q for 'bottom_right', 0 otherwise; query i sees key j when j <= i + offset. "
        "The first query that sees key j0 is j0 - offset (at least 0): start at its block. A tile whose last "
        "key j1 - 1 is > i0 + offset crosses the diagonal: mask its S with -inf, as in the forward "
        "(causal_mask_tile(i0, i1, j0, j1, device, offset)).",
        "A row that sees no key has L = -inf, and exp(-inf - (-inf)) is NaN. Subtract "
        "torch.where(torch.isinf(L), 0.0, L) instead: the row's scores are all -inf, so its P is 0 and so "
        "are its gradients.",
    ],
}
