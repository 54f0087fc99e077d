"""Prototype: the Gluon dK/dV kernel in FlashAttention-3's own d = 128 layout, transposed tiles with P^T and dS^T fed
to the products from registers (`course_lib/attention/hopper_backward.py` stores P and dS to shared memory and reads
them back; notes/attention.md, "Open").

    python3 scripts/hopper_dkdv_rs.py --compile-only        # any machine: ptxas's spills for sm_90a, no GPU
    python3 scripts/hopper_dkdv_rs.py [--stages 2]          # a Hopper GPU: against hopper_backward.dkdv
    python3 scripts/hopper_dkdv_rs.py --one-pass            # ... with dQ too, against the default backward

Per consumer warpgroup (64 keys of the program's 128) and query block of 64 rows:

    S^T  = K_w Q^T,  dP^T = V_w dO^T        (64 keys x 64 queries, fp32; A from shared memory)
    P^T  = exp2(S^T scale log2 e - L2[q]),  masked on the causal diagonal
    dV  += P^T dO                            (A = P^T in registers, 16 bits)
    dS^T = P^T (dP^T - D[q])
    dK  += dS^T Q                            (A = dS^T in registers)

L and D are per query, the tiles' columns, so a thread would hold 16 values of each, their addresses and masks: the
producer brings each step's 64 values of L2 = L log2 e (+inf past N_Q) and D into shared memory by TMA with Q and
dO (`stats` lays them out; a library version would have the D pass write them), and the consumers read them there
when they need them. Nothing of P or dS goes through shared memory for dK and dV (`hopper_backward`'s shared memory is
taken as it is, its P and dS tiles unused but for dS^T in the one pass below, plus the two small vectors). The
program's block, its steps (GQA, both causal alignments) and the dK, dV store are `hopper_backward`'s.

With DQ (`onepass_rs`, `--one-pass`) the kernel also makes dQ as `hopper_onepass` does (both warpgroups' dS, d / 2
columns each, in chunks, added to a float32 accumulator by TMA): dS^T goes to shared memory for that product alone.

Status (2026-11-30): written and compiled for sm_90a on a machine without a GPU (`--compile-only`, Triton 3.7's
ptxas): dK/dV: no spills and no serialised wgmmas at d = 64 and 128, causal or not, 2 or 3 stages
(`hopper_backward`'s kernel: 8 / 20 bytes of spill stores at d = 128); one pass at d = 128, dQ in 2 chunks: 12 / 60
bytes non-causal / causal (`hopper_onepass`: 44 / 172), in 1 chunk 180 / 216; d = 64 none. Never run on a GPU: the
first run is the check against `hopper_backward.dkdv` (its largest difference per cell), then the times. A first
version that loaded L and D into registers spilled 140 bytes at d = 128, and ptxas serialised its wgmmas (C7515: a
spilled value reloaded into dP^T's accumulator between two of its wgmmas).
"""

from __future__ import annotations

import argparse

import torch
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
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from course_lib.attention.hopper import LOG2E, descriptor, launch_options
from course_lib.attention.hopper_backward import (
    KEY_ROWS,
    KROWS,
    QROWS,
    QUERY_ROWS,
    partition_barrier,
    program_block,
    program_index,
    query_block_range,
    shared_tiles,
    step_block,
    store_dkdv,
)
from course_lib.attention.hopper_onepass import add_dq
from course_lib.runtime import cdiv

NUM_CONSUMERS = 2


@gluon.jit
def _producer(args, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr):
    """`hopper_backward._producer`, and with each step's Q and dO its 64 values of L2 and D (`stats`) into the
    slot's small tiles: the consumers read them from shared memory, holding no addresses for them."""
    (q_desc, do_desc, k_desc, v_desc, l_desc, d_desc, q_smem, do_smem, k_smem, v_smem, l_smem, d_smem, kv_bar,
     ready_bar, empty_bar, H, GROUP, SHARE, N_Q, N_K, OFFSET, num_n, BHKV, N_PAD) = args  # fmt: skip
    CTA_N: gl.constexpr = KROWS * NUM_CONSUMERS
    bhk, n_blk = program_index(num_n, BHKV, CAUSAL)
    n_start = n_blk * CTA_N
    kv_row = (bhk // SHARE) * N_K + n_start
    mbarrier.expect(kv_bar, 2 * NUM_CONSUMERS * k_desc.block_type.nbytes)
    for c in gl.static_range(NUM_CONSUMERS):
        tma.async_copy_global_to_shared(k_desc, [kv_row + c * KROWS, 0], kv_bar, k_smem.index(c))
        tma.async_copy_global_to_shared(v_desc, [kv_row + c * KROWS, 0], kv_bar, v_smem.index(c))
    lo, mid, hi = query_block_range(n_start, N_Q, OFFSET, CAUSAL, CTA_N)
    n_m = hi - lo
    first_head = (bhk // (H // GROUP)) * H + (bhk % (H // GROUP)) * GROUP
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
def _dq_product_t(ds_smem, k_smem, dq_zero, col: gl.constexpr, NUM_CONSUMERS: gl.constexpr):
    """Issue dQ[:, col ... col + C] = sum over the warpgroups c of dS_c K_c[:, col ...], dS_c read as the transpose
    of the dS^T tile warpgroup c stored (64 keys x 64 queries). Returns the product's token."""
    C: gl.constexpr = dq_zero.shape[1]
    tok = warpgroup_mma(ds_smem.index(0).permute((1, 0)), k_smem.index(0).slice(col, C, dim=1), dq_zero,
                        use_acc=False, is_async=True)  # fmt: skip
    for c in gl.static_range(1, NUM_CONSUMERS):
        tok = warpgroup_mma(ds_smem.index(c).permute((1, 0)), k_smem.index(c).slice(col, C, dim=1), tok,
                            is_async=True)  # fmt: skip
    return tok


@gluon.jit
def _consumer(args, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
              NUM_CONSUMERS: gl.constexpr, WG: gl.constexpr, DQ: gl.constexpr, DQ_CHUNKS: gl.constexpr):  # fmt: skip
    """Warpgroup WG: dK, dV of keys n_start + 64 WG ... + 63, from transposed tiles (module docstring); with DQ,
    its columns of each step's dQ too (`hopper_onepass`'s way: both warpgroups' dS, d / 2 columns each, in
    DQ_CHUNKS chunks, added by TMA)."""
    (q_smem, do_smem, k_smem, v_smem, l_smem, d_smem, ds_smem, dq_smem, kv_bar, ready_bar, empty_bar, ds_bar,
     dq_full, dq_desc, DK, DV, qk_scale, sm_scale, stride_kb, stride_kh, stride_kn, H, GROUP, N_Q, N_K, OFFSET,
     num_n, BHKV) = args  # fmt: skip
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
    bhk, n_start, lo, mid, n_m, first_head = program_block(num_n, BHKV, H, GROUP, N_Q, OFFSET, CAUSAL, CTA_N)
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
        if DQ:  # keys past N_K (the next head's, or zeros) get P = 0, else dS K takes them into dQ
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
        if DQ:
            if (
                step > 0
            ):  # both warpgroups' dQ products of the previous step, which read these tiles, are done
                mbarrier.wait(dq_full, (step - 1) & 1)
            ds_smem.index(WG).store(ds16)
            fence_async_shared()
            partition_barrier()
            mbarrier.arrive(ds_bar, count=1)
            mbarrier.wait(ds_bar, step & 1)  # both warpgroups' dS^T tiles of the step are in shared memory
            for c in gl.static_range(DQ_CHUNKS):  # each chunk's first column written inline (a constant)
                dq_tok = _dq_product_t(ds_smem, k_smem, dq_zero, (WG * DQ_CHUNKS + c) * C, NUM_CONSUMERS)
                dq = warpgroup_mma_wait(0, deps=[dq_tok])
                row = head * N_Q + m_blk * QROWS
                add_dq(
                    dq,
                    dq_smem.index(WG * DQ_CHUNKS + c),
                    dq_desc,
                    row,
                    (WG * DQ_CHUNKS + c) * C,
                    DQ_CHUNKS - 1,
                )
            mbarrier.arrive(dq_full, count=1)
    dk, dv = warpgroup_mma_wait(0, deps=[dk_tok, dv_tok])
    if DQ:
        tma.store_wait(0)
    store_dkdv(
        dk, dv, DK, DV, sm_scale, n_start + WG * KROWS, bhk, H // GROUP, N_K, stride_kb, stride_kh, stride_kn
    )


@gluon.jit
def dkdv_rs_kernel(
    q_desc, do_desc, k_desc, v_desc, l_desc, d_desc, dq_desc, DK, DV, qk_scale, sm_scale,
    stride_kb, stride_kh, stride_kn,
    H, GROUP, SHARE, N_Q, N_K, OFFSET, BHKV, N_PAD,
    CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, DQ: gl.constexpr = False, DQ_CHUNKS: gl.constexpr = 1,
):  # fmt: skip
    """`hopper_backward.dkdv_ws_kernel`'s arguments and grid, but L and D as TMA descriptors (l_desc, d_desc) of
    (B * H * N_PAD,) float32 vectors in blocks of 64: L2 = L log2 e with +inf past N_Q (and for rows that saw no
    key), D with 0 there, N_PAD = N_Q rounded up to 64 (`stats`). With DQ,
    dq_desc is `hopper_onepass.bwd_ws_kernel`'s (a zeroed float32 accumulator, blocks of 64 x d / (2 DQ_CHUNKS)),
    and the dS^T tiles go to shared memory for dQ's products (else dq_desc is not read)."""
    CTA_N: gl.constexpr = KROWS * NUM_CONSUMERS
    num_n = gl.cdiv(N_K, CTA_N)
    # `hopper_backward`'s ring, K, V and barriers; its P tiles go unused, its dS tiles hold dS^T (64 x 64 either way)
    q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, ready_bar, empty_bar = shared_tiles(
        q_desc, do_desc, k_desc, v_desc, HEAD_DIM, NUM_STAGES, NUM_CONSUMERS
    )
    l_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, QROWS], l_desc.layout)
    d_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, QROWS], d_desc.layout)
    C: gl.constexpr = HEAD_DIM // (NUM_CONSUMERS * DQ_CHUNKS)
    if DQ:
        dq_smem = gl.allocate_shared_memory(gl.float32, [NUM_CONSUMERS * DQ_CHUNKS, QROWS, C], dq_desc.layout)
    else:  # not read
        dq_smem = l_smem
    ds_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ds_bar, count=NUM_CONSUMERS)
    mbarrier.init(dq_full, count=NUM_CONSUMERS)
    fence_async_shared()
    shared = (q_smem, do_smem, k_smem, v_smem, l_smem, d_smem, ds_smem, dq_smem, kv_bar, ready_bar, empty_bar,
              ds_bar, dq_full, dq_desc, DK, DV, qk_scale, sm_scale, stride_kb, stride_kh, stride_kn, H, GROUP, N_Q,
              N_K, OFFSET, num_n, BHKV)  # fmt: skip
    loads = (q_desc, do_desc, k_desc, v_desc, l_desc, d_desc, q_smem, do_smem, k_smem, v_smem, l_smem, d_smem,
             kv_bar, ready_bar, empty_bar, H, GROUP, SHARE, N_Q, N_K, OFFSET, num_n, BHKV, N_PAD)  # fmt: skip
    gl.warp_specialize(
        [
            (_consumer, (shared, CAUSAL, HEAD_DIM, NUM_STAGES, NUM_CONSUMERS, 0, DQ, DQ_CHUNKS)),
            (_consumer, (shared, CAUSAL, HEAD_DIM, NUM_STAGES, NUM_CONSUMERS, 1, DQ, DQ_CHUNKS)),
            (_producer, (loads, CAUSAL, NUM_STAGES, NUM_CONSUMERS)),
        ],
        [4, 1], [CONSUMER_REGS, 24],
    )  # fmt: skip


def stats(l3, delta, n_pad: int):
    """L2 = L log2 e and D as (B * H * n_pad,) float32 vectors: +inf and 0 past N_Q, and L2 = +inf where L = -inf
    (a row that saw no key): what the kernel's TMA loads reads. (In a library version the D pass would write them.)"""
    B, H, n_q = l3.shape
    l2 = torch.full((B * H, n_pad), float("inf"), device=l3.device)
    l2[:, :n_q] = torch.where(l3.isneginf(), float("inf"), l3 * LOG2E).reshape(B * H, n_q)
    d = torch.zeros((B * H, n_pad), device=l3.device)
    d[:, :n_q] = delta
    return l2.view(-1), d.view(-1)


def _vector_desc(t):
    layout = gl.NVMMASharedLayout.get_default_for([QUERY_ROWS], gl.float32)
    return TensorDescriptor(t, [t.numel()], [1], [QUERY_ROWS], layout)


def _launch(
    q4, k4, v4, do4, l3, delta, dk4, dv4, offset, causal, scale, stages, dq_acc=None, dq_chunks=1, grid=None
):
    B, H, n_q, d = q4.shape
    h_kv, n_k = k4.shape[1], k4.shape[2]
    n_pad = cdiv(n_q, QUERY_ROWS) * QUERY_ROWS
    l2, d2 = stats(l3, delta, n_pad)
    dq = dq_acc is not None
    if dq:
        cols = d // (NUM_CONSUMERS * dq_chunks)
        layout = gl.NVMMASharedLayout.get_default_for([QUERY_ROWS, cols], gl.float32)
        dq_desc = TensorDescriptor(dq_acc, [B * H * n_q, d], [d, 1], [QUERY_ROWS, cols], layout)
    else:
        dq_desc = _vector_desc(d2)  # not read
    args = (
        descriptor(q4, QUERY_ROWS), descriptor(do4, QUERY_ROWS), descriptor(k4, KEY_ROWS), descriptor(v4, KEY_ROWS),
        _vector_desc(l2), _vector_desc(d2), dq_desc, dk4, dv4, scale * LOG2E, scale,
        dk4.stride(0), dk4.stride(1), dk4.stride(2),
        H, H // h_kv, 1, n_q, n_k, offset, B * h_kv, n_pad,
    )  # fmt: skip
    meta = dict(CAUSAL=causal, HEAD_DIM=d, NUM_STAGES=stages, NUM_CONSUMERS=NUM_CONSUMERS, DQ=dq,
                DQ_CHUNKS=dq_chunks, **launch_options(NUM_CONSUMERS))  # fmt: skip
    if grid is not None:
        return dkdv_rs_kernel.warmup(*args, grid=grid, **meta)
    dkdv_rs_kernel[(cdiv(n_k, KEY_ROWS * NUM_CONSUMERS) * B * h_kv,)](*args, **meta)
    return None


def dkdv_rs(
    q4, k4, v4, do4, l3, delta, dk4, dv4, offset: int, causal: bool, scale: float, stages: int = 2, grid=None
):
    """`hopper_backward.dkdv`'s contract (dk4, dv4 in K's dtype, one slice per K/V head), with this kernel.
    grid=(1,) compiles without launching (`--compile-only`); returns the kernel's compiled binary then."""
    return _launch(q4, k4, v4, do4, l3, delta, dk4, dv4, offset, causal, scale, stages, grid=grid)


def onepass_rs(q4, k4, v4, o4, do4, l3, offset: int, causal: bool, scale: float, stages: int = 2, dq_chunks: int = 2,
               grid=None):  # fmt: skip
    """`hopper_onepass.backward`'s contract ((dQ, dK, dV)), with this kernel's DQ: its D pass, zeroed float32
    accumulator and cast as there."""
    from course_lib.attention.backward import preprocess

    B, H, n_q, d = q4.shape
    delta = torch.empty(B * H, n_q, dtype=torch.float32, device=q4.device)
    if grid is None:
        preprocess(o4, do4, delta, q4.dtype)
    dq_acc = torch.zeros(B * H * n_q, d, dtype=torch.float32, device=q4.device)
    dk, dv = torch.empty_like(k4), torch.empty_like(v4)
    out = _launch(q4, k4, v4, do4, l3, delta, dk, dv, offset, causal, scale, stages, dq_acc, dq_chunks, grid)
    if grid is not None:
        return out
    return (dq_acc.view(q4.shape) * scale).to(q4.dtype), dk, dv


def rs_call(stages: int):
    """`dkdv_rs` with `hopper_backward.dkdv`'s arguments."""
    return lambda *args: dkdv_rs(*args, stages=stages)


def compile_only(stages: int) -> None:
    import gluon_spills  # scripts/: the sm_90a target on any machine

    gluon_spills.use_sm90_target()
    for d in (128, 64):
        B, H, n = 1, 2, 1024
        q, k, v, do = (torch.randn(B, H, n, d).to(torch.bfloat16) for _ in range(4))
        lse, delta = torch.zeros(B, H, n), torch.zeros(B * H, n)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        for causal in (False, True):
            binary = dkdv_rs(q, k, v, do, lse, delta, dk, dv, 0, causal, d**-0.5, stages, grid=(1,))
            print(f"dK/dV, d = {d}, causal {causal}, {stages} stages: {gluon_spills.ptxas_spills(binary)}")
            for chunks in (1, 2):
                binary = onepass_rs(q, k, v, q, do, lse, 0, causal, d**-0.5, stages, chunks, grid=(1,))
                print(f"one pass, dQ in {chunks} chunk(s): {gluon_spills.ptxas_spills(binary)}")


def check_and_time(stages: int) -> None:
    from course_lib.attention import backward as bwd
    from course_lib.attention import forward as fwd
    from course_lib.attention import hopper_backward as hb
    from course_lib.perf.timing import benchmark

    for d in (128, 64):
        for n, causal in (
            (1000, False),
            (1000, True),
            (4096, False),
            (4096, True),
            (16384, False),
            (16384, True),
        ):
            B, H = max(16384 // n, 1), 2048 // d
            q, k, v, do = (torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            o, lse = fwd.forward(q, k, v, causal=causal)
            delta = torch.empty(B * H, n, dtype=torch.float32, device="cuda")
            bwd.preprocess(o, do, delta, q.dtype)
            ref_k, ref_v, dk, dv = (torch.empty_like(k) for _ in range(4))
            hb.dkdv(q, k, v, do, lse, delta, ref_k, ref_v, 0, causal, d**-0.5)
            dkdv_rs(q, k, v, do, lse, delta, dk, dv, 0, causal, d**-0.5, stages)
            diff = max(
                (dk.float() - ref_k.float()).abs().max().item(),
                (dv.float() - ref_v.float()).abs().max().item(),
            )
            flops = 2 * 4 * B * H * n * n * d * (0.5 if causal else 1.0)  # the kernel's 4 products
            t_ref, t_rs = (
                benchmark(lambda f=f, out=out: f(q, k, v, do, lse, delta, *out, 0, causal, d**-0.5))  # noqa: B023
                for f, out in ((hb.dkdv, (ref_k, ref_v)), (rs_call(stages), (dk, dv)))
            )
            print(
                f"d = {d}, N = {n}, causal {causal}: max diff from hopper_backward {diff:.2e}; TFLOP/s "
                f"{flops / t_ref / 1e9:.0f} (hopper_backward) / {flops / t_rs / 1e9:.0f} (this)",
                flush=True,
            )


def check_and_time_one_pass(stages: int) -> None:
    """The one pass against the default backward (`attention.backward.backward`): the largest difference of dQ,
    dK, dV, then TFLOP/s of the backward's 2.5 x forward FLOPs for the default, `hopper_onepass.backward` and
    this kernel's (dQ in 1 and 2 chunks)."""
    from course_lib.attention import backward as bwd
    from course_lib.attention import forward as fwd
    from course_lib.attention import hopper_onepass
    from course_lib.perf.timing import benchmark

    for d in (128, 64):
        for n, causal in ((1000, False), (4096, False), (4096, True), (16384, False), (16384, True)):
            B, H = max(16384 // n, 1), 2048 // d
            q, k, v, do = (torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            o, lse = fwd.forward(q, k, v, causal=causal)
            scale = d**-0.5
            want = bwd.backward(do, q, k, v, o, lse, causal=causal)
            got = {c: onepass_rs(q, k, v, o, do, lse, 0, causal, scale, stages, c) for c in (1, 2)}
            diff = max((g.float() - w.float()).abs().max().item() for c in got for g, w in zip(got[c], want))
            flops = 2.5 * 4 * B * H * n * n * d * (0.5 if causal else 1.0)
            calls = {
                "default": lambda: bwd.backward(do, q, k, v, o, lse, causal=causal),  # noqa: B023
                "hopper_onepass": lambda: hopper_onepass.backward(q, k, v, o, do, lse, 0, causal, scale),  # noqa: B023
                "this, 1 chunk": lambda: onepass_rs(q, k, v, o, do, lse, 0, causal, scale, stages, 1),  # noqa: B023
                "this, 2 chunks": lambda: onepass_rs(q, k, v, o, do, lse, 0, causal, scale, stages, 2),  # noqa: B023
            }
            rates = ", ".join(f"{name} {flops / benchmark(call) / 1e9:.0f}" for name, call in calls.items())
            print(f"d = {d}, N = {n}, causal {causal}: max diff {diff:.2e}; TFLOP/s {rates}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument(
        "--one-pass", action="store_true", help="the one pass (dQ too) against the default backward"
    )
    a = p.parse_args()
    if a.compile_only:
        compile_only(a.stages)
    elif a.one_pass:
        check_and_time_one_pass(a.stages)
    else:
        check_and_time(a.stages)


if __name__ == "__main__":
    main()
