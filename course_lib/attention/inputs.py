"""Inputs of the Triton attention kernels: what they accept, and how tensors reach them (notebook 06).

The kernels index (batch, head, row, column) with four strides, so any tensor (..., N, d) is viewed
as (B, H, N, d) without a copy where its strides allow (`as_4d`); the checks give a clear error for
anything the kernels cannot take.
"""

from __future__ import annotations

import functools

import torch

from .. import runtime
from ..checks import (
    KERNEL_HEAD_DIMS,
    MAX_HEAD_DIM,
    OFFSET_LIMIT,
    AcceptedCalls,
    causal_alignment,
    check_attention_inputs,
    check_kernel_device,
    check_sinks,
    check_window,
    default_scale,
    tensors_key,
)
from ..runtime import tl

# Head dims the kernels accept (`checks.KERNEL_HEAD_DIMS`, decoding's too); 16, 32, 64 and 128 are the tuned ones.
SUPPORTED_HEAD_DIMS = KERNEL_HEAD_DIMS


# q, k, v's shapes, dtypes and devices that `check_inputs` accepted: what it checks is a function of these
# alone. Checking in full costs 8.1 us of host time per call, a kind accepted before 1.6 (a 2-core CPU).
_ACCEPTED = AcceptedCalls()


def check_inputs(q, k, v, where: str) -> None:
    """Raise a clear error for anything the kernels cannot take (see `course_lib.checks`).

    Accepted: q (..., Nq, d), k and v (..., Nk, d), same leading dims (k and v may have fewer heads,
    dim -3, dividing q's: grouped-query attention), dtype and device; float16, bfloat16 or float32
    (float64 only under the interpreter, for gradcheck); d a multiple of 8 in [16, 256]; Nk = 0
    allowed (every row then sees no key); tensors on the device where the kernels run
    (`course_lib.DEVICE`). Shapes, dtypes and devices accepted once are accepted at once after
    (`_ACCEPTED`)."""
    key = tensors_key(q, k, v)
    if _ACCEPTED.seen(key):
        return
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    if runtime.INTERPRET:
        dtypes = dtypes + (torch.float64,)
    elif isinstance(q, torch.Tensor) and q.dtype == torch.float64:
        raise TypeError(
            f"{where}: float64 runs only under the Triton interpreter (CPU), where it serves gradcheck; "
            "the compiled GPU kernels take float16, bfloat16 or float32. For a float64 result use "
            "course_lib.attention.reference.attention."
        )
    check_attention_inputs(q, k, v, where=where, dtypes=dtypes, allow_empty=True, allow_gqa=True)
    d = q.shape[-1]
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"{where}: head dim d={d} is not supported by the Triton kernels; supported: multiples of 8 "
            f"from 16 to {MAX_HEAD_DIM} (tuned: 16, 32, 64, 128); q {tuple(q.shape)}"
        )
    check_kernel_device(where, q=q, k=k, v=v)
    _ACCEPTED.add(key)


def check_call(q, k, v, causal, scale, window, sinks, where: str):
    """Check an attention call's arguments as every public entry point does (errors naming `where`);
    return them normalised: (alignment, window, float32 sinks, scale), as `forward._forward` takes them.
    `check_inputs`, then `checks.causal_alignment`, `check_window`, `check_sinks`, `default_scale`."""
    check_inputs(q, k, v, where=where)
    alignment = causal_alignment(causal)
    window = check_window(window, alignment, where)
    sinks = check_sinks(sinks, q, where)
    return alignment, window, sinks, default_scale(q.shape[-1], scale)


def as_4d(t: torch.Tensor) -> torch.Tensor:
    """View t (..., N, d) as (B, H, N, d) without copying when the strides allow it.

    0 or 1 leading dims become (1, 1, ...) or (B, 1, ...); 2 stay; more are merged into the first of
    two by `reshape`, which copies only when the merged dims cannot share one stride."""
    dims = t.dim()
    if dims == 4:
        return t
    if dims == 3:
        return t[:, None]
    if dims <= 2:
        return t[None, None]
    shape = t.shape
    return t.reshape(-1, shape[-3], shape[-2], shape[-1])


def strides4(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(batch, head, row, column) strides of a 4-D view, in elements (what the kernels index with)."""
    return t.stride()


def slice_span(t4: torch.Tensor, rows: int) -> int:
    """Elements between the first and the last that a kernel addresses in one (batch, head) slice of a
    4-D view (B, H, N, d) when it reads `rows` rows (N, or a packed call's longest sequence)."""
    _, _, row_stride, col_stride = t4.stride()
    return max(rows - 1, 0) * abs(row_stride) + max(t4.shape[3] - 1, 0) * abs(col_stride)


def within_offsets(t4: torch.Tensor, rows: int, name: str, where: str, copy: bool = True) -> torch.Tensor:
    """t4 itself when one (batch, head) slice of `rows` rows fits the kernels' 32-bit offsets (the
    batch and head offsets, and a packed sequence's first row, are 64-bit); else, with `copy`, a
    contiguous copy (rows d elements apart: O(N d) bytes against the kernels' O(N^2 d) work) where
    that fits. Transformers' layout (batch, rows, heads, d) seen as (batch, heads, rows, d) puts rows
    H * d elements apart: at 32 heads of 128 a slice of 524288 rows passes 2**31, and its offsets
    would wrap and read the wrong memory. What still does not fit (an output, which must be written
    where it is, or d * rows >= 2**31) is refused by name."""
    if t4.numel() < OFFSET_LIMIT and t4.is_contiguous():  # rows <= N: a slice spans less than the whole
        return t4  # (0.2 us of host time against 0.8 for the span: this runs on every tensor of every call)
    _, _, row_stride, col_stride = t4.stride()  # `slice_span`, inlined
    span = max(rows - 1, 0) * abs(row_stride) + max(t4.shape[3] - 1, 0) * abs(col_stride)
    if span < OFFSET_LIMIT:
        return t4
    if copy and rows * t4.shape[3] < OFFSET_LIMIT:
        return t4.contiguous()
    raise ValueError(
        f"{where}: {name} {tuple(t4.shape)} (strides {t4.stride()}, as (batch, heads, rows, d)): one (batch, "
        f"head) slice of {rows} rows spans {span} elements, past the kernels' 32-bit offsets (at most "
        f"{OFFSET_LIMIT - 1}); split the sequence (ring attention, notebook 13, shares one attention "
        "between devices)"
    )


def kernel_flags(dtype: torch.dtype) -> dict:
    """Compile-time flags that depend on the input dtype.

    UPCAST: bf16 under the interpreter (its bf16 `tl.dot` is wrong), so tiles go to fp32 after loading.
    DOT_PRECISION: "ieee" for fp32/fp64 inputs (a GPU would otherwise use tf32, ~1e-3 relative error);
    for fp16/bf16 it changes nothing. ACC_DTYPE: fp32 accumulators, fp64 for fp64 inputs (gradcheck).
    One dict per (dtype, mode), made once: read it or unpack it, never change it."""
    return _kernel_flags(dtype, runtime.INTERPRET)


@functools.cache
def _kernel_flags(dtype: torch.dtype, interpret: bool) -> dict:
    wide = dtype in (torch.float32, torch.float64)
    return dict(
        UPCAST=bool(interpret and dtype == torch.bfloat16),
        DOT_PRECISION="ieee" if wide else "tf32",
        ACC_DTYPE=tl.float64 if dtype == torch.float64 else tl.float32,
    )
