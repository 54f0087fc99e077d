"""The backward's D pass (notebook 07): D = rowsum(dO * O), one float per query row, read by every dS = P (dP - D).

The Triton dQ kernel computes D itself (`backward`, FUSE_D); this pass runs alone where another kernel reads D
first: the atomic dQ mode, the Gluon dQ kernel (`hopper_dq`), and the one-pass backward (`hopper_onepass`), for
which it also writes L2 = L log2 e, both padded to whole 64-row steps, so that the kernel's producer warp can load
them by TMA, and zeroes the float32 dQ accumulator the kernel adds into (one launch fewer a call: host time).
"""

from __future__ import annotations

import torch

from .. import runtime
from ..kernels import bound
from ..kernels.blocks import program_block, row_mask
from ..kernels.softmax import LOG2E
from ..runtime import tl, triton
from .configs import PREPROCESS
from .inputs import kernel_flags, strides4

__all__ = ["preprocess", "preprocess_kernel", "preprocess_launch"]


@triton.jit
def preprocess_kernel(
    O, DO, Dlt, L, L2, ACC,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_lb, stride_lh, stride_lm,
    H, N_Q, N_OUT, ACC_ROWS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, UPCAST: tl.constexpr,
    ACC_DTYPE: tl.constexpr, BASE2: tl.constexpr, ZERO_ACC: tl.constexpr,
):  # fmt: skip
    """D[z, rows] = sum over d of dO * O for one block of BLOCK_M rows: reads 2 * BLOCK_M * d
    elements, writes BLOCK_M floats (D is contiguous, (B * H, N_OUT), N_OUT >= N_Q rows a head: 0 past N_Q).
    BASE2: also L2 = L log2 e into L2 (laid out as D), +inf past N_Q and where L = -inf (a row that saw no
    key), for a kernel that loads both by TMA (`hopper_onepass`); else L and L2 are not read. ZERO_ACC: also zeroes
    this block's rows of ACC, (ACC_ROWS, HEAD_DIM) float32 whose row (b * H + h) * N_Q + i is query row i of head
    (b, h) (rows past ACC_ROWS are not there: the accumulator may hold the first heads only); else ACC is not
    touched."""
    off_b, off_h, m_start = program_block(N_OUT, H, BLOCK_M, False, False)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = row_mask(offs_m, N_Q, offs_d, HEAD_DIM, BLOCK_D)
    o_ptrs = (
        O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    )
    do_ptrs = (
        DO
        + off_b * stride_dob
        + off_h * stride_doh
        + offs_m[:, None] * stride_dom
        + offs_d[None, :] * stride_dod
    )
    o = tl.load(o_ptrs, mask=mask, other=0.0)
    do = tl.load(do_ptrs, mask=mask, other=0.0)
    delta = tl.sum(o.to(ACC_DTYPE) * do.to(ACC_DTYPE), axis=1)
    out = (off_b * H + off_h) * N_OUT + offs_m
    tl.store(Dlt + out, delta, mask=offs_m < N_OUT)
    if BASE2:
        lse = tl.load(L + off_b * stride_lb + off_h * stride_lh + offs_m * stride_lm, mask=offs_m < N_Q,
                      other=float("-inf"))  # fmt: skip
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
        tl.store(L2 + out, lse2, mask=offs_m < N_OUT)
    if ZERO_ACC:
        acc_rows = (off_b * H + off_h) * N_Q + offs_m
        keep = (offs_m < N_Q) & (acc_rows < ACC_ROWS)
        acc_ptrs = ACC + acc_rows.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
        zeros = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        tl.store(acc_ptrs, zeros, mask=keep[:, None] & (offs_d[None, :] < HEAD_DIM))


def preprocess_launch(
    o4, do4, delta, B: int, H: int, n_q: int, d: int, dtype: torch.dtype, l3=None, l2=None, acc=None
) -> tuple:
    """The D pass's launch, `preprocess_kernel` (grid, arguments, constants): D = rowsum(dO * O) into delta
    (B * H, n_out) float32, n_out = delta's columns >= n_q (zeros past n_q), for o4, do4 (B, H, n_q, d) of
    `dtype`, any strides. What the atomic dQ and the Gluon dQ read. With l3 (B, H, n_q), the forward's L, also
    L2 = L log2 e into l2 (as delta; +inf past n_q and where L = -inf): the one-pass backward's (`hopper_onepass`).
    With acc (rows, d) float32, contiguous, rows <= B * H * n_q in dQ's row order: zeroed too (ZERO_ACC)."""
    pre, flags = PREPROCESS.current(), kernel_flags(dtype)
    n_out = delta.shape[-1]
    grid = (runtime.cdiv(n_out, pre.block_m) * B * H,)
    base2 = l3 is not None
    lse, lse2 = (l3, l2) if base2 else (delta, delta)  # stand-ins, not read
    l_strides = l3.stride() if base2 else (0, 0, 0)
    zero_acc = acc is not None
    if zero_acc and (acc.dtype != torch.float32 or not acc.is_contiguous() or acc.shape[-1] != d):
        raise ValueError(f"the D pass zeroes a contiguous (rows, {d}) float32 accumulator, got {tuple(acc.shape)} "
                         f"{acc.dtype}")  # fmt: skip
    acc_rows = acc.numel() // d if zero_acc else 0
    args = (o4, do4, delta, lse, lse2, acc if zero_acc else delta, *strides4(o4), *strides4(do4), *l_strides, H,
            n_q, n_out, acc_rows)  # fmt: skip
    meta = dict(
        HEAD_DIM=d, BLOCK_D=max(16, runtime.next_power_of_2(d)), **pre.kwargs(),
        UPCAST=flags["UPCAST"], ACC_DTYPE=flags["ACC_DTYPE"], BASE2=base2, ZERO_ACC=zero_acc,
    )  # fmt: skip
    return grid, args, meta


def preprocess(o4, do4, delta, dtype: torch.dtype, l3=None, l2=None, acc=None) -> None:
    """The D pass launched (`preprocess_launch`): D = rowsum(dO * O) into delta (B * H, n_out) float32 for o4, do4
    (B, H, n_q, d) of `dtype`; with l3, L2 into l2 too; with acc, acc zeroed. The one-pass backward's first launch
    (`hopper_onepass`) and the probes'."""
    B, H, n_q, d = o4.shape
    grid, args, meta = preprocess_launch(o4, do4, delta, B, H, n_q, d, dtype, l3, l2, acc)
    bound.launch(preprocess_kernel, grid, *args, **meta)
