"""Sliding-window attention (`flash_attention(..., window=W)`): query i sees only the W keys ending at its
own position, as Mistral's `sliding_window` and Gemma's local layers.

Forward and backward against the float64 reference, both causal alignments, grouped-query attention,
windows shorter than a block, across blocks and longer than the sequence; the block-range helpers'
Python twins brute-forced; the custom operator; bad windows. CPU through the interpreter at tiny sizes,
GPU at real ones (`@pytest.mark.gpu`).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import course_lib
from course_lib import flash_attention
from course_lib.attention import attention_backward, attention_forward
from course_lib.attention.blocks import (
    kv_block_range_py,
    q_block_range_py,
    window_kv_range_py,
    window_q_range_py,
)
from course_lib.attention.op import flash_attention_op
from course_lib.attention.reference import attention as reference_attention
from course_lib.attention.reference import causal_mask
from course_lib.testing import assert_close_to_reference, gqa_qkv, reference_outputs

DEVICE = course_lib.DEVICE
ON_GPU = course_lib.ON_GPU
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


_qkv = gqa_qkv


def _check(q, k, v, causal, window, what, dq_mode=None):
    """Forward + backward against the float64 reference (bound set by plain PyTorch in the inputs' dtype).
    dq_mode: None through `flash_attention`; else the module functions with that backward."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    if dq_mode is None:
        o = flash_attention(q, k, v, causal=causal, window=window)
        do = torch.randn_like(o)
        o.backward(do)
        grads = (q.grad, k.grad, v.grad)
    else:
        o, lse = attention_forward(q, k, v, causal, window=window)
        do = torch.randn_like(o)
        grads = attention_backward(do, q, k, v, o, lse, causal, dq_mode=dq_mode, window=window)
    ref_o, ref_g = reference_outputs(
        *(t.detach().cpu().double() for t in (q, k, v)), causal, None, do.cpu().double(), window
    )
    base_o, base_g = reference_outputs(q, k, v, causal, None, do, window)
    assert torch.isfinite(o).all(), f"O has NaN/inf, {what}"
    assert_close_to_reference(o, ref_o, base_o, what=f"O, {what}")
    for name, g, t, r, b in zip(("dq", "dk", "dv"), grads, (q, k, v), ref_g, base_g):
        assert g.shape == t.shape, f"{name}, {what}: gradient shape {g.shape}"
        assert_close_to_reference(g, r, b, what=f"{name}, {what}")


# (query heads per K/V head, Nq, Nk, causal, window): the interpreter's blocks are 32 x 32, so windows of
# 1, 5 and 17 keys stay inside a block, 40 and 70 cross block edges, 500 is longer than any sequence here.
CASES = [
    (1, 45, 45, True, 1),
    (1, 70, 70, True, 17),
    (2, 81, 81, True, 40),
    (4, 37, 90, "bottom_right", 5),
    (4, 90, 37, "bottom_right", 40),
    (2, 1, 70, "bottom_right", 17),  # one decoding step against a cache of 70
    (8, 64, 64, True, 500),
    (1, 50, 99, True, 70),  # top-left with Nq < Nk
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group,n_q,n_k,causal,window", CASES)
def test_window_matches_reference(group, n_q, n_k, causal, window, dtype):
    hkv = 2 if group <= 4 else 1
    q, k, v = _qkv(1, hkv * group, hkv, n_q, n_k, 32, dtype, seed=group * 100 + n_q + window)
    _check(
        q,
        k,
        v,
        causal,
        window,
        f"window {window}, GQA {group}:1, Nq={n_q}, Nk={n_k}, causal={causal}, {dtype}",
    )


@pytest.mark.parametrize("dq_mode", ["two_kernel", "atomic"])
@pytest.mark.parametrize("on_chip", [1, 2, 4])
def test_window_backward_variants(dq_mode, on_chip, monkeypatch):
    """Both dQ modes, and each way of summing a group of 4 query heads into dK, dV (on chip, in pairs,
    one head per program with fp32 partials), with a window crossing block edges."""
    import importlib

    bwd = importlib.import_module("course_lib.attention.backward")
    monkeypatch.setattr(bwd, "dkdv_heads_per_program", lambda group, causal, n_k, d: on_chip)
    q, k, v = _qkv(2, 8, 2, 70, 70, 32, torch.float32, seed=13)
    _check(q, k, v, True, 40, f"window 40, {dq_mode}, {on_chip} heads per program", dq_mode=dq_mode)


def test_window_is_a_mask_on_full_attention():
    """A window at least as long as the keys changes nothing; a window of 1 is each query's own key
    (O = v of the same position, top-left); rows outside every window get O = 0 and L = -inf."""
    q, k, v = _qkv(1, 2, 2, 40, 40, 16, torch.float32, seed=4)
    torch.testing.assert_close(flash_attention(q, k, v, True, window=40), flash_attention(q, k, v, True))
    torch.testing.assert_close(flash_attention(q, k, v, True, window=1), v, rtol=1e-5, atol=1e-5)
    # bottom-right with Nq > Nk: the first Nq - Nk rows see no key, with or without a window
    q, k, v = _qkv(1, 2, 1, 50, 20, 16, torch.float32, seed=5)
    o, lse = attention_forward(q, k, v, "bottom_right", window=8)
    empty = ~causal_mask(50, 20, alignment="bottom_right", window=8).any(-1)
    assert int(empty.sum()) == 30
    assert torch.equal(o[:, :, empty.to(o.device)], torch.zeros_like(o[:, :, empty.to(o.device)]))
    assert torch.isneginf(lse[:, :, empty.to(lse.device)]).all()
    ref_o, ref_l = reference_attention(*(t.double() for t in (q, k, v)), "bottom_right", None, True, 8)
    torch.testing.assert_close(o.double(), ref_o, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse.double(), ref_l, rtol=1e-4, atol=1e-4)


def test_a_huge_window_is_no_window():
    """A window far longer than the sequences ("no limit", up to 2^31 - 1) gives causal attention, forward
    and backward: the kernels receive it capped at Nq + Nk, so their 32-bit index arithmetic cannot wrap."""
    q, k, v = _qkv(1, 4, 2, 40, 70, 16, torch.float32, seed=8)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    do = torch.randn_like(q)
    o = flash_attention(q, k, v, "bottom_right")
    grads = torch.autograd.grad(o, (q, k, v), do)
    for window in (2**31 - 1, 2**40):
        o_w = flash_attention(q, k, v, "bottom_right", window=window)
        torch.testing.assert_close(o_w, o)
        for a, b in zip(torch.autograd.grad(o_w, (q, k, v), do), grads):
            torch.testing.assert_close(a, b)


def test_reference_window_mask():
    """The reference's mask, written out: query i sees keys i - W < j <= i (top-left)."""
    mask = causal_mask(6, 6, window=3)
    want = torch.tensor([[abs(i - j) < 3 and j <= i for j in range(6)] for i in range(6)])
    assert torch.equal(mask, want)
    # bottom-right, Nq = 2 < Nk = 6: rows are positions 4 and 5
    assert torch.equal(
        causal_mask(2, 6, alignment="bottom_right", window=2),
        want.new_tensor([[False, False, False, True, True, False], [False, False, False, False, True, True]]),
    )


def _visible(n_q, n_k, offset, window):
    i = torch.arange(n_q)[:, None]
    j = torch.arange(n_k)[None, :]
    return (j <= i + offset) & (j > i + offset - window)


def test_window_block_ranges_cover_exactly_the_visible_pairs():
    """The Python twins of the window's block ranges, brute-forced as the causal ones are: the three stages
    of a query block visit every visible key exactly once and no block that none of its rows sees, and
    their unmasked stage holds only whole blocks that every row sees entirely; the same for a key block's
    query rows (the dK/dV kernel)."""
    for n_q, n_k, bm, bn, offset, window in itertools.product(
        (1, 31, 64, 97), (1, 33, 64, 130), (16, 32), (16, 64), (-40, 0, 5, 70), (1, 7, 16, 50, 300)
    ):
        vis = _visible(n_q, n_k, offset, window)
        seen = torch.zeros(n_q, n_k, dtype=torch.int64)
        for m0 in range(0, n_q, bm):
            rows = slice(m0, min(m0 + bm, n_q))
            lo, mid, hi = kv_block_range_py(m0, n_q, n_k, offset, bm, bn, True)
            w_lo, w_full, w_mid = window_kv_range_py(m0, n_q, offset, window, lo, mid, hi, bm, bn)
            where = (n_q, n_k, bm, bn, offset, window, m0, (w_lo, w_full, w_mid, hi))
            assert lo <= w_lo <= w_full <= w_mid <= hi, where
            assert w_lo % bn == 0 and w_full % bn == 0 or w_full == hi, where
            for j0 in range(w_lo, hi, bn):
                seen[rows, j0 : min(j0 + bn, hi)] += 1
                # a block no row sees is visited only when the rows see no key at all (Nk below the window)
                assert vis[rows, j0 : min(j0 + bn, n_k)].any() or not vis[rows].any(), where
                if w_full <= j0 < w_mid:  # unmasked: whole block, all of it visible to every row
                    assert j0 + bn <= n_k and vis[rows, j0 : j0 + bn].all(), where
        assert torch.equal(seen[vis], torch.ones_like(seen[vis])), (n_q, n_k, bm, bn, offset, window)
        for n0 in range(0, n_k, bn):
            lo, mid, hi = q_block_range_py(n0, n_q, offset, bm, bn, True)
            w_mid, w_full, w_hi = window_q_range_py(n0, offset, window, lo, mid, hi, bm, bn)
            where = (n_q, n_k, bm, bn, offset, window, n0, (lo, w_mid, w_full, w_hi))
            assert lo <= w_mid <= w_full <= w_hi <= hi and w_full % bm == 0 and w_hi % bm == 0, where
            keys = slice(n0, min(n0 + bn, n_k))
            assert not vis[:lo, keys].any() and not vis[w_hi:, keys].any(), where
            assert vis[w_mid:w_full, keys].all(), where  # unmasked rows see every key of the block


def test_window_through_the_custom_operator():
    """The operator takes the window (its schema: an int, 0 for none) and its gradient matches the
    autograd Function's; under torch.compile the window stays an argument of the one node."""
    q, k, v = _qkv(1, 4, 2, 40, 40, 16, torch.float32, seed=6)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    o = flash_attention_op(q, k, v, True, window=9)
    o2 = flash_attention(q, k, v, True, window=9)
    torch.testing.assert_close(o, o2)
    g = torch.autograd.grad(o.sum(), (q, k, v))
    g2 = torch.autograd.grad(o2.sum(), (q, k, v))
    for a, b in zip(g, g2):
        torch.testing.assert_close(a, b)
    compiled = torch.compile(
        lambda q, k, v: flash_attention(q, k, v, "bottom_right", window=9), fullgraph=True
    )
    torch.testing.assert_close(compiled(q, k, v), o2)


@pytest.mark.parametrize(
    "causal,window,error,match",
    [
        (False, 8, ValueError, "needs causal"),
        (True, 0, ValueError, "window must be >= 1"),
        (True, -3, ValueError, "window must be >= 1"),
        (True, 2.5, TypeError, "window must be an integer"),
        (True, True, TypeError, "window must be an integer"),
    ],
)
def test_bad_windows_are_named(causal, window, error, match):
    q, k, v = _qkv(1, 2, 2, 8, 8, 16, torch.float32, seed=1)
    with pytest.raises(error, match=match):
        flash_attention(q, k, v, causal, window=window)
    with pytest.raises(error, match=match):
        flash_attention_op(q, k, v, causal, window=window)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "group,n_q,n_k,causal,d,window,dtype",
    [
        (4, 4096, 4096, True, 128, 1024, torch.bfloat16),
        (1, 2048, 2048, True, 64, 100, torch.float16),
        (8, 1000, 3000, "bottom_right", 128, 777, torch.bfloat16),
        (2, 3000, 1000, "bottom_right", 64, 256, torch.bfloat16),
        (4, 1, 4096, "bottom_right", 128, 2048, torch.bfloat16),
        (1, 1500, 1500, True, 96, 33, torch.float32),
    ],
)
def test_gpu_window(group, n_q, n_k, causal, d, window, dtype):
    q, k, v = _qkv(2, 4 * group, 4, n_q, n_k, d, dtype, seed=17)
    _check(
        q, k, v, causal, window, f"GPU window {window}, GQA {group}:1, Nq={n_q}, Nk={n_k}, {causal}, d={d}"
    )
