"""The public Triton FlashAttention-2: `flash_attention(q, k, v, causal, scale)` and the autograd
Function `FlashAttentionTriton` (notebooks 06 and 07).

The forward kernel (`forward.py`) returns O and the logsumexp L; the Function saves Q, K, V, O and L
(all O(N) per (batch, head): nothing of size Nq x Nk) and the backward kernels (`backward.py`)
rebuild P from L. Inputs: (..., N, d) with any leading dims — (batch, N, d) as in homework, or
(batch, heads, N, d) as for `torch.nn.functional.scaled_dot_product_attention` — and any strides.
"""

from __future__ import annotations

import torch

from ..checks import default_scale
from .backward import _backward
from .forward import _forward, check_inputs


class FlashAttentionTriton(torch.autograd.Function):
    """Differentiable FlashAttention-2 with Triton kernels.

    `FlashAttentionTriton.apply(q, k, v, is_causal)` (optionally a fifth argument, the softmax scale;
    default 1/sqrt(d)). q: (..., Nq, d), k and v: (..., Nk, d), float16, bfloat16 or float32
    (float64 under the interpreter only). Returns O (..., Nq, d). The forward saves Q, K, V, O and
    L = logsumexp (shape q.shape[:-1]); the backward returns dq, dk, dv and None for is_causal
    (and for scale)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, scale=None):
        check_inputs(q, k, v, where="FlashAttentionTriton")
        scale = default_scale(q.shape[-1], scale)
        o, lse = _forward(q, k, v, bool(is_causal), scale, None, _FAST)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = bool(is_causal)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _backward(do, q, k, v, o, lse, ctx.is_causal, ctx.scale, None, _FAST, "two_kernel")
        return dq, dk, dv, None, None


_FAST = {"EXP2": True, "SKIP_MASKED": True, "TMA": False, "HOPPER": True}


def flash_attention(q, k, v, causal: bool = False, scale: float | None = None):
    """O = softmax(Q K^T * scale [+ causal mask]) V with the Triton FlashAttention-2 kernels.

    q: (..., Nq, d), k and v: (..., Nk, d) — same leading dims, dtype and device; any strides (no copy
    is made when the leading dims can be viewed as (batch, heads)); float16, bfloat16 or float32
    (float64 under the interpreter, for gradcheck). d: a multiple of 8 from 16 to 256.
    causal: query i sees keys j <= i (top-left aligned, as SDPA's is_causal=True; Nq != Nk allowed).
    scale: default 1/sqrt(d). Returns O with q's shape and dtype; differentiable in q, k and v.
    Runs compiled on a GPU, through the Triton interpreter on the CPU (`course_lib.runtime`)."""
    return FlashAttentionTriton.apply(q, k, v, causal, scale)
