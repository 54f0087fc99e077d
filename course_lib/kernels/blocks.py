"""Which blocks a program visits: the one answer every attention kernel asks for (notebooks 04, 06, 07).
Part of the shared kernel layer (`course_lib.kernels`); `course_lib.attention.blocks` names the same functions.

A forward program owns BLOCK_M query rows m_start ... m_start + BLOCK_M - 1 and loops over blocks of
BLOCK_N keys; a dK/dV program owns BLOCK_N keys and loops over blocks of BLOCK_M query rows. Both loops
have two stages: blocks that need no mask (every pair visible), then blocks that need one (the causal
diagonal, the ragged last block). Blocks in which no pair is visible are never loaded.

Causal masking, with an *offset*: query row i sees key j when

    j <= i + causal_offset

`causal_offset = 0` is the top-left alignment (query i sees keys 0..i, as SDPA's `is_causal=True`);
`causal_offset = Nk - Nq` is the bottom-right alignment of a KV cache (the Nq queries are the last Nq
positions of the sequence, as FlashAttention's `flash_attn_func`): `causal_offset` (below) gives it.
With Nq > Nk bottom-right, the first Nq - Nk rows see no key at all.

A sliding *window* of W keys adds a lower bound, j > i + causal_offset - W (query i sees at most the W keys
ending at its own position): `window_kv_range` and `window_q_range` cut the causal ranges down to it, and
add a third, masked stage where the window's edge crosses a block.

A *split* cuts a key range into `num_splits` nearly equal runs of whole blocks, one per program
(`split_range`; FlashAttention's split of `get_n_block_min_max`); split 0 of 1 is the whole range.
`kv_block_range` splits the keys its query block sees. Split-KV decoding (notebook 09) splits a
sequence's whole cache instead, the same boundaries for every query tile of it, then cuts the causal
end (`split_kv_range`).

Each function exists twice, with the same arguments and results: a `@triton.jit` helper that the
kernels call, and a plain-Python twin (`*_py`) that the plots, the notebooks and the tests use.
"""

from __future__ import annotations

from ..checks import causal_alignment, causal_offset  # noqa: F401  (re-exported: the alignment rules)
from ..runtime import tl, triton


# --------------------------------------------------------------------------------------------------
# The kernels' helpers
# --------------------------------------------------------------------------------------------------
@triton.jit
def program_block(N_ROWS, H, BLOCK: tl.constexpr, REVERSE: tl.constexpr, BLOCK_MAJOR: tl.constexpr):
    """This program's (batch, head, first row) for a grid of cdiv(N_ROWS, BLOCK) * B * H programs.
    Head-major by default: the blocks of one (batch, head) are adjacent, so its K and V stay in the L2
    cache. BLOCK_MAJOR: block index first, then (batch, head): the programs of block 0 of every head
    start before any of block 1 (with work that falls with the block index, the longest first).
    REVERSE: the last block first (causal forward: the longest rows start first). Batch and head come
    back as int64, ready to multiply by strides."""
    num_blocks = tl.cdiv(N_ROWS, BLOCK)
    pid = tl.program_id(0)
    if BLOCK_MAJOR:
        n_hz = tl.num_programs(0) // num_blocks
        off_hz = pid % n_hz
        block = pid // n_hz
    else:
        off_hz = pid // num_blocks
        block = pid % num_blocks
    if REVERSE:
        block = num_blocks - 1 - block
    return (off_hz // H).to(tl.int64), (off_hz % H).to(tl.int64), block * BLOCK


@triton.jit
def sequence(SEQ, off_b, N_Q, N_K, OFFSET, VARLEN: tl.constexpr):
    """Where program batch off_b's rows lie: (mem_b, q_start, n_q, k_start, n_k, offset).

    VARLEN = 0: batch off_b of a padded (B, H, N, d) tensor: (off_b, 0, N_Q, 0, N_K, OFFSET).
    VARLEN = 1 or 2 (packed sequences, `varlen.py`): off_b is a sequence of the packed rows, SEQ its
    int32 bounds [q_0, k_0, q_1, k_1, ...] (the cumulative lengths of queries and keys interleaved), the
    tensors' batch dim is 1 (mem_b = 0), and sequence off_b owns query rows q_start ... q_start + n_q - 1
    and key rows k_start ... k_start + n_k - 1; N_Q and N_K are then the longest sequence's lengths (the
    grid's), and the causal offset is OFFSET (1: top-left or none) or n_k - n_q (2: bottom-right, per
    sequence). Row starts come back as int64, ready to multiply by strides."""
    mem_b = off_b
    q_start = 0
    k_start = 0
    n_q = N_Q
    n_k = N_K
    offset = OFFSET
    if VARLEN:
        q_start = tl.load(SEQ + 2 * off_b).to(tl.int64)
        k_start = tl.load(SEQ + 2 * off_b + 1).to(tl.int64)
        n_q = (tl.load(SEQ + 2 * off_b + 2) - q_start).to(tl.int32)
        n_k = (tl.load(SEQ + 2 * off_b + 3) - k_start).to(tl.int32)
        mem_b = 0
        if VARLEN == 2:
            offset = n_k - n_q
    return mem_b, q_start, n_q, k_start, n_k, offset


@triton.jit
def kv_block_range(
    m_start, N_Q, N_K, offset, split, NUM_SPLITS: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Keys a query block visits: (lo, mid, hi). Keys [lo, mid) are visible to every row of the block
    (no mask: whole blocks of BLOCK_N); keys [mid, hi) need a mask. lo and mid are multiples of
    BLOCK_N; hi is not always (a ragged end). `split` of `NUM_SPLITS` takes its share of the blocks.
    With NUM_SPLITS = 1 the loop starts at the constant 0: a dQ loop whose start the compiler cannot
    see ran 20-30 % slower on an H200."""
    hi = N_K
    mid = (N_K // BLOCK_N) * BLOCK_N
    if CAUSAL:
        # The block's last row, min(m_start + BLOCK_M, N_Q) - 1, sees keys up to that row + offset;
        # its first row sees keys up to m_start + offset: blocks ending there need no mask.
        hi = tl.minimum(N_K, tl.maximum(tl.minimum(m_start + BLOCK_M, N_Q) + offset, 0))
        mid = tl.minimum(mid, (tl.maximum(m_start + offset + 1, 0) // BLOCK_N) * BLOCK_N)
    if NUM_SPLITS == 1:
        lo = 0
        mid = tl.minimum(mid, hi)
    else:
        lo, hi = split_range(hi, split, NUM_SPLITS, BLOCK_N)
        lo = tl.minimum(lo, hi)
        mid = tl.minimum(tl.maximum(mid, lo), hi)
    return lo, mid, hi


@triton.jit
def split_range(n_k, split, NUM_SPLITS, BLOCK_N: tl.constexpr):
    """Keys [lo, hi) of split `split` of NUM_SPLITS over keys [0, n_k): P = cdiv(cdiv(n_k, BLOCK_N),
    NUM_SPLITS) whole blocks of BLOCK_N each, lo = split * P * BLOCK_N, hi cut at n_k. NUM_SPLITS may
    be a run-time value (one compiled kernel for every split count). lo is not clamped: a split past the
    last block has lo >= hi (its loop runs no step). Clamped, min(lo, n_k) (as `kv_block_range` takes
    it), the split-KV kernel compiled differently for sm_90 (Triton 3.7.1; bf16, d = 128): paged with the
    table row 119 registers instead of 96 and 1672 SASS instructions instead of 1528."""
    per_split = tl.cdiv(tl.cdiv(n_k, BLOCK_N), NUM_SPLITS)
    lo = split * per_split * BLOCK_N
    hi = tl.minimum(lo + per_split * BLOCK_N, n_k)
    return lo, hi


@triton.jit
def split_kv_range(
    n_k, offset, last_row, split, NUM_SPLITS, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr
):  # fmt: skip
    """Keys [lo, hi) that split `split` of NUM_SPLITS visits for a tile of query rows whose last row is
    `last_row`, as split-KV decoding cuts a sequence of n_k keys (notebook 09): the sequence's blocks are
    shared out first (`split_range`: the same boundaries for every query tile, every split at most P
    blocks), then CAUSAL cuts hi after the last key the tile's last row sees, last_row + offset (the
    bottom-right offset n_k - Nq of a KV cache). Every key of [lo, hi) is masked in the loop (rows
    before the last see fewer keys; `visible_keys`). lo >= hi: the split sees no key."""
    lo, hi = split_range(n_k, split, NUM_SPLITS, BLOCK_N)
    if CAUSAL:
        hi = tl.minimum(hi, offset + last_row + 1)
    return lo, hi


@triton.jit
def q_block_range(
    n_start, N_Q, offset, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):  # fmt: skip
    """Query rows that see a block of keys n_start ... n_start + BLOCK_N - 1: (lo, mid, hi), multiples
    of BLOCK_M. Rows [lo, mid) see part of the block (mask); rows [mid, hi) see all of it (no causal
    mask). Rows before lo see none of it."""
    hi = tl.cdiv(N_Q, BLOCK_M) * BLOCK_M
    lo = 0
    mid = 0
    if CAUSAL:
        # Row i sees key j when i >= j - offset: the first row that sees key n_start is n_start - offset;
        # rows from n_start + BLOCK_N - 1 - offset on see every key of the block.
        lo = tl.minimum((tl.maximum(n_start - offset, 0) // BLOCK_M) * BLOCK_M, hi)
        mid = tl.minimum(tl.cdiv(tl.maximum(n_start + BLOCK_N - 1 - offset, 0), BLOCK_M) * BLOCK_M, hi)
    return lo, mid, hi


@triton.jit
def window_kv_range(
    m_start, N_Q, offset, WINDOW, lo, mid, hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):  # fmt: skip
    """A sliding window of WINDOW keys on `kv_block_range`'s (lo, mid, hi): (w_lo, w_full, w_mid). Keys
    [w_lo, w_full) cross the window's lower edge for some row of the block (masked), [w_full, w_mid) are
    seen by every row (no mask), [w_mid, hi) stay the causal diagonal (masked). Blocks wholly below the
    window of the block's first row are never visited."""
    # The block's first row sees keys from m_start + offset - WINDOW + 1 on; its last row from
    # last + offset - WINDOW + 1 on: keys from there up see the window of every row.
    last = tl.minimum(m_start + BLOCK_M, N_Q) - 1
    w_lo = tl.minimum(tl.maximum((tl.maximum(m_start + offset - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N, lo), hi)
    w_full = tl.maximum(
        tl.minimum(tl.cdiv(tl.maximum(last + offset - WINDOW + 1, 0), BLOCK_N) * BLOCK_N, mid), w_lo
    )
    return w_lo, w_full, tl.maximum(mid, w_full)


@triton.jit
def window_q_range(
    n_start, offset, WINDOW, lo, mid, hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):  # fmt: skip
    """A sliding window of WINDOW keys on `q_block_range`'s (lo, mid, hi) for the key block at n_start:
    (w_mid, w_full, w_hi). Rows [lo, w_mid) are the causal diagonal (masked), [w_mid, w_full) see every
    key of the block (no mask), [w_full, w_hi) cross the window's upper edge (masked); rows from w_hi on
    see none of the block (row i sees key j when j > i + offset - WINDOW, i.e. i < j - offset + WINDOW)."""
    w_hi = tl.minimum(hi, tl.cdiv(tl.maximum(n_start + BLOCK_N - 1 - offset + WINDOW, 0), BLOCK_M) * BLOCK_M)
    w_hi = tl.maximum(w_hi, lo)  # never below lo: every range stays ordered
    w_mid = tl.minimum(mid, w_hi)
    w_full = tl.minimum(
        tl.maximum((tl.maximum(n_start - offset + WINDOW, 0) // BLOCK_M) * BLOCK_M, w_mid), w_hi
    )
    return w_mid, w_full, w_hi


@triton.jit
def visible_keys(rows, cols, N_K, offset, WINDOW, CAUSAL: tl.constexpr, LOCAL: tl.constexpr):
    """Which (row, key) pairs of a tile are visible: keys past N_K never; with CAUSAL, j <= i + offset;
    with LOCAL (a sliding window) also j > i + offset - WINDOW. rows: (R, 1), cols: (1, C) or the
    transposed pair; the result broadcasts to the tile."""
    visible = cols < N_K
    if CAUSAL:
        visible = visible & (rows + offset >= cols)
        if LOCAL:
            visible = visible & (rows + offset - WINDOW < cols)
    return visible


@triton.jit
def row_mask(rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Mask of a (rows, BLOCK_D) tile: rows past n_rows and padding columns past HEAD_DIM are off."""
    if BLOCK_D == HEAD_DIM:
        mask = (rows < n_rows)[:, None]
    else:
        mask = (rows < n_rows)[:, None] & (offs_d < HEAD_DIM)[None, :]
    return mask


@triton.jit
def load_rows(
    ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr
):
    """A (rows, BLOCK_D) tile from HBM at `ptrs`: rows past n_rows and padding columns read as 0, and
    UPCAST (bf16 under the interpreter) turns it to fp32 right after the load."""
    tile = tl.load(ptrs, mask=row_mask(rows, n_rows, offs_d, HEAD_DIM, BLOCK_D), other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


# --------------------------------------------------------------------------------------------------
# Their Python twins
# --------------------------------------------------------------------------------------------------
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sequence_py(bounds, b: int, n_q: int, n_k: int, offset: int, varlen: int) -> tuple[int, ...]:
    """`sequence` in Python: bounds is the flat list [q_0, k_0, q_1, k_1, ...] (None when varlen = 0)."""
    if not varlen:
        return b, 0, n_q, 0, n_k, offset
    q_start, k_start = bounds[2 * b], bounds[2 * b + 1]
    n_q, n_k = bounds[2 * b + 2] - q_start, bounds[2 * b + 3] - k_start
    return 0, q_start, n_q, k_start, n_k, n_k - n_q if varlen == 2 else offset


def kv_block_range_py(
    m_start: int,
    n_q: int,
    n_k: int,
    offset: int,
    block_m: int,
    block_n: int,
    causal: bool,
    split: int = 0,
    num_splits: int = 1,
) -> tuple[int, int, int]:
    """`kv_block_range` in Python: (lo, mid, hi) for the query block starting at row m_start."""
    hi, mid = n_k, (n_k // block_n) * block_n
    if causal:
        hi = min(n_k, max(min(m_start + block_m, n_q) + offset, 0))
        mid = min(mid, (max(m_start + offset + 1, 0) // block_n) * block_n)
    lo, hi = split_range_py(hi, split, num_splits, block_n)
    lo = min(lo, hi)
    mid = min(max(mid, lo), hi)
    return lo, mid, hi


def split_range_py(n_k: int, split: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """`split_range` in Python: (lo, hi) of split `split` over keys [0, n_k); lo >= hi when it has none."""
    per_split = _cdiv(_cdiv(n_k, block_n), num_splits)
    lo = split * per_split * block_n
    return lo, min(lo + per_split * block_n, n_k)


def split_kv_range_py(
    n_k: int, offset: int, last_row: int, split: int, num_splits: int, block_n: int, causal: bool
) -> tuple[int, int]:
    """`split_kv_range` in Python: (lo, hi) for a query tile whose last row is `last_row`."""
    lo, hi = split_range_py(n_k, split, num_splits, block_n)
    if causal:
        hi = min(hi, offset + last_row + 1)
    return lo, hi


def q_block_range_py(
    n_start: int, n_q: int, offset: int, block_m: int, block_n: int, causal: bool
) -> tuple[int, int, int]:
    """`q_block_range` in Python: (lo, mid, hi) for the key block starting at key n_start."""
    hi = _cdiv(n_q, block_m) * block_m
    if not causal:
        return 0, 0, hi
    lo = min((max(n_start - offset, 0) // block_m) * block_m, hi)
    mid = min(_cdiv(max(n_start + block_n - 1 - offset, 0), block_m) * block_m, hi)
    return lo, mid, hi


def window_kv_range_py(
    m_start: int, n_q: int, offset: int, window: int, lo: int, mid: int, hi: int, block_m: int, block_n: int
) -> tuple[int, int, int]:
    """`window_kv_range` in Python: (w_lo, w_full, w_mid) from `kv_block_range_py`'s (lo, mid, hi)."""
    last = min(m_start + block_m, n_q) - 1
    w_lo = min(max((max(m_start + offset - window + 1, 0) // block_n) * block_n, lo), hi)
    w_full = max(min(_cdiv(max(last + offset - window + 1, 0), block_n) * block_n, mid), w_lo)
    return w_lo, w_full, max(mid, w_full)


def window_q_range_py(
    n_start: int, offset: int, window: int, lo: int, mid: int, hi: int, block_m: int, block_n: int
) -> tuple[int, int, int]:
    """`window_q_range` in Python: (w_mid, w_full, w_hi) from `q_block_range_py`'s (lo, mid, hi)."""
    w_hi = max(min(hi, _cdiv(max(n_start + block_n - 1 - offset + window, 0), block_m) * block_m), lo)
    w_mid = min(mid, w_hi)
    w_full = min(max((max(n_start - offset + window, 0) // block_m) * block_m, w_mid), w_hi)
    return w_mid, w_full, w_hi
