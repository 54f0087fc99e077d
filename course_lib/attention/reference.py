"""Standard attention in plain PyTorch: the reference every kernel in the course is tested against.

Taught in notebook 02 (and used from notebook 00 on). It materialises the full Nq x Nk matrices
S = Q K^T * scale and P = softmax(S) — exactly what FlashAttention avoids — so it costs
O(Nq * Nk) memory per (batch, head). Run it in float64 to get a reference that is exact enough to
judge fp32/fp16/bf16 kernels by.
"""

from __future__ import annotations

import torch

from ..checks import accumulator_dtype, check_attention_inputs, default_scale


def causal_mask(n_queries: int, n_keys: int, device=None) -> torch.Tensor:
    """Boolean (Nq, Nk) mask, True where query i may attend to key j, i.e. j <= i.

    Query i is aligned with key i (top-left), as in `scaled_dot_product_attention(is_causal=True)`;
    every row keeps at least key 0, so no row is fully masked."""
    return causal_mask_tile(0, n_queries, 0, n_keys, device)


def causal_mask_tile(i0: int, i1: int, j0: int, j1: int, device=None) -> torch.Tensor:
    """The (i1 - i0, j1 - j0) tile of `causal_mask` for query rows [i0, i1) and keys [j0, j1)
    (notebook 04: only tiles that cross the diagonal need it)."""
    i = torch.arange(i0, i1, device=device)[:, None]
    j = torch.arange(j0, j1, device=device)[None, :]
    return j <= i


def attention(q, k, v, causal: bool = False, scale: float | None = None, return_lse: bool = False):
    """O = softmax(Q K^T * scale [+ causal mask]) V, computed the standard (memory-hungry) way.

    q: (..., Nq, d), k: (..., Nk, d), v: (..., Nk, d_v), any floating dtype (float64 included), any
    device, any strides. Returns O (..., Nq, d_v) in the input dtype; with `return_lse=True` also
    L = logsumexp of the scaled, masked scores, (..., Nq), float32 for half inputs, else the input
    dtype. Softmax and the logsumexp are computed in at least float32."""
    check_attention_inputs(q, k, v, where="reference.attention", same_head_dim_v=False)
    scale = default_scale(q.shape[-1], scale)
    acc_dtype = accumulator_dtype(q.dtype)
    S = torch.matmul(q, k.transpose(-2, -1)).to(acc_dtype) * scale  # (..., Nq, Nk)
    if causal:
        S = S.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    L = torch.logsumexp(S, dim=-1)  # (..., Nq)
    P = torch.exp(S - L[..., None])
    O = torch.matmul(P.to(v.dtype), v)
    if return_lse:
        return O, L
    return O
