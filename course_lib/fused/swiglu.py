"""SwiGLU's gate, silu(a) * b, as one fused Triton kernel forward and one backward (notebook 11).

Llama's MLP is W2 (silu(W1 x) * W3 x) (Shazeer, 2020: "GLU variants improve transformer"), with silu(a) =
a * sigmoid(a). Between the two matmuls PyTorch runs two elementwise kernels: silu(a) writes a tensor that
the product reads again, and each rounds to the activations' dtype. Here one kernel reads a and b once and
writes their gate once, computed in float32 (float64 for float64 inputs) and rounded once:

    forward:   y = a * s * b,                      s = sigmoid(a)
    backward:  da = dy * b * s * (1 + a (1 - s)),  db = dy * a * s

Bytes that must move: forward read a, b, write y (3 x T x F elements; eager PyTorch 5); backward read a, b,
dy, write da, db. a and b may be the two halves of one fused W1/W3 matmul's output (a serving step's
`torch.chunk`): each is read through its row stride, nothing copied.

Contiguous a and b (separate W1 and W3 outputs) are read as flat arrays, FLAT_BLOCK elements a program; other
strides (the halves of one output) by tiles of ROWS rows and BLOCK columns (`_tile`): row tiles on the grid's first
axis, column blocks on the second. The arithmetic of both is `_gate` and `_gate_grads`.

Here: the kernels, `swiglu_forward` / `swiglu_backward` (their launches), the autograd Function `SwiGLUFunction`,
the checks (`check_swiglu`) and `swiglu_reference` (float64). The entry point `swiglu(a, b)` is in `api.py`
(`course_lib.fused.swiglu`).
"""

from __future__ import annotations

import torch

from .. import runtime
from ..checks import accumulator_dtype, check_dtype, check_kernel_device
from ..kernels import bound
from ..runtime import tl, triton
from ..second_derivative import refuse_second_derivative
from .rms_norm import as_rows

runtime.require_triton()

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BLOCK = 1024  # columns of a program's tile (fewer where the rows are shorter)
# Elements of a program's tile (4 warps). H200, bf16, graph replays, forward / backward us at 3280 x 2816 (a serving
# step's MLP), 16384 x 8192, 4096 x 14336, tiles of 1024 / 2048 / 4096 / 8192: 16.4 / 16.6 / 18.6 / 22.8 and 24.4 /
# 24.3 / 25.0 / 31.0; 192.8 / 193.3 / 196.2 / 211.3 and 327.2 / 326.9 / 327.4 / 385.0; 85.8 / 85.7 / 88.9 / 96.3
# and 144.1 / 144.1 / 144.6 / 171.6 (2026-11-30; PyTorch's silu(a) * b forward 24.5, 322.5, 144.3). 2048 keeps
# the interpreter's program count (it runs them one by one) half of 1024's.
TILE = 2048
# Contiguous a and b (separate W1 and W3 matmuls, as in training) take the flat kernels: FLAT_BLOCK elements a
# program. GB/s at 4096 x 14336 / 16384 x 14336, forward and backward (H200, bf16, graph replays, 2026-11-30): the 2-D
# tiles 4116 / 4170 and 4080 / 4108, flat 4308 / 4367 and 4297 / 4322, torch.compile's kernel 4363 / 4389 forward.
FLAT_BLOCK = 1024
WARPS = 4


@triton.jit
def _gate(a, b):
    """silu(a) * b = a * sigmoid(a) * b, in a's and b's (accumulator) dtype."""
    return a / (1.0 + tl.exp(-a)) * b


@triton.jit
def _gate_grads(a, b, dy):
    """(da, db) of the gate: dy * b * s * (1 + a (1 - s)) and dy * a * s, s = sigmoid(a)."""
    s = 1.0 / (1.0 + tl.exp(-a))
    return dy * b * s * (1.0 + a * (1.0 - s)), dy * a * s


@triton.jit
def swiglu_flat_fwd_kernel(a_ptr, b_ptr, y_ptr, n, BLOCK: tl.constexpr, ACC_64: tl.constexpr):
    """y = silu(a) * b over BLOCK elements of contiguous a, b, y (n elements each)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc_ty = tl.float64 if ACC_64 else tl.float32
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(acc_ty)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(acc_ty)
    tl.store(y_ptr + offs, _gate(a, b).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_flat_bwd_kernel(
    a_ptr, b_ptr, dy_ptr, da_ptr, db_ptr, n, BLOCK: tl.constexpr, ACC_64: tl.constexpr
):
    """da, db over BLOCK elements of contiguous a, b, dy, da, db."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc_ty = tl.float64 if ACC_64 else tl.float32
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(acc_ty)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(acc_ty)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(acc_ty)
    da, db = _gate_grads(a, b, dy)
    tl.store(da_ptr + offs, da.to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + offs, db.to(db_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tile_of_program(n_rows, n_cols, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """(rows (ROWS,) int64, cols (BLOCK,), mask (ROWS, BLOCK)) of this program's tile: row tiles on the grid's first
    axis, column blocks on its second."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    return rows, cols, (rows < n_rows)[:, None] & (cols < n_cols)[None, :]


@triton.jit
def swiglu_fwd_kernel(
    a_ptr, b_ptr, y_ptr, n_rows, n_cols, stride_a, stride_b, stride_y,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, ACC_64: tl.constexpr,
):  # fmt: skip
    """y = silu(a) * b over this program's (ROWS, BLOCK) tile."""
    rows, cols, mask = _tile_of_program(n_rows, n_cols, ROWS, BLOCK)
    acc_ty = tl.float64 if ACC_64 else tl.float32
    a = tl.load(a_ptr + rows[:, None] * stride_a + cols[None, :], mask=mask, other=0.0).to(acc_ty)
    b = tl.load(b_ptr + rows[:, None] * stride_b + cols[None, :], mask=mask, other=0.0).to(acc_ty)
    y = _gate(a, b)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(
    a_ptr, b_ptr, dy_ptr, da_ptr, db_ptr, n_rows, n_cols, stride_a, stride_b, stride_dy, stride_da, stride_db,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, ACC_64: tl.constexpr,
):  # fmt: skip
    """da = dy * b * s * (1 + a (1 - s)), db = dy * a * s (s = sigmoid(a)) over a (ROWS, BLOCK) tile."""
    rows, cols, mask = _tile_of_program(n_rows, n_cols, ROWS, BLOCK)
    acc_ty = tl.float64 if ACC_64 else tl.float32
    a = tl.load(a_ptr + rows[:, None] * stride_a + cols[None, :], mask=mask, other=0.0).to(acc_ty)
    b = tl.load(b_ptr + rows[:, None] * stride_b + cols[None, :], mask=mask, other=0.0).to(acc_ty)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(acc_ty)
    da, db = _gate_grads(a, b, dy)
    tl.store(da_ptr + rows[:, None] * stride_da + cols[None, :], da.to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + rows[:, None] * stride_db + cols[None, :], db.to(db_ptr.dtype.element_ty), mask=mask)


def _tile(n_rows: int, n_cols: int) -> tuple[tuple[int, int], int, int]:
    """(grid, ROWS, BLOCK): BLOCK columns (at most `BLOCK`), as many rows as make a tile of `TILE` elements."""
    block = min(BLOCK, runtime.next_power_of_2(max(n_cols, 1)))
    rows = min(max(TILE // block, 1), runtime.next_power_of_2(max(n_rows, 1)))
    return (runtime.cdiv(n_rows, rows), runtime.cdiv(n_cols, block)), rows, block


def swiglu_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b for checked a, b (..., F) of one shape and dtype: y (..., F) contiguous, a's dtype."""
    y = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    if y.numel() == 0:
        return y
    acc_64 = accumulator_dtype(a.dtype) == torch.float64
    if a.is_contiguous() and b.is_contiguous():
        n = y.numel()
        bound.launch(swiglu_flat_fwd_kernel, (runtime.cdiv(n, FLAT_BLOCK),), a, b, y, n,
                     BLOCK=FLAT_BLOCK, ACC_64=acc_64, num_warps=WARPS)  # fmt: skip
        return y
    a2, b2, y2 = as_rows(a), as_rows(b), y.view(-1, a.shape[-1])
    grid, rows, block = _tile(*a2.shape)
    bound.launch(swiglu_fwd_kernel, grid,
        a2, b2, y2, *a2.shape, a2.stride(0), b2.stride(0), y2.stride(0),
        ROWS=rows, BLOCK=block, ACC_64=acc_64, num_warps=WARPS,
    )  # fmt: skip
    return y


def swiglu_backward(a: torch.Tensor, b: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db), each (..., F) contiguous in a's dtype, for y = silu(a) * b and its gradient dy."""
    da = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    db = torch.empty_like(da)
    if da.numel() == 0:
        return da, db
    acc_64 = accumulator_dtype(a.dtype) == torch.float64
    if a.is_contiguous() and b.is_contiguous() and dy.is_contiguous():
        n = da.numel()
        bound.launch(swiglu_flat_bwd_kernel, (runtime.cdiv(n, FLAT_BLOCK),), a, b, dy, da, db, n,
                     BLOCK=FLAT_BLOCK, ACC_64=acc_64, num_warps=WARPS)  # fmt: skip
        return da, db
    a2, b2, dy2 = as_rows(a), as_rows(b), as_rows(dy)
    da2, db2 = da.view(-1, a.shape[-1]), db.view(-1, a.shape[-1])
    grid, rows, block = _tile(*a2.shape)
    bound.launch(swiglu_bwd_kernel, grid,
        a2, b2, dy2, da2, db2, *a2.shape,
        a2.stride(0), b2.stride(0), dy2.stride(0), da2.stride(0), db2.stride(0),
        ROWS=rows, BLOCK=block, ACC_64=acc_64, num_warps=WARPS,
    )  # fmt: skip
    return da, db


class SwiGLUFunction(torch.autograd.Function):
    """Differentiable fused gate: `SwiGLUFunction.apply(a, b)` = silu(a) * b for checked a, b (see `swiglu`)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return swiglu_forward(a, b)

    @staticmethod
    def backward(ctx, dy):
        a, b = ctx.saved_tensors
        da, db = swiglu_backward(a, b, dy.to(a.dtype))
        return refuse_second_derivative(
            (da, db), (dy, a, b), "course_lib's swiglu", "swiglu_reference (PyTorch ops)"
        )


def check_swiglu(a, b) -> None:
    """a and b: tensors of one shape (at least 1-D), dtype (float16, bfloat16, float32, float64) and device (a
    CUDA GPU, or the CPU under Triton's interpreter); a TypeError or ValueError naming what is wrong."""
    where = "swiglu"
    check_kernel_device(where, a=a, b=b)  # tensors, on the kernels' device
    for name, t in (("a", a), ("b", b)):
        if t.dim() == 0:
            raise ValueError(f"{where}: {name} must have at least one dim (..., F), got a 0-d tensor")
        check_dtype(where, name, t, DTYPES)
    if a.shape != b.shape:
        raise ValueError(
            f"{where}: a and b must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if a.dtype != b.dtype:
        raise ValueError(f"{where}: a and b must have the same dtype, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"{where}: a and b must be on the same device, got {a.device} and {b.device}")


def swiglu_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b in float64 (the ground truth the tests compare with)."""
    a64 = a.double()
    return a64 * torch.sigmoid(a64) * b.double()
