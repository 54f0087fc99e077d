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

`StepGraphs`, which `DecodeGraphs` specialises to T = 1, replays steps in which each of B sequences
brings the same number T of tokens, one graph per (B, T, width): notebook 15's verification steps (the
pending token and gamma drafts, T = gamma + 1 query rows per sequence, `PagedKV`'s Tq) and its draft
models' steps. Every sequence of a replayed step brings exactly T tokens; a step with ragged counts
is not replayed (`speculative.steps.forward_tokens` pads it to its longest sequence, or runs it as usual).

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
    """One captured step of B sequences, T tokens each, over a block table `width` pages wide."""

    def __init__(self, model, cache: PagedKVCache, batch: int, tokens: int, width: int, pool):
        device = model.device
        n = batch * tokens
        self.tokens = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.zeros(n, dtype=torch.int64, device=device)
        self.kv = PagedKV(
            cache,
            torch.zeros(batch, width, dtype=torch.int32, device=device),
            torch.zeros(batch, dtype=torch.int32, device=device),
            self.slots,
            torch.arange(n, dtype=torch.int64, device=device),  # T tokens per sequence: no padding rows
            tokens,
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


def step_key(cache: PagedKVCache, seq_ids: list[int], tokens: int) -> tuple[int, int, int]:
    """(B, T, width): the shape that fixes a captured step in which each of the sequences `seq_ids`
    brings `tokens` tokens, their slots already appended (width: `table_width` of the most pages)."""
    return len(seq_ids), tokens, table_width(max(len(cache.seqs[i].pages) for i in seq_ids))


class StepGraphs:
    """CUDA graphs of a model's steps over a paged cache in which every sequence brings the same number T
    of tokens, one graph per (batch size B, T, table width): T = 1 for decode steps, T = gamma + 1 for a
    speculative verification step (notebook 15). A step whose sequences bring different numbers of
    tokens is not replayed here: its caller runs it as usual, or pads it (`speculative.steps`).

    `step(seq_ids, tokens, positions, slots)`: sequence seq_ids[b] brings tokens[b*T : (b+1)*T] at those
    positions, their K/V going to those slots (as `PagedKVCache.append` gave), len(tokens) = B*T; returns
    the logits (B*T, vocab) (fixed memory: read them before the next step). max_tokens: the largest T
    its users replay (longer steps are prefills, one-off shapes whose capture costs three runs)."""

    def __init__(self, model, cache: PagedKVCache, max_tokens: int = 16):
        if torch.device(model.device).type != "cuda":
            raise ValueError(
                f"{type(self).__name__}: CUDA graphs need a model on a CUDA device, got {model.device}"
            )
        self.model, self.cache, self.max_tokens = model, cache, max_tokens
        self.graphs: dict[tuple[int, ...], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.replays = 0  # steps served by a replay

    def key(self, shape: tuple[int, int, int]) -> tuple[int, ...]:
        """The key of `graphs` for a step of shape (B, T, width) (`step_key`)."""
        return shape

    def step(self, seq_ids: list[int], tokens: list[int], positions: list[int], slots: torch.Tensor):
        batch = len(seq_ids)
        if batch == 0 or len(tokens) % batch or len(positions) != len(tokens) or len(slots) != len(tokens):
            raise ValueError(
                f"{type(self).__name__}.step: {len(tokens)} tokens, {len(positions)} positions and "
                f"{len(slots)} slots for {batch} sequences; each sequence must bring the same number"
            )
        shape = step_key(self.cache, seq_ids, len(tokens) // batch)
        key = self.key(shape)
        if key not in self.graphs:
            self.graphs[key] = _Graph(self.model, self.cache, *shape, self.pool)
        graph = self.graphs[key]
        graph.fill(seq_ids, tokens, positions, slots)
        self.replays += 1
        return graph.run()


class DecodeGraphs(StepGraphs):
    """CUDA graphs of a model's decode steps over a paged cache, one per (batch size, table width).

    `step(seq_ids, tokens, positions, slots)` runs the step in which sequence seq_ids[i] brings token
    tokens[i] at position positions[i], its K/V going to slot slots[i] (as `PagedKVCache.append` gave),
    and returns the logits (B, vocab) (fixed memory: read them before the next step)."""

    def __init__(self, model, cache: PagedKVCache):
        super().__init__(model, cache, max_tokens=1)

    def key(self, shape: tuple[int, int, int]) -> tuple[int, ...]:
        batch, tokens, width = shape
        if tokens != 1:
            raise ValueError(
                f"DecodeGraphs.step: one token per sequence, got {tokens} (StepGraphs takes more)"
            )
        return batch, width
