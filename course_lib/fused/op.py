"""RMSNorm and RoPE as PyTorch custom operators, so `torch.compile` can take a model that calls them
(notebook 11; the attention's operators, and why a graph needs them, are in `attention/op.py`, notebook
08b).

Traced into, `RMSNormFunction` and `RoPEFunction` hand their Triton launches to the compiler, which
fails on them (on the CPU, with the kernels interpreted, even where it may break the graph). As
operators they are black boxes: the graph holds one node per call, whose output shapes come from a small
*fake* implementation, and whose gradient is another operator:

    course_lib::rms_norm_forward(x, weight, eps, dw_mode) -> (y, rstd)
    course_lib::rms_norm_backward(dy, x, weight, rstd, dw_mode) -> (dx, dw)
    course_lib::rope(q, k, cos, sin, positions, start, interleaved, backward) -> (q', k')

`rms_norm` and `rope` (`api.py`) call them under torch.compile only; eagerly the autograd Functions run, which skip
the operators' dispatch. RoPE's positions are a tensor (positions given) or None with an int start: an
operator's arguments have fixed types. RoPE's backward is the same operator with backward=True (the
rotation by the negative angles).
"""

from __future__ import annotations

import math

import torch

from ..checks import accumulator_dtype
from ..second_derivative import refuse_second_derivative
from .rms_norm import rms_norm_backward, rms_norm_forward
from .rope import check_position_range, kernel_input, kernel_output, rotate


# --------------------------------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("course_lib::rms_norm_forward", mutates_args=())
def rms_norm_forward_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, dw_mode: str = "partials"
) -> tuple[torch.Tensor, torch.Tensor]:
    """y (x's shape, promote(x, weight) dtype, contiguous) and rstd (rows,) of `rms_norm` (which checks
    the arguments); dw_mode is the backward's."""
    return rms_norm_forward(x, weight, eps)


@rms_norm_forward_op.register_fake
def _rms_norm_forward_fake(x, weight, eps, dw_mode="partials"):
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return y, x.new_empty(math.prod(x.shape[:-1]), dtype=accumulator_dtype(x.dtype))


@torch.library.custom_op("course_lib::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dw_mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx (x's shape and dtype, contiguous) and dw (weight's shape and dtype) of `rms_norm_forward_op`."""
    return rms_norm_backward(dy, x, weight, rstd, dw_mode)


@rms_norm_backward_op.register_fake
def _rms_norm_backward_fake(dy, x, weight, rstd, dw_mode):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_norm_setup_context(ctx, inputs, output):
    x, weight, _eps, ctx.dw_mode = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.mark_non_differentiable(output[1])


def _rms_norm_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    with torch.no_grad():
        grads = rms_norm_backward_op(dy, x, weight, rstd, ctx.dw_mode)
    dx, dw = refuse_second_derivative(
        grads, (dy, x, weight), "course_lib's rms_norm", "rms_norm_reference (PyTorch ops)"
    )
    return dx, dw, None, None


rms_norm_forward_op.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup_context)


# --------------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("course_lib::rope", mutates_args=())
def rope_op(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    start: int,
    interleaved: bool,
    backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q', k' of `rope` (which checks the arguments) on 4-D q, k and 3-D cos, sin: positions (1 or B, T),
    or None for start..start+T-1; backward=True rotates by the negative angles. The positions' values
    are checked here, where they can be read."""
    if positions is not None:
        check_position_range(positions, cos.shape[1])
    return rotate(q, k, cos, sin, start if positions is None else positions, interleaved, backward)


@rope_op.register_fake
def _rope_fake(q, k, cos, sin, positions, start, interleaved, backward=False):
    return kernel_output(kernel_input(q)), kernel_output(kernel_input(k))


def _rope_setup_context(ctx, inputs, output):
    _q, _k, cos, sin, positions, start, interleaved, backward = inputs
    ctx.save_for_backward(cos, sin, positions)
    ctx.args = (start, interleaved, not backward)


def _rope_backward(ctx, dq_out, dk_out):
    cos, sin, positions = ctx.saved_tensors
    with torch.no_grad():
        grads = rope_op(dq_out, dk_out, cos, sin, positions, *ctx.args)
    dq, dk = refuse_second_derivative(
        grads, (dq_out, dk_out), "course_lib's rope", "rope_reference (PyTorch ops)"
    )
    return dq, dk, None, None, None, None, None, None


rope_op.register_autograd(_rope_backward, setup_context=_rope_setup_context)
