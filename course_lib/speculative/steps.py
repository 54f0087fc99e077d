"""Running a model over the paged cache several tokens at a time, and rolling the cache back (notebook 15).

Everything beyond one token per step needs two things from the serving stack of notebook 10:

- `forward_tokens(model, cache, feeds)`: ONE `model.forward_step` over several sequences, each fed any
  number of new tokens (a verification step: the pending token plus gamma drafts). `PagedKV.attend`
  already does causal attention of every new token over its own sequence's cache, bottom-right aligned.
- `truncate(cache, seq_id, length)`: the rollback of rejected tokens. The sequence's length shrinks and
  the pages past the new end are released (`PageAllocator.release` drops one reference: a page shared
  with another sequence stays alive for it). A kept, partly filled last page that another sequence
  shares is copied before the next write into it by `PagedKVCache.append` (copy-on-write), so a
  rollback never disturbs a neighbour. This lives here, by composition over `cache.seqs` and
  `cache.allocator`, not as a method of `PagedKVCache`.

attention="kernel" runs course_lib's paged split-KV decode kernel (`PagedKV`); attention="torch" reads
the very same pages through `TorchPagedKV`, with `decode_reference` (float64 PyTorch) doing the
arithmetic: on a CPU the Triton interpreter runs the kernel one program at a time, about a second per
step on this course's 2-core machine, too slow for a notebook that takes hundreds of steps.

CUDA graphs (cuda_graphs=True in the engine, a model on a GPU, the kernel path): a step of a few tokens
per sequence is bound by the CPU's launches (the capstone's plain step: 24.9 ms of host time for a few
ms of GPU work on an H200), so `forward_tokens` replays it through `decode.graphs.StepGraphs`, one graph
per (batch, tokens per sequence, table width). A step whose sequences bring different numbers of tokens
(an n-gram draft that found fewer drafts for one sequence; the last rounds) is padded at each sequence's
end to the longest (`padded_step`): causal attention keeps the real tokens blind to the pads, whose K/V
are rolled back (`truncate`) after the step. `step_cache` keeps the cache and its graphs on the model
between generations, so that a generation run once captures every graph the next identical one replays.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..checks import check_int
from ..decode import decode_reference
from ..decode.cache import PagedKVCache
from ..decode.graphs import StepGraphs
from ..decode.paged_kv import PagedKV

ATTENTION = ("kernel", "torch")


class TorchPagedKV(PagedKV):
    """`PagedKV` whose `attend` gathers each sequence's pages and attends in float64 PyTorch
    (`decode_reference`) instead of launching the Triton kernel: the same cache, writes and masking."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer, self.slots, k, v)
        padded = q.new_zeros(self.batch * self.tq, *q.shape[1:])
        padded[self.rows] = q
        table = self.block_table.long()  # (B, max_pages) -> (B, max_pages * page_size, Hkv, d)
        k_seq = self.cache.k_pages[layer][table].flatten(1, 2)
        v_seq = self.cache.v_pages[layer][table].flatten(1, 2)
        o, _ = decode_reference(
            padded.view(self.batch, self.tq, *q.shape[1:]), k_seq, v_seq, self.cache_seqlens
        )
        return o.to(q.device, q.dtype).view(self.batch * self.tq, *q.shape[1:])[self.rows]


def check_attention(where: str, attention: str) -> str:
    if attention not in ATTENTION:
        raise ValueError(f"{where}: attention must be one of {ATTENTION}, got {attention!r}")
    return attention


def check_graphs(where: str, model, attention: str, cuda_graphs) -> bool:
    """cuda_graphs must be a bool; True needs a model on a CUDA device and attention="kernel" (a graph
    replays the kernel path). Returns it."""
    if not isinstance(cuda_graphs, bool):
        raise TypeError(f"{where}: cuda_graphs must be True or False, got {cuda_graphs!r}")
    if cuda_graphs and torch.device(model.device).type != "cuda":
        raise ValueError(
            f"{where}: cuda_graphs=True replays steps as CUDA graphs, which need a model on a CUDA device; "
            f"this one is on {model.device} (leave cuda_graphs=False)"
        )
    if cuda_graphs and attention != "kernel":
        raise ValueError(
            f"{where}: cuda_graphs=True replays the kernel path: attention must be 'kernel', got {attention!r}"
        )
    return cuda_graphs


def new_cache(model, num_pages: int, page_size: int = 16) -> PagedKVCache:
    """An empty paged cache shaped for `model` (the serving interface's num_layers, num_kv_heads, ...)."""
    return PagedKVCache(
        model.num_layers, num_pages, page_size, model.num_kv_heads, model.head_dim, model.dtype, model.device
    )


@dataclass
class _Kept:
    cache: PagedKVCache
    graphs: StepGraphs
    made_for: tuple  # the model's (dtype, device) when the cache was made
    busy: bool = False


KEPT = "_kept_step_caches"  # the model's attribute: its caches with their graphs, between generations


def kept_pages(num_pages: int) -> int:
    """The pages of a kept cache made for a generation that needs num_pages: the next power of two, so
    that generations of nearby sizes (plain and speculative, gamma 1..4) share one cache and its graphs."""
    return 1 << max(0, num_pages - 1).bit_length()


@contextmanager
def step_cache(model, num_pages: int, page_size: int = 16, cuda_graphs: bool = False):
    """The paged cache of one generation of `model` (at least num_pages pages of page_size tokens) and, with
    cuda_graphs, the `StepGraphs` over it: yields (cache, graphs or None). Without graphs, a new cache.
    With them, a cache kept on the model (its attribute KEPT) from an earlier generation when one is free
    and large enough (the smallest such), else a new one of `kept_pages` pages, kept for the next: its
    graphs, captured at the first step of each shape, are replayed by later generations. On leaving, every
    sequence still in the cache is freed. The graphs read the model's weights where they were at capture
    (in-place updates are seen); caches of another dtype or device than the model's now are dropped."""
    if not cuda_graphs:
        yield new_cache(model, num_pages, page_size), None
        return
    now = (model.dtype, torch.device(model.device))
    kept = [k for k in getattr(model, KEPT, []) if k.made_for == now]
    setattr(model, KEPT, kept)
    pages = lambda k: k.cache.allocator.num_pages
    fits = [k for k in kept if not k.busy and k.cache.page_size == page_size and pages(k) >= num_pages]
    if fits:
        entry = min(fits, key=pages)
    else:
        cache = new_cache(model, kept_pages(num_pages), page_size)
        entry = _Kept(cache, StepGraphs(model, cache), now)
        kept.append(entry)
    entry.busy = True
    try:
        yield entry.cache, entry.graphs
    finally:
        for s in list(entry.cache.seqs):
            entry.cache.free(s)
        entry.busy = False


def padded_step(live, starts: list[int], tokens: int) -> tuple[list[int], list[int], list[int]]:
    """The inputs of a step in which every sequence of `live` ((seq_id, its n_i <= tokens new tokens), the
    first at position starts[i]) brings `tokens` tokens: each padded at its end by its last token at its
    last position (a pad's output is dropped and its K/V rolled back). Returns (token ids, positions, rows
    of the B * tokens outputs that are real tokens'), each a list."""
    ids, pos, keep = [], [], []
    for b, ((_, t), a) in enumerate(zip(live, starts)):
        pad = tokens - len(t)
        ids += list(t) + [t[-1]] * pad
        pos += list(range(a, a + len(t))) + [a + len(t) - 1] * pad
        keep += range(b * tokens, b * tokens + len(t))
    return ids, pos, keep


@torch.no_grad()
def forward_tokens(
    model, cache: PagedKVCache, feeds, attention: str = "kernel", graphs: StepGraphs | None = None
) -> list[torch.Tensor]:
    """One `model.forward_step` over every sequence of `feeds`, a list of (seq_id, new tokens); each
    sequence's tokens go at the positions after its cached length, their K/V into new slots of `cache`.
    Returns each sequence's logits (n_i, vocab) float32, in the order of `feeds` (a sequence fed no
    token gets a (0, vocab) tensor and takes no part in the step).

    graphs: the `StepGraphs` over `cache` (the kernel path): a step whose longest feed has at most
    graphs.max_tokens tokens is replayed as a CUDA graph, shorter feeds padded (module docstring); the
    logits returned are copies, not the graph's memory. Longer steps (prefills) run as usual."""
    check_attention("forward_tokens", attention)
    if graphs is not None and attention != "kernel":
        raise ValueError(f"forward_tokens: a CUDA graph replays the kernel path, not attention={attention!r}")
    live = [(s, list(t)) for s, t in feeds if len(t) > 0]
    if not live:
        return [torch.empty(0, 0) for _ in feeds]
    starts = [cache.seqs[s].length if s in cache.seqs else 0 for s, _ in live]
    lens = [len(t) for _, t in live]
    tokens = max(lens)
    if graphs is not None and tokens <= graphs.max_tokens:
        slots = torch.cat([cache.append(s, tokens) for s, _ in live])
        ids, pos, keep = padded_step(live, starts, tokens)
        logits = graphs.step([s for s, _ in live], ids, pos, slots)
        padded = len(keep) < len(ids)
        logits = (logits[torch.tensor(keep, device=logits.device)] if padded else logits.clone()).float()
        for (s, _), a, n in zip(live, starts, lens):
            if n < tokens:
                truncate(cache, s, a + n)
    else:
        slots = torch.cat([cache.append(s, n) for (s, _), n in zip(live, lens)])
        kv_class = PagedKV if attention == "kernel" else TorchPagedKV
        kv = kv_class.for_step(cache, [s for s, _ in live], lens, slots)
        device = model.device
        ids = torch.tensor([x for _, t in live for x in t], dtype=torch.int64, device=device)
        pos = torch.tensor([p for a, n in zip(starts, lens) for p in range(a, a + n)], device=device)
        logits = model.forward_step(ids, pos, kv).float()
    pieces = iter(logits.split(lens))
    return [next(pieces) if len(t) > 0 else logits[:0] for _, t in feeds]


def truncate(cache: PagedKVCache, seq_id: int, length: int) -> int:
    """Shrink sequence `seq_id` to its first `length` tokens (0 <= length <= its length): pages wholly
    past the new end are released (a shared page loses one reference and stays with its other owners).
    Returns the number of page references released. Notebook 15."""
    if seq_id not in cache.seqs:
        raise ValueError(f"truncate: sequence {seq_id!r} is not in the cache")
    s = cache.seqs[seq_id]
    length = check_int("truncate", "length", length, 0)
    if length > s.length:
        raise ValueError(f"truncate: length {length} is more than sequence {seq_id!r}'s {s.length} tokens")
    keep = -(-length // cache.page_size)
    dropped = s.pages[keep:]
    for page in dropped:
        cache.allocator.release(page)
    del s.pages[keep:]
    s.length = length
    return len(dropped)
