"""FlashAttention-2 in pure PyTorch: tiled forward and backward, online softmax, no N x N matrix kept.

Taught in notebook 04. The loops are the kernel's loops written in Python: each iteration works on one
tile, a BLOCK_M x BLOCK_N piece of the score matrix, which on a GPU would live in on-chip SRAM and
registers. Only Q, K, V, O, dO (N x d) and the logsumexp L (N) live in "HBM" (here: ordinary tensors);
S and P exist one tile at a time. It runs on any device (the device of its inputs); it is slow, because
every tile costs a few PyTorch calls, but it is exact and it is the algorithm the Triton kernels of
notebooks 06 and 07 implement.

    O = FlashAttentionTorch.apply(q, k, v, is_causal)     # q (..., Nq, d), k and v (..., Nk, d)

Causal: query i sees keys j <= i (top-left aligned, like `course_lib.attention.reference.attention`).
Scale: 1/sqrt(d) unless given. Accumulators (m, l, O, dQ, dK, dV) are float32, or float64 for
float64 inputs; O, dQ, dK, dV are returned in the inputs' dtype, L in the accumulator dtype.
"""

from __future__ import annotations

import math

import torch

from ..checks import accumulator_dtype, check_attention_inputs, default_scale
from ..second_derivative import refuse_second_derivative
from .reference import causal_mask_tile

BLOCK_M = 64  # rows of Q per tile (the paper's B_r)
BLOCK_N = 64  # rows of K and V per tile (the paper's B_c)


def _check_options(causal, block_m, block_n, where: str) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"{where}: is_causal must be a bool, got {type(causal).__name__} {causal!r}")
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"{where}: {name} must be a positive integer, got {b!r}")


def flash_forward(
    q, k, v, causal: bool = False, scale: float | None = None, block_m: int = BLOCK_M, block_n: int = BLOCK_N
):
    """Tiled attention forward, FlashAttention-2 loop order. Returns (O, L).

    q: (..., Nq, d), k and v: (..., Nk, d), one floating dtype, one device, any strides.
    O: (..., Nq, d) in q's dtype. L = m + log(l): (..., Nq), the logsumexp of each row of scaled (and
    masked) scores, float32 (float64 for float64 inputs): all the backward needs to rebuild P."""
    check_attention_inputs(q, k, v, where="flash_forward")
    _check_options(causal, block_m, block_n, "flash_forward")
    scale = default_scale(q.shape[-1], scale)
    acc = accumulator_dtype(q.dtype)
    n_q, n_k = q.shape[-2], k.shape[-2]
    lead = q.shape[:-2]
    O = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # HBM, written once per row block
    L = torch.empty(q.shape[:-1], dtype=acc, device=q.device)  # HBM, written once per row block

    # Outer loop over Q row blocks: each one is independent (on a GPU: one program per block).
    for i0 in range(0, n_q, block_m):
        i1 = min(i0 + block_m, n_q)
        Qi = q[..., i0:i1, :].to(acc)  # HBM -> SRAM: BLOCK_M x d, read once
        m = torch.full((*lead, i1 - i0), -math.inf, dtype=acc, device=q.device)  # registers
        l = torch.zeros((*lead, i1 - i0), dtype=acc, device=q.device)  # registers
        Oi = torch.zeros((*lead, i1 - i0, v.shape[-1]), dtype=acc, device=q.device)  # registers, unnormalised
        # Causal: key blocks that start after the block's last query (j0 > i1 - 1) are skipped.
        n_k_visible = min(n_k, i1) if causal else n_k
        for j0 in range(0, n_k_visible, block_n):
            j1 = min(j0 + block_n, n_k)
            Kj = k[..., j0:j1, :].to(acc)  # HBM -> SRAM: BLOCK_N x d
            Vj = v[..., j0:j1, :].to(acc)  # HBM -> SRAM: BLOCK_N x d
            S = (Qi @ Kj.transpose(-1, -2)) * scale  # BLOCK_M x BLOCK_N tile, on chip only
            if causal and j1 - 1 > i0:  # only tiles crossing the diagonal need a mask
                S = S.masked_fill(~causal_mask_tile(i0, i1, j0, j1, q.device), -math.inf)
            m_new = torch.maximum(m, S.amax(dim=-1))  # finite: every row sees key 0 in block 0
            P = torch.exp(S - m_new[..., None])  # unnormalised probabilities of this tile
            alpha = torch.exp(m - m_new)  # rescales what was summed under the old maximum
            l = alpha * l + P.sum(dim=-1)
            Oi = alpha[..., None] * Oi + P @ Vj
            m = m_new
        O[..., i0:i1, :] = (Oi / l[..., None]).to(q.dtype)  # normalise once, SRAM -> HBM
        L[..., i0:i1] = m + torch.log(l)
    return O, L


def flash_backward(
    dO,
    q,
    k,
    v,
    O,
    L,
    causal: bool = False,
    scale: float | None = None,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
):
    """Tiled attention backward by recomputation. Returns (dQ, dK, dV) in q's dtype.

    dO, q, O: (..., Nq, d); k, v: (..., Nk, d); L: (..., Nq) from `flash_forward`. P is rebuilt tile by
    tile as exp(S - L), never stored. With D = rowsum(dO * O):
        dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D),  dQ = dS K * scale,  dK = dS^T Q * scale.
    Loop order as in FlashAttention-2's backward: outer over K/V blocks (dK_j, dV_j stay on chip),
    inner over Q blocks; dQ is accumulated in HBM (a GPU kernel uses atomics or a second pass)."""
    check_attention_inputs(q, k, v, where="flash_backward")
    _check_options(causal, block_m, block_n, "flash_backward")
    scale = default_scale(q.shape[-1], scale)
    acc = accumulator_dtype(q.dtype)
    n_q, n_k = q.shape[-2], k.shape[-2]
    D = (dO.to(acc) * O.to(acc)).sum(dim=-1)  # (..., Nq): one cheap pass over dO and O
    L = L.to(acc)
    dQ = torch.zeros(q.shape, dtype=acc, device=q.device)  # HBM accumulator
    dK = torch.empty(k.shape, dtype=q.dtype, device=q.device)
    dV = torch.empty(v.shape, dtype=q.dtype, device=q.device)

    for j0 in range(0, n_k, block_n):
        j1 = min(j0 + block_n, n_k)
        Kj = k[..., j0:j1, :].to(acc)  # HBM -> SRAM, read once
        Vj = v[..., j0:j1, :].to(acc)
        dKj = torch.zeros(Kj.shape, dtype=acc, device=q.device)  # on chip for the whole inner loop
        dVj = torch.zeros(Vj.shape, dtype=acc, device=q.device)
        # Causal: query blocks that end before key j0 (i1 - 1 < j0) see none of these keys: skipped.
        first_i0 = (j0 // block_m) * block_m if causal else 0
        for i0 in range(first_i0, n_q, block_m):
            i1 = min(i0 + block_m, n_q)
            Qi = q[..., i0:i1, :].to(acc)  # HBM -> SRAM
            dOi = dO[..., i0:i1, :].to(acc)
            S = (Qi @ Kj.transpose(-1, -2)) * scale  # recomputed tile
            if causal and j1 - 1 > i0:
                S = S.masked_fill(~causal_mask_tile(i0, i1, j0, j1, q.device), -math.inf)
            P = torch.exp(S - L[..., i0:i1, None])  # exact probabilities: L holds each row's log-normaliser
            dVj += P.transpose(-1, -2) @ dOi
            dP = dOi @ Vj.transpose(-1, -2)
            dS = P * (dP - D[..., i0:i1, None])
            dQ[..., i0:i1, :] += (dS @ Kj) * scale  # read-modify-write in HBM
            dKj += (dS.transpose(-1, -2) @ Qi) * scale
        dK[..., j0:j1, :] = dKj.to(q.dtype)  # SRAM -> HBM once
        dV[..., j0:j1, :] = dVj.to(q.dtype)
    return dQ.to(q.dtype), dK, dV


class FlashAttentionTorch(torch.autograd.Function):
    """Differentiable tiled attention in pure PyTorch (FlashAttention-2's algorithm).

        O = FlashAttentionTorch.apply(q, k, v, is_causal)

    q: (..., Nq, d), k and v: (..., Nk, d), e.g. (batch, N, d) or (batch, heads, N, d); float16,
    bfloat16, float32 or float64, CPU or GPU. Saves q, k, v, O and L (shape q.shape[:-1]) for the
    backward, never an Nq x Nk tensor. Optional trailing arguments: scale (default 1/sqrt(d)),
    block_m, block_n. Backward returns dq, dk, dv and None for is_causal and each option (autograd
    drops the Nones beyond the arguments actually passed)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, scale=None, block_m=BLOCK_M, block_n=BLOCK_N):
        check_attention_inputs(q, k, v, where="FlashAttentionTorch")
        _check_options(is_causal, block_m, block_n, "FlashAttentionTorch")
        scale = default_scale(q.shape[-1], scale)
        O, L = flash_forward(q, k, v, is_causal, scale, block_m, block_n)
        ctx.save_for_backward(q, k, v, O, L)
        ctx.options = (is_causal, scale, block_m, block_n)
        return O

    @staticmethod
    def backward(ctx, dO):
        q, k, v, O, L = ctx.saved_tensors
        with torch.no_grad():  # O and L were saved without a graph: no second derivative from here
            dq, dk, dv = flash_backward(dO, q, k, v, O, L, *ctx.options)
        dq, dk, dv = refuse_second_derivative(
            (dq, dk, dv), (dO, q, k, v), "FlashAttentionTorch", "course_lib.attention.reference.attention"
        )
        return dq, dk, dv, None, None, None, None


def flash_attention_torch(
    q, k, v, causal: bool = False, scale: float | None = None, block_m: int = BLOCK_M, block_n: int = BLOCK_N
):
    """O = softmax(Q K^T * scale [causal]) V by tiled attention in pure PyTorch; differentiable.

    Same shapes, dtypes and conventions as `FlashAttentionTorch.apply` (which it calls)."""
    return FlashAttentionTorch.apply(q, k, v, causal, scale, block_m, block_n)
