"""Grouped-query attention, the two causal alignments and the block-range helper (course_lib.attention).

Forward and backward against the float64 reference (`course_lib.testing.assert_close_to_reference`);
on the CPU through the Triton interpreter at tiny sizes, on a GPU at real ones (`@pytest.mark.gpu`).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import course_lib
from course_lib import flash_attention
from course_lib.attention import attention_backward, attention_forward
from course_lib.attention.blocks import kv_block_range_py, q_block_range_py
from course_lib.attention.reference import attention as reference_attention
from course_lib.attention.reference import causal_mask
from course_lib.testing import check_forward_backward, gqa_qkv

DEVICE = course_lib.DEVICE
ON_GPU = course_lib.ON_GPU
# bf16 under the interpreter too: its casts round as on a GPU (`runtime.BF16_ROUNDS_TO_NEAREST`)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


_qkv = gqa_qkv  # q of hq heads, k and v of hkv heads, drawn from a seed


def _check(q, k, v, causal, what):
    check_forward_backward(flash_attention, q, k, v, causal, what)


# (query heads per K/V head, Nq, Nk, causal): every GQA ratio asked for, both alignments with Nq < Nk and
# Nq > Nk, ragged lengths that are no multiple of the interpreter's 32 x 32 blocks.
GQA_CASES = [
    (1, 45, 45, True),
    (2, 37, 70, "bottom_right"),
    (4, 70, 37, "bottom_right"),
    (8, 33, 33, False),
    (4, 50, 81, True),
    (2, 1, 50, "bottom_right"),  # one decoding step against a cache of 50
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group,n_q,n_k,causal", GQA_CASES)
def test_gqa_and_alignments_match_reference(group, n_q, n_k, causal, dtype):
    hkv = 2 if group <= 4 else 1
    q, k, v = _qkv(1, hkv * group, hkv, n_q, n_k, 32, dtype, seed=group * 100 + n_q)
    _check(q, k, v, causal, f"GQA {group}:1, Nq={n_q}, Nk={n_k}, causal={causal}, {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("on_chip", [1, 2])
@pytest.mark.parametrize("causal", [True, "bottom_right", False])
def test_gqa_partial_sums_match_reference(on_chip, causal, dtype, monkeypatch):
    """The backward's other way to sum a group of 4 query heads into dK, dV (`backward.
    dkdv_heads_per_program` < group, as for head dims <= 64 beyond 4096 keys): 1 or 2 heads per program, their
    fp32 partial sums added afterwards by `_group_sum_kernel`."""
    import importlib

    bwd = importlib.import_module("course_lib.attention.backward")
    monkeypatch.setattr(bwd, "dkdv_heads_per_program", lambda group, causal, n_k, d: on_chip)
    q, k, v = _qkv(2, 8, 2, 37, 70, 32, dtype, seed=11)
    _check(q, k, v, causal, f"GQA 4:1 summed {on_chip} per program, causal={causal}, {dtype}")


def test_gqa_equals_repeated_kv():
    """GQA gives what multi-head attention gives on K/V repeated per query head (without repeating)."""
    q, k, v = _qkv(2, 8, 2, 40, 40, 16, torch.float32, seed=3)
    o = flash_attention(q, k, v, causal=True)
    o_rep = flash_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), causal=True)
    torch.testing.assert_close(o, o_rep, rtol=1e-5, atol=1e-5)


def test_rows_that_see_no_key():
    """Bottom-right with Nq > Nk: the first Nq - Nk rows see no key. Their O is 0, L is -inf, and their
    gradients are 0 (never NaN); the other rows match the reference."""
    n_q, n_k = 50, 20
    q, k, v = _qkv(1, 2, 1, n_q, n_k, 32, torch.float32, seed=5)
    o, lse = attention_forward(q, k, v, causal="bottom_right")
    empty = ~causal_mask(n_q, n_k, alignment="bottom_right").any(-1)
    assert int(empty.sum()) == n_q - n_k
    assert torch.equal(o[:, :, empty.to(o.device)], torch.zeros_like(o[:, :, empty.to(o.device)]))
    assert torch.isneginf(lse[:, :, empty.to(lse.device)]).all()
    ref_o, ref_l = reference_attention(
        *(t.double() for t in (q, k, v)), causal="bottom_right", return_lse=True
    )
    torch.testing.assert_close(o.double(), ref_o, rtol=1e-4, atol=1e-4)
    do = torch.randn_like(o)
    dq, dk, dv = attention_backward(do, q, k, v, o, lse, "bottom_right")
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(g).all(), f"{name} has NaN/inf"
    assert torch.equal(dq[:, :, empty.to(dq.device)], torch.zeros_like(dq[:, :, empty.to(dq.device)]))
    _check(q, k, v, "bottom_right", "Nq=50 > Nk=20, bottom_right, rows with no key")


def test_alignment_argument():
    q, k, v = _qkv(1, 2, 2, 8, 12, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="bottom_right"):
        flash_attention(q, k, v, causal="bottom-right")
    # Nq == Nk: the two alignments are the same mask
    q, k, v = _qkv(1, 2, 2, 20, 20, 16, torch.float32, seed=2)
    torch.testing.assert_close(
        flash_attention(q, k, v, causal=True), flash_attention(q, k, v, causal="bottom_right")
    )


def _visible(n_q, n_k, offset, causal):
    i = torch.arange(n_q)[:, None]
    j = torch.arange(n_k)[None, :]
    return (j <= i + offset) if causal else torch.ones(n_q, n_k, dtype=torch.bool)


@pytest.mark.parametrize("causal", [False, True])
def test_block_ranges_cover_exactly_the_visible_pairs(causal):
    """The Python twins of the kernels' block-range helper, brute-forced: every visible (query, key) pair
    is visited exactly once (over the splits), no block wholly invisible is visited, and the unmasked
    stage holds only blocks that are entirely visible to the whole query block."""
    for n_q, n_k, bm, bn, offset, splits in itertools.product(
        (1, 31, 64, 97), (1, 33, 64, 130), (16, 32), (16, 64), (-40, -3, 0, 5, 70), (1, 3)
    ):
        vis = _visible(n_q, n_k, offset, causal)
        seen = torch.zeros(n_q, n_k, dtype=torch.int64)
        for m0 in range(0, n_q, bm):
            rows = slice(m0, min(m0 + bm, n_q))
            for s in range(splits):
                lo, mid, hi = kv_block_range_py(m0, n_q, n_k, offset, bm, bn, causal, s, splits)
                assert (lo % bn == 0 or lo == hi) and (mid % bn == 0 or mid == hi) and lo <= mid <= hi <= n_k
                for j0 in range(lo, hi, bn):
                    cols = slice(j0, min(j0 + bn, hi))
                    seen[rows, cols] += 1
                    block = vis[rows, j0 : min(j0 + bn, n_k)]
                    assert block.any() or rows.stop <= rows.start, (n_q, n_k, bm, bn, offset, m0, j0)
                    if j0 < mid:  # unmasked stage: whole block of keys, all visible to every row
                        assert j0 + bn <= n_k and vis[m0 : m0 + bm, j0 : j0 + bn].all()
        assert torch.equal(seen[vis], torch.ones_like(seen[vis])), (n_q, n_k, bm, bn, offset, splits)
        # keys side (dK/dV): lo, mid, hi are multiples of BLOCK_M; rows [lo, hi) hold every row that sees the
        # key block; rows [mid, hi) see all of it (all its keys up to Nk when it is the ragged last block)
        for n0 in range(0, n_k, bn):
            lo, mid, hi = q_block_range_py(n0, n_q, offset, bm, bn, causal)
            where = (n_q, n_k, bm, bn, offset, n0, (lo, mid, hi))
            assert lo % bm == 0 and mid % bm == 0 and hi % bm == 0 and 0 <= lo <= mid <= hi, where
            keys = slice(n0, min(n0 + bn, n_k))
            assert not vis[:lo, keys].any(), where
            assert not vis[hi:, keys].any(), where
            assert vis[mid:hi, keys].all(), where


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "group,n_q,n_k,causal,d",
    [
        (4, 2048, 2048, True, 128),
        (8, 1000, 3000, "bottom_right", 64),
        (2, 3000, 1000, "bottom_right", 128),
        (1, 1, 4096, "bottom_right", 128),
        (4, 4096, 4096, True, 64),  # one program per query head, the last of a group adds the partials
    ],
)
def test_gpu_gqa_and_alignments(group, n_q, n_k, causal, d):
    q, k, v = _qkv(2, 4 * group, 4, n_q, n_k, d, torch.bfloat16, seed=7)
    _check(q, k, v, causal, f"GPU GQA {group}:1, Nq={n_q}, Nk={n_k}, causal={causal}, d={d}")
