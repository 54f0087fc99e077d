"""FlashAttention-2 backward pass in Triton (notebook 07).

Given dO, the backward needs dQ = dS K * scale, dK = dS^T Q * scale and dV = P^T dO, where
P = exp(S * scale - L) is rebuilt tile by tile from the saved logsumexp L (no Nq x Nk matrix is ever
stored) and dS = P * (dP - D) with dP = dO V^T and D = rowsum(dO * O).

The kernels:
1. `d_pass.preprocess_kernel`: D = rowsum(dO * O), one float per query row (reads dO and O once).
2. `_dkdv_kernel`: one program per block of BLOCK_N key rows. K and V stay on chip (registers /
   shared memory) while the program loops over all query blocks that see them, streaming Q, dO, L
   and D from HBM; dK and dV accumulate in fp32 registers and are written once.
3. `_dq_kernel`: one program per block of BLOCK_M query rows. Q, dO, L, D stay on chip while the
   program loops over the K/V blocks; dQ accumulates in fp32 registers and is written once.
Splitting dQ from dK/dV costs recomputing S and dP (7 matrix products instead of 5) but needs no
atomics: that is `dq_mode="two_kernel"` (the default). There the dQ kernel runs first and computes D
itself (FUSE_D: it holds dO already and reads O once more), storing D for the dK/dV kernel, so the
backward is two launches, not three (launches cost CPU time, notes/attention.md, "Open").
`dq_mode="atomic"` instead adds each program's dQ contribution into an fp32 buffer with
`tl.atomic_add` (relaxed) inside the dK/dV kernel (one pass, 5 products, but Nk / BLOCK_N read-modify-writes
of every dQ element), after the preprocessing kernel: 0.65-0.78x the default's speed on an H200 (notes/attention.md).

Causal (top-left or bottom-right aligned): blocks wholly above the diagonal are skipped; only diagonal
blocks are masked (separate loop stages), as in the forward pass; `blocks.q_block_range` and
`blocks.kv_block_range` say which (with a sliding window, `blocks.window_q_range` and
`blocks.window_kv_range` cut them down and add the window's edge as a third, masked stage). Grouped-query
attention: a dK/dV program owns one block of one K/V head and loops over the GROUP query heads that share
it, so dK and dV are summed over those heads on chip, with no atomics and no repeated K/V (causal programs
walk all the heads' query blocks in one loop, `dkdv_one_loop`); where that measured slower
(`dkdv_heads_per_program`, and the Hopper kernel's `heads_per_program`), fewer heads per program write
partial sums that `_group_sum_kernel` adds up. Rows that saw no key (L = -inf) contribute nothing.

On a Hopper GPU, where `hopper_backward.choose` measured it faster (d = 64 and 128), the dK/dV kernel is
instead a warp-specialised one after FlashAttention-3, in Gluon (`hopper_backward`, notebook 08c): the Triton
kernel above spills registers at d = 128, and at d = 64 the Gluon one sums over 128 query rows a step. The dQ
kernel (with D) runs first either way.

How P is rebuilt (`probabilities`) and which blocks a program visits (`blocks.q_block_range`,
`blocks.kv_block_range`) are `tl.constexpr` function arguments of the kernels, defaulting to these
production helpers; notebook 08's optimisation ladder swaps in its first rungs' variants (natural
exponentials, every block masked) from `teaching.py` through `config=`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .. import runtime
from ..checks import (
    accumulator_dtype,
    causal_alignment,
    causal_offset,
    check_sinks,
    check_window,
    default_scale,
    kernel_window,
    kv_group,
)
from ..kernels import bound
from ..kernels.blocks import (
    kv_block_range,
    load_rows,
    program_block,
    q_block_range,
    row_mask,
    sequence,
    visible_keys,
    window_kv_range,
    window_q_range,
)
from ..kernels.launch import Launch, PerDevice, keyword
from ..kernels.plans import on_current_device
from ..kernels.softmax import LOG2E
from ..runtime import tl, triton
from .configs import DKDV, DQ, split_config, teaching_hooks
from .d_pass import preprocess_kernel, preprocess_launch
from .forward import hopper_kernels, run_gluon
from .inputs import as_4d, check_inputs, kernel_flags, strides4, within_offsets
from .launch import (
    compile_ahead,
    compile_kernel_ahead,
    cuda_device,
    launch,
    make_tuner,
    n_bucket,
    wait_compiled,
)

DQ_MODES = ("two_kernel", "atomic")


@triton.jit
def _load_lse(l_ptrs, mask):
    """L of a block of query rows; a row that saw no key (L = -inf) reads +inf, so that its
    P = exp(S - L) is exactly 0 (not exp(-inf + inf) = NaN) and it adds nothing to any gradient."""
    lse = tl.load(l_ptrs, mask=mask, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse)


@triton.jit
def probabilities(s, lse2, qk_scale):
    """P = exp(S * scale - L) for a tile of raw scores S = Q K^T, in base 2: exp2(S * qk_scale - L2)
    with qk_scale = scale * log2 e and L2 = L * log2 e (the forward's L in base-2 units, shaped to
    broadcast against S). The kernels convert L once per row, before it is broadcast: one multiply-add
    and one ex2 per score. A masked score (-inf) gives P = 0."""
    return tl.math.exp2(s * qk_scale - lse2)


@triton.jit
def _dkdv_block(
    dk, dv, k, v, q_ptrs, do_ptrs, l_base, d_base, dq_base, start_m,
    stride_qm, stride_dom, stride_lm, stride_dqm, stride_dqd,
    offs_n, offs_m, offs_d, N_Q, N_K, offset, window, sm_scale, qk_scale,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, PROBABILITIES: tl.constexpr, ATOMIC: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC_DTYPE: tl.constexpr, LOCAL: tl.constexpr,
):  # fmt: skip
    """Add one query block's share (rows start_m ... start_m + BLOCK_M - 1 of one head) to dK, dV.

    The tiles are computed transposed, (BLOCK_N, BLOCK_M): S^T = K Q^T, so P^T and dS^T come out
    ready for dV += P^T dO and dK += dS^T Q without moving a tile between layouts. Query rows past
    N_Q load L = +inf, so their P is exactly 0 and they add nothing even in an unmasked stage."""
    start_m = tl.multiple_of(start_m, BLOCK_M)
    rows = start_m + offs_m
    # Q and dO blocks: HBM -> shared memory, 2 * BLOCK_M * d elements per step (coalesced rows).
    q = load_rows(q_ptrs + start_m * stride_qm, rows, N_Q, offs_d, HEAD_DIM, BLOCK_D, UPCAST)
    lse2 = _load_lse(l_base + rows * stride_lm, rows < N_Q) * LOG2E  # L: BLOCK_M floats, base 2
    sT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)  # (BLOCK_N, BLOCK_M)
    if MASK:
        visible = visible_keys(rows[None, :], offs_n[:, None], N_K, offset, window, CAUSAL, LOCAL)
        sT = tl.where(visible, sT, float("-inf"))  # masked before exp: P^T = exactly 0 there
    pT = PROBABILITIES(sT, lse2[None, :], qk_scale)
    do = load_rows(do_ptrs + start_m * stride_dom, rows, N_Q, offs_d, HEAD_DIM, BLOCK_D, UPCAST)
    dv += tl.dot(pT.to(do.dtype), do, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    delta = tl.load(d_base + rows, mask=rows < N_Q, other=0.0)  # D: BLOCK_M floats
    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)  # (dO V^T)^T
    dsT = pT * (dpT - delta[None, :])
    dk += tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if ATOMIC:
        # this K/V block's share of dQ = dS K * scale, added into the fp32 dQ buffer in HBM
        dq = tl.dot(tl.trans(dsT.to(k.dtype)), k, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        dq_ptrs = dq_base + rows[:, None] * stride_dqm + offs_d[None, :] * stride_dqd
        # relaxed: an accumulation needs no ordering against the thread's other memory accesses
        # (the default, acq_rel, orders each add: 6-7x slower in scripts/atomic_throughput.py on an H200)
        dq_mask = row_mask(rows, N_Q, offs_d, HEAD_DIM, BLOCK_D)
        tl.atomic_add(dq_ptrs, dq * sm_scale, mask=dq_mask, sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_inner(
    dk, dv, k, v,  # accumulators and this program's K, V blocks (all on chip)
    q_base, do_base, l_base, d_base, dq_base,
    stride_qm, stride_qd, stride_dom, stride_dod, stride_lm, stride_dqm, stride_dqd,
    stride_qh, stride_doh, stride_lh, stride_dh, stride_dqh,
    offs_n, offs_m, offs_d, lo, hi, N_Q, N_K, offset, window, sm_scale, qk_scale,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, PROBABILITIES: tl.constexpr, ATOMIC: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC_DTYPE: tl.constexpr,
    GROUP: tl.constexpr, ONE_LOOP: tl.constexpr, LOCAL: tl.constexpr,
):  # fmt: skip
    """Accumulate dK, dV of one K/V block over the query blocks lo, lo + BLOCK_M, ... < hi of each of
    GROUP query heads (the bases point at the first; stride_*h step from one head to the next).

    ONE_LOOP=False: a loop per head (unrolled over the heads). ONE_LOOP=True: one loop over the
    (head, query block) pairs, head by head, so the heads share one software pipeline: the next head's
    first Q, dO blocks load while the last head's last block is in use, instead of each head's loop
    filling and draining its own (`dkdv_one_loop` says when that pays)."""
    q_ptrs = q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    do_ptrs = do_base + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod
    if ONE_LOOP:
        n_blocks = (hi - lo) // BLOCK_M  # lo and hi are multiples of BLOCK_M
        for step in range(0, GROUP * n_blocks):
            g = step // n_blocks  # never evaluated when n_blocks = 0 (no step)
            dk, dv = _dkdv_block(
                dk, dv, k, v, q_ptrs + g * stride_qh, do_ptrs + g * stride_doh, l_base + g * stride_lh,
                d_base + g * stride_dh, dq_base + g * stride_dqh, lo + (step - g * n_blocks) * BLOCK_M,
                stride_qm, stride_dom, stride_lm, stride_dqm, stride_dqd,
                offs_n, offs_m, offs_d, N_Q, N_K, offset, window, sm_scale, qk_scale,
                MASK, CAUSAL, PROBABILITIES, ATOMIC, HEAD_DIM, BLOCK_D, BLOCK_M, UPCAST, DOT_PRECISION, ACC_DTYPE,
                LOCAL,
            )  # fmt: skip
    else:
        for g in tl.static_range(GROUP):  # with GROUP = 1, the multi-head kernel's loop
            for start_m in range(lo, hi, BLOCK_M):
                dk, dv = _dkdv_block(
                    dk, dv, k, v, q_ptrs + g * stride_qh, do_ptrs + g * stride_doh, l_base + g * stride_lh,
                    d_base + g * stride_dh, dq_base + g * stride_dqh, start_m,
                    stride_qm, stride_dom, stride_lm, stride_dqm, stride_dqd,
                    offs_n, offs_m, offs_d, N_Q, N_K, offset, window, sm_scale, qk_scale,
                    MASK, CAUSAL, PROBABILITIES, ATOMIC, HEAD_DIM, BLOCK_D, BLOCK_M, UPCAST, DOT_PRECISION, ACC_DTYPE,
                    LOCAL,
                )  # fmt: skip
    return dk, dv


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, L, Dlt, DQ, DK, DV, SEQ, sm_scale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_lb, stride_lh, stride_lm,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    H, N_Q, N_K, OFFSET, WINDOW, N_BUCKET,
    GROUP: tl.constexpr, SHARE: tl.constexpr, CAUSAL: tl.constexpr, ATOMIC: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC_DTYPE: tl.constexpr, BLOCK_MAJOR: tl.constexpr,
    PROBABILITIES: tl.constexpr = probabilities, Q_RANGE: tl.constexpr = q_block_range,
    ONE_LOOP: tl.constexpr = False, LOCAL: tl.constexpr = False, VARLEN: tl.constexpr = 0,
):  # fmt: skip
    """dK, dV for one block of BLOCK_N key rows, summed over GROUP query heads; with ATOMIC also dQ
    (added). Grid: (cdiv(N_K, BLOCK_N) * B * H // GROUP,): program head ph covers query heads
    ph * GROUP ... ph * GROUP + GROUP - 1, reads K/V head ph // SHARE and writes DK, DV head ph.
    SHARE = 1: DK, DV are dK, dV (a program sums every query head of its K/V head). SHARE > 1 (grouped-
    query attention split over SHARE programs per K/V head): DK, DV hold H // GROUP partial sums, which
    the caller adds up. PROBABILITIES, Q_RANGE: how P is rebuilt, which query blocks are visited
    (`teaching.py` has the ladder's variants). LOCAL: a sliding window of WINDOW keys (`forward.py`).
    VARLEN: packed sequences, SEQ their bounds (`blocks.sequence`); D stays (sequences, H, N_Q)."""
    # causal: the early keys have the most work
    seq_b, off_ph, n_start = program_block(N_K, H // GROUP, BLOCK_N, False, BLOCK_MAJOR)
    off_b, q_start, n_q, k_start, n_k, offset = sequence(SEQ, seq_b, N_Q, N_K, OFFSET, VARLEN)
    off_kh = off_ph // SHARE
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = row_mask(offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D)
    # K and V blocks: HBM -> on chip once, 2 * BLOCK_N * d elements, reused for every query block of
    # every query head of the group.
    k = tl.load(
        K
        + off_b * stride_kb
        + off_kh * stride_kh
        + (k_start + offs_n[:, None]) * stride_kn
        + offs_d[None, :] * stride_kd,
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        V
        + off_b * stride_vb
        + off_kh * stride_vh
        + (k_start + offs_n[:, None]) * stride_vn
        + offs_d[None, :] * stride_vd,
        mask=kv_mask,
        other=0.0,
    )
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC_DTYPE)  # fp32 accumulators, registers
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC_DTYPE)

    # Query blocks [lo, mid) straddle the diagonal: masked stage. Blocks [mid, hi) see every key of
    # the block: unmasked stage (masked in atomic mode too: the zero-filled keys past N_K of a ragged
    # last block would otherwise add exp(-L) * (dP - D) * 0 terms to dQ, NaN when L << 0).
    lo, mid, hi = Q_RANGE(n_start, n_q, offset, CAUSAL, BLOCK_M, BLOCK_N)
    if VARLEN:  # a block of keys past its sequence's end (a shorter sequence than the longest): no row
        hi = tl.where(n_start < n_k, hi, 0)
        lo = tl.minimum(lo, hi)
        mid = tl.minimum(mid, hi)
    w_hi = hi
    if LOCAL:  # a sliding window: rows [hi, w_hi) cross its upper edge (a third, masked stage)
        mid, hi, w_hi = window_q_range(n_start, offset, WINDOW, lo, mid, hi, BLOCK_M, BLOCK_N)
    qk_scale = sm_scale * LOG2E  # P in base 2 (`probabilities`)
    off_h = off_ph * GROUP  # the group's first query head
    q_base = Q + off_b * stride_qb + off_h * stride_qh + q_start * stride_qm
    do_base = DO + off_b * stride_dob + off_h * stride_doh + q_start * stride_dom
    l_base = L + off_b * stride_lb + off_h * stride_lh + q_start * stride_lm
    d_base = Dlt + (seq_b * H + off_h) * N_Q
    dq_base = DQ + off_b * stride_dqb + off_h * stride_dqh + q_start * stride_dqm
    for stage in tl.static_range(2):  # [lo, mid) masked (the diagonal), then [mid, hi)
        dk, dv = _dkdv_inner(
            dk, dv, k, v, q_base, do_base, l_base, d_base, dq_base,
            stride_qm, stride_qd, stride_dom, stride_dod, stride_lm, stride_dqm, stride_dqd,
            stride_qh, stride_doh, stride_lh, N_Q, stride_dqh,
            offs_n, offs_m, offs_d, lo if stage == 0 else mid, mid if stage == 0 else hi,
            n_q, n_k, offset, WINDOW, sm_scale, qk_scale, stage == 0 or ATOMIC, CAUSAL, PROBABILITIES, ATOMIC,
            HEAD_DIM, BLOCK_D, BLOCK_M, UPCAST, DOT_PRECISION, ACC_DTYPE, GROUP, ONE_LOOP, LOCAL,
        )  # fmt: skip
    if LOCAL:
        dk, dv = _dkdv_inner(
            dk, dv, k, v, q_base, do_base, l_base, d_base, dq_base,
            stride_qm, stride_qd, stride_dom, stride_dod, stride_lm, stride_dqm, stride_dqd,
            stride_qh, stride_doh, stride_lh, N_Q, stride_dqh,
            offs_n, offs_m, offs_d, hi, w_hi,
            n_q, n_k, offset, WINDOW, sm_scale, qk_scale, True, CAUSAL, PROBABILITIES, ATOMIC,
            HEAD_DIM, BLOCK_D, BLOCK_M, UPCAST, DOT_PRECISION, ACC_DTYPE, GROUP, ONE_LOOP, LOCAL,
        )  # fmt: skip

    # dK = dS^T Q * scale and dV: registers -> HBM once, 2 * BLOCK_N * d elements.
    dk = dk * sm_scale
    dk_ptrs = (
        DK
        + off_b * stride_dkb
        + off_ph * stride_dkh
        + (k_start + offs_n[:, None]) * stride_dkn
        + offs_d[None, :] * stride_dkd
    )
    dv_ptrs = (
        DV
        + off_b * stride_dvb
        + off_ph * stride_dvh
        + (k_start + offs_n[:, None]) * stride_dvn
        + offs_d[None, :] * stride_dvd
    )
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_inner(
    dq, q, do, lse2, delta,  # dQ accumulator and this program's Q, dO, L (base 2), D (all on chip)
    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_n, offs_d, lo, hi, N_K, offset, window, qk_scale,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, PROBABILITIES: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC_DTYPE: tl.constexpr, LOCAL: tl.constexpr,
):  # fmt: skip
    """Accumulate dQ of one query block over the K/V blocks lo, lo + BLOCK_N, ... < hi."""
    k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        # K and V blocks: HBM -> shared memory, 2 * BLOCK_N * d elements per step (coalesced rows).
        k = load_rows(k_ptrs + start_n * stride_kn, cols, N_K, offs_d, HEAD_DIM, BLOCK_D, UPCAST)
        v = load_rows(v_ptrs + start_n * stride_vn, cols, N_K, offs_d, HEAD_DIM, BLOCK_D, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)  # (BLOCK_M, BLOCK_N)
        if MASK:
            visible = visible_keys(offs_m[:, None], cols[None, :], N_K, offset, window, CAUSAL, LOCAL)
            s = tl.where(visible, s, float("-inf"))  # masked before exp: P = exactly 0 there
        p = PROBABILITIES(s, lse2[:, None], qk_scale)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return dq


@triton.jit
def _dq_kernel(
    Q, K, V, O, DO, L, Dlt, DQ, SEQ, sm_scale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_lb, stride_lh, stride_lm,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    H, GROUP, N_Q, N_K, OFFSET, WINDOW, N_BUCKET,
    CAUSAL: tl.constexpr, FUSE_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC_DTYPE: tl.constexpr,
    PROBABILITIES: tl.constexpr = probabilities, KV_RANGE: tl.constexpr = kv_block_range,
    LOCAL: tl.constexpr = False, VARLEN: tl.constexpr = 0,
):  # fmt: skip
    """dQ for one block of BLOCK_M query rows of one (batch, head). Grid: (cdiv(N_Q, BLOCK_M) * B * H,).

    FUSE_D=True: compute D = rowsum(dO * O) for these rows here (reading the O block once) and store
    it for the dK/dV kernel, which then runs second; FUSE_D=False: read D written by
    `preprocess_kernel`. PROBABILITIES, KV_RANGE, VARLEN: as in `_dkdv_kernel` and `forward._fwd_kernel`."""
    seq_b, off_h, m_start = program_block(N_Q, H, BLOCK_M, CAUSAL, False)  # causal: the longest rows first
    off_b, q_start, n_q, k_start, n_k, offset = sequence(SEQ, seq_b, N_Q, N_K, OFFSET, VARLEN)
    off_kh = off_h // GROUP
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = row_mask(offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D)
    rows = q_start + offs_m  # the rows in the tensors (packed sequences: after the earlier sequences')
    # Q, dO blocks: HBM -> on chip once (2 * BLOCK_M * d elements); L and D: BLOCK_M floats each.
    q_ptrs = (
        Q + off_b * stride_qb + off_h * stride_qh + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd
    )
    do_ptrs = (
        DO
        + off_b * stride_dob
        + off_h * stride_doh
        + rows[:, None] * stride_dom
        + offs_d[None, :] * stride_dod
    )
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    do = tl.load(do_ptrs, mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = _load_lse(L + off_b * stride_lb + off_h * stride_lh + rows * stride_lm, offs_m < n_q)
    d_ptrs = Dlt + (seq_b * H + off_h) * N_Q + offs_m
    if FUSE_D:
        # D = rowsum(dO * O): the O block, HBM -> registers once (BLOCK_M * d elements); D to HBM.
        o_ptrs = (
            O
            + off_b * stride_ob
            + off_h * stride_oh
            + rows[:, None] * stride_om
            + offs_d[None, :] * stride_od
        )
        o = tl.load(o_ptrs, mask=q_mask, other=0.0)
        delta = tl.sum(o.to(ACC_DTYPE) * do.to(ACC_DTYPE), axis=1)
        tl.store(d_ptrs, delta, mask=offs_m < n_q)
    else:
        delta = tl.load(d_ptrs, mask=offs_m < n_q, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC_DTYPE)  # fp32 accumulator, registers
    k_base = K + off_b * stride_kb + off_kh * stride_kh + k_start * stride_kn
    v_base = V + off_b * stride_vb + off_kh * stride_vh + k_start * stride_vn

    # Stage 1, unmasked: K/V blocks every row sees. Stage 2, masked: causal diagonal blocks and the
    # ragged last block (whose zero-filled keys must not reach dQ). Blocks above the diagonal: skipped.
    lo, mid, hi = KV_RANGE(m_start, n_q, n_k, offset, 0, 1, CAUSAL, BLOCK_M, BLOCK_N)
    if VARLEN:  # a block of rows past its sequence's end: no key (as in the forward)
        hi = tl.where(m_start < n_q, hi, 0)
        mid = tl.minimum(mid, hi)
    qk_scale = sm_scale * LOG2E  # P in base 2 (`probabilities`): scale and L converted once, not per tile
    lse2 = lse * LOG2E
    if LOCAL:  # a sliding window: its lower edge first (masked), as in the forward
        w_lo, lo, mid = window_kv_range(m_start, n_q, offset, WINDOW, lo, mid, hi, BLOCK_M, BLOCK_N)
        dq = _dq_inner(
            dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, w_lo, lo, n_k, offset, WINDOW, qk_scale,
            True, CAUSAL, PROBABILITIES, HEAD_DIM, BLOCK_D, BLOCK_N, UPCAST, DOT_PRECISION, ACC_DTYPE, LOCAL,
        )  # fmt: skip
    dq = _dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_n, offs_d, lo, mid, n_k, offset, WINDOW, qk_scale,
        False, CAUSAL, PROBABILITIES, HEAD_DIM, BLOCK_D, BLOCK_N, UPCAST, DOT_PRECISION, ACC_DTYPE, LOCAL,
    )  # fmt: skip
    dq = _dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_n, offs_d, mid, hi, n_k, offset, WINDOW, qk_scale,
        True, CAUSAL, PROBABILITIES, HEAD_DIM, BLOCK_D, BLOCK_N, UPCAST, DOT_PRECISION, ACC_DTYPE, LOCAL,
    )  # fmt: skip
    # dQ = dS K * scale: registers -> HBM once, BLOCK_M * d elements.
    dq = dq * sm_scale
    dq_ptrs = (
        DQ
        + off_b * stride_dqb
        + off_h * stride_dqh
        + rows[:, None] * stride_dqm
        + offs_d[None, :] * stride_dqd
    )
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=q_mask)


@triton.jit
def _group_sum_kernel(PK, PV, DK, DV, n_elements, SHARE: tl.constexpr, BLOCK: tl.constexpr):
    """dK and dV of grouped-query attention from per-program partial sums: program (g, j, t) adds the
    SHARE partials of elements j * BLOCK ... of K/V head g (batch included) of dK (t = 0) or dV (t = 1).
    PK, PV (B * H_kv, SHARE, n_elements) and DK, DV (B * H_kv, n_elements), contiguous, n_elements =
    N_K * d; the sum in fp32, one read of every partial and one write of the result."""
    g = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    src, dst = PK, DK
    if tl.program_id(2) == 1:
        src, dst = PV, DV
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SHARE):
        acc += tl.load(src + (g * SHARE + s) * n_elements + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + g * n_elements + offs, acc.to(dst.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class GroupSumLaunch(Launch):
    """The group-sum kernel: elements per program, warps."""

    block: int = keyword("BLOCK")
    num_warps: int = keyword("num_warps")


GROUP_SUM = PerDevice(  # elements per group-sum program
    interpreter=GroupSumLaunch(block=256, num_warps=4), gpu=GroupSumLaunch(block=2048, num_warps=4)
)


_TUNE_KEY = ["N_BUCKET", "HEAD_DIM", "CAUSAL"]
_dkdv_tuned = make_tuner(_dkdv_kernel, DKDV, key=_TUNE_KEY + ["ATOMIC", "GROUP"])
# The atomic variant adds into DQ: the tuner must zero it before each timed run.
_dkdv_atomic_tuned = make_tuner(_dkdv_kernel, DKDV, key=_TUNE_KEY + ["ATOMIC", "GROUP"], reset_to_zero=["DQ"])
_dq_tuned = make_tuner(_dq_kernel, DQ, key=_TUNE_KEY + ["FUSE_D"])
DKDV_HOOKS = ("PROBABILITIES", "Q_RANGE")  # the kernels' function arguments (teaching variants)
DQ_HOOKS = ("PROBABILITIES", "KV_RANGE")


def backward(
    do,
    q,
    k,
    v,
    o,
    L,
    causal=False,
    scale: float | None = None,
    config: dict | None = None,
    dq_mode: str = "two_kernel",
    window=None,
    sinks=None,
):
    """FlashAttention-2 backward: (dQ, dK, dV) from dO, the inputs and the forward's O and L.

    do, q, o: (..., Nq, d); k, v: (..., Nk, d) (fewer heads for grouped-query attention: dK and dV
    are then summed over the query heads that share each K/V head); L: q.shape[:-1], logsumexp in
    natural-log units, as returned by `forward.forward` — or the merged O and L of a longer sequence
    of which k, v are a part (ring attention). Any strides. causal: as in `forward.forward`. Returns
    dq, dk, dv with the shapes and dtype of q, k, v (contiguous). Nothing of size Nq x Nk is allocated.
    window: the forward's sliding window (None: none), as in `forward.forward`. sinks: the forward's
    attention sinks (None: none); with sinks the result is (dq, dk, dv, dsinks), dsinks of the sinks'
    shape and dtype: dsink_h = -sum over the head's rows of P_sink * D (`sink_gradient`).

    dq_mode: "two_kernel" (default) — a dK/dV kernel and a separate dQ kernel, no atomics;
             "atomic" — one dK/dV kernel that also adds dQ into an fp32 buffer with tl.atomic_add.
    config (dict, optional): BLOCK_M, BLOCK_N (for both kernels; BLOCK_M1/BLOCK_N1 and
    BLOCK_M2/BLOCK_N2 override them for the dK/dV and dQ kernels), num_warps, num_stages, and the
    switches exp2 and skip_masked_blocks (see `forward.forward`; their teaching variants are
    `teaching.probabilities_natural` and `teaching.every_q_block` / `every_kv_block`, always with a
    fixed launch). config=None: the default choice."""
    check_inputs(q, k, v, where="attention.backward")
    check_saved(do, o, L, q, "attention.backward")
    if dq_mode not in DQ_MODES:
        raise ValueError(f"attention.backward: dq_mode must be one of {DQ_MODES}, got {dq_mode!r}")
    alignment = causal_alignment(causal)
    window = check_window(window, alignment, "attention.backward")
    sinks32 = check_sinks(sinks, q, "attention.backward")
    scale = default_scale(q.shape[-1], scale)
    launch_cfg, switches = split_config(config, DKDV.cpu if runtime.INTERPRET else DKDV.fixed)
    dq, dk, dv, dsinks = _backward(
        do, q, k, v, o, L, alignment, scale, launch_cfg, switches, dq_mode, window=window, sinks=sinks32
    )
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks.to(sinks.dtype))


def dkdv_heads_per_program(group: int, causal: bool, n_k: int, head_dim: int) -> int:
    """How many of the `group` query heads that share a K/V head one dK/dV program sums on chip.

    All of them (one program per K/V head and key block; causal ones block-major, `dkdv_block_major`,
    and walking the heads in one loop, `dkdv_one_loop`), except for head dims of 64 and less beyond
    4096 keys (non-causal: from 4096): there each query head gets its own program, as on repeated K/V,
    and the `group` partial dK, dV (fp32) are added afterwards (`_group_sum_kernel`). K/V are still
    read, not copied, but the partials cost a write and a read of 4 bytes per element and query head
    (16-bit partials, half of that, exceeded a bf16 test's bound: twice plain PyTorch's error over
    repeated K/V, plus the floor); in exchange there are `group` times more, shorter programs, which
    balance better over the SMs. Measured on an H200 (bf16, 4 query heads per K/V head,
    B x N = 16k tokens, backward alone, three passes, best us, on chip / fp32 partials; repeated K/V):
    causal d = 64: 4k 2387 / 2458 (2310), 8k 4638 / 4539 (4551), 16k 9074 / 8598 (8795); causal
    d = 128: 4k 1997 / 2209 (2102), 8k 3585 / 3809 (3789), 16k 6900 / 7048 (7196); non-causal d = 64,
    16k: 15480 / 15045 (14935), d = 128, 4k: 3702 / 3853 (3557). Up to 2k keys on chip won every cell
    (notes/attention.md). Since the partials are added by one Triton kernel, non-causal d = 64 at 4k
    keys joined them (forward + backward against repeated K/V, medians of four alternating passes:
    on chip 0.976x, partials 1.005x; at 2k 0.986x / 0.972x)."""
    if head_dim <= 64 and (n_k > 4096 or (not causal and n_k == 4096)):
        return 1
    return group


def dkdv_shape_class(
    n_q: int, n_k: int, head_dim: int, causal: bool, dtype, atomic: bool, on_chip: int
) -> tuple:
    """The dK/dV kernel's shape class (`launch.chosen`): what its launch choice depends on, the query
    heads a program sums on chip (`dkdv_heads_per_program`) included."""
    return (n_bucket(max(n_q, n_k)), head_dim, causal, dtype, atomic, on_chip)


def dkdv_one_loop(on_chip: int, causal: bool) -> bool:
    """Whether a dK/dV program that sums several query heads on chip walks them in one loop
    (`_dkdv_inner`'s ONE_LOOP): causal programs, whose per-head loops are short (a program's two
    stages, the diagonal and the rest, each once per head), so filling and draining each loop's
    pipeline costs a visible share. Measured on an H200 (bf16, 4 query heads per K/V head, B x N =
    16k tokens, backward alone, us, a loop per head / one loop; repeated K/V): causal d = 64, 1k: 755
    / 686 (731); d = 128, 1k: 689 / 641 (688); d = 64, 2k: 1319 / 1203 (1269); d = 128, 2k: 1168 /
    1092 (1140). Non-causal loops are long, and one loop was 1-4 % slower there (d = 64, 16k: 15478
    / 16088; d = 128, 16k: 13816 / 14439), as it was for a single head."""
    return causal and on_chip > 1


def dkdv_block_major(on_chip: int, causal: bool) -> bool:
    """Whether the dK/dV programs run block-major (`blocks.program_block`): causal programs that sum
    several query heads on chip, whose work falls steeply with the key block (on repeated K/V, or one
    head per program, head-major keeps a head's Q and dO in the L2 cache and was faster)."""
    return causal and on_chip > 1


HOPPER_FAILED: list[str] = []  # why the Gluon dK/dV kernel could not be used in this process, if it failed
HOPPER_DQ_FAILED: list[str] = []  # likewise for the Gluon dQ kernel
HOPPER_ONEPASS_FAILED: list[str] = []  # and for the one-pass backward


def hopper_dq(d: int):
    """The `hopper_dq` module if its warp-specialised dQ kernel should run (it runs beside the Gluon dK/dV
    kernel, whose checks it shares, where `hopper_dq.choose` found it faster), else None."""
    if HOPPER_DQ_FAILED:
        return None
    from . import hopper_dq as module

    return module if module.choose(d) else None


def hopper_dkdv(q4, k4, v4, do4, causal: bool, n_q: int, n_k: int, switches: dict):
    """The `hopper_backward` module if its warp-specialised dK/dV kernel should run here (hopper switch
    on, a GPU run with Gluon, a Hopper GPU, contiguous 16-bit inputs, a shape where
    `hopper_backward.choose` found it faster than the Triton kernel), else None."""
    if not switches["HOPPER"] or HOPPER_FAILED or hopper_kernels() is None:
        return None
    from . import hopper_backward

    if not hopper_backward.supports(q4, k4, v4, do4):
        return None
    chosen = hopper_backward.choose(q4.shape[-1], causal, n_q, n_k, kv_group(q4, k4))
    return hopper_backward if chosen else None


def hopper_onepass(q4, k4, v4, do4, causal: bool, n_q: int, n_k: int, switches: dict):
    """The `hopper_onepass` module if its one-pass backward (dQ, dK, dV from one Gluon kernel) should run
    here: the hopper and hopper_onepass switches on, a GPU run with Gluon, inputs `hopper_backward.supports`
    takes, dQ allowed to vary in its last bits from run to run (not under
    `torch.use_deterministic_algorithms(True)`: TMA's adds come in any order), a shape where
    `hopper_onepass.choose` found it faster than the two kernels; else None."""
    if (
        not (switches["HOPPER"] and switches["HOPPER_ONEPASS"])
        or HOPPER_ONEPASS_FAILED
        or hopper_kernels() is None
    ):
        return None
    if torch.are_deterministic_algorithms_enabled():
        return None
    from . import hopper_onepass as module

    if not module.supports(q4, k4, v4, do4):
        return None
    pairs, sms = q4.shape[0] * k4.shape[1], runtime.sm_count(q4.device.index)
    return module if module.choose(q4.shape[-1], causal, n_q, n_k, kv_group(q4, k4), pairs, sms) else None


SAVED_WITHOUT_SINKS = (True,) * 5 + (False,)  # `save_tensors`'s record of (q, k, v, o, L, sinks=None)


def save_tensors(ctx, *tensors) -> None:
    """`ctx.save_for_backward` of the tensors that are not None (an absent sinks tensor, say), with
    `saved_tensors(ctx)` giving them back in place. Homework tests find L by its shape among an autograd
    node's saved tensors (`grad_fn.saved_tensors`), which must then hold no None."""
    ctx.saved_present = tuple(t is not None for t in tensors)
    ctx.save_for_backward(*(t for t in tensors if t is not None))


def saved_tensors(ctx) -> tuple:
    """The tensors `save_tensors` saved, None where it was given None."""
    if ctx.saved_present == SAVED_WITHOUT_SINKS:  # no sinks, the common call: no loop
        return (*ctx.saved_tensors, None)
    kept = iter(ctx.saved_tensors)
    return tuple(next(kept) if present else None for present in ctx.saved_present)


def check_saved(do, o, L, q, where: str, l_name: str = "L") -> None:
    """dO and O must match q in shape, dtype and device, and L be q.shape[:-1] in the accumulator dtype
    on q's device, as the forward returns them (`attention.backward` and the packed backward operator)."""
    for name, t in (("do", do), ("o", o)):
        if not isinstance(t, torch.Tensor) or t.shape != q.shape or t.dtype != q.dtype:
            raise ValueError(
                f"{where}: {name} must match q in shape and dtype; got "
                f"{getattr(t, 'shape', type(t))} {getattr(t, 'dtype', '')}, q {tuple(q.shape)} {q.dtype}"
            )
    if not isinstance(L, torch.Tensor) or L.shape != q.shape[:-1]:
        raise ValueError(
            f"{where}: {l_name} must have shape q.shape[:-1] = {tuple(q.shape[:-1])}; "
            f"got {getattr(L, 'shape', type(L))}"
        )
    if L.dtype != accumulator_dtype(q.dtype):
        raise TypeError(
            f"{where}: {l_name} must be {accumulator_dtype(q.dtype)} (as the forward returns it for "
            f"{q.dtype} inputs); got {L.dtype}"
        )
    for name, t in (("do", do), ("o", o), (l_name, L)):
        if t.device != q.device:
            raise ValueError(f"{where}: {name} is on {t.device}, q on {q.device}; move it to q's device")


def _backward(
    do,
    q,
    k,
    v,
    o,
    L,
    alignment,
    scale,
    launch_cfg,
    switches,
    dq_mode,
    *,
    compile_only=False,
    window=0,
    sinks=None,
    seqs=None,
    plan_out=None,
):
    """Launch the kernels on validated inputs (no checks here): dQ (with D) then dK/dV, or, atomic,
    the preprocessing then dK/dV with dQ. window: `checks.check_window`'s (0: none); sinks:
    `checks.check_sinks`'s. seqs: None, or packed sequences (`packed.Sequences`; two-kernel mode
    only): do, q, k, v, o are then (total rows, heads, d) and L (total_q, Hq). Returns (dq, dk, dv,
    dsinks), dsinks None without sinks (float32 with).
    The kernels need nothing for the sinks: P rebuilt from L (which includes them) is already right.

    compile_only=True (the autograd forward, before its own launch): launch nothing; start compiling
    the default backward's two kernels for this shape (`launch.compile_ahead`). do, o and L may then be
    None: their stand-ins, and every buffer, live on the meta device (shapes and strides, no memory).
    plan_out: None, or a list to which a `BackwardPlan` (the one pass's: `OnePassPlan`) of this call is appended
    where it can be repeated so (`plans.py`: the default launches, no atomic dQ, sinks, packing or copy of an
    input)."""
    where = "meta" if compile_only else q.device
    if compile_only:
        if launch_cfg is not None or dq_mode != "two_kernel":
            return None
        do = o = torch.empty(q.shape, dtype=q.dtype, device=where)  # as the forward allocates O
        L = torch.empty(q.shape[:-1], dtype=accumulator_dtype(q.dtype), device=where)
        dk = torch.empty(k.shape, dtype=k.dtype, device=where)
        dv = torch.empty(v.shape, dtype=v.dtype, device=where)
    else:  # empty_like: 1.2 us of host time against torch.empty(shape, ...)'s 2.9 (a 2-core CPU)
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    if seqs is None:
        q4, k4, v4, o4, do4, dk4, dv4 = (as_4d(t) for t in (q, k, v, o, do, dk, dv))
        l3 = L if q4 is q and L.dim() == 3 else L.reshape(q4.shape[:-1])  # a reshape to its own shape: 2.3 us
        B, H, n_q, d = q4.shape
        H_kv, n_k = k4.shape[1], k4.shape[2]
    else:  # packed rows viewed as one batch of (heads, rows), as in the forward
        q4, k4, v4, o4, do4, dk4, dv4 = (t.transpose(0, 1)[None] for t in (q, k, v, o, do, dk, dv))
        l3 = L.t()[None]
        B, H, d, H_kv, n_q, n_k = seqs.count, q.shape[1], q.shape[2], k.shape[1], seqs.max_q, seqs.max_k
    rows = dict(q=n_q, o=n_q, do=n_q, k=n_k, v=n_k)
    viewed = (q4, k4, v4, o4, do4)
    q4, k4, v4, o4, do4 = (
        within_offsets(t, rows[name], name, "attention.backward")
        for t, name in ((q4, "q"), (k4, "k"), (v4, "v"), (o4, "o"), (do4, "do"))
    )
    for t, name in ((dk4, "dk"), (dv4, "dv")):  # written where they are: checked only
        within_offsets(t, n_k, name, "attention.backward", copy=False)
    group = kv_group(q4, k4)
    causal = alignment is not None
    offset = causal_offset(alignment, n_q, n_k) if seqs is None else 0
    window = kernel_window(window, n_q, n_k)
    atomic = dq_mode == "atomic"
    fixed_launch = launch_cfg is not None
    plannable = (  # a plan of this call may be kept (`plan_out`)
        plan_out is not None and not compile_only and not fixed_launch and not atomic
        and seqs is None and sinks is None and on_current_device(q)
        and all(a is b for a, b in zip(viewed, (q4, k4, v4, o4, do4)))  # nothing copied (`within_offsets`)
    )  # fmt: skip
    # (the Gluon kernel has no sliding window and no packed sequences)
    use_gluon = not (fixed_launch or atomic or window or seqs is not None)
    # dQ, dK, dV from one kernel (`hopper_onepass`) where it runs, or on to the two kernels if it fails
    onepass = hopper_onepass(q4, k4, v4, do4, causal, n_q, n_k, switches) if use_gluon else None
    if onepass is not None:
        grads = _onepass(
            onepass, q, k, v, q4, k4, v4, o4, do4, L, l3, dk4, dv4, offset, causal, scale, sinks, compile_only,
            plan_out if plannable else None,
        )  # fmt: skip
        if grads is not None or compile_only:
            return grads
    gluon = hopper_dkdv(q4, k4, v4, do4, causal, n_q, n_k, switches) if use_gluon else None
    # the warp-specialised dQ kernel (Hopper, beside the Gluon dK/dV kernel), or None
    gluon_dq = hopper_dq(d) if gluon is not None and switches.get("HOPPER_DQ", True) else None
    if gluon is not None:
        on_chip = gluon.heads_per_program(group, causal, n_k)
    elif seqs is not None:  # packed: dK, dV are strided views, which the partials' sum does not take
        on_chip = group
    else:
        on_chip = dkdv_heads_per_program(group, causal, n_k, d)
    share = group // on_chip  # dK/dV programs per K/V head
    acc_dtype = accumulator_dtype(q.dtype)
    # D, contiguous (packed sequences: padded to the longest, zeros past each one's end)
    delta = (torch.empty if seqs is None else torch.zeros)((B * H, n_q), dtype=acc_dtype, device=where)
    if atomic:
        dq_acc = torch.zeros(q4.shape, dtype=acc_dtype, device=where)  # fp32 dQ, added to atomically
    else:
        if compile_only:
            dq = torch.empty(q.shape, dtype=q.dtype, device=where)
        else:
            dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dq_acc = as_4d(dq) if seqs is None else dq.transpose(0, 1)[None]
        within_offsets(dq_acc, n_q, "dq", "attention.backward", copy=False)
    flags = kernel_flags(q.dtype)
    block_d = max(16, runtime.next_power_of_2(d))
    common = dict(CAUSAL=causal, HEAD_DIM=d, BLOCK_D=block_d, **flags)
    bucket = n_bucket(max(n_q, n_k))
    shape = (bucket, d, causal, q.dtype)  # what the configuration choice depends on
    fixed = launch_cfg or {}
    bounds = l3 if seqs is None else seqs.bounds  # a stand-in pointer when unused
    q_args = (
        q4, k4, v4, o4, do4, l3, delta, dq_acc, bounds, scale,
        *strides4(q4), *strides4(k4), *strides4(v4), *strides4(o4), *strides4(do4), *l3.stride(),
        *strides4(dq_acc), H, group, n_q, n_k, offset, window, bucket,
    )  # fmt: skip
    if window:  # the sliding-window variants; without one the kernels compile exactly as before
        common["LOCAL"] = True
    if seqs is not None:
        common["VARLEN"] = seqs.mode(alignment)
    q_meta = dict(common, FUSE_D=True)
    q_grid = lambda c: (runtime.cdiv(n_q, c.block_m) * B * H,)
    if share > 1:  # one partial dK, dV per program head (fp32), added up below
        dk_out, dv_out = (torch.empty((B, H // on_chip, n_k, d), dtype=acc_dtype, device=where) for _ in "kv")
    else:
        dk_out, dv_out = dk4, dv4
    kv_args = (
        q4, k4, v4, do4, l3, delta, dq_acc, dk_out, dv_out, bounds, scale,
        *strides4(q4), *strides4(k4), *strides4(v4), *strides4(do4), *l3.stride(),
        *strides4(dq_acc), *strides4(dk_out), *strides4(dv_out), H, n_q, n_k, offset, window, bucket,
    )  # fmt: skip
    kv_meta = dict(
        common,
        ATOMIC=atomic,
        GROUP=on_chip,
        SHARE=share,
        BLOCK_MAJOR=dkdv_block_major(on_chip, causal),
        ONE_LOOP=dkdv_one_loop(on_chip, causal),
    )
    kv_grid = lambda c: (runtime.cdiv(n_k, c.block_n) * B * (H // on_chip),)
    kv_shape = dkdv_shape_class(n_q, n_k, d, causal, q.dtype, atomic, on_chip)
    kv_tuner = _dkdv_atomic_tuned if atomic else _dkdv_tuned
    tensors = None  # {name: tensor} for a plan of this call (`BackwardPlan`)
    if plannable:
        tensors = dict(q4=q4, k4=k4, v4=v4, o4=o4, do4=do4, l3=l3, delta=delta, dq4=dq_acc)
        tensors.update(dk4=dk4, dv4=dv4)
        if share > 1:
            tensors.update(dk_out=dk_out, dv_out=dv_out)
    sum_launch = GROUP_SUM.current()
    sum_args = (dk_out, dv_out, dk4, dv4, n_k * d)
    sum_meta = dict(SHARE=share, **sum_launch.kwargs())
    sum_name = ("group sum", share, acc_dtype, q.dtype)  # what its compilation depends on
    if atomic or gluon_dq is not None:  # D = rowsum(dO * O) by itself: the atomic dQ and the Gluon dQ read it
        pre_grid, pre_args, pre_meta = preprocess_launch(o4, do4, delta, B, H, n_q, d, q.dtype)
        pre_name = ("preprocess", d, q.dtype)

    recording = bound.recording(tensors) if tensors is not None else contextlib.nullcontext()
    with recording as recorded:  # the launches, noted for a plan where this call can have one
        with cuda_device(q):
            if launch_cfg is None and not atomic:
                # The dK/dV kernel compiles (first use of this shape) while the dQ kernel compiles and runs.
                if gluon is None:
                    compile_ahead(_dkdv_kernel, kv_tuner, DKDV, kv_grid, kv_args, kv_meta, kv_shape)
                elif runtime.ON_GPU:
                    gluon.compile_ahead(q4, k4, v4, l3, delta, dk_out, offset, causal, scale)
                if gluon_dq is not None and runtime.ON_GPU:
                    gluon_dq.compile_ahead(q4, k4, v4, l3, delta, dq_acc, offset, causal, scale)
                    compile_kernel_ahead(pre_name, preprocess_kernel, pre_grid, pre_args, pre_meta)
                if compile_only:
                    if gluon_dq is None:
                        compile_ahead(_dq_kernel, _dq_tuned, DQ, q_grid, q_args, q_meta, shape)
                    if share > 1:
                        compile_kernel_ahead(sum_name, _group_sum_kernel, (1,), sum_args, sum_meta)
                    return None
            if atomic:
                bound.launch(preprocess_kernel, pre_grid, *pre_args, **pre_meta)
            elif gluon_dq is not None:  # D first (the Gluon dQ kernel reads it), then dQ
                wait_compiled(pre_name)
                bound.launch(preprocess_kernel, pre_grid, *pre_args, **pre_meta)
                dq_args = (q4, k4, v4, do4, l3, delta, dq_acc, offset, causal, scale)
                if not run_gluon("dQ kernel", HOPPER_DQ_FAILED, gluon_dq.dq, *dq_args):
                    launch(_dq_kernel, _dq_tuned, DQ, q_grid, q_args, dict(q_meta, FUSE_D=False), shape)
            elif launch_cfg is None:
                # dQ first: it also computes D, which the dK/dV kernel needs (stream order keeps them apart).
                launch(_dq_kernel, _dq_tuned, DQ, q_grid, q_args, q_meta, shape)
            else:
                bm, bn = fixed.get("BLOCK_M2", fixed["BLOCK_M"]), fixed.get("BLOCK_N2", fixed["BLOCK_N"])
                bound.launch(_dq_kernel, (runtime.cdiv(n_q, bm) * B * H,),
                    *q_args, **q_meta, **teaching_hooks(switches, DQ_HOOKS), BLOCK_M=bm, BLOCK_N=bn,
                    num_warps=fixed["num_warps"], num_stages=fixed["num_stages"],
                )  # fmt: skip
            gluon_args = (q4, k4, v4, do4, l3, delta, dk_out, dv_out, offset, causal, scale)
            if gluon is None or not run_gluon("dK/dV kernel", HOPPER_FAILED, gluon.dkdv, *gluon_args):
                if launch_cfg is None:
                    launch(_dkdv_kernel, kv_tuner, DKDV, kv_grid, kv_args, kv_meta, kv_shape)
                else:
                    bm, bn = fixed.get("BLOCK_M1", fixed["BLOCK_M"]), fixed.get("BLOCK_N1", fixed["BLOCK_N"])
                    bound.launch(_dkdv_kernel, (runtime.cdiv(n_k, bn) * B * (H // on_chip),),
                        *kv_args, **kv_meta, **teaching_hooks(switches, DKDV_HOOKS), BLOCK_M=bm, BLOCK_N=bn,
                        num_warps=fixed["num_warps"], num_stages=fixed["num_stages"],
                    )  # fmt: skip
        if share > 1:  # grouped-query attention: each K/V head's dK, dV is the sum of its `share` partials
            wait_compiled(sum_name)  # compiled ahead during the forward, if it was
            with cuda_device(q):
                sum_grid = (B * H_kv, runtime.cdiv(n_k * d, sum_launch.block), 2)
                bound.launch(_group_sum_kernel, sum_grid, *sum_args, **sum_meta)
    if sinks is None:
        dsinks = None
    elif seqs is None:
        dsinks = sink_gradient(sinks, L.reshape(B, H, n_q), delta.view(B, H, n_q))
    else:  # D back from (sequences, H, longest) to the packed rows
        dsinks = sink_gradient(sinks, l3, seqs.pack(delta.view(B, H, n_q))[None])
    launches = recorded.prepared() if recorded is not None else None
    if launches:
        plan_out.append(BackwardPlan(launches, q, q4, L, l3, delta, dk_out if share > 1 else None))
    if atomic:
        return dq_acc.to(q.dtype).view(q.shape), dk, dv, dsinks
    return dq, dk, dv, dsinks


def _onepass(module, q, k, v, q4, k4, v4, o4, do4, L, l3, dk4, dv4, offset, causal, scale, sinks, compile_only,
             plan_out):  # fmt: skip
    """`_backward` by the one-pass kernel (`hopper_onepass`): (dq, dk, dv, dsinks) shaped as q, k, v; None if
    it failed (`run_gluon`), or with compile_only (its kernel and D pass then compile in the background). dk4,
    dv4: `_backward`'s dK, dV (contiguous), which it writes. plan_out: None, or a list to which a
    `OnePassPlan` of this call is appended where its launches can be repeated."""
    if compile_only:
        if runtime.ON_GPU:
            module.compile_ahead(q4, k4, v4, l3, offset, causal, scale)
        return None
    grads, replays = [], None if plan_out is None else []
    with cuda_device(q):
        ran = run_gluon(
            "one-pass backward", HOPPER_ONEPASS_FAILED,
            lambda *a: grads.append(module.backward(*a, dk4=dk4, dv4=dv4, replay_out=replays)),
            q4, k4, v4, o4, do4, l3, offset, causal, scale,
        )  # fmt: skip
    if not ran:
        return None
    if replays:
        plan_out.append(OnePassPlan(replays[0], q, q4, L, l3))
    dq4, _, _, delta = grads[0]
    dsinks = None if sinks is None else sink_gradient(sinks, l3, delta.reshape(l3.shape))
    return dq4.view(q.shape), dk4.view(k.shape), dv4.view(v.shape), dsinks


def _plan_tensors(four_d: bool, l3_shape: tuple, do, q, k, v, o, L) -> tuple:
    """A plan's dQ, dK, dV, allocated contiguous, and {name: tensor}: the call's tensors and those three as the
    kernels take them (q4, k4, v4, o4, do4, l3, dq4, dk4, dv4), viewed as `_backward` viewed them."""
    contiguous = torch.contiguous_format
    dk = torch.empty_like(k, memory_format=contiguous)
    dv = torch.empty_like(v, memory_format=contiguous)
    dq = torch.empty_like(q, memory_format=contiguous)
    if four_d:
        tensors = dict(q4=q, k4=k, v4=v, o4=o, do4=do, l3=L, dq4=dq, dk4=dk, dv4=dv)
    else:
        tensors = dict(
            q4=as_4d(q), k4=as_4d(k), v4=as_4d(v), o4=as_4d(o), do4=as_4d(do), l3=L.reshape(l3_shape),
            dq4=as_4d(dq), dk4=as_4d(dk), dv4=as_4d(dv),
        )  # fmt: skip
    return dq, dk, dv, tensors


class BackwardPlan:
    """A backward call to repeat (`plans.py`): its launches (the Triton dQ with D, or the D pass and the
    Gluon dQ; the Triton or Gluon dK/dV, TMA descriptors made again over the new tensors; for grouped-query
    attention with per-head partials, their sum) with every non-tensor argument fixed, and how
    to allocate dQ, dK, dV, D and the partials and view the tensors as the kernels take them.
    `run(do, q, k, v, o, L)` gives (dq, dk, dv) as `_backward` does, for a call with the same key."""

    __slots__ = ("launches", "four_d", "l3_shape", "delta_shape", "acc_dtype", "partial_shape")

    def __init__(self, launches: tuple, q, q4, L, l3, delta, partial):
        self.launches = launches
        self.four_d = q4 is q and l3 is L
        self.l3_shape, self.delta_shape, self.acc_dtype = tuple(l3.shape), tuple(delta.shape), delta.dtype
        self.partial_shape = None if partial is None else tuple(partial.shape)

    def run(self, do, q, k, v, o, L):
        dq, dk, dv, tensors = _plan_tensors(self.four_d, self.l3_shape, do, q, k, v, o, L)
        tensors["delta"] = q.new_empty(self.delta_shape, dtype=self.acc_dtype)  # 1.4 us less than torch.empty
        if self.partial_shape is not None:
            tensors["dk_out"] = q.new_empty(self.partial_shape, dtype=self.acc_dtype)
            tensors["dv_out"] = q.new_empty(self.partial_shape, dtype=self.acc_dtype)
        for launch_ in self.launches:
            launch_(tensors)
        return dq, dk, dv


class OnePassPlan:
    """A backward call by the one-pass kernel to repeat (`plans.py`): its `hopper_onepass.Replay` (the D pass
    (which zeroes the accumulator) and the kernel's launches over the slices, each slice's cast after it) over the
    new call's tensors, viewed as `_backward` viewed them. `run(do, q, k, v, o, L)` gives (dq, dk, dv). Kept
    under a key that holds whether deterministic algorithms are on (`api.py`): the one pass is not, then."""

    __slots__ = ("replay", "four_d", "l3_shape")

    def __init__(self, replay, q, q4, L, l3):
        self.replay, self.four_d, self.l3_shape = replay, q4 is q and l3 is L, tuple(l3.shape)

    def run(self, do, q, k, v, o, L):
        dq, dk, dv, tensors = _plan_tensors(self.four_d, self.l3_shape, do, q, k, v, o, L)
        self.replay.run(tensors)
        return dq, dk, dv


def sink_gradient(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """d(loss)/d(sink_h) for attention sinks: a sink is a key with a zero value, so its dP is 0 and its
    dS = P_sink * (0 - D): dsink_h = -sum over batch and rows of exp(sink_h - L) * D. sinks: (H,); lse, delta:
    (B, H, Nq) (L includes the sinks; D = rowsum(dO * O)). Returns (H,) in the accumulator dtype."""
    p_sink = torch.exp(sinks.view(1, -1, 1) - lse)
    p_sink = torch.where(torch.isneginf(sinks).view(1, -1, 1), torch.zeros_like(p_sink), p_sink)
    return -(p_sink * delta).sum(dim=(0, 2))
