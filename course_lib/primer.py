"""The finished kernels of the Triton primer (notebook 05): vector add, row-wise weighted sum, row softmax.

Each kernel uses plain pointer arithmetic and masks, so it runs compiled on a GPU and through the
interpreter on a CPU (see `course_lib.runtime`). A *program* is one instance of a kernel: it owns a
block of elements, keeps it in registers (the compiler may stage it through the SM's shared memory,
SRAM), and talks to HBM only through `tl.load` / `tl.store`.

Public functions:
- `add(x, y, block_size=1024)`: x + y, one block of elements per program.
- `weighted_sum(x, weight)`: (x * weight).sum(-1), differentiable (`WeightedSum`, an autograd.Function);
  its backward reduces the weight gradient across programs.
- `softmax(x)`: softmax over the last dim, one row per program, fused (one read, one write).
"""

from __future__ import annotations

import torch

from . import runtime
from .checks import accumulator_dtype, check_dtype, check_tensor
from .runtime import tl, triton

runtime.require_triton()

HALF_AND_SINGLE = (torch.float16, torch.bfloat16, torch.float32)
WITH_DOUBLE = (*HALF_AND_SINGLE, torch.float64)
MAX_SOFTMAX_COLS = 1 << 16  # one row must fit in one program's registers


def _check_tensors(where: str, dtypes: tuple[torch.dtype, ...], **tensors: torch.Tensor) -> None:
    """Kind, dtype and device checks shared by the primer's public functions."""
    for name, t in tensors.items():
        check_tensor(where, name, t)
        check_dtype(where, name, t, dtypes)
        if t.device.type != runtime.DEVICE.type:
            raise ValueError(
                f"{where}: {name} is on {t.device} but Triton kernels run on {runtime.DEVICE} here "
                f"(move it with .to(course_lib.DEVICE))"
            )


# ----------------------------------------------------------------------------------------------------
# Vector add
# ----------------------------------------------------------------------------------------------------


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    """out = x + y. One program handles BLOCK_SIZE consecutive elements; the mask covers the ragged end."""
    pid = tl.program_id(axis=0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements  # the last block may run past the end
    x = tl.load(x_ptr + offsets, mask=mask)  # HBM -> registers: BLOCK_SIZE elements
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)  # registers -> HBM


def add(x: torch.Tensor, y: torch.Tensor, block_size: int = 1024) -> torch.Tensor:
    """Element-wise x + y with a Triton kernel: one program per `block_size` elements (a power of two).

    x, y: same shape, dtype and device (contiguous copies are made). Returns a tensor like x."""
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        raise TypeError("add: x and y must be torch.Tensors")
    if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
        raise ValueError(
            "add: x and y must match in shape, dtype and device; got "
            f"x {tuple(x.shape)} {x.dtype} {x.device}, y {tuple(y.shape)} {y.dtype} {y.device}"
        )
    if x.device.type != runtime.DEVICE.type:
        raise ValueError(f"add: tensors are on {x.device} but Triton kernels run on {runtime.DEVICE} here")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"add: block_size must be a power of two (tl.arange needs one), got {block_size}")
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    grid = (triton.cdiv(n, block_size),)
    add_kernel[grid](x, y, out, n, BLOCK_SIZE=block_size)
    return out


# ----------------------------------------------------------------------------------------------------
# Row-wise weighted sum: out[i] = sum_c x[i, c] * w[c]
# ----------------------------------------------------------------------------------------------------


@triton.jit
def weighted_sum_fwd_kernel(
    x_ptr, w_ptr, out_ptr, n_rows, n_cols, stride_xr, stride_xc, ROWS: tl.constexpr, BLOCK_D: tl.constexpr
):
    """out[i] = sum_c x[i, c] * w[c] for ROWS rows per program, walking the columns BLOCK_D at a time.

    The accumulator has out's dtype (float32, or float64 for float64 inputs) and lives in registers;
    each x tile (ROWS x BLOCK_D) is read from HBM once."""
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    acc = tl.zeros([ROWS], dtype=out_ptr.dtype.element_ty)
    for d0 in range(0, n_cols, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        col_mask = cols < n_cols
        x = tl.load(
            x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc,
            mask=row_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(acc.dtype)
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(acc.dtype)
        acc += tl.sum(x * w[None, :], axis=1)
    tl.store(out_ptr + rows, acc, mask=row_mask)


@triton.jit
def weighted_sum_bwd_kernel(
    x_ptr,
    w_ptr,
    grad_out_ptr,
    grad_x_ptr,
    partial_grad_w_ptr,
    n_rows,
    n_cols,
    stride_xr,
    stride_xc,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """grad_x[i, c] = grad_out[i] * w[c] (written directly) and, per program p,
    partial_grad_w[p, c] = sum over its ROWS rows of grad_out[i] * x[i, c].

    The weight gradient needs a sum over *all* rows, which live in different programs: each program
    writes its partial sum to its own row of `partial_grad_w` (n_programs x n_cols, fp32/fp64 in HBM),
    and the caller adds those rows up afterwards. No two programs write the same address."""
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    acc_dtype = partial_grad_w_ptr.dtype.element_ty
    g = tl.load(grad_out_ptr + rows, mask=row_mask, other=0.0).to(acc_dtype)
    for d0 in range(0, n_cols, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        col_mask = cols < n_cols
        tile_mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(
            x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=tile_mask, other=0.0
        ).to(acc_dtype)
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(acc_dtype)
        grad_x = g[:, None] * w[None, :]
        tl.store(
            grad_x_ptr + rows[:, None] * n_cols + cols[None, :],
            grad_x.to(grad_x_ptr.dtype.element_ty),
            mask=tile_mask,
        )
        tl.store(partial_grad_w_ptr + pid * n_cols + cols, tl.sum(x * g[:, None], axis=0), mask=col_mask)


class WeightedSum(torch.autograd.Function):
    """Differentiable row-wise weighted sum: `WeightedSum.apply(x, weight)`, see `weighted_sum`."""

    ROWS = 16
    BLOCK_D = 64

    @staticmethod
    def forward(ctx, x, weight):
        weight = weight.contiguous()  # the kernels read w with unit stride
        x2 = x.reshape(-1, x.shape[-1])  # (rows, D); a view when it can be
        n_rows, n_cols = x2.shape
        out = torch.empty(n_rows, device=x.device, dtype=accumulator_dtype(x.dtype))
        grid = (triton.cdiv(n_rows, WeightedSum.ROWS),)
        weighted_sum_fwd_kernel[grid](
            x2, weight, out, n_rows, n_cols, x2.stride(0), x2.stride(1),
            ROWS=WeightedSum.ROWS, BLOCK_D=WeightedSum.BLOCK_D,
        )  # fmt: skip
        ctx.save_for_backward(x, weight)
        return out.to(x.dtype).reshape(x.shape[:-1])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        n_rows, n_cols = x2.shape
        grid = (triton.cdiv(n_rows, WeightedSum.ROWS),)
        grad_x = torch.empty((n_rows, n_cols), device=x.device, dtype=x.dtype)
        partial_grad_w = torch.empty((grid[0], n_cols), device=x.device, dtype=accumulator_dtype(x.dtype))
        weighted_sum_bwd_kernel[grid](
            x2, weight, grad_out.reshape(-1).contiguous(), grad_x, partial_grad_w,
            n_rows, n_cols, x2.stride(0), x2.stride(1),
            ROWS=WeightedSum.ROWS, BLOCK_D=WeightedSum.BLOCK_D,
        )  # fmt: skip
        grad_w = partial_grad_w.sum(dim=0)  # the reduction across programs
        return grad_x.reshape(x.shape), grad_w.to(weight.dtype)


def weighted_sum(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(x * weight).sum(-1) with Triton kernels, differentiable in x and weight.

    x: (..., D), any strides; weight: (D,), contiguous or not. float16, bfloat16, float32 or float64,
    one dtype for both; accumulation in float32 (float64 for float64). Returns (...) in x's dtype."""
    _check_tensors("weighted_sum", WITH_DOUBLE, x=x, weight=weight)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(
            f"weighted_sum: x must have a non-empty last dim (..., D); got shape {tuple(x.shape)}"
        )
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weighted_sum: weight must have shape (D,) = ({x.shape[-1]},) to match x {tuple(x.shape)}; "
            f"got {tuple(weight.shape)}"
        )
    if x.dtype != weight.dtype:
        raise TypeError(f"weighted_sum: x and weight must share one dtype; got {x.dtype} and {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"weighted_sum: x is on {x.device}, weight on {weight.device}")
    return WeightedSum.apply(x, weight.contiguous())


# ----------------------------------------------------------------------------------------------------
# Fused row softmax
# ----------------------------------------------------------------------------------------------------


@triton.jit
def softmax_kernel(x_ptr, out_ptr, n_cols, stride_x_row, stride_out_row, BLOCK_SIZE: tl.constexpr):
    """One row per program: read the row once (HBM -> registers), max, exp, sum, divide, write once.

    BLOCK_SIZE is the row length rounded up to a power of two; the padding reads -inf, so it adds
    nothing to the max and exp(-inf) = 0 to the sum. Arithmetic is float32 whatever the storage dtype."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)  # safe softmax: the largest exponent is 0
    numerator = tl.exp(x)
    denominator = tl.sum(numerator, axis=0)
    y = numerator / denominator
    tl.store(out_ptr + row * stride_out_row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def softmax_num_warps(block_size: int) -> int:
    """Warps per program for a row of `block_size` elements: more threads for longer rows."""
    if block_size >= 8192:
        return 16
    if block_size >= 2048:
        return 8
    return 4


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of x (..., N) with one fused kernel: one program per row.

    float16, bfloat16 or float32 (computed in float32, returned in x's dtype); N <= 65536 (a row must
    fit in one program). Rows may be strided; the last dim is made contiguous if it is not."""
    _check_tensors("softmax", HALF_AND_SINGLE, x=x)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"softmax: x must have a non-empty last dim (..., N); got shape {tuple(x.shape)}")
    n_cols = x.shape[-1]
    if n_cols > MAX_SOFTMAX_COLS:
        raise ValueError(
            f"softmax: rows of {n_cols} elements do not fit in one program (at most {MAX_SOFTMAX_COLS}); "
            "longer rows need an online softmax over blocks (notebook 03)"
        )
    x2 = x.reshape(-1, n_cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    if out.numel() == 0:
        return out.reshape(x.shape)
    block_size = triton.next_power_of_2(n_cols)
    softmax_kernel[(x2.shape[0],)](
        x2,
        out,
        n_cols,
        x2.stride(0),
        out.stride(0),
        BLOCK_SIZE=block_size,
        num_warps=softmax_num_warps(block_size),
    )
    return out.reshape(x.shape)
