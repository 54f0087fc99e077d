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
  cache (tests/test_prefix_cache.py). Its decode steps take cascade attention where the batch shares a long
  enough prefix of pages (`cascade.CascadeChoice`).

The host's share: a prompt's pages are read from one bytes buffer of its int64 ids (sliced per page, not
converted per page), the batcher hands in the request's ids as a NumPy array (`Request.ids`: no list converted
per call), and a running sequence's pages are registered incrementally (the pages filled since the last step,
from the chain's last hash, while the step computes: `_launched`), so a step's bookkeeping follows its new
tokens, not the sequence's length. Before a request's first step, `walk` computes no hash: it finds each cached
page by what its hash digests (`by_key`: the parent's hash and the page's token bytes, one bytes key compared
whole by the dict) and reads the page's hash from the table; `start` gives the pages found their references in
one pass. A page's SHA-256 is computed once, by `insert` as it is registered (about 0.5 us a page, 1 ms for a
32k-token prompt's 2048 pages, while the step computes on a GPU). A 32k-token prompt 90 % cached, ms of CPU
time on a 2-core CPU (`scripts/serving_probe.py --host`, 2026-11-29): `walk` 1.61 -> 0.50 (a SHA-256 a page
before), `start` 0.32 -> 0.15; `insert` gained `by_key`'s entries (2048 pages: 2.9 -> 3.3). Since 2026-11-30 a
page found also brings the pages its sequence registered after it (`_Run`), checked against the prompt in one
comparison of their token bytes: `walk` 0.42 -> 0.14 ms in the step (0.085 alone); `insert` pays for the runs
(2048 pages: 2.72 -> 3.41 ms, while the step computes on a GPU).

Not here: pages of a sequence that rolls back (speculative decoding) are never cached partial, so rollback
never touches a cached page; SGLang's radix tree answers the same question with a tree of token runs (the hash
chain is the simpler structure to teach and to check, and what vLLM v1 uses).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from itertools import repeat

import numpy as np

from ..checks import check_int
from ..decode.batching import ContinuousBatcher
from ..decode.cache import OutOfPages, PageAllocator, PagedKVCache, SequencePages
from .cascade import CascadeChoice

__all__ = ["CachingPageAllocator", "PrefixCache", "PrefixCachingBatcher", "block_hash"]

ROOT_HASH = b""
_UNCUT = 1 << 62  # a run's `cut` while none of its pages was evicted


def _page_bytes(tokens, n: int, page_size: int, first: int = 0) -> bytes:
    """Pages first..n-1 of `tokens` (a list of ids or an int64 NumPy array) as one buffer of int64 bytes, page i
    at [(i - first) * page_size * 8, (i - first + 1) * page_size * 8)."""
    rows = tokens[first * page_size : n * page_size]
    return np.ascontiguousarray(rows, dtype=np.int64).tobytes()


def block_hash(parent: bytes, tokens) -> bytes:
    """The hash of a full page: SHA-256 of the previous page's hash (b"" for the first page) and the page's token
    ids as int64 (`tokens`: the ids, or their int64 bytes). 32 bytes; the same tokens after the same prefix
    always give the same hash."""
    if type(tokens) is not bytes:
        tokens = np.asarray(tokens, dtype=np.int64).tobytes()
    return hashlib.sha256(parent + tokens).digest()


class _Run:
    """Pages one sequence registered one after another (`PrefixCache.insert`), so page i + 1's parent is page i's
    hash; data: their token bytes end to end; cut: the place of the first page evicted since (its page id may be
    registered again, in another run), _UNCUT while none is. A run with a page evicted is never extended."""

    __slots__ = ("pages", "data", "hashes", "cut")

    def __init__(self):
        self.pages, self.data, self.hashes, self.cut = [], bytearray(), [], _UNCUT

    def add(self, page: int, h: bytes, row: bytes) -> None:
        self.pages.append(page)
        self.hashes.append(h)
        self.data += row

    def follow(self, j: int, data: bytes, at: int, n: int, step: int) -> int:
        """How many of the n pages after page j (not past `cut`) hold data[at:] page by page: the tokens compared
        at once."""
        n = min(n, self.cut - j - 1)
        if n <= 0:
            return 0
        start = (j + 1) * step
        if data[at : at + n * step] != self.data[start : start + n * step]:  # a prompt that leaves the run
            ours = np.frombuffer(data, np.int64, n * step // 8, at).reshape(n, -1)
            theirs = np.frombuffer(self.data, np.int64, n * step // 8, start).reshape(n, -1)
            n = int(np.argmin((ours == theirs).all(axis=1)))
        return n


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

    def allocate_pages(self, n: int) -> list[int]:
        """As n calls of `allocate`: the free pages first, then one evicted page at a time."""
        n = check_int("CachingPageAllocator.allocate_pages", "n", n, 0)
        pages = super().allocate_pages(min(n, len(self.free_list)))
        while len(pages) < n:
            pages.append(self.allocate())
        return pages


class PrefixCache:
    """The table of cached full pages of one `PagedKVCache` (whose allocator must be a `CachingPageAllocator`).

    by_hash: block hash -> page; entry: for each cached page its hash, its parent's hash and its token ids (int64
    bytes); by_key: parent's hash + token bytes -> page, the same pages keyed by what their hash digests (what
    `walk` looks up); idle: the cached pages no sequence holds (reference count 1: the cache's own), least
    recently used first; chain: for each running sequence, how many of its first pages are registered and the
    last one's hash (where `insert` goes on from)."""

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
        self.entry: dict[int, tuple[bytes, bytes, bytes]] = {}  # page -> (hash, parent hash, token bytes)
        self.by_key: dict[bytes, int] = {}  # parent hash + token bytes -> page (bytes: no object for the GC)
        self.idle: OrderedDict[int, None] = OrderedDict()
        self.chain: dict[object, tuple[int, bytes]] = {}  # sequence -> (pages registered, last hash)
        self.run_of: dict[int, tuple[_Run, int]] = {}  # registered page -> (its run, its place in it)
        self._open: dict[object, _Run] = {}  # sequence -> the run its next registered page may extend
        self.hits = self.lookups = self.evictions = 0  # tokens found / tokens asked for, pages evicted

    def walk(self, tokens, limit: int | None = None) -> tuple[list[int], bytes]:
        """(`match`'s pages, the hash of the last of them (b"" for none)). `tokens`: a list of ids or an int64
        NumPy array (the batcher's `Request.ids`, converted once per request).

        Each page is looked up in `by_key` by its parent's hash and its token bytes, one bytes key (every hash
        has the same length, so a key splits one way): what its block hash digests, compared whole by the dict,
        so a hit is the stored page's tokens and parent, and its hash (the next page's parent) is read from
        `entry`, not computed. The same pages as hashing each page and checking the hit (`by_hash`, notebook
        14's exercise), without a SHA-256 a page: a 32k-token prompt's 1843 cached pages took 1.61 ms that way,
        0.5 ms here (a 2-core CPU, 2026-11-29). A page found in a run (`run_of`: the pages one sequence registered
        one after another) brings the run's next pages with it, as many as hold the prompt's next tokens (one
        comparison of their bytes) and none past a page evicted since (`_Run.cut`): each one's parent is the one
        before it by construction, so they are what the page-by-page lookup finds (tests/test_prefix_cache.py);
        then the lookup goes on page by page. 1843 pages in one run: 0.085 ms."""
        pages, parent = [], ROOT_HASH
        n_full = len(tokens) // self.page_size if limit is None else min(limit, len(tokens) // self.page_size)
        if n_full == 0 or not self.by_hash:
            return pages, parent
        data, step = _page_bytes(tokens, n_full, self.page_size), 8 * self.page_size
        find, entry, run_of = self.by_key.get, self.entry, self.run_of
        at, end = 0, len(data)
        while at < end:
            page = find(parent + data[at : at + step])
            if page is None:
                break
            pages.append(page)
            parent = entry[page][0]
            at += step
            # the pages registered after it: taken together where they still hold these tokens
            if page in run_of:
                run, j = run_of[page]
                found = run.follow(j, data, at, min((end - at) // step, len(run.pages) - j - 1), step)
                if found:
                    pages += run.pages[j + 1 : j + 1 + found]
                    parent = run.hashes[j + found]
                    at += found * step
        return pages, parent

    def match(self, tokens, limit: int | None = None) -> list[int]:
        """The cached pages that hold the first full pages of `tokens`, in order, stopping at the first page not
        cached (or at `limit` pages). Each hit is checked against the page's stored tokens and parent hash."""
        return self.walk(tokens, limit)[0]

    def start(self, seq_id, tokens, found: tuple[list[int], bytes] | None = None) -> int:
        """Add sequence `seq_id` to the cache, starting on the cached pages of `tokens` (at least its last token
        is left to compute: its logits give the next token); `found`: what `walk` gave for these tokens and
        that limit, if the caller has it (no page evicted since). Returns how many tokens are already in the
        cache. The pages found are cached pages, each with the cache's own reference: they take one more each
        without `share_pages`' checks (1843 pages: 0.32 ms with them, 0.15 without, 2-core CPU, 2026-11-29)."""
        pages, parent = found or self.walk(tokens, limit=(len(tokens) - 1) // self.page_size)
        self.lookups += len(tokens)
        self.hits += len(pages) * self.page_size
        self.cache.add_sequence(seq_id)
        idle, refs = self.idle, self.cache.allocator.refs
        for page in pages:
            refs[page] += 1
        if idle:
            deque(map(idle.pop, pages, repeat(None)), maxlen=0)  # in use again: not evictable
        self.cache.seqs[seq_id] = SequencePages(list(pages), len(pages) * self.page_size)
        self.chain[seq_id] = (len(pages), parent)
        return len(pages) * self.page_size

    def insert(self, seq_id, tokens) -> None:
        """Register the full pages of sequence `seq_id`, whose cache holds `tokens` (its first tokens: a list of
        ids or an int64 NumPy array), so later requests find them. A page whose hash is already cached (another
        copy of the same prefix) is left as the sequence's own. Goes on from the pages registered before
        (`chain`): a full page never changes."""
        seq = self.cache.seqs[seq_id]
        n_full = min(len(tokens), seq.length) // self.page_size
        done, parent = self.chain.get(seq_id, (0, ROOT_HASH))
        if n_full == done:
            return
        if n_full < done:  # fewer full pages than registered: walk again from the first
            done, parent = 0, ROOT_HASH
        data, step = _page_bytes(tokens, n_full, self.page_size, done), 8 * self.page_size
        by_hash, by_key, entry, run_of, own = self.by_hash, self.by_key, self.entry, self.run_of, []
        # the run of the pages this sequence registered last, if it ends at page done - 1 and lost none
        run = self._open.get(seq_id)
        if run is not None and not (done and run.pages[-1] == seq.pages[done - 1] and run.cut == _UNCUT):
            run = None
        for page, at in zip(seq.pages[done:n_full], range(0, len(data), step)):
            row = data[at : at + step]
            h = block_hash(parent, row)
            if h not in by_hash and page not in entry:
                by_hash[h] = page
                entry[page] = (h, parent, row)
                by_key[parent + row] = page
                own.append(page)
                if run is None:
                    run = _Run()
                run_of[page] = (run, len(run.pages))
                run.add(page, h, row)
            else:  # a page of someone else's (or one registered before): the next registered page starts a run
                run = None
            parent = h
        if run is None:
            self._open.pop(seq_id, None)
        else:
            self._open[seq_id] = run
        self.cache.allocator.share_pages(own)  # the cache's own reference of each page it registered
        self.chain[seq_id] = (n_full, parent)

    def registered(self, seq_id) -> int:
        """How many of sequence `seq_id`'s first pages `insert` has gone over (0 for a sequence it does not know)."""
        return self.chain.get(seq_id, (0, ROOT_HASH))[0]

    def release(self, seq_id, tokens=None) -> None:
        """Free sequence `seq_id`, first registering its full pages if `tokens` (what its cache holds) is given.
        Its cached pages that no other sequence holds become idle (evictable, most recently used last); the rest
        return to the pool as usual."""
        if tokens is not None:
            self.insert(seq_id, tokens)
        pages = list(self.cache.seqs[seq_id].pages)
        self.chain.pop(seq_id, None)
        self._open.pop(seq_id, None)
        self._free(seq_id)
        refs, entry, idle = self.cache.allocator.refs, self.entry, self.idle
        for page in pages:
            if page in entry and refs[page] == 1:
                idle[page] = None
                idle.move_to_end(page)

    def evict(self, n: int) -> int:
        """Free up to `n` idle cached pages, least recently used first; returns how many were freed."""
        freed = 0
        while freed < n and self.idle:
            page, _ = self.idle.popitem(last=False)
            h, parent, row = self.entry.pop(page)
            del self.by_hash[h], self.by_key[parent + row]
            run, j = self.run_of.pop(page)
            run.cut = min(run.cut, j)
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
    side share them) and kept after their request ends until the pool needs them. Its decode steps choose
    cascade attention by themselves where the batch shares a long enough prefix (kv_view defaults to
    `CascadeChoice()`; kv_view=None keeps the paged kernel). Notebook 14."""

    def __init__(self, model, num_pages: int, page_size: int = 16, **kwargs):
        kwargs.setdefault("kv_view", CascadeChoice())
        super().__init__(model, num_pages, page_size, **kwargs)
        self.cache.allocator = CachingPageAllocator(num_pages)
        self.prefix = PrefixCache(self.cache)
        self._requests = {}

        def free_and_keep(seq_id):  # every path that ends a sequence (retire, preempt) keeps its full pages
            req = self._requests.pop(seq_id, None)
            self.prefix.release(seq_id, None if req is None else req.ids(0, req.computed))

        self.cache.free = free_and_keep

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            if req.id in self.swapped:  # back from host memory: its own pages, no lookup
                need = -(-(req.num_tokens + 1) // self.cache.page_size)
                if need > self.cache.allocator.num_free:
                    break
                self.waiting.pop(0)
                self._swap_in(req)
                self.running.append(req)
                continue
            ids = req.ids(0, req.num_tokens)
            found = self.prefix.walk(ids, limit=(len(ids) - 1) // self.cache.page_size)
            cached = found[0]
            need = -(-(len(ids) + 1) // self.cache.page_size) - len(cached)
            idle = self.prefix.idle
            idle_reused = sum(map(idle.__contains__, cached)) if idle else 0
            if need > self.cache.allocator.num_free - idle_reused:
                break
            self.waiting.pop(0)
            req.computed = self.prefix.start(req.id, ids, found)
            self._requests[req.id] = req
            self.running.append(req)

    def _swap_in(self, req) -> None:
        super()._swap_in(req)
        self._requests[req.id] = req  # its full pages are registered again as it goes on

    def _launched(self, plan) -> None:
        """Register the pages the step fills (found by requests admitted later) while it computes: after its
        launches, before its first tokens are read, so a prompt's hashing is not added to its time to first
        token on a GPU. Its K/V are written by then for any later step (the same stream). Every running request
        is looked at, as a step ends: one swapped in and left out of the step registers its pages too."""
        fed = {req.id: n for req, n in plan}
        for req in self.running:
            end = req.computed + fed.get(req.id, 0)
            if end // self.cache.page_size != self.prefix.registered(req.id):
                self.prefix.insert(req.id, req.ids(0, end))
