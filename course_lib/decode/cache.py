"""A paged KV cache: page pools, a block table per sequence and the allocator behind them (notebook 10).

The pool of one layer is (num_pages, page_size, Hkv, d) for K and the same for V (the layout that
`api.paged_decode_attention` reads). A sequence owns a list of page ids, its row of the block table;
token i of the sequence lives in page pages[i // page_size] at slot i % page_size. Memory is taken a
page at a time as a sequence grows, so at most page_size - 1 slots per sequence sit unused, instead of
the (max length - length) a contiguous reservation wastes.

`PageAllocator` hands out page ids from a free list and counts references: a forked sequence shares its
parent's pages (a shared prompt prefix is stored once); the first write into a shared, partly filled
page copies it first (copy-on-write), as vLLM does.

`swap_out` / `swap_in` move a sequence's pages to host memory and back (a batcher's swap preemption,
notebook 14): the K/V come back bit for bit, into whatever pages are free then.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..checks import check_int


class OutOfPages(RuntimeError):
    """The pool has no free page left."""


class PageAllocator:
    """Page ids 0..num_pages-1: a free list and a reference count per page. Notebook 10."""

    def __init__(self, num_pages: int):
        num_pages = check_int("PageAllocator", "num_pages", num_pages, 1)
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

    def allocate_pages(self, n: int) -> list[int]:
        """n pages as n calls of `allocate` hand them out, in that order; OutOfPages (none taken) when fewer are
        free. One slice of the free list, not a call per page."""
        n = check_int("PageAllocator.allocate_pages", "n", n, 0)
        if n > len(self.free_list):
            raise OutOfPages(f"{n} pages asked for, {len(self.free_list)} of {self.num_pages} are free")
        if n == 0:
            return []
        pages = self.free_list[: -n - 1 : -1]
        del self.free_list[-n:]
        refs = self.refs
        for page in pages:
            refs[page] = 1
        return pages

    def _page(self, page, where: str) -> int:
        """`page` as an int in 0..num_pages-1 (no negative indexing); else TypeError / ValueError."""
        page = check_int(where, "page", page, 0)
        if page >= self.num_pages:
            raise ValueError(f"{where}: page {page} is out of range; pages are 0..{self.num_pages - 1}")
        return page

    def _pages(self, pages, where: str) -> list[int]:
        """`pages` (ints, or a 1-D integer NumPy array) as a list of page ids, checked in one pass (builtins over
        the list, not `_page` per page); the first bad one raises `_page`'s error."""
        if isinstance(pages, np.ndarray) and pages.ndim == 1 and pages.dtype.kind in "iu":
            ids = pages.tolist()
        else:
            ids = list(pages)
            if not set(map(type, ids)) <= {int}:  # a bool, a NumPy int, not an int: per page
                return [self._page(page, where) for page in ids]
        if ids and (min(ids) < 0 or max(ids) >= self.num_pages):
            for page in ids:
                self._page(page, where)
        return ids

    def share(self, page: int) -> None:
        """One more owner of `page` (a forked sequence)."""
        page = self._page(page, "PageAllocator.share")
        if self.refs[page] < 1:
            raise ValueError(f"page {page} is free; only a page in use can be shared")
        self.refs[page] += 1

    def share_pages(self, pages) -> None:
        """`share` of each page of `pages` (a page listed twice gains two owners), checked at once before any count
        changes: a free page among them changes nothing and raises. A 2048-page prefix: 0.38 ms as calls of
        `share`, 0.19 here (a 2-core CPU)."""
        ids = self._pages(pages, "PageAllocator.share_pages")
        refs = self.refs
        if ids and min(map(refs.__getitem__, ids)) < 1:
            page = next(page for page in ids if refs[page] < 1)
            raise ValueError(f"page {page} is free; only a page in use can be shared")
        for page in ids:
            refs[page] += 1

    def release(self, page: int) -> None:
        """One owner fewer; the page returns to the free list when none is left."""
        page = self._page(page, "PageAllocator.release")
        if self.refs[page] < 1:
            raise ValueError(
                f"page {page} is free (released already, or never allocated); only a page in use can be released"
            )
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free_list.append(page)

    def release_pages(self, pages) -> None:
        """`release` of each page of `pages` in order (the pages left without an owner join the free list in that
        order), checked at once before any count changes: a free page among them changes nothing and raises.
        A page listed twice takes the calls of `release` one by one."""
        ids = self._pages(pages, "PageAllocator.release_pages")
        refs = self.refs
        if len(set(ids)) < len(ids):
            for page in ids:
                self.release(page)
            return
        if ids and min(map(refs.__getitem__, ids)) < 1:
            page = next(page for page in ids if refs[page] < 1)
            raise ValueError(
                f"page {page} is free (released already, or never allocated); only a page in use can be released"
            )
        for page in ids:
            refs[page] -= 1
        self.free_list.extend([page for page in ids if refs[page] == 0])


@dataclass
class SequencePages:
    """One sequence's pages (its block-table row) and its length in tokens."""

    pages: list[int] = field(default_factory=list)
    length: int = 0


@dataclass
class SwappedSequence:
    """A sequence's K/V in host memory (`PagedKVCache.swap_out`): k, v (num_layers, pages, page_size, Hkv, d) in
    the pools' dtype, pinned when the pools are on a GPU (read them on the host only after a sync), and the
    sequence's length in tokens."""

    k: torch.Tensor
    v: torch.Tensor
    length: int

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        """Host bytes held (K and V)."""
        return 2 * self.k.numel() * self.k.element_size()


class PagedKVCache:
    """K/V page pools for every layer, the allocator and each sequence's pages. Notebook 10.

    k_pages[l], v_pages[l]: (num_pages, page_size, num_kv_heads, head_dim) tensors of `dtype` on `device`."""

    def __init__(self, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device):
        where = "PagedKVCache"
        num_layers, num_pages, page_size, num_kv_heads, head_dim = (
            check_int(where, name, value, 1)
            for name, value in zip(
                ("num_layers", "num_pages", "page_size", "num_kv_heads", "head_dim"),
                (num_layers, num_pages, page_size, num_kv_heads, head_dim),
            )
        )
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(
                f"{where}: dtype must be a floating torch.dtype (e.g. torch.float16), got {dtype!r}"
            )
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

    def _seq(self, seq_id, where: str) -> SequencePages:
        """The pages of sequence `seq_id`; a ValueError naming the known ids if there is none."""
        if seq_id not in self.seqs:
            known = list(self.seqs)
            known = f"{known[:8]}"[:-1] + ", ...]" if len(known) > 8 else f"{known}"
            raise ValueError(
                f"{where}: sequence {seq_id!r} is not in the cache (sequences: {known}); "
                f"add_sequence({seq_id!r}) first"
            )
        return self.seqs[seq_id]

    def add_sequence(self, seq_id: int) -> None:
        """Start an empty sequence `seq_id` (no pages yet: `append` allocates them)."""
        if seq_id in self.seqs:
            raise ValueError(f"PagedKVCache.add_sequence: sequence {seq_id!r} already exists")
        self.seqs[seq_id] = SequencePages()

    def fork(self, parent: int, child: int) -> None:
        """`child` starts as a copy of `parent` that shares every page (no data copied)."""
        where = "PagedKVCache.fork"
        src = self._seq(parent, where)
        if child == parent:
            raise ValueError(
                f"{where}: child and parent are both sequence {child!r}; the child must be a new id"
            )
        if child in self.seqs:
            raise ValueError(
                f"{where}: child sequence {child!r} already exists; free it first or pick a new id"
            )
        self.allocator.share_pages(src.pages)
        self.seqs[child] = SequencePages(list(src.pages), src.length)

    def pages_needed(self, seq_id: int, n: int) -> int:
        """New pages that appending n tokens to `seq_id` takes (copy-on-write included)."""
        n = check_int("PagedKVCache.pages_needed", "n", n, 0)
        s = self._seq(seq_id, "PagedKVCache.pages_needed")
        have = len(s.pages) * self.page_size
        extra = max(0, -(-(s.length + n - have) // self.page_size))
        partial = s.length % self.page_size and n > 0
        cow = bool(partial and self.allocator.refs[s.pages[-1]] > 1)
        return extra + cow

    def append(self, seq_id: int, n: int) -> torch.Tensor:
        """Make room for n new tokens of `seq_id`; returns their slots (n,) int64, slot = page *
        page_size + offset (an index into the pool viewed as (num_pages * page_size, Hkv, d)).
        Allocates pages as needed and copies a shared, partly filled last page before writing into it."""
        n = check_int("PagedKVCache.append", "n", n, 0)
        s = self._seq(seq_id, "PagedKVCache.append")
        if self.pages_needed(seq_id, n) > self.allocator.num_free:
            raise OutOfPages(f"sequence {seq_id} needs {self.pages_needed(seq_id, n)} pages for {n} tokens")
        if n > 0 and s.length % self.page_size and self.allocator.refs[s.pages[-1]] > 1:
            old = s.pages[-1]
            new = self.allocator.allocate()
            for pool in self.k_pages + self.v_pages:
                pool[new].copy_(pool[old])
            self.allocator.release(old)
            s.pages[-1] = new
        first, end, size = s.length, s.length + n, self.page_size
        s.pages.extend(self.allocator.allocate_pages(max(0, -(-end // size) - len(s.pages))))
        # token t's slot is pages[t // size] * size + t % size: every slot of the pages it touches at once in
        # NumPy, then the run of them it writes. A 32k-token append: 15 ms a token at a time in Python, 2.5 ms a
        # page at a time, 0.1 ms here (a 2-core CPU)
        lo = first // size
        pages = np.asarray(s.pages[lo : -(-end // size)], dtype=np.int64)
        slots = (pages[:, None] * size + np.arange(size, dtype=np.int64)).ravel()
        s.length = end
        return torch.from_numpy(slots[first - lo * size : end - lo * size])

    def free(self, seq_id: int) -> None:
        """Give back the sequence's pages (shared ones stay with their other owners)."""
        self._seq(seq_id, "PagedKVCache.free")
        self.allocator.release_pages(self.seqs.pop(seq_id).pages)

    def swap_out(self, seq_id: int) -> SwappedSequence:
        """Copy sequence `seq_id`'s K/V to host memory, then give its pages back through `self.free` (which a
        batcher may route through its own bookkeeping, as the prefix cache does). Host memory is page-locked
        (pinned) when the pools are on a GPU, so the copies are queued on the stream without a sync; they
        finish before any later kernel of that stream writes into the pages. Returns the `SwappedSequence`
        that `swap_in` takes. Shared pages are copied too (they come back as the sequence's own)."""
        s = self._seq(seq_id, "PagedKVCache.swap_out")
        gpu = self.device.type == "cuda"
        index = torch.tensor(s.pages, dtype=torch.int64, device=self.device)
        shape = (len(self.k_pages), len(s.pages), *self.k_pages[0].shape[1:])
        dtype = self.k_pages[0].dtype
        k = torch.empty(shape, dtype=dtype, pin_memory=gpu)
        v = torch.empty(shape, dtype=dtype, pin_memory=gpu)
        for layer, (k_pool, v_pool) in enumerate(zip(self.k_pages, self.v_pages)):
            k[layer].copy_(k_pool[index], non_blocking=gpu)
            v[layer].copy_(v_pool[index], non_blocking=gpu)
        swapped = SwappedSequence(k, v, s.length)
        self.free(seq_id)
        return swapped

    def swap_in(self, seq_id: int, swapped: SwappedSequence) -> None:
        """Start sequence `seq_id` again from `swapped` (what `swap_out` returned): as many pages as it held, taken
        from the free list now, filled with its K/V; its length as it was. OutOfPages (nothing changed) when
        the pool has too few free pages."""
        where = "PagedKVCache.swap_in"
        if seq_id in self.seqs:
            raise ValueError(f"{where}: sequence {seq_id!r} already exists")
        if not isinstance(swapped, SwappedSequence):
            raise TypeError(f"{where}: swapped must be what swap_out returned, got {type(swapped).__name__}")
        per_page = (len(self.k_pages), *self.k_pages[0].shape[1:])
        got = (swapped.k.shape[0], *swapped.k.shape[2:])
        if got != per_page or swapped.k.dtype != self.k_pages[0].dtype:
            raise ValueError(
                f"{where}: swapped pages of shape {tuple(swapped.k.shape)} ({swapped.k.dtype}) do not fit this "
                f"cache's (layers, page_size, Hkv, d) = {per_page} ({self.k_pages[0].dtype})"
            )
        n = swapped.num_pages
        if n > self.allocator.num_free:
            raise OutOfPages(
                f"sequence {seq_id} needs {n} pages to swap in, {self.allocator.num_free} are free"
            )
        pages = self.allocator.allocate_pages(n)
        index = torch.tensor(pages, dtype=torch.int64, device=self.device)
        gpu = self.device.type == "cuda"
        for layer, (k_pool, v_pool) in enumerate(zip(self.k_pages, self.v_pages)):
            k_pool[index] = swapped.k[layer].to(self.device, non_blocking=gpu)
            v_pool[index] = swapped.v[layer].to(self.device, non_blocking=gpu)
        self.seqs[seq_id] = SequencePages(pages, swapped.length)

    def write(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, validate: bool = True
    ) -> None:
        """Store k, v (T, Hkv, d) of T new tokens at `slots` (T,) of layer `layer`. Slots on the CPU (as
        `append` returns them) are checked to lie in pages that a sequence holds (`check_slots`); slots already on
        a GPU are not (reading them would sync, and a step replayed as a CUDA graph writes through here).
        validate=False skips that check: a step's view whose slots were checked once for every layer
        (`paged_kv.PagedKV`)."""
        layer = check_int("PagedKVCache.write", "layer", layer, 0)
        if layer >= len(self.k_pages):
            raise ValueError(
                f"PagedKVCache.write: layer {layer} is out of range; layers are 0..{len(self.k_pages) - 1}"
            )
        per_token = tuple(self.k_pages[layer].shape[2:])  # (Hkv, d)
        if not (
            isinstance(slots, torch.Tensor) and slots.dim() == 1 and slots.dtype in (torch.int32, torch.int64)
        ):
            raise TypeError(
                f"PagedKVCache.write: slots must be a (T,) int64 or int32 tensor (from append), got {slots!r}"
            )
        expected = (slots.shape[0], *per_token)
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != expected:
                raise ValueError(
                    f"PagedKVCache.write: {name} must have shape (T, Hkv, d) = {expected} for {slots.shape[0]} "
                    f"slots; got {tuple(getattr(x, 'shape', ())) or type(x).__name__}"
                )
        if validate and slots.device.type == "cpu":
            self.check_slots(slots)
        slots = slots.to(self.k_pages[layer].device)
        for pool, x in ((self.k_pages[layer], k), (self.v_pages[layer], v)):
            flat = pool.view(-1, *pool.shape[2:])
            # int64 slots: index_copy_, the host's cheaper call (both copies 31 against 45-61 us, an H200's host)
            if slots.dtype == torch.int64:
                flat.index_copy_(0, slots, x.to(pool.dtype))
            else:
                flat[slots] = x.to(pool.dtype)

    def check_slots(self, slots: torch.Tensor) -> None:
        """Every slot of `slots` (a CPU tensor) in [0, num_pages x page_size), in a page some sequence holds (a
        ValueError otherwise)."""
        total, ids = self.allocator.num_pages * self.page_size, slots.tolist()
        bad = [i for i in ids if not 0 <= i < total]
        if bad:
            raise ValueError(
                f"PagedKVCache.write: slots {bad[:5]} are outside the pool's [0, {total}) "
                f"({self.allocator.num_pages} pages of {self.page_size} tokens); take slots from append()"
            )
        unheld = sorted({i // self.page_size for i in ids if self.allocator.refs[i // self.page_size] == 0})
        if unheld:
            raise ValueError(
                f"PagedKVCache.write: slots fall in pages {unheld[:5]}, which no sequence holds; "
                "take slots from append()"
            )

    def block_table(self, seq_ids, max_pages: int | None = None, device=None) -> torch.Tensor:
        """(B, max_pages) int32 block table of the sequences (unused entries 0; max_pages defaults to the
        longest row), on `device` (default: the pools' device)."""
        table = self.block_table_array(seq_ids, max_pages)
        return torch.from_numpy(table).to(self.device if device is None else device)

    def block_table_array(self, seq_ids, max_pages: int | None = None) -> np.ndarray:
        """`block_table` as a NumPy array on the host (what `paged_kv.to_device` copies with a step's other arrays)."""
        where = "PagedKVCache.block_table"
        rows = [self._seq(i, where).pages for i in seq_ids]
        if max_pages is None:
            width = max([len(r) for r in rows] + [1])
        else:
            width = check_int(where, "max_pages", max_pages, 0)
            for i, r in zip(seq_ids, rows):
                if len(r) > width:
                    raise ValueError(
                        f"{where}: sequence {i!r} holds {len(r)} pages, more than max_pages={width}"
                    )
        # filled in NumPy: a row of 2048 pages took 148 us through torch.tensor, 43 us here (a 2-core CPU)
        table = np.zeros((len(rows), width), dtype=np.int32)
        for b, r in enumerate(rows):
            table[b, : len(r)] = r
        return table

    def seqlens(self, seq_ids, device=None) -> torch.Tensor:
        """(B,) int32 lengths of the sequences, on `device` (default: the pools' device)."""
        return torch.from_numpy(self.seqlens_array(seq_ids)).to(self.device if device is None else device)

    def seqlens_array(self, seq_ids) -> np.ndarray:
        """`seqlens` as a NumPy array on the host."""
        return np.asarray([self._seq(i, "PagedKVCache.seqlens").length for i in seq_ids], dtype=np.int32)
