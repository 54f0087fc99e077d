"""A warp-specialised dK/dV kernel after FlashAttention-3 on Hopper GPUs (H100, H200), in Gluon (notebook 08c,
section 5).

The Triton dK/dV kernel (`backward._dkdv_kernel`) keeps a block of 128 keys' dK and dV (fp32) in the
registers of 8 warps and computes the transposed tiles S^T = K Q^T and dP^T = V dO^T, so that P^T and
dS^T come out ready to be the left operand of dV += P^T dO and dK += dS^T Q. At d = 128 that is
128 accumulator registers per thread, another 64 for the two score tiles, and one value of L and of D
per *column* of the tiles (16 each per thread): more than the 255 registers a thread may have, so the
kernel spills to local memory (notes/attention.md, "Why it is so"). This kernel arranges the same work
with FlashAttention-3's warp specialisation (Shah et al. 2024, section 3) and one of the two layouts its
backward's code offers (untransposed tiles; at d = 128 on Hopper FlashAttention-3 takes the transposed one
and feeds P^T and dS^T to dV and dK from registers, which this kernel has not tried):

* producer (1 warp, 24 registers per thread): loads the program's K and V block once with TMA, then,
  for every query block that sees them, the Q and dO blocks (Q_ROWS rows each: 64 at d = 128, 128 at d = 64,
  FlashAttention-3's tiles, `DkdvLaunch`) into a ring of NUM_STAGES
  shared-memory slots (a `ready` mbarrier per slot; an `empty` one counts the consumers done with it).
* consumers (2 warpgroups of 4 warps, up to 240 registers per thread): warpgroup w owns keys
  64 w ... 64 w + 63 of the block and their dK, dV (64 x d fp32 each, registers). Per query block it
  computes S = Q K_w^T and dP = dO V_w^T untransposed (Q_ROWS query rows x 64 keys), so L and D are one
  value per *row*: two registers per thread each (four at 128 rows). P = exp2(S * scale log2 e - L log2 e)
  and dS = P (dP - D) go to shared memory in 16 bits, and the tensor cores read them back transposed for
  dV += P^T dO and dK += dS^T Q (wgmma reads either orientation of a 16-bit shared-memory tile).

Grouped-query attention: a program owns a block of one K/V head and walks the query blocks of every
query head of its group in one loop, so dK and dV are summed over the group on chip; or, for long
non-causal rows (`heads_per_program`), each query head gets its own programs, which write fp32 partial
dK, dV that the backward adds up (`backward._group_sum_kernel`). Causal (either
alignment): query blocks wholly before the keys are skipped, and only the diagonal ones are masked.

dQ stays with the Triton dQ kernel, which runs first and also writes D = rowsum(dO * O)
(`backward._backward`). No CPU path: Gluon has no interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from ..kernels import bound
from ..kernels.launch import Launch, keyword
from ..runtime import cdiv
from . import hopper
from .hopper import LOG2E, chunked_block_major, descriptor, launch_options
from .launch import compile_in_background, wait_compiled

KEY_ROWS = 64  # keys per consumer warpgroup: one wgmma's M
QUERY_ROWS = 64  # query rows per step
KROWS = gl.constexpr(KEY_ROWS)
QROWS = gl.constexpr(QUERY_ROWS)
# Causal programs run block-major a chunk of this many (batch, K/V head) pairs at a time (`program_index`).
CHUNK_PAIRS = gl.constexpr(8)
# The kernel's pieces below are public: `hopper_onepass` builds its kernel on them.
# A barrier among the warps of one partition (the name changed between Triton releases).
partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def program_index(num_n, BHKV, CAUSAL: gl.constexpr):
    """This program's (batch * K/V head index, key block index). Non-causal: head-major (the
    programs of one head share its Q and dO in the L2 cache). Causal: block-major within a chunk of
    CHUNK_PAIRS pairs, chunk after chunk, so that the first key blocks of a chunk's heads, which the
    most query blocks see, start first, while a wave streams the Q and dO of a few heads, not of up to
    one head a program (at d = 128, 16 x 16 heads of 1k, that is 66 MiB against the L2's 60), as
    `hopper._tile` deals the forward's tiles. Measured on an H200 (bf16, B x N = 16k tokens, 2048 / d
    heads, the kernel alone, TFLOP/s of its 4 products, chunks of 8 pairs / block-major over all,
    `scripts/hopper_onepass_probe.py` in alternating processes, CHUNK_PAIRS edited between them,
    2026-12-01): d = 128 1k 373 / 326, 2k 469 / 407, 4k 522 / 475; d = 64 1k 262 / 235, 2k 327 / 287,
    4k 358 / 325 (64 query rows a step then); chunks of 16 and 32 pairs within 1-5 % of 8. The whole two-kernel
    backward at d = 128: 1k 268 / 249, 2k 341 / 313, 8k 409 / 390, 16k 437 / 436."""
    pid = gl.program_id(0)
    if CAUSAL:
        return chunked_block_major(pid, CHUNK_PAIRS, BHKV, num_n)
    return pid // num_n, pid % num_n


@gluon.jit
def query_block_range(n_start, N_Q, OFFSET, CAUSAL: gl.constexpr, CTA_N: gl.constexpr, QR: gl.constexpr):
    """Query blocks (of QR rows) that see keys n_start ... n_start + CTA_N - 1: (lo, mid, hi),
    block indices; blocks [lo, mid) see part of the keys (masked), [mid, hi) all of them.
    Row i sees key j when i + OFFSET >= j (`blocks.q_block_range`, in blocks)."""
    hi = gl.cdiv(N_Q, QR)
    lo = 0
    mid = 0
    if CAUSAL:
        lo = gl.minimum(gl.maximum(n_start - OFFSET, 0) // QR, hi)
        mid = gl.minimum(gl.cdiv(gl.maximum(n_start + CTA_N - 1 - OFFSET, 0), QR), hi)
    return lo, mid, hi


@gluon.jit
def step_block(step, lo, n_m, GROUP, CAUSAL: gl.constexpr):
    """Step `step` of a program's loop over the GROUP query heads x n_m query blocks (from block lo):
    (head within the group, query block). Causal: head by head (a head's blocks run from the diagonal
    on). Non-causal: the heads of the group in turn for each query block, so that the group's
    programs read one query block of each head at about the same time (1-3 % faster at 8k-16k keys
    on an H200; 3-5 % slower for causal programs)."""
    if CAUSAL:
        g = step // n_m
        return g, lo + step - g * n_m
    return step % GROUP, lo + step // GROUP


@gluon.jit
def program_block(
    num_n, BHKV, H, GROUP, N_Q, OFFSET, CAUSAL: gl.constexpr, CTA_N: gl.constexpr, QR: gl.constexpr
):
    """This program's (batch * K/V head, first key, query blocks lo, mid (`query_block_range`), their number,
    batch * H + the first query head of its group)."""
    bhk, n_blk = program_index(num_n, BHKV, CAUSAL)
    n_start = n_blk * CTA_N
    lo, mid, hi = query_block_range(n_start, N_Q, OFFSET, CAUSAL, CTA_N, QR)
    H_KV = H // GROUP
    first_head = (bhk // H_KV) * H + (bhk % H_KV) * GROUP
    return bhk, n_start, lo, mid, hi - lo, first_head


@gluon.jit
def _scores(q_smem, do_smem, ready_bar, k_w, v_w, s_zero, step, NUM_STAGES: gl.constexpr):
    """Once the step's Q and dO are in their ring slot: S = Q K_w^T and dP = dO V_w^T issued to the tensor
    cores (right behind the previous step's products). Returns (Q, dO, S's token, dP's token)."""
    slot = step % NUM_STAGES
    mbarrier.wait(ready_bar.index(slot), (step // NUM_STAGES) & 1)
    q = q_smem.index(slot)
    do = do_smem.index(slot)
    s_tok = warpgroup_mma(q, k_w.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(do, v_w.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return q, do, s_tok, dp_tok


@gluon.jit
def _row_stats(L, Dlt, head, rows, H, N_Q, stride_lb, stride_lh, stride_lm):
    """L (base 2; a row that saw no key, L = -inf, reads +inf: P = 0) and D of the step's rows, loaded while
    the products run. Rows past N_Q: L = +inf, so they add nothing."""
    l_row = L + (head // H).to(gl.int64) * stride_lb + (head % H).to(gl.int64) * stride_lh
    lse = gl.load(l_row + rows * stride_lm, mask=rows < N_Q, other=float("inf"))
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    delta = gl.load(Dlt + head.to(gl.int64) * N_Q + rows, mask=rows < N_Q, other=0.0)
    return lse2, delta


@gluon.jit
def _probabilities(s, rows, cols, m_blk, mid, OFFSET, lse2, qk_scale, CAUSAL: gl.constexpr):
    """P = exp2(S scale log2 e - L log2 e), keys hidden by the causal mask on the diagonal blocks: key j is
    visible to row i when i + OFFSET >= j."""
    if CAUSAL:
        if m_blk < mid:
            visible = gl.expand_dims(rows + OFFSET, 1) >= gl.expand_dims(cols, 0)
            s = gl.where(visible, s, float("-inf"))
    return gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))


@gluon.jit
def _tiles(key_start, HEAD_DIM: gl.constexpr, QR: gl.constexpr):
    """A consumer's register tiles, in wgmma's accumulator layouts: a zero score tile (QR query rows x 64 keys;
    what products with use_acc=False are given), dK and dV (64 keys x d, zero), the query rows of a step's tile
    (from 0) and the keys key_start ... + 63 of its columns."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, KROWS, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    s_zero = gl.zeros([QR, KROWS], gl.float32, layout=s_layout)
    dk = gl.zeros([KROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([KROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    offs_m = gl.arange(0, QR, layout=gl.SliceLayout(1, s_layout))
    cols = key_start + gl.arange(0, KROWS, layout=gl.SliceLayout(0, s_layout))
    return s_zero, dk, dv, offs_m, cols


@gluon.jit
def store_dkdv(dk, dv, DK, DV, sm_scale, key_start, bhk, H_KV, N_K, stride_kb, stride_kh, stride_kn):
    """dK = dS^T Q * scale and dV of keys key_start ... + 63: registers -> HBM once (keys past N_K masked)."""
    acc_layout: gl.constexpr = dk.type.layout
    key_rows = key_start + gl.arange(0, KROWS, layout=gl.SliceLayout(1, acc_layout))
    offs_d = gl.arange(0, dk.shape[1], layout=gl.SliceLayout(0, acc_layout))
    base = (bhk // H_KV).to(gl.int64) * stride_kb + (bhk % H_KV).to(gl.int64) * stride_kh
    ptrs = base + gl.expand_dims(key_rows, 1) * stride_kn + gl.expand_dims(offs_d, 0)
    mask = gl.expand_dims(key_rows < N_K, 1)
    gl.store(DK + ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=mask)
    gl.store(DV + ptrs, dv.to(DV.dtype.element_ty), mask=mask)


@gluon.jit
def load_kv(k_desc, v_desc, k_smem, v_smem, kv_bar, kv_row, NUM_CONSUMERS: gl.constexpr):
    """The program's K and V blocks, NUM_CONSUMERS x 64 rows from row kv_row of the (B * H_kv * N_K, d) matrices,
    into shared memory by TMA, arriving on kv_bar (the producer's first loads)."""
    mbarrier.expect(kv_bar, 2 * NUM_CONSUMERS * k_desc.block_type.nbytes)
    for c in gl.static_range(NUM_CONSUMERS):
        tma.async_copy_global_to_shared(k_desc, [kv_row + c * KROWS, 0], kv_bar, k_smem.index(c))
        tma.async_copy_global_to_shared(v_desc, [kv_row + c * KROWS, 0], kv_bar, v_smem.index(c))


@gluon.jit
def _producer(args, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
              QR: gl.constexpr):  # fmt: skip
    """One warp issues every TMA copy: the K and V blocks of the program once (one 64-row half per
    consumer), then Q and dO of each (query head, query block) step into ring slot step % NUM_STAGES,
    once both consumers have released it. Rows past a head's end are the next head's (or zeros past
    the tensor): P is 0 for query rows past N_Q, and keys past N_K are never stored."""
    (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, ready_bar, empty_bar,
     H, GROUP, SHARE, N_Q, N_K, OFFSET, num_n, BHKV) = args  # fmt: skip
    CTA_N: gl.constexpr = KROWS * NUM_CONSUMERS
    bhk, n_start, lo, _, n_m, first_head = program_block(
        num_n, BHKV, H, GROUP, N_Q, OFFSET, CAUSAL, CTA_N, QR
    )
    kv_row = (bhk // SHARE) * N_K + n_start  # batch * H_kv + K/V head: SHARE programs per K/V head
    load_kv(k_desc, v_desc, k_smem, v_smem, kv_bar, kv_row, NUM_CONSUMERS)
    for step in range(GROUP * n_m):
        g, m_blk = step_block(step, lo, n_m, GROUP, CAUSAL)
        row = (first_head + g) * N_Q + m_blk * QR
        slot = step % NUM_STAGES
        mbarrier.wait(empty_bar.index(slot), ((step // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(ready_bar.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row, 0], ready_bar.index(slot), q_smem.index(slot))
        tma.async_copy_global_to_shared(do_desc, [row, 0], ready_bar.index(slot), do_smem.index(slot))


@gluon.jit
def _consumer(args, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
              NUM_CONSUMERS: gl.constexpr, WG: gl.constexpr, QR: gl.constexpr):  # fmt: skip
    """Warpgroup WG: dK and dV of keys n_start + 64 WG ... + 63 (registers), summed over every query
    block of the program's GROUP query heads, then stored (rows past N_K masked)."""
    (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, ready_bar, empty_bar,
     L, Dlt, DK, DV, qk_scale, sm_scale, stride_lb, stride_lh, stride_lm,
     stride_kb, stride_kh, stride_kn, H, GROUP, N_Q, N_K, OFFSET, num_n, BHKV) = args  # fmt: skip
    dtype: gl.constexpr = q_smem.dtype
    CTA_N: gl.constexpr = KROWS * NUM_CONSUMERS
    bhk, n_start, lo, mid, n_m, first_head = program_block(
        num_n, BHKV, H, GROUP, N_Q, OFFSET, CAUSAL, CTA_N, QR
    )
    k_w = k_smem.index(WG)
    v_w = v_smem.index(WG)
    p_w = p_smem.index(WG)
    ds_w = ds_smem.index(WG)
    s_zero, dk, dv, offs_m, cols = _tiles(n_start + WG * KROWS, HEAD_DIM, QR)
    mbarrier.wait(kv_bar, 0)
    dk_tok = warpgroup_mma_init(dk)  # the accumulators as in-flight products (none issued yet)
    dv_tok = warpgroup_mma_init(dv)
    for step in range(GROUP * n_m):
        g, m_blk = step_block(step, lo, n_m, GROUP, CAUSAL)
        head = first_head + g  # batch * H + query head
        rows = m_blk * QR + offs_m
        q, do, s_tok, dp_tok = _scores(q_smem, do_smem, ready_bar, k_w, v_w, s_zero, step, NUM_STAGES)
        lse2, delta = _row_stats(L, Dlt, head, rows, H, N_Q, stride_lb, stride_lh, stride_lm)
        # Products complete in issue order: S done means the previous step's dV and dK are too, so
        # its Q, dO slot, P and dS tiles are free again.
        s, dk, dv = warpgroup_mma_wait(1, deps=[s_tok, dk_tok, dv_tok])
        if step > 0:
            mbarrier.arrive(empty_bar.index((step - 1) % NUM_STAGES), count=1)
        p = _probabilities(s, rows, cols, m_blk, mid, OFFSET, lse2, qk_scale, CAUSAL)
        p_w.store(p.to(dtype))
        fence_async_shared()
        partition_barrier()
        dv_tok = warpgroup_mma(p_w.permute((1, 0)), do, dv, is_async=True)
        dp = warpgroup_mma_wait(1, deps=[dp_tok])
        ds = p * (dp - gl.expand_dims(delta, 1))
        ds_w.store(ds.to(dtype))
        fence_async_shared()
        partition_barrier()
        dk_tok = warpgroup_mma(ds_w.permute((1, 0)), q, dk, is_async=True)
    dk, dv = warpgroup_mma_wait(0, deps=[dk_tok, dv_tok])
    store_dkdv(
        dk, dv, DK, DV, sm_scale, n_start + WG * KROWS, bhk, H // GROUP, N_K, stride_kb, stride_kh, stride_kn
    )


@gluon.jit
def shared_tiles(q_desc, do_desc, k_desc, v_desc, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
            NUM_CONSUMERS: gl.constexpr, QR: gl.constexpr):  # fmt: skip
    """The kernel's shared memory: the Q, dO ring (NUM_STAGES slots of QR rows), K and V (a 64-key half per
    consumer), P and dS tiles (one per consumer), and the barriers: K/V loaded, a slot ready, a slot free
    (counting the consumers done with it), initialised."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, QR, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, QR, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, KROWS, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, KROWS, HEAD_DIM], v_desc.layout)
    pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([QR, KROWS], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, QR, KROWS], pds_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, QR, KROWS], pds_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready_bar = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty_bar = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready_bar.index(i), count=1)
        mbarrier.init(empty_bar.index(i), count=NUM_CONSUMERS)
    return q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, ready_bar, empty_bar


@gluon.jit
def dkdv_ws_kernel(
    q_desc, do_desc, k_desc, v_desc, L, Dlt, DK, DV, qk_scale, sm_scale,
    stride_lb, stride_lh, stride_lm, stride_kb, stride_kh, stride_kn,
    H, GROUP, SHARE, N_Q, N_K, OFFSET, BHKV,
    CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, Q_ROWS: gl.constexpr,
):  # fmt: skip
    """dK, dV of one block of 64 * NUM_CONSUMERS keys of one (batch, K/V head), summed over GROUP query
    heads that share it: all of them (SHARE = 1), or one of the SHARE slices of GROUP heads each, whose
    partial sums the caller adds up.

    q_desc, do_desc: TMA descriptors of Q, dO as (B*H*N_Q, d) matrices in blocks of (Q_ROWS, d), the query rows
    of a step (`DkdvLaunch.q_rows`); k_desc,
    v_desc: K, V as (B*H_kv*N_K, d) in blocks of (64, d). L (B, H, N_Q) float32 (natural log, strides
    stride_l*); Dlt (B*H, N_Q) float32, contiguous. DK, DV (B, H // GROUP, N_K, d) with strides
    stride_k* (unit last): dK, dV in K's dtype when SHARE = 1, else one fp32 partial per slice.
    qk_scale = scale * log2(e). Grid: cdiv(N_K, 64 * NUM_CONSUMERS) * BHKV programs, BHKV =
    B * H // GROUP, launched with num_warps=4 (the kernel's own warps are consumer 0)."""
    CTA_N: gl.constexpr = KROWS * NUM_CONSUMERS
    num_n = gl.cdiv(N_K, CTA_N)
    q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, ready_bar, empty_bar = shared_tiles(
        q_desc, do_desc, k_desc, v_desc, HEAD_DIM, NUM_STAGES, NUM_CONSUMERS, Q_ROWS
    )
    fence_async_shared()

    shared = (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, ready_bar, empty_bar,
              L, Dlt, DK, DV, qk_scale, sm_scale, stride_lb, stride_lh, stride_lm,
              stride_kb, stride_kh, stride_kn, H, GROUP, N_Q, N_K, OFFSET, num_n, BHKV)  # fmt: skip
    loads = (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, ready_bar, empty_bar,
             H, GROUP, SHARE, N_Q, N_K, OFFSET, num_n, BHKV)  # fmt: skip
    gl.warp_specialize(
        [
            (_consumer, (shared, CAUSAL, HEAD_DIM, NUM_STAGES, NUM_CONSUMERS, 0, Q_ROWS)),
            (_consumer, (shared, CAUSAL, HEAD_DIM, NUM_STAGES, NUM_CONSUMERS, 1, Q_ROWS)),
            (_producer, (loads, CAUSAL, NUM_STAGES, NUM_CONSUMERS, Q_ROWS)),
        ],
        [4, 1], [CONSUMER_REGS, 24],
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------
NUM_CONSUMERS = 2  # warpgroups of 64 keys: the kernel's `gl.warp_specialize` lists two consumer partitions


@dataclass(frozen=True)
class DkdvLaunch(Launch):
    """The kernel's launch for one head dim: NUM_STAGES Q, dO ring slots, NUM_CONSUMERS warpgroups, Q_ROWS query
    rows a step. d = 64 takes 128 rows a step (FlashAttention-3's tile there: the dV and dK products sum over 128
    query rows, not 64), with the registers and shared memory of d = 128's 64 (164 KB, 8-24 bytes of spills,
    `scripts/gluon_spills.py --d 64`). The kernel alone, TFLOP/s of its 4 products, 128 rows against 64 (H200,
    bf16, B x N = 16k, 32 heads; `scripts/hopper_onepass_probe.py --ds 64 --dkdv-rows 64,128`, 2026-12-01):
    non-causal 1k 412 / 376, 2k 472 / 425, 4k 495 / 436; causal 1k 302 / 262, 2k 390 / 325, 4k 436 / 358. At
    d = 128, 128 rows would need 262 KB, more than an SM has."""

    num_stages: int = keyword("NUM_STAGES")
    num_consumers: int = keyword("NUM_CONSUMERS", default=NUM_CONSUMERS)
    q_rows: int = keyword("Q_ROWS", default=QUERY_ROWS)  # query rows a step: Q, dO's blocks

    def kwargs(self) -> dict:
        """The kernel's constants of the launch, and its warps and registers (`hopper.launch_options`)."""
        return {**super().kwargs(), **launch_options(self.num_consumers)}


LAUNCHES = {64: DkdvLaunch(num_stages=2, q_rows=128), 128: DkdvLaunch(num_stages=2)}  # by head dim
STAGES = {d: launch.num_stages for d, launch in LAUNCHES.items()}  # the ring slots alone (older 08c copies)


def supports(q4, k4, v4, do4) -> bool:
    """Whether this kernel can take these (B, H, N, d) tensors: what the Gluon forward takes
    (`hopper.supports`: a Hopper GPU, bfloat16 or float16, d in its head dims, contiguous, 16-byte
    aligned), and dO contiguous and aligned too (its TMA descriptor)."""
    return hopper.supports(q4, k4, v4) and do4.is_contiguous() and do4.data_ptr() % 16 == 0


def _launch(q4, k4, v4, do4, l3, delta, dk4, dv4, offset: int, causal: bool, scale: float, warmup: bool):
    B, H, n_q, d = q4.shape
    n_k = k4.shape[2]
    slices = dk4.shape[1]  # K/V heads, or SHARE slices of each (fp32 partials)
    share = slices // k4.shape[1]
    setting = LAUNCHES[d]
    grid = (cdiv(n_k, KEY_ROWS * setting.num_consumers) * B * slices,)
    args = (
        descriptor(q4, setting.q_rows), descriptor(do4, setting.q_rows),
        descriptor(k4, KEY_ROWS), descriptor(v4, KEY_ROWS),
        l3, delta, dk4, dv4, scale * LOG2E, scale,
        l3.stride(0), l3.stride(1), l3.stride(2), dk4.stride(0), dk4.stride(1), dk4.stride(2),
        H, H // slices, share, n_q, n_k, offset, B * slices,
    )  # fmt: skip
    kwargs = dict(CAUSAL=causal, HEAD_DIM=d, **setting.kwargs())
    if warmup:
        return dkdv_ws_kernel.warmup(*args, grid=grid, **kwargs)
    bound.launch(
        dkdv_ws_kernel, grid, *args, **kwargs
    )  # bound once (host time), and seen by a plan's recording
    return None


def _key(q4, k4, dk4, offset: int, causal: bool) -> tuple:
    return (
        "dK/dV (Gluon)",
        tuple(q4.shape),
        tuple(k4.shape),
        tuple(dk4.shape),
        dk4.dtype,
        q4.dtype,
        offset,
        causal,
    )


def dkdv(q4, k4, v4, do4, l3, delta, dk4, dv4, offset: int, causal: bool, scale: float) -> None:
    """Write dK, dV into dk4, dv4 (B, H_kv, N_K, d, contiguous) for q4, do4 (B, H, N_Q, d) and k4, v4
    (B, H_kv, N_K, d) that pass `supports`; l3 (B, H, N_Q) float32 is the forward's L, delta
    (B*H, N_Q) float32 contiguous holds D = rowsum(dO * O); offset: the causal alignment's
    `checks.causal_offset`. The caller makes q4's GPU current.

    dk4, dv4 may instead be fp32 (B, H_kv * share, N_K, d): the `share` partial sums of each K/V head,
    each over H / (H_kv * share) of its query heads (`heads_per_program`), for the caller to add."""
    wait_compiled(_key(q4, k4, dk4, offset, causal))  # compiled ahead (`compile_ahead`): not twice
    _launch(q4, k4, v4, do4, l3, delta, dk4, dv4, offset, causal, scale, warmup=False)


def compile_ahead(q4, k4, v4, l3, delta, dk4, offset: int, causal: bool, scale: float) -> None:
    """Compile what `dkdv` will launch for these shapes, in a background thread, once per process
    (`launch.compile_ahead`, which does this for the Triton kernels, says why). l3, delta, dk4 may be
    stand-ins on the meta device (dk4: the output, or its fp32 partials); q4 stands in for dO."""
    args = (q4, k4, v4, q4, l3, delta, dk4, dk4, offset, causal, scale)
    compile_in_background(_key(q4, k4, dk4, offset, causal), lambda: _launch(*args, warmup=True))


def choose(d: int, causal: bool, n_q: int, n_k: int, group: int) -> bool:
    """Whether this kernel, rather than the Triton dK/dV kernel, runs for this shape (`group` query
    heads per K/V head). Measured on an H200 (bf16, B x N = 16k tokens, 2048 / d query heads; the
    backward alone, Triton dQ kernel included, notebook 08c and notes/attention.md, "Why it is so"):
    at d = 128 it is 3-11 % faster with one query head per K/V head and 6-16 % with four; causal rows of
    1024 keys, which it lost before its programs ran in chunks of heads (`program_index`), it now wins
    too (whole backward, TFLOP/s, against the Triton dK/dV kernel: 268 / 240, four query heads a K/V head
    293 / 271; 2026-12-01). At d = 64, on 128 query rows a step (`LAUNCHES`), it wins too (whole backward,
    against the Triton dK/dV kernel, `hopper_onepass_probe.py --ds 64 --dkdv-rows 64,128 [--groups 4]`,
    2026-12-01): non-causal 1k 317 / 317 (4 query heads a K/V head: 345 / 329), 2k 357 / 341 (368 / 340), 4k
    380 / 349 (380 / 356); causal 1k 237 / 227 (266 / 252), 2k 290 / 263 (317 / 279), 4k 324 / 287 (357 / 312).
    On 64 rows the Triton kernel had won non-causal cells by 4-17 %."""
    return d in (64, 128)


def heads_per_program(group: int, causal: bool, n_k: int) -> int:
    """How many of the `group` query heads that share a K/V head one program sums on chip: all of them
    (dK, dV written once), except non-causal rows of 4096 keys or more, where each query head gets its
    own programs, as on repeated K/V: they write partial dK, dV (fp32) that `backward._group_sum_kernel`
    adds up. A program that walks a whole group runs `group` times longer, and its L2 hit rate was
    lower (85 % against 92 % at 8k keys, hardware counters). Measured on an H200
    (bf16, d = 128, 4 query heads per K/V head, B x N = 16k tokens, forward + backward against the same
    call on repeated K/V, best of three passes), whole group / one head per program: 1k 1.013x /
    0.949x, 2k 1.006x / 0.988x, 4k 0.984x / 1.011x, 8k 0.961x / 0.994x, 16k 0.973x / 0.995x. Causal
    programs, whose work falls with the key block and which run block-major, stay whole (4k-16k:
    1.020-1.094x / 0.990-1.003x)."""
    if not causal and n_k >= 4096:
        return 1
    return group
