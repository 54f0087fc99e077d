"""A backward made of kernels has no derivative of its own: a second differentiation through it must
raise, not treat the kernels' results as constants (notebook 07).

Asked for gradients with create_graph=True (a gradient penalty, a Hessian-vector product), PyTorch runs
a Function's backward in grad mode and differentiates its results again later. Results computed by
Triton kernels carry no graph, so without a guard the second-order term would silently be zero (or the
later call would fail with an unrelated message). `refuse_second_derivative` ties the backward's
results to its inputs through a node whose own backward raises, naming what has no second derivative
and what to use instead. `torch.autograd.function.once_differentiable` is not enough here: its error
node hangs off detached copies, so `torch.autograd.grad(..., inputs=x)` prunes it and the term is
silently dropped.
"""

from __future__ import annotations

import torch


class _NoSecondDerivative(torch.autograd.Function):
    """Passes the first `n` tensors through; differentiating them raises `message`."""

    @staticmethod
    def forward(ctx, message, n, *tensors):
        ctx.message = message
        return tuple(t if t is None else t.view_as(t) for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.message)


def refuse_second_derivative(
    grads: tuple,
    inputs: tuple,
    what: str = "course_lib attention",
    instead: str = "an attention written in PyTorch ops (course_lib.attention.reference.attention, or SDPA)",
) -> tuple:
    """`grads` unchanged, except in a backward run with create_graph=True (grad mode on) where one of
    `inputs` (the incoming gradients and the saved tensors) requires grad: there the grads are tied to
    the inputs through a node that raises "`what` has no second derivative ...; use `instead`" when
    anything is differentiated through it. create_graph=True with no second differentiation still gives
    the right first-order gradients."""
    if not torch.is_grad_enabled() or not any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in inputs
    ):
        return grads
    message = (
        f"{what} has no second derivative: its backward's kernels are not differentiable (a gradient penalty "
        f"or double backward through it); use {instead} for that term"
    )
    return _NoSecondDerivative.apply(message, len(grads), *grads, *inputs)
