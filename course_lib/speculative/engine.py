"""Speculative decoding over the paged KV cache, for a batch of prompts (notebook 15).

Each round, for every unfinished sequence: the draft proposes up to gamma tokens; the target scores the
pending token and all drafts of every sequence in ONE `forward_step` (gamma + 1 query rows per
sequence, bottom-right causal over its cache: a multi-token decode step); `acceptance` keeps a prefix of
the drafts and adds one token of the target's own; the rejected tail is rolled back in both caches
(`steps.truncate`). Sequences of a batch keep different numbers of tokens per round: the next round
simply feeds each its own pending token and drafts.

`plain_generate` is the baseline: one token per target step through the same cache and step code.

cuda_graphs=True (a model on a GPU, attention="kernel") replays the steps of a few tokens per sequence
as CUDA graphs (`steps.forward_tokens`; prefills run as usual): the same tokens, without the CPU's
launch cost per step. The cache and its graphs are kept on the model between calls (`steps.step_cache`),
so a second identical call replays every graph the first captured.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch

from ..checks import check_generation_fits, check_int, check_real, max_positions, prompt_lists, vocab_size
from .acceptance import accept_greedy, accept_sampled, probabilities
from .drafts import ModelDraft, NGramDraft
from .steps import check_attention, check_graphs, forward_tokens, step_cache, truncate


@dataclass
class SpecResult:
    """What a generation produced and what it cost.

    tokens[i]: the new tokens of prompt i. rounds[i]: (proposed, accepted) per round of prompt i (each
    round emits accepted + 1 tokens). target_steps / draft_steps: forward steps run (a step serves the
    whole batch). seconds: wall time."""

    tokens: list[list[int]]
    rounds: list[list[tuple[int, int]]] = field(default_factory=list)
    target_steps: int = 0
    draft_steps: int = 0
    seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """alpha: accepted / (accepted + rejections); a round that kept every draft had no rejection.
        (The estimate of a per-token acceptance probability when acceptances are independent.)"""
        acc = sum(a for r in self.rounds for _, a in r)
        rej = sum(1 for r in self.rounds for p, a in r if a < p)
        return acc / (acc + rej) if acc + rej else float("nan")

    @property
    def tokens_per_round(self) -> float:
        """Mean tokens emitted per target verification of one sequence (plain decoding: 1)."""
        n = sum(len(r) for r in self.rounds)
        return sum(a + 1 for r in self.rounds for _, a in r) / n if n else float("nan")


def _check(where, target, prompts, max_new_tokens, temperature):
    vocab = vocab_size(target)
    prompts = prompt_lists(where, prompts, vocab)
    max_new_tokens = check_int(where, "max_new_tokens", max_new_tokens, 1)
    max_len = max_positions(target)
    for p in prompts:
        check_generation_fits(where, len(p), max_new_tokens, max_len)
    temperature = check_real(where, "temperature (0 is greedy)", temperature, low=0)
    return prompts, max_new_tokens, temperature, vocab


def _pages(prompts, max_new_tokens, extra, page_size):
    return sum(-(-(len(p) + max_new_tokens + extra) // page_size) + 1 for p in prompts)


@torch.no_grad()
def speculative_generate(
    target,
    draft,
    prompts,
    max_new_tokens: int,
    gamma: int = 4,
    temperature: float = 0.0,
    generator=None,
    page_size: int = 16,
    attention: str = "kernel",
    cuda_graphs: bool = False,
) -> SpecResult:
    """Generate `max_new_tokens` tokens after each of `prompts` (lists of token ids) with `target`,
    drafted by `draft` (an `NGramDraft`, a `ModelDraft`, or a model of the serving interface, which is
    wrapped in a `ModelDraft`), gamma >= 1 drafts per round. temperature 0: greedy (the target's greedy
    tokens exactly); > 0: sampled, distributed exactly as the target's samples at that temperature
    (`generator`: a CPU torch.Generator). attention: "kernel" (course_lib's paged decode kernel) or
    "torch" (`steps.TorchPagedKV`). cuda_graphs: the target's verification steps and a bare draft
    model's steps replayed as CUDA graphs (module docstring; a `ModelDraft` given replays its own when
    made with cuda_graphs=True). Returns a `SpecResult`. Notebook 15."""
    where = "speculative_generate"
    prompts, max_new_tokens, temperature, vocab = _check(where, target, prompts, max_new_tokens, temperature)
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"{where}: gamma (drafted tokens per round) must be an int >= 1, got {gamma!r}")
    check_graphs(where, target, check_attention(where, attention), cuda_graphs)
    pages = _pages(prompts, max_new_tokens, gamma + 1, page_size)
    with ExitStack() as kept:
        if not isinstance(draft, (NGramDraft, ModelDraft)):
            if not hasattr(draft, "forward_step"):
                raise TypeError(
                    f"{where}: draft must be an NGramDraft, a ModelDraft or a model with forward_step"
                )
            check_graphs(f"{where} (the draft)", draft, attention, cuda_graphs)
            cache, graphs = kept.enter_context(step_cache(draft, pages, page_size, cuda_graphs))
            draft = ModelDraft.over(draft, cache, graphs, attention)
        if draft.vocab_size is not None and vocab is not None and draft.vocab_size != vocab:
            raise ValueError(
                f"{where}: the draft's vocabulary has {draft.vocab_size} tokens, the target's {vocab}: a "
                "draft must share the target's vocabulary (its ids are the target's ids)"
            )
        start = time.perf_counter()
        draft_steps0 = getattr(draft, "steps", 0)
        cache, graphs = kept.enter_context(step_cache(target, pages, page_size, cuda_graphs))
        seqs = [list(p) for p in prompts]
        result = SpecResult([[] for _ in prompts], [[] for _ in prompts])
        for i in range(len(prompts)):
            cache.add_sequence(i)
        while True:
            active = [i for i in range(len(prompts)) if len(result.tokens[i]) < max_new_tokens]
            if not active:
                break
            ks = {i: min(gamma, max_new_tokens - len(result.tokens[i]) - 1) for i in active}
            proposals = draft.propose([(i, seqs[i], ks[i]) for i in active], temperature, generator, vocab)
            feeds = [(i, seqs[i][cache.seqs[i].length :] + d) for i, (d, _) in zip(active, proposals)]
            logits = forward_tokens(target, cache, feeds, attention, graphs)
            result.target_steps += 1
            for i, (d, q), rows in zip(active, proposals, logits):
                rows = rows[-(len(d) + 1) :]
                if temperature == 0:
                    n, token = accept_greedy(d, rows.argmax(-1).tolist())
                else:
                    if q is None:
                        q = torch.zeros(0, rows.shape[-1], dtype=torch.float64)
                    n, token = accept_sampled(probabilities(rows, temperature), q, d, generator)
                settled = len(seqs[i]) + n  # the pending token and the n kept drafts are in the cache
                truncate(cache, i, settled)
                draft.rollback(i, settled)
                emitted = d[:n] + [token]
                seqs[i] += emitted
                result.tokens[i] += emitted
                result.rounds[i].append((len(d), n))
        for i in range(len(prompts)):
            cache.free(i)
            draft.finish(i)
    result.draft_steps = getattr(draft, "steps", 0) - draft_steps0
    result.seconds = time.perf_counter() - start
    return result


@torch.no_grad()
def plain_generate(
    model, prompts, max_new_tokens: int, temperature: float = 0.0, generator=None, page_size: int = 16,
    attention: str = "kernel", cuda_graphs: bool = False,
) -> SpecResult:  # fmt: skip
    """The baseline: one token per step for every prompt, through the same paged cache and step code
    (cuda_graphs: each step after the prefill replayed as a CUDA graph, module docstring).
    Returns a `SpecResult` (no rounds; target_steps = max_new_tokens)."""
    where = "plain_generate"
    prompts, max_new_tokens, temperature, _ = _check(where, model, prompts, max_new_tokens, temperature)
    check_graphs(where, model, check_attention(where, attention), cuda_graphs)
    start = time.perf_counter()
    pages = _pages(prompts, max_new_tokens, 1, page_size)
    with step_cache(model, pages, page_size, cuda_graphs) as (cache, graphs):
        result = SpecResult([[] for _ in prompts])
        pending = [list(p) for p in prompts]
        for i in range(len(prompts)):
            cache.add_sequence(i)
        for _ in range(max_new_tokens):
            logits = forward_tokens(model, cache, list(enumerate(pending)), attention, graphs)
            result.target_steps += 1
            for i, rows in enumerate(logits):
                last = rows[-1]
                if temperature == 0:
                    token = int(last.argmax())
                else:
                    token = int(torch.multinomial(probabilities(last, temperature), 1, generator=generator))
                result.tokens[i].append(token)
                pending[i] = [token]
        for i in range(len(prompts)):
            cache.free(i)
    result.seconds = time.perf_counter() - start
    return result
