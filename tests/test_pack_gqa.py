"""course_lib.decode.pack_gqa (notebook 09): the split-KV kernel's packed-GQA rows, r = t * GROUP + g, against
their Python twin on the CPU interpreter; every (token, query head) of a kv head in exactly one row of one
tile; the rows' offsets those of the tensor's own elements."""

from __future__ import annotations

import pytest
import torch

import course_lib
from course_lib.decode.pack_gqa import packed_offsets, packed_rows, packed_rows_py
from course_lib.runtime import tl, triton

DEV = course_lib.DEVICE


@triton.jit
def packed_rows_probe(
    OUT, OFFS, b, kvh, T_Q, stride_b, stride_t, stride_h, GROUP: tl.constexpr, BLOCK_M: tl.constexpr
):  # fmt: skip
    """Program pid_m stores its tile's (t, h, row_ok, t_last) per row, and the rows' packed_offsets."""
    pid_m = tl.program_id(0)
    t, h, row_ok, t_last = packed_rows(pid_m, kvh, T_Q, GROUP, BLOCK_M)
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(OUT + 4 * r, t)
    tl.store(OUT + 4 * r + 1, h.to(tl.int32))
    tl.store(OUT + 4 * r + 2, row_ok.to(tl.int32))
    tl.store(OUT + 4 * r + 3, tl.zeros([BLOCK_M], dtype=tl.int32) + t_last)
    tl.store(OFFS + r, packed_offsets(b, t, h, stride_b, stride_t, stride_h), mask=row_ok)


@pytest.mark.parametrize("tq,hq,hkv,block_m", [(1, 8, 2, 16), (3, 6, 2, 16), (9, 8, 1, 64), (5, 24, 4, 16)])
def test_packed_rows_match_their_twin_and_the_tensor(tq, hq, hkv, block_m):
    """Tiles of (token, head) rows of the last kv head of sequence 1 of a (B, Tq, Hq, d) tensor: the
    kernel's helper equals its twin, the real rows are the Tq x GROUP pairs once each (the kv head's query
    heads kvh * GROUP ... kvh * GROUP + GROUP - 1), t_last is the tile's last real token, and each real row's
    offset is where q[b, t, h, 0] lies (a strided view: q sliced from a wider tensor)."""
    group, kvh, b = hq // hkv, hkv - 1, 1
    q = torch.zeros(2, tq, hq + 3, 16, device=DEV)[:, :, :hq]  # strides of a tensor with 3 more heads
    tiles = -(-(tq * group) // block_m)
    out = torch.full((tiles * block_m, 4), -1, dtype=torch.int32, device=DEV)
    offs = torch.full((tiles * block_m,), -1, dtype=torch.int64, device=DEV)
    packed_rows_probe[(tiles,)](out, offs, b, kvh, tq, *q.stride()[:3], group, block_m)
    got = out.cpu().tolist()
    case = f"Tq={tq} Hq={hq} Hkv={hkv} BLOCK_M={block_m}"
    pairs = []
    for pid_m in range(tiles):
        t, h, ok, t_last = packed_rows_py(pid_m, kvh, tq, group, block_m)
        rows = got[pid_m * block_m : (pid_m + 1) * block_m]
        assert [row[:3] for row in rows] == [[a, c, int(d)] for a, c, d in zip(t, h, ok)], case
        assert all(row[3] == t_last for row in rows), case
        assert t_last == max(a for a, d in zip(t, ok) if d), case
        pairs += [(a, c) for a, c, d in zip(t, h, ok) if d]
        for r, (a, c, d) in enumerate(zip(t, h, ok)):
            if d:
                want = (q[b, a, c].data_ptr() - q.data_ptr()) // q.element_size()
                assert offs[pid_m * block_m + r].item() == want, (case, pid_m, r)
    heads = range(kvh * group, kvh * group + group)
    assert sorted(pairs) == [(a, c) for a in range(tq) for c in heads], case
