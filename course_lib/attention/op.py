"""The attention as a PyTorch custom operator, so `torch.compile` can take a model that calls it
(notebook 08b).

`torch.compile` first traces Python into a graph (Dynamo), running every op on *fake* tensors that
carry only shape, dtype and device. An `autograd.Function` whose forward launches Triton kernels is
traced *into*: the compiler then sees the launch, the autotuner and the kernel itself, and tries to
compile the kernel its own way (on the H200 this failed with `InductorError: CompilationError`). A
custom operator is a black box instead: the graph holds one node `course_lib.flash_attention_forward`,
whose output shapes come from a small *fake* implementation (`_forward_fake`), and whose gradient is
another black box, `course_lib.flash_attention_backward`. The kernels then run exactly as in eager
mode, compiled or interpreted.

Two operators, one per pass, both built on the plain kernel functions of `course_lib.attention`:

    course_lib::flash_attention_forward(q, k, v, causal, scale, window, sinks) -> (O, L)
    course_lib::flash_attention_backward(dO, q, k, v, O, L, causal, scale, window, sinks)
        -> (dQ, dK, dV, dsinks)

the same pair for packed sequences of different lengths (`varlen.py`), with their cumulative
lengths and longest lengths after k, v: `course_lib::flash_attention_varlen_forward` and
`course_lib::flash_attention_varlen_backward`; and a pair for a padded batch run as packed sequences,
with its (B, Nk) padding mask after k, v (`varlen.flash_attention_padded`: the real tokens' count
decides the packed shapes, which a graph cannot hold): `course_lib::flash_attention_padded_forward` and
`course_lib::flash_attention_padded_backward`, which return dense (B, H, N, ...) tensors.

`causal` is a string in the schema ("none", "top_left" or "bottom_right"), `scale` a float, `window`
an int (0: no sliding window), `sinks` an optional tensor: an operator's arguments have fixed types, so
`flash_attention_op` turns False/True/None into these first. An operator returns tensors only: without
sinks, dsinks is an empty tensor that autograd never hands on.
"""

from __future__ import annotations

import torch

from ..checks import accumulator_dtype, causal_alignment, check_sinks, check_window, default_scale
from ..second_derivative import refuse_second_derivative
from .backward import _backward as _launch_backward
from .backward import backward as _attention_backward
from .backward import check_saved, save_tensors, saved_tensors
from .configs import DEFAULT_LAUNCH, DEFAULT_SWITCHES
from .decode_route import attention_forward as _attention_forward
from .forward import _forward
from .inputs import check_call, check_inputs
from .packed import check_packed, check_padded, pack_rows, padded_sequences, sequences


def _alignment(causal: str, where: str) -> str | None:
    """An operator's causal string ("none" or an alignment's name) as an alignment (`checks.causal_alignment`)."""
    return causal_alignment(causal, where, strings=True)


def _outputs_fake(q):
    """O and L as the forward operators return them: O like q, L q.shape[:-1] in the accumulator dtype."""
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=accumulator_dtype(q.dtype))


def _grads_fake(q, k, v, sinks):
    """dQ, dK, dV like q, k, v, and dsinks like the sinks (empty without), as the backward operators
    return them."""
    dsinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


@torch.library.custom_op("course_lib::flash_attention_forward", mutates_args=())
def forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: str,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """O and L = logsumexp of attention, as one operator (`decode_route.attention_forward` runs inside:
    the forward kernel, or the split-KV kernel for a decoding step on a GPU).

    q: (..., Hq, Nq, d) or (B, Nq, d); k, v: (..., Hkv, Nk, d) with Hq a multiple of Hkv; float16,
    bfloat16 or float32. causal: "none", "top_left" or "bottom_right". window: 0, or a sliding window
    of that many keys (`flash_attention`). sinks: None or (Hq,) attention-sink logits. Returns O (q's
    shape and dtype, contiguous) and L (q.shape[:-1], float32)."""
    alignment = _alignment(causal, "course_lib::flash_attention_forward")
    return _attention_forward(q, k, v, alignment, scale, window=window or None, sinks=sinks)


@forward_op.register_fake
def _forward_fake(q, k, v, causal, scale, window=0, sinks=None):
    # Shapes only: this runs on fake tensors while torch.compile traces, so bad input fails there too.
    # Meta tensors (no device at all) skip the check, which also asks for the kernels' device.
    if q.device.type != "meta":
        check_inputs(q, k, v, where="course_lib::flash_attention_forward")
    alignment = _alignment(causal, "course_lib::flash_attention_forward")
    check_window(window or None, alignment, "course_lib::flash_attention_forward")
    check_sinks(sinks, q, "course_lib::flash_attention_forward")
    return _outputs_fake(q)


@torch.library.custom_op("course_lib::flash_attention_backward", mutates_args=())
def backward_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: str,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV (and dsinks) of attention, as one operator (`backward.backward` runs inside).

    do, o: q's shape; lse: q.shape[:-1], as returned by `forward_op`. Returns dq, dk, dv with the
    shapes and dtypes of q, k, v (contiguous); with grouped-query attention dk, dv are summed over the
    query heads that share each K/V head; dsinks with the sinks' shape and dtype (empty without sinks)."""
    alignment = _alignment(causal, "course_lib::flash_attention_backward")
    grads = _attention_backward(do, q, k, v, o, lse, alignment, scale, window=window or None, sinks=sinks)
    return grads if sinks is not None else (*grads, q.new_empty(0))


@backward_op.register_fake
def _backward_fake(do, q, k, v, o, lse, causal, scale, window=0, sinks=None):
    return _grads_fake(q, k, v, sinks)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, window, sinks = inputs
    o, lse = output
    save_tensors(ctx, q, k, v, o, lse, sinks)
    ctx.causal = causal
    ctx.scale = scale
    ctx.window = window
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, sinks = saved_tensors(ctx)
    with torch.no_grad():
        grads = backward_op(do, q, k, v, o, lse, ctx.causal, ctx.scale, ctx.window, sinks)
    dq, dk, dv, dsinks = refuse_second_derivative(grads, (do, q, k, v, sinks))
    return dq, dk, dv, None, None, None, None if sinks is None else dsinks


forward_op.register_autograd(_backward, setup_context=_setup_context)


def flash_attention_op(
    q, k, v, causal="none", scale: float | None = None, window: int | None = None, sinks=None
) -> torch.Tensor:
    """O = softmax(Q K^T * scale [+ causal mask]) V through the custom operator: differentiable, and
    `torch.compile(fullgraph=True)` keeps it as one node (no graph break, kernels not re-compiled).

    q: (B, Hq, Nq, d) or (B, Nq, d); k, v: (B, Hkv, Nk, d) or (B, Nk, d), Hq a multiple of Hkv
    (grouped-query attention without repeating K/V); float16, bfloat16 or float32 (float64 under the
    interpreter). causal: "none", "top_left" (query i sees keys j <= i, SDPA's is_causal) or
    "bottom_right" (j <= i + Nk - Nq, a KV cache); False/True are accepted for "none"/"top_left".
    scale: default 1/sqrt(d). window: None or a sliding window, sinks: None or (Hq,) attention sinks
    (`flash_attention`). Returns O with q's shape and dtype. Taught in notebook 08b."""
    # clear errors before dispatch (meta tensors too); the operator takes the sinks as given
    alignment, window, _, scale = check_call(q, k, v, causal, scale, window, sinks, "flash_attention")
    return forward_op(q, k, v, alignment or "none", scale, window, sinks)[0]


# --------------------------------------------------------------------------------------------------
# Packed sequences (`varlen.flash_attention_varlen` calls these under torch.compile)
# --------------------------------------------------------------------------------------------------
def _packed(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window, sinks, where
):
    """The checked pieces of a packed call: (alignment, `packed.Sequences`, float32 sinks). q, k, v,
    scale and window are checked as `flash_attention_varlen` checks them: the operators are public
    (torch.ops.course_lib), and the kernels trust what they get."""
    alignment = _alignment(causal, where)
    check_packed(q, k, v, where)
    check_window(window or None, alignment, where)
    default_scale(q.shape[-1], scale)
    seqs = sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k, where)
    return alignment, seqs, check_sinks(sinks, q.transpose(0, 1)[None], where)


@torch.library.custom_op("course_lib::flash_attention_varlen_forward", mutates_args=())
def varlen_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: str,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """O (total_q, Hq, d) and L (total_q, Hq) of packed sequences (`varlen.flash_attention_varlen`)."""
    where = "course_lib::flash_attention_varlen_forward"
    alignment, seqs, sinks32 = _packed(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window, sinks, where
    )
    return _forward(q, k, v, alignment, scale, DEFAULT_LAUNCH, DEFAULT_SWITCHES, window, sinks32, seqs)


@varlen_forward_op.register_fake
def _varlen_forward_fake(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window=0, sinks=None
):
    return _outputs_fake(q)


@torch.library.custom_op("course_lib::flash_attention_varlen_backward", mutates_args=())
def varlen_backward_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: str,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV (and dsinks, empty without sinks) of `varlen_forward_op`."""
    where = "course_lib::flash_attention_varlen_backward"
    alignment, seqs, sinks32 = _packed(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window, sinks, where
    )
    check_saved(do, o, lse, q, where, l_name="lse")
    dq, dk, dv, dsinks = _launch_backward(
        do.contiguous(), q, k, v, o, lse, alignment, scale, DEFAULT_LAUNCH, DEFAULT_SWITCHES, "two_kernel",
        window=window, sinks=sinks32, seqs=seqs,
    )  # fmt: skip
    return dq, dk, dv, q.new_empty(0) if sinks is None else dsinks.to(sinks.dtype)


@varlen_backward_op.register_fake
def _varlen_backward_fake(
    do,
    q,
    k,
    v,
    o,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal,
    scale,
    window=0,
    sinks=None,
):
    return _grads_fake(q, k, v, sinks)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, sinks = inputs
    save_tensors(ctx, q, k, v, *output, cu_q, cu_k, sinks)
    ctx.args = (max_q, max_k, causal, scale, window)
    ctx.mark_non_differentiable(output[1])


def _varlen_backward(ctx, do, _dlse):
    q, k, v, o, lse, cu_q, cu_k, sinks = saved_tensors(ctx)
    max_q, max_k, causal, scale, window = ctx.args
    with torch.no_grad():
        grads = varlen_backward_op(
            do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, scale, window, sinks
        )
    dq, dk, dv, dsinks = refuse_second_derivative(grads, (do, q, k, v, sinks))
    return dq, dk, dv, None, None, None, None, None, None, None, None if sinks is None else dsinks


varlen_forward_op.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


# --------------------------------------------------------------------------------------------------
# A padded batch as packed sequences (`varlen.flash_attention_padded` calls these under torch.compile)
# --------------------------------------------------------------------------------------------------
def _check_padded(q, k, v, padding, causal: str, window: int, sinks, where: str) -> None:
    """The operators' arguments as `flash_attention_padded` checks its own; causal "none" or "bottom_right"
    (the queries are the last positions of the keys: top-left has no meaning here)."""
    alignment = causal_alignment(causal, where, ("bottom_right",), strings=True)
    check_padded(q, k, v, padding, alignment, window or None, sinks, where)


@torch.library.custom_op("course_lib::flash_attention_padded_forward", mutates_args=())
def padded_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    padding: torch.Tensor,
    causal: str,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """O (B, Hq, Nq, d) and L (B, Hq, Nq) of a padded batch (`varlen.flash_attention_padded`, which
    checks the arguments): the real rows packed, `varlen_forward_op`, scattered back; padded query rows
    give O = 0 and L = 0. causal: "none" or "bottom_right"."""
    _check_padded(q, k, v, padding, causal, window, sinks, "course_lib::flash_attention_padded_forward")

    real_q, real_k, cu_q, cu_k, max_q, max_k = padded_sequences(padding.to(q.device), q.shape[2])
    o = q.new_zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    lse = q.new_zeros(o.shape[:-1], dtype=accumulator_dtype(q.dtype))
    if max_q > 0:
        o_rows, lse_rows = varlen_forward_op(
            *pack_rows(real_q, q), *pack_rows(real_k, k, v), cu_q, cu_k, max_q, max_k,
            causal, scale, window, sinks,
        )  # fmt: skip
        o, lse = o.index_put((real_q,), o_rows), lse.index_put((real_q,), lse_rows)
    return o.transpose(1, 2).contiguous(), lse.transpose(1, 2).contiguous()


@padded_forward_op.register_fake
def _padded_forward_fake(q, k, v, padding, causal, scale, window=0, sinks=None):
    return _outputs_fake(q)


@torch.library.custom_op("course_lib::flash_attention_padded_backward", mutates_args=())
def padded_backward_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    padding: torch.Tensor,
    causal: str,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV (dense, zero at padding) and dsinks (empty without sinks) of `padded_forward_op`."""
    _check_padded(q, k, v, padding, causal, window, sinks, "course_lib::flash_attention_padded_backward")

    real_q, real_k, cu_q, cu_k, max_q, max_k = padded_sequences(padding.to(q.device), q.shape[2])
    dq, dk, dv = (torch.zeros_like(t.transpose(1, 2)) for t in (q, k, v))  # (B, N, heads, d)
    dsinks = q.new_empty(0) if sinks is None else torch.zeros_like(sinks)
    if max_q > 0:
        dq_rows, dk_rows, dv_rows, dsinks = varlen_backward_op(  # dsinks empty without sinks, as above
            *pack_rows(real_q, do, q), *pack_rows(real_k, k, v), *pack_rows(real_q, o, lse),
            cu_q, cu_k, max_q, max_k, causal, scale, window, sinks,
        )  # fmt: skip
        dq, dk, dv = (
            dq.index_put((real_q,), dq_rows),
            dk.index_put((real_k,), dk_rows),
            dv.index_put((real_k,), dv_rows),
        )
    return (
        dq.transpose(1, 2).contiguous(),
        dk.transpose(1, 2).contiguous(),
        dv.transpose(1, 2).contiguous(),
        dsinks,
    )


@padded_backward_op.register_fake
def _padded_backward_fake(do, q, k, v, o, lse, padding, causal, scale, window=0, sinks=None):
    return _grads_fake(q, k, v, sinks)


def _padded_setup_context(ctx, inputs, output):
    q, k, v, padding, causal, scale, window, sinks = inputs
    save_tensors(ctx, q, k, v, *output, padding, sinks)
    ctx.args = (causal, scale, window)
    ctx.mark_non_differentiable(output[1])


def _padded_backward(ctx, do, _dlse):
    q, k, v, o, lse, padding, sinks = saved_tensors(ctx)
    with torch.no_grad():
        grads = padded_backward_op(do, q, k, v, o, lse, padding, *ctx.args, sinks)
    dq, dk, dv, dsinks = refuse_second_derivative(grads, (do, q, k, v, sinks))
    return dq, dk, dv, None, None, None, None, None if sinks is None else dsinks


padded_forward_op.register_autograd(_padded_backward, setup_context=_padded_setup_context)
