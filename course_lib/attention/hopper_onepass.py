"""FlashAttention-3's one-pass backward on Hopper GPUs, in Gluon, in its transposed layout: dK, dV and dQ from one
kernel (notebook 08c, sections 5 and 7). The backward's default at d = 64 from 4096 tokens, 2048 causal or
grouped, and at d = 128 from 2048 causal, 8192 with one query head a K/V head (`choose`).

The two-kernel backward (`hopper_backward` or the Triton kernel for dK, dV; a dQ kernel) computes S and dP twice:
7 products where the algorithm needs 5. Here one kernel makes all three gradients, as FlashAttention-3 does (Shah
et al. 2024, section 3.3), with its tiles transposed (its `flash_bwd_launch_template.h`, `Mma_dKV_is_RS`). Per
consumer warpgroup (64 keys of the program's 128, dK and dV in registers) and step (64 query rows):

    S^T  = K_w Q^T,  dP^T = V_w dO^T        (64 keys x 64 queries, fp32; both operands in shared memory)
    P^T  = exp2(S^T scale log2 e - L2[q]),  masked on the causal diagonal and past N_K
    dV  += P^T dO                            (A = P^T from registers, 16 bits: no trip through shared memory)
    dS^T = P^T (dP^T - D[q])
    dK  += dS^T Q                            (A = dS^T from registers)
    dQ[:, cols_w] = dS K[:, cols_w]          (both warpgroups' dS^T tiles in shared memory, read transposed)

* L and D belong to the queries, the tiles' columns: a thread would hold 16 of each with their addresses and
  masks. The producer warp brings each step's 64 values of L2 = L log2 e (+inf past N_Q and for rows that saw no
  key: P = 0 there) and of D into shared memory by TMA with Q and dO; the D pass writes both, padded to whole
  steps (`d_pass.preprocess` with l3). Loaded into registers instead, ptxas spilled 140 bytes at d = 128 and
  serialised the wgmmas (its C7515).
* each warpgroup computes d / 2 columns of the step's dQ from both warpgroups' dS (`ds_bar`: an mbarrier between the
  two), in DQ_CHUNKS products (`dq_chunks_for`), multiplies them by the softmax scale and puts them in shared
  memory, and TMA adds them into a zeroed float32 accumulator (`cp.reduce.async.bulk.tensor ... .add`): the
  consumers never hold an address or wait for an atomic. dQ = the accumulator cast to Q's dtype afterwards. The
  kernel runs in up to 4 launches over the (batch, K/V head) pairs (`slices`), each with the accumulator of its own
  rows: a quarter of dQ's rows in float32, half dQ's bytes, not twice (a model's backward peak would otherwise rise
  by a quarter). The order of TMA's adds varies, so dQ is not bitwise deterministic:
  `torch.use_deterministic_algorithms(True)` keeps the two kernels.
* the program's block, its steps (GQA: the group's query heads in turn, dK and dV summed on chip; both causal
  alignments), the shared memory and the dK, dV store are `hopper_backward`'s.

Measured on an H200 (bf16, B x N = 16k tokens, H x d = 2048, TFLOP/s of the backward's 2.5 x forward FLOPs, the
whole backward with its D pass; `scripts/hopper_onepass_probe.py`, 2026-11-30; the same run's default of then, the
two kernels): see `choose`. Compiled for sm_90a (`scripts/gluon_spills.py`): no spills at d = 64; at d = 128 with
dQ in 2 chunks 4 / 52 bytes of spill stores non-causal / causal (12 / 60 in one launch, before `slices`; the
d = 128 figures in `choose` are that version's), where the earlier one-pass kernel, which stored
P and dS to shared memory in the untransposed layout (git history before 2026-11-30), spilled 44 / 172 and ran
at d = 64 16k 352 / 327 against this one's 407 / 374. The H200's Triton 3.6 (its ptxas; the script run there,
2026-11-30): d = 64 none; d = 128 in 1 chunk 180 / 216 bytes, in 2 chunks 8 / 52 (1 chunk still the faster without a
mask: `dq_chunks_for`). No CPU path: Gluon has no interpreter.
"""

from __future__ import annotations

import contextlib

import torch
from triton._C.libtriton import ir as _ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .. import runtime
from ..kernels import bound
from ..runtime import cdiv
from .d_pass import preprocess, preprocess_kernel, preprocess_launch  # the D pass (here also L2, padded)
from .hopper import LOG2E, descriptor, launch_options
from .hopper_backward import (
    KROWS,
    QROWS,
    QUERY_ROWS,
    load_kv,
    partition_barrier,
    program_block,
    shared_tiles,
    step_block,
    store_dkdv,
    supports,
)
from .launch import compile_in_background, compile_kernel_ahead, wait_compiled

__all__ = ["backward", "choose", "compile_ahead", "slices", "supports", "warmup"]


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA's reduce-add: global[coord ...] += the shared-memory tile src, asynchronously, as
    `tma.async_copy_shared_to_global` stores; `tma.store_wait` waits until it has read src. Gluon has the
    operation (its builder's `create_async_tma_reduce`) but no function for it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(
        _ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
    )


@gluon.jit
def _add_dq(dq, dq_c, dq_desc, row, col, PENDING: gl.constexpr):
    """A chunk of this warpgroup's columns of a step's dQ: into its shared-memory tile dq_c (once TMA has read
    what it held: at most PENDING later adds may still be reading their own tiles), then added to the
    accumulator at (row, col) by TMA."""
    tma.store_wait(PENDING)
    dq_c.store(dq)
    fence_async_shared()
    partition_barrier()
    _tma_reduce_add(dq_desc, [row, col], dq_c)


@gluon.jit
def _slice_block(num_n, BHKV, BHK0, H, GROUP, N_Q, OFFSET, CAUSAL: gl.constexpr, CTA_N: gl.constexpr):
    """`hopper_backward.program_block` in a slice of (batch, K/V head) pairs from BHK0 on: the block of the
    slice's program, its pair and first query head moved on by the slice's start."""
    bhk, n_start, lo, mid, n_m, first_head = program_block(
        num_n, BHKV, H, GROUP, N_Q, OFFSET, CAUSAL, CTA_N, QROWS
    )
    return bhk + BHK0, n_start, lo, mid, n_m, first_head + BHK0 * GROUP


@gluon.jit
def _producer(args, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr):
    """`hopper_backward`'s producer, and with each step's Q and dO its 64 values of L2 and D into the slot's
    small tiles: the consumers read them from shared memory, holding no addresses for them."""
    (q_desc, do_desc, k_desc, v_desc, l_desc, d_desc, q_smem, do_smem, k_smem, v_smem, l_smem, d_smem, kv_bar,
     ready_bar, empty_bar, H, GROUP, N_Q, N_K, OFFSET, num_n, BHKV, BHK0, N_PAD) = args  # fmt: skip
    CTA_N: gl.constexpr = KROWS * NUM_CONSUMERS
    bhk, n_start, lo, _, n_m, first_head = _slice_block(
        num_n, BHKV, BHK0, H, GROUP, N_Q, OFFSET, CAUSAL, CTA_N
    )
    load_kv(k_desc, v_desc, k_smem, v_smem, kv_bar, bhk * N_K + n_start, NUM_CONSUMERS)
    nbytes: gl.constexpr = (
        q_desc.block_type.nbytes
        + do_desc.block_type.nbytes
        + l_desc.block_type.nbytes
        + d_desc.block_type.nbytes
    )
    for step in range(GROUP * n_m):
        g, m_blk = step_block(step, lo, n_m, GROUP, CAUSAL)
        row = (first_head + g) * N_Q + m_blk * QROWS
        stat = (first_head + g) * N_PAD + m_blk * QROWS
        slot = step % NUM_STAGES
        mbarrier.wait(empty_bar.index(slot), ((step // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(ready_bar.index(slot), nbytes)
        tma.async_copy_global_to_shared(q_desc, [row, 0], ready_bar.index(slot), q_smem.index(slot))
        tma.async_copy_global_to_shared(do_desc, [row, 0], ready_bar.index(slot), do_smem.index(slot))
        tma.async_copy_global_to_shared(l_desc, [stat], ready_bar.index(slot), l_smem.index(slot))
        tma.async_copy_global_to_shared(d_desc, [stat], ready_bar.index(slot), d_smem.index(slot))


@gluon.jit
def _dq_product(ds_smem, k_smem, dq_zero, col: gl.constexpr, NUM_CONSUMERS: gl.constexpr):
    """Issue dQ[:, col ... col + C] = sum over the warpgroups c of dS_c K_c[:, col ...], dS_c read as the transpose
    of the dS^T tile warpgroup c stored (64 keys x 64 queries), C = dq_zero's columns. Returns the product's token."""
    C: gl.constexpr = dq_zero.shape[1]
    tok = warpgroup_mma(ds_smem.index(0).permute((1, 0)), k_smem.index(0).slice(col, C, dim=1), dq_zero,
                        use_acc=False, is_async=True)  # fmt: skip
    for c in gl.static_range(1, NUM_CONSUMERS):
        tok = warpgroup_mma(ds_smem.index(c).permute((1, 0)), k_smem.index(c).slice(col, C, dim=1), tok,
                            is_async=True)  # fmt: skip
    return tok


@gluon.jit
def _consumer(args, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
              NUM_CONSUMERS: gl.constexpr, WG: gl.constexpr, DQ_CHUNKS: gl.constexpr):  # fmt: skip
    """Warpgroup WG: dK, dV of keys n_start + 64 WG ... + 63 from transposed tiles, and its columns of each step's
    dQ (module docstring)."""
    (q_smem, do_smem, k_smem, v_smem, l_smem, d_smem, ds_smem, dq_smem, kv_bar, ready_bar, empty_bar, ds_bar,
     dq_full, dq_desc, DK, DV, qk_scale, sm_scale, stride_kb, stride_kh, stride_kn, H, GROUP, N_Q, N_K, OFFSET,
     num_n, BHKV, BHK0) = args  # fmt: skip
    dtype: gl.constexpr = q_smem.dtype
    CTA_N: gl.constexpr = KROWS * NUM_CONSUMERS
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, QROWS, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    C: gl.constexpr = HEAD_DIM // (NUM_CONSUMERS * DQ_CHUNKS)  # columns of a chunk of dQ
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16]
    )
    dq_zero = gl.zeros([QROWS, C], gl.float32, layout=dq_layout)
    bhk, n_start, lo, mid, n_m, first_head = _slice_block(
        num_n, BHKV, BHK0, H, GROUP, N_Q, OFFSET, CAUSAL, CTA_N
    )
    k_w = k_smem.index(WG)
    v_w = v_smem.index(WG)
    st_zero = gl.zeros([KROWS, QROWS], gl.float32, layout=st_layout)
    dk = gl.zeros([KROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([KROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    keys = n_start + WG * KROWS + gl.arange(0, KROWS, layout=gl.SliceLayout(1, st_layout))  # the tiles' rows
    offs_q = gl.arange(0, QROWS, layout=gl.SliceLayout(0, st_layout))  # their columns, from the block's first
    mbarrier.wait(kv_bar, 0)
    dk_tok = warpgroup_mma_init(dk)
    dv_tok = warpgroup_mma_init(dv)
    for step in range(GROUP * n_m):
        g, m_blk = step_block(step, lo, n_m, GROUP, CAUSAL)
        head = first_head + g  # batch * H + query head
        slot = step % NUM_STAGES
        mbarrier.wait(ready_bar.index(slot), (step // NUM_STAGES) & 1)
        q = q_smem.index(slot)
        do = do_smem.index(slot)
        st_tok = warpgroup_mma(k_w, q.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        dpt_tok = warpgroup_mma(v_w, do.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        # S^T done means the previous step's dV and dK are too (in issue order): its ring slot is free
        st, dk, dv = warpgroup_mma_wait(1, deps=[st_tok, dk_tok, dv_tok])
        if step > 0:
            mbarrier.arrive(empty_bar.index((step - 1) % NUM_STAGES), count=1)
        if CAUSAL:
            if m_blk < mid:  # key j (a row) is visible to query i (a column) when i + OFFSET >= j
                rows = m_blk * QROWS + offs_q  # the step's queries
                visible = gl.expand_dims(rows + OFFSET, 0) >= gl.expand_dims(keys, 1)
                st = gl.where(visible, st, float("-inf"))
        # keys past N_K (the next head's, or zeros) get P = 0, else dS K takes them into dQ
        if n_start + CTA_N > N_K:
            st = gl.where(gl.expand_dims(keys < N_K, 1), st, float("-inf"))
        # L2 = L log2 e, +inf for rows past N_Q (P = 0 there) and for rows that saw no key
        lse2 = l_smem.index(slot).load(gl.SliceLayout(0, st_layout))
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
        dv_tok = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), do, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=[dpt_tok])
        delta = d_smem.index(slot).load(gl.SliceLayout(0, st_layout))
        ds16 = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)  # dS^T
        dk_tok = warpgroup_mma(gl.convert_layout(ds16, op_layout), q, dk, is_async=True)
        if step > 0:  # both warpgroups' dQ products of the previous step, which read these tiles, are done
            mbarrier.wait(dq_full, (step - 1) & 1)
        ds_smem.index(WG).store(ds16)
        fence_async_shared()
        partition_barrier()
        mbarrier.arrive(ds_bar, count=1)
        mbarrier.wait(ds_bar, step & 1)  # both warpgroups' dS^T tiles of the step are in shared memory
        for c in gl.static_range(DQ_CHUNKS):  # each chunk's first column written inline (a constant)
            dq_tok = _dq_product(ds_smem, k_smem, dq_zero, (WG * DQ_CHUNKS + c) * C, NUM_CONSUMERS)
            dq = warpgroup_mma_wait(0, deps=[dq_tok])
            row = (head - BHK0 * GROUP) * N_Q + m_blk * QROWS  # in the slice's accumulator
            _add_dq(
                dq * sm_scale,
                dq_smem.index(WG * DQ_CHUNKS + c),
                dq_desc,
                row,
                (WG * DQ_CHUNKS + c) * C,
                DQ_CHUNKS - 1,
            )
        mbarrier.arrive(dq_full, count=1)  # counts the warpgroups done with the step
    dk, dv = warpgroup_mma_wait(0, deps=[dk_tok, dv_tok])
    tma.store_wait(0)
    store_dkdv(
        dk, dv, DK, DV, sm_scale, n_start + WG * KROWS, bhk, H // GROUP, N_K, stride_kb, stride_kh, stride_kn
    )


@gluon.jit(do_not_specialize=["BHKV", "BHK0"])  # each slice launches the same binary
def bwd_ws_kernel(
    q_desc, do_desc, k_desc, v_desc, l_desc, d_desc, dq_desc, DK, DV, qk_scale, sm_scale,
    stride_kb, stride_kh, stride_kn,
    H, GROUP, N_Q, N_K, OFFSET, BHKV, BHK0, N_PAD,
    CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, DQ_CHUNKS: gl.constexpr,
):  # fmt: skip
    """dQ, dK, dV for one program's 128 keys of a K/V head, in a slice of BHKV (batch, K/V head) pairs from
    BHK0 on. q_desc, do_desc, k_desc, v_desc: `hopper.descriptor`s of (B * H * N, d) matrices; l_desc, d_desc: of
    (B * H * N_PAD,) float32 vectors in blocks of 64 (L2 and D, `d_pass.preprocess` with l3; N_PAD = N_Q rounded
    up to 64); dq_desc: of the slice's zeroed float32 (BHKV * GROUP * N_Q, d) accumulator in blocks of
    (64, d / (NUM_CONSUMERS * DQ_CHUNKS)), which receives scale x the sum over key blocks of dS K. Rows of a step
    past N_Q add zeros (P = 0 there) to the next head's rows, or fall outside the slice, where TMA drops them.
    DK, DV: (B, H_KV, N_K, d) in K's dtype, strides given; grid: cdiv(N_K, 128) * BHKV."""
    CTA_N: gl.constexpr = KROWS * NUM_CONSUMERS
    num_n = gl.cdiv(N_K, CTA_N)
    # `hopper_backward`'s ring, K, V and barriers; its P tiles go unused, its dS tiles hold dS^T (64 x 64 either way)
    q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, ready_bar, empty_bar = shared_tiles(
        q_desc, do_desc, k_desc, v_desc, HEAD_DIM, NUM_STAGES, NUM_CONSUMERS, QROWS
    )
    l_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, QROWS], l_desc.layout)
    d_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, QROWS], d_desc.layout)
    C: gl.constexpr = HEAD_DIM // (NUM_CONSUMERS * DQ_CHUNKS)
    dq_smem = gl.allocate_shared_memory(gl.float32, [NUM_CONSUMERS * DQ_CHUNKS, QROWS, C], dq_desc.layout)
    ds_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ds_bar, count=NUM_CONSUMERS)
    mbarrier.init(dq_full, count=NUM_CONSUMERS)
    fence_async_shared()
    shared = (q_smem, do_smem, k_smem, v_smem, l_smem, d_smem, ds_smem, dq_smem, kv_bar, ready_bar, empty_bar,
              ds_bar, dq_full, dq_desc, DK, DV, qk_scale, sm_scale, stride_kb, stride_kh, stride_kn, H, GROUP, N_Q,
              N_K, OFFSET, num_n, BHKV, BHK0)  # fmt: skip
    loads = (q_desc, do_desc, k_desc, v_desc, l_desc, d_desc, q_smem, do_smem, k_smem, v_smem, l_smem, d_smem,
             kv_bar, ready_bar, empty_bar, H, GROUP, N_Q, N_K, OFFSET, num_n, BHKV, BHK0, N_PAD)  # fmt: skip
    gl.warp_specialize(
        [
            (_consumer, (shared, CAUSAL, HEAD_DIM, NUM_STAGES, NUM_CONSUMERS, 0, DQ_CHUNKS)),
            (_consumer, (shared, CAUSAL, HEAD_DIM, NUM_STAGES, NUM_CONSUMERS, 1, DQ_CHUNKS)),
            (_producer, (loads, CAUSAL, NUM_STAGES, NUM_CONSUMERS)),
        ],
        [4, 1], [CONSUMER_REGS, 24],
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------
NUM_CONSUMERS = 2  # warpgroups of 64 keys: the kernel's `gl.warp_specialize` lists two consumer partitions
# Q, dO (and L2, D) ring slots, by head dim: d = 128 takes 197 KB of shared memory with two (three would not fit).
# d = 64 with 2, 3, 4, 6 (`hopper_onepass_probe.py --ds 64 --ns 2048,4096,16384 --groups 1,4 --stages 2,3,4,6`,
# H200, 2026-11-30): geomean 346.4, 342.8, 344.8, 344.1 TFLOP/s over the 12 cells, no cell 2 % apart: a slot is
# freed as soon as the next step's S^T is done, early enough that two hide the loads.
NUM_STAGES = {64: 2, 128: 2}
# launches over the (batch, K/V head) pairs, so that the float32 dQ accumulator holds a quarter of dQ's rows
# (`slices`)
DQ_SLICES = 4


def dq_chunks_for(d: int, causal) -> int:
    """Products a warpgroup's columns of a step's dQ are made in (`DQ_CHUNKS`), the faster by head dim and mask:
    two at d = 128 with a causal mask, one elsewhere. Measured (`hopper_onepass_probe.py --ds 128 --ns
    2048,4096,8192,16384 --groups 1,4`, H200, 2026-11-30, TFLOP/s in one / two): causal 2k 316 / 338, 4k 385 /
    405, 8k 432 / 451, 16k 456 / 474 (4 query heads a K/V head: 332 / 373 ... 433 / 473); non-causal 2k 431 /
    431, 4k 473 / 473, 8k 505 / 495, 16k 517 / 452. At d = 64 one chunk was 6-9 % faster in every cell."""
    return 2 if d == 128 and causal else 1


def _vector_desc(t):
    """A TMA descriptor of the float32 vector t in blocks of 64 (a step's L2 or D)."""
    layout = gl.NVMMASharedLayout.get_default_for([QUERY_ROWS], gl.float32)
    return TensorDescriptor(t, [t.numel()], [1], [QUERY_ROWS], layout)


def _launch(
    q4, k4, v4, do4, delta, l2, dq_acc, dk4, dv4, offset, causal, scale, dq_chunks, bhk0, bhkv, warmup
):
    """The kernel on the (batch, K/V head) pairs bhk0 ... bhk0 + bhkv - 1, adding their dQ into dq_acc's first
    bhkv * group * N_Q rows."""
    B, H, n_q, d = q4.shape
    h_kv, n_k = k4.shape[1], k4.shape[2]
    rows = bhkv * (H // h_kv) * n_q
    cols = d // (NUM_CONSUMERS * dq_chunks)
    dq_layout = gl.NVMMASharedLayout.get_default_for([QUERY_ROWS, cols], gl.float32)
    dq_desc = TensorDescriptor(dq_acc, [rows, d], [d, 1], [QUERY_ROWS, cols], dq_layout)
    grid = (cdiv(n_k, KROWS.value * NUM_CONSUMERS) * bhkv,)
    args = (
        descriptor(q4, QUERY_ROWS), descriptor(do4, QUERY_ROWS), descriptor(k4, KROWS.value),
        descriptor(v4, KROWS.value), _vector_desc(l2.view(-1)), _vector_desc(delta.view(-1)), dq_desc,
        dk4, dv4, scale * LOG2E, scale, dk4.stride(0), dk4.stride(1), dk4.stride(2),
        H, H // h_kv, n_q, n_k, offset, bhkv, bhk0, delta.shape[-1],
    )  # fmt: skip
    meta = dict(
        CAUSAL=causal, HEAD_DIM=d, NUM_STAGES=NUM_STAGES[d], NUM_CONSUMERS=NUM_CONSUMERS, DQ_CHUNKS=dq_chunks,
        **launch_options(NUM_CONSUMERS),
    )  # fmt: skip
    if warmup:
        return bwd_ws_kernel.warmup(*args, grid=grid, **meta)
    bound.launch(bwd_ws_kernel, grid, *args, **meta)  # bound once (host time)
    return None


def _by_slices(cuts, rows_per_pair: int, dq_acc, dq_rows, launch) -> None:
    """The kernel's launches over the slices `cuts` ((first pair, count) each; `launch(first, count)`), each
    adding into dq_acc zeroed (the D pass zeroes it for the first), then cast into its rows of dQ, dq_rows
    ((B * H * N_Q, d)); rows_per_pair = group * N_Q."""
    if len(cuts) == 1:  # the whole of dQ in one launch (short rows, where host time shows): no slicing
        launch(*cuts[0])
        dq_rows.copy_(dq_acc)
        return
    for i, (first, count) in enumerate(cuts):
        rows = count * rows_per_pair
        if i:
            dq_acc[:rows].zero_()
        launch(first, count)
        dq_rows[first * rows_per_pair : first * rows_per_pair + rows].copy_(dq_acc[:rows])


class Replay:
    """The launches of one `backward` call (the D pass, then the kernel over each slice), repeated over new
    tensors of the same shapes, strides and alignments, nothing decided again: `attention.backward`'s plan of a
    one-pass call (`kernels/plans.py`: host time)."""

    __slots__ = ("launches", "cuts", "rows_per_pair", "stat_shape", "acc_shape", "dq_rows")

    def __init__(self, launches: tuple, cuts: list, rows_per_pair: int, delta, dq_acc):
        self.launches, self.cuts, self.rows_per_pair = launches, cuts, rows_per_pair
        self.stat_shape, self.acc_shape = tuple(delta.shape), tuple(dq_acc.shape)
        self.dq_rows = (-1, dq_acc.shape[-1])

    def run(self, tensors: dict) -> None:
        """dQ into tensors["dq4"] (contiguous as q4), dK, dV into "dk4", "dv4" (contiguous as k4), as `backward`
        made them, from the call's tensors by the names `backward` gives them (q4, k4, v4, o4, do4, l3); D, L2
        and the accumulator are added to the dict (`_buffers`)."""
        q4, f32 = tensors["q4"], torch.float32
        tensors["delta"] = q4.new_empty(self.stat_shape, dtype=f32)
        tensors["l2"] = q4.new_empty(self.stat_shape, dtype=f32)
        dq_acc = tensors["dq_acc"] = q4.new_empty(self.acc_shape, dtype=f32)  # zeroed by the D pass
        pre, *kernels = self.launches
        pre(tensors)
        kernels = iter(kernels)
        dq_rows = tensors["dq4"].view(self.dq_rows)
        _by_slices(self.cuts, self.rows_per_pair, dq_acc, dq_rows, lambda *_: next(kernels)(tensors))


def slices(bhkv: int, key_blocks: int = 1, sms: int = 0) -> list[tuple[int, int]]:
    """(first, count) of the (batch, K/V head) pairs each launch takes: up to `DQ_SLICES` launches of equal count
    (the last may hold fewer), so that the float32 dQ accumulator holds a quarter of dQ's rows. With `key_blocks`
    programs a pair on `sms` SMs (0: not counted), the count of launches is the largest whose waves are as full as
    the best count's (within 3 %; a launch of p programs takes ceil(p / sms) waves) among those that give every
    launch 1.5 waves or more (or 1 launch): a last wave part empty in every launch leaves SMs idle each time.
    Measured (`hopper_onepass_probe.py --ds 64 --ns 4096,2048 --groups 4,1 --slices 1,2,3,4`, H200, 2026-11-30):
    4 query heads per K/V head at 4k, 32 pairs of 32 programs, TFLOP/s in 1, 2, 3, 4 launches: non-causal 383,
    385, 343, 381, causal 354, 358, 329, 360: 3 launches of 2.67 waves (a third wave 67 % full) lost 11 %; at 2k
    (64 pairs of 16) likewise 366, 364, 327, 360; at 16k (8 pairs of 128) causal 401, 398, 369, 392, non-causal
    395-398 for every count. With one query head per K/V head (128 pairs at 4k) causal rows ran 298, 328, 336,
    338: more launches, a smaller accumulator, faster."""
    most = min(DQ_SLICES, bhkv)
    if not sms:
        return _cut(bhkv, most)
    fill = {}
    for n in range(1, most + 1):
        programs = [count * key_blocks for _, count in _cut(bhkv, n)]
        if n == 1 or min(programs) >= 1.5 * sms:
            fill[n] = sum(programs) / (sms * sum(cdiv(p, sms) for p in programs))
    best = max(fill.values())
    return _cut(bhkv, max(n for n, f in fill.items() if f >= best - 0.03))


def _cut(bhkv: int, n: int) -> list[tuple[int, int]]:
    """bhkv pairs in n launches of equal count (the last may hold fewer; fewer launches where that leaves one
    empty)."""
    per = cdiv(bhkv, n)
    return [(first, min(per, bhkv - first)) for first in range(0, bhkv, per)]


def _slices(q4, k4) -> list[tuple[int, int]]:
    """`slices` of this call on q4's GPU."""
    blocks = cdiv(k4.shape[2], KROWS.value * NUM_CONSUMERS)
    return slices(q4.shape[0] * k4.shape[1], blocks, runtime.sm_count(q4.device.index))


def _buffers(q4, k4, where, cuts):
    """The D pass's outputs D and L2, each (B * H, N_PAD) float32 (N_PAD = N_Q rounded up to 64), and the float32
    dQ accumulator of the largest of the slices `cuts` ((its pairs * group * N_Q, d)), not zeroed: the D pass
    zeroes it. Three allocations: one with D and L2 as its two rows cost the host more (the views)."""
    B, H, n_q, d = q4.shape
    n_pad = cdiv(n_q, QUERY_ROWS) * QUERY_ROWS
    delta, l2 = (torch.empty((B * H, n_pad), dtype=torch.float32, device=where) for _ in range(2))
    per = cuts[0][1]
    return delta, l2, torch.empty((per * (H // k4.shape[1]) * n_q, d), dtype=torch.float32, device=where)


def _d_pass_key(q4) -> tuple:
    """The name the D pass with L2 (`d_pass.preprocess` with l3) compiles under."""
    return ("preprocess", "base 2", q4.shape[-1], q4.dtype)


def _key(q4, k4, offset: int, causal: bool, dq_chunks: int) -> tuple:
    return (
        "one-pass backward (Gluon)",
        tuple(q4.shape),
        tuple(k4.shape),
        q4.dtype,
        offset,
        causal,
        dq_chunks,
    )


def backward(
    q4,
    k4,
    v4,
    o4,
    do4,
    l3,
    offset: int,
    causal: bool,
    scale: float,
    dq_chunks: int | None = None,
    dk4=None,
    dv4=None,
    replay_out=None,
):
    """(dQ, dK, dV, D) of attention for q4, do4 (B, H, N_Q, d), o4 likewise (any strides) and k4, v4
    (B, H_kv, N_K, d) that pass `supports` (a Hopper GPU, 16-bit, contiguous, d 64 or 128); l3 (B, H, N_Q) the
    forward's L (float32, natural log); offset: the causal alignment's `checks.causal_offset`. dK, dV are summed
    over the H / H_kv query heads of each K/V head; the gradients come back contiguous in Q's dtype (dK, dV into
    dk4, dv4 if given, contiguous as k4), and D = rowsum(dO * O) as a (B * H, N_Q) float32 view (the sinks'
    gradient reads it). dq_chunks: `dq_chunks_for(d, causal)` if None. Launches: the D pass (D and L2, and the
    float32 accumulator zeroed: half dQ's bytes in 4 slices), then for each of `slices` the kernel and dQ's cast
    (and the accumulator zeroed again before each slice but the first). The caller
    makes q4's GPU current. replay_out: None, or a list to which a `Replay` of this call's launches is appended
    where they can be repeated so (`kernels.bound.recording`: not a first call, which compiles or binds)."""
    B, H, n_q, d = q4.shape
    group = H // k4.shape[1]
    dq_chunks = dq_chunks or dq_chunks_for(d, causal)
    cuts = _slices(q4, k4)
    delta, l2, dq_acc = _buffers(q4, k4, q4.device, cuts)
    dk = torch.empty_like(k4) if dk4 is None else dk4
    dv = torch.empty_like(v4) if dv4 is None else dv4
    dq = torch.empty_like(q4)
    tensors = dict(
        q4=q4, k4=k4, v4=v4, o4=o4, do4=do4, l3=l3, delta=delta, l2=l2, dq_acc=dq_acc, dk4=dk, dv4=dv
    )
    with bound.recording(tensors) if replay_out is not None else contextlib.nullcontext() as recorded:
        wait_compiled(_d_pass_key(q4))
        preprocess(o4, do4, delta, q4.dtype, l3, l2, dq_acc)  # dq_acc zeroed too
        wait_compiled(_key(q4, k4, offset, causal, dq_chunks))  # compiled ahead (`compile_ahead`): not twice
        _by_slices(
            cuts, group * n_q, dq_acc, dq.view(B * H * n_q, d),
            lambda first, count: _launch(q4, k4, v4, do4, delta, l2, dq_acc, dk, dv, offset, causal, scale,
                                         dq_chunks, first, count, False),
        )  # fmt: skip
    launches = recorded.prepared() if recorded is not None else None
    if launches:
        replay_out.append(Replay(launches, cuts, group * n_q, delta, dq_acc))
    return dq, dk, dv, delta[:, :n_q]


def warmup(q4, k4, v4, offset: int, causal: bool, scale: float, dq_chunks: int | None = None, where="meta"):
    """Compile, without launching, the kernel `backward` launches for these shapes; returns the compiled kernel.
    q4, k4, v4 may be stand-ins on the meta device (or CPU tensors: scripts/gluon_spills.py compiles for sm_90a
    on a machine without a GPU, `where` then "cpu")."""
    dq_chunks = dq_chunks or dq_chunks_for(q4.shape[-1], causal)
    cuts = slices(q4.shape[0] * k4.shape[1])  # the binary is the same for every slice
    delta, l2, dq_acc = _buffers(q4, k4, where, cuts)
    return _launch(
        q4, k4, v4, q4, delta, l2, dq_acc, k4, v4, offset, causal, scale, dq_chunks, *cuts[0], True
    )


def compile_ahead(q4, k4, v4, l3, offset: int, causal: bool, scale: float) -> None:
    """`warmup`, and the D pass `backward` launches, each in a background thread, once per process
    (`launch.compile_ahead` says why); `backward` waits for them. q4, k4, v4, l3 may be stand-ins on the meta
    device (q4 stands in for O and dO)."""
    key = _key(q4, k4, offset, causal, dq_chunks_for(q4.shape[-1], causal))
    compile_in_background(key, lambda: warmup(q4, k4, v4, offset, causal, scale))
    B, H, n_q, d = q4.shape
    delta, l2, dq_acc = _buffers(q4, k4, "meta", slices(B * k4.shape[1]))
    pre = preprocess_launch(q4, q4, delta, B, H, n_q, d, q4.dtype, l3, l2, dq_acc)
    compile_kernel_ahead(_d_pass_key(q4), preprocess_kernel, *pre)


def choose(d: int, causal: bool, n_q: int, n_k: int, group: int, pairs: int = 0, sms: int = 0) -> bool:
    """Whether the backward (`backward._backward`) runs this kernel rather than its two: with `pairs` (batch, K/V
    head) pairs on `sms` SMs given, a grid of half a wave or more (pairs x key blocks of 128 >= sms / 2), and
    d = 64 with 4096 queries
    and keys or more with a causal mask, 8192 without; d = 128 with a causal mask from 2048, or without one from
    8192 with one query head a K/V head.
    At d = 64 and 2048 tokens it lost, since the two kernels' dK/dV kernel became the Gluon one on 128 query rows a
    step (`hopper_backward.LAUNCHES`; whole backward, TFLOP/s, two kernels / one pass, `hopper_onepass_probe.py --ds
    64 --ns 1024,2048,4096 --groups 4 --dkdv-rows 128`, 2026-12-01): causal 290 / 285 (4 query heads a K/V head:
    317 / 244), non-causal grouped 368 / 358; at 4096 it won causal rows (324 / 338, grouped 357 / 353) and tied
    the rest (380 / 379, 380 / 377); notebook 08c's timing the same day, one pass over two kernels: 4096 0.90x
    non-causal, 0.98x causal; 16k 1.02x, 1.08x. So without a mask from 8192. Before that, against the Triton
    dK/dV kernel: measured on an H200
    (bf16, B x N = 16k tokens, 32 query heads, d = 64; the whole backward, TFLOP/s of 2.5 x the forward's FLOPs, one
    pass against the two kernels in the same run, `scripts/hopper_onepass_probe.py --ds 64 --groups 1,4`,
    2026-11-30), in one launch: non-causal 1k 312 / 332 (4 query heads per K/V head: 338 / 325), 2k 353 / 359, 4k
    380 / 358 (388 / 348), 8k 396 / 363, 16k 407 / 366 (410 / 366); causal 1k 212 / 233 (244 / 250), 2k 263 / 268,
    4k 302 / 294 (355 / 306), 8k 353 / 300, 16k 381 / 314 (402 / 331). dQ in two chunks was 6-9 % slower than in one
    at every cell. In 4 launches (`slices`, as now; the same probe and day): 4k 380 / 372, 16k 407 / 368; causal 4k
    338 / 296, 16k 393 / 316; 2k 346 / 341, causal 281 / 266; 1k 296 / 331, causal 149 / 233. At 2k in a second run
    (the same day): non-causal 347 / 358 (325 / 350), causal 281 / 273 (296 / 281): causal rows from 2048, the
    others from 4096. In a third run, 4k with 4 query heads per K/V head lost non-causal, 340 / 350, and won causal,
    326 / 308: there `slices` made 3 launches of 2.6 waves; it now makes 4 (see `slices`: 381 / 370, 360 / 314 in a
    fourth run). Grouped at 2k without a mask, in 4 launches: 360 / 338, 358 / 341, 360 / 351 in three runs (one
    head a K/V head: 348 / 339, 346 / 358), so grouped rows take it from 2048 too; at 1k it lost (207 / 325). At d =
    128 (16 heads; against two Gluon kernels; `--ds 128 --ns 2048,4096,8192,16384 --groups 1,4`, 2026-11-30, each
    with `dq_chunks_for`'s chunks): causal 2k 338 / 330 (4 query heads a K/V head: 373 / 373), 4k 405 / 375 (423 /
    411), 8k 451 / 416 (458 / 461), 16k 474 / 451 (473 / 466), a run before 4k 412 / 390, 16k 478 / 449;
    non-causal 2k 431 / 460 (459 / 437), 4k 473 / 471 (474 / 475), 8k 505 / 492 (488 / 492), 16k 517 / 493 (496 /
    495); at 1k it lost (336 / 373). Causal 2k in a third run (`--ns 1024,2048`): 338 / 321 (370 / 372); 1k 246 / 245
    (294 / 279): a tie, left to the two kernels. Small grids (graph replays, L2 flushed, us of the whole backward,
    one pass / two kernels, causal; `hopper_onepass_probe.py --small 1x2x2048,1x4x2048,1x8x2048,1x16x2048,1x2x4096
    --ds 64,128`, 2026-11-30): d = 64 at 2048 tokens, 1 x 2 heads (32 programs) 68.6 / 63.2, 1 x 4 (64) 69.6 /
    64.8, 1 x 8 (128) 71.5 / 79.8, 1 x 16 (256) 82.8 / 123.5, 1 x 2 heads at 4096 (64) 122.1 / 118.2; d = 128 102.6
    / 101.3, 104.2 / 102.9, 108.2 / 106.4, 129.9 / 148.8, 186.2 / 181.4 (an earlier timing without the flush, the
    same order). Under half a wave the two kernels' grids, a program per query block too, finish first, and their
    host time is lower (the plan's backward 42-45 us against 51-53); at d = 128 a grid of 128 is a tie (1-3 %)."""
    if pairs and sms and 2 * pairs * cdiv(n_k, KROWS.value * NUM_CONSUMERS) < sms:
        return False
    if d == 128:
        return min(n_q, n_k) >= (2048 if causal else 8192) and (bool(causal) or group == 1)
    return d == 64 and min(n_q, n_k) >= (4096 if causal else 8192)
