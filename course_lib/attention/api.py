"""The public Triton FlashAttention-2: `flash_attention(q, k, v, causal, scale, window, sinks)` and the autograd
Function `FlashAttentionTriton` (notebooks 06 and 07).

The forward kernel (`forward.py`) returns O and the logsumexp L; the Function saves Q, K, V, O and L
(all O(N) per (batch, head): nothing of size Nq x Nk) and the backward kernels (`backward.py`)
rebuild P from L. Inputs: (..., N, d) with any leading dims — (batch, N, d) as in homework, or
(batch, heads, N, d) as for `torch.nn.functional.scaled_dot_product_attention`, with fewer K/V heads
for grouped-query attention — and any strides.
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad

try:  # a tensor inside one of functorch's transforms (vmap, grad); a private helper of PyTorch's
    from torch._C._functorch import is_functorch_wrapped_tensor
except ImportError:  # pragma: no cover - a PyTorch without it: every tensor reads as plain

    def is_functorch_wrapped_tensor(t) -> bool:
        return False


from .. import runtime
from ..second_derivative import refuse_second_derivative
from . import plans
from .backward import SAVED_WITHOUT_SINKS, _backward, save_tensors, saved_tensors
from .configs import DEFAULT_LAUNCH, DEFAULT_SWITCHES
from .decode_route import routed_forward
from .inputs import check_call
from .op import flash_attention_op

_PREPARED: set = set()  # shapes whose backward kernels this process has started compiling


def _recorded(*tensors) -> bool:
    """Whether a call must go through autograd: a gradient may be asked of one of `tensors` (grad mode
    on and one requires grad), forward-mode AD is on, or one is a wrapper (functorch's transforms, a
    tensor subclass), for which the Function's own rules (and errors) hold."""
    if getattr(forward_ad, "_current_level", -1) >= 0:  # inside `forward_ad.dual_level()`
        return True
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) is not torch.Tensor or is_functorch_wrapped_tensor(t) or (grad and t.requires_grad):
            return True
    return False


class FlashAttentionTriton(torch.autograd.Function):
    """Differentiable FlashAttention-2 with Triton kernels.

    `FlashAttentionTriton.apply(q, k, v, is_causal)` (optionally a fifth argument, the softmax scale,
    default 1/sqrt(d), a sixth, a sliding window, and a seventh, attention sinks, as in
    `flash_attention`). q: (..., Nq, d), k and v: (..., Nk, d), float16, bfloat16 or float32 (float64
    under the interpreter only). is_causal: False, True / "top_left" (query i sees keys j <= i) or
    "bottom_right" (j <= i + Nk - Nq). Returns O (..., Nq, d). The forward saves Q, K, V, O and L =
    logsumexp (shape q.shape[:-1]); the backward returns dq, dk, dv and None for is_causal (and for
    scale and window), and the sinks' gradient."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, scale=None, window=None, sinks=None):
        needs_grad = any(ctx.needs_input_grad[:3])
        key = plans.call_key(q, k, v, is_causal, scale, window, sinks)
        plan = plans.find(plans.FORWARD, key)
        if plan is not None and (plan.grad_ready or not needs_grad):  # a call seen before (plans.py)
            o, lse = plan.run(q, k, v)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.saved_present = SAVED_WITHOUT_SINKS
            ctx.alignment, ctx.scale, ctx.window = plan.call
            ctx.sinks_dtype, ctx.plan = None, plan
            return o
        alignment, window, sinks32, scale = check_call(
            q, k, v, is_causal, scale, window, sinks, "FlashAttentionTriton"
        )
        shape = (q.shape, k.shape, q.dtype, alignment, bool(window)) if runtime.ON_GPU else None
        if shape is not None and needs_grad and shape not in _PREPARED:
            # a new shape's backward kernels start compiling now, alongside the forward's
            _PREPARED.add(shape)
            _backward(
                None, q, k, v, None, None, alignment, scale, DEFAULT_LAUNCH, DEFAULT_SWITCHES, "two_kernel",
                compile_only=True, window=window,
            )  # fmt: skip
        plan_out = None if key is None else []
        o, lse = routed_forward(
            q, k, v, alignment, scale, DEFAULT_LAUNCH, DEFAULT_SWITCHES, window, sinks32, plan_out=plan_out
        )  # fmt: skip
        plan = _keep(key, plan_out, (alignment, scale, window))
        if plan is not None:
            plan.grad_ready = needs_grad or plan.grad_ready
        save_tensors(ctx, q, k, v, o, lse, sinks32)
        ctx.alignment = alignment
        ctx.scale = scale
        ctx.window = window
        ctx.sinks_dtype = None if sinks is None else sinks.dtype
        ctx.plan = plan
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, sinks32 = saved_tensors(ctx)
        plan = ctx.plan
        with torch.no_grad():
            if plan is not None and plan.generation != plans.generation():
                plan = None  # a launch choice changed since the forward: the full path
            # do's shape is O's; deterministic algorithms turn the one-pass backward off (`backward.OnePassPlan`)
            key = None if plan is None else (
                do.stride(), do.data_ptr() % 16, do.dtype, torch.are_deterministic_algorithms_enabled()
            )  # fmt: skip
            backward_plan = plans.find(plan.backward, key) if plan is not None else None
            if backward_plan is not None:  # a backward seen before (plans.py)
                dq, dk, dv = backward_plan.run(do, q, k, v, o, lse)
                dsinks = None
            else:
                plan_out = None if plan is None else []
                dq, dk, dv, dsinks = _backward(
                    do, q, k, v, o, lse, ctx.alignment, ctx.scale, DEFAULT_LAUNCH, DEFAULT_SWITCHES,
                    "two_kernel", window=ctx.window, sinks=sinks32, plan_out=plan_out,
                )  # fmt: skip
                if plan_out:
                    plans.store(plan.backward, key, plan_out[0])
                dsinks = None if dsinks is None else dsinks.to(ctx.sinks_dtype)
        dq, dk, dv, dsinks = refuse_second_derivative((dq, dk, dv, dsinks), (do, q, k, v, sinks32))
        return dq, dk, dv, None, None, None, dsinks


def _keep(key, plan_out, call: tuple):
    """Keep the plan a call left in `plan_out` under its key (`plans.py`), with the checked (alignment, scale,
    window) it ran with; return it (None when it left none)."""
    if not plan_out:
        return None
    plan = plan_out[0]
    plan.call = call
    plans.store(plans.FORWARD, key, plan)
    return plan


def flash_attention(
    q,
    k,
    v,
    causal=False,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
):
    """O = softmax(Q K^T * scale [+ causal mask]) V with the Triton FlashAttention-2 kernels.

    q: (..., Nq, d), k and v: (..., Nk, d) — same leading dims, or fewer heads (dim -3) in k and v for
    grouped-query / multi-query attention (q's heads a multiple of theirs; K/V are never repeated);
    same dtype and device; any strides; float16, bfloat16 or float32 (float64 under the interpreter,
    for gradcheck). d: a multiple of 8 from 16 to 256.
    causal: False; True or "top_left" (query i sees keys j <= i, as SDPA's is_causal=True);
    "bottom_right" (query i sees keys j <= i + Nk - Nq: the queries are the last Nq positions, as with
    a KV cache and FlashAttention's flash_attn_func). Rows that see no key give O = 0 (and zero
    gradients). scale: default 1/sqrt(d). window: None, or a sliding window of that many keys, with a
    causal alignment: query i sees only keys i + offset - window < j <= i + offset (offset 0 top-left,
    Nk - Nq bottom-right), as Mistral's `sliding_window` and Gemma's local layers do; blocks outside the
    window are never loaded. sinks: None, or attention sinks as gpt-oss has them: (Hq,) learned logits,
    one per query head, each joining every row's softmax as a key whose value is zero (rows may then put
    weight on "nothing"); differentiable. Returns O with q's shape and dtype; differentiable in q, k
    and v. Runs compiled on a GPU, through the Triton interpreter on the CPU (`course_lib.runtime`).
    On a GPU, a few query rows over many keys (a decoding step with a long cache) run Flash-Decoding's
    split-KV kernel for the forward instead (`decode_route.py`, notebook 09). Under `torch.compile` it
    is a PyTorch custom operator (`op.py`): the compiled graph keeps it as one node, forward and backward
    (notebook 08b). Run eagerly it calls the autograd Function directly, which computes the same and
    skips the operator's dispatch (tens of microseconds per call, which a short sequence feels); with
    nothing to differentiate (no_grad, inference) it runs the forward alone, without an autograd node.
    A NaN in k reaches the rows that see its key; a NaN or inf in v reaches every row whose tile loads
    that key, masked or not (0 x NaN is NaN), as in plain PyTorch's P @ V: clean a cache rather than
    rely on the mask to hide what it holds."""
    if torch.compiler.is_compiling():
        return flash_attention_op(q, k, v, causal, scale, window, sinks)
    tensors = isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if not tensors or not (sinks is None or isinstance(sinks, torch.Tensor)):
        check_call(q, k, v, causal, scale, window, sinks, "flash_attention")  # raises, naming the argument
    if _recorded(q, k, v, sinks):
        return FlashAttentionTriton.apply(q, k, v, causal, scale, window, sinks)
    # nothing to differentiate (inference, no_grad): the forward alone, without an autograd node
    key = plans.call_key(q, k, v, causal, scale, window, sinks)
    plan = plans.find(plans.FORWARD, key)
    if plan is not None:  # a call seen before: allocate and launch (plans.py)
        return plan.run(q, k, v)[0]
    alignment, window, sinks32, scale = check_call(q, k, v, causal, scale, window, sinks, "flash_attention")
    plan_out = None if key is None else []
    o, _ = routed_forward(
        q, k, v, alignment, scale, DEFAULT_LAUNCH, DEFAULT_SWITCHES, window, sinks32, plan_out=plan_out
    )  # fmt: skip
    _keep(key, plan_out, (alignment, scale, window))
    return o
