"""Batch management measured: static against continuous batching, with and without chunked prefill (notebook 14).

- `draw_workload`: a stream of requests with drawn prompt lengths, output lengths and arrival times (Poisson).
- `StaticBatcher`: the batcher that waits for its whole batch to finish before it admits the next (what a plain
  `model.generate` over a padded batch does): a slot whose request ended sits idle until the longest one ends.
- `serve_workload`: runs a workload through a batcher on the wall clock (time spent waiting for the next arrival
  is skipped, not slept) and measures throughput (generated tokens / s), time to first token and time per
  output token per request.
- `predict_steps`: the prediction before the measurement. A decoding step of a small model is memory-bound on
  its weights (notebook 09: step time ~ (weights + B KV) / bandwidth, and the weights dominate at these sizes),
  so a step costs about the same whether 2 or 8 sequences run in it: the gain of continuous batching is the
  ratio of the steps the two schedules take for the same output tokens, which the output lengths alone decide.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from ..checks import check_int
from ..decode.batching import ContinuousBatcher

__all__ = ["Served", "StaticBatcher", "Workload", "draw_workload", "predict_steps", "serve_workload"]


@dataclass(frozen=True)
class Workload:
    """prompts: token-id lists; new_tokens: how many tokens each request generates; arrivals: seconds after the
    start at which each arrives (sorted)."""

    prompts: list[list[int]]
    new_tokens: list[int]
    arrivals: list[float]


def draw_workload(
    n: int, vocab: int, prompt_lens=(16, 128), new_tokens=(4, 64), rate: float | None = None, seed: int = 0
) -> Workload:
    """n requests: prompt lengths uniform in `prompt_lens` (inclusive), output lengths uniform in `new_tokens`,
    arrivals a Poisson process of `rate` requests / s (None: all at time 0, an offline batch)."""
    n = check_int("draw_workload", "n", n, 1)
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(prompt_lens[0], prompt_lens[1] + 1, (n,), generator=g).tolist()
    outs = torch.randint(new_tokens[0], new_tokens[1] + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (m,), generator=g).tolist() for m in lens]
    if rate is None:
        arrivals = [0.0] * n
    else:
        gaps = torch.empty(n).exponential_(rate, generator=g)
        arrivals = (gaps.cumsum(0) - gaps[0]).tolist()
    return Workload(prompts, outs, arrivals)


class StaticBatcher(ContinuousBatcher):
    """Static batching: requests are admitted only when the batch is empty, so a batch runs until its longest
    request ends while finished slots stay idle. Everything else (paged cache, prefill, greedy) as
    `ContinuousBatcher`."""

    def _admit(self) -> None:
        if not self.running:
            super()._admit()


@dataclass
class Served:
    """What `serve_workload` measured: per request (in submission order) its arrival, first and last token
    times (seconds from the start: a Gantt chart's bars), time to first token and time per output token after
    the first; the whole run's generated tokens, seconds and steps."""

    arrival: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    last: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0

    @property
    def throughput(self) -> float:
        """Generated tokens per second."""
        return self.tokens / self.seconds

    def summary(self) -> dict:
        """Throughput, and the median and 90th percentile of TTFT and TPOT (ms)."""

        def p(xs, q):
            return statistics.quantiles(xs, n=10)[8] if q == 90 and len(xs) > 1 else statistics.median(xs)

        return {
            "tokens/s": self.throughput,
            "TTFT p50 ms": 1e3 * p(self.ttft, 50),
            "TTFT p90 ms": 1e3 * p(self.ttft, 90),
            "TPOT p50 ms": 1e3 * p(self.tpot, 50),
            "TPOT p90 ms": 1e3 * p(self.tpot, 90),
            "steps": self.steps,
        }


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def serve_workload(batcher: ContinuousBatcher, workload: Workload) -> Served:
    """Run `workload` through `batcher` (a fresh one: nothing submitted yet). A request is submitted once the
    clock passes its arrival; when nothing runs and nothing waits, the clock jumps to the next arrival. Each
    token's time is taken after its step (synchronised on a GPU)."""
    if batcher.waiting or batcher.running:
        raise ValueError("serve_workload: the batcher must be empty (requests already submitted to it)")
    n = len(workload.prompts)
    first, last, count = [None] * n, [0.0] * n, [0] * n
    ids: dict[int, int] = {}
    skipped, nxt, steps = 0.0, 0, 0
    start = time.perf_counter()
    while nxt < n or batcher.waiting or batcher.running:
        now = time.perf_counter() - start + skipped
        if nxt < n and not (batcher.waiting or batcher.running) and workload.arrivals[nxt] > now:
            skipped += workload.arrivals[nxt] - now  # idle: jump to the next arrival
            now = workload.arrivals[nxt]
        while nxt < n and workload.arrivals[nxt] <= now:
            ids[batcher.submit(workload.prompts[nxt], workload.new_tokens[nxt])] = nxt
            nxt += 1
        out = batcher.step()
        _sync(batcher.model.device)
        steps += 1
        t = time.perf_counter() - start + skipped
        for request_id in out:
            i = ids[request_id]
            first[i] = t if first[i] is None else first[i]
            last[i], count[i] = t, count[i] + 1
    served = Served(
        list(workload.arrivals), first, last, tokens=sum(count), seconds=max(last) - workload.arrivals[0]
    )
    served.steps = steps
    served.ttft = [f - a for f, a in zip(first, workload.arrivals)]
    served.tpot = [(l - f) / (c - 1) for f, l, c in zip(first, last, count) if c > 1]
    return served


def predict_steps(new_tokens: list[int], max_batch: int) -> tuple[int, int]:
    """(static, continuous): the decoding steps each schedule takes to generate `new_tokens` for requests that
    are all waiting at the start, with at most `max_batch` running (prefill steps left out). Static: batches of
    max_batch in order, each taking its longest request's steps. Continuous: a freed slot is refilled at once, so
    the steps are those of `max_batch` queues served longest-waiting-first."""
    max_batch = check_int("predict_steps", "max_batch", max_batch, 1)
    static = sum(max(new_tokens[i : i + max_batch]) for i in range(0, len(new_tokens), max_batch))
    slots = [0] * max_batch  # the step at which each slot frees up
    for need in new_tokens:
        k = min(range(max_batch), key=slots.__getitem__)
        slots[k] += need
    return static, max(slots)
