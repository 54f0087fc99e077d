"""Sequences of different lengths packed into one call: `flash_attention_varlen` (notebook 08b).

A batch of sequences of different lengths is usually padded to the longest, and the padding is
computed, masked and thrown away: with lengths drawn from 1 to N, about half of a padded batch's
attention work is waste. Packing puts the sequences one after another instead, as rows of one tensor,
and says where each begins with cumulative lengths (FlashAttention's `flash_attn_varlen_func`):

    q: (total_q, Hq, d)      rows cu_seqlens_q[b] ... cu_seqlens_q[b + 1] - 1 are sequence b's queries
    k, v: (total_k, Hkv, d)  rows cu_seqlens_k[b] ... cu_seqlens_k[b + 1] - 1 are its keys
    cu_seqlens_q, cu_seqlens_k: (B + 1,) integers, starting at 0, never decreasing, ending at the total

Each sequence attends only to its own keys, with its own causal alignment (bottom-right takes each
sequence's own Nk - Nq). The kernels are the padded ones (`forward.py`, `backward.py`) with one switch,
VARLEN: a program looks up its sequence's bounds (`blocks.sequence`), offsets its pointers by the
sequence's first row, and a block of rows past the sequence's end visits no key. The grid is that of
a padded batch of the longest sequence, so blocks past a shorter sequence's end cost a launch slot and
nothing more.

The entry points live here (the face: `flash_attention_varlen`, `flash_attention_padded`, and under
torch.compile their operators in `op.py`); the bounds the kernels read and their checks, below them,
in `packed.py` (`Sequences`, `sequences`, `check_packed`, `check_padded`).
"""

from __future__ import annotations

import torch

from .. import runtime
from ..checks import causal_alignment, check_int, check_sinks, check_window, default_scale
from ..second_derivative import refuse_second_derivative
from .backward import _backward, save_tensors, saved_tensors
from .configs import DEFAULT_LAUNCH, DEFAULT_SWITCHES
from .forward import _forward
from .launch import n_bucket
from .op import padded_forward_op, varlen_forward_op
from .packed import (  # noqa: F401  (Sequences, sequences, check_packed: re-exported, as before packed.py)
    Sequences,
    check_packed,
    check_padded,
    pack_rows,
    padded_sequences,
    sequences,
)

_PREPARED: set = set()  # kinds of packed calls whose backward kernels this process has started compiling


class FlashAttentionVarlen(torch.autograd.Function):
    """Differentiable attention over packed sequences (`flash_attention_varlen`, which checks the
    arguments): forward(q, k, v, seqs, alignment, scale, window, sinks32, sinks_dtype) -> O; the
    backward returns dq, dk, dv (and dsinks in the sinks' dtype)."""

    @staticmethod
    def forward(ctx, q, k, v, seqs, alignment, scale, window, sinks32, sinks_dtype):
        kind = (
            q.shape[1:],
            k.shape[1:],
            q.dtype,
            alignment,
            bool(window),
            n_bucket(max(seqs.max_q, seqs.max_k)),
        )
        if runtime.ON_GPU and any(ctx.needs_input_grad[:3]) and kind not in _PREPARED:
            # a new kind of call's backward kernels start compiling now, alongside the forward's
            _PREPARED.add(kind)
            _backward(None, q, k, v, None, None, alignment, scale, DEFAULT_LAUNCH, DEFAULT_SWITCHES,
                      "two_kernel", compile_only=True, window=window, seqs=seqs)  # fmt: skip
        o, lse = _forward(q, k, v, alignment, scale, DEFAULT_LAUNCH, DEFAULT_SWITCHES, window, sinks32, seqs)
        save_tensors(ctx, q, k, v, o, lse, sinks32, seqs.bounds)
        ctx.meta = (seqs, alignment, scale, window, sinks_dtype)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, sinks32, _ = saved_tensors(ctx)
        seqs, alignment, scale, window, sinks_dtype = ctx.meta
        with torch.no_grad():
            dq, dk, dv, dsinks = _backward(
                do.contiguous(), q, k, v, o, lse, alignment, scale, DEFAULT_LAUNCH, DEFAULT_SWITCHES,
                "two_kernel", window=window, sinks=sinks32, seqs=seqs,
            )  # fmt: skip
            dsinks = None if dsinks is None else dsinks.to(sinks_dtype)
        dq, dk, dv, dsinks = refuse_second_derivative((dq, dk, dv, dsinks), (do, q, k, v, sinks32))
        return dq, dk, dv, None, None, None, None, dsinks, None


def flash_attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal=False,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    validate: bool = True,
):
    """Attention over sequences of different lengths packed into rows, each sequence attending only to
    its own keys (FlashAttention's `flash_attn_varlen_func`; this module's docstring has the layout).

    q: (total_q, Hq, d); k, v: (total_k, Hkv, d), Hq a multiple of Hkv (grouped-query attention);
    float16, bfloat16 or float32 (float64 under the interpreter); any strides. cu_seqlens_q,
    cu_seqlens_k: (B + 1,) int32 or int64 on q's device, 0 first and the row count last; a sequence may
    have no queries or no keys (its rows then give O = 0). max_seqlen_q, max_seqlen_k: the longest
    sequence's counts, or an upper bound (None: computed, which waits for the GPU). causal, scale,
    window, sinks: as in `flash_attention`, per sequence ("bottom_right" aligns each sequence's queries
    with the end of its own keys). validate: check the bounds' values (one wait for the GPU; off inside
    CUDA graphs, where it is skipped anyway); unchecked bounds are trusted, and wrong ones (a sequence
    longer than max_seqlen_*, a last entry past the rows) give garbage or read and write out of bounds.
    Returns O (total_q, Hq, d) in q's dtype; differentiable in q, k, v and sinks."""
    where = "flash_attention_varlen"
    check_packed(q, k, v, where)
    alignment = causal_alignment(causal, where)
    window = check_window(window, alignment, where)
    sinks32 = check_sinks(sinks, q.transpose(0, 1)[None], where)
    scale = default_scale(q.shape[-1], scale)
    if torch.compiler.is_compiling():  # one opaque node (`op.py`); the bounds are checked inside it
        if max_seqlen_q is None or max_seqlen_k is None:
            raise ValueError(f"{where}: under torch.compile, give max_seqlen_q and max_seqlen_k (ints)")
        max_q, max_k = (
            check_int(where, "max_seqlen_q", max_seqlen_q, 0),
            check_int(where, "max_seqlen_k", max_seqlen_k, 0),
        )
        name = alignment or "none"
        return varlen_forward_op(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, name, scale, window, sinks
        )[0]
    seqs = sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k, where, validate)
    sinks_dtype = None if sinks is None else sinks.dtype
    return FlashAttentionVarlen.apply(q, k, v, seqs, alignment, scale, window, sinks32, sinks_dtype)


def flash_attention_padded(q, k, v, padding, causal=False, scale=None, window=None, sinks=None):
    """Attention of a padded batch, run as packed sequences: the padding is never computed.

    q: (B, Hq, Nq, d); k, v: (B, Hkv, Nk, d); padding: (B, Nk) bool (or 0/1 integers), True where a
    key is a real token (transformers' 2-D `attention_mask`). The queries are the last Nq positions of
    the keys (prefill: Nq = Nk; decoding with a cache: Nq < Nk), so a query row is real where
    padding[:, -Nq:] is. Each sequence's real queries attend to its real keys; causal: query i sees the
    real keys up to its own position (each sequence bottom-right aligned after the padding is removed,
    which is the same thing). window: a sliding window counted in real tokens, which equals positions
    when each row's real tokens are one run (left or right padding). Padded query rows give O = 0 (no
    gradient; a batch with no real query returns zeros outside the autograd graph). Returns O
    (B, Hq, Nq, d). The real rows are gathered and scattered back by index, which
    waits for the GPU once (the lengths decide the shapes); under torch.compile, where shapes that
    depend on values cannot be traced, the whole call is one custom operator
    (`op.padded_forward_op`, with its backward)."""
    where = "flash_attention_padded"
    alignment = check_padded(q, k, v, padding, causal, window, sinks, where)
    B, n_q = q.shape[0], q.shape[2]
    if torch.compiler.is_compiling():  # the real tokens' count decides shapes: one opaque node (`op.py`)
        return padded_forward_op(
            q, k, v, padding, alignment or "none", default_scale(q.shape[-1], scale), window or 0, sinks
        )[0]
    real_q, real_k, cu_q, cu_k, max_q, max_k = padded_sequences(padding.to(q.device), n_q)
    out = q.new_zeros(B, n_q, q.shape[1], q.shape[3])
    if max_q == 0:  # every query is padding
        return out.transpose(1, 2)
    o = flash_attention_varlen(
        *pack_rows(real_q, q), *pack_rows(real_k, k, v), cu_q, cu_k, max_q, max_k, alignment,
        scale, window, sinks, validate=False,
    )  # fmt: skip
    return out.index_put((real_q,), o).transpose(1, 2)
