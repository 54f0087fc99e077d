"""FlashAttention-3's warp-specialised forward on Hopper GPUs (H100, H200), in Gluon (notebook 08).

The Triton forward (`forward.py`) has every warp do everything, one step after the other: load a K/V
tile, S = Q K^T on the tensor cores, the softmax on the ordinary cores, O += P V on the tensor cores.
While the softmax runs, the tensor cores wait; at d = 128 that caps it near 500 of the H200's
~800 TFLOP/s (notes/attention.md). This kernel gives the warps of one program different jobs
(Shah et al. 2024, FlashAttention-3, sections 3.1-3.2), written in Gluon, Triton's lower-level
dialect, which exposes what the hardware does asynchronously:

* producer (1 warp, 24 registers per thread): issues every copy with TMA, Hopper's tile copy
  engine. Per tile, the program's Q blocks once; then K_j and V_j into a ring of NUM_STAGES
  shared-memory slots. A `ready` mbarrier per slot fires when the copy lands; an `empty` mbarrier
  per slot counts the consumers that are done with it.
* consumers (2 or 3 warpgroups of 4 warps, up to 240 registers per thread): each owns 64 query
  rows of the tile and keeps its m, l and O accumulator (64 x d fp32) in registers. Step j starts
  S_j = Q K_j^T and O += P_{j-1} V_{j-1} (asynchronous wgmma), waits for S_j only, and computes
  S_j's softmax while P_{j-1} V_{j-1} is still on the tensor cores (intra-warpgroup overlap).
* PINGPONG: consumers take turns to issue their products (a `turn` mbarrier each, passed round
  the ring), so one warpgroup's softmax runs while another's products occupy the tensor cores.
* PERSISTENT: one program per SM loops over tiles, so one tile's epilogue and the next tile's
  first loads overlap; otherwise one program per tile.
* KEY_SPLITS: each tile's key blocks cut into runs, a program each, writing partial (O, L) that notebook
  09's combine merges: for few query rows over many keys, whose tiles leave the last wave part idle
  (`key_splits`; a cached prompt's prefill, `decode.prefill_split`).
* STREAM (stream-K): one program an SM, each taking an equal span of all the tiles' key blocks from a table
  (`stream_work`): a tile cut between two programs writes its two parts' partials into two slots for the
  combine, so every SM gets the same work with no last wave.

Shared memory per program: (64 * consumers + 2 * NUM_STAGES * BLOCK_N) * d * 2 bytes (224 KB for
d = 128 with 3 stages: one program per SM). HBM traffic is the Triton forward's: Q, O once, K and
V once per tile of 64 * consumers query rows (mostly from L2).

Used by `forward.forward` (and so by `flash_attention`) on a Hopper GPU for contiguous
(B, H, N, d) bfloat16 / float16 inputs with d in {64, 128}, where `choose` says it is faster than the
Triton kernel; everything else takes the Triton kernel. No CPU path: Gluon has no interpreter.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..kernels import bound
from ..kernels.launch import Launch, keyword
from ..runtime import cdiv, sm_count  # sm_count: the persistent grid's size

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)
DTYPES = (torch.bfloat16, torch.float16)
QUERY_ROWS = 64  # query rows per consumer warpgroup: one wgmma's M
ROWS = gl.constexpr(QUERY_ROWS)  # the same, for the kernels (which may only read constexpr globals)


@gluon.jit
def _online_softmax(s, m_i, l_i, qk_scale, DTYPE: gl.constexpr, p_layout: gl.constexpr):
    """Online-softmax update for one (64, BLOCK_N) score tile s (fp32, registers, wgmma layout).

    Returns P = exp2(s * qk_scale - m_new) in 16 bits, laid out as the A operand of the next
    product (registers); the new row max m_new and row sum l_new; alpha = exp2(m_i - m_new), the
    factor the output accumulator must be rescaled by."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_new = l_i * alpha + gl.sum(p, 1)
    p_op = gl.convert_layout(p.to(DTYPE), p_layout)
    return p_op, m_new, l_new, alpha


@gluon.jit
def softmax_step(
    s, m_i, l_i, cols, rows, n_k, qk_scale, masked,
    CAUSAL: gl.constexpr, DTYPE: gl.constexpr, p_layout: gl.constexpr, offset,
):  # fmt: skip
    """`_online_softmax` of s, with invisible scores (key past n_k; under CAUSAL, key j after query
    row i + offset: 0 top-left, n_k - n_q bottom-right) set to -inf first when `masked`. A run-time
    branch: only the last block and the causal diagonal pay for masks. Each branch holds a whole
    softmax, which keeps the exponentials in their own basic block, ahead of the wgmma wait that
    follows: the assembler schedules within a block, and a PTX wgmma wait names no registers, so it
    would otherwise be free to hoist the wait above the exponentials and nothing would overlap (seen
    in the machine code)."""
    if masked:
        visible = gl.expand_dims(cols, 0) < n_k
        if CAUSAL:
            visible = visible & (gl.expand_dims(rows + offset, 1) >= gl.expand_dims(cols, 0))
        s = gl.where(visible, s, float("-inf"))
        p_op, m_new, l_new, alpha = _online_softmax(s, m_i, l_i, qk_scale, DTYPE, p_layout)
    else:
        p_op, m_new, l_new, alpha = _online_softmax(s, m_i, l_i, qk_scale, DTYPE, p_layout)
    return p_op, m_new, l_new, alpha


@gluon.jit
def store_o_l(
    acc, m_i, l_i, rows, row0, O, L, off_hz, H, N_Q,
    stride_ob, stride_oh, stride_om, stride_lb, stride_lh, stride_lm,
    BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, DTYPE: gl.constexpr, o_layout: gl.constexpr,
):  # fmt: skip
    """The epilogue of BLOCK_M query rows row0 ... of head off_hz (registers -> HBM, rows past N_Q
    masked): O = acc / l in O's dtype (DTYPE, or float32: cascade attention's partials), and
    L = (m + log2 l) * ln 2 (float32, natural-log units).
    acc: (BLOCK_M, HEAD_DIM) fp32 in o_layout; m_i, l_i and their row indices `rows`: BLOCK_M each."""
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = (acc / gl.expand_dims(l_o, 1)).to(O.dtype.element_ty)
    o_rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    off_b = off_hz // H
    off_h = off_hz % H
    o_base = O + off_b.to(gl.int64) * stride_ob + off_h.to(gl.int64) * stride_oh
    o_ptrs = o_base + gl.expand_dims(o_rows, 1) * stride_om + gl.expand_dims(o_cols, 0)
    gl.store(o_ptrs, out, mask=gl.expand_dims(o_rows < N_Q, 1))
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    l_ptrs = L + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh + rows * stride_lm
    gl.store(l_ptrs, lse, mask=rows < N_Q)


@gluon.jit
def chunked_block_major(t, chunk, count, blocks):
    """Item t of `count` rows (heads, or (batch, K/V head) pairs) of `blocks` blocks each, taken block-major a chunk
    of `chunk` rows at a time, chunk after chunk (the last chunk may hold fewer rows): (row, block). Block 0 of a
    chunk's rows comes first, while what is read at once is a chunk's rows, not every row's (`_tile`,
    `hopper_backward.program_index`)."""
    per = chunk * blocks
    c = t // per
    r = t % per
    rows = gl.maximum(gl.minimum(count - c * chunk, chunk), 1)
    return c * chunk + r % rows, r // rows


@gluon.jit
def _tile(k, BH, num_m, num_tiles, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr, KEY_SPLITS: gl.constexpr):
    """The tile of this program's round k: (valid, batch*head index, query-block index, key split).

    One program per tile (not PERSISTENT): round 0 only, tile = program id; tiles of one head are
    adjacent (its K and V stay in L2) and, under CAUSAL, its longest query blocks come first.
    PERSISTENT: round k covers tiles k*G ... k*G + G - 1 of the G programs, in snake order (program
    G-1-pid on odd rounds). Under CAUSAL the tiles go longest first, so that the snake hands each program a
    long tile and then a short one (a static round-robin over head-major tiles gives program pid the same
    query block of every head whenever G is a multiple of the blocks per head, 1.5-1.8x the average work at
    the standard shapes, a simulation): where G is a multiple of num_m (`persistent_grid` makes it one for
    top-left rows), in chunks of G // num_m heads, a round a chunk, so that the K and V read at once are a
    chunk's heads (the L2 holds a chunk's, not every head's); else over all heads at once (4-19 % slower at d = 128).
    KEY_SPLITS > 1: the num_m * BH tiles of split 0 first, then those of split 1, ... (a split's tiles of
    one head read the same K/V blocks, so they run together)."""
    G = gl.num_programs(0)
    pid = gl.program_id(0)
    t = k * G + gl.where(k % 2 == 0, pid, G - 1 - pid)
    valid = t < num_tiles
    split = 0
    if KEY_SPLITS > 1:
        split = t // (num_m * BH)
        t = t % (num_m * BH)
    if CAUSAL and PERSISTENT:
        hg = gl.where(G % num_m == 0, G // num_m, BH)  # heads a chunk: all of them on a grid not so cut
        off_hz, longest = chunked_block_major(t, hg, BH, num_m)
        start_m = num_m - 1 - longest
    else:
        off_hz = t // num_m
        start_m = t % num_m
        if CAUSAL:
            start_m = num_m - 1 - start_m
    return valid, off_hz, start_m, split


@gluon.jit
def _split_range(split, n_blocks, KEY_SPLITS: gl.constexpr):
    """Key blocks lo ... hi - 1 of split `split` (KEY_SPLITS > 1) of a tile's n_blocks: its share of
    them, in order (the host sees that every tile has at least KEY_SPLITS blocks: no split is empty)."""
    return split * n_blocks // KEY_SPLITS, (split + 1) * n_blocks // KEY_SPLITS


@gluon.jit
def _stream_span(WORK):
    """STREAM: this program's span of the tiles' key blocks, from `stream_work`'s table (int32, (programs + 1, 2)):
    it starts at key block lo0 of tile t0 and ends before key block lo1 of tile t1; and how many tile parts that
    is."""
    pid = gl.program_id(0)
    t0 = gl.load(WORK + 2 * pid)
    lo0 = gl.load(WORK + 2 * pid + 1)
    t1 = gl.load(WORK + 2 * pid + 2)
    lo1 = gl.load(WORK + 2 * pid + 3)
    return t0, lo0, t1, lo1, t1 - t0 + gl.where(lo1 > 0, 1, 0)


@gluon.jit
def _rounds(WORK, num_tiles, STREAM: gl.constexpr):
    """(t0, lo0, t1, lo1, rounds): STREAM's span and its parts (`_stream_span`), else the rounds of a program over
    the tiles (the span's four values unused)."""
    if STREAM:
        return _stream_span(WORK)
    else:
        return 0, 0, 0, 0, gl.cdiv(num_tiles, gl.num_programs(0))


@gluon.jit
def _stream_part(k, t0, lo0, t1, lo1, num_m, N_K, OFFSET, CTA_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 CAUSAL: gl.constexpr):  # fmt: skip
    """STREAM: part k of this program's span: (valid, batch*head index, query-block index, the tile's key blocks,
    lo, hi): key blocks lo ... hi - 1 of tile t0 + k, tiles one program per (batch, head) after another as without
    PERSISTENT."""
    t = t0 + k
    off_hz = t // num_m
    start_m = t % num_m
    if CAUSAL:
        start_m = num_m - 1 - start_m
    n_blocks = _n_blocks(start_m, N_K, OFFSET, CTA_M, BLOCK_N, CAUSAL)
    lo = gl.where(k == 0, lo0, 0)
    hi = gl.where(t == t1, lo1, n_blocks)
    return hi > lo, off_hz, start_m, n_blocks, lo, hi


@gluon.jit
def _n_blocks(start_m, N_K, OFFSET, CTA_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """How many K/V blocks the query block start_m visits (causal: none past the key its last row
    sees, row + OFFSET)."""
    n = gl.cdiv(N_K, BLOCK_N)
    if CAUSAL:
        n = gl.minimum(n, gl.cdiv((start_m + 1) * CTA_M + OFFSET, BLOCK_N))
    return n


@gluon.jit
def _producer(args, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
              NUM_CONSUMERS: gl.constexpr, PERSISTENT: gl.constexpr, KEY_SPLITS: gl.constexpr,
              STREAM: gl.constexpr):  # fmt: skip
    """One warp issues every TMA copy (HBM -> shared memory) of the program. Per tile: the Q blocks,
    once the consumers are done with the previous tile's; then K_j, V_j into ring slot
    it % NUM_STAGES, once every consumer has released that slot. `it` counts K/V blocks over all
    of the program's tiles. Rows past a head's end are the next head's (or zeros past the tensor):
    the consumers mask those keys and never store those queries."""
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_bar, v_bar, empty_bar,
     BH, H, GROUP, N_Q, N_K, OFFSET, num_m, num_tiles, WORK) = args  # fmt: skip
    CTA_M: gl.constexpr = ROWS * NUM_CONSUMERS
    it = 0
    tcount = 0
    t0, lo0, t1, lo1, rounds = _rounds(WORK, num_tiles, STREAM)
    for k in range(rounds):
        if STREAM:
            valid, off_hz, start_m, n_blocks, lo, hi = _stream_part(
                k, t0, lo0, t1, lo1, num_m, N_K, OFFSET, CTA_M, BLOCK_N, CAUSAL
            )
        else:
            valid, off_hz, start_m, split = _tile(k, BH, num_m, num_tiles, CAUSAL, PERSISTENT, KEY_SPLITS)
            n_blocks = gl.where(valid, _n_blocks(start_m, N_K, OFFSET, CTA_M, BLOCK_N, CAUSAL), 0)
            lo = 0
            hi = n_blocks
            if KEY_SPLITS > 1:
                lo, hi = _split_range(split, n_blocks, KEY_SPLITS)
        q_row = off_hz * N_Q + start_m * CTA_M
        # K/V head of query head h: h // GROUP (grouped-query attention), of the same batch
        kv_row = ((off_hz // H) * (H // GROUP) + (off_hz % H) // GROUP) * N_K
        for c in gl.static_range(NUM_CONSUMERS):
            # A fresh mbarrier counts as having completed the phase before phase 0, so the first
            # wait on each `empty` barrier returns at once.
            mbarrier.wait(q_empty.index(c), (tcount & 1) ^ 1, pred=valid)
            mbarrier.expect(q_bar.index(c), q_desc.block_type.nbytes, pred=valid)
            tma.async_copy_global_to_shared(
                q_desc, [q_row + c * ROWS, 0], q_bar.index(c), q_smem.index(c), pred=valid
            )
        for j in range(lo, hi):
            slot = it % NUM_STAGES
            mbarrier.wait(empty_bar.index(slot), ((it // NUM_STAGES) & 1) ^ 1)
            row = kv_row + j * BLOCK_N
            mbarrier.expect(k_bar.index(slot), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row, 0], k_bar.index(slot), k_smem.index(slot))
            mbarrier.expect(v_bar.index(slot), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [row, 0], v_bar.index(slot), v_smem.index(slot))
            it += 1
        tcount += gl.where(valid, 1, 0)


@gluon.jit
def _consumer(args, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
              NUM_CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr, PERSISTENT: gl.constexpr,
              WG: gl.constexpr, KEY_SPLITS: gl.constexpr, STREAM: gl.constexpr):  # fmt: skip
    """Warpgroup WG: for each of the program's tiles, O and L of the tile's query rows
    64 * WG ... 64 * WG + 63 (m, l: 64 floats, acc: 64 x HEAD_DIM fp32, all in registers).
    args: the run-time values every consumer shares (see `fwd_ws_kernel`)."""
    (q_smem, k_smem, v_smem, q_bar, q_empty, k_bar, v_bar, empty_bar, turn_bar,
     O, L, qk_scale, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, stride_lm,
     BH, H, N_Q, N_K, OFFSET, num_m, num_tiles, WORK) = args  # fmt: skip
    dtype: gl.constexpr = q_smem.dtype
    CTA_M: gl.constexpr = ROWS * NUM_CONSUMERS
    # Register layouts of the two products' results: wgmma tiles of 16 rows x N columns per warp.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    NEXT: gl.constexpr = (WG + 1) % NUM_CONSUMERS
    q = q_smem.index(WG)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=col_layout)

    it = 0  # K/V blocks consumed over all tiles: gives ring slot, ring phase and turn parity
    tcount = 0
    t0, lo0, t1, lo1, rounds = _rounds(WORK, num_tiles, STREAM)
    for k in range(rounds):
        if STREAM:
            valid, off_hz, start_m, n_blocks, lo, hi = _stream_part(
                k, t0, lo0, t1, lo1, num_m, N_K, OFFSET, CTA_M, BLOCK_N, CAUSAL
            )
            # a tile's first part in slot 0, the rest of it (another program's) in slot 1
            split = gl.where(lo > 0, 1, 0)
        else:
            valid, off_hz, start_m, split = _tile(k, BH, num_m, num_tiles, CAUSAL, PERSISTENT, KEY_SPLITS)
        if valid:
            if not STREAM:
                n_blocks = _n_blocks(start_m, N_K, OFFSET, CTA_M, BLOCK_N, CAUSAL)
                lo = 0
                hi = n_blocks
                if KEY_SPLITS > 1:
                    lo, hi = _split_range(split, n_blocks, KEY_SPLITS)
            o_ptr = O
            l_ptr = L
            if KEY_SPLITS > 1 or STREAM:  # a split's partial (O, L) in its slot of the buffers
                o_ptr = O + split.to(gl.int64) * BH * N_Q * HEAD_DIM
                l_ptr = L + split.to(gl.int64) * BH * N_Q
            m_start = start_m * CTA_M + WG * ROWS
            first_masked = N_K // BLOCK_N  # blocks from here on need the mask
            if CAUSAL:
                first_masked = gl.minimum(first_masked, (m_start + OFFSET) // BLOCK_N)
            rows = m_start + gl.arange(0, ROWS, layout=row_layout)
            m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
            l_i = gl.zeros([ROWS], gl.float32, layout=row_layout)
            acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)

            # Block 0: S_0 = Q K_0^T and its softmax; P_0 waits in registers for V_0.
            slot = it % NUM_STAGES
            mbarrier.wait(q_bar.index(WG), tcount & 1)
            mbarrier.wait(k_bar.index(slot), (it // NUM_STAGES) & 1)
            if PINGPONG:
                mbarrier.wait(turn_bar.index(WG), it & 1)
            s_tok = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn_bar.index(NEXT), count=1)
            s = warpgroup_mma_wait(0, deps=[s_tok])
            # the first block: its keys from lo * BLOCK_N, masked from first_masked on (lo = 0 unless KEY_SPLITS)
            p_op, m_i, l_i, alpha = softmax_step(
                s, m_i, l_i, lo * BLOCK_N + offs_n, rows, N_K, qk_scale, first_masked <= lo, CAUSAL, dtype,
                p_layout, OFFSET,
            )  # fmt: skip

            for j in range(lo + 1, hi):
                g = it + j - lo
                slot = g % NUM_STAGES
                prev = (g - 1) % NUM_STAGES
                # Issue S_j = Q K_j^T and O += P_{j-1} V_{j-1}; both run on the tensor cores.
                mbarrier.wait(k_bar.index(slot), (g // NUM_STAGES) & 1)
                if PINGPONG:
                    mbarrier.wait(turn_bar.index(WG), g & 1)
                s_tok = warpgroup_mma(
                    q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True
                )
                mbarrier.wait(v_bar.index(prev), ((g - 1) // NUM_STAGES) & 1)
                acc_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
                if PINGPONG:
                    mbarrier.arrive(turn_bar.index(NEXT), count=1)
                # Wait for S_j only (the older of the two): its softmax overlaps P_{j-1} V_{j-1}.
                s = warpgroup_mma_wait(1, deps=[s_tok])
                p_next, m_i, l_i, alpha = softmax_step(
                    s, m_i, l_i, j * BLOCK_N + offs_n, rows, N_K, qk_scale, j >= first_masked, CAUSAL, dtype,
                    p_layout, OFFSET,
                )  # fmt: skip
                # p_next through the wait: the softmax must finish before it (see softmax_step).
                acc, p_op, p_next = warpgroup_mma_wait(0, deps=[acc_tok, p_op, p_next])
                mbarrier.arrive(empty_bar.index(prev), count=1)  # K, V of block j - 1: done here
                p_op = p_next
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)

            # Every S of this tile is done: the producer may load the next tile's Q.
            mbarrier.arrive(q_empty.index(WG), count=1)
            it += hi - lo
            last = (it - 1) % NUM_STAGES
            mbarrier.wait(v_bar.index(last), ((it - 1) // NUM_STAGES) & 1)
            acc_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc_tok])
            mbarrier.arrive(empty_bar.index(last), count=1)
            tcount += 1

            store_o_l(
                acc, m_i, l_i, rows, m_start, o_ptr, l_ptr, off_hz, H, N_Q,
                stride_ob, stride_oh, stride_om, stride_lb, stride_lh, stride_lm, ROWS, HEAD_DIM, dtype, o_layout,
            )  # fmt: skip
            if STREAM:
                # the whole tile here: slot 1 holds nothing (L = -inf; its O is not read)
                if (lo == 0) & (hi == n_blocks):
                    l_ptrs = (
                        L + BH * N_Q + (off_hz // H).to(gl.int64) * stride_lb
                        + (off_hz % H).to(gl.int64) * stride_lh + rows * stride_lm
                    )  # fmt: skip
                    gl.store(
                        l_ptrs, gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout), mask=rows < N_Q
                    )


@gluon.jit(do_not_specialize=["OFFSET"])  # an offset's divisibility changes no instruction: one binary
def fwd_ws_kernel(
    q_desc, k_desc, v_desc, O, L, qk_scale,
    stride_ob, stride_oh, stride_om, stride_lb, stride_lh, stride_lm,
    BH, H, GROUP, N_Q, N_K, OFFSET,
    CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    NUM_CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr, PERSISTENT: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, KEY_SPLITS: gl.constexpr = 1, STREAM: gl.constexpr = False, WORK=None,
):  # fmt: skip
    """O and L for tiles of CTA_M = 64 * NUM_CONSUMERS query rows of one (batch, head).

    q_desc, k_desc, v_desc: TMA descriptors of the (B*H*N, d) matrices with blocks (64, d) and
    (BLOCK_N, d). O (B, H, N_Q, d) with strides stride_o*, unit last stride; L (B, H, N_Q) float32 with
    strides stride_l* (stride_lm 1 but for `forward`'s token_major).
    qk_scale = softmax scale * log2(e). OFFSET: under CAUSAL, query row i sees keys j <= i + OFFSET (0
    top-left, N_K - N_Q >= 0 bottom-right: every row sees a key). Grid: one program per tile, or
    (PERSISTENT) one per SM.
    Launched with num_warps=4: the kernel's own four warps are consumer 0; the other consumers and
    the producer are worker partitions of `gl.warp_specialize`."""
    dtype: gl.constexpr = q_desc.dtype
    CTA_M: gl.constexpr = ROWS * NUM_CONSUMERS
    num_m = gl.cdiv(N_Q, CTA_M)
    num_tiles = num_m * BH * KEY_SPLITS

    # Shared memory: Q (one 64 x d block per consumer), the K and V rings, and the mbarriers.
    q_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, ROWS, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty_bar = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turn_bar = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(q_bar.index(c), count=1)
        mbarrier.init(q_empty.index(c), count=1)
        mbarrier.init(turn_bar.index(c), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
        mbarrier.init(empty_bar.index(i), count=NUM_CONSUMERS)
    fence_async_shared()
    if PINGPONG:
        mbarrier.arrive(turn_bar.index(0), count=1)  # consumer 0 issues first

    # Run-time arguments go in a tuple; the compile-time ones are passed one by one (a tuple built
    # in a variable turns its constexpr entries into run-time values).
    shared = (q_smem, k_smem, v_smem, q_bar, q_empty, k_bar, v_bar, empty_bar, turn_bar,
              O, L, qk_scale, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, stride_lm,
              BH, H, N_Q, N_K, OFFSET, num_m, num_tiles, WORK)  # fmt: skip
    loads = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_bar, v_bar, empty_bar,
             BH, H, GROUP, N_Q, N_K, OFFSET, num_m, num_tiles, WORK)  # fmt: skip
    if NUM_CONSUMERS == 1:  # two programs share an SM (`Variant.programs_per_sm`)
        gl.warp_specialize(
            [
                (_consumer, (shared, CAUSAL, HEAD_DIM, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, PINGPONG, PERSISTENT, 0,
                             KEY_SPLITS, STREAM)),
                (_producer, (loads, CAUSAL, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, PERSISTENT, KEY_SPLITS, STREAM)),
            ],
            [1], [24],
        )  # fmt: skip
    elif NUM_CONSUMERS == 2:
        gl.warp_specialize(
            [
                (_consumer, (shared, CAUSAL, HEAD_DIM, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, PINGPONG, PERSISTENT, 0,
                             KEY_SPLITS, STREAM)),
                (_consumer, (shared, CAUSAL, HEAD_DIM, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, PINGPONG, PERSISTENT, 1,
                             KEY_SPLITS, STREAM)),
                (_producer, (loads, CAUSAL, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, PERSISTENT, KEY_SPLITS, STREAM)),
            ],
            [4, 1], [CONSUMER_REGS, 24],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_consumer, (shared, CAUSAL, HEAD_DIM, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, PINGPONG, PERSISTENT, 0,
                             KEY_SPLITS, STREAM)),
                (_consumer, (shared, CAUSAL, HEAD_DIM, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, PINGPONG, PERSISTENT, 1,
                             KEY_SPLITS, STREAM)),
                (_consumer, (shared, CAUSAL, HEAD_DIM, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, PINGPONG, PERSISTENT, 2,
                             KEY_SPLITS, STREAM)),
                (_producer, (loads, CAUSAL, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, PERSISTENT, KEY_SPLITS, STREAM)),
            ],
            [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24],
        )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant(Launch):
    """A variant of the kernel: BLOCK_N keys per K/V block, NUM_STAGES ring slots, NUM_CONSUMERS
    warpgroups of 64 query rows, PINGPONG, PERSISTENT (module docstring). It unpacks as the tuple
    (block_n, num_stages, num_consumers, pingpong, persistent)."""

    block_n: int = keyword("BLOCK_N")
    num_stages: int = keyword("NUM_STAGES")
    num_consumers: int = keyword("NUM_CONSUMERS")
    pingpong: bool = keyword("PINGPONG")
    persistent: bool = keyword("PERSISTENT")

    @property
    def programs_per_sm(self) -> int:
        """Programs an SM runs at once: two with one consumer (half the registers each, so that one program's
        softmax and start overlap the other's products, as ping-pong does between the consumers of one), else one."""
        return 2 if self.num_consumers == 1 else 1

    def kwargs(self) -> dict:
        """The kernel's constants of the variant, and its warps and registers (`launch_options`)."""
        return {**super().kwargs(), **launch_options(self.num_consumers, self.programs_per_sm)}


D128_SHORT = Variant(128, 3, 2, True, True)  # d = 128, no mask, rows of <= 32 K/V blocks
D128_LONG = Variant(128, 3, 2, True, False)
D64 = Variant(128, 3, 3, True, True)
# 128-row tiles at d = 64: causal rows of 2k-4k keys, bottom-right calls (a KV cache's chunk)
D64_ROWS_128 = Variant(128, 4, 2, True, True)
# Every variant the tests check: the chosen ones and a few others (each fits in 227 KB of shared memory, or its
# share of it where two run on an SM: one consumer, 64-key blocks, two programs an SM).
VARIANTS = {
    128: (D128_SHORT, D128_LONG, Variant(128, 3, 2, False, True), Variant(64, 3, 1, False, False)),
    64: (D64, Variant(128, 3, 3, False, False), D64_ROWS_128),
}


def choose(
    d: int, causal: bool, n_q: int, n_k: int, offset: int = 0, heads: int = 0, sms: int = 0
) -> Variant | None:
    """The variant to run for this shape, or None where the Triton kernel was faster: `_variant`'s, then, with
    `heads` (batch x query heads) and `sms` given, the grid's rule, for grids that do not fill the GPU evenly.
    At d = 64 (tiles of 192 rows, a persistent grid of `sms` programs) the rows an SM gets, its tiles' rounds x
    192, weighed by 0.85 (the Gluon kernel's speed per row against the Triton kernel's, on full grids), against
    the Triton kernel's (tiles of 128 rows: rounds x 128): the fewer wins. At d = 128 on 128-row tiles, the
    Triton kernel where fewer tiles than half the SMs have 2048 keys or fewer. Bottom-right calls (offset >=
    n_q) keep `_variant`'s. Measured (graph replays, us, Gluon / Triton; `scripts/hopper_ws_forward.py --grids`,
    H200, 2026-11-30), d = 64 non-causal, (batch x heads, N): 2 x 4096 (Gluon rows 1 x 192 x 0.85 = 163 against
    Triton's 1 x 128) 61.2 / 58.6, 8 x 4096 (326 / 256) 113.6 / 88.3, 2 x 16384 (326 / 256) 397.2 / 325.3, 9 and
    10 x 4096 (326 / 384) 114.6 / 136.1 (10), 12 x 4096 (326 / 384) 115.3 / 138.0, 16 x 4096 (490 / 512) 166.3 /
    171.1, 4 x 16384 (490 / 512) 592.6 / 643.5, 8 x 16384 (979 / 1024) 1174.6 / 1288.0, 32 x 4096 (979 / 1024)
    316.9 / 332.2; causal 2 x 8192 (163 / 128) 118.2 / 110.1, 8 x 8192 (490 / 512) 180.2 / 248.6. d = 128: 2 x
    2048 (32 tiles) causal 35.6 / 29.9, non-causal 35.3 / 29.2; 4 x 2048 causal (64) 36.1 / 30.5; 2 x 4096
    non-causal (64) 59.8 / 73.4; 5 x 2048 causal (80) 37.2 / 40.4; 5 x 4096 causal (160) 61.8 / 74.7; 8 x 2048
    causal (128) 37.9 / 42.2; 3 x 8192 non-causal (192) 211.3 / 274.7. The Triton kernel's 128-row tiles are
    an approximation (its table's launch decides)."""
    variant = _variant(d, causal, n_q, n_k, offset)
    if variant is None or not (heads and sms) or (causal and offset >= n_q):
        return variant
    rows = 64 * variant.num_consumers
    tiles = heads * cdiv(n_q, rows)
    if d == 64:
        gluon_rows = 0.85 * rows * cdiv(tiles, sms)
        return variant if gluon_rows <= 128 * cdiv(heads * cdiv(n_q, 128), sms) else None
    return None if rows >= 128 and 2 * tiles < sms and n_k <= 2048 else variant


def _variant(d: int, causal: bool, n_q: int, n_k: int, offset: int = 0) -> Variant | None:
    """The variant for this shape on a grid that fills the GPU (`choose`), or None where the Triton kernel was
    faster.

    From `scripts/hopper_ws_forward.py` on an H200 (notes/attention.md, "Why it is so": the sweeps
    and repeated timings): at d = 128 this kernel wins everywhere (on short causal rows since 2026-12-01). Without
    the mask, one program per SM (persistent) while rows are short (<= 32 K/V blocks of 128: the
    epilogue of one tile overlaps the next one's loads), one program per tile beyond. With the mask,
    persistent at every length, its tiles dealt longest first a chunk of heads at a time (`_tile`;
    `scripts/hopper_ws_forward.py --passes 4 --causal 1` and an A/B of the tile orders, H200,
    2026-12-01, TFLOP/s, persistent / one program per tile / persistent with the tiles longest first over
    all heads, as before): 1k 373 / 318 / 309 (the one-consumer variant of before, 335), 2k 475 / 399 / 385,
    4k 541 / 471 / 465, 8k 575 / 527 / 554, 16k 606 / 578 / 581. At d = 64 the exponentials, not the tensor
    cores, set the pace; three consumers win on long rows, the Triton kernel on short ones; causal rows of
    2k-4k keys take 128-row tiles (D64_ROWS_128, chunked as above): 346 / 393 against Triton's 309 / 355
    (8k: 406 against D64's 414, 16k 426 / 421-425, 1k 278 / Triton's 281: left as they were). One consumer of
    64 rows a program, two programs an SM (`Variant.programs_per_sm`; the choice at d = 128 causal 1k until
    2026-12-01) ran 335-340 there. A causal offset (bottom-right: a chunk of queries at
    the end of a KV cache) at least n_q puts most of each row's keys before the diagonal: such shapes
    follow the unmasked rule, at the keys a row sees on average, and at d = 64 take tiles of 128 rows
    (`scripts/hopper_ws_forward.py --bottom-right`, H200, 2026-11-29, Nq x Nk from 256 x 8192 to
    3280 x 32768 over ~8k query rows, and at 16 heads of one sequence: the pick 1.29-1.35x the Triton
    kernel at d = 128, 1.00-1.05x at d = 64, within 0.96 of the fastest variant in every cell; the
    192-row tiles of D64 lost up to 28 % where the rows are few)."""
    if causal and offset >= n_q:
        unmasked = _variant(d, False, n_q, offset + n_q // 2)
        return D64_ROWS_128 if d == 64 and unmasked is not None else unmasked
    if d == 128:
        return D128_SHORT if causal or cdiv(n_k, 128) <= 32 else D128_LONG
    if d == 64 and causal and 2048 <= n_k < 8192:
        return D64_ROWS_128
    if d == 64:
        return D64 if n_k >= (8192 if causal else 2048) else None
    return None


def supports(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor) -> bool:
    """Whether this kernel can take these (B, H, N, d) tensors: a Hopper GPU (compute capability
    9.x), bfloat16 or float16, d in HEAD_DIMS, not empty, each tensor contiguous (the descriptors
    view it as a (B*H*N, d) matrix) at a 16-byte aligned address (what TMA requires)."""
    if not (q4.is_cuda and capability(q4.device.index)[0] == 9):
        return False
    if q4.dtype not in DTYPES or q4.shape[-1] not in HEAD_DIMS or q4.numel() == 0 or k4.numel() == 0:
        return False
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q4, k4, v4))


def launch_options(num_consumers: int, programs_per_sm: int = 1) -> dict:
    """Warps and registers: 4 * num_consumers + 4 warps (the producer's warp is padded to a
    warpgroup) share the SM's 64K registers, or their share of them where `programs_per_sm` programs run on
    an SM at once. `setmaxnreg` drops the producer's warpgroup to 24 per thread; the worker consumers get
    CONSUMER_REGS, consumer 0 (the default partition) the rest."""
    warps = 4 * num_consumers + 4
    maxnreg = (65536 // (programs_per_sm * warps * 32)) // 8 * 8
    consumer_regs = min(240, ((maxnreg * (warps // 4) - 24) // num_consumers) // 8 * 8)
    return {"num_warps": 4, "maxnreg": maxnreg, "CONSUMER_REGS": consumer_regs}


def persistent_grid(variant: Variant, tiles: int, num_m: int, top_left: bool, index: int) -> int:
    """Programs of a PERSISTENT launch of `tiles` tiles, num_m a head (its query blocks): one per slot
    (`programs_per_sm` an SM), fewer where the tiles are fewer; for causal rows with most keys on the diagonal
    (top_left: offset < n_q) a multiple of num_m where that keeps 90 % of the slots, so that each round is a
    chunk of whole heads sorted longest first (`_tile`)."""
    slots = variant.programs_per_sm * sm_count(index)
    if top_left and slots // num_m * num_m >= 0.9 * slots:
        slots = slots // num_m * num_m
    return min(tiles, slots)


@functools.cache
def _smem_layout(rows: int, d: int, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(
        [rows, d], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    )


def descriptor(t4: torch.Tensor, rows: int) -> TensorDescriptor:
    """A TMA descriptor of a contiguous t4 (B, H, N, d) viewed as one (B*H*N, d) matrix, in blocks
    of (rows, d); bfloat16 or float16. Also used by scripts/hopper_gluon_forward.py."""
    B, H, N, d = t4.shape
    mat = t4.view(B * H * N, d)
    return TensorDescriptor(mat, [B * H * N, d], [d, 1], [rows, d], _smem_layout(rows, d, t4.dtype))


@functools.cache
def capability(index: int) -> tuple[int, int]:
    """Compute capability (major, minor) of CUDA device `index` (9.x: Hopper), cached."""
    return torch.cuda.get_device_capability(index)


def forward(
    q4,
    k4,
    v4,
    o4,
    lse3,
    causal: bool,
    scale: float,
    variant: Variant,
    offset: int = 0,
    key_splits: int = 1,
    token_major: bool = False,
    work: torch.Tensor | None = None,
) -> None:
    """Write O into o4 (B, H, Nq, d; q's dtype or float32, contiguous rows: any strides of B and H) and L into
    lse3 (B, H, Nq) float32, for q4 (B, H, Nq, d) and
    k4, v4 (B, Hkv, Nk, d) that pass `supports` (H a multiple of Hkv: grouped-query attention);
    variant from `choose` (or any of VARIANTS, for tests); offset: the causal offset, 0 (top-left) or
    Nk - Nq >= 0 (bottom-right; `kernels.blocks`). The caller makes q4's GPU current.

    token_major: o4 is (B, Nq, H, d) and lse3 (B, Nq, H) instead (any strides, d's unit), the layout a model's
    output projection reads. key_splits S > 1 (from `key_splits`): each tile's key blocks are cut into S runs, a
    program each, and o4 and lse3 hold a leading split dimension, float32, each split's slot B * H * Nq rows
    after the one before ((S, B, H, Nq, d) and (S, B, H, Nq) contiguous, or token-major (S, B, Nq, H, d) and (S,
    B, Nq, H)): each run's partial (O_s divided by its own row sums, L_s its logsumexp), which notebook 09's
    combine merges (`decode.combine`). Every tile must have at least S key blocks (`key_splits` sees to it).
    work: `stream_work`'s table on q's GPU (key_splits 1): each program takes its even share of all the tiles'
    key blocks (stream-K), o4 and lse3 hold 2 slots as with key_splits=2: a tile's first part in slot 0, its
    rest (another program's) in slot 1, L = -inf there where one program did the whole tile."""
    B, H, n_q, d = q4.shape
    n_k = k4.shape[2]
    if causal and offset < 0:
        raise ValueError(
            f"hopper.forward: causal offset {offset} < 0 (rows that see no key) is not supported"
        )
    if isinstance(key_splits, bool) or not isinstance(key_splits, int) or key_splits < 1:
        raise ValueError(f"hopper.forward: key_splits must be an int >= 1, got {key_splits!r}")
    rows = (B, n_q, H) if token_major else (B, H, n_q)
    if work is not None and key_splits != 1:
        raise ValueError(f"hopper.forward: work (stream-K) takes key_splits=1, got {key_splits}")
    if work is not None and not (
        isinstance(work, torch.Tensor) and work.dtype == torch.int32 and work.dim() == 2 and work.shape[1] == 2
        and work.shape[0] >= 2 and work.is_contiguous() and work.device == q4.device
    ):  # fmt: skip
        raise ValueError(
            "hopper.forward: work must be `stream_work`'s table, an int32 (programs + 1, 2) contiguous tensor on "
            f"q's device; got {getattr(work, 'dtype', type(work).__name__)} {tuple(getattr(work, 'shape', ()))}"
        )
    slots = 2 if work is not None else key_splits
    lead = (slots,) if slots > 1 else ()
    if tuple(o4.shape) != (*lead, *rows, d) or tuple(lse3.shape) != (*lead, *rows):
        raise ValueError(
            f"hopper.forward: o4 must be {(*lead, *rows, d)} and lse3 {(*lead, *rows)} for q4 {tuple(q4.shape)} "
            f"({'token-major' if token_major else 'head-major'}, {key_splits} key splits); got {tuple(o4.shape)} "
            f"and {tuple(lse3.shape)}"
        )
    num_m = cdiv(n_q, QUERY_ROWS * variant.num_consumers)  # query blocks a head
    tiles = num_m * B * H * key_splits
    top_left = causal and offset < n_q
    grid = (
        persistent_grid(variant, tiles, num_m, top_left, q4.device.index) if variant.persistent else tiles,
    )
    if slots > 1 and not (o4.is_contiguous() and lse3.is_contiguous()):
        raise ValueError(
            f"hopper.forward: key_splits={key_splits} needs contiguous partials (a slot a split)"
        )
    splits = {"KEY_SPLITS": key_splits} if key_splits > 1 else {}
    if work is not None:
        grid = (work.shape[0] - 1,)
        splits = {"STREAM": True, "WORK": work}
    # strides of the batch, then of the other two dims (split 0's slot)
    o_strides, l_strides = o4.stride()[-4:-1], lse3.stride()[-3:]
    if token_major:  # (B, Nq, H, ...): batch, head, row
        o_strides, l_strides = (
            (o_strides[0], o_strides[2], o_strides[1]),
            (l_strides[0], l_strides[2], l_strides[1]),
        )
    bound.launch(fwd_ws_kernel, grid,
        descriptor(q4, QUERY_ROWS), descriptor(k4, variant.block_n), descriptor(v4, variant.block_n),
        o4, lse3, scale * LOG2E, *o_strides, *l_strides,
        B * H, H, H // k4.shape[1], n_q, n_k, offset if causal else 0,
        CAUSAL=causal, HEAD_DIM=d, **variant.kwargs(), **splits,
    )  # fmt: skip


# What a split adds to the time of a prefill's attention, as a fraction of it per split (its partials written and
# merged, a tile's start and end once more): fitted to `scripts/serving_probe.py --prefill-key-splits` (H200,
# 2026-11-30; 3280 x 32k and 1648 x 16k, 16 / 4 heads at d = 64 and 32 / 8 at d = 128, 1-8 splits, graph
# replays): with it `key_splits` picks a split count within 2 % of the fastest in each of the four cells.
SPLIT_COST = 0.03
MAX_KEY_SPLITS = 8


def key_splits(
    variant: Variant, batch_heads: int, n_q: int, n_k: int, causal: bool, offset: int, sms: int
) -> int:
    """How many runs `forward` cuts each tile's keys into, so that the tiles fill their waves: few query rows
    over many keys (a cached prompt's prefill: 3280 rows over 32k keys at 16 heads is 416 tiles of 128 rows,
    3.15 waves on 132 SMs, the last one 85 % idle). The S (at most MAX_KEY_SPLITS and the shortest tile's key
    blocks, so that no run is empty) whose time, ceil(S x waves) / S rounds of a whole tile's work, each split
    adding SPLIT_COST, is least; 1 where the tiles fill their waves already."""
    cta_m = QUERY_ROWS * variant.num_consumers
    tiles = cdiv(n_q, cta_m) * batch_heads
    shortest = cdiv(n_k, variant.block_n)
    if causal:
        shortest = min(shortest, cdiv(cta_m + offset, variant.block_n))

    def time(s: int) -> float:
        return cdiv(s * tiles, sms) / s * (1 + SPLIT_COST * s)

    return min(range(1, max(1, min(MAX_KEY_SPLITS, shortest)) + 1), key=lambda s: (time(s), s))


def stream_work(
    variant: Variant, batch_heads: int, n_q: int, n_k: int, causal: bool, offset: int, sms: int
) -> np.ndarray | None:
    """Stream-K for few query rows over many keys (a cached prompt's prefill): all the tiles' key blocks, tiles in
    `forward`'s order (a head's after another's), cut into `programs_per_sm` x sms equal spans, a program each, so
    that every SM gets the same work (`key_splits` rounds whole runs of tiles: 3 splits of 416 tiles are 9.45
    waves, the last 45 % busy). The (programs + 1, 2) int32 table of (tile, first key block) where each span
    starts (the last row: (tiles, 0)); None where a span would be shorter than a tile (a tile would then be cut
    in more than two parts, which the two slots of partials cannot hold) or there are fewer tiles than programs."""
    cta_m = QUERY_ROWS * variant.num_consumers
    num_m = cdiv(n_q, cta_m)
    programs = variant.programs_per_sm * sms
    if num_m * batch_heads < programs:
        return None
    m = np.arange(num_m)
    if causal:
        m = num_m - 1 - m  # the kernel's order of a head's query blocks
    blocks = np.full(num_m, cdiv(n_k, variant.block_n), dtype=np.int64)
    if causal:
        blocks = np.minimum(blocks, -(-((m + 1) * cta_m + offset) // variant.block_n))
    blocks = np.tile(blocks, batch_heads)
    starts = np.concatenate(([0], np.cumsum(blocks)))
    total = int(starts[-1])
    if total // programs < int(blocks.max()):
        return None
    at = np.arange(programs + 1, dtype=np.int64) * total // programs
    tile = np.searchsorted(starts, at, side="right") - 1  # the last span ends at (tiles, 0)
    return np.stack([tile, at - starts[tile]], axis=1).astype(np.int32)
