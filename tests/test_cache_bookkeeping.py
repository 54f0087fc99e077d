"""course_lib.decode.cache: bad input to `PageAllocator` and `PagedKVCache` is refused with a clear error
and leaves the bookkeeping (reference counts, free list, pages and lengths) as it was; the good paths
still work. CPU only."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from course_lib.decode.cache import OutOfPages, PageAllocator, PagedKVCache


def alloc_state(alloc: PageAllocator):
    return list(alloc.refs), list(alloc.free_list)


def cache_state(cache: PagedKVCache):
    return alloc_state(cache.allocator), copy.deepcopy(cache.seqs)


def small_cache(num_pages: int = 8) -> PagedKVCache:
    """Sequence 0 with 6 tokens (pages: one full, one half full) and sequence 1 with 2 tokens."""
    cache = PagedKVCache(1, num_pages, 4, 1, 8, torch.float32, "cpu")
    for seq, n in ((0, 6), (1, 2)):
        cache.add_sequence(seq)
        cache.append(seq, n)
    return cache


# --------------------------------------------------------------------------------------------------
# PageAllocator
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["share", "release"])
@pytest.mark.parametrize(
    "page, error, match",
    [
        (-1, ValueError, r"^PageAllocator\.(share|release): page must be >= 0, got -1$"),
        (3, ValueError, r"^PageAllocator\.(share|release): page 3 is out of range; pages are 0\.\.2$"),
        (5, ValueError, r"page 5 is out of range; pages are 0\.\.2"),
        ("1", TypeError, r"page must be an integer, got '1' \(str\)"),
        (1.0, TypeError, r"page must be an integer, got 1\.0 \(float\)"),
        (True, TypeError, r"page must be an integer, got True \(bool\)"),
    ],
)
def test_allocator_refuses_bad_page_ids(method, page, error, match):
    alloc = PageAllocator(3)
    for _ in range(3):
        alloc.allocate()
    before = alloc_state(alloc)
    with pytest.raises(error, match=match):
        getattr(alloc, method)(page)
    assert alloc_state(alloc) == before == ([1, 1, 1], [])


def test_allocator_refuses_free_pages():
    alloc = PageAllocator(3)
    alloc.allocate()
    before = alloc_state(alloc)
    with pytest.raises(ValueError, match=r"^page 1 is free; only a page in use can be shared$"):
        alloc.share(1)
    with pytest.raises(
        ValueError,
        match=r"^page 2 is free \(released already, or never allocated\); only a page in use can be released$",
    ):
        alloc.release(2)
    assert alloc_state(alloc) == before
    alloc.release(0)  # the last owner: back to the free list
    with pytest.raises(ValueError, match=r"^page 0 is free \(released already"):
        alloc.release(0)  # a double release would put page 0 on the free list twice
    assert alloc.refs == [0, 0, 0] and sorted(alloc.free_list) == [0, 1, 2]


@pytest.mark.parametrize(
    "num_pages, error, match",
    [
        ("3", TypeError, r"^PageAllocator: num_pages must be an integer, got '3' \(str\)$"),
        (2.5, TypeError, r"^PageAllocator: num_pages must be an integer, got 2\.5 \(float\)$"),
        (True, TypeError, r"num_pages must be an integer, got True \(bool\)"),
        (0, ValueError, r"^PageAllocator: num_pages must be >= 1, got 0$"),
        (-2, ValueError, r"^PageAllocator: num_pages must be >= 1, got -2$"),
    ],
)
def test_allocator_refuses_bad_page_counts(num_pages, error, match):
    with pytest.raises(error, match=match):
        PageAllocator(num_pages)


def test_allocator_good_path():
    alloc = PageAllocator(np.int64(3))  # a NumPy integer is an integer
    assert alloc.num_pages == 3 and type(alloc.num_pages) is int
    a, b = alloc.allocate(), alloc.allocate()
    assert (a, b) == (0, 1) and alloc.num_free == 1
    alloc.share(a)
    alloc.share(np.int64(a))
    assert alloc.refs == [3, 1, 0]
    alloc.release(a)
    alloc.release(b)
    assert alloc.refs == [2, 0, 0] and alloc.num_free == 2
    alloc.release(a)
    alloc.release(a)
    assert alloc.refs == [0, 0, 0] and alloc.num_free == 3
    for _ in range(3):
        alloc.allocate()
    with pytest.raises(OutOfPages, match=r"^all 3 pages are in use$"):
        alloc.allocate()


def test_page_runs_equal_one_call_per_page():
    """allocate_pages, share_pages and release_pages (one call for many pages) leave the reference counts and the
    free list, in order, exactly as the calls of allocate, share and release one page at a time."""
    rng = np.random.default_rng(0)
    runs, calls = PageAllocator(12), PageAllocator(12)
    for _ in range(300):
        held = [p for p in range(12) if calls.refs[p] > 0]
        op = rng.integers(3)
        if op == 0:
            n = int(rng.integers(0, calls.num_free + 1))
            assert runs.allocate_pages(n) == [calls.allocate() for _ in range(n)]
        elif held:
            pages = rng.choice(held, size=int(rng.integers(0, len(held) + 1)), replace=False).tolist()
            if op == 1:
                pages = pages + pages[:1]  # a page listed twice gains two owners
                runs.share_pages(pages if rng.integers(2) else np.asarray(pages))
                for p in pages:
                    calls.share(p)
            else:
                if pages and calls.refs[pages[0]] >= 2:
                    pages = pages + pages[:1]  # a page listed twice loses two owners
                runs.release_pages(pages)
                for p in pages:
                    calls.release(p)
        assert alloc_state(runs) == alloc_state(calls)


def test_page_runs_refuse_bad_pages_and_change_nothing():
    alloc = PageAllocator(3)
    alloc.allocate_pages(2)
    before = alloc_state(alloc)
    with pytest.raises(ValueError, match=r"^page 2 is free; only a page in use can be shared$"):
        alloc.share_pages([0, 2, 1])
    with pytest.raises(ValueError, match=r"^page 2 is free \(released already, or never allocated\)"):
        alloc.release_pages([1, 2])
    for bad, error, match in (
        (-1, ValueError, r"^PageAllocator\.share_pages: page must be >= 0, got -1$"),
        (3, ValueError, r"page 3 is out of range; pages are 0\.\.2$"),
        (True, TypeError, r"page must be an integer, got True \(bool\)"),
        ("1", TypeError, r"page must be an integer, got '1' \(str\)"),
    ):
        with pytest.raises(error, match=match):
            alloc.share_pages([0, bad])
    with pytest.raises(OutOfPages, match=r"^2 pages asked for, 1 of 3 are free$"):
        alloc.allocate_pages(2)
    assert alloc_state(alloc) == before == ([1, 1, 0], [2])
    alloc.share_pages([np.int64(0)])  # NumPy integers: one page at a time, as `share`
    assert alloc.refs == [2, 1, 0]


def test_append_slots_follow_the_pages():
    """Each appended token's slot is pages[t // page_size] * page_size + t % page_size, whatever the page size
    and however the tokens come (a run of pages, a part of one, none)."""
    rng = np.random.default_rng(1)
    for page_size in (1, 3, 4, 16):
        cache = PagedKVCache(1, 64, page_size, 1, 8, torch.float32, "cpu")
        cache.add_sequence(0)
        for n in rng.integers(0, 20, size=8).tolist():
            if cache.pages_needed(0, n) > cache.allocator.num_free:
                break
            slots = cache.append(0, n)
            pages, end = cache.seqs[0].pages, cache.seqs[0].length
            want = [pages[t // page_size] * page_size + t % page_size for t in range(end - n, end)]
            assert slots.dtype == torch.int64 and slots.tolist() == want


# --------------------------------------------------------------------------------------------------
# PagedKVCache: the constructor
# --------------------------------------------------------------------------------------------------
GOOD = dict(
    num_layers=2, num_pages=4, page_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32, device="cpu"
)


@pytest.mark.parametrize("name", ["num_layers", "num_pages", "page_size", "num_kv_heads", "head_dim"])
@pytest.mark.parametrize(
    "value, error, match",
    [
        (0, ValueError, r"^PagedKVCache: {name} must be >= 1, got 0$"),
        (-3, ValueError, r"^PagedKVCache: {name} must be >= 1, got -3$"),
        (2.5, TypeError, r"^PagedKVCache: {name} must be an integer, got 2\.5 \(float\)$"),
        ("4", TypeError, r"^PagedKVCache: {name} must be an integer, got '4' \(str\)$"),
    ],
)
def test_cache_refuses_bad_sizes(name, value, error, match):
    with pytest.raises(error, match=match.format(name=name)):
        PagedKVCache(**{**GOOD, name: value})


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, "float32", None])
def test_cache_refuses_non_floating_dtypes(dtype):
    with pytest.raises(TypeError, match=r"^PagedKVCache: dtype must be a floating torch\.dtype"):
        PagedKVCache(**{**GOOD, "dtype": dtype})


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_cache_accepts_floating_dtypes(dtype):
    cache = PagedKVCache(**{**GOOD, "dtype": dtype})
    assert cache.device == torch.device("cpu") and len(cache.k_pages) == 2
    assert cache.k_pages[0].shape == (4, 4, 1, 8) and cache.k_pages[0].dtype == dtype


# --------------------------------------------------------------------------------------------------
# PagedKVCache: sequence ids
# --------------------------------------------------------------------------------------------------
UNKNOWN = r"sequence 9 is not in the cache \(sequences: \[0, 1\]\); add_sequence\(9\) first$"


@pytest.mark.parametrize(
    "call, where",
    [
        (lambda c: c.append(9, 1), "append"),
        (lambda c: c.pages_needed(9, 1), "pages_needed"),
        (lambda c: c.fork(9, 2), "fork"),
        (lambda c: c.free(9), "free"),
        (lambda c: c.block_table([0, 9]), "block_table"),
        (lambda c: c.seqlens([9, 1]), "seqlens"),
    ],
)
def test_unknown_sequences_are_named(call, where):
    cache = small_cache()
    before = cache_state(cache)
    with pytest.raises(ValueError, match=rf"^PagedKVCache\.{where}: {UNKNOWN}"):
        call(cache)
    assert cache_state(cache) == before


def test_unknown_sequence_lists_only_a_few_known_ids():
    cache = PagedKVCache(1, 4, 4, 1, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"sequence 0 is not in the cache \(sequences: \[\]\)"):
        cache.seqlens([0])
    for seq in range(12):
        cache.add_sequence(seq)
    with pytest.raises(
        ValueError, match=r"\(sequences: \[0, 1, 2, 3, 4, 5, 6, 7, \.\.\.\]\); add_sequence\(20\)"
    ):
        cache.free(20)


def test_add_sequence_refuses_an_existing_id():
    cache = small_cache()
    before = cache_state(cache)
    with pytest.raises(ValueError, match=r"^PagedKVCache\.add_sequence: sequence 1 already exists$"):
        cache.add_sequence(1)
    assert cache_state(cache) == before


def test_fork_refuses_an_existing_child():
    cache = small_cache()
    before = cache_state(cache)
    with pytest.raises(
        ValueError, match=r"^PagedKVCache\.fork: child sequence 1 already exists; free it first"
    ):
        cache.fork(0, 1)  # would overwrite sequence 1 and leak its page
    assert cache_state(cache) == before
    with pytest.raises(ValueError, match=r"^PagedKVCache\.fork: child and parent are both sequence 0; "):
        cache.fork(0, 0)  # would double the refcounts of 0's pages: they would never be freed
    assert cache_state(cache) == before


# --------------------------------------------------------------------------------------------------
# PagedKVCache: token counts, block tables, layers
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["append", "pages_needed"])
@pytest.mark.parametrize(
    "n, error, match",
    [
        (-10, ValueError, r"n must be >= 0, got -10$"),
        (-1, ValueError, r"n must be >= 0, got -1$"),
        (2.5, TypeError, r"n must be an integer, got 2\.5 \(float\)$"),
        (None, TypeError, r"n must be an integer, got None \(NoneType\)$"),
    ],
)
def test_append_refuses_bad_token_counts(where, n, error, match):
    cache = small_cache()
    cache.fork(0, 2)  # 0's half-full last page is shared: a bad append must not copy it first
    before = cache_state(cache)
    with pytest.raises(error, match=rf"^PagedKVCache\.{where}: {match}"):
        getattr(cache, where)(2, n)
    assert cache_state(cache) == before
    assert cache.seqlens([0, 1, 2]).tolist() == [6, 2, 6]


def test_append_of_zero_tokens_is_a_no_op():
    cache = small_cache()
    cache.fork(0, 2)
    before = cache_state(cache)
    assert cache.pages_needed(2, 0) == 0
    slots = cache.append(2, 0)
    assert slots.shape == (0,) and slots.dtype == torch.int64
    assert cache_state(cache) == before


def test_block_table_refuses_a_too_narrow_table():
    cache = small_cache()
    before = cache_state(cache)
    with pytest.raises(
        ValueError, match=r"^PagedKVCache\.block_table: sequence 0 holds 2 pages, more than max_pages=1$"
    ):
        cache.block_table([1, 0], max_pages=1)
    with pytest.raises(ValueError, match=r"^PagedKVCache\.block_table: max_pages must be >= 0, got -1$"):
        cache.block_table([1], max_pages=-1)
    with pytest.raises(
        TypeError, match=r"^PagedKVCache\.block_table: max_pages must be an integer, got 2\.0"
    ):
        cache.block_table([1], max_pages=2.0)
    assert cache_state(cache) == before
    p0, p1 = cache.seqs[0].pages, cache.seqs[1].pages
    assert cache.block_table([1, 0], max_pages=3).tolist() == [p1 + [0, 0], p0 + [0]]
    assert cache.block_table([1], max_pages=1).tolist() == [p1]


def test_write_refuses_a_bad_layer():
    cache = small_cache()
    slots = cache.append(1, 1)
    kv = torch.ones(1, 1, 8)
    pools = [p.clone() for p in cache.k_pages + cache.v_pages]
    with pytest.raises(
        ValueError, match=r"^PagedKVCache\.write: layer 1 is out of range; layers are 0\.\.0$"
    ):
        cache.write(1, slots, kv, kv)
    with pytest.raises(ValueError, match=r"^PagedKVCache\.write: layer must be >= 0, got -1$"):
        cache.write(-1, slots, kv, kv)  # not the last layer by negative indexing
    for p, q in zip(cache.k_pages + cache.v_pages, pools):
        assert torch.equal(p, q)
    cache.write(0, slots, kv, 2 * kv)
    assert torch.equal(cache.k_pages[0].view(-1, 1, 8)[slots], kv)
    assert torch.equal(cache.v_pages[0].view(-1, 1, 8)[slots], 2 * kv)


def test_write_refuses_mismatched_shapes():
    """k and v must be (T, Hkv, d) for T slots, and slots a (T,) integer tensor: refused before anything
    is stored (a wrong head count once surfaced as a broadcasting error, or a device assert on a GPU)."""
    cache = small_cache()
    slots = cache.append(1, 2)
    good = torch.ones(2, 1, 8)
    pools = [p.clone() for p in cache.k_pages + cache.v_pages]
    cases = [
        (slots, torch.ones(3, 1, 8), good, ValueError, r"k must have shape \(T, Hkv, d\) = \(2, 1, 8\)"),
        (slots, good, torch.ones(2, 2, 8), ValueError, r"v must have shape \(T, Hkv, d\) = \(2, 1, 8\)"),
        (slots, torch.ones(2, 8), good, ValueError, "k must have shape"),
        (slots.float(), good, good, TypeError, r"slots must be a \(T,\) int64 or int32 tensor"),
        (slots > 0, good, good, TypeError, "slots must be"),  # a bool mask would index by position
        (slots.to(torch.uint8), good, good, TypeError, "slots must be"),
        (slots[None], good, good, TypeError, "slots must be"),
    ]
    for s, k, v, error, words in cases:
        with pytest.raises(error, match=words):
            cache.write(0, s, k, v)
    for p, q in zip(cache.k_pages + cache.v_pages, pools):
        assert torch.equal(p, q)


# --------------------------------------------------------------------------------------------------
# The good path: allocate, fork with copy-on-write, append, free every page
# --------------------------------------------------------------------------------------------------
def test_fork_copy_on_write_and_free_return_every_page():
    cache = PagedKVCache(2, 8, 4, 1, 8, torch.float32, "cpu")
    cache.add_sequence(0)
    slots = cache.append(0, 6)  # p0 full, p1 holds 2 of 4 slots
    assert slots.tolist() == [0, 1, 2, 3, 4, 5]
    for layer in range(2):
        cache.write(layer, slots, torch.randn(6, 1, 8), torch.randn(6, 1, 8))
    cache.fork(0, 1)
    pages = cache.seqs[0].pages
    assert cache.seqs[1].pages == pages and [cache.allocator.refs[p] for p in pages] == [2, 2]
    assert cache.seqlens([0, 1]).tolist() == [6, 6] and cache.allocator.num_free == 6
    shared = [pool[pages[1]].clone() for pool in cache.k_pages + cache.v_pages]
    assert cache.pages_needed(1, 1) == 1  # the copy of the shared, partly filled page
    new = cache.append(1, 1)
    copied = cache.seqs[1].pages[1]
    assert copied not in pages and cache.seqs[1].pages[0] == pages[0]
    assert int(new[0]) == copied * 4 + 2
    assert [cache.allocator.refs[p] for p in pages] == [2, 1]
    for pool, old in zip(cache.k_pages + cache.v_pages, shared):
        assert torch.equal(pool[copied], old)
    cache.append(0, 3)  # 0's last page is its own again: no copy, one new page for the 9th token
    assert len(cache.seqs[0].pages) == 3 and cache.seqlens([0, 1]).tolist() == [9, 7]
    table = cache.block_table([0, 1])
    assert table.dtype == torch.int32 and table.tolist() == [cache.seqs[0].pages, cache.seqs[1].pages + [0]]
    cache.fork(1, 2)
    cache.free(0)
    cache.free(1)
    assert cache.allocator.num_free == 8 - 2 and list(cache.seqs) == [2]
    cache.free(2)
    assert cache.allocator.num_free == 8 and cache.allocator.refs == [0] * 8 and cache.seqs == {}
    cache.add_sequence(0)  # a freed id can be used again
    assert cache.append(0, 1).tolist() == [cache.seqs[0].pages[0] * 4]


def test_write_refuses_slots_outside_held_pages():
    """Slots on the CPU must lie in the pool and in a page some sequence holds: a negative slot once
    wrote into another page (negative indexing), one past the pool raised a bare IndexError, and one in
    a free page was stored where the next sequence's tokens would overwrite it."""
    cache = small_cache(num_pages=4)
    slots = cache.append(1, 2)  # in page 2; pages 0-2 held, page 3 free
    kv = torch.ones(2, 1, 8)
    pools = [p.clone() for p in cache.k_pages + cache.v_pages]
    total = 4 * cache.page_size
    for bad, words in (
        ([0, -1], rf"slots \[-1\] are outside the pool's \[0, {total}\)"),
        ([0, total], rf"slots \[{total}\] are outside the pool's \[0, {total}\)"),
        ([0, 3 * cache.page_size], r"slots fall in pages \[3\], which no sequence holds"),
    ):
        with pytest.raises(ValueError, match=words):
            cache.write(0, torch.tensor(bad), kv, kv)
    for p, q in zip(cache.k_pages + cache.v_pages, pools):
        assert torch.equal(p, q)
    cache.write(0, slots, kv, 3 * kv)  # the slots append gave are taken
    assert torch.equal(cache.v_pages[0].view(-1, 1, 8)[slots], 3 * kv)


def test_allocator_shares_and_copies_on_write():
    alloc = PageAllocator(3)
    a = alloc.allocate()
    alloc.share(a)
    alloc.release(a)
    assert alloc.refs[a] == 1 and alloc.num_free == 2
    cache = PagedKVCache(1, 6, 4, 1, 16, torch.float32, "cpu")
    cache.add_sequence(0)
    slots = cache.append(0, 6)  # pages p0 (full) and p1 (2 of 4 slots)
    cache.write(0, slots, torch.randn(6, 1, 16), torch.randn(6, 1, 16))
    cache.fork(0, 1)
    shared_last = cache.seqs[1].pages[-1]
    assert cache.allocator.refs[shared_last] == 2
    before = cache.k_pages[0][shared_last].clone()
    new = cache.append(1, 1)  # writes into the shared, partly filled page: copy first
    assert cache.seqs[1].pages[0] == cache.seqs[0].pages[0]  # the full page stays shared
    assert cache.seqs[1].pages[-1] != shared_last
    torch.testing.assert_close(cache.k_pages[0][cache.seqs[1].pages[-1]], before)
    assert int(new[0]) == cache.seqs[1].pages[-1] * 4 + 2
    cache.free(0)
    cache.free(1)
    assert cache.allocator.num_free == 6
    cache.add_sequence(2)
    with pytest.raises(OutOfPages, match="^sequence 2 needs 7 pages for 25 tokens$"):
        cache.append(2, 25)  # 7 pages of 4 tokens, 6 free: refused before any page is taken
    assert cache.allocator.num_free == 6 and cache.seqs[2].pages == [] and cache.seqs[2].length == 0
