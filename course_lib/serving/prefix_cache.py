"""Prefix caching: full pages found again by their tokens, shared, kept until evicted (notebook 14).

A page holds `page_size` tokens. Once full it never changes (a sequence writes only into its last, partial
page), so a full page can be named by what it holds: its **block hash** is a hash of the previous page's hash and
the page's token ids, chained from the first page (vLLM v1, nano-vllm). Two prompts that start with the same
2 000 tokens name the same first 2 000 / page_size pages, and the second finds them in the table instead of
recomputing them.

- `PrefixCache.match(tokens)` walks a prompt's full pages while the table knows them. A hit is not trusted on the
  hash alone: the page's stored tokens and its parent's hash are compared too, so a collision never hands a
  request someone else's keys.
- A cached page holds one reference of its own. When its last request ends the page is not freed but joins an LRU
  list; `CachingPageAllocator` takes pages from that list (oldest first) only when its free list is empty, so a
  cached page lives as long as nobody needs the memory, and a page still read by a sequence is never evicted.
- `PrefixCachingBatcher`: `decode.ContinuousBatcher` whose admission starts a request on the cached pages of its
  prompt and marks them computed, so its prefill runs only over the rest. Greedy output is the same as without the
  cache (tests/test_prefix_cache.py).

Not here: pages of a sequence that rolls back (speculative decoding) are never cached partial, so rollback
never touches a cached page; SGLang's radix tree answers the same question with a tree of token runs (the hash
chain is the simpler structure to teach and to check, and what vLLM v1 uses).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from ..decode.batching import ContinuousBatcher
from ..decode.cache import OutOfPages, PageAllocator, PagedKVCache, SequencePages

__all__ = ["CachingPageAllocator", "PrefixCache", "PrefixCachingBatcher", "block_hash"]

ROOT_HASH = b""


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of a full page: SHA-256 of the previous page's hash (b"" for the first page) and the page's token
    ids as int64. 32 bytes; the same tokens after the same prefix always give the same hash."""
    return hashlib.sha256(parent + np.asarray(tokens, dtype=np.int64).tobytes()).digest()


class CachingPageAllocator(PageAllocator):
    """A `PageAllocator` that counts the prefix cache's idle pages as free and evicts the oldest one when a page
    is asked for and the free list is empty."""

    def __init__(self, num_pages: int):
        super().__init__(num_pages)
        self.prefix: PrefixCache | None = None

    @property
    def num_free(self) -> int:
        idle = len(self.prefix.idle) if self.prefix is not None else 0
        return len(self.free_list) + idle

    def allocate(self) -> int:
        if not self.free_list and self.prefix is not None:
            self.prefix.evict(1)
        return super().allocate()


class PrefixCache:
    """The table of cached full pages of one `PagedKVCache` (whose allocator must be a `CachingPageAllocator`).

    by_hash: block hash -> page; for each cached page its hash, its parent's hash and its tokens; idle: the cached
    pages no sequence holds (reference count 1: the cache's own), least recently used first."""

    def __init__(self, cache: PagedKVCache):
        if not isinstance(cache.allocator, CachingPageAllocator):
            raise TypeError(
                "PrefixCache: the cache's allocator must be a CachingPageAllocator (PrefixCachingBatcher makes one); "
                f"got {type(cache.allocator).__name__}"
            )
        self.cache = cache
        self._free = cache.free  # the cache's own free (a batcher may route cache.free through `release`)
        self.page_size = cache.page_size
        cache.allocator.prefix = self
        self.by_hash: dict[bytes, int] = {}
        self.entry: dict[
            int, tuple[bytes, bytes, tuple[int, ...]]
        ] = {}  # page -> (hash, parent hash, tokens)
        self.idle: OrderedDict[int, None] = OrderedDict()
        self.hits = self.lookups = self.evictions = 0  # tokens found / tokens asked for, pages evicted

    def match(self, tokens: Sequence[int], limit: int | None = None) -> list[int]:
        """The cached pages that hold the first full pages of `tokens`, in order, stopping at the first page not
        cached (or at `limit` pages). Each hit is checked against the page's stored tokens and parent hash."""
        pages, parent = [], ROOT_HASH
        n_full = len(tokens) // self.page_size if limit is None else min(limit, len(tokens) // self.page_size)
        for i in range(n_full):
            block = tuple(int(t) for t in tokens[i * self.page_size : (i + 1) * self.page_size])
            h = block_hash(parent, block)
            page = self.by_hash.get(h)
            if page is None or self.entry[page][1:] != (parent, block):  # absent, or a collision
                break
            pages.append(page)
            parent = h
        return pages

    def start(self, seq_id, tokens: Sequence[int]) -> int:
        """Add sequence `seq_id` to the cache, starting on the cached pages of `tokens` (at least its last token
        is left to compute: its logits give the next token). Returns how many tokens are already in the cache."""
        pages = self.match(tokens, limit=(len(tokens) - 1) // self.page_size)
        self.lookups += len(tokens)
        self.hits += len(pages) * self.page_size
        self.cache.add_sequence(seq_id)
        for page in pages:
            self.idle.pop(page, None)  # in use again: not evictable
            self.cache.allocator.share(page)
        self.cache.seqs[seq_id] = SequencePages(list(pages), len(pages) * self.page_size)
        return len(pages) * self.page_size

    def insert(self, seq_id, tokens: Sequence[int]) -> None:
        """Register the full pages of sequence `seq_id`, whose cache holds `tokens` (its first tokens), so later
        requests find them. A page whose hash is already cached (another copy of the same prefix) is left as the
        sequence's own."""
        seq = self.cache.seqs[seq_id]
        parent = ROOT_HASH
        for i in range(min(len(tokens), seq.length) // self.page_size):
            block = tuple(int(t) for t in tokens[i * self.page_size : (i + 1) * self.page_size])
            h = block_hash(parent, block)
            page = seq.pages[i]
            if h not in self.by_hash and page not in self.entry:
                self.by_hash[h] = page
                self.entry[page] = (h, parent, block)
                self.cache.allocator.share(page)  # the cache's own reference
            parent = h

    def release(self, seq_id, tokens: Sequence[int] | None = None) -> None:
        """Free sequence `seq_id`, first registering its full pages if `tokens` (what its cache holds) is given.
        Its cached pages that no other sequence holds become idle (evictable, most recently used last); the rest
        return to the pool as usual."""
        if tokens is not None:
            self.insert(seq_id, tokens)
        pages = list(self.cache.seqs[seq_id].pages)
        self._free(seq_id)
        for page in pages:
            if page in self.entry and self.cache.allocator.refs[page] == 1:
                self.idle[page] = None
                self.idle.move_to_end(page)

    def evict(self, n: int) -> int:
        """Free up to `n` idle cached pages, least recently used first; returns how many were freed."""
        freed = 0
        while freed < n and self.idle:
            page, _ = self.idle.popitem(last=False)
            h, _, _ = self.entry.pop(page)
            del self.by_hash[h]
            self.cache.allocator.release(page)
            freed += 1
        self.evictions += freed
        if freed < n and not self.cache.allocator.free_list:
            raise OutOfPages(f"every page is in use by a sequence ({self.cache.allocator.num_pages} pages)")
        return freed

    @property
    def hit_rate(self) -> float:
        """Tokens found in the cache over tokens asked for, since the start."""
        return self.hits / self.lookups if self.lookups else 0.0


class PrefixCachingBatcher(ContinuousBatcher):
    """`ContinuousBatcher` with prefix caching: a request starts on the cached pages of its prompt, and its
    prefill runs only over what is not cached. Pages are registered as they fill (so requests running side by
    side share them) and kept after their request ends until the pool needs them. Notebook 14."""

    def __init__(self, model, num_pages: int, page_size: int = 16, **kwargs):
        super().__init__(model, num_pages, page_size, **kwargs)
        self.cache.allocator = CachingPageAllocator(num_pages)
        self.prefix = PrefixCache(self.cache)
        self._requests = {}

        def free_and_keep(seq_id):  # every path that ends a sequence (retire, preempt) keeps its full pages
            req = self._requests.pop(seq_id, None)
            self.prefix.release(seq_id, None if req is None else req.tokens[: req.computed])

        self.cache.free = free_and_keep

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            cached = self.prefix.match(req.tokens, limit=(len(req.tokens) - 1) // self.cache.page_size)
            need = -(-(len(req.tokens) + 1) // self.cache.page_size) - len(cached)
            idle_reused = sum(page in self.prefix.idle for page in cached)
            if need > self.cache.allocator.num_free - idle_reused:
                break
            self.waiting.pop(0)
            req.computed = self.prefix.start(req.id, req.tokens)
            self._requests[req.id] = req
            self.running.append(req)

    def step(self) -> dict[int, int]:
        out = super().step()
        for req in self.running:  # pages that filled this step, found by requests admitted later
            self.prefix.insert(req.id, req.tokens[: req.computed])
        return out
