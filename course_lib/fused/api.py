"""The fused kernels' public entry points (notebook 11): `rms_norm` and the module `RMSNorm`, `rope` (`rope_` in
place) and `swiglu`.

Each checks its arguments (`rms_norm.check_rms_norm`, `rope.check_rope`; once for each kind of call, with the
kinds it accepted kept in a `checks.AcceptedCalls`), then runs the kernels
through an autograd Function (`RMSNormFunction`, `RoPEFunction`) or, with nothing to differentiate,
the forward alone; under torch.compile it is one opaque node instead, the custom operators of `op.py`.
The kernels, their launches and their numerics are `rms_norm.py`'s and `rope.py`'s.
"""

from __future__ import annotations

import torch
from torch import nn

from ..checks import AcceptedCalls, check_eps, check_int, tensors_key
from .op import rms_norm_forward_op, rope_op
from .rms_norm import RMSNormFunction, check_rms_norm, rms_norm_forward
from .rope import (
    OFFSET_LIMIT,
    RoPEFunction,
    _heads_span,
    as_4d,
    cache_3d,
    check_rope,
    kernel_positions,
    rotate,
)
from .swiglu import SwiGLUFunction, check_swiglu, swiglu_forward

# The kinds of call each check accepted (`checks.AcceptedCalls`): a repeat skips it. A model calls these once or
# twice a layer with the same kinds of tensors; the checks took about 10 us of a call's host time (a 2-core CPU).
_RMS_NORM_CALLS = AcceptedCalls()
_ROPE_CALLS = AcceptedCalls()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, dw_mode: str = "partials"
) -> torch.Tensor:
    """Fused RMSNorm over the last dim, differentiable in x and weight (taught in notebook 11).

    x: (..., D), any leading dims and strides; weight: (D,). dtypes float16, bfloat16, float32 (float64
    for gradcheck); x and weight may differ (the output takes the promoted dtype, as in PyTorch), except
    a float64 weight, which needs a float64 x (refused otherwise: the product would be float32).
    Computes exactly what LlamaRMSNorm computes (also Qwen3's q/k norms, over the head dim): float32
    statistics, cast to x's dtype, then times w. Not Gemma's RMSNorm: it multiplies by (1 + w) in
    float32 before its one cast to x's dtype; rms_norm(x, 1 + w) rounds x_hat to x's dtype first.
    `dw_mode` picks the backward's dW reduction: "partials" (default, deterministic), "atomics" or
    "locked" (see the module docstring). Returns y with x's shape. When no gradient can flow (no_grad,
    or neither x nor weight requires one), the forward runs without autograd and skips storing rstd."""
    key = tensors_key(x, weight)
    key = key and (*key, type(eps), eps, dw_mode)
    if not _RMS_NORM_CALLS.seen(key):
        check_rms_norm(x, weight, eps, dw_mode)
        _RMS_NORM_CALLS.add(key)
    if torch.compiler.is_compiling():  # one opaque node per call (`op.py`)
        return rms_norm_forward_op(x, weight, float(eps), dw_mode)[0]
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return rms_norm_forward(x, weight, float(eps), store_rstd=False)[0]
    return RMSNormFunction.apply(x, weight, float(eps), dw_mode)


class RMSNorm(nn.Module):
    """RMSNorm layer with a learned weight (initialised to ones), computed by `rms_norm`.

    `RMSNorm(hidden, eps=1e-6)(x)` for x (..., hidden); the drop-in counterpart of LlamaRMSNorm."""

    def __init__(self, hidden: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        hidden = check_int("RMSNorm", "hidden", hidden, 1)
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise TypeError(
                f"RMSNorm: dtype must be a floating-point torch.dtype (a learned weight), got {dtype!r}"
            )
        self.weight = nn.Parameter(torch.ones(hidden, device=device, dtype=dtype))
        self.eps = check_eps("RMSNorm", "eps", eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: int | torch.Tensor | None = None,
    layout: str = "half",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their positions' angles in one fused kernel; differentiable in q and k
    (taught in notebook 11).

    q: (B, Hq, T, d) and k: (B, Hk, T, d) (or (H, T, d)), same dtype (float16, bfloat16, float32;
    float64 for gradcheck), any strides with d contiguous, d even. cos, sin: (T_cache, d) or
    (1 or B, T_cache, d), from `rope_cache` or Hugging Face's rotary embedding, in the pair layout of
    `layout` ("half": j with j + d/2, as Llama; "interleaved": 2i with 2i + 1, as GPT-J).
    positions: None (0..T-1), an int p (p..p+T-1, for a KV cache) or an int tensor (T,) or (B, T).
    Hugging Face's rotary embedding returns cos and sin already looked up at its position_ids, (B, T, d):
    pass those with positions=None (positions would look them up a second time). A cos narrower than d
    (partial rotary, GPT-NeoX, Phi) is refused.
    Returns (q', k') with the shapes and dtype of q and k, computed in float32 (float64 for float64
    inputs)."""
    q4, k4, cos3, sin3, pos = _rope_arguments(q, k, cos, sin, positions, layout)
    interleaved = layout == "interleaved"
    if torch.compiler.is_compiling():  # one opaque node per call (`op.py`)
        tensor = isinstance(pos, torch.Tensor)
        q_out, k_out = rope_op(q4, k4, cos3, sin3, pos if tensor else None, 0 if tensor else pos, interleaved)
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        q_out, k_out = RoPEFunction.apply(q4, k4, cos3, sin3, pos, interleaved)
    else:  # nothing to differentiate (a serving step, generation): the kernel without autograd's Function
        q_out, k_out = rotate(q4, k4, cos3, sin3, pos, interleaved)
    # (H, T, d) inputs: as_4d's leading 1 dropped again (a view, cheaper on the host than reshape)
    return (q_out.squeeze(0) if q.dim() == 3 else q_out), (k_out.squeeze(0) if k.dim() == 3 else k_out)


def rope_(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: int | torch.Tensor | None = None,
    layout: str = "half",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope` in place: q and k rotated where they lie, returned (a serving step rotates the Q and K column slices
    of its fused QKV projection's output, which the attention then reads without a copy: `models.piecewise`).
    The arguments are `rope`'s, and q, k need d contiguous (any other strides) and may not be tensors autograd
    tracks (nothing is differentiated in place; `rope` is the differentiable one). Same arithmetic as `rope`:
    float32, rounded once."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        raise ValueError("rope_: q and k require gradients; rotate in place only without autograd (use rope)")
    if q.dim() not in (3, 4) or k.dim() not in (3, 4) or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(
            "rope_: q and k must be (B, H, T, d) or (H, T, d) with d contiguous (they are written in place); got "
            f"shapes {tuple(q.shape)}, {tuple(k.shape)} with strides {q.stride()}, {k.stride()}"
        )
    if not torch.compiler.is_compiling():
        q4, k4, cos3, sin3, pos = _rope_arguments(q, k, cos, sin, positions, layout)
        if max(_heads_span(q4), _heads_span(k4)) < OFFSET_LIMIT:  # within the kernel's 32-bit head offsets
            rotate(q4, k4, cos3, sin3, pos, layout == "interleaved", out=(q4, k4))
            return q, k
    # under torch.compile (its operator is functional) or past 32-bit head offsets: rotated copies written back
    q_out, k_out = rope(q, k, cos, sin, positions, layout)
    return q.copy_(q_out), k.copy_(k_out)


def _rope_arguments(q, k, cos, sin, positions, layout: str) -> tuple:
    """`rope`'s and `rope_`'s arguments checked (once for each kind of call) and as the kernel takes them: q, k 4-D,
    cos, sin 3-D, the positions a tensor or an int start (`rope.kernel_positions`)."""
    key = tensors_key(q, k, cos, sin)
    key = key and (*key, layout)
    if not _ROPE_CALLS.seen(key):
        check_rope(q, k, cos, sin, layout)
        _ROPE_CALLS.add(key)
    q4, k4 = as_4d(q), as_4d(k)
    cos3, sin3 = cache_3d(cos), cache_3d(sin)
    return q4, k4, cos3, sin3, kernel_positions(positions, q4.shape[0], q4.shape[2], cos3.shape[1], q.device)


_SWIGLU_CALLS = AcceptedCalls()


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b in one fused kernel, differentiable in a and b: the gate of Llama's SwiGLU MLP,
    W2 (swiglu(W1 x, W3 x)) (taught in notebook 11; kernels in `swiglu.py`).

    a, b: (..., F) of one shape, dtype (float16, bfloat16, float32; float64 for gradcheck) and device, any
    strides (the halves of one fused W1/W3 matmul's output are read through their row stride). Computed in
    float32 and rounded once (PyTorch's F.silu(a) * b rounds twice). Returns (..., F) contiguous in a's dtype.
    Under torch.compile the PyTorch expression, which the compiler fuses itself."""
    key = tensors_key(a, b)
    if not _SWIGLU_CALLS.seen(key):
        check_swiglu(a, b)
        _SWIGLU_CALLS.add(key)
    if torch.compiler.is_compiling():
        return torch.nn.functional.silu(a) * b
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return SwiGLUFunction.apply(a, b)
    return swiglu_forward(a, b)
