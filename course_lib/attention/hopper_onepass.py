"""FlashAttention-3's one-pass backward on Hopper GPUs, in Gluon: dK, dV and dQ from one kernel
(notebook 08c, section 5).

The two-kernel backward (`hopper_backward` for dK, dV; a dQ kernel) computes S and dP twice: 7 products
where the algorithm needs 5. Here the dK/dV kernel of `hopper_backward` also computes dQ, as
FlashAttention-3 does (Shah et al. 2024, section 3.3):

* the two consumer warpgroups each own 64 keys of the program's block (dK, dV in registers) and each
  computes half of dQ's columns for the step's 64 query rows: dQ[:, cols_w] = dS K[:, cols_w], over both
  warpgroups' dS tiles in shared memory (`ds_bar`: an mbarrier between the two warpgroups);
* each warpgroup puts its half of dQ (fp32) in shared memory and TMA adds it into a float32 dQ
  accumulator in global memory (`cp.reduce.async.bulk.tensor ... .add`): the tensor cores' partners
  never hold an address or wait for an atomic. dQ = scale * accumulator, cast to Q's dtype, afterwards.
  At d = 128 the half is made and added in two chunks of 32 columns (`DQ_CHUNKS`), causal programs run one
  loop (the key mask in it), and non-causal ones one loop without the mask where N_K fills every block
  (`EVEN_K`), where one loop in each branch of the mask was compiled: the backward ran 4-13 % faster. Values
  ptxas spilled at d = 128 (H200, non-causal / causal): 54 / 74 before; 70 / 26 with the chunks and the causal
  loop; non-causal with EVEN_K, `scripts/gluon_spills.py`: 44 bytes of spill stores against 536.
* the order within a step is `hopper_backward`'s (dV as soon as P is stored, dK as soon as this warpgroup's dS
  is), dQ last. FlashAttention-3's (P and dS stored together behind one barrier, then dV, dQ, dK; dQ collected
  while dK runs) was no faster in the whole backward (d = 128, 16k causal: 377 against 378 TFLOP/s; d = 64:
  252 against 324; at 441f0eb).

Not chosen by `backward.backward`: it is correct (tests/test_hopper_onepass.py) but slower than the two kernels
in all but two cells (one win, one tie), and its dQ is not deterministic (the order of TMA's adds varies).
Measured on an H200 (bf16, B x N = 16k, H x d = 2048, TFLOP/s of the backward's 2.5 x forward FLOPs; the whole
backward with its D pass, zeroed accumulator and cast; `scripts/hopper_onepass_probe.py --ns 4096,16384`,
2026-11-30, one chunk / two, the default backward in the same run): d = 128 16k non-causal 471 / 493 against 491
(a tie, with EVEN_K), causal 387 / 431 against 449; 4k non-causal 439 / 466 against 512, causal 319 / 343 against
368; d = 64 (one chunk: no spills either way, two ran 1-9 % slower) 16k 352 / 327 against 365 / 313 (causal: the
one cell it wins, 1.04x), 4k 327 / 262 against 355 / 293.

Where the time goes (`scripts/hopper_onepass_ablate.py`: the source with parts taken out, d = 128 16k non-causal,
before the chunks): the whole 472; without TMA's add 499; without dQ's product, store and add 631; and without
the two warpgroups' waits for each other 660, where the two-kernel backward's dK/dV kernel runs the same 4
products at 833 (these units). So the adds cost 5 %. The two builds without the product say less than they seem:
compiled on a machine without a GPU (`scripts/gluon_spills.py`'s way, Triton 3.7's ptxas), both had their wgmmas
serialised (ptxas's C7515), which no build of this file has; with one loop, the stripped code is the dK/dV
kernel's, instruction for instruction but 16. Tried before and not kept: each warpgroup's dQ over its own 64 keys
and all d columns, no wait for the other's dS but twice the adds (d = 128 16k 396 / 350 against 472 / 381;
aa130cc); dQ added from shared memory by a writer warp of its own with `gl.atomic_add` (`atom.add.v4.f32`) 323 /
345 at d = 128, with `red.add.v4.f32` 331 / 345."""

from __future__ import annotations

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

from ..runtime import cdiv
from .backward import preprocess  # the backward's D pass
from .hopper import LOG2E, descriptor, launch_options
from .hopper_backward import (
    KROWS,
    QROWS,
    _probabilities,
    _producer,
    _row_stats,
    _scores,
    _tiles,
    partition_barrier,
    program_block,
    shared_tiles,
    step_block,
    store_dkdv,
)


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
def add_dq(dq, dq_c, dq_desc, row, col, PENDING: gl.constexpr):
    """A chunk of this warpgroup's columns of a step's dQ: into its shared-memory tile dq_c (once TMA has read
    what it held: at most PENDING later adds may still be reading their own tiles), then added to the
    accumulator at (row, col) by TMA."""
    tma.store_wait(PENDING)
    dq_c.store(dq)
    fence_async_shared()
    partition_barrier()
    _tma_reduce_add(dq_desc, [row, col], dq_c)


@gluon.jit
def _dq_product(ds_smem, k_smem, dq_zero, col: gl.constexpr, NUM_CONSUMERS: gl.constexpr):
    """Issue dQ[:, col ... col + C] = sum over the warpgroups c of dS_c K_c[:, col ...] (both dS tiles in shared
    memory), C = dq_zero's columns. Returns the product's token."""
    C: gl.constexpr = dq_zero.shape[1]
    dq_tok = warpgroup_mma(ds_smem.index(0), k_smem.index(0).slice(col, C, dim=1), dq_zero,
                           use_acc=False, is_async=True)  # fmt: skip
    for c in gl.static_range(1, NUM_CONSUMERS):
        dq_tok = warpgroup_mma(ds_smem.index(c), k_smem.index(c).slice(col, C, dim=1), dq_tok,
                               is_async=True)  # fmt: skip
    return dq_tok


@gluon.jit
def _steps(loop, dk, dv, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
           WG: gl.constexpr, KEY_MASK: gl.constexpr, DQ_CHUNKS: gl.constexpr):  # fmt: skip
    """A consumer's loop over its steps; returns dK, dV. KEY_MASK: the program's block holds keys past N_K
    (a loop of its own, so that the others carry no mask and no register for it). DQ_CHUNKS: this warpgroup's
    d / NUM_CONSUMERS columns of dQ in that many products, one after the other (fewer registers live at once)."""
    (q_smem, do_smem, k_smem, ds_smem, ready_bar, empty_bar, ds_bar, dq_full, dq_desc, k_w, v_w, p_w, ds_w,
     dq_w, s_zero, dq_zero, offs_m, cols, L, Dlt, stride_lb, stride_lh, stride_lm, qk_scale,
     H, GROUP, N_Q, N_K, OFFSET, n_start, lo, mid, n_m, first_head) = loop  # fmt: skip
    dtype: gl.constexpr = q_smem.dtype
    C: gl.constexpr = dq_zero.shape[1]  # columns of a chunk
    dk_tok = warpgroup_mma_init(dk)
    dv_tok = warpgroup_mma_init(dv)
    dq_tok = warpgroup_mma_init(dq_zero)
    for step in range(GROUP * n_m):
        g, m_blk = step_block(step, lo, n_m, GROUP, CAUSAL)
        head = first_head + g
        rows = m_blk * QROWS + offs_m
        q, do, s_tok, dp_tok = _scores(q_smem, do_smem, ready_bar, k_w, v_w, s_zero, step, NUM_STAGES)
        lse2, delta = _row_stats(L, Dlt, head, rows, H, N_Q, stride_lb, stride_lh, stride_lm)
        s, dk, dv = warpgroup_mma_wait(1, deps=[s_tok, dk_tok, dv_tok])
        if step > 0:
            mbarrier.arrive(empty_bar.index((step - 1) % NUM_STAGES), count=1)
        if KEY_MASK:  # keys past N_K (the next head's, or zeros) get P = 0, else dS K takes them into dQ
            keys = gl.arange(0, KROWS, layout=gl.SliceLayout(0, s_zero.type.layout))
            s = gl.where(gl.expand_dims(keys < N_K - n_start - WG * KROWS, 0), s, float("-inf"))
        p = _probabilities(s, rows, cols, m_blk, mid, OFFSET, lse2, qk_scale, CAUSAL)
        p_w.store(p.to(dtype))
        fence_async_shared()
        partition_barrier()
        dv_tok = warpgroup_mma(p_w.permute((1, 0)), do, dv, is_async=True)
        dp = warpgroup_mma_wait(1, deps=[dp_tok])
        ds = p * (dp - gl.expand_dims(delta, 1))
        if step > 0:  # both warpgroups' dQ products of the previous step, which read this tile, are done
            mbarrier.wait(dq_full, (step - 1) & 1)
        ds_w.store(ds.to(dtype))
        fence_async_shared()
        partition_barrier()
        mbarrier.arrive(ds_bar, count=1)
        dk_tok = warpgroup_mma(ds_w.permute((1, 0)), q, dk, is_async=True)
        mbarrier.wait(ds_bar, step & 1)  # both dS tiles of the step are in shared memory
        # each chunk's first column written inline: a constant (a name bound in every unrolled chunk is not)
        for c in gl.static_range(DQ_CHUNKS):
            dq_tok = _dq_product(ds_smem, k_smem, dq_zero, (WG * DQ_CHUNKS + c) * C, NUM_CONSUMERS)
            dq = warpgroup_mma_wait(0, deps=[dq_tok])
            row = head * N_Q + m_blk * QROWS
            add_dq(dq, dq_w.index(WG * DQ_CHUNKS + c), dq_desc, row, (WG * DQ_CHUNKS + c) * C, DQ_CHUNKS - 1)
        mbarrier.arrive(dq_full, count=1)  # counts the warpgroups done with the step
    dk, dv = warpgroup_mma_wait(0, deps=[dk_tok, dv_tok])
    return dk, dv


@gluon.jit
def _consumer(args, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
              WG: gl.constexpr, DQ_CHUNKS: gl.constexpr, EVEN_K: gl.constexpr):  # fmt: skip
    """Warpgroup WG: dK, dV of keys n_start + 64 WG ... + 63 (registers), and columns
    WG * d / NUM_CONSUMERS ... of each step's dQ (added by TMA, in DQ_CHUNKS chunks)."""
    (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, dq_smem, kv_bar, ready_bar, empty_bar,
     ds_bar, dq_full, dq_desc,
     L, Dlt, DK, DV, qk_scale, sm_scale, stride_lb, stride_lh, stride_lm,
     stride_kb, stride_kh, stride_kn, H, GROUP, N_Q, N_K, OFFSET, num_n, BHKV) = args  # fmt: skip
    CTA_N: gl.constexpr = KROWS * NUM_CONSUMERS
    C: gl.constexpr = HEAD_DIM // (NUM_CONSUMERS * DQ_CHUNKS)  # columns of a chunk of dQ
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16]
    )

    bhk, n_start, lo, mid, n_m, first_head = program_block(num_n, BHKV, H, GROUP, N_Q, OFFSET, CAUSAL, CTA_N)
    k_w = k_smem.index(WG)
    v_w = v_smem.index(WG)
    p_w = p_smem.index(WG)
    ds_w = ds_smem.index(WG)
    dq_w = dq_smem  # (NUM_CONSUMERS * DQ_CHUNKS, 64, C): a tile per warpgroup and chunk
    s_zero, dk, dv, offs_m, cols = _tiles(n_start + WG * KROWS, HEAD_DIM)
    dq_zero = gl.zeros([QROWS, C], gl.float32, layout=dq_layout)

    mbarrier.wait(kv_bar, 0)
    loop = (q_smem, do_smem, k_smem, ds_smem, ready_bar, empty_bar, ds_bar, dq_full, dq_desc, k_w, v_w, p_w, ds_w,
            dq_w, s_zero, dq_zero, offs_m, cols, L, Dlt, stride_lb, stride_lh, stride_lm, qk_scale,
            H, GROUP, N_Q, N_K, OFFSET, n_start, lo, mid, n_m, first_head)  # fmt: skip
    if CAUSAL:  # one loop, the key mask in it: a second loop's code spilled more (module docstring)
        dk, dv = _steps(loop, dk, dv, CAUSAL, NUM_STAGES, NUM_CONSUMERS, WG, True, DQ_CHUNKS)
    elif EVEN_K:  # every program's keys exist: one loop, no key mask
        dk, dv = _steps(loop, dk, dv, CAUSAL, NUM_STAGES, NUM_CONSUMERS, WG, False, DQ_CHUNKS)
    elif n_start + CTA_N > N_K:
        dk, dv = _steps(loop, dk, dv, CAUSAL, NUM_STAGES, NUM_CONSUMERS, WG, True, DQ_CHUNKS)
    else:
        dk, dv = _steps(loop, dk, dv, CAUSAL, NUM_STAGES, NUM_CONSUMERS, WG, False, DQ_CHUNKS)
    tma.store_wait(0)

    store_dkdv(
        dk, dv, DK, DV, sm_scale, n_start + WG * KROWS, bhk, H // GROUP, N_K, stride_kb, stride_kh, stride_kn
    )


@gluon.jit
def bwd_ws_kernel(
    q_desc, do_desc, k_desc, v_desc, dq_desc, L, Dlt, DK, DV, qk_scale, sm_scale,
    stride_lb, stride_lh, stride_lm, stride_kb, stride_kh, stride_kn,
    H, GROUP, SHARE, N_Q, N_K, OFFSET, BHKV,
    CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, DQ_CHUNKS: gl.constexpr = 1, EVEN_K: gl.constexpr = False,
):  # fmt: skip
    """`hopper_backward.dkdv_ws_kernel`'s arguments, and dq_desc: a TMA descriptor of a zeroed float32
    (B * H * N_Q, d) accumulator in blocks of (64, d / (NUM_CONSUMERS * DQ_CHUNKS)), which receives the sum
    over key blocks of dS K (unscaled). Rows of a step past N_Q add zeros (P = 0 there) to the next head's rows, or
    fall outside the tensor, where TMA drops them. EVEN_K: N_K is a multiple of 64 * NUM_CONSUMERS, so no program
    needs the key mask: non-causal calls compile one loop, not two (causal ones have one loop, masked, either way:
    unmasked it ran 3 % slower)."""
    CTA_N: gl.constexpr = KROWS * NUM_CONSUMERS
    C: gl.constexpr = HEAD_DIM // (NUM_CONSUMERS * DQ_CHUNKS)
    num_n = gl.cdiv(N_K, CTA_N)
    q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, ready_bar, empty_bar = shared_tiles(
        q_desc, do_desc, k_desc, v_desc, HEAD_DIM, NUM_STAGES, NUM_CONSUMERS
    )
    dq_smem = gl.allocate_shared_memory(gl.float32, [NUM_CONSUMERS * DQ_CHUNKS, QROWS, C], dq_desc.layout)
    ds_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ds_bar, count=NUM_CONSUMERS)
    mbarrier.init(dq_full, count=NUM_CONSUMERS)
    fence_async_shared()

    shared = (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, dq_smem, kv_bar, ready_bar, empty_bar,
              ds_bar, dq_full, dq_desc,
              L, Dlt, DK, DV, qk_scale, sm_scale, stride_lb, stride_lh, stride_lm,
              stride_kb, stride_kh, stride_kn, H, GROUP, N_Q, N_K, OFFSET, num_n, BHKV)  # fmt: skip
    loads = (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, ready_bar, empty_bar,
             H, GROUP, SHARE, N_Q, N_K, OFFSET, num_n, BHKV)  # fmt: skip
    gl.warp_specialize(
        [
            (_consumer, (shared, CAUSAL, HEAD_DIM, NUM_STAGES, NUM_CONSUMERS, 0, DQ_CHUNKS, EVEN_K)),
            (_consumer, (shared, CAUSAL, HEAD_DIM, NUM_STAGES, NUM_CONSUMERS, 1, DQ_CHUNKS, EVEN_K)),
            (_producer, (loads, CAUSAL, NUM_STAGES, NUM_CONSUMERS)),
        ],
        [4, 1], [CONSUMER_REGS, 24],
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------
NUM_CONSUMERS = 2
NUM_STAGES = 2  # Q, dO ring slots: d = 128 takes 197 KB of shared memory with two


def backward(q4, k4, v4, o4, do4, l3, offset: int, causal: bool, scale: float, dq_chunks: int | None = None):
    """(dQ, dK, dV) of attention from one kernel, for q4, do4, o4 (B, H, N_Q, d) and k4, v4 (B, H_kv, N_K, d)
    that pass `hopper_backward.supports` (a Hopper GPU, 16-bit, contiguous, d 64 or 128); l3 (B, H, N_Q) the
    forward's L (float32, natural log); offset: the causal alignment's `checks.causal_offset`. dK, dV are
    summed over the H / H_kv query heads of each K/V head. dq_chunks: products a warpgroup's half of a step's dQ
    is made in (`_steps`' DQ_CHUNKS; None: 2 at d = 128, 1 at d = 64, the faster of each in the module docstring).
    The caller makes q4's GPU current."""
    B, H, n_q, d = q4.shape
    dq_chunks = dq_chunks or (2 if d == 128 else 1)
    h_kv, n_k = k4.shape[1], k4.shape[2]
    delta = torch.empty(B * H, n_q, dtype=torch.float32, device=q4.device)  # D = rowsum(dO * O)
    preprocess(o4, do4, delta, q4.dtype)
    dq_acc = torch.zeros(B * H * n_q, d, dtype=torch.float32, device=q4.device)
    dk, dv = torch.empty_like(k4), torch.empty_like(v4)
    cols = d // (NUM_CONSUMERS * dq_chunks)
    dq_desc = TensorDescriptor(
        dq_acc, [B * H * n_q, d], [d, 1], [QROWS.value, cols],
        gl.NVMMASharedLayout.get_default_for([QROWS.value, cols], gl.float32),
    )  # fmt: skip
    grid = (cdiv(n_k, KROWS.value * NUM_CONSUMERS) * B * h_kv,)
    bwd_ws_kernel[grid](
        descriptor(q4, QROWS.value), descriptor(do4, QROWS.value),
        descriptor(k4, KROWS.value), descriptor(v4, KROWS.value), dq_desc,
        l3, delta, dk, dv, scale * LOG2E, scale,
        l3.stride(0), l3.stride(1), l3.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
        H, H // h_kv, 1, n_q, n_k, offset, B * h_kv,
        CAUSAL=causal, HEAD_DIM=d, NUM_STAGES=NUM_STAGES, NUM_CONSUMERS=NUM_CONSUMERS, DQ_CHUNKS=dq_chunks,
        EVEN_K=n_k % (KROWS.value * NUM_CONSUMERS) == 0,
        **launch_options(NUM_CONSUMERS),
    )  # fmt: skip
    return (dq_acc.view(q4.shape) * scale).to(q4.dtype), dk, dv
