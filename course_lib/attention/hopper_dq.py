"""A warp-specialised dQ kernel for Hopper GPUs (H100, H200), in Gluon: the counterpart of the dK/dV kernel
of notebook 08c, section 5 (`hopper_backward`). `backward.backward` runs it beside the Gluon dK/dV kernel
where `choose` measured it faster (d = 128); `scripts/hopper_dq_probe.py` checks it against float64 and times
it against the Triton dQ kernel.

The backward on Hopper runs the Gluon dK/dV kernel (`hopper_backward`) and the Triton dQ kernel
(`backward._dq_kernel`), which recomputes S and dP for every (query block, key block) pair: 44 % of the
backward's time at d = 128, 8k keys (notes/attention.md, "Open"). The Triton kernel has every warp do
everything in turn: load K_j and V_j, S = Q K_j^T, P, dP = dO V_j^T, dS, dQ += dS K_j, so the tensor
cores wait while P and dS are computed. This kernel arranges the same work as `hopper_backward` and the
Gluon forward (`hopper`) do:

* producer (1 warp, 24 registers per thread): loads the program's Q and dO blocks once with TMA (one
  64-row block of each per consumer, one `q_bar` mbarrier for all of them), then, for every key block
  the program's rows see, K_j and V_j into ring slot j % NUM_STAGES (a `ready` mbarrier per slot; an
  `empty` one counts the consumers done with it).
* consumers (1 or 2 warpgroups of 4 warps, up to 240 registers per thread): warpgroup w owns query rows
  64 w ... 64 w + 63 of the program's block, their L and D (one value per row: two registers per thread
  each) and dQ (64 x d fp32, registers). Step j issues S_j = Q K_j^T, dP_j = dO V_j^T and
  dQ += dS_{j-1} K_{j-1} (asynchronous wgmma, in that order), waits for S_j only and computes
  P_j = exp2(S_j * scale log2 e - L log2 e) while dP_j and dQ's product run, then waits for dP_j and
  computes dS_j = P_j (dP_j - D) while dQ's product still runs. dS_j stays in registers, in 16 bits, as
  the left operand of the next step's product (no shared memory: K_j, as stored, is already the right
  operand of dS K). Waiting for that product frees slot j - 1.

Causal (either alignment, offset = Nk - Nq bottom-right, 0 top-left: row i sees key j when
i + offset >= j): the producer loads no key block past the program's last row's last key; each consumer
masks only the blocks that cross its rows' diagonal (or the ragged last block), and skips (waits for and
releases at once) blocks past its own last row. Grouped-query attention: query head h reads K/V head
h // (H // H_kv); dQ has one writer per row, so nothing is summed.

dQ = scale * dS K is written in the dtype of the given output (the Triton kernel writes the same, in
q's dtype). D = rowsum(dO * O) is read, not computed: the Triton dQ kernel computes it (FUSE_D) for the
dK/dV kernel, which runs second; with this kernel, the backward computes D first in a pass of its own
(`d_pass.preprocess_kernel`: reads O and dO once). No CPU path: Gluon has no interpreter.
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
    warpgroup_mma_wait,
)

from ..kernels import bound
from ..kernels.launch import Launch, keyword
from ..runtime import cdiv
from .hopper import LOG2E, descriptor, launch_options
from .launch import compile_in_background, wait_compiled

QUERY_ROWS = 64  # query rows per consumer warpgroup: one wgmma's M
ROWS = gl.constexpr(QUERY_ROWS)


@gluon.jit
def _program(num_m, CAUSAL: gl.constexpr):
    """This program's (batch * H + query head, query block index): head-major, so that the programs
    that read one K/V head run together (its K and V stay in the L2 cache); causal: a head's last query
    block, which sees the most keys, first (as the Triton dQ kernel orders them)."""
    pid = gl.program_id(0)
    off_hz = pid // num_m
    start_m = pid % num_m
    if CAUSAL:
        start_m = num_m - 1 - start_m
    return off_hz, start_m


@gluon.jit
def _kv_blocks(row0, N_ROWS: gl.constexpr, N_Q, N_K, OFFSET, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """How many key blocks (of BLOCK_N) query rows row0 ... row0 + N_ROWS - 1 see: all of them, or
    (causal) up to the one holding the last row's last key, min(row0 + N_ROWS, N_Q) - 1 + OFFSET (none
    when that is negative: rows that see no key, bottom-right with Nq > Nk)."""
    hi = N_K
    if CAUSAL:
        hi = gl.minimum(N_K, gl.maximum(gl.minimum(row0 + N_ROWS, N_Q) + OFFSET, 0))
    return gl.cdiv(hi, BLOCK_N)


@gluon.jit
def _probabilities(s, lse2, cols, rows, N_K, OFFSET, qk_scale, masked, CAUSAL: gl.constexpr):
    """P = exp2(S * qk_scale - L2) for one (64, BLOCK_N) score tile (fp32, registers, wgmma layout),
    L2 the rows' L in base 2 (+inf for rows past N_Q and rows that saw no key: P = 0). When `masked`
    (a run-time branch: the causal diagonal and the ragged last block), keys past N_K and, causal, keys
    after a row's last (cols > rows + OFFSET) get P = 0. Each branch holds its exponentials, so they stay
    ahead of the wgmma wait that follows (`hopper.softmax_step` says why)."""
    if masked:
        visible = gl.expand_dims(cols, 0) < N_K
        if CAUSAL:
            visible = visible & (gl.expand_dims(rows + OFFSET, 1) >= gl.expand_dims(cols, 0))
        s = gl.where(visible, s, float("-inf"))
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
    else:
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
    return p


@gluon.jit
def _producer(args, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
              NUM_CONSUMERS: gl.constexpr):  # fmt: skip
    """One warp issues every TMA copy: the program's Q and dO blocks once (one 64-row block of each per
    consumer), then K_j, V_j into ring slot j % NUM_STAGES once every consumer has released it. Rows past
    a head's end are the next head's (or zeros past the tensor): the consumers give their P = 0."""
    (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, ready_bar, empty_bar,
     H, GROUP, N_Q, N_K, OFFSET, num_m) = args  # fmt: skip
    CTA_M: gl.constexpr = ROWS * NUM_CONSUMERS
    off_hz, start_m = _program(num_m, CAUSAL)
    m_start = start_m * CTA_M
    q_row = off_hz * N_Q + m_start
    # K/V head of query head h: h // GROUP (grouped-query attention), of the same batch
    kv_row = ((off_hz // H) * (H // GROUP) + (off_hz % H) // GROUP) * N_K
    mbarrier.expect(q_bar, NUM_CONSUMERS * (q_desc.block_type.nbytes + do_desc.block_type.nbytes))
    for c in gl.static_range(NUM_CONSUMERS):
        tma.async_copy_global_to_shared(q_desc, [q_row + c * ROWS, 0], q_bar, q_smem.index(c))
        tma.async_copy_global_to_shared(do_desc, [q_row + c * ROWS, 0], q_bar, do_smem.index(c))
    n_blocks = _kv_blocks(m_start, CTA_M, N_Q, N_K, OFFSET, CAUSAL, BLOCK_N)
    for j in range(n_blocks):
        slot = j % NUM_STAGES
        # A fresh mbarrier counts as having completed the phase before phase 0: the first wait on each
        # `empty` barrier returns at once.
        mbarrier.wait(empty_bar.index(slot), ((j // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(ready_bar.index(slot), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        row = kv_row + j * BLOCK_N
        tma.async_copy_global_to_shared(k_desc, [row, 0], ready_bar.index(slot), k_smem.index(slot))
        tma.async_copy_global_to_shared(v_desc, [row, 0], ready_bar.index(slot), v_smem.index(slot))


@gluon.jit
def _consumer(args, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
              NUM_CONSUMERS: gl.constexpr, WG: gl.constexpr):  # fmt: skip
    """Warpgroup WG: dQ of query rows m_start + 64 WG ... + 63 of the program's head, summed over the key
    blocks they see (registers), then stored times sm_scale (rows past N_Q masked)."""
    (q_smem, do_smem, k_smem, v_smem, q_bar, ready_bar, empty_bar, L, Dlt, DQ, qk_scale, sm_scale,
     stride_lb, stride_lh, stride_lm, stride_dqb, stride_dqh, stride_dqm,
     H, N_Q, N_K, OFFSET, num_m) = args  # fmt: skip
    dtype: gl.constexpr = q_smem.dtype
    out_dtype: gl.constexpr = DQ.dtype.element_ty
    CTA_M: gl.constexpr = ROWS * NUM_CONSUMERS
    # Register layouts: the score tiles (64 rows x BLOCK_N keys), dQ (64 rows x d), and dS as the left
    # operand of dQ's product.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    off_hz, start_m = _program(num_m, CAUSAL)
    m_start = start_m * CTA_M
    row0 = m_start + WG * ROWS
    n_blocks = _kv_blocks(m_start, CTA_M, N_Q, N_K, OFFSET, CAUSAL, BLOCK_N)  # the producer's
    n_mine = gl.minimum(_kv_blocks(row0, ROWS, N_Q, N_K, OFFSET, CAUSAL, BLOCK_N), n_blocks)
    n_mine = gl.where(row0 < N_Q, n_mine, 0)  # rows wholly past N_Q (a short last block): no work
    first_masked = N_K // BLOCK_N  # blocks from here on need the mask
    if CAUSAL:  # the first row sees keys up to row0 + OFFSET: blocks ending there see every key
        first_masked = gl.minimum(first_masked, gl.maximum(row0 + OFFSET + 1, 0) // BLOCK_N)
    off_b = off_hz // H
    off_h = off_hz % H
    rows = row0 + gl.arange(0, ROWS, layout=row_layout)
    # L (natural log; a row that saw no key, L = -inf, reads +inf: P = 0) in base 2, and D. Rows past
    # N_Q: L = +inf, so they add nothing.
    l_row = L + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh
    lse = gl.load(l_row + rows * stride_lm, mask=rows < N_Q, other=float("inf"))
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    delta = gl.expand_dims(gl.load(Dlt + off_hz.to(gl.int64) * N_Q + rows, mask=rows < N_Q, other=0.0), 1)
    offs_n = gl.arange(0, BLOCK_N, layout=col_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    dq = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=dq_layout)
    q = q_smem.index(WG)
    do = do_smem.index(WG)

    mbarrier.wait(q_bar, 0)  # also when no key is seen: no copy may land after the program ends
    if n_mine > 0:
        # Block 0: S_0, dP_0, then dS_0, which waits in registers for the next step's product.
        mbarrier.wait(ready_bar.index(0), 0)
        s_tok = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(do, v_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s_tok])
        p = _probabilities(s, lse2, offs_n, rows, N_K, OFFSET, qk_scale, first_masked == 0, CAUSAL)
        dp = warpgroup_mma_wait(0, deps=[dp_tok])
        ds_op = gl.convert_layout((p * (dp - delta)).to(dtype), ds_layout)
        for j in range(1, n_mine):
            slot = j % NUM_STAGES
            prev = (j - 1) % NUM_STAGES
            mbarrier.wait(ready_bar.index(slot), (j // NUM_STAGES) & 1)
            # S_j, dP_j and dQ += dS_{j-1} K_{j-1} on the tensor cores; they complete in issue order.
            s_tok = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(
                do, v_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True
            )
            dq_tok = warpgroup_mma(ds_op, k_smem.index(prev), dq, is_async=True)
            s = warpgroup_mma_wait(2, deps=[s_tok])  # P_j while dP_j and dQ's product run
            p = _probabilities(
                s, lse2, j * BLOCK_N + offs_n, rows, N_K, OFFSET, qk_scale, j >= first_masked, CAUSAL
            )
            dp = warpgroup_mma_wait(1, deps=[dp_tok])  # dS_j while dQ's product runs
            ds_next = gl.convert_layout((p * (dp - delta)).to(dtype), ds_layout)
            # ds_next through the wait: dS_j must be done before it (as `hopper` passes P).
            dq, ds_op, ds_next = warpgroup_mma_wait(0, deps=[dq_tok, ds_op, ds_next])
            mbarrier.arrive(empty_bar.index(prev), count=1)  # K, V of block j - 1: done here
            ds_op = ds_next
        last = (n_mine - 1) % NUM_STAGES
        dq_tok = warpgroup_mma(ds_op, k_smem.index(last), dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=[dq_tok])
        mbarrier.arrive(empty_bar.index(last), count=1)
    for j in range(n_mine, n_blocks):  # causal: blocks past this warpgroup's last row, seen by the other's
        slot = j % NUM_STAGES
        mbarrier.wait(ready_bar.index(slot), (j // NUM_STAGES) & 1)
        mbarrier.arrive(empty_bar.index(slot), count=1)

    # dQ = dS K * scale: registers -> HBM once (rows past N_Q masked).
    o_rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, dq_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dq_layout))
    base = DQ + off_b.to(gl.int64) * stride_dqb + off_h.to(gl.int64) * stride_dqh
    ptrs = base + gl.expand_dims(o_rows, 1) * stride_dqm + gl.expand_dims(offs_d, 0)
    gl.store(ptrs, (dq * sm_scale).to(out_dtype), mask=gl.expand_dims(o_rows < N_Q, 1))


@gluon.jit
def dq_ws_kernel(
    q_desc, do_desc, k_desc, v_desc, L, Dlt, DQ, qk_scale, sm_scale,
    stride_lb, stride_lh, stride_lm, stride_dqb, stride_dqh, stride_dqm,
    H, GROUP, N_Q, N_K, OFFSET,
    CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    NUM_CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):  # fmt: skip
    """dQ of one block of 64 * NUM_CONSUMERS query rows of one (batch, query head).

    q_desc, do_desc: TMA descriptors of Q, dO as (B*H*N_Q, d) matrices in blocks of (64, d); k_desc,
    v_desc: K, V as (B*H_kv*N_K, d) in blocks of (BLOCK_N, d), H_kv = H // GROUP. L (B, H, N_Q) float32
    (natural log, strides stride_l*); Dlt (B*H, N_Q) float32, contiguous: D = rowsum(dO * O). DQ
    (B, H, N_Q, d), strides stride_dq* (unit last), float32 or Q's dtype: dQ = dS K * sm_scale.
    qk_scale = sm_scale * log2(e). OFFSET: the causal offset (row i sees key j when i + OFFSET >= j).
    Grid: cdiv(N_Q, 64 * NUM_CONSUMERS) * B * H programs, launched with num_warps=4 (the kernel's own
    warps are consumer 0)."""
    dtype: gl.constexpr = q_desc.dtype
    CTA_M: gl.constexpr = ROWS * NUM_CONSUMERS
    num_m = gl.cdiv(N_Q, CTA_M)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, ROWS, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, ROWS, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready_bar = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty_bar = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready_bar.index(i), count=1)
        mbarrier.init(empty_bar.index(i), count=NUM_CONSUMERS)
    fence_async_shared()

    # Run-time arguments go in a tuple; the compile-time ones one by one (`hopper.fwd_ws_kernel`).
    shared = (q_smem, do_smem, k_smem, v_smem, q_bar, ready_bar, empty_bar, L, Dlt, DQ, qk_scale, sm_scale,
              stride_lb, stride_lh, stride_lm, stride_dqb, stride_dqh, stride_dqm,
              H, N_Q, N_K, OFFSET, num_m)  # fmt: skip
    loads = (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, ready_bar, empty_bar,
             H, GROUP, N_Q, N_K, OFFSET, num_m)  # fmt: skip
    if NUM_CONSUMERS == 2:
        gl.warp_specialize(
            [
                (_consumer, (shared, CAUSAL, HEAD_DIM, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, 0)),
                (_consumer, (shared, CAUSAL, HEAD_DIM, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, 1)),
                (_producer, (loads, CAUSAL, BLOCK_N, NUM_STAGES, NUM_CONSUMERS)),
            ],
            [4, 1], [CONSUMER_REGS, 24],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_consumer, (shared, CAUSAL, HEAD_DIM, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, 0)),
                (_producer, (loads, CAUSAL, BLOCK_N, NUM_STAGES, NUM_CONSUMERS)),
            ],
            [1], [24],
        )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DqLaunch(Launch):
    """The kernel's launch: BLOCK_N keys per K/V block, NUM_STAGES K/V ring slots, NUM_CONSUMERS
    warpgroups of 64 query rows (a program's block: 64 or 128 rows), and programs_per_sm, the programs
    whose registers (`kwargs`) and shared memory (`shared_bytes`) one SM can hold at once. Unpacks as
    (block_n, num_stages, num_consumers, programs_per_sm)."""

    block_n: int = keyword("BLOCK_N")
    num_stages: int = keyword("NUM_STAGES")
    num_consumers: int = keyword("NUM_CONSUMERS")
    programs_per_sm: int = 1

    def kwargs(self) -> dict:
        """The kernel's constants of the launch, and its warps and registers: `hopper.launch_options`,
        with the SM's 64K registers shared by programs_per_sm programs."""
        options = launch_options(self.num_consumers)
        if self.programs_per_sm > 1:
            warps = 4 * self.num_consumers + 4  # the producer's warp padded to a warpgroup
            maxnreg = (65536 // (warps * 32 * self.programs_per_sm)) // 8 * 8
            regs = min(240, ((maxnreg * (warps // 4) - 24) // self.num_consumers) // 8 * 8)
            options = dict(options, maxnreg=maxnreg, CONSUMER_REGS=regs)
        return {**super().kwargs(), **options}

    def shared_bytes(self, d: int, itemsize: int = 2) -> int:
        """Shared memory of one program's tiles at head dim d: Q and dO (64 rows per consumer), the K and
        V ring (the mbarriers add a few bytes)."""
        return (2 * QUERY_ROWS * self.num_consumers + 2 * self.num_stages * self.block_n) * d * itemsize


# Per head dim, chosen before any GPU timing (scripts/hopper_dq_probe.py --variants times VARIANTS).
# Blocks of 64 keys: a consumer holds dQ (64 registers per thread at d = 128), S and dP (32 each) and two
# 16-bit dS operands (16 each); with blocks of 128 that would be about 256, over the 240 it gets. Every
# entry compiles for sm_90 without local memory (ptxas of triton 3.7.1). 3 stages: a consumer holds two
# slots (block j's, and j - 1's until dS_{j-1} K_{j-1} completes), so with 2 the next block's copy could
# only start at the end of a step.
LAUNCHES = {64: DqLaunch(64, 3, 2), 128: DqLaunch(64, 3, 2)}
# Candidates the probe times; each fits in an SM's shared memory (228 KB) programs_per_sm times.
VARIANTS = {
    64: (LAUNCHES[64], DqLaunch(64, 2, 2), DqLaunch(128, 2, 2), DqLaunch(128, 3, 2), DqLaunch(64, 3, 1, 2)),
    128: (LAUNCHES[128], DqLaunch(64, 2, 2), DqLaunch(64, 4, 2), DqLaunch(64, 2, 1, 2)),
}


def arguments(q4, k4, v4, do4, l3, delta, dq4, offset: int, causal: bool, scale: float, launch: DqLaunch):
    """(grid, args, kwargs) of the kernel's launch `dq_ws_kernel[grid](*args, **kwargs)` for these
    tensors (as `dq` takes them): built once, a launch can be repeated without rebuilding its descriptors."""
    B, H, n_q, d = q4.shape
    n_k = k4.shape[2]
    grid = (cdiv(n_q, QUERY_ROWS * launch.num_consumers) * B * H,)
    args = (
        descriptor(q4, QUERY_ROWS), descriptor(do4, QUERY_ROWS),
        descriptor(k4, launch.block_n), descriptor(v4, launch.block_n),
        l3, delta, dq4, scale * LOG2E, scale,
        l3.stride(0), l3.stride(1), l3.stride(2), dq4.stride(0), dq4.stride(1), dq4.stride(2),
        H, H // k4.shape[1], n_q, n_k, offset,
    )  # fmt: skip
    return grid, args, dict(CAUSAL=causal, HEAD_DIM=d, **launch.kwargs())


def dq(
    q4, k4, v4, do4, l3, delta, dq4, offset: int, causal: bool, scale: float, launch: DqLaunch | None = None
):
    """Write dQ = scale * dS K into dq4 (B, H, N_Q, d; unit last stride; float32 or q4's dtype) for q4, do4
    (B, H, N_Q, d) and k4, v4 (B, H_kv, N_K, d) that pass `hopper_backward.supports` (H a multiple of
    H_kv); l3 (B, H, N_Q) float32 is the forward's L (natural log), delta (B*H, N_Q) float32 contiguous
    holds D = rowsum(dO * O); offset: the causal alignment's `checks.causal_offset`. launch: LAUNCHES[d]
    unless given (one of VARIANTS, say). The caller makes q4's GPU current."""
    launch = LAUNCHES[q4.shape[-1]] if launch is None else launch
    grid, args, kwargs = arguments(q4, k4, v4, do4, l3, delta, dq4, offset, causal, scale, launch)
    wait_compiled(_key(q4, k4, dq4, offset, causal))  # compiled ahead during the forward, if it was
    bound.launch(dq_ws_kernel, grid, *args, **kwargs)


def _key(q4, k4, dq4, offset: int, causal: bool) -> tuple:
    return ("dQ (Gluon)", tuple(q4.shape), tuple(k4.shape), q4.dtype, dq4.dtype, offset, causal)


def choose(d: int) -> bool:
    """Whether this kernel, after the D pass (`d_pass.preprocess_kernel`), replaces the Triton dQ kernel
    (which computes D itself) when the Gluon dK/dV kernel runs. Measured on an H200 (`scripts/hopper_dq_probe.py`,
    bf16, B x N = 16k tokens, 2048 / d query heads, 1 or 4 per K/V head, 2026-11-29): at d = 128 the Triton
    launch over this kernel is 1.19-1.26x with no mask and 1.22-1.41x causal (both alignments), N = 1k-16k;
    at d = 64, 0.92-0.93x at 1k, 1.01-1.03x at 4k, 1.09-1.11x at 16k: too close for the D pass it needs."""
    return d == 128


def compile_ahead(q4, k4, v4, l3, delta, dq4, offset: int, causal: bool, scale: float) -> None:
    """Compile what `dq` will launch for these shapes in a background thread, once per process (as
    `hopper_backward.compile_ahead` does for the dK/dV kernel); q4 stands in for dO."""
    launch = LAUNCHES[q4.shape[-1]]

    def work():  # the descriptors are made in the thread, once: this runs before every backward's dQ
        grid, args, kwargs = arguments(q4, k4, v4, q4, l3, delta, dq4, offset, causal, scale, launch)
        return dq_ws_kernel.warmup(*args, grid=grid, **kwargs)

    compile_in_background(_key(q4, k4, dq4, offset, causal), work)
