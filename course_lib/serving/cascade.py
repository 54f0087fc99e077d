"""Cascade attention: a batch whose sequences share a prefix reads the prefix once (notebook 14).

Paged decoding reads each sequence's whole cache: B sequences that share a P-token prefix read it B times.
Cascade attention (FlashInfer's cascade inference; vLLM v1 uses it from a 256-token common prefix) splits each
sequence's keys in two disjoint sets and merges the partial results with notebook 03's rule:

1. prefix: every query row of the batch, B * Tq of them, attends to the shared prefix's pages in ONE pass of the
   paged kernel: one K/V stream read once, many query rows against it (compute-friendly, like a prefill);
   no mask (the prefix lies wholly before every query). On a Hopper GPU, with the prefix gathered once for a
   group's steps, the pass is notebook 08c's warp-specialised forward over slices of it (`dense_prefix_pass`);
2. suffix: each sequence attends to its own pages with the paged decoding kernel, causal bottom-right (the
   queries are the last Tq tokens of the suffix);
3. the merge, over every part at once: each pass writes its splits' partial (O_s, L_s) into its slots of ONE
   float32 buffer (the prefix's S_p splits, then the suffix's S_s; with S_s = 1 the suffix's final state),
   and ONE launch of split-KV decoding's combine (`decode.combine`) takes L = log sum_s exp(L_s),
   O = sum_s exp(L_s - L) O_s over all S_p + S_s parts (`cascade_passes`).
On a GPU passes 1 and 2 run on two CUDA streams (`OVERLAP`): each may fill the SMs the other leaves idle; the
combine waits for both. The dense prefix pass's copies of the queries run before the fork, so that its kernel is
the side stream's first launch.

Bytes: paged decoding reads B (P + S) tokens of K and V; cascade reads P + B S. Checked against float64
attention over each full sequence (`cascade_reference`, tests/test_cascade.py).

The batcher's choice (`CascadeChoice`, a `kv_view` of `decode.ContinuousBatcher`): in a decode step, the largest
group of sequences whose block tables start with the same pages (shared by reference count: a cached prompt
prefix, a fork) takes cascade attention when the prefix re-reads it saves, (G - 1) x P tokens of K and V, reach
`CASCADE_MIN_SAVED_BYTES`; the other sequences, and every other step, take the paged kernel.
"""

from __future__ import annotations

import contextlib
import functools
import math

import numpy as np
import torch

from ..checks import check_block_table, check_cache_seqlens, check_int, check_tensor, should_validate
from ..decode import paged_decode_attention
from ..decode.combine import combine
from ..decode.paged import paged_plan
from ..decode.paged_kv import gather_tokens, to_device
from ..decode.split_kv import write_partials
from ..pdl import enabled as pdl_enabled
from ..runtime import sm_count

__all__ = [
    "CASCADE_MIN_SAVED_BYTES",
    "CascadeChoice",
    "CascadeKV",
    "cascade_decode_attention",
    "cascade_min_prefix",
    "cascade_passes",
    "cascade_reference",
    "dense_prefix_pass",
    "gather_prefix",
    "prefix_splits",
    "shared_prefix",
]

# Where cascade starts to win, from the cascade grid of bench/serving.py (H200, 2026-11-29; Hq = 32, Hkv = 8,
# d = 128, bf16: 4 KiB of K and V per token and layer, suffixes of 1024). Cascade's cost over paged decoding
# is a second pass and the merge; what it saves is the B - 1 extra reads of the prefix. The bench's
# `cascade_crossover` (log-interpolated between grid cells) put the crossing at (B - 1) x P = 9k tokens
# (B = 4) and 15k (B = 16), and at B = 64 cascade won from the grid's shortest prefix (1k), with the two passes
# side by side (`prefix_splits`); 18k / 28k / 70k with the record before, 76k and 84k at B = 16 and 64 before
# the 128-row prefix tile and the combine merge. So: cascade from 72k tokens of re-reads saved, 288 MiB per
# layer, above every crossing measured (at small B it would win earlier: the rule stays on the safe side).
CASCADE_MIN_SAVED_BYTES = 72 * 1024 * 4096


def _check(q, k_pages, prefix_pages, prefix_len, block_table, suffix_lens, where: str):
    check_tensor(where, "q", q)
    if q.dim() != 4:
        raise ValueError(f"{where}: q must be (B, Tq, Hq, d), got shape {tuple(q.shape)}")
    check_block_table(where, prefix_pages, name="prefix_pages", row=True)
    check_tensor(where, "block_table", block_table)  # the rest of it: paged_decode_attention's checks
    prefix_len = check_int(where, "prefix_len (tokens of the shared prefix)", prefix_len, 0)
    page_size = k_pages.shape[1]
    if not 0 < prefix_len <= prefix_pages.numel() * page_size:
        raise ValueError(
            f"{where}: prefix_len {prefix_len} must be in 1..{prefix_pages.numel() * page_size} "
            f"({prefix_pages.numel()} prefix pages of {page_size} tokens)"
        )
    check_cache_seqlens(where, suffix_lens, q.shape[0], None, name="suffix_lens")
    if should_validate(False, suffix_lens.device) and bool((suffix_lens < q.shape[1]).any()):  # the CPU: free
        raise ValueError(
            f"{where}: every suffix must hold at least the Tq = {q.shape[1]} query tokens (they are its last "
            f"tokens), got suffix_lens {suffix_lens.tolist()}"
        )


def cascade_decode_attention(
    q, k_pages, v_pages, prefix_pages, prefix_len: int, block_table, suffix_lens, scale=None, num_splits=None,
    *, validate: bool = True, prefix_kv=None,
):  # fmt: skip
    """Decoding attention of B sequences that share a prefix, the prefix read once.

    q (B, Tq, Hq, d): the last Tq tokens of each sequence; k_pages, v_pages (num_pages, page_size, Hkv, d): the
    paged cache; prefix_pages (P_pages,) int32: the pages of the shared prefix, whose first prefix_len tokens are
    the prefix; block_table (B, max_pages) int32 and suffix_lens (B,) int32 (each >= Tq): each sequence's own
    tokens after the prefix, as `paged_decode_attention` takes them. Sequence b is prefix + its suffix; query t
    of it sees the whole prefix and suffix keys j <= suffix_lens[b] - Tq + t. Returns out (B, Tq, Hq, d) in q's
    dtype. Not differentiable (serving). validate: as `paged_decode_attention`'s (False: no sync per call, for a
    batcher whose cache built the tables). Three launches (`cascade_passes`): the prefix pass and the suffix
    pass, on two streams with `OVERLAP`, then the one combine once both are done. prefix_kv: None, or the
    prefix's K and V gathered once (`gather_prefix`), which a Hopper GPU's prefix pass reads with the
    warp-specialised forward (`dense_prefix_pass`)."""
    side = side_stream(q.device) if OVERLAP else None
    prefix, suffix, merge, out = cascade_passes(
        q, k_pages, v_pages, prefix_pages, prefix_len, block_table, suffix_lens, scale, num_splits,
        validate=validate, pdl=side is None and pdl_enabled(q.device), prefix_kv=prefix_kv,
    )  # fmt: skip
    staged = getattr(prefix, "stage", None)
    if staged is not None:  # the dense prefix pass's copies of the queries, before the fork (`_DensePrefix`)
        staged()
    if side is not None:  # the prefix pass (compute-bound) beside the suffix pass (bandwidth-bound)
        main = torch.cuda.current_stream(q.device)
        side.wait_stream(main)  # the buffers, made on this stream, are ready before the side writes them
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        prefix(staged=staged is not None)
    suffix()
    if side is not None:
        main.wait_stream(side)  # the combine reads both passes' partials; nothing made on the side stream
    merge()
    return out


def cascade_passes(
    q, k_pages, v_pages, prefix_pages, prefix_len: int, block_table, suffix_lens, scale=None, num_splits=None,
    *, validate: bool = True, pdl: bool = False, prefix_kv=None,
):  # fmt: skip
    """`cascade_decode_attention`'s arguments checked and its three launches planned, not run:
    (prefix, suffix, merge, out), three functions of no argument and the output (B, Tq, Hq, d) in q's dtype
    that merge() fills. Each pass writes its splits' partial (O, L) into its own slots of ONE buffer
    (S_p + S_s, B, Tq, Hq, d) float32 and (S_p + S_s, B, Tq, Hq) float32, in memory (S, Hq, B x Tq, d) and
    (S, Hq, B x Tq) (S_p splits of the prefix pass first, its B x Tq query rows laid out as (B, Tq); then the
    suffix pass's S_s, its final (O, L) when S_s = 1), and merge() is ONE `combine` of all S_p + S_s parts: no
    stacked copy, no second pass over O.
    merge() must run after both passes. pdl: the combine is launched with PDL, for a caller that runs the
    three in this order on one stream (the suffix pass then lets the combine be scheduled early).
    `scripts/serving_probe.py` times the three one by one.

    The prefix pass reads its block-table row whole (`paged_plan`'s table_row=True), though its grid is more
    than one wave, where decoding's rule would look up page ids block by block: that rule was measured on
    short programs, and the prefix pass's are long (2048 keys each at 32k and 16 splits). Measured on an
    H200 (B = 64 queries x 32 heads, 8 K/V heads, d = 128, a 32k-token prefix in pages of 64, bf16, graph
    replays, `scripts/prefix_gap.py`): 121.7 us with page-id loads, 114.5 with the row (16 splits and
    128-row programs both)."""
    where = "cascade_decode_attention"
    _check(q, k_pages, prefix_pages, prefix_len, block_table, suffix_lens, where)
    B, Tq, Hq, d = q.shape
    rows = q.reshape(1, B * Tq, Hq, d)  # every query of the batch: one multi-query pass over the prefix
    prefix_table = prefix_pages.view(1, -1)
    prefix_len_t = torch.full(
        (1,), prefix_len, dtype=torch.int32, device=q.device
    )  # a fill: graph-capturable
    dense = None if prefix_kv is None else dense_prefix_pass(q, prefix_kv, prefix_len, scale)
    if dense is None:
        prefix_run = paged_plan(
            rows, k_pages, v_pages, prefix_table, prefix_len_t, False, num_splits, validate, where, table_row=True
        )  # fmt: skip
    suffix_run = paged_plan(q, k_pages, v_pages, block_table, suffix_lens, True, num_splits, validate, where)
    s_p, s_s = (prefix_run.num_splits if dense is None else dense.splits), suffix_run.num_splits
    # the partials in memory as (S, Hq, B * Tq, d), read as (S, B, Tq, Hq, d): the dense prefix pass's kernel
    # writes its slots as they are (`_DensePrefix`); the split-KV kernel and the combine take any strides
    o_buf = torch.empty((s_p + s_s, Hq, B * Tq, d), dtype=torch.float32, device=q.device)
    l_buf = torch.empty((s_p + s_s, Hq, B * Tq), dtype=torch.float32, device=q.device)
    o_part = o_buf.view(s_p + s_s, Hq, B, Tq, d).permute(0, 2, 3, 1, 4)
    l_part = l_buf.view(s_p + s_s, Hq, B, Tq).permute(0, 2, 3, 1)
    out = torch.empty_like(q)
    lse = torch.empty((B, Tq, Hq), dtype=torch.float32, device=q.device)

    def prefix(staged: bool = False):
        if dense is not None:
            dense(o_buf[:s_p], l_buf[:s_p], staged=staged)
            return
        write_partials(
            prefix_run, rows, k_pages, v_pages, prefix_table, prefix_len_t,
            o_part[:s_p].view(s_p, 1, B * Tq, Hq, d), l_part[:s_p].view(s_p, 1, B * Tq, Hq), scale,
        )  # fmt: skip

    def suffix():
        write_partials(
            suffix_run, q, k_pages, v_pages, block_table, suffix_lens, o_part[s_p:], l_part[s_p:], scale,
            pdl=pdl,
        )  # fmt: skip

    def merge():
        # notebook 09's combine of split partials over both passes' splits (the merge of attention.merge in
        # PyTorch ops took 35 us here on an H200 at B = 64, Hq = 32, d = 128; a combine of the two passes'
        # results after each pass's own, 209 us a step in all); COMBINE_ROWS rows a program over few slots
        rows = COMBINE_ROWS if not pdl and s_p + s_s <= COMBINE_ROWS_SLOTS else None
        combine(o_part, l_part, out, lse, pdl=pdl, rows_per_program=rows)

    if dense is not None:
        prefix.stage = dense.stage
    return prefix, suffix, merge, out


def gather_prefix(
    k_pages, v_pages, prefix_pages, prefix_len: int, splits: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared prefix's K and V gathered from its pages once, each (S, Hkv, prefix_len / S, d) contiguous: its
    tokens cut into S = splits slices (`prefix_splits`), slice-major (slice s holds tokens s * prefix_len / S
    ...). What a group's decode steps read in `dense_prefix_pass`, as S x Hkv heads of K/V (prefix_pages
    (P_pages,) int32, on the pools' device). A prefix's full pages do not change while they are shared, so one
    gather serves every step of the group."""
    splits = check_int("gather_prefix", "splits", splits, 1)
    if prefix_len % splits:
        raise ValueError(f"gather_prefix: splits {splits} must divide prefix_len {prefix_len}")

    def one(pool):
        rows = gather_tokens(pool, prefix_pages, prefix_len)  # (P, Hkv, d)
        return rows.view(splits, prefix_len // splits, *rows.shape[1:]).transpose(1, 2).contiguous()

    return one(k_pages), one(v_pages)


def prefix_splits(q: torch.Tensor, pool: torch.Tensor, prefix_len: int, sms: int | None = None) -> int:
    """How many slices `gather_prefix` cuts a shared prefix into for `dense_prefix_pass`, whose warp-specialised
    forward has no split of its own: the slices are read as S x Hkv K/V heads, each with its own copy of the
    queries (B x Tq x Hq / Hkv rows per K/V head), and their (O, L) join the combine as the paged pass's splits
    do. The most slices, a power of 2 dividing prefix_len, whose tiles of 128 query rows, S x Hkv x
    ceil(rows / 128), take at most half the SMs (`sms`, default the GPU's; 1 off CUDA): the suffix pass, on the
    other stream, takes the other half at the same time. q (B, Tq, Hq, d); pool (num_pages, page_size, Hkv, d).

    Measured on an H200 (`scripts/serving_probe.py --dense-prefix`: 32 / 8 heads, d = 128, pages of 64, own
    suffixes of 1024, bf16, graph replays, 2026-11-29), the step on two streams in us by slices (2 / 4 / 8 / 16),
    the pick in brackets, 64 tiles in each: B = 64, 32k: 225.5 / [134.3] / 150.5 / 165.5; B = 64, 16k: 133.9 /
    [126.3] / 126.7 / 141.0; B = 128, 32k: [238.6] / 267.5 / 277.5 / 297.8; B = 128, 16k: [198.5] / 216.6 /
    227.5 / 248.2. The paged prefix pass's steps: 190.9, 144.8, 339.1, 251.5. With all 128 tiles on the GPU
    (B = 64, 32k, 8 slices) the suffix pass waited for the prefix pass: 150.5 us, both one after the other."""
    if sms is None:
        sms = sm_count(pool.device.index) if pool.device.type == "cuda" else 1
    B, Tq, Hq, _ = q.shape
    hkv = pool.shape[2]
    tiles = hkv * -(-(B * Tq * Hq // hkv) // 128)  # of one slice
    splits = 1
    while (
        prefix_len % (2 * splits) == 0
        and 2 * splits * tiles <= sms // 2
        and prefix_len // (2 * splits) >= 128
    ):
        splits *= 2
    return splits


# The fewest query rows per K/V head (B x Tq x Hq / Hkv) for the dense prefix pass: its tiles hold 128 rows, and
# fewer rows leave them part empty. Measured in the serving bench (H200, 16k prefix, graph replays, us, paged
# prefix pass / dense): B = 4 (16 rows) 33.6 / 62.5, B = 16 (64 rows) 55.6 / 76.7, B = 64 (256 rows) 146.2 / 139.6.
DENSE_PREFIX_MIN_ROWS = 256


class _DensePrefix:
    """`dense_prefix_pass`'s plan, its buffers made once: called with the prefix's slots of the partial buffers
    in memory (o (S, Hq, B x Tq, d) fp32, l (S, Hq, B x Tq) fp32), it copies the queries once per slice
    (`stage`, unless staged=True: `cascade_decode_attention` runs it before the fork) and runs the Gluon forward
    over the slices as K/V heads, which writes its (O, L) straight into those slots: one copy, one launch.

    Measured on an H200 (B = 64, 32k prefix, 8 slices, graph replays, 2026-11-29; `scripts/serving_probe.py
    --dense-prefix`): the queries staged before the fork, the step 164.5 -> 156.8 us (the kernel was queued
    behind a copy while the suffix pass's programs took every SM); O and L written in place, where two copies
    permuted them before, the prefix pass 87.0 -> 70.5 us and the step 150.0. Then half the SMs' worth of tiles
    (`prefix_splits`: 4 slices here) let the suffix pass run beside it: 134.3. A smaller persistent grid on the
    128 tiles of 8 slices (64-112 programs) took two rounds (prefix pass 87 -> 134-136 us; step 156-159 us,
    before the in-place write), and the side stream at a higher priority changed nothing (the probe:
    `serving_probe.py --partition` at commit 011d203)."""

    def __init__(self, q, k, v, variant, scale: float):
        B, Tq, Hq, d = q.shape
        splits, hkv, p = k.shape[:3]
        self.q, self.splits, self.variant, self.scale = q, splits, variant, scale
        # K/V head (s, h) of the kernel is slice s of K/V head h; its query rows are the group's query heads, each
        # over every query of the batch: (query head in the group, query row). Slice-major, so that its O is the
        # partials' memory order (S, Hq, B x Tq, d) as `cascade_passes` lays them out.
        self.rows = (Hq // hkv) * B * Tq
        self.q4 = torch.empty((1, splits * hkv, self.rows, d), dtype=q.dtype, device=q.device)
        self.k4, self.v4 = k.view(1, splits * hkv, p, d), v.view(1, splits * hkv, p, d)

    def stage(self) -> None:
        """The queries' copies, one per slice: (slice, query head, query row, d)."""
        bt, hq, d = self.q.shape[0] * self.q.shape[1], self.q.shape[2], self.q.shape[3]
        shape = (self.splits, hq, bt, d)
        self.q4.view(shape).copy_(self.q.view(bt, hq, d).transpose(0, 1).expand(shape))

    def __call__(self, o_buf, l_buf, staged: bool = False) -> None:
        """o_buf (S, Hq, B x Tq, d) and l_buf (S, Hq, B x Tq), float32, contiguous: written by the kernel itself."""
        from ..attention import hopper

        if not staged:
            self.stage()
        heads, d = self.q4.shape[1], self.q4.shape[3]
        hopper.forward(
            self.q4, self.k4, self.v4, o_buf.view(1, heads, self.rows, d), l_buf.view(1, heads, self.rows), False,
            self.scale, self.variant,
        )  # fmt: skip


def dense_prefix_possible(pool: torch.Tensor) -> bool:
    """Whether `dense_prefix_pass` can run on a cache whose pages are `pool` (num_pages, page_size, Hkv, d): a
    Hopper GPU with Gluon, a dtype and head dim the kernel has. Where not, `CascadeChoice` gathers no prefix."""
    from ..attention import forward as attention_forward

    if pool.device.type != "cuda" or attention_forward.hopper_kernels() is None:
        return False
    from ..attention import hopper

    if pool.dtype not in hopper.DTYPES or pool.shape[-1] not in hopper.HEAD_DIMS:
        return False
    return hopper.capability(pool.device.index)[0] == 9


def dense_prefix_pass(q, prefix_kv, prefix_len: int, scale=None) -> _DensePrefix | None:
    """The prefix pass with the warp-specialised Gluon forward (`attention.hopper`, notebook 08c) over the
    prefix gathered once (`gather_prefix`), on a Hopper GPU: every query row of the batch (q (B, Tq, Hq, d))
    against the slices `gather_prefix` cut the prefix into, no mask. None where it does not apply (not a Hopper GPU,
    a dtype or head dim the kernel lacks, fewer than DENSE_PREFIX_MIN_ROWS query rows per K/V head, prefix_kv not
    this prefix, or a shape where `hopper.choose` found the Triton kernel faster): the caller keeps the paged
    prefix pass."""
    k, v = prefix_kv
    if k.dim() != 4 or v.shape != k.shape or k.shape[3] != q.shape[3]:
        raise ValueError(
            f"dense_prefix_pass: prefix_kv must be gather_prefix's (K, V), each (S, Hkv, prefix_len / S, d) with q's "
            f"d = {q.shape[3]}, got shapes {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[0] * k.shape[2] != prefix_len or not dense_prefix_possible(k):
        return None
    from ..attention import hopper

    B, Tq, Hq, d = q.shape
    rows = B * Tq * Hq // k.shape[1]  # query rows per K/V head
    if rows < DENSE_PREFIX_MIN_ROWS or not hopper.supports(q, k, v):
        return None
    variant = hopper.choose(d, False, rows, k.shape[2])
    if variant is None:
        return None
    return _DensePrefix(q, k, v, variant, 1 / math.sqrt(d) if scale is None else scale)


# Rows a program of the merge (`decode.combine`'s `combine_rows_kernel`) where it has at most COMBINE_ROWS_SLOTS
# slots of partials and is not launched with PDL; else one program a row. Graph replays on an H200 (2026-12-01): the
# bench's step at B = 64, Hq = 32, d = 128 (the dense prefix pass's 4 slots and 1 of the suffix), the combine alone,
# one program a row 11.5 us; 4, 8, 16, 32 rows a program 8.3, 9.3, 11.3, 13.0 us (the slots in turn); the bench's
# cascade step 132.4 -> 128.0 and 128.3 us (two runs). 4 rows with the slots loaded at once (`combine.SLOTS_AT_ONCE`):
# 7.0 us alone, the step 127.7 -> 127.5 us (the passes set it). With 4 rows a program over the paged prefix pass's
# many splits (B = 4 and 16) every step was slower: B = 4, 16k 33.3 -> 44.5 us, B = 16, 4k 43.1 -> 58.2 us (the
# slots in turn); 45.4 / 59.3 with them at once where they fit, 36.2 / 46.4 loaded at once however many.
COMBINE_ROWS = 4
COMBINE_ROWS_SLOTS = 8

# The prefix and suffix passes on two CUDA streams, so that one's programs fill the SMs the other leaves idle
# (its last wave, its tail); under CUDA-graph capture the fork and join are captured too.
OVERLAP = True


@functools.cache
def side_stream(device: torch.device):
    """A second CUDA stream of `device` for the prefix pass (None off CUDA): one per device, made once."""
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device=device)


def cascade_min_prefix(batch: int, token_bytes: int) -> int:
    """The shortest shared prefix, in tokens, from which `batch` sequences take cascade attention: the prefix
    re-reads it saves, (batch - 1) x prefix x token_bytes (K and V of one token in one layer), reach
    CASCADE_MIN_SAVED_BYTES. The capstone-shaped model of the serving bench (Hkv = 4, d = 64, bf16: 1 KiB a
    token) needs a 42 131-token prefix at batch 8 and 4 682 at batch 64."""
    batch = check_int("cascade_min_prefix", "batch", batch, 2)
    token_bytes = check_int("cascade_min_prefix", "token_bytes", token_bytes, 1)
    return -(-CASCADE_MIN_SAVED_BYTES // ((batch - 1) * token_bytes))


def shared_prefix(cache, seq_ids) -> tuple[list[int], list[int]]:
    """(members, pages): the largest group of sequences `seq_ids` of `cache` (a `decode.cache.PagedKVCache`) whose
    block tables start with the same page, as indices into seq_ids, and the pages they all start with, up to
    the last full page before each member's last token (so every member keeps at least one token of its own).
    ([], []) when no two sequences start on the same page."""
    groups: dict[int, list[int]] = {}
    for b, seq_id in enumerate(seq_ids):
        pages = cache.seqs[seq_id].pages
        if pages:
            groups.setdefault(pages[0], []).append(b)
    members = max(groups.values(), key=len, default=[])
    if len(members) < 2:
        return [], []
    seqs = [cache.seqs[seq_ids[b]] for b in members]
    limit = min((s.length - 1) // cache.page_size for s in seqs)
    rows = [s.pages[:limit] for s in seqs]
    low, high = min(rows), max(rows)  # what all rows share, the first and the last in list order share
    n = next((i for i, (a, b) in enumerate(zip(low, high)) if a != b), limit)
    return members, rows[0][:n]


def _table(rows: list[list[int]]) -> np.ndarray:
    table = np.zeros((len(rows), max([len(r) for r in rows] + [1])), dtype=np.int32)
    for b, r in enumerate(rows):
        table[b, : len(r)] = r
    return table


class CascadeKV:
    """A decode step's view of the paged cache (the `attend` of `decode.paged_kv.PagedKV`) in which the sequences
    `members` (indices into seq_ids) share the pages `prefix_pages` and take `cascade_decode_attention`; the
    others take the paged kernel. One new token per sequence; its K/V go to `slots` (B,), on the host as the
    batcher gives them. Its tensors reach the GPU in one copy that does not wait (`decode.paged_kv.to_device`;
    one by one, 8 copies that each waited for the GPU)."""

    def __init__(
        self, cache, seq_ids: list[int], members: list[int], prefix_pages: list[int], slots, store=None
    ):
        # None, or {layer: the prefix gathered} that `CascadeChoice` keeps for the group's steps
        self.store = store
        size = cache.page_size
        self.cache, self.batch = cache, len(seq_ids)
        self.prefix_len = len(prefix_pages) * size
        seqs = [cache.seqs[seq_ids[b]] for b in members]
        suffix_table = _table([s.pages[len(prefix_pages) :] for s in seqs])
        suffix_lens = np.asarray([s.length - self.prefix_len for s in seqs], dtype=np.int32)
        arrays = [slots.numpy(), np.asarray(prefix_pages, dtype=np.int32), suffix_table, suffix_lens]
        rest = sorted(set(range(self.batch)) - set(members))
        if rest:  # part of the batch: cascade rows and paged rows gathered, then put back in place
            others = [seq_ids[b] for b in rest]
            arrays += [np.asarray(members, dtype=np.int64), np.asarray(rest, dtype=np.int64)]
            arrays += [cache.block_table_array(others), cache.seqlens_array(others)]
        if cache.device.type == "cpu":  # once for every layer, as `PagedKV` (on a GPU never read)
            cache.check_slots(slots)
        tensors = to_device(arrays, cache.device)
        self.slots, self.prefix_pages, self.suffix_table, self.suffix_lens = tensors[:4]
        self.members = self.rest = None
        if rest:
            self.members, self.rest, self.rest_table, self.rest_lens = tensors[4:]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write k, v (B, Hkv, d) into layer `layer`'s pages, then attend: q (B, Hq, d) -> o (B, Hq, d)."""
        self.cache.write(layer, self.slots, k, v, validate=False)  # checked once a step (`__init__`)
        k_pages, v_pages = self.cache.k_pages[layer], self.cache.v_pages[layer]
        shared = q if self.members is None else q[self.members]
        prefix_kv = None
        if self.store is not None:
            prefix_kv = self.store.get(layer)
            if prefix_kv is None:  # the group's first step: the prefix gathered for the steps that follow
                splits = prefix_splits(shared.unsqueeze(1), k_pages, self.prefix_len)
                gathered = gather_prefix(k_pages, v_pages, self.prefix_pages, self.prefix_len, splits)
                prefix_kv = self.store[layer] = gathered
        o_shared = cascade_decode_attention(
            shared.unsqueeze(1), k_pages, v_pages, self.prefix_pages, self.prefix_len, self.suffix_table,
            self.suffix_lens, validate=False, prefix_kv=prefix_kv,
        ).squeeze(1)  # fmt: skip
        if self.members is None:
            return o_shared
        o = torch.empty_like(q)
        o[self.members] = o_shared
        if self.rest is not None:
            o[self.rest] = paged_decode_attention(
                q[self.rest].unsqueeze(1), k_pages, v_pages, self.rest_table, self.rest_lens, validate=False
            ).squeeze(1)
        return o


class CascadeChoice:
    """A `kv_view` for `decode.ContinuousBatcher` (notebook 14): in a step where every sequence decodes one token,
    the `shared_prefix` group takes cascade attention when its shared prefix holds at least `min_prefix` tokens
    (None: `cascade_min_prefix` for the group's size and the cache's bytes per token, the measured crossover);
    every other step gets None (the batcher's paged view). `steps` counts the steps it took cascade in.

    On a Hopper GPU the group's prefix is gathered once per layer at its first cascade step and kept while the
    group's steps last (`gather_prefix`, `dense_prefix_pass`: one more copy of the prefix's K and V per layer);
    a step that takes no cascade, or another prefix, drops it (a page freed since may hold other tokens)."""

    def __init__(self, min_prefix: int | None = None):
        if min_prefix is not None:
            min_prefix = check_int("CascadeChoice", "min_prefix", min_prefix, 1)
        self.min_prefix = min_prefix
        self.steps = 0
        self._key, self._store = None, None  # the prefix's pages and, per layer, the prefix gathered

    def threshold(self, cache, group: int) -> int:
        """The shortest shared prefix, in tokens, for which a group of `group` sequences of `cache` takes cascade."""
        if self.min_prefix is not None:
            return self.min_prefix
        pool = cache.k_pages[0]
        return cascade_min_prefix(group, 2 * pool[0, 0].numel() * pool.element_size())

    def __call__(self, cache, seq_ids: list[int], new_lens: list[int], slots) -> CascadeKV | None:
        view = self._choose(cache, seq_ids, new_lens, slots)
        if view is None:
            self._key, self._store = None, None
        return view

    def _choose(self, cache, seq_ids, new_lens, slots) -> CascadeKV | None:
        if len(seq_ids) < 2 or any(n != 1 for n in new_lens):
            return None
        members, pages = shared_prefix(cache, seq_ids)
        if len(members) < 2 or len(pages) * cache.page_size < self.threshold(cache, len(members)):
            return None
        self.steps += 1
        store = None
        if dense_prefix_possible(cache.k_pages[0]):
            if self._key != tuple(pages):
                self._key, self._store = tuple(pages), {}
            store = self._store
        return CascadeKV(cache, seq_ids, members, pages, slots, store)


def cascade_reference(q, k_pages, v_pages, prefix_pages, prefix_len, block_table, suffix_lens, scale=None):
    """The same attention in float64 over each full sequence (prefix then suffix gathered from the pages), with
    Hq / Hkv query heads per K/V head and the bottom-right causal mask: (B, Tq, Hq, d) float64."""
    B, Tq, Hq, d = q.shape
    page_size, Hkv = k_pages.shape[1], k_pages.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale

    def gather(pages, table, n):
        idx = torch.arange(n)
        return pages[table.long().cpu()[idx // page_size], idx % page_size].double()  # (n, Hkv, d)

    out = torch.empty(B, Tq, Hq, d, dtype=torch.float64)
    k_all, v_all = k_pages.cpu(), v_pages.cpu()
    for b in range(B):
        n_s = int(suffix_lens[b])
        k = torch.cat([gather(k_all, prefix_pages, prefix_len), gather(k_all, block_table[b], n_s)])
        v = torch.cat([gather(v_all, prefix_pages, prefix_len), gather(v_all, block_table[b], n_s)])
        k = k.repeat_interleave(Hq // Hkv, dim=1)  # (N, Hq, d)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
        s = torch.einsum("thd,nhd->htn", q[b].cpu().double(), k) * scale  # (Hq, Tq, N)
        n = k.shape[0]
        visible = torch.arange(n)[None, :] <= (n - Tq + torch.arange(Tq))[:, None]
        s = s.masked_fill(~visible, float("-inf"))
        out[b] = torch.einsum("htn,nhd->thd", torch.softmax(s, dim=-1), v)
    return out
