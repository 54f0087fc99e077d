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
combine waits for both.

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
from ..decode.paged_kv import to_device
from ..decode.split_kv import write_partials
from ..pdl import enabled as pdl_enabled

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
    "shared_prefix",
]

# Where cascade starts to win, from the cascade grid of bench/serving.py (H200, 2026-11-29; Hq = 32, Hkv = 8,
# d = 128, bf16: 4 KiB of K and V per token and layer, suffixes of 1024). Cascade's cost over paged decoding
# is a second pass and the merge; what it saves is the B - 1 extra reads of the prefix. The bench's
# `cascade_crossover` (log-interpolated between grid cells) put the crossing at (B - 1) x P = 18k tokens
# (B = 4), 28k (B = 16) and 70k (B = 64) with this round's kernels (76k and 84k at B = 16 and 64 before the
# 128-row prefix tile and the combine merge). So: cascade from 72k tokens of re-reads saved, 288 MiB per layer,
# above every crossing measured (at small B it would win earlier: the rule stays on the safe side).
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
    if side is not None:  # the prefix pass (compute-bound) beside the suffix pass (bandwidth-bound)
        main = torch.cuda.current_stream(q.device)
        side.wait_stream(main)  # the buffers, made on this stream, are ready before the side writes them
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        prefix()
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
    (S_p + S_s, B, Tq, Hq, d) float32 and (S_p + S_s, B, Tq, Hq) float32 (S_p splits of the prefix pass
    first, its B x Tq query rows laid out as (B, Tq); then the suffix pass's S_s, its final (O, L) when
    S_s = 1), and merge() is ONE `combine` of all S_p + S_s parts: no stacked copy, no second pass over O.
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
    o_part = torch.empty((s_p + s_s, B, Tq, Hq, d), dtype=torch.float32, device=q.device)
    l_part = torch.empty((s_p + s_s, B, Tq, Hq), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    lse = torch.empty((B, Tq, Hq), dtype=torch.float32, device=q.device)

    def prefix():
        if dense is not None:
            dense(o_part[:s_p], l_part[:s_p])
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
        # results after each pass's own, 209 us a step in all)
        combine(o_part, l_part, out, lse, pdl=pdl)

    return prefix, suffix, merge, out


def gather_prefix(k_pages, v_pages, prefix_pages, prefix_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared prefix's K and V, each (Hkv, prefix_len, d) contiguous, gathered from its pages once: what a
    group's decode steps read in `dense_prefix_pass` (prefix_pages (P_pages,) int32, on the pools' device). A
    prefix's full pages do not change while they are shared, so one gather serves every step of the group."""

    def one(pool):
        return pool.index_select(0, prefix_pages).flatten(0, 1)[:prefix_len].transpose(0, 1).contiguous()

    return one(k_pages), one(v_pages)


# Splits of the prefix in `dense_prefix_pass`: the warp-specialised forward has no split of its own, so the
# prefix's keys are cut into DENSE_PREFIX_SPLITS slices read as that many K/V heads, each with its own copy of
# the queries (B x Tq x Hq / Hkv rows per K/V head: 256 at B = 64, 32 / 8 heads), and the slices' (O, L) join the
# combine as the paged pass's splits do. Measured on an H200 (`scripts/serving_probe.py --dense-prefix`: B = 64,
# 32 / 8 heads, d = 128, a 32k prefix in pages of 64, S = 1024, bf16, graph replays, 2026-11-29): 8 slices, the
# prefix pass 86.8 us and the step 164.5 us on two streams; 16: 108.2 / 188.2; 32: 147.7 / 234.4; the paged
# prefix pass's step 191.3. Gathering the prefix took 241 us, once for the group's steps.
DENSE_PREFIX_SPLITS = 8
# The fewest query rows per K/V head (B x Tq x Hq / Hkv) for the dense prefix pass: its tiles hold 128 rows, and
# fewer rows leave them part empty. Measured in the serving bench (H200, 16k prefix, graph replays, us, paged
# prefix pass / dense): B = 4 (16 rows) 33.6 / 62.5, B = 16 (64 rows) 55.6 / 76.7, B = 64 (256 rows) 146.2 / 139.6.
DENSE_PREFIX_MIN_ROWS = 256


class _DensePrefix:
    """`dense_prefix_pass`'s plan, its buffers made once: called with the prefix's slots of the partial buffers
    (o (S, B, Tq, Hq, d) fp32, l (S, B, Tq, Hq) fp32), it copies the queries once per slice, runs the Gluon
    forward over the slices as K/V heads, and permutes its (O, L) into those slots (three copies, one launch)."""

    def __init__(self, q, k, v, splits: int, variant, scale: float):
        B, Tq, Hq, d = q.shape
        hkv, p = k.shape[0], k.shape[1]
        self.q, self.splits, self.variant, self.scale = q, splits, variant, scale
        # the queries' copies: (K/V head, slice, query head within the group, query row, d)
        self.shape = (hkv, splits, Hq // hkv, B * Tq, d)
        rows = self.shape[2] * self.shape[3]
        self.q4 = torch.empty((1, hkv * splits, rows, d), dtype=q.dtype, device=q.device)
        self.k4 = k.view(1, hkv * splits, p // splits, d)
        self.v4 = v.view(1, hkv * splits, p // splits, d)
        self.o4 = torch.empty_like(self.q4)
        self.l3 = torch.empty((1, hkv * splits, rows), dtype=torch.float32, device=q.device)

    def __call__(self, o_part, l_part) -> None:
        from ..attention import hopper

        hkv, splits, g, bt, d = self.shape
        self.q4.view(self.shape).copy_(
            self.q.view(bt, hkv, g, d).permute(1, 2, 0, 3).unsqueeze(1).expand(self.shape)
        )
        hopper.forward(self.q4, self.k4, self.v4, self.o4, self.l3, False, self.scale, self.variant)
        o_part.view(splits, bt, hkv, g, d).copy_(self.o4.view(self.shape).permute(1, 3, 0, 2, 4))
        l_part.view(splits, bt, hkv, g).copy_(self.l3.view(self.shape[:4]).permute(1, 3, 0, 2))


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
    against DENSE_PREFIX_SPLITS slices of the prefix, no mask. None where it does not apply (not a Hopper GPU,
    a dtype or head dim the kernel lacks, fewer than DENSE_PREFIX_MIN_ROWS query rows per K/V head, a prefix not
    cut evenly, or a shape where `hopper.choose` found the Triton kernel faster): the caller keeps the paged
    prefix pass."""
    k, v = prefix_kv
    if k.shape[1] != prefix_len or not dense_prefix_possible(k):
        return None
    from ..attention import hopper

    splits = DENSE_PREFIX_SPLITS
    B, Tq, Hq, d = q.shape
    rows = B * Tq * Hq // k.shape[0]  # query rows per K/V head
    if rows < DENSE_PREFIX_MIN_ROWS or prefix_len % splits or not hopper.supports(q, k, v):
        return None
    variant = hopper.choose(d, False, rows, prefix_len // splits)
    if variant is None:
        return None
    return _DensePrefix(q, k, v, splits, variant, 1 / math.sqrt(d) if scale is None else scale)


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
                gathered = gather_prefix(k_pages, v_pages, self.prefix_pages, self.prefix_len)
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
