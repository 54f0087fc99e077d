"""Decode steps replayed as CUDA graphs: the serving loop's launch cost paid once (notebook 10).

A decode step runs every layer of the model over one new token per sequence. Its GPU work is small
(the capstone's 16-layer model at batch 8: about 2 ms) but it takes a few hundred kernel launches,
each costing the CPU tens of microseconds in Python, PyTorch and Triton, so a plain step is bound by
the CPU (about 17 ms for that model). A CUDA graph records the launches of one step once and replays
them with a single call; that is what serving engines (vLLM, SGLang) do for their decode steps.

A graph replays fixed kernels on fixed memory, so `DecodeGraphs` keeps, per batch shape, one set of
input tensors (token ids, positions, the slots where the new K/V go, the block table, the lengths) and
the output logits at fixed addresses: a step copies its inputs into them and replays. What fixes the
recorded launches is the shape: the batch size B and the block table's width, which sets the
decode kernel's plan (`heuristics.decode_plan`). The width is padded up to a power of two pages
(`table_width`), so a growing batch is recaptured only when its longest sequence doubles. Lengths,
page ids and positions are read by the kernels from those tensors at replay, so one graph serves
every step of that shape. Only steps in which every sequence brings one token are replayed; a step
with a prefill chunk runs as it is (its token count changes from step to step).

Capturing a shape (`course_lib.perf.timing.graphed`): the step first runs twice as usual on the fixed
tensors (which compiles any kernel not yet compiled and writes the step's K/V into the cache), is then
recorded, and is replayed for its result; each run writes the same K/V. All graphs share one memory
pool: they never run at the same time, and each step's logits are read before the next replay.
"""

from __future__ import annotations

import torch

from ..perf.timing import graphed
from .cache import PagedKVCache
from .paged_kv import PagedKV


def table_width(pages: int) -> int:
    """Block-table width (pages per row) of a graph whose longest sequence has `pages` pages: the next
    power of two, at least 1."""
    return 1 << max(0, pages - 1).bit_length()


class _Graph:
    """One captured decode step of B sequences over a block table `width` pages wide."""

    def __init__(self, model, cache: PagedKVCache, batch: int, width: int, pool):
        device = model.device
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(batch, dtype=torch.int64, device=device)
        self.slots = torch.zeros(batch, dtype=torch.int64, device=device)
        self.kv = PagedKV(
            cache,
            torch.zeros(batch, width, dtype=torch.int32, device=device),
            torch.zeros(batch, dtype=torch.int32, device=device),
            self.slots,
            torch.arange(batch, dtype=torch.int64, device=device),  # one token per sequence: row b
            1,
        )
        self.model, self.pool, self.replay, self.logits = model, pool, None, None

    def fill(self, seq_ids, tokens, positions, slots) -> None:
        cache, kv = self.kv.cache, self.kv
        self.tokens.copy_(torch.tensor(tokens, dtype=torch.int64), non_blocking=True)
        self.positions.copy_(torch.tensor(positions, dtype=torch.int64), non_blocking=True)
        self.slots.copy_(slots, non_blocking=True)
        kv.block_table.copy_(
            cache.block_table(seq_ids, kv.block_table.shape[1], device="cpu"), non_blocking=True
        )
        kv.cache_seqlens.copy_(cache.seqlens(seq_ids, device="cpu"), non_blocking=True)

    def _forward(self) -> None:
        self.logits = self.model.forward_step(self.tokens, self.positions, self.kv)

    def run(self) -> torch.Tensor:
        if self.replay is None:  # first use: run as usual, then record (the last run's logits stay)
            self.replay = graphed(self._forward, pool=self.pool)
        self.replay()
        return self.logits


class DecodeGraphs:
    """CUDA graphs of a model's decode steps over a paged cache, one per (batch size, table width).

    `step(seq_ids, tokens, positions, slots)` runs the step in which sequence seq_ids[i] brings token
    tokens[i] at position positions[i], its K/V going to slot slots[i] (as `PagedKVCache.append` gave),
    and returns the logits (B, vocab) (fixed memory: read them before the next step)."""

    def __init__(self, model, cache: PagedKVCache):
        if torch.device(model.device).type != "cuda":
            raise ValueError(f"DecodeGraphs: CUDA graphs need a model on a CUDA device, got {model.device}")
        self.model, self.cache = model, cache
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.replays = 0  # steps served by a replay

    def step(self, seq_ids: list[int], tokens: list[int], positions: list[int], slots: torch.Tensor):
        width = table_width(max(len(self.cache.seqs[i].pages) for i in seq_ids))
        key = (len(seq_ids), width)
        if key not in self.graphs:
            self.graphs[key] = _Graph(self.model, self.cache, *key, self.pool)
        graph = self.graphs[key]
        graph.fill(seq_ids, tokens, positions, slots)
        self.replays += 1
        return graph.run()
