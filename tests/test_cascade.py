"""Cascade attention (course_lib.serving.cascade, notebook 14) against float64 attention over each full sequence:
the shared prefix read once by every query row, each suffix with the paged kernel, the states merged. The
batcher's choice of it (`CascadeChoice`): the same greedy tokens as the paged kernel alone."""

from __future__ import annotations

import pytest
import torch

import course_lib
from course_lib.decode.batching import ContinuousBatcher
from course_lib.decode.cache import PagedKVCache
from course_lib.decode.toy_model import ToyModel
from course_lib.serving import PrefixCachingBatcher, cascade_decode_attention, cascade_reference
from course_lib.serving.cascade import (
    CASCADE_MIN_SAVED_BYTES,
    CascadeChoice,
    cascade_min_prefix,
    dense_prefix_pass,
    gather_prefix,
    prefix_splits,
    shared_prefix,
)

DEV = course_lib.DEVICE


def _setup(B, Tq, Hq, Hkv, d, prefix_len, suffix_lens, page_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    prefix_pages_n = -(-prefix_len // page_size)
    per_seq = [-(-n // page_size) for n in suffix_lens]
    num_pages = prefix_pages_n + sum(per_seq) + 3
    perm = torch.randperm(num_pages, generator=g)  # pages scattered through the pool
    k_pages = torch.randn(num_pages, page_size, Hkv, d, generator=g).to(DEV, dtype)
    v_pages = torch.randn(num_pages, page_size, Hkv, d, generator=g).to(DEV, dtype)
    prefix_pages = perm[:prefix_pages_n].to(torch.int32)
    table = torch.zeros(B, max(per_seq), dtype=torch.int32)
    start = prefix_pages_n
    for b, n in enumerate(per_seq):
        table[b, :n] = perm[start : start + n]
        start += n
    q = torch.randn(B, Tq, Hq, d, generator=g).to(DEV, dtype)
    lens = torch.tensor(suffix_lens, dtype=torch.int32)
    return q, k_pages, v_pages, prefix_pages.to(DEV), prefix_len, table.to(DEV), lens.to(DEV)


@pytest.mark.parametrize(
    "B,Tq,Hq,Hkv,prefix_len,suffix_lens,dtype",
    [
        (3, 1, 4, 2, 37, [5, 1, 12], torch.float32),  # a ragged prefix (its last page partial), GQA
        (
            2,
            3,
            2,
            2,
            16,
            [3, 9],
            torch.float32,
        ),  # several query tokens each: bottom-right causal in the suffix
        (4, 1, 8, 1, 50, [7, 7, 2, 20], torch.float16),  # multi-query attention, half precision
    ],
)
def test_cascade_matches_float64_attention_over_each_full_sequence(
    B, Tq, Hq, Hkv, prefix_len, suffix_lens, dtype
):
    args = _setup(B, Tq, Hq, Hkv, 16, prefix_len, suffix_lens, 8, dtype)
    out = cascade_decode_attention(*args)
    ref = cascade_reference(*args)
    assert out.shape == (B, Tq, Hq, 16) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.cpu().double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("plen,splits,want", [(37, None, 1), (32, 8, 8), (36, 4, 4), (36, 1, 1)])
def test_gather_prefix_copies_the_prefix_keys_slice_major(plen, splits, want):
    """`gather_prefix`: the prefix's first prefix_len tokens of K and V from its scattered pages, cut into S slices
    of K/V heads, (S, Hkv, P / S, d) (S = 1 unless given)."""
    q, k, v, pages, plen, _, _ = _setup(2, 1, 4, 2, 16, plen, [3, 4], 8, torch.float32)
    gk, gv = gather_prefix(k, v, pages, plen) if splits is None else gather_prefix(k, v, pages, plen, splits)
    idx = torch.arange(plen, device=k.device)
    rows = pages.long()[idx // 8]
    assert gk.is_contiguous() and gk.shape == (want, 2, plen // want, 16)
    for got, pool in ((gk, k), (gv, v)):
        assert torch.equal(got, pool[rows, idx % 8].view(want, plen // want, 2, 16).transpose(1, 2))
    with pytest.raises(ValueError, match="splits 5 must divide prefix_len"):
        gather_prefix(k, v, pages, plen, 5)


@pytest.mark.parametrize(
    "B,Hq,Hkv,prefix_len,sms,want",
    [
        (64, 32, 8, 32768, 132, 4),  # 256 rows per K/V head, 2 tiles: 16 a slice, 64 tiles <= 66
        (128, 32, 8, 32768, 132, 2),  # 4 tiles a K/V head: 32 a slice
        (64, 32, 8, 32768, 264, 8),  # twice the SMs, twice the slices
        (64, 32, 8, 384, 132, 2),  # slices of at least 128 keys
        (64, 32, 8, 32766, 132, 2),  # slices divide the prefix: 32766 = 2 x 16383
        (512, 32, 8, 32768, 132, 1),  # 128 tiles a slice: one slice, however many SMs that fills
    ],
)
def test_prefix_splits_fills_half_the_sms_with_tiles(B, Hq, Hkv, prefix_len, sms, want):
    """`prefix_splits`: the most slices (a power of 2 dividing the prefix, 128 keys or more each) whose 128-row
    tiles take at most half the SMs, so that the suffix pass runs beside the prefix pass (the H200's steps in its
    docstring); one slice off CUDA."""
    q = torch.empty(B, 1, Hq, 128)
    pool = torch.empty(4, 16, Hkv, 128)
    assert prefix_splits(q, pool, prefix_len, sms) == want
    assert prefix_splits(q, pool, prefix_len) == 1  # a CPU pool


def test_dense_prefix_pass_names_a_prefix_kv_of_the_wrong_layout():
    """A prefix_kv that is not `gather_prefix`'s (S, Hkv, P / S, d) pair (the (Hkv, P, d) of a plain gather, K and V
    of different shapes, another head dim) is refused by name, on any device, before any kernel reads it."""
    q, k, v, pages, plen, _, _ = _setup(2, 1, 4, 2, 16, 32, [3, 4], 8, torch.float32)
    gk, gv = gather_prefix(k, v, pages, plen, 2)
    for bad in ((gk[0], gv[0]), (gk, gv[:1]), (gk[..., :8], gv[..., :8])):
        with pytest.raises(ValueError, match="dense_prefix_pass: prefix_kv must be gather_prefix's"):
            dense_prefix_pass(q, bad, plen)
    assert dense_prefix_pass(q, (gk, gv), plen) is None  # the right layout, off a Hopper GPU: the paged pass


def _hopper() -> bool:
    return DEV.type == "cuda" and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not _hopper(), reason="the dense prefix pass runs the Gluon forward: Hopper GPUs only")
@pytest.mark.parametrize(
    "B,Tq,Hq,Hkv,d,prefix_len,suffix_lens,dtype",
    [
        (
            64,
            1,
            32,
            8,
            128,
            16384,
            [1, 70, 300, 65] * 16,
            torch.bfloat16,
        ),  # the bench's heads, ragged suffixes
        (32, 2, 16, 4, 64, 16384, [2, 9, 17, 64, 65, 3, 128, 40] * 4, torch.float16),  # d = 64, Tq = 2
        (256, 1, 8, 8, 128, 8192, [5, 1, 12, 7] * 64, torch.bfloat16),  # no grouping
    ],
)
def test_the_dense_prefix_pass_matches_float64_attention(B, Tq, Hq, Hkv, d, prefix_len, suffix_lens, dtype):
    """With the prefix gathered once (`gather_prefix`), the prefix pass runs the warp-specialised forward over its
    slices (`dense_prefix_pass`: 1, 8 and `prefix_splits`' count), writing its partials in place; the step against
    float64 attention over each full sequence, and the plan taken (not the paged pass)."""
    args = _setup(B, Tq, Hq, Hkv, d, prefix_len, suffix_lens, 64, dtype)
    q, k, v, pages, plen = args[:5]
    ref = cascade_reference(*args)
    paged = cascade_decode_attention(*args).cpu().double()
    for splits in sorted({1, 8, prefix_splits(q, k, plen)}):
        prefix_kv = gather_prefix(k, v, pages, plen, splits)
        assert dense_prefix_pass(q, prefix_kv, plen) is not None
        out = cascade_decode_attention(*args, prefix_kv=prefix_kv)
        torch.testing.assert_close(out.cpu().double(), ref, rtol=2e-2, atol=2e-2)
        assert (out.cpu().double() - ref).abs().max() <= 2 * (paged - ref).abs().max() + 4e-3
    assert dense_prefix_pass(q, prefix_kv, plen - 1) is None  # a prefix that is not the gathered one: paged
    assert dense_prefix_pass(q[: B // 2], prefix_kv, plen) is None  # 128 rows per K/V head: paged


class _Calls:
    """A launcher (`combine`, `write_partials`) that records argument `index` of each call: its partials."""

    def __init__(self, fn, index):
        self.fn, self.index, self.buffers = fn, index, []

    def __call__(self, *args, **kwargs):
        self.buffers.append(args[self.index])
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize(
    "B,Tq,Hq,Hkv,prefix_len,suffix_lens,num_splits,dtype",
    [
        (3, 2, 4, 2, 300, [2, 9, 17], None, torch.float32),  # the prefix split several ways, GQA, Tq = 2
        (4, 1, 8, 1, 50, [7, 3, 2, 20], 3, torch.float16),  # MQA; 3 splits each, some suffix splits empty
    ],
)
def test_both_passes_write_one_partial_buffer_and_one_combine_merges_it(
    B, Tq, Hq, Hkv, prefix_len, suffix_lens, num_splits, dtype, monkeypatch
):
    """The two passes write into one (S_p + S_s, B, Tq, Hq, d) float32 buffer, and ONE combine launch reads it:
    no combine of the prefix's splits alone, no stacked copy of the two results. Every module that launches
    the combine is watched (split-KV decoding's own, after a split pass, and cascade's)."""
    from course_lib.decode import split_kv
    from course_lib.serving import cascade

    combines = _Calls(cascade.combine, 0)  # combine(o_part, lse_part, out, lse)
    passes = _Calls(cascade.write_partials, 6)  # write_partials(run, q, k, v, table, lens, o_part, ...)
    monkeypatch.setattr(cascade, "combine", combines)
    monkeypatch.setattr(split_kv, "combine", combines)
    monkeypatch.setattr(cascade, "write_partials", passes)
    args = _setup(B, Tq, Hq, Hkv, 16, prefix_len, suffix_lens, 8, dtype, seed=3)
    out = cascade_decode_attention(*args, num_splits=num_splits)
    assert len(passes.buffers) == 2 and len(combines.buffers) == 1
    (merged,) = combines.buffers
    assert merged.dtype == torch.float32 and merged.shape[1:] == (B, Tq, Hq, 16)
    for written in passes.buffers:  # each pass writes its slots of the buffer the combine reads
        assert written.untyped_storage().data_ptr() == merged.untyped_storage().data_ptr()
    # the prefix's splits, then the suffix's: 3 + 3 forced; the prefix alone split several ways when chosen
    assert merged.shape[0] == 6 if num_splits else merged.shape[0] > 2
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.cpu().double(), cascade_reference(*args), rtol=tol, atol=tol)


@pytest.mark.skipif(
    DEV.type == "cuda", reason="the CPU's SM count is set to 2 here, to make this grid two waves"
)
def test_the_prefix_pass_reads_its_table_row_in_any_waves_and_decoding_keeps_its_rule(monkeypatch):
    """The prefix pass, on its 128-row tile, reads its block-table row whole (TABLE_ROW > 0) in a grid of
    more than one wave (`cascade_passes`: 121.7 -> 114.5 us on an H200), and still matches float64
    attention; the suffix pass and a plain paged decoding launch of the same rows keep decoding's rule
    (`table_row_plan`: page ids block by block in a grid of more than one wave, never on a call's own tile)."""
    from course_lib.decode import heuristics, paged_decode_attention
    from course_lib.decode.paged import paged_plan
    from course_lib.kernels import bound

    monkeypatch.setattr(heuristics, "CPU_SM_COUNT", 2)  # 4 slots of the 128-row tile: 2 row tiles x 3 splits
    launches = []
    real = bound.launch

    def recorded(kernel, grid, *args, **kwargs):
        launches.append((kernel.fn.__name__, tuple(grid), kwargs))
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(bound, "launch", recorded)
    B, Hq, Hkv, d, prefix_len = 64, 4, 1, 128, 200  # 64 x 4 = 256 query rows of the one K/V head
    suffix_lens = [1 + (7 * b) % 19 for b in range(B)]
    args = _setup(B, 1, Hq, Hkv, d, prefix_len, suffix_lens, 16, torch.float32, seed=4)
    out = cascade_decode_attention(*args, num_splits=3)
    torch.testing.assert_close(out.cpu().double(), cascade_reference(*args), rtol=1e-5, atol=1e-5)
    prefix, suffix = [(grid, kw) for name, grid, kw in launches if name == "split_kv_kernel"]
    assert prefix[1]["BLOCK_M"] == 128 and prefix[1]["TABLE_ROW"] == 16  # 13 prefix pages: a row of 16
    tile = heuristics.many_rows_tile(d, B * Hq // Hkv, causal=False)
    assert not heuristics.one_wave(prefix[0][0] * prefix[0][1] * prefix[0][2], tile)
    assert suffix[1]["TABLE_ROW"] == 0  # 64 sequences x 3 splits: many waves of short programs
    q, k_pages, v_pages, prefix_pages = args[:4]
    rows = q.reshape(1, B, Hq, d)
    plen = torch.full((1,), prefix_len, dtype=torch.int32, device=DEV)
    plain = paged_plan(rows, k_pages, v_pages, prefix_pages.view(1, -1), plen, False, 3, True, "decode")
    assert plain.plan.tile == tile and not plain.plan.table_row
    launches.clear()
    paged_decode_attention(rows, k_pages, v_pages, prefix_pages.view(1, -1), plen, False, num_splits=3)
    assert launches[0][2]["TABLE_ROW"] == 0


def test_bad_input_is_refused_by_name():
    q, k, v, pp, plen, table, lens = _setup(2, 2, 2, 2, 16, 20, [4, 1], 8, torch.float32)
    with pytest.raises(ValueError, match="at least the Tq = 2 query tokens"):
        cascade_decode_attention(q, k, v, pp, plen, table, lens.cpu())
    with pytest.raises(ValueError, match="prefix_len 99 must be in 1..24"):
        cascade_decode_attention(q, k, v, pp, 99, table, torch.tensor([4, 4], dtype=torch.int32, device=DEV))
    with pytest.raises(TypeError, match="prefix_pages must be int32"):
        cascade_decode_attention(q, k, v, pp.long(), plen, table, torch.tensor([4, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="q must be"):
        cascade_decode_attention(q[0], k, v, pp, plen, table, lens)


# --------------------------------------------------------------------------------------------------
# The batcher's choice: cascade for a decode step whose sequences share a long enough prefix of pages
# --------------------------------------------------------------------------------------------------
def _shared_prompts(vocab, shared, tails, seed=11):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (shared,), generator=g).tolist()
    return [prefix + torch.randint(0, vocab, (n,), generator=g).tolist() for n in tails]


def _serve_sharing(model, kv_view, prompts, other):
    """The first prompt alone for one step (its prefix pages get cached), then the others sharing them and one
    prompt of its own, all decoding side by side. Returns (tokens per prompt, the batcher)."""
    batcher = PrefixCachingBatcher(model, num_pages=40, page_size=4, max_batch=4, max_step_tokens=64,
                                   kv_view=kv_view)  # fmt: skip
    ids = [batcher.submit(prompts[0], 5)]
    batcher.step()
    ids += [batcher.submit(p, 5) for p in prompts[1:] + [other]]
    batcher.run()
    return [batcher.finished[i].generated for i in ids], batcher


def test_the_batcher_takes_cascade_over_a_shared_prefix_with_the_same_greedy_tokens(monkeypatch):
    """Three requests on the cached pages of a 13-token prefix (3 full pages of 4) and one of their own: with a
    threshold of 8 tokens the decode steps take cascade for the three and the paged kernel for the fourth, and
    every request generates exactly the tokens of the paged kernel alone and of full attention.

    With the dense prefix pass taken as possible (on any device here: the toy model's head dim then keeps the
    paged pass), the group's prefix is gathered at its first cascade step, once per layer, handed to the
    steps that follow, and dropped at a step without cascade."""
    from course_lib.serving import cascade

    monkeypatch.setattr(cascade, "dense_prefix_possible", lambda pool: True)
    calls, kept = [], []
    monkeypatch.setattr(cascade, "gather_prefix", lambda *a: calls.append(a[3]) or gather_prefix(*a))
    choose = cascade.CascadeChoice.__call__

    def watched(self, *args):
        view = choose(self, *args)
        kept.append(None if self._store is None else view.store is self._store)
        return view

    monkeypatch.setattr(cascade.CascadeChoice, "__call__", watched)
    model = ToyModel(DEV)
    prompts = _shared_prompts(model.vocab, 13, (2, 5, 3))
    other = _shared_prompts(model.vocab, 6, (1,), seed=12)[0]
    choice = CascadeChoice(min_prefix=8)
    with_cascade, batcher = _serve_sharing(model, choice, prompts, other)
    paged, plain = _serve_sharing(model, None, prompts, other)
    assert choice.steps >= 3, "the set-up must reach decode steps over the shared prefix"
    runs = sum(1 for a, b in zip([None, *kept], kept) if a is None and b is not None)
    assert all(k is not False for k in kept) and runs >= 1 and calls == [12] * (model.num_layers * runs)
    assert choice(None, [0, 1], [2, 1], None) is None and choice._store is None
    assert plain.kv_view is None
    assert with_cascade == paged
    for p, got in zip(prompts + [other], with_cascade):
        assert got == model.generate_full(p, 5)
    assert batcher.cache.allocator.num_free == 40


def test_the_measured_threshold_keeps_short_prefixes_on_the_paged_kernel():
    """By default the threshold is the bench's crossover (CASCADE_MIN_SAVED_BYTES): a 12-token prefix of the toy
    model (2 heads of 16 floats: 256 bytes of K and V a token) is far below it."""
    model = ToyModel(DEV)
    prompts = _shared_prompts(model.vocab, 13, (2, 5, 3))
    other = _shared_prompts(model.vocab, 6, (1,), seed=12)[0]
    _, batcher = _serve_sharing(model, CascadeChoice(), prompts, other)
    assert batcher.kv_view.steps == 0
    assert isinstance(PrefixCachingBatcher(model, num_pages=4, page_size=4).kv_view, CascadeChoice)
    assert cascade_min_prefix(8, 1024) == 42131 and cascade_min_prefix(64, 1024) == 4682
    assert cascade_min_prefix(2, 4096) == 72 * 1024 == CASCADE_MIN_SAVED_BYTES // 4096


def test_shared_prefix_finds_the_largest_group_and_its_common_full_pages():
    cache = PagedKVCache(1, 32, 4, 1, 16, torch.float32, "cpu")
    cache.add_sequence(0)
    cache.append(0, 10)  # pages a b c (c half full)
    for child in (1, 2):
        cache.fork(0, child)
    cache.append(1, 3)  # copy-on-write of c: 1 owns its third page
    cache.add_sequence(3)
    cache.append(3, 5)
    members, pages = shared_prefix(cache, [3, 0, 1, 2])
    assert members == [1, 2, 3] and pages == cache.seqs[0].pages[:2]  # c is not full in 0 and 2
    assert shared_prefix(cache, [3, 0]) == ([], [])


def test_bad_choices_are_refused():
    with pytest.raises(ValueError, match="min_prefix must be >= 1"):
        CascadeChoice(min_prefix=0)
    with pytest.raises(ValueError, match="batch must be >= 2"):
        cascade_min_prefix(1, 1024)
    with pytest.raises(TypeError, match="kv_view must be None or a callable"):
        ContinuousBatcher(ToyModel(DEV), num_pages=8, page_size=4, kv_view="cascade")
