"""Merging partial attention results over disjoint sets of keys (notebook 03's merge, in PyTorch).

A partial result over a set of keys is (O, L): O normalised over those keys only, L their logsumexp
(natural log, float32 or float64). For two disjoint key sets a and b the result over their union is

    L = logaddexp(L_a, L_b),   O = exp(L_a - L) * O_a + exp(L_b - L) * O_b

exact up to rounding, in any order: the same rule as `course_lib.softmax.merge_states`, written on
(O, L) instead of (m, l). Split-KV decoding (notebook 09) merges the slices of one cache, ring
attention (notebook 13) the slices that travel around the ring.

A set with no visible key is (O, L) = (0, -inf): it merges as the identity, and two empty sets give
(0, -inf), never NaN.
"""

from __future__ import annotations

import torch

from ..checks import check_int, check_tensor

LSE_DTYPES = (torch.float32, torch.float64)


def _check_parts(where: str, outputs: dict, lses: dict) -> None:
    """Every part a torch.Tensor, all on one device; the O parts (`outputs`, name -> tensor) of a floating
    dtype, the L parts (`lses`) float32 or float64. A TypeError or ValueError naming the argument otherwise."""
    tensors = {**outputs, **lses}
    for name, t in tensors.items():
        check_tensor(where, name, t)
    for name, t in outputs.items():
        if not t.is_floating_point():
            raise TypeError(f"{where}: {name} must be a floating-point tensor, got {t.dtype}")
    for name, t in lses.items():
        if t.dtype not in LSE_DTYPES:
            raise TypeError(f"{where}: {name} (a logsumexp) must be float32 or float64, got {t.dtype}")
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"{where}: every part must be on one device, got {devices}")


def _weight(lse_part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(L_part - L), with 0 where both are -inf (a row that saw no key in either part)."""
    w = torch.exp(lse_part - lse)
    return torch.where(torch.isneginf(lse), torch.zeros_like(w), w)


def merge_attention_states(o_a, lse_a, o_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial results over disjoint key sets.

    o_a, o_b: (..., N, d), any float dtype; lse_a, lse_b: (..., N), float32 or float64.
    Returns (O, L): O (..., N, d) in o_a's dtype, L (..., N) in lse_a's dtype. Differentiable."""
    _check_parts("merge_attention_states", {"o_a": o_a, "o_b": o_b}, {"lse_a": lse_a, "lse_b": lse_b})
    if o_a.shape != o_b.shape or lse_a.shape != lse_b.shape or o_a.shape[:-1] != lse_a.shape:
        raise ValueError(
            "merge_attention_states: expected o_a, o_b of one shape (..., N, d) and lse_a, lse_b of shape "
            f"(..., N); got o_a {tuple(o_a.shape)}, o_b {tuple(o_b.shape)}, lse_a {tuple(lse_a.shape)}, "
            f"lse_b {tuple(lse_b.shape)}"
        )
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = _weight(lse_a, lse).unsqueeze(-1)
    w_b = _weight(lse_b, lse).unsqueeze(-1)
    o = w_a * o_a.to(w_a.dtype) + w_b * o_b.to(w_b.dtype)
    return o.to(o_a.dtype), lse


def merge_many(
    o_parts: torch.Tensor, lse_parts: torch.Tensor, dim: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge S partial results stacked along `dim` in one step (what a split-KV combine does).

    o_parts: (..., S, ..., N, d) with the splits along `dim`; lse_parts: the same without d (float32 or
    float64). dim: 0 <= dim < lse_parts.dim(), counted the same in both.
    L = logsumexp over the splits; O = sum over splits of exp(L_s - L) * O_s. Returns (O, L) with
    `dim` removed; L keeps lse_parts' dtype, O o_parts' dtype."""
    _check_parts("merge_many", {"o_parts": o_parts}, {"lse_parts": lse_parts})
    if o_parts.shape[:-1] != lse_parts.shape:
        raise ValueError(
            f"merge_many: o_parts {tuple(o_parts.shape)} must be lse_parts {tuple(lse_parts.shape)} plus a "
            "last (head) dimension"
        )
    dim = check_int("merge_many", "dim", dim, 0)
    if dim >= lse_parts.dim():
        raise ValueError(
            f"merge_many: dim (the splits' axis) must be below {lse_parts.dim()} for lse_parts of shape "
            f"{tuple(lse_parts.shape)}, got {dim}"
        )
    lse = torch.logsumexp(lse_parts, dim=dim)
    w = _weight(lse_parts, lse.unsqueeze(dim)).unsqueeze(-1)
    o = (w * o_parts.to(w.dtype)).sum(dim=dim)
    return o.to(o_parts.dtype), lse
