"""Attention sinks (`flash_attention(..., sinks=s)`): one learned logit per query head that joins every
row's softmax as a key with a zero value (gpt-oss), forward and backward, dsinks included.

Against the float64 reference (which appends the sink as one more column of S), with and without a causal
mask and a sliding window, grouped-query attention, 3-D and 4-D inputs; the custom operator; bad sinks.
CPU through the interpreter at tiny sizes, GPU at real ones (`@pytest.mark.gpu`).
"""

from __future__ import annotations

import pytest
import torch

import course_lib
from course_lib import flash_attention
from course_lib.attention import attention_backward, attention_forward
from course_lib.attention.op import flash_attention_op
from course_lib.attention.reference import attention as reference_attention
from course_lib.testing import FLOOR, assert_close_to_reference, gqa_qkv

DEVICE = course_lib.DEVICE
ON_GPU = course_lib.ON_GPU
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(b, hq, hkv, n_q, n_k, d, dtype, seed):
    q, k, v = gqa_qkv(b, hq, hkv, n_q, n_k, d, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    sinks = (2 * torch.randn(hq, generator=g)).to(DEVICE)  # logits of the order of the scores'
    return q, k, v, sinks


def _reference(q, k, v, sinks, causal, window, do):
    """O and (dq, dk, dv, dsinks) of the reference on detached copies of the inputs, in their dtype."""
    q, k, v, sinks = (t.detach().clone().requires_grad_(True) for t in (q, k, v, sinks))
    o = reference_attention(q, k, v, causal, window=window, sinks=sinks)
    return o.detach(), torch.autograd.grad(o, (q, k, v, sinks), do.to(o.dtype))


def _check(q, k, v, sinks, causal, window, what):
    q, k, v, sinks = (t.detach().requires_grad_(True) for t in (q, k, v, sinks))
    o = flash_attention(q, k, v, causal, window=window, sinks=sinks)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v, sinks), do)
    ref_o, ref_g = _reference(
        *(t.detach().cpu().double() for t in (q, k, v, sinks)), causal, window, do.cpu().double()
    )
    base_o, base_g = _reference(q, k, v, sinks, causal, window, do)  # float32 sinks, as the kernels take them
    assert torch.isfinite(o).all(), f"O has NaN/inf, {what}"
    assert_close_to_reference(o, ref_o, base_o, what=f"O, {what}")
    for name, g, t, r, b in zip(("dq", "dk", "dv", "dsinks"), grads, (q, k, v, sinks), ref_g, base_g):
        assert g.shape == t.shape and g.dtype == t.dtype, f"{name}, {what}: {g.shape} {g.dtype}"
        # dsinks (float32) sums a term per row computed from the inputs' dtype (D from O and dO): its floor
        # is that dtype's, relative to its size
        floor = FLOOR[q.dtype] * max(1.0, float(r.abs().max())) if name == "dsinks" else None
        assert_close_to_reference(g, r, b, what=f"{name}, {what}", floor=floor)


CASES = [  # (query heads per K/V head, Nq, Nk, causal, window)
    (1, 45, 45, True, None),
    (2, 37, 70, "bottom_right", None),
    (4, 70, 37, "bottom_right", 17),  # rows that see no key: the sink takes all their weight, O = 0
    (2, 33, 33, False, None),
    (1, 64, 64, True, 40),  # gpt-oss's layers: a sliding window with sinks
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group,n_q,n_k,causal,window", CASES)
def test_sinks_match_reference(group, n_q, n_k, causal, window, dtype):
    q, k, v, sinks = _inputs(1, 2 * group, 2, n_q, n_k, 32, dtype, seed=group * 10 + n_q)
    _check(
        q,
        k,
        v,
        sinks,
        causal,
        window,
        f"sinks, GQA {group}:1, Nq={n_q}, Nk={n_k}, {causal}, window {window}, {dtype}",
    )


def test_sinks_change_the_result_and_minus_infinity_is_none():
    """A sink takes weight from every key (so the result differs from no sink by more than the tolerance
    the checks above use); a sink of -inf is no sink, bit for bit; L includes the sink."""
    q, k, v, sinks = _inputs(2, 4, 2, 40, 40, 16, torch.float32, seed=3)
    plain = flash_attention(q, k, v, True)
    assert (flash_attention(q, k, v, True, sinks=sinks) - plain).abs().max() > 1e-2
    assert torch.equal(flash_attention(q, k, v, True, sinks=torch.full_like(sinks, float("-inf"))), plain)
    _, lse = attention_forward(q, k, v, True, sinks=sinks)
    _, ref_l = reference_attention(*(t.double() for t in (q, k, v)), True, None, True, sinks=sinks.double())
    torch.testing.assert_close(lse.double(), ref_l, rtol=1e-4, atol=1e-4)


def test_sinks_three_dims_and_the_module_functions():
    """(batch, N, d) inputs take one sink; `attention_backward` with sinks returns dsinks too (both dQ modes)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 30, 16, generator=g).to(DEVICE).double() for _ in range(3))
    if ON_GPU:
        q, k, v = q.float(), k.float(), v.float()
    sinks = torch.tensor([0.7], device=DEVICE, dtype=q.dtype)
    o, lse = attention_forward(q, k, v, True, sinks=sinks)
    do = torch.randn_like(o)
    ref_o, ref_g = _reference(q.double(), k.double(), v.double(), sinks.double(), True, None, do.double())
    torch.testing.assert_close(o.double(), ref_o, rtol=1e-4, atol=1e-4)
    for mode in ("two_kernel", "atomic"):
        grads = attention_backward(do, q, k, v, o, lse, True, dq_mode=mode, sinks=sinks)
        assert len(grads) == 4
        for g_, r in zip(grads, ref_g):
            torch.testing.assert_close(g_.double(), r, rtol=1e-4, atol=1e-4)


def test_sinks_through_the_custom_operator():
    q, k, v, sinks = _inputs(1, 4, 2, 40, 40, 16, torch.float32, seed=6)
    q, k, v, sinks = (t.requires_grad_(True) for t in (q, k, v, sinks))
    o = flash_attention_op(q, k, v, True, window=9, sinks=sinks)
    o2 = flash_attention(q, k, v, True, window=9, sinks=sinks)
    torch.testing.assert_close(o, o2)
    for a, b in zip(
        torch.autograd.grad(o.sum(), (q, k, v, sinks)), torch.autograd.grad(o2.sum(), (q, k, v, sinks))
    ):
        torch.testing.assert_close(a, b)
    compiled = torch.compile(lambda q, k, v, s: flash_attention(q, k, v, True, sinks=s), fullgraph=True)
    out = compiled(q, k, v, sinks)
    torch.testing.assert_close(out, flash_attention(q, k, v, True, sinks=sinks))
    (ds,) = torch.autograd.grad(out.sum(), (sinks,))
    (ds2,) = torch.autograd.grad(flash_attention(q, k, v, True, sinks=sinks).sum(), (sinks,))
    torch.testing.assert_close(ds, ds2)


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda q: torch.zeros(3, device=q.device), ValueError, r"sinks must have shape \(4,\)"),
        (lambda q: torch.zeros(1, 4, device=q.device), ValueError, r"sinks must have shape \(4,\)"),
        (lambda q: torch.zeros(4, dtype=torch.int64, device=q.device), TypeError, "floating-point"),
        (lambda q: [0.0] * 4, TypeError, "sinks must be a tensor"),
    ],
)
def test_bad_sinks_are_named(make, error, match):
    q, k, v, _ = _inputs(1, 4, 2, 8, 8, 16, torch.float32, seed=1)
    with pytest.raises(error, match=match):
        flash_attention(q, k, v, True, sinks=make(q))
    with pytest.raises(error, match=match):
        flash_attention_op(q, k, v, True, sinks=make(q))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "group,n_q,n_k,causal,d,window,dtype",
    [
        (8, 2048, 2048, True, 64, 128, torch.bfloat16),  # gpt-oss's sliding layers: window 128, d = 64
        (8, 2048, 2048, True, 64, None, torch.bfloat16),
        (4, 1000, 3000, "bottom_right", 128, None, torch.float16),
        (1, 1500, 1500, False, 128, None, torch.float32),
    ],
)
def test_gpu_sinks(group, n_q, n_k, causal, d, window, dtype):
    q, k, v, sinks = _inputs(2, 4 * group, 4, n_q, n_k, d, dtype, seed=17)
    _check(q, k, v, sinks, causal, window, f"GPU sinks, GQA {group}:1, Nq={n_q}, Nk={n_k}, {causal}, d={d}")
