"""Attention on one (query rows, key rows) block of a ring step, returning (O, L) and its backward
(notebook 13).

Ring attention splits one attention into blocks: the queries a rank holds against the keys it has in
hand. Each block gives a partial result (O, L) over its keys, merged across steps with the logsumexp
rule (`course_lib.attention.merge`). Two ways to compute a block:

- backend "triton": course_lib's FlashAttention-2 kernels (`attention_forward`, `attention_backward`,
  grouped-query attention without repeating K/V), compiled on a GPU, through Triton's interpreter on
  the CPU (exact, but slow there);
- backend "torch": the same maths in plain PyTorch, S = Q K^T materialised per block (fine for the
  small CPU runs of the notebook and the tests; any dtype including float64).
"auto" takes "triton" for CUDA tensors and "torch" for CPU tensors.

Shapes: q, do, o (B, H, Nq, d); k, v (B, Hkv, Nk, d) with H a multiple of Hkv (GQA: query head h reads
key/value head h // (H / Hkv)); L (B, H, Nq), float32 (float64 for float64 inputs), natural log.
causal: top-left (query i sees keys j <= i): the only causal shape a ring block needs.
"""

from __future__ import annotations

import torch

from ..checks import accumulator_dtype

BACKENDS = ("auto", "torch", "triton")


def resolve_backend(backend: str, device: torch.device) -> str:
    """ "torch" or "triton" for `backend` on `device` ("auto": triton on CUDA, torch elsewhere)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def _grouped(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, int]:
    """q (B, H, N, d) viewed as (B, Hkv, G, N, d), G = H / Hkv query heads per key/value head."""
    B, H, N, d = q.shape
    g = H // k.shape[1]
    return q.reshape(B, k.shape[1], g, N, d), g


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    """S = Q K^T * scale per (B, Hkv, G) in the accumulator dtype, -inf above the diagonal if causal."""
    acc = accumulator_dtype(q.dtype)
    qg, _ = _grouped(q, k)
    S = torch.matmul(qg.to(acc), k.to(acc).unsqueeze(2).transpose(-1, -2)) * scale  # (B, Hkv, G, Nq, Nk)
    if causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
        S = S.masked_fill(~keep, float("-inf"))
    return S


def torch_block_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L) of one block in plain PyTorch: O (B, H, Nq, d) in q's dtype, L (B, H, Nq) float32/64."""
    S = _scores(q, k, causal, scale)
    L = torch.logsumexp(S, dim=-1)  # every row of a ring block sees at least one key: finite
    P = torch.exp(S - L.unsqueeze(-1))
    O = torch.matmul(P, v.to(P.dtype).unsqueeze(2))  # (B, Hkv, G, Nq, d)
    return O.reshape(q.shape).to(q.dtype), L.reshape(q.shape[:-1])


def torch_block_backward(do, q, k, v, o, lse, causal: bool, scale: float):
    """(dQ, dK, dV) of one block from the final O and L of the whole sequence (not the block's own).

    P = exp(S - L) with the merged L is this block's share of the full softmax; D = rowsum(dO * O)
    uses the merged O. Then dV = P^T dO, dS = P * (dO V^T - D), dQ = dS K scale, dK = dS^T Q scale,
    summed over the G query heads that share a key/value head."""
    acc = accumulator_dtype(q.dtype)
    S = _scores(q, k, causal, scale)
    qg, g = _grouped(q, k)
    dog, _ = _grouped(do.to(acc), k)
    og, _ = _grouped(o.to(acc), k)
    P = torch.exp(S - lse.to(acc).reshape(S.shape[:-1]).unsqueeze(-1))
    D = (dog * og).sum(-1, keepdim=True)  # (B, Hkv, G, Nq, 1)
    dS = P * (torch.matmul(dog, v.to(acc).unsqueeze(2).transpose(-1, -2)) - D)
    dq = torch.matmul(dS, k.to(acc).unsqueeze(2)) * scale
    dk = (torch.matmul(dS.transpose(-1, -2), qg.to(acc)) * scale).sum(2)
    dv = torch.matmul(P.transpose(-1, -2), dog).sum(2)
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def block_forward(q, k, v, causal: bool, scale: float, backend: str):
    """(O, L) of attention of q against the keys k, v (shapes in the module docstring).

    backend: "torch" or "triton" (see `resolve_backend`). Taught in notebook 13."""
    if backend == "torch":
        return torch_block_forward(q, k, v, causal, scale)
    from ..attention import attention_forward

    # Contiguous blocks: the Hopper forward takes only those, and the copy is O(N d) against O(N^2 d) work.
    return attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), causal, scale)


def block_backward(do, q, k, v, o, lse, causal: bool, scale: float, backend: str):
    """(dQ, dK, dV) of one block, given the merged O and L of the whole sequence. Notebook 13."""
    if backend == "torch":
        return torch_block_backward(do, q, k, v, o, lse, causal, scale)
    from ..attention import attention_backward

    return attention_backward(do, q, k, v, o, lse, causal, scale)  # GQA: dK, dV summed over each group
