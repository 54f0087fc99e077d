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

`Sequences` holds the bounds the kernels read; `sequences()` checks them.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import runtime
from ..checks import causal_alignment, check_int, check_sinks, check_window, default_scale
from ..second_derivative import refuse_second_derivative
from .backward import _backward, save_tensors, saved_tensors
from .forward import _forward
from .inputs import check_inputs
from .launch import n_bucket

_PREPARED: set = set()  # kinds of packed calls whose backward kernels this process has started compiling


@dataclasses.dataclass(frozen=True)
class Sequences:
    """Packed sequences' bounds as the kernels read them.

    bounds: int32 (2 * (count + 1),) on the inputs' device, [q_0, k_0, q_1, k_1, ...] (cu_seqlens_q and
    cu_seqlens_k interleaved: one sequence's four bounds are adjacent); count: B; max_q, max_k: the
    longest sequence's query and key counts (the grid is sized by them); total_q: q's rows."""

    bounds: torch.Tensor
    count: int
    max_q: int
    max_k: int
    total_q: int

    @staticmethod
    def mode(alignment: str | None) -> int:
        """The kernels' VARLEN switch: 2 when each sequence's causal offset is its own Nk - Nq
        (bottom-right), else 1."""
        return 2 if alignment == "bottom_right" else 1

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """(count, H, max_q) per-row values (the backward's D) -> (H, total_q), in packed row order."""
        cu_q = self.bounds[0::2].long()
        lengths = cu_q[1:] - cu_q[:-1]
        row_seq = torch.repeat_interleave(
            torch.arange(self.count, device=padded.device), lengths, output_size=self.total_q
        )
        row_pos = torch.arange(self.total_q, device=padded.device) - cu_q[row_seq]
        return padded[row_seq, :, row_pos].t()


def sequences(
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k, where: str, validate: bool = True
) -> Sequences:
    """Check packed sequences' bounds against q (total_q, Hq, d) and k (total_k, Hkv, d) and return
    them as `Sequences`. cu_seqlens_*: (B + 1,) int32 or int64 tensors on q's device. max_seqlen_*:
    the longest sequence's length or an upper bound (capped at the row count: no sequence is longer),
    or None to compute it (which waits for the GPU). validate=True also checks the values (start at 0,
    never decrease, end at the row count, no sequence longer than max_seqlen_*; checked as given, before
    the int32 copy the kernels read: one wait for the GPU); skipped while a CUDA graph is being captured."""
    cus = []
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(
                f"{where}: {name} must be a tensor of cumulative lengths, got {type(cu).__name__}"
            )
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(
                f"{where}: {name} must be 1-D with B + 1 >= 2 entries (0, then each sequence's end); "
                f"got shape {tuple(cu.shape)}"
            )
        if cu.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{where}: {name} must be int32 or int64, got {cu.dtype}")
        if cu.device != q.device:
            raise ValueError(f"{where}: {name} is on {cu.device}, q on {q.device}; move it to q's device")
        cus.append(cu)
    if cus[0].numel() != cus[1].numel():
        raise ValueError(
            f"{where}: cu_seqlens_q and cu_seqlens_k must describe the same sequences; got "
            f"{cus[0].numel() - 1} and {cus[1].numel() - 1}"
        )
    total_q, total_k = q.shape[0], k.shape[0]
    if total_q >= 2**31 or total_k >= 2**31:
        raise ValueError(f"{where}: at most 2**31 - 1 rows; got {total_q} queries and {total_k} keys")
    pairs = torch.stack(cus, dim=1)  # (B + 1, 2): cu_seqlens_q and cu_seqlens_k side by side
    bounds = pairs.to(torch.int32).reshape(-1)  # [q_0, k_0, q_1, k_1, ...]
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing and (max_seqlen_q is None or max_seqlen_k is None):
        raise ValueError(
            f"{where}: inside a CUDA graph capture give max_seqlen_q and max_seqlen_k (an upper bound will "
            "do): computing them reads the lengths back from the GPU, which a capture cannot do"
        )
    lengths = None
    if (validate and not capturing) or max_seqlen_q is None or max_seqlen_k is None:
        host = pairs.long().cpu()  # the values given, not their int32 copies (2**32 + 5 would pass as 5)
        lengths = host[1:] - host[:-1]
    if validate and not capturing:
        for i, (name, total) in enumerate((("cu_seqlens_q", total_q), ("cu_seqlens_k", total_k))):
            cu = host[:, i]
            if cu[0] != 0 or cu[-1] != total:
                raise ValueError(
                    f"{where}: {name} must start at 0 and end at the number of rows ({total}); got "
                    f"{cu[0].item()} ... {cu[-1].item()}"
                )
            if (lengths[:, i] < 0).any():
                bad = int(torch.nonzero(lengths[:, i] < 0)[0])
                raise ValueError(
                    f"{where}: {name} decreases at sequence {bad} ({cu[bad].item()} -> {cu[bad + 1].item()})"
                )
    maxima = []
    for i, (name, given, total) in enumerate(
        (("max_seqlen_q", max_seqlen_q, total_q), ("max_seqlen_k", max_seqlen_k, total_k))
    ):
        if given is None:
            maxima.append(int(lengths[:, i].max()))
            continue
        given = check_int(where, name, given, 0)
        if lengths is not None and int(lengths[:, i].max()) > given:
            raise ValueError(
                f"{where}: {name}={given}, but sequence {int(lengths[:, i].argmax())} has "
                f"{int(lengths[:, i].max())} rows: it must be at least the longest sequence's length"
            )
        # an upper bound (a model's context length) is fine, but no sequence is longer than all the
        # rows: the grid and the backward's D, (B, H, longest), are sized by the smaller
        maxima.append(min(given, total))
    return Sequences(bounds, cus[0].numel() - 1, maxima[0], maxima[1], total_q)


def check_packed(q, k, v, where: str) -> None:
    """q (total_q, Hq, d), k and v (total_k, Hkv, d), as the kernels take them (`inputs.check_inputs`
    on the (heads, rows, d) views: dtypes, devices, head dim, grouped-query heads)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{where}: {name} must be (total rows, heads, head dim), packed sequences; got {shape}"
            )
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if k.shape != v.shape:
        raise ValueError(f"{where}: k and v must have one shape (total_k, Hkv, d); got {shapes}")
    if q.shape[0] == 0 or q.shape[1] == 0 or k.shape[1] == 0 or q.shape[2] == 0:
        raise ValueError(
            f"{where}: q needs at least one row, and q, k, v at least one head (dim 1); got {shapes}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"{where}: q and k must have one head dim (dim 2); got {shapes}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"{where}: q's {q.shape[1]} heads must be a multiple of k and v's {k.shape[1]} (grouped-query "
            f"attention); got {shapes}"
        )
    # dtypes, devices and the head dims the kernels take, on the (1, heads, rows, d) views they run on
    check_inputs(*(t.transpose(0, 1)[None] for t in (q, k, v)), where=where)


class FlashAttentionVarlen(torch.autograd.Function):
    """Differentiable attention over packed sequences (`flash_attention_varlen`, which checks the
    arguments): forward(q, k, v, seqs, alignment, scale, window, sinks32, sinks_dtype) -> O; the
    backward returns dq, dk, dv (and dsinks in the sinks' dtype)."""

    @staticmethod
    def forward(ctx, q, k, v, seqs, alignment, scale, window, sinks32, sinks_dtype):
        from .api import _DEFAULT_LAUNCH, _FAST

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
            _backward(None, q, k, v, None, None, alignment, scale, _DEFAULT_LAUNCH, _FAST, "two_kernel", True,
                      window, seqs=seqs)  # fmt: skip
        o, lse = _forward(q, k, v, alignment, scale, _DEFAULT_LAUNCH, _FAST, window, sinks32, seqs)
        save_tensors(ctx, q, k, v, o, lse, sinks32, seqs.bounds)
        ctx.meta = (seqs, alignment, scale, window, sinks_dtype)
        return o

    @staticmethod
    def backward(ctx, do):
        from .api import _DEFAULT_LAUNCH, _FAST

        q, k, v, o, lse, sinks32, _ = saved_tensors(ctx)
        seqs, alignment, scale, window, sinks_dtype = ctx.meta
        with torch.no_grad():
            dq, dk, dv, dsinks = _backward(
                do.contiguous(), q, k, v, o, lse, alignment, scale, _DEFAULT_LAUNCH, _FAST, "two_kernel",
                window=window, sinks=sinks32, seqs=seqs,
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
    alignment = causal_alignment(causal)
    window = check_window(window, alignment, where)
    sinks32 = check_sinks(sinks, q.transpose(0, 1)[None], where)
    scale = default_scale(q.shape[-1], scale)
    if torch.compiler.is_compiling():  # one opaque node (`op.py`); the bounds are checked inside it
        if max_seqlen_q is None or max_seqlen_k is None:
            raise ValueError(f"{where}: under torch.compile, give max_seqlen_q and max_seqlen_k (ints)")
        from .op import varlen_forward_op

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


def check_padded(q, k, v, padding, causal, window, sinks, where: str) -> None:
    """`flash_attention_padded`'s checks (its operators' too), each error naming `where`: q, k, v dense
    (B, heads, N, d) tensors, padding (B, Nk) bool or 0/1 integers, Nq <= Nk, the window and the sinks."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{where}: {name} must be (batch, heads, rows, head dim); got {shape}")
    # the dense tensors' own checks (batch, heads, head dim, dtypes, devices)
    check_inputs(q, k, v, where=where)
    B, _, n_q, _ = q.shape
    n_k = k.shape[2]
    if not isinstance(padding, torch.Tensor) or padding.shape != (B, n_k):
        shape = tuple(padding.shape) if isinstance(padding, torch.Tensor) else type(padding).__name__
        raise ValueError(f"{where}: padding must be (batch, keys) = ({B}, {n_k}); got {shape}")
    if padding.dtype.is_floating_point or padding.dtype.is_complex:
        raise TypeError(
            f"{where}: padding must be bool or 0/1 integers, True (1) where a key is a real token; got "
            f"{padding.dtype} (an additive mask, 0 for real tokens and -inf for padding, would read inverted: "
            "pass `mask == 0`)"
        )
    if padding.device.type == "meta":
        raise ValueError(
            f"{where}: padding is on the meta device (shapes only, no values); pass it on {q.device}"
        )
    if n_q > n_k:
        raise ValueError(f"{where}: the queries are the last positions of the keys: Nq={n_q} > Nk={n_k}")
    check_window(window, causal_alignment("bottom_right" if causal else False), where)
    check_sinks(sinks, q, where)


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
    check_padded(q, k, v, padding, causal, window, sinks, where)
    B, n_q = q.shape[0], q.shape[2]
    alignment = "bottom_right" if causal else False
    if torch.compiler.is_compiling():  # the real tokens' count decides shapes: one opaque node (`op.py`)
        from .op import padded_forward_op

        name = "bottom_right" if causal else "none"
        return padded_forward_op(
            q, k, v, padding, name, default_scale(q.shape[-1], scale), window or 0, sinks
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


def padded_sequences(padding: torch.Tensor, n_q: int):
    """A padded batch as packed sequences: (real_q (B, Nq) bool, real_k (B, Nk) bool, cu_seqlens_q,
    cu_seqlens_k (B + 1,) int32, the longest sequence's query and key counts as ints). padding: (B, Nk),
    True where a key is a real token; the queries are the last Nq positions. Reading the counts waits
    for the GPU once."""
    real_k = padding.to(dtype=torch.bool)
    real_q = real_k[:, real_k.shape[1] - n_q :]
    lens_q, lens_k = real_q.sum(1), real_k.sum(1)
    cu_q = torch.nn.functional.pad(lens_q.cumsum(0), (1, 0)).to(torch.int32)
    cu_k = torch.nn.functional.pad(lens_k.cumsum(0), (1, 0)).to(torch.int32)
    max_q, max_k = torch.stack([lens_q.max(), lens_k.max()]).tolist() if len(lens_q) else (0, 0)
    return real_q, real_k, cu_q, cu_k, max_q, max_k


def pack_rows(real, *tensors):
    """The rows of (B, heads, N, ...) tensors where real (B, N) is True, packed as (total, heads, ...)."""
    return [t.transpose(1, 2)[real] for t in tensors]
