"""Packed GQA: the query heads that share a kv head, and the new tokens, as the rows of one tile (notebook 09).

Grouped-query attention gives GROUP = Hq / Hkv query heads to each kv head: query head h reads kv head
h // GROUP. A decoding step has few query tokens (Tq = 1 for plain decoding), so one program per query head
would read each kv head's cache GROUP times for tiles of Tq rows. The split-KV kernel instead gives one
program the GROUP x Tq (token, head) pairs of a kv head as the rows of its tile,

    row r = t * GROUP + g   (token t, head g of the group: query head kvh * GROUP + g),

padded to BLOCK_M >= 16 rows (`tl.dot`'s smallest tile), so the cache of a kv head is read once. A token's
rows are adjacent: a tile shares at most its first and its last token with its neighbours. FlashAttention-3
packs the same way (hopper/pack_gqa.h: m_idx = row / qhead_per_khead); its block range then takes the
causal cut from the last token of the tile, as `split_kv_range` does from `packed_rows`' t_last.

The attention kernels (`attention/forward.py`, `backward.py`) do not pack: a forward program owns
BLOCK_M rows of one query head and reads kv head h // GROUP; a dK/dV program loops over the GROUP query
heads of its kv head. (`attention/packed.py` is about something else: packed *sequences*, varlen.)

`packed_rows` and `packed_offsets` are the kernel's helpers; `packed_rows_py` is the plain-Python twin
(tests/test_pack_gqa.py).
"""

from __future__ import annotations

from ..runtime import tl, triton


@triton.jit
def packed_rows(pid_m, kvh, T_Q, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Tile pid_m of kv head kvh's packed rows: (t, h, row_ok, t_last). t, h: each row's token and query
    head (BLOCK_M,); row_ok: the row is one of the T_Q * GROUP real rows, not padding; t_last: the last
    token the tile holds (a scalar: what bounds its causal range)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    t = rows // GROUP
    h = kvh * GROUP + rows % GROUP
    row_ok = rows < T_Q * GROUP
    t_last = (tl.minimum((pid_m + 1) * BLOCK_M, T_Q * GROUP) - 1) // GROUP
    return t, h, row_ok, t_last


@triton.jit
def packed_offsets(b, t, h, stride_b, stride_t, stride_h):
    """Offsets (in elements) of packed rows' (sequence b, token t, head h) in a (B, Tq, Hq, ...) tensor:
    b * stride_b + t * stride_t + h * stride_h, shaped like t (add the last dim's offsets for a tile)."""
    return b * stride_b + t * stride_t + h * stride_h


def packed_rows_py(pid_m: int, kvh: int, tq: int, group: int, block_m: int) -> tuple[list, list, list, int]:
    """`packed_rows` in Python: (t, h, row_ok, t_last) of tile pid_m, as lists of BLOCK_M entries."""
    rows = range(pid_m * block_m, (pid_m + 1) * block_m)
    t_last = (min((pid_m + 1) * block_m, tq * group) - 1) // group
    return (
        [r // group for r in rows],
        [kvh * group + r % group for r in rows],
        [r < tq * group for r in rows],
        t_last,
    )
