"""Flash-Decoding: attention of a few new query tokens over a long KV cache, split along the keys (notebook 09).

Layouts (FlashAttention's `flash_attn_with_kvcache` layout: tokens before heads):
  q              (B, Tq, Hq, d)   the new query tokens of each sequence; Tq = 1 for plain decoding, a few
                                  for speculative verification or a chunked prefill
  k_cache        (B, Nmax, Hkv, d), v_cache the same: key j of sequence b is valid for j < cache_seqlens[b]
                                  (the new tokens' keys already written at the end)
  cache_seqlens  (B,) int32       valid keys per sequence, 0 <= cache_seqlens[b] <= Nmax (None in
                                  `decode_attention`: every sequence holds all Nmax keys)
  out            (B, Tq, Hq, d)   q's dtype; lse (B, Tq, Hq) float32 (natural log, -inf for a row that
                                  sees no key; its out row is 0)
Hq must be a multiple of Hkv (GQA; MQA when Hkv = 1): query head h reads kv head h // (Hq / Hkv).
Causal alignment is bottom-right: query t of Tq sees keys j <= cache_seqlens[b] - Tq + t (the new
tokens are the last Tq of the sequence); causal=False lets every query see all cache_seqlens[b] keys.

The kernel. One program per (sequence x kv head, split, query tile): grid (B * Hkv, S, M tiles), fixed
by the shapes alone, so a step can be captured once as a CUDA graph and replayed for any lengths.
- GQA packing: the G = Hq / Hkv query heads that share a kv head and the Tq tokens become the rows of
  one tile (row r = t * G + g, padded to BLOCK_M >= 16), so the cache of a kv head is read once, not G times.
- Split s of a sequence of n keys covers blocks [s * P, (s + 1) * P) of BLOCK_N keys, P = cdiv(cdiv(n,
  BLOCK_N), S): computed in the kernel from the length it loads, so a ragged batch is split per
  sequence with no host sync. A split with no key writes (O, L) = (0, -inf).
- A batch of two sequences or more is cut into short slices when its cache is long (`heuristics.sliced`),
  read with the paged kernel's tile, its programs started longest sequence first when they do not all
  fit on the GPU at once (`heuristics.longest_first`): whatever its lengths, its longest sequence does
  not stream alone at the end.
- Each split writes its partial (O, L) in fp32; `combine` merges them (S = 1 writes the result directly).
  `plan_launch` and `write_partials` run the kernel alone into a buffer the caller gives: cascade
  attention's two passes write one buffer, merged by one combine (`serving.cascade`, notebook 14).
  On Hopper the combine is launched early (`course_lib.pdl`): the split programs let it be scheduled
  once each has stored its partial. Measured on an H200 (bf16, d = 128, 32/8 heads, graph replays, us;
  plain launches / trigger at each program's start / at its end): batch 1 at 4k 14.2 (trigger at the end)
  against 15.5-15.7 at the start, 8k 17.6-17.9 / 18.9 / 17.5-17.8, 32k 41.2 / 41.2-41.4 / 40.9-41.3;
  B = 8 at 8k 70.6 / 70.4-70.6 / 70.1-70.3; B = 16 at 32k (four waves) 490.2-491.1 / 494.3-494.7 /
  489.8-490.4; the ragged B = 16 256.5 / 259.6 / 256.3. (Why the trigger at the start costs time was
  not found.)
Bytes moved: every valid K and V row once (2 x n x Hkv x d x element size per sequence), Q and O once,
plus the partials (S x B x Tq x Hq x (d + 1) x 4 bytes, twice).

`paged.py` runs the same kernel with PAGED=True: K/V rows are found through a block table. Each block
of keys first needs its page ids, a load its K/V loads wait on. A grid of one wave whose table rows have
at most `heuristics.TABLE_ROW_MAX` entries (`heuristics.table_row_plan`) instead loads the sequence's
whole row at each program's start, beside its length, and finds each block's page ids in registers
(`tl.gather`): the first K/V load waits for one memory round trip, not two, and the pipeline runs
ahead as the contiguous kernel's does (`heuristics.ROW_TILES`). Measured on an H200 (bf16, d = 128, 32/8
heads, page size 16, CUDA-graph replays, us, page-id loads -> table row, both on the paged tile; the
contiguous kernel): batch 1 at 1k keys 11.4 -> 10.5 (9.1-10.5), 4k 17.2 -> 15.9 (15.4), 8k 21.2 ->
19.6 (18.7), 16k 29.0 -> 27.9 (25.5); B = 64 at 4k 250.8 -> 248.6 (248.3); on the row tile, batch 1
at 32k 44.8 -> 42.1 (40.2). Many waves of short programs ran slower with the row (B = 256 at 1k: 254 ->
264.5), where the pipeline's own look-ahead at the page ids already hides them. Long programs gained in
more than one wave: cascade attention's prefix pass (B = 64 x 32 heads over a 32k prefix in pages of 64,
16 splits of 2048 keys, 128-row tiles) 121.7 -> 114.5 us, so it reads its row in any waves (`paged_plan`).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from .. import pdl, runtime
from ..checks import (
    KERNEL_DTYPES,
    AcceptedCalls,
    causal_alignment,
    check_cache_seqlens,
    check_dtype,
    check_int,
    check_kernel_device,
    check_lengths,
    check_tensor,
    default_scale,
    kernel_support,
    should_validate,
    tensors_key,
)
from ..kernels import bound, plans
from ..kernels.blocks import split_kv_range, visible_keys
from ..kernels.softmax import logsumexp, softmax_step
from ..pdl import allow_dependents
from ..runtime import tl, triton
from .combine import combine
from .heuristics import DecodePlan, decode_plan, longest_first, longest_first_block, many_rows_tile, tile_for
from .pack_gqa import packed_offsets, packed_rows
from .paged_lookup import kv_rows, table_row

runtime.require_triton()

DTYPES = KERNEL_DTYPES  # what the kernels take (`checks.kernel_support` is the rule, with the head dims)


@triton.jit
def split_kv_kernel(
    Q, K, V, BLOCK_TABLE, SEQLENS, O_PART, L_PART, qk_scale,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_tb, stride_tp,
    stride_os, stride_ob, stride_ot, stride_oh, stride_od,
    stride_ls, stride_lb, stride_lt, stride_lh,
    H_KV, T_Q, CAPACITY, NUM_SPLITS,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr, PAGED: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, SORT_B: tl.constexpr, PDL: tl.constexpr,
    TABLE_ROW: tl.constexpr = 0, FULL: tl.constexpr = False,
):  # fmt: skip
    """Partial (O, L) of one split of one (sequence, kv head) for one tile of (token, head) rows.

    PAGED=False: K, V are (B, Nmax, Hkv, d) caches; stride_kb steps sequences, stride_kn keys.
    PAGED=True: K, V are (num_pages, PAGE_SIZE, Hkv, d) pools; key j of sequence b lives in page
    BLOCK_TABLE[b, j // PAGE_SIZE] at slot j % PAGE_SIZE; stride_kb steps pages, stride_kn slots.
    qk_scale = softmax scale x log2(e): scores go straight into base 2.
    Grid (B * Hkv, NUM_SPLITS, M tiles), the last split of every (sequence, kv head) first (against the
    first split first: within +-5 us on an H200, the sign changing between machines). SORT_B > 0 (a
    sliced batch): the programs take their (sequence, kv head, split) longest sequence first instead
    (`longest_first`; SORT_B is the batch padded to a power of two).
    PDL: the combine may be scheduled as soon as every program here has stored its partial
    (`course_lib.pdl`). FULL: every sequence holds all CAPACITY keys; SEQLENS is never read.

    Each piece in its own file, beside this loop (FlashAttention-3's layout):
      the tile's rows, packed GQA          `pack_gqa.py`: packed_rows, packed_offsets
      the split's keys, the causal cut     `kernels/blocks.py`: split_kv_range (NUM_SPLITS a run-time value)
      the mask of a tile                   `kernels/blocks.py`: visible_keys
      where a block of keys lives          `paged_lookup.py`: table_row, kv_rows (contiguous or paged)
      the online softmax and its finish    `kernels/softmax.py`: softmax_step, logsumexp
      the order of the programs            `heuristics.py`: longest_first"""
    pid_bh = tl.program_id(0)
    split = tl.num_programs(1) - 1 - tl.program_id(1)  # the last splits launch first (docstring)
    pid_m = tl.program_id(2)
    b = (pid_bh // H_KV).to(tl.int64)
    kvh = (pid_bh % H_KV).to(tl.int64)
    if SORT_B > 0:  # a sliced batch: the longest sequences first (the length comes with the order)
        b, kvh, split, seqlen = longest_first(
            SEQLENS, tl.num_programs(0) // H_KV, CAPACITY, H_KV, NUM_SPLITS,
            tl.program_id(0) + tl.program_id(1) * tl.num_programs(0), SORT_B,
        )  # fmt: skip
    elif FULL:  # no lengths to load: the whole cache
        seqlen = CAPACITY
    else:
        # the wrappers check the lengths; the clamp keeps reads in bounds
        seqlen = tl.minimum(tl.load(SEQLENS + b), CAPACITY)

    if PAGED and TABLE_ROW > 0:  # the sequence's whole block-table row, loaded beside its length
        row = table_row(BLOCK_TABLE, b, stride_tb, stride_tp, CAPACITY // PAGE_SIZE, TABLE_ROW)
    else:  # none: `kv_rows` loads each block's page ids (or reads a contiguous cache)
        row = 0

    # Rows of the tile: (token t, head g of the group), r = t * GROUP + g; query head kvh * GROUP + g.
    t, h, row_ok, t_last = packed_rows(pid_m, kvh, T_Q, GROUP, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    # Q tile: HBM -> registers once, BLOCK_M x d.
    q_rows = packed_offsets(b, t, h, stride_qb, stride_qt, stride_qh)
    q = tl.load(
        Q + q_rows[:, None] + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)

    # This split's keys: whole BLOCK_N blocks [lo, hi), hi cut at the sequence's length and, causal,
    # after the tile's last token's last key: bottom-right, row t sees keys j <= seqlen - T_Q + t.
    offset = seqlen - T_Q
    lo, hi = split_kv_range(seqlen, offset, t_last, split, NUM_SPLITS, CAUSAL, BLOCK_N)

    # Running state in registers: row max m (base 2), row sum l, unnormalised output acc.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        col_ok = cols < hi
        # Where the block's keys live (a paged cache pays one page id per key).
        k_rows, v_rows = kv_rows(
            cols, col_ok, b, BLOCK_TABLE, row, stride_tb, stride_tp, stride_kb, stride_kn, stride_vb, stride_vn,
            PAGED, PAGE_SIZE, TABLE_ROW,
        )  # fmt: skip
        kv_mask = col_ok[:, None] & d_ok[None, :]
        # K block: HBM -> on chip, BLOCK_N x d elements of this kv head.
        k = tl.load(
            K + k_rows[:, None] + kvh * stride_kh + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0
        )
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N) fp32
        s = tl.where(visible_keys(t[:, None], cols[None, :], hi, offset, 0, CAUSAL, False), s, float("-inf"))
        p, alpha, l_i, m_i = softmax_step(s, m_i, l_i, qk_scale, True, True)  # s is scaled already
        acc = acc * alpha[:, None]
        # V block: HBM -> on chip; acc += P V in fp32.
        v = tl.load(
            V + v_rows[:, None] + kvh * stride_vh + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0
        )
        if UPCAST:
            v = v.to(tl.float32)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)

    # Partial result of this split: O = acc / l and L = m + log l, or (0, -inf) if it saw no key.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), logsumexp(m_i, l_safe))
    o_rows = packed_offsets(b, t, h, stride_ob, stride_ot, stride_oh)
    tl.store(
        O_PART + split * stride_os + o_rows[:, None] + offs_d[None, :] * stride_od,
        o.to(O_PART.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    l_rows = packed_offsets(b, t, h, stride_lb, stride_lt, stride_lh)
    tl.store(L_PART + split * stride_ls + l_rows, lse, mask=row_ok)
    if PDL:  # this program's partial is stored: the combine may be scheduled once every program is here
        allow_dependents()


# --------------------------------------------------------------------------------------------------
# Checks and the launch, shared with paged.py
# --------------------------------------------------------------------------------------------------
def check_query_and_lengths(
    q, cache_seqlens, kv_heads: int, head_dim: int, dtype, device, where: str, full: bool = False
):
    """Raise TypeError / ValueError naming the problem for q (B, Tq, Hq, d) and cache_seqlens (B,)
    (None with full: every sequence holds the whole cache)."""
    check_tensor(where, "q", q)
    if q.dim() != 4:
        raise ValueError(
            f"{where}: q must be (B, Tq, Hq, d) (tokens before heads); got shape {tuple(q.shape)}"
        )
    B, Tq, Hq, d = q.shape
    check_dtype(where, "q", q, KERNEL_DTYPES)
    if q.dtype != dtype:
        raise TypeError(f"{where}: q ({q.dtype}) and the K/V cache ({dtype}) must share one dtype")
    if q.device != device:
        raise ValueError(f"{where}: q is on {q.device} but the K/V cache is on {device}")
    if d != head_dim:
        raise ValueError(f"{where}: q has head dim {d}, the K/V cache {head_dim}")
    if problem := kernel_support(q.dtype, d):
        raise ValueError(f"{where}: {problem}")
    if kv_heads == 0 or Hq % kv_heads:
        raise ValueError(
            f"{where}: Hq={Hq} query heads must be a multiple of Hkv={kv_heads} kv heads (GQA); q {tuple(q.shape)}"
        )
    if Tq == 0:
        raise ValueError(f"{where}: q has no query token (Tq = 0); q {tuple(q.shape)}")
    check_kernel_device(where, q=q)
    if not (full and cache_seqlens is None):
        check_cache_seqlens(where, cache_seqlens, B, q.device)


def check_kv_pair(k, v, names: tuple[str, str], layout: str, where: str) -> None:
    """k and v: 4-D tensors of one shape, dtype and device (a contiguous cache or a page pool)."""
    for name, t in zip(names, (k, v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(
                f"{where}: {name} must be a {layout} tensor; got "
                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
            )
    if k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
        raise ValueError(
            f"{where}: {names[0]} and {names[1]} must match; got k {tuple(k.shape)} {k.dtype} "
            f"{k.device}, v {tuple(v.shape)} {v.dtype} {v.device}"
        )


def check_inference(where: str, **tensors: torch.Tensor) -> None:
    """Decoding has no backward: refuse inputs that ask for a gradient (grad mode on and one of them
    requires grad) rather than return an output that silently drops it."""
    if not torch.is_grad_enabled():
        return
    wanting = [name for name, t in tensors.items() if t.requires_grad]
    if wanting:
        raise RuntimeError(
            f"{where}: {', '.join(wanting)} require(s) grad, but decoding attention has no backward; run it "
            "under torch.no_grad() / torch.inference_mode(), or call course_lib.flash_attention to train"
        )


def normalise_causal(causal, where: str) -> bool:
    """The kernel's CAUSAL flag: True for True or 'bottom_right' (the decoding alignment), False for False
    (`checks.causal_alignment` with decoding's one alignment: 'top_left' makes no sense for new tokens at
    the end of a cache and is refused)."""
    return causal_alignment(causal, where, ("bottom_right",)) is not None


class SplitLaunch(NamedTuple):
    """A launch of `split_kv_kernel` planned from the shapes alone (`plan_launch`): its plan (tile, split
    count, sliced or not, table rows whole or not: `heuristics.DecodePlan`), the query tile's rows
    `block_m` and tiles per (sequence, kv head) `m_tiles`, and the kernel's flags."""

    plan: DecodePlan
    block_m: int
    m_tiles: int
    causal: bool
    page_size: int  # 0: a contiguous cache
    capacity: int
    full: bool

    @property
    def num_splits(self) -> int:
        """Splits of the grid: the partials it writes per (sequence, query token, head)."""
        return self.plan.num_splits


def plan_launch(
    q, k, block_table, *, page_size, capacity, causal, num_splits, full=False, where="decode", table_row=None
):  # fmt: skip
    """The `SplitLaunch` of q (B, Tq, Hq, d) over k (a cache or, with a block_table, a page pool); num_splits,
    None or an integer >= 1, is checked here (errors name `where`); table_row: `heuristics.decode_plan`'s
    (None: decoding's rule). Reads no tensor's values."""
    B, Tq, Hq, d = q.shape
    Hkv = k.shape[2]
    group = Hq // Hkv
    paged = block_table is not None
    many_rows = many_rows_tile(d, group * Tq, causal)  # a cascade's prefix pass: 128-row programs
    block_m = min((many_rows or tile_for(d, paged)).block_m_max, max(16, runtime.next_power_of_2(group * Tq)))
    m_tiles = runtime.cdiv(group * Tq, block_m)
    if num_splits is not None:
        num_splits = check_int(where, "num_splits", num_splits, 1)
        if num_splits > max(1, capacity):  # a split of no key is wasted work, and a huge count a huge buffer
            raise ValueError(
                f"{where}: num_splits={num_splits} is more than the cache holds keys ({capacity} per sequence); "
                "give at most that many, or None to choose"
            )
    width = block_table.shape[1] if paged else 0
    if B == 0:  # nothing to launch (the plan's wave arithmetic would divide by 0)
        plan = DecodePlan(tile_for(d, paged), num_splits or 1, False, False)
    else:
        plan = decode_plan(
            B, Hkv, m_tiles, capacity, d, paged, width, q.element_size(),
            num_splits, full, many_rows, table_row,
        )  # fmt: skip
    return SplitLaunch(plan, block_m, m_tiles, causal, page_size if paged else 0, capacity, full)


def write_partials(run: SplitLaunch, q, k, v, block_table, cache_seqlens, o_part, l_part, scale, pdl=False):
    """Launch `run`'s split-KV kernel: split s writes its partial (O, L) of every row into o_part[s]
    (B, Tq, Hq, d) and l_part[s] (B, Tq, Hq) float32, any strides (o_part float32; with one split it is the
    result itself, in any float dtype). The inputs are `launch`'s. pdl: a kernel launched next with PDL
    (`combine`) may be scheduled once every program has stored its partial."""
    B, Tq, Hq, d = q.shape
    Hkv = k.shape[2]
    if B == 0:
        return
    tile, num_splits, paged = run.plan.tile, run.plan.num_splits, block_table is not None
    # the kernel reads lengths[b] at SEQLENS + b; with full, none (any tensor stands in, never read)
    cache_seqlens = l_part if run.full else cache_seqlens.contiguous()
    table = block_table if paged else cache_seqlens  # any tensor: never read when PAGED=False
    table_strides = block_table.stride() if paged else (0, 0)
    scale = default_scale(d, scale)
    wide = q.dtype == torch.float32
    grid = (B * Hkv, num_splits, run.m_tiles)
    programs = B * Hkv * num_splits * run.m_tiles
    longest = run.plan.sliced and num_splits > 1 and not run.full
    sort_b = longest_first_block(B, programs, tile) if longest else 0
    width = block_table.shape[1] if paged else 0
    bound.launch(split_kv_kernel, grid,
        q, k, v, table, cache_seqlens, o_part, l_part, scale * 1.4426950408889634,
        *q.stride(), *k.stride(), *v.stride(), *table_strides, *o_part.stride(), *l_part.stride(),
        Hkv, Tq, run.capacity, num_splits,
        PAGE_SIZE=run.page_size or 1, GROUP=Hq // Hkv, CAUSAL=run.causal, PAGED=paged,
        HEAD_DIM=d, BLOCK_D=runtime.next_power_of_2(d), BLOCK_M=run.block_m, BLOCK_N=tile.block_n,
        UPCAST=bool(runtime.INTERPRET and q.dtype == torch.bfloat16),
        DOT_PRECISION="ieee" if wide else "tf32",
        SORT_B=sort_b, PDL=pdl, TABLE_ROW=runtime.next_power_of_2(width) if run.plan.table_row else 0,
        FULL=run.full, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip


def launch(
    q, k, v, block_table, cache_seqlens, *, page_size, capacity, causal, scale, num_splits, full=False,
    where: str = "decode",
):  # fmt: skip
    """Run the split-KV kernel (and the combine if S > 1); returns (out, lse). Inputs already checked
    (num_splits, None or an integer >= 1, is checked here; errors name `where`).

    k, v: (B, Nmax, Hkv, d) caches (block_table None) or (num_pages, page_size, Hkv, d) pools.
    full: every sequence holds all `capacity` keys (`heuristics.sliced`); cache_seqlens is then None
    (or holds `capacity` for every sequence) and is never read."""
    B, Tq, Hq, d = q.shape
    key = None
    if plans.ENABLED:  # a call seen before runs its plan (`CallPlan`)
        key = (
            plans.tensor_key(q), plans.tensor_key(k), plans.tensor_key(v), plans.tensor_key(block_table),
            plans.tensor_key(cache_seqlens), page_size, capacity, causal, type(scale), scale,
            type(num_splits), num_splits, full, plans.current_gpu(),
        )  # fmt: skip
        plan = plans.find(PLANS, key)
        if plan is not None:
            return plan.run(q, k, v, block_table, cache_seqlens)
    run = plan_launch(
        q, k, block_table, page_size=page_size, capacity=capacity, causal=causal, num_splits=num_splits,
        full=full, where=where,
    )  # fmt: skip
    out = torch.empty_like(q)
    lse = torch.empty((B, Tq, Hq), dtype=torch.float32, device=q.device)
    if B == 0:
        return out, lse
    num_splits = run.num_splits
    if num_splits == 1:
        o_part, l_part = out.unsqueeze(0), lse.unsqueeze(0)  # the one split writes the result itself
        tensors = dict(o_part=o_part, l_part=l_part)
    else:
        o_part = torch.empty((num_splits, B, Tq, Hq, d), dtype=torch.float32, device=q.device)
        l_part = torch.empty((num_splits, B, Tq, Hq), dtype=torch.float32, device=q.device)
        tensors = dict(o_part=o_part, l_part=l_part, out=out, lse=lse)
    tensors.update(q=q, k=k, v=v, table=block_table, lens=cache_seqlens)
    tensors = {name: t for name, t in tensors.items() if t is not None}
    use_pdl = num_splits > 1 and pdl.enabled(q.device)  # the combine is launched while the splits end
    with bound.recording(tensors) if key is not None else contextlib.nullcontext() as recorded:
        write_partials(run, q, k, v, block_table, cache_seqlens, o_part, l_part, scale, pdl=use_pdl)
        if num_splits > 1:
            combine(o_part, l_part, out, lse, pdl=use_pdl)
    launches = recorded.prepared() if recorded is not None and plans.on_current_device(q) else None
    if launches:
        plans.store(PLANS, key, CallPlan(launches, out, lse, o_part, l_part, num_splits))
    return out, lse


PLANS = plans.table()  # a decoding call's key (`launch`) -> its CallPlan


class CallPlan:
    """A split-KV call to repeat (`kernels.plans`): the split kernel's launch and the combine's (S > 1) with
    every non-tensor argument fixed, and the shapes of the result and the partials to allocate. `run(q, k, v,
    block_table, cache_seqlens)` gives (out, lse) as `launch` does, for a call with the same key."""

    __slots__ = ("launches", "lse_shape", "o_part_shape", "l_part_shape", "num_splits")

    def __init__(self, launches: tuple, out, lse, o_part, l_part, num_splits: int):
        self.launches, self.lse_shape, self.num_splits = launches, tuple(lse.shape), num_splits
        self.o_part_shape, self.l_part_shape = tuple(o_part.shape), tuple(l_part.shape)

    def run(self, q, k, v, block_table, cache_seqlens):
        out = torch.empty_like(q)
        lse = q.new_empty(self.lse_shape, dtype=torch.float32)
        tensors = dict(q=q, k=k, v=v, table=block_table, lens=cache_seqlens)
        if self.num_splits == 1:
            tensors.update(o_part=out.unsqueeze(0), l_part=lse.unsqueeze(0))
        else:
            o_part = q.new_empty(self.o_part_shape, dtype=torch.float32)
            l_part = q.new_empty(self.l_part_shape, dtype=torch.float32)
            tensors.update(o_part=o_part, l_part=l_part, out=out, lse=lse)
        for launch_ in self.launches:
            launch_(tensors)
        return out, lse


# kinds of calls `check_decode` accepted: 5.3 us of host time a call checked in full, 3.0 seen before (a 2-core CPU)
_DECODE_CALLS = AcceptedCalls()


def check_decode(q, k_cache, v_cache, cache_seqlens, where: str) -> None:
    """`decode_attention`'s checks of what the shapes, dtypes and devices say (no values read); a kind
    of call accepted before is accepted at once (`checks.AcceptedCalls`)."""
    key = tensors_key(q, k_cache, v_cache, cache_seqlens)
    if _DECODE_CALLS.seen(key):
        return
    check_kv_pair(k_cache, v_cache, ("k_cache", "v_cache"), "(B, Nmax, Hkv, d)", where)
    full = cache_seqlens is None  # every sequence holds the whole cache: no lengths to read
    check_query_and_lengths(
        q, cache_seqlens, k_cache.shape[2], k_cache.shape[3], k_cache.dtype, k_cache.device, where, full
    )
    check_inference(where, q=q, k_cache=k_cache, v_cache=v_cache)
    if k_cache.shape[0] != q.shape[0]:
        raise ValueError(f"{where}: q has batch {q.shape[0]}, k_cache {k_cache.shape[0]}")
    _DECODE_CALLS.add(key)


def decode_checked(q, k_cache, v_cache, cache_seqlens, causal, scale, num_splits, validate, where: str):
    """`decode_attention` after `check_decode`: the lengths' values checked (`should_validate`), then the
    kernels; returns (out, lse). The body of its operator too (`op.py`)."""
    full = cache_seqlens is None
    capacity = k_cache.shape[1]
    if not full and should_validate(validate, q.device):
        check_lengths(where, cache_seqlens, capacity)
    return launch(
        q, k_cache, v_cache, None, cache_seqlens,
        page_size=1, capacity=capacity, causal=normalise_causal(causal, where), scale=scale,
        num_splits=num_splits, full=full, where=where,
    )  # fmt: skip
