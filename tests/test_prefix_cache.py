"""Prefix caching (course_lib.serving.prefix_cache, notebook 14): greedy output identical with and without the
cache, no page leaked or freed while a sequence reads it, eviction under pressure, a hash collision not trusted."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import course_lib
from course_lib.decode.batching import ContinuousBatcher
from course_lib.decode.cache import PageAllocator, PagedKVCache
from course_lib.decode.toy_model import ToyModel
from course_lib.serving import prefix_cache
from course_lib.serving.prefix_cache import (
    CachingPageAllocator,
    PrefixCache,
    PrefixCachingBatcher,
    block_hash,
)

DEV = course_lib.DEVICE


def _prompts(vocab, shared, tails, seed=3):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (shared,), generator=g).tolist()
    return [prefix + torch.randint(0, vocab, (n,), generator=g).tolist() for n in tails]


def _accounted(batcher):
    """Every page is free, idle in the prefix cache, or held: the reference counts add up, none leaked; the
    cache's tables agree."""
    alloc, prefix = batcher.cache.allocator, batcher.prefix
    held = [0] * alloc.num_pages
    for seq in batcher.cache.seqs.values():
        for page in seq.pages:
            held[page] += 1
    for page in range(alloc.num_pages):
        own = 1 if page in prefix.entry else 0
        assert alloc.refs[page] == held[page] + own, (
            f"page {page}: refs {alloc.refs[page]}, held {held[page]}"
        )
        assert (page in alloc.free_list) == (alloc.refs[page] == 0), f"page {page}"
        assert (page in prefix.idle) == (own == 1 and held[page] == 0), f"page {page}"
    # the tables walk and insert read name the same pages: by hash, and by parent hash + token bytes
    assert prefix.by_hash == {h: page for page, (h, _, _) in prefix.entry.items()}
    assert prefix.by_key == {parent + row: page for page, (_, parent, row) in prefix.entry.items()}


def test_block_hash_chains_over_the_previous_page():
    a = block_hash(b"", [1, 2, 3, 4])
    assert a == block_hash(b"", [1, 2, 3, 4]) and len(a) == 32
    assert block_hash(a, [5, 6, 7, 8]) != block_hash(b"", [5, 6, 7, 8])  # same tokens, another prefix


def test_a_page_hashes_alike_from_its_ids_and_their_bytes():
    """walk, match and insert read a prompt as one int64 buffer (a list or the batcher's NumPy ids): the same
    hashes, pages and entries as block_hash of each page's ids."""
    as_bytes = np.asarray([1, 2, 3, 4], dtype=np.int64).tobytes()
    assert block_hash(b"", as_bytes) == block_hash(b"", [1, 2, 3, 4])
    cache = PagedKVCache(1, 8, 4, 1, 16, torch.float32, "cpu")
    cache.allocator = CachingPageAllocator(8)
    prefix = PrefixCache(cache)
    tokens = list(range(10, 24))  # three full pages and two tokens
    prefix.start(0, tokens)
    cache.append(0, len(tokens))
    prefix.insert(0, np.asarray(tokens, dtype=np.int64))
    parent = b""
    for i, page in enumerate(cache.seqs[0].pages[:3]):
        ids = tokens[4 * i : 4 * i + 4]
        h = block_hash(parent, ids)
        assert prefix.by_hash[h] == page and prefix.entry[page] == (h, parent, np.int64(ids).tobytes())
        parent = h
    assert prefix.registered(0) == 3
    for other in (tokens[:9] + [0], np.asarray(tokens[:9] + [0], dtype=np.int64)):
        assert prefix.walk(other) == (cache.seqs[0].pages[:2], prefix.entry[cache.seqs[0].pages[1]][0])
        assert prefix.match(other, limit=1) == cache.seqs[0].pages[:1]


def _walk_page_by_page(prefix, tokens, limit=None):
    """Notebook 14's lookup over the cache's tables: each full page's block hash looked up, the hit checked against
    the page's stored parent and tokens. (pages, hash of the last)."""
    ids, size = np.asarray(tokens, dtype=np.int64), prefix.page_size
    n = len(ids) // size if limit is None else min(limit, len(ids) // size)
    pages, parent = [], b""
    for i in range(n):
        row = ids[i * size : (i + 1) * size].tobytes()
        h = prefix_cache.block_hash(parent, row)
        page = prefix.by_hash.get(h)
        if page is None or prefix.entry[page][1:] != (parent, row):
            break
        pages.append(page)
        parent = h
    return pages, parent


@pytest.mark.parametrize("weak_hash", [False, True])
def test_walk_finds_what_the_page_by_page_lookup_finds(weak_hash, monkeypatch):
    """`walk` (a dict keyed by parent hash and token bytes, no hash computed) finds the same pages and last hash
    as the page-by-page lookup (notebook 14's), for prompts that branch off each other, stop inside a page or
    on a page's end, after evictions and with pages registered again, and with a 1-byte hash that collides all the
    time (weak_hash). Sequences register their pages a few at a time, as the batcher's steps do. The idle pages
    keep an LRU order: they go idle in the order their sequence held them, and the oldest is evicted first."""
    import hashlib

    if weak_hash:
        monkeypatch.setattr(
            prefix_cache, "block_hash", lambda p, t: hashlib.sha256(p + bytes(t)).digest()[:1]
        )
    rng = np.random.default_rng(7)
    size, num_pages = 3, 40
    cache = PagedKVCache(1, num_pages, size, 1, 16, torch.float32, "cpu")
    cache.allocator = CachingPageAllocator(num_pages)
    prefix = PrefixCache(cache)
    seen = [rng.integers(0, 2, 12).tolist()]
    live, lru = {}, []

    def idle_after(event, pages=()):
        """The idle pages after `event`: those before, less the ones evicted (the oldest) or in use again, then the
        ones a released sequence left idle."""
        nonlocal lru
        now = list(prefix.idle)
        if event == "evicted":
            assert now == lru[len(lru) - len(now) :]
        else:
            assert now == [p for p in lru if p in now] + [p for p in pages if p in now and p not in lru]
        lru = now

    for seq in range(60):
        base = seen[rng.integers(len(seen))]
        prompt = base[: rng.integers(len(base) + 1)] + rng.integers(0, 2, rng.integers(1, 9)).tolist()
        seen.append(prompt)
        for query in (prompt, base, prompt[:-1], prompt + [5]):  # lists and arrays, each limit
            for limit in (None, 1, (len(query) - 1) // size):
                want = _walk_page_by_page(prefix, query, limit)
                assert prefix.walk(query, limit) == want
                assert prefix.walk(np.asarray(query, dtype=np.int64), limit) == want
        if len(live) == 3 or cache.allocator.num_free < -(-len(prompt) // size) + 1:
            done = min(live)
            pages = list(cache.seqs[done].pages)
            prefix.release(done, live.pop(done))
            idle_after("released", pages)
        prefix.start(seq, prompt)
        idle_after("started")
        ids, have = np.asarray(prompt, dtype=np.int64), cache.seqs[seq].length
        for stop in sorted({*rng.integers(have, len(prompt) + 1, 2).tolist(), len(prompt)}):
            cache.append(seq, stop - cache.seqs[seq].length)
            idle_after("evicted")
            prefix.insert(seq, ids[:stop])
        live[seq] = prompt
        _accounted(types.SimpleNamespace(cache=cache, prefix=prefix))
    assert prefix.evictions > 0 and len(prefix.entry) > 10, "the set-up must evict and keep pages"


def test_walk_takes_a_run_of_pages_together_and_stops_where_it_must():
    """A page found brings the pages its sequence registered after it (`_Run`) as far as they hold the prompt's
    tokens: a prompt that leaves the run mid-way stops there, an evicted page cuts the run, and a sequence that
    goes on from a cached prefix starts a run of its own; always what the page-by-page lookup finds."""
    size, num_pages = 4, 64
    cache = PagedKVCache(1, num_pages, size, 1, 16, torch.float32, "cpu")
    cache.allocator = CachingPageAllocator(num_pages)
    prefix = PrefixCache(cache)
    rng = np.random.default_rng(11)
    first = rng.integers(0, 1000, 30 * size).tolist()

    def register(seq, tokens, chunks):
        prefix.start(seq, tokens)
        ids = np.asarray(tokens, dtype=np.int64)
        for stop in chunks:  # a few pages at a time, as a batcher's steps register them
            cache.append(seq, stop - cache.seqs[seq].length)
            prefix.insert(seq, ids[:stop])

    def check(query, expect_pages):
        got = prefix.walk(query)
        assert got == _walk_page_by_page(prefix, query) and len(got[0]) == expect_pages

    register(0, first, (5 * size, 17 * size + 2, 30 * size))  # one run of 30 pages
    run, at = prefix.run_of[cache.seqs[0].pages[0]]
    assert at == 0 and run.pages == cache.seqs[0].pages[:30]
    check(first, 30)
    check(first[: 12 * size + 3], 12)  # stops inside a page
    leave = list(first)
    leave[20 * size + 1] += 1  # leaves the run in page 20
    check(leave, 20)
    second = first[: 10 * size] + rng.integers(0, 1000, 8 * size).tolist()  # goes on from 10 cached pages
    register(1, second, (18 * size,))
    assert prefix.run_of[cache.seqs[1].pages[10]][0] is not run  # its own run, after the first's pages
    check(second, 18)
    prefix.release(0)
    victims = prefix.evict(1)  # the first idle page: the first's page 10
    assert victims == 1 and run.cut == 10
    check(first, 10)  # page 9, then the lookup finds no page 10
    check(second, 18)  # the second's own pages are untouched


def test_ttft_host_times_each_part_and_puts_the_model_back():
    """bench.serving.ttft_host (scripts/serving_probe.py --host): each part's host time, cached and not, and the
    model's own forward_step once it is done."""
    from course_lib.bench.serving import HOST_PARTS, serving_model, ttft_host

    model = serving_model(False)
    prompt = torch.randint(0, model.config.vocab_size, (40,)).tolist()
    got = ttft_host(model, prompt, 0.9, 1)
    assert got["prompt"] == 40 and got["cached_tokens"] == 32
    for kind in ("uncached", "cached"):
        assert set(got[kind]) == {*HOST_PARTS, "total"} and min(got[kind].values()) >= 0
        assert got[kind]["total"] == pytest.approx(sum(got[kind][p] for p in HOST_PARTS))
    assert "forward_step" not in vars(model)


def test_ttft_splits_each_first_token_and_puts_the_model_back():
    """bench.serving.ttft: each first token's host time before the model's step is part of its wall time, and the
    step's GPU time where the model is on a GPU (None on a CPU), the same first token with the cache and without,
    and the model's own forward_step afterwards, also where a wrapper was set on the instance before."""
    from course_lib.bench.serving import serving_model, ttft

    model = serving_model(False)
    prompt = torch.randint(
        0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(4)
    ).tolist()
    own = model.forward_step
    model.forward_step = own  # an instance attribute the timing wraps and then puts back
    got = ttft(model, prompt, 0.9, 2, warmup=False)
    assert vars(model)["forward_step"] is own
    del model.forward_step
    assert got["same_first_token"] and got["cached_tokens"] == 32
    for kind in ("uncached", "cached"):
        assert 0 < got[f"{kind}_before_step_ms"] < got[f"{kind}_ms"]
        gpu_ms = got[f"{kind}_step_gpu_ms"]
        if model.device.type == "cuda":
            assert 0 < gpu_ms < got[f"{kind}_ms"], (kind, gpu_ms)
        else:
            assert gpu_ms is None


@pytest.mark.parametrize("max_batch", [1, 3])
def test_greedy_tokens_identical_with_and_without_the_cache(max_batch):
    """Requests sharing a 13-token prompt prefix (3 full pages of 4): the cached run computes fewer prompt tokens
    and generates exactly the same tokens; afterwards every page is accounted for."""
    model = ToyModel(DEV)
    prompts = _prompts(model.vocab, 13, (2, 5, 1, 7))
    plain = ContinuousBatcher(model, num_pages=24, page_size=4, max_batch=max_batch, max_step_tokens=16)
    cached = PrefixCachingBatcher(model, num_pages=24, page_size=4, max_batch=max_batch, max_step_tokens=16)
    want = [plain.submit(p, 3) for p in prompts]
    got = [cached.submit(p, 3) for p in prompts]
    want, got = plain.run(), cached.run()
    assert list(got.values()) == list(want.values())
    for p, g in zip(prompts, got.values()):
        assert g == model.generate_full(p, 3)
    assert cached.prefix.hits >= 3 * 4 * (len(prompts) - max_batch), "later requests found the shared pages"
    _accounted(cached)
    assert cached.cache.allocator.num_free == 24  # idle cached pages count as free


def test_eviction_under_pressure_keeps_live_sequences_right():
    """A pool too small to keep every finished prompt: idle pages are evicted oldest first, live ones never, and
    the output is still exactly greedy."""
    model = ToyModel(DEV)
    prompts = _prompts(model.vocab, 9, (6, 3, 8, 2, 5), seed=5) + _prompts(model.vocab, 10, (4, 7), seed=6)
    batcher = PrefixCachingBatcher(model, num_pages=10, page_size=4, max_batch=2, max_step_tokens=12)
    ids = [batcher.submit(p, 2) for p in prompts]
    got = batcher.run()
    for i, p in zip(ids, prompts):
        assert got[i] == model.generate_full(p, 2), f"request {i}"
    assert batcher.prefix.evictions > 0, "the test set-up must make the pool evict"
    _accounted(batcher)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_the_prefix_cache(mode):
    """With one more request than the pool can hold, the batcher preempts. Recompute: the preempted request comes
    back on its own cached pages; swap: its pages come back from host memory. Either way it still generates the
    greedy tokens, and every page is accounted for after each step."""
    model = ToyModel(DEV)
    prompts = _prompts(model.vocab, 8, (7, 7, 7), seed=9)
    batcher = PrefixCachingBatcher(
        model, num_pages=9, page_size=4, max_batch=3, max_step_tokens=64, preemption=mode
    )
    ids = [batcher.submit(p, 6) for p in prompts]
    while batcher.waiting or batcher.running:
        batcher.step()
        _accounted(batcher)
    for i, p in zip(ids, prompts):
        assert batcher.finished[i].generated == model.generate_full(p, 6)
    assert batcher.preemptions > 0 and not batcher.swapped


def test_a_hash_collision_is_not_trusted(monkeypatch):
    """If two different pages hashed alike, the stored tokens tell them apart: no request gets another's keys."""
    cache = PagedKVCache(1, 8, 4, 1, 16, torch.float32, "cpu")
    cache.allocator = CachingPageAllocator(8)
    prefix = PrefixCache(cache)
    monkeypatch.setattr(prefix_cache, "block_hash", lambda parent, tokens: b"same")
    assert prefix.start(0, [1, 2, 3, 4, 5]) == 0
    cache.append(0, 5)
    prefix.insert(0, [1, 2, 3, 4, 5])
    assert prefix.match([1, 2, 3, 4, 9]) == [cache.seqs[0].pages[0]]
    assert prefix.match([9, 9, 9, 9, 9]) == [], "a colliding hash with other tokens must miss"


def test_bad_use_is_refused():
    cache = PagedKVCache(1, 4, 4, 1, 16, torch.float32, "cpu")
    assert isinstance(cache.allocator, PageAllocator)
    with pytest.raises(TypeError, match="CachingPageAllocator"):
        PrefixCache(cache)
