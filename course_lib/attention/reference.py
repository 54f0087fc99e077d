"""Standard attention in plain PyTorch: the reference every kernel in the course is tested against.

Taught in notebook 02 (and used from notebook 00 on). It materialises the full Nq x Nk matrices
S = Q K^T * scale and P = softmax(S) — exactly what FlashAttention avoids — so it costs
O(Nq * Nk) memory per (batch, head). Run it in float64 to get a reference that is exact enough to
judge fp32/fp16/bf16 kernels by.
"""

from __future__ import annotations

import torch

from ..checks import (
    accumulator_dtype,
    causal_alignment,
    causal_offset,
    check_attention_inputs,
    check_sinks,
    check_window,
    default_scale,
    kv_group,
)


def causal_mask(
    n_queries: int, n_keys: int, device=None, alignment: str = "top_left", window: int | None = None
) -> torch.Tensor:
    """Boolean (Nq, Nk) mask, True where query i may attend to key j.

    "top_left": j <= i, query i aligned with key i, as `scaled_dot_product_attention(is_causal=True)`;
    every row keeps key 0 (without a window). "bottom_right": j <= i + Nk - Nq, the queries are the last Nq positions (a
    KV cache); with Nq > Nk the first Nq - Nk rows see no key (`attention` gives them O = 0).
    window: also j > i + offset - window (a sliding window of that many keys), None for none."""
    offset = causal_offset(causal_alignment(alignment), n_queries, n_keys)
    mask = causal_mask_tile(0, n_queries, 0, n_keys, device, offset)
    if window is not None:
        mask &= ~causal_mask_tile(0, n_queries, 0, n_keys, device, offset - window)
    return mask


def causal_mask_tile(i0: int, i1: int, j0: int, j1: int, device=None, offset: int = 0) -> torch.Tensor:
    """The (i1 - i0, j1 - j0) tile of the causal mask j <= i + offset for query rows [i0, i1) and keys
    [j0, j1) (notebook 04: only tiles that cross the diagonal need it; `blocks.py` for the offset).
    offset may also be a one-element tensor (a count known only on the device)."""
    i = torch.arange(i0, i1, device=device)[:, None]
    j = torch.arange(j0, j1, device=device)[None, :]
    return j <= i + offset


def attention(
    q,
    k,
    v,
    causal=False,
    scale: float | None = None,
    return_lse: bool = False,
    window: int | None = None,
    sinks=None,
):
    """O = softmax(Q K^T * scale [+ causal mask]) V, computed the standard (memory-hungry) way.

    q: (..., Nq, d), k: (..., Nk, d), v: (..., Nk, d_v), any floating dtype (float64 included), any
    device, any strides; k and v may have fewer heads (dim -3) than q (grouped-query attention: they
    are repeated here, which is what the kernels avoid). causal: False, True / "top_left" (j <= i) or
    "bottom_right" (j <= i + Nk - Nq). Returns O (..., Nq, d_v) in the input dtype; with
    `return_lse=True` also L = logsumexp of the scaled, masked scores, (..., Nq), float32 for half
    inputs, else the input dtype. A row that sees no key gets O = 0 and L = -inf. Softmax and the
    logsumexp are computed in at least float32. window: a sliding window of that many keys (causal
    only): query i also sees no key j <= i + offset - window. sinks: (Hq,) logits, one per query head,
    each an extra key of every row of its head with a zero value (gpt-oss): it takes its share of the
    softmax and adds nothing to O; L includes it."""
    check_attention_inputs(q, k, v, where="reference.attention", same_head_dim_v=False, allow_gqa=True)
    alignment = causal_alignment(causal)
    window = check_window(window, alignment, "reference.attention") or None
    scale = default_scale(q.shape[-1], scale)
    acc_dtype = accumulator_dtype(q.dtype)
    group = kv_group(q, k)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    S = torch.matmul(q, k.transpose(-2, -1)).to(acc_dtype) * scale  # (..., Nq, Nk)
    if alignment is not None:
        mask = causal_mask(q.shape[-2], k.shape[-2], q.device, alignment, window)
        S = S.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = check_sinks(sinks, q, "reference.attention").to(acc_dtype)
        sink = sink.view(-1, 1, 1) if q.dim() >= 4 else sink.view(1, 1)
        S = torch.cat([S, sink.expand(*S.shape[:-1], 1)], dim=-1)  # the sink: one more column
    L = torch.logsumexp(S, dim=-1)  # (..., Nq)
    P = torch.exp(S - L.masked_fill(torch.isneginf(L), 0.0)[..., None])  # rows with no key: P = 0
    if sinks is not None:
        P = P[..., :-1]  # the sink's value is zero: its probability only scales the others down
    O = torch.matmul(P.to(v.dtype), v)
    if return_lse:
        return O, L
    return O


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None, window=None, sinks=None):
    """`attention` over packed sequences (`varlen.flash_attention_varlen`'s layout), one sequence at a
    time: q (total_q, Hq, d), k and v (total_k, Hkv, d), cu_seqlens_* (B + 1,) cumulative lengths.
    Returns (O (total_q, Hq, d), L (total_q, Hq)); a sequence with no keys gives O = 0, L = -inf (L = the
    sink where there is one)."""
    cu_q, cu_k = [int(x) for x in cu_seqlens_q.tolist()], [int(x) for x in cu_seqlens_k.tolist()]
    o = q.new_zeros(q.shape)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=accumulator_dtype(q.dtype), device=q.device)
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if qs.stop == qs.start:
            continue
        if ks.stop == ks.start:  # no keys: O = 0; L = the sink where there is one
            if sinks is not None:
                lse[qs] = sinks.to(lse.dtype)
            continue
        heads = (t[s].transpose(0, 1)[None] for t, s in ((q, qs), (k, ks), (v, ks)))  # (1, H, n, d) each
        o_b, l_b = attention(*heads, causal, scale, return_lse=True, window=window, sinks=sinks)
        o[qs], lse[qs] = o_b[0].transpose(0, 1), l_b[0].transpose(0, 1)
    return o, lse
