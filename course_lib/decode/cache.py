"""A paged KV cache: page pools, a block table per sequence and the allocator behind them (notebook 10).

The pool of one layer is (num_pages, page_size, Hkv, d) for K and the same for V (the layout that
`paged.paged_decode_attention` reads). A sequence owns a list of page ids, its row of the block table;
token i of the sequence lives in page pages[i // page_size] at slot i % page_size. Memory is taken a
page at a time as a sequence grows, so at most page_size - 1 slots per sequence sit unused, instead of
the (max length - length) a contiguous reservation wastes.

`PageAllocator` hands out page ids from a free list and counts references: a forked sequence shares its
parent's pages (a shared prompt prefix is stored once); the first write into a shared, partly filled
page copies it first (copy-on-write), as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class OutOfPages(RuntimeError):
    """The pool has no free page left."""


class PageAllocator:
    """Page ids 0..num_pages-1: a free list and a reference count per page. Notebook 10."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"PageAllocator: num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.free_list = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self.refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self.free_list)

    def allocate(self) -> int:
        """A free page with reference count 1; raises OutOfPages when none is left."""
        if not self.free_list:
            raise OutOfPages(f"all {self.num_pages} pages are in use")
        page = self.free_list.pop()
        self.refs[page] = 1
        return page

    def share(self, page: int) -> None:
        """One more owner of `page` (a forked sequence)."""
        if self.refs[page] < 1:
            raise ValueError(f"page {page} is free; only a page in use can be shared")
        self.refs[page] += 1

    def release(self, page: int) -> None:
        """One owner fewer; the page returns to the free list when none is left."""
        if self.refs[page] < 1:
            raise ValueError(f"page {page} is already free")
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free_list.append(page)


@dataclass
class SequencePages:
    """One sequence's pages (its block-table row) and its length in tokens."""

    pages: list[int] = field(default_factory=list)
    length: int = 0


class PagedKVCache:
    """K/V page pools for every layer, the allocator and each sequence's pages. Notebook 10.

    k_pages[l], v_pages[l]: (num_pages, page_size, num_kv_heads, head_dim) tensors of `dtype` on `device`."""

    def __init__(self, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device):
        if page_size < 1:
            raise ValueError(f"PagedKVCache: page_size must be >= 1, got {page_size}")
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.page_size = page_size
        self.k_pages = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_pages = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.allocator = PageAllocator(num_pages)
        self.seqs: dict[int, SequencePages] = {}

    @property
    def device(self) -> torch.device:
        """The device of the page pools."""
        return self.k_pages[0].device

    def add_sequence(self, seq_id: int) -> None:
        """Start an empty sequence `seq_id` (no pages yet: `append` allocates them)."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} already exists")
        self.seqs[seq_id] = SequencePages()

    def fork(self, parent: int, child: int) -> None:
        """`child` starts as a copy of `parent` that shares every page (no data copied)."""
        src = self.seqs[parent]
        for page in src.pages:
            self.allocator.share(page)
        self.seqs[child] = SequencePages(list(src.pages), src.length)

    def pages_needed(self, seq_id: int, n: int) -> int:
        """New pages that appending n tokens to `seq_id` takes (copy-on-write included)."""
        s = self.seqs[seq_id]
        have = len(s.pages) * self.page_size
        extra = max(0, -(-(s.length + n - have) // self.page_size))
        partial = s.length % self.page_size and n > 0
        cow = bool(partial and self.allocator.refs[s.pages[-1]] > 1)
        return extra + cow

    def append(self, seq_id: int, n: int) -> torch.Tensor:
        """Make room for n new tokens of `seq_id`; returns their slots (n,) int64, slot = page *
        page_size + offset (an index into the pool viewed as (num_pages * page_size, Hkv, d)).
        Allocates pages as needed and copies a shared, partly filled last page before writing into it."""
        if self.pages_needed(seq_id, n) > self.allocator.num_free:
            raise OutOfPages(f"sequence {seq_id} needs {self.pages_needed(seq_id, n)} pages for {n} tokens")
        s = self.seqs[seq_id]
        if n > 0 and s.length % self.page_size and self.allocator.refs[s.pages[-1]] > 1:
            old = s.pages[-1]
            new = self.allocator.allocate()
            for pool in self.k_pages + self.v_pages:
                pool[new].copy_(pool[old])
            self.allocator.release(old)
            s.pages[-1] = new
        slots = []
        for i in range(s.length, s.length + n):
            if i // self.page_size == len(s.pages):
                s.pages.append(self.allocator.allocate())
            slots.append(s.pages[i // self.page_size] * self.page_size + i % self.page_size)
        s.length += n
        return torch.tensor(slots, dtype=torch.int64)

    def free(self, seq_id: int) -> None:
        """Give back the sequence's pages (shared ones stay with their other owners)."""
        for page in self.seqs.pop(seq_id).pages:
            self.allocator.release(page)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (T, Hkv, d) of T new tokens at `slots` (T,) of layer `layer`."""
        for pool, x in ((self.k_pages[layer], k), (self.v_pages[layer], v)):
            pool.view(-1, *pool.shape[2:])[slots.to(pool.device)] = x.to(pool.dtype)

    def block_table(self, seq_ids, max_pages: int | None = None, device=None) -> torch.Tensor:
        """(B, max_pages) int32 block table of the sequences (unused entries 0; max_pages defaults to the
        longest row), on `device` (default: the pools' device)."""
        rows = [self.seqs[i].pages for i in seq_ids]
        width = max([len(r) for r in rows] + [1]) if max_pages is None else max_pages
        table = torch.zeros(len(rows), width, dtype=torch.int32)
        for b, r in enumerate(rows):
            table[b, : len(r)] = torch.tensor(r, dtype=torch.int32)
        return table.to(self.device if device is None else device)

    def seqlens(self, seq_ids, device=None) -> torch.Tensor:
        """(B,) int32 lengths of the sequences, on `device` (default: the pools' device)."""
        lens = [self.seqs[i].length for i in seq_ids]
        return torch.tensor(lens, dtype=torch.int32).to(self.device if device is None else device)
