"""RMSNorm as one fused Triton kernel forward and one backward (notebook 11).

RMSNorm (Zhang & Sennrich, 2019) scales each row x (D elements) by the inverse of its root mean square,
then by a learned weight w (D,):

    rstd = 1 / sqrt(mean(x**2) + eps),    y = w * (x * rstd)

The numerics follow Hugging Face's LlamaRMSNorm exactly: the mean of squares and the scaling are computed
in float32, the normalised row x_hat = x * rstd is cast back to x's dtype, and only then multiplied by the
weight (in the promoted dtype of x and w, which is also the output's dtype). float64 inputs are computed
in float64 (for `torch.autograd.gradcheck`).

Forward: one program per ROWS rows (`launch.RMS_FORWARD`: several short rows per program, one long one).
The (ROWS, D) tile goes HBM -> registers once; the sums of squares, rstd and y are computed there; y goes
back to HBM once, and rstd (one float32 per row) is saved for the backward. Rows of more than 4096
elements go through the chunked kernel instead: one row per program in pieces, read twice, the second time
from the L2 cache (fewer registers per program, so more programs share an SM).
Bytes that must move: read x and w, write y and rstd.

Backward, with g = dy * w and x_hat = x * rstd (float32):

    dx = rstd * (g - x_hat * mean(g * x_hat))            one row at a time, in registers
    dw = sum over all rows of dy * x_hat                  a reduction across every program

dx is per row; dw needs every row. The backward is a persistent kernel: a few programs per SM
(`launch.RMS_BACKWARD`), each looping over tiles of ROWS rows (same table; row tiles pid, pid + P,
pid + 2P, ...; x and dy of a whole tile are loaded at once, and the next tile's are requested before
this one's arithmetic, so more bytes are in flight) and summing its rows' dy * x_hat in registers.
Long rows (the table's `stream`) load x and dy with evict_first and store dx with the streaming hint
(.cs): each of those bytes is touched once. On an H200 that is 3 % faster at D = 8192 and 1-7 % slower
at D = 2048 and 4096 (the measurements are in `launch`).
What each program does with its sum at the end is the `dw_mode` (notebook 11 compares them):
- "partials" (the default): program p writes its sum to row p of a (P, D) float32 buffer; a second
  reduction, `column_sum_kernel` (one program per strip of columns, walking down the P rows in a fixed
  order), adds the P rows and casts to w's dtype. No two programs touch one address: deterministic.
- "atomics": every program `tl.atomic_add`s its sum into one float32 row. One pass, but the order of
  the additions depends on scheduling, so the last bits of dw change from run to run.
- "locked": G = min(LOCKED_BUFFERS, P) buffers, each guarded by a spin lock (`tl.atomic_cas`), as in
  Triton's layer-norm tutorial: program p adds into buffer p % G while holding its lock, then the G rows
  are summed. The order within a buffer still depends on scheduling: not deterministic either. (The G
  rows are then added by the same column-sum kernel.)
Bytes that must move: read x, dy, w and rstd; write dx and dw.

Here: the kernels, `rms_norm_forward` / `rms_norm_backward` (their launches), the autograd Function
`RMSNormFunction`, the checks (`check_rms_norm`) and `rms_norm_reference` (float64, the ground truth).
The entry points `rms_norm(x, weight, eps=1e-6, dw_mode="partials")` and `RMSNorm(hidden, eps)` are in
`api.py` (`course_lib.fused.rms_norm` and `.RMSNorm`).
"""

from __future__ import annotations

import torch

from .. import runtime
from ..checks import accumulator_dtype, check_dtype, check_eps, check_kernel_device
from ..kernels import bound
from ..runtime import tl, triton
from ..second_derivative import refuse_second_derivative
from . import launch

runtime.require_triton()

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DW_MODES = ("partials", "atomics", "locked")
_MODE_ID = {mode: i for i, mode in enumerate(DW_MODES)}
LOCKED_BUFFERS = 16  # G, the number of lock-guarded dW buffers of the "locked" mode


# --------------------------------------------------------------------------------------------------
# Forward: ROWS rows per program
# --------------------------------------------------------------------------------------------------
@triton.jit
def rms_norm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, n_cols, stride_x, stride_y, eps,
    BLOCK_D: tl.constexpr, ROWS: tl.constexpr, STORE_RSTD: tl.constexpr,
):  # fmt: skip
    """y[row] = w * cast(x[row] * rstd), rstd[row] = 1 / sqrt(mean(x[row]**2) + eps), for the ROWS rows
    pid * ROWS, ... of this program.

    The (ROWS, BLOCK_D) tile (BLOCK_D >= n_cols, padding and rows past the end masked) lives in registers;
    statistics in rstd's dtype (float32, or float64 for float64 inputs). rstd is stored only when
    STORE_RSTD (a backward will need it)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    acc_ty = rstd_ptr.dtype.element_ty
    x_ptrs = x_ptr + rows[:, None] * stride_x + cols[None, :]
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(acc_ty)  # HBM -> registers, ROWS x D elements
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(acc_ty)  # D elements, from the L2 for most rows
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)  # (ROWS,)
    x_hat = (x * rstd[:, None]).to(x_ptr.dtype.element_ty)  # LlamaRMSNorm: x's dtype before the weight
    y = w[None, :] * x_hat.to(acc_ty)
    y_ptrs = y_ptr + rows[:, None] * stride_y + cols[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)  # registers -> HBM
    if STORE_RSTD:
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)  # 4 bytes per row, for the backward


@triton.jit
def rms_norm_fwd_chunked_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, stride_x, stride_y, eps, N_COLS: tl.constexpr, CHUNK: tl.constexpr,
    KEEP: tl.constexpr, STORE_RSTD: tl.constexpr,
):  # fmt: skip
    """The same result for one row per program, read in CHUNK-element pieces: for rows too long to keep
    in registers without starving the SM of programs. A first pass sums the squares (loads marked KEEP,
    "evict_last" for an x larger than the L2 twice over, `launch.keep_hint`: the row stays in the L2
    cache); a second reads the row again, from the L2 (evict_first: done with it), and writes y. HBM
    traffic is still one read of x and one write of y.

    The row length N_COLS is a compile-time constant (one compilation per hidden size, as torch.compile
    does): the loops' trip counts are known, and when CHUNK divides N_COLS no load or store needs a
    mask. Measured on an H200 (bf16, D = 8192, T = 4k): 35.0 us with the length as a run-time argument
    and masks, 33.7-34.0 us as a constant; 126.9 -> 126.3-126.6 us at T = 16k."""
    row = tl.program_id(0).to(tl.int64)
    acc_ty = rstd_ptr.dtype.element_ty
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    sum_sq = tl.zeros([CHUNK], dtype=acc_ty)
    for start in range(0, N_COLS, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        if N_COLS % CHUNK == 0:
            x = tl.load(x_row + cols, eviction_policy=KEEP)
        else:
            x = tl.load(x_row + cols, mask=cols < N_COLS, other=0.0, eviction_policy=KEEP)
        x = x.to(acc_ty)
        sum_sq += x * x
    rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / N_COLS + eps)
    for start in range(0, N_COLS, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        mask = cols < N_COLS
        if N_COLS % CHUNK == 0:
            x = tl.load(x_row + cols, eviction_policy="evict_first")
            w = tl.load(w_ptr + cols, eviction_policy="evict_last")
        else:
            x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_first")
            w = tl.load(w_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last")
        x_hat = (x.to(acc_ty) * rstd).to(x_ptr.dtype.element_ty)  # LlamaRMSNorm: x's dtype before the weight
        y = (w.to(acc_ty) * x_hat.to(acc_ty)).to(y_ptr.dtype.element_ty)
        if N_COLS % CHUNK == 0:
            tl.store(y_row + cols, y)
        else:
            tl.store(y_row + cols, y, mask=mask)
    if STORE_RSTD:
        tl.store(rstd_ptr + row, rstd)


# --------------------------------------------------------------------------------------------------
# Backward: persistent programs, dx per row, dw summed in registers then reduced across programs
# --------------------------------------------------------------------------------------------------
@triton.jit
def _dw_to_buffer(dw_ptr, lock_ptr, dw, cols, mask, n_cols, n_buffers, DW_MODE: tl.constexpr):
    """Hand this program's dW sum (registers, BLOCK_D floats) to HBM, in one of the three ways."""
    pid = tl.program_id(0)
    if DW_MODE == 0:  # partials: my own row of the (P, D) buffer; nobody else writes it
        tl.store(dw_ptr + pid * n_cols + cols, dw, mask=mask)
    elif DW_MODE == 1:  # atomics: everyone adds into the one row; the hardware orders the additions
        tl.atomic_add(dw_ptr + cols, dw, mask=mask)
    else:  # locked: buffer pid % G, read-add-write while holding its lock
        buf = pid % n_buffers
        lock = lock_ptr + buf
        while tl.atomic_cas(lock, 0, 1) == 1:
            pass
        ptrs = dw_ptr + buf * n_cols + cols
        tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + dw, mask=mask)
        tl.debug_barrier()  # every thread's store is done before the lock is released
        tl.atomic_xchg(lock, 0)


@triton.jit
def _load_tile(
    x_ptr, dy_ptr, first, n_rows, cols, col_mask, stride_x, stride_dy, ROWS: tl.constexpr, STREAM: tl.constexpr
):  # fmt: skip
    """The (ROWS, BLOCK_D) tiles of x and dy whose first row is `first`, in their own dtype (rows past
    n_rows read as zeros). STREAM: marked evict_first (read once; the L2 cache need not keep them)."""
    rows = first + tl.arange(0, ROWS)
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    x_ptrs = x_ptr + rows[:, None] * stride_x + cols[None, :]
    dy_ptrs = dy_ptr + rows[:, None] * stride_dy + cols[None, :]
    if STREAM:
        x = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
        dy = tl.load(dy_ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(x_ptrs, mask=mask, other=0.0)
        dy = tl.load(dy_ptrs, mask=mask, other=0.0)
    return x, dy


@triton.jit
def rms_norm_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_ptr,
    lock_ptr,
    n_rows,
    n_cols,
    stride_dy,
    stride_x,
    stride_dx,
    n_buffers,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    DW_MODE: tl.constexpr,
    STREAM: tl.constexpr,
):
    """dx for the row tiles starting at pid * ROWS, (pid + P) * ROWS, ... (P programs), and this program's
    share of dw.

    Per loop step: a (ROWS, BLOCK_D) tile of x and of dy HBM -> registers (loaded together: ROWS times the
    bytes in flight of a row-at-a-time loop), ROWS floats of rstd, the dx tile registers -> HBM. The
    loads run one tile ahead (software pipelining by hand): the next tile's x and dy are requested before
    this tile's arithmetic and store, so the memory system always has a tile in flight. w is loaded once
    per program; the dW sum stays in registers, (ROWS, BLOCK_D), until the loop ends."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * ROWS
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < n_cols
    acc_ty = dw_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(acc_ty)
    dw = tl.zeros([ROWS, BLOCK_D], dtype=acc_ty)
    x, dy = _load_tile(
        x_ptr, dy_ptr, tl.cast(pid * ROWS, tl.int64), n_rows, cols, col_mask, stride_x, stride_dy, ROWS, STREAM
    )  # fmt: skip
    for first in range(pid * ROWS, n_rows, step):
        rows = tl.cast(first, tl.int64) + tl.arange(0, ROWS)
        row_mask = rows < n_rows
        x_next, dy_next = _load_tile(
            x_ptr, dy_ptr, tl.cast(first + step, tl.int64), n_rows, cols, col_mask, stride_x, stride_dy, ROWS,
            STREAM,
        )  # fmt: skip
        # (the next tile: in flight while this one is computed and stored; masked off past the end)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
        x_hat = x.to(acc_ty) * rstd
        dy32 = dy.to(acc_ty)
        g = dy32 * w[None, :]
        dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=1) / n_cols)[:, None])
        dx_ptrs = dx_ptr + rows[:, None] * stride_dx + cols[None, :]
        dx_mask = row_mask[:, None] & col_mask[None, :]
        if STREAM:  # written once, not read again here: a streaming store (.cs)
            tl.store(dx_ptrs, dx.to(dx_ptr.dtype.element_ty), mask=dx_mask, cache_modifier=".cs")
        else:
            tl.store(dx_ptrs, dx.to(dx_ptr.dtype.element_ty), mask=dx_mask)
        dw += dy32 * x_hat.to(x_ptr.dtype.element_ty).to(acc_ty)  # the weight multiplied the cast x_hat
        x, dy = x_next, dy_next
    _dw_to_buffer(dw_ptr, lock_ptr, tl.sum(dw, axis=0), cols, col_mask, n_cols, n_buffers, DW_MODE)


@triton.jit
def column_sum_kernel(buf_ptr, out_ptr, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """out[c] = sum over r of buf[r, c] for this program's BLOCK_C columns, cast to out's dtype.

    The second reduction of dW: buf is the (P, D) float32 partial sums (in the L2 cache, just written).
    Each program walks down its column strip a (BLOCK_R, BLOCK_C) tile at a time, adding in a fixed order:
    deterministic."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=buf_ptr.dtype.element_ty)
    for first in range(0, n_rows, BLOCK_R):
        rows = first + tl.arange(0, BLOCK_R)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        acc += tl.load(buf_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=col_mask)


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------
def as_rows(t: torch.Tensor) -> torch.Tensor:
    """t (..., D) as a (rows, D) matrix whose last dim is contiguous (a view when it can be); `swiglu` reads its
    strided inputs so too."""
    t2 = t if t.dim() == 2 else t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 or t2.shape[0] == 0 else t2.contiguous()


def _power_of_two(name: str, value: int) -> int:
    if value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 1, got {value}")
    return value


def rms_norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    rows: int | None = None,
    warps: int | None = None,
    chunk: int | None = None,
    store_rstd: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward kernel alone, on x (..., D) float16/bfloat16/float32 (float64 under the interpreter)
    and weight (D,): returns (y (..., D) in promote(x, w) dtype, rstd (rows,) float32, float64 for
    float64 inputs), rows = the product of x's leading dims.

    `rows` (rows per program, a power of two), `warps` and `chunk` default to `launch.rms_forward`; pass
    them to try other launch settings. chunk = 0: `rms_norm_fwd_kernel` (whole rows in registers);
    chunk > 0 (a power of two): `rms_norm_fwd_chunked_kernel`, one row per program in pieces of that
    many elements (`rows` does not apply). store_rstd=False (no backward will follow): rstd is not
    written and None is returned in its place; torch.compile's inference graph of the eager code writes
    none either."""
    x2 = as_rows(x)
    weight = weight.contiguous()  # read with unit stride (a strided or expanded weight is copied)
    n_rows, n_cols = x2.shape
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    # y contiguous in x's shape: rows n_cols apart, read by the kernel as (n_rows, n_cols), returned as it is
    y = torch.empty(x.shape, device=x.device, dtype=out_dtype)
    rstd = torch.empty(n_rows if store_rstd else 1, device=x.device, dtype=accumulator_dtype(x.dtype))
    if n_rows:
        block = runtime.next_power_of_2(n_cols)
        setting = launch.rms_forward(block)
        chunk = setting.chunk if chunk is None else chunk
        if chunk:
            bound.launch(rms_norm_fwd_chunked_kernel, (n_rows,),
                x2, weight, y, rstd, x2.stride(0), n_cols, eps,
                N_COLS=n_cols, CHUNK=_power_of_two("chunk", chunk), KEEP=launch.keep_hint(x2.nbytes, x.device),
                STORE_RSTD=store_rstd, num_warps=warps or setting.warps,
            )  # fmt: skip
        else:
            rows = _power_of_two("rows", rows or setting.rows)
            bound.launch(rms_norm_fwd_kernel, (runtime.cdiv(n_rows, rows),),
                x2, weight, y, rstd, n_rows, n_cols, x2.stride(0), n_cols, eps,
                BLOCK_D=block, ROWS=rows, STORE_RSTD=store_rstd, num_warps=warps or setting.warps,
            )  # fmt: skip
    return y, rstd if store_rstd else None


def column_sum(
    buffer: torch.Tensor, dtype: torch.dtype, tile: launch.ColumnSumTile | None = None
) -> torch.Tensor:
    """Sum a (P, D) buffer over its rows with `column_sum_kernel`: returns (D,) in `dtype`; deterministic.

    `tile` defaults to `launch.COLUMN_SUM`."""
    tile = tile or launch.COLUMN_SUM
    buffer = buffer.contiguous()  # the kernel reads row r at buf + r * D
    n_rows, n_cols = buffer.shape
    out = torch.empty(n_cols, device=buffer.device, dtype=dtype)
    grid = (runtime.cdiv(n_cols, tile.block_c),)
    bound.launch(
        column_sum_kernel, grid, buffer, out, n_rows, n_cols,
        BLOCK_R=tile.block_r, BLOCK_C=tile.block_c, num_warps=tile.warps,
    )  # fmt: skip
    return out


DW_SUMS = ("triton", "torch")  # how the dW partial rows are added: column_sum_kernel, or torch.sum(dim=0)


def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    dw_mode: str = "partials",
    *,
    rows: int | None = None,
    programs_per_sm: int | None = None,
    warps: int | None = None,
    stream: bool | None = None,
    dw_sum: str = "triton",
    column_tile: launch.ColumnSumTile | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward kernel and the dW reduction, for dy and x (..., D), weight (D,) and the forward's
    rstd (rows,): returns (dx like x, dw like weight). dw_mode: one of DW_MODES, "partials", "atomics"
    or "locked" (notebook 11 compares them).

    Launch settings, defaults from `launch.rms_backward`: `rows` per loop step, `programs_per_sm`,
    `warps`; `dw_sum` picks the second reduction of the partial rows ("triton": `column_sum`, tile
    `column_tile`; "torch": `sum(dim=0)`)."""
    if dw_sum not in DW_SUMS:
        raise ValueError(f"rms_norm_backward: dw_sum must be one of {DW_SUMS}, got {dw_sum!r}")
    x2, dy2 = as_rows(x), as_rows(dy)
    weight, rstd = weight.contiguous(), rstd.contiguous()  # read with unit stride, as in the forward
    n_rows, n_cols = x2.shape
    acc = accumulator_dtype(x.dtype)
    dx = torch.empty((n_rows, n_cols), device=x.device, dtype=x.dtype)
    if n_rows == 0:
        return dx.reshape(x.shape), torch.zeros_like(weight)
    block = runtime.next_power_of_2(n_cols)
    setting = launch.rms_backward(block)
    rows = _power_of_two("rows", rows or setting.rows)
    n_programs = launch.persistent_programs(runtime.cdiv(n_rows, rows), block, x.device, programs_per_sm)
    n_buffers = {"partials": n_programs, "atomics": 1, "locked": min(LOCKED_BUFFERS, n_programs)}[dw_mode]
    empty_or_zeros = torch.empty if dw_mode == "partials" else torch.zeros
    dw_buffer = empty_or_zeros((n_buffers, n_cols), device=x.device, dtype=acc)
    # the locks only where they are taken: zeroing them is one more kernel launch
    locks = torch.zeros(n_buffers, device=x.device, dtype=torch.int32) if dw_mode == "locked" else dw_buffer
    bound.launch(rms_norm_bwd_kernel, (n_programs,),
        dy2, x2, weight, rstd, dx, dw_buffer, locks,
        n_rows, n_cols, dy2.stride(0), x2.stride(0), dx.stride(0), n_buffers,
        BLOCK_D=block, ROWS=rows, DW_MODE=_MODE_ID[dw_mode], num_warps=warps or setting.warps,
        STREAM=setting.stream if stream is None else bool(stream),
    )  # fmt: skip
    if dw_sum == "triton":  # the second reduction (P or G rows), and the cast to w's dtype, in one kernel
        dw = column_sum(dw_buffer, weight.dtype, column_tile)
    else:
        dw = (dw_buffer.sum(dim=0) if n_buffers > 1 else dw_buffer[0]).to(weight.dtype)
    return dx.reshape(x.shape), dw


class RMSNormFunction(torch.autograd.Function):
    """Differentiable fused RMSNorm: `RMSNormFunction.apply(x, weight, eps, dw_mode)`; see `rms_norm`."""

    @staticmethod
    def forward(ctx, x, weight, eps, dw_mode):
        y, rstd = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.dw_mode = dw_mode
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, weight, rstd, ctx.dw_mode)
        dx, dw = refuse_second_derivative(
            (dx, dw), (dy, x, weight), "course_lib's rms_norm", "rms_norm_reference (PyTorch ops)"
        )
        return dx, dw, None, None


def check_rms_norm(x, weight, eps, dw_mode) -> None:
    where = "rms_norm"
    check_kernel_device(where, x=x, weight=weight)
    for name, t in (("x", x), ("weight", weight)):
        check_dtype(where, name, t, DTYPES)
    if weight.dtype == torch.float64 and x.dtype != torch.float64:
        # the kernels compute in x's accumulator (float32): y would be float64 with float32 digits
        raise TypeError(
            f"{where}: a float64 weight needs a float64 x (the kernels multiply by the weight in float32 "
            f"for x in {launch.dtype_name(x.dtype)}); got x {launch.dtype_name(x.dtype)}: cast the weight "
            "to x's dtype or to float32, or pass both in float64"
        )
    if x.device != weight.device:
        raise ValueError(f"{where}: x is on {x.device} but weight is on {weight.device}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{where}: x must be (..., D) with D >= 1; got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(
            f"{where}: weight must have shape (D,) = ({x.shape[-1]},) to match x {tuple(x.shape)}; "
            f"got {tuple(weight.shape)}"
        )
    if x.shape[-1] > launch.MAX_ROW:
        raise ValueError(
            f"{where}: hidden size {x.shape[-1]} is over {launch.MAX_ROW}, the longest row one program holds"
        )
    check_eps(where, "eps", eps)
    if dw_mode not in DW_MODES:
        raise ValueError(f"{where}: dw_mode must be one of {DW_MODES}, got {dw_mode!r}")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm in float64 on the CPU, without intermediate casts: the ground truth tests compare with.

    x: (..., D), weight: (D,), any float dtypes. Returns float64 (..., D), differentiable in x and
    weight (so reference gradients come from autograd)."""
    x64, w64 = x.double().cpu(), weight.double().cpu()
    return w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
