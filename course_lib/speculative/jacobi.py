"""Parallel decoding of an autoregressive model: Jacobi and lookahead decoding (notebook 15).

Jacobi decoding (Santilli et al. 2023): guess the next n tokens, run the model once on the last settled
token and the n guesses (n + 1 query rows, causal over the cache), and replace every guess by the
model's greedy choice at the position before it. A guess that equals the greedy choice after a correct
prefix is correct too, so each iteration settles the longest agreeing prefix plus one more token (at
least one: never slower than greedy in steps) and the rest of the outputs become the next guesses. The
fixed point is exactly the greedy output.

Lookahead decoding (Fu et al. 2024), the simplest honest version: the Jacobi window runs as before, and
the n-grams it produces (a fed token and the model's outputs after it) are kept in a pool; each step
also verifies up to `candidates` n-grams from the pool that start with the last settled token. The
candidates ride in the same forward step as extra sequences of the batch, forked from the main one
(`PagedKVCache.fork`: they share its pages; the first write copies the partly filled last page), in
place of the paper's special attention mask. The branch that settles the most tokens wins; exact.
cuda_graphs=True replays their steps as CUDA graphs, as the engine's (`steps.forward_tokens`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..checks import check_int
from .engine import _check, _pages
from .steps import check_attention, check_graphs, forward_tokens, step_cache, truncate


def jacobi_update(window: list[int], outputs: list[int]) -> tuple[list[int], list[int]]:
    """One Jacobi iteration's bookkeeping. window = [t, g_1, ..., g_n]: the last settled token and the n
    guesses that were fed; outputs (n + 1,): the model's greedy choice after each fed token.
    Returns (settled, next_guesses): settled = outputs[0..k] where g_1..g_k agreed with outputs[0..k-1]
    (k + 1 tokens, the greedy output); next_guesses = the n guesses for the positions after them: the
    outputs not settled, then the last output repeated to fill n."""
    n = len(window) - 1
    k = 0
    while k < n and window[k + 1] == outputs[k]:
        k += 1
    settled = list(outputs[: k + 1])
    rest = list(outputs[k + 1 :])
    fill = rest[-1] if rest else settled[-1]
    return settled, (rest + [fill] * n)[:n]


@dataclass
class ParallelResult:
    """tokens: the new tokens; settled: tokens settled per forward step; steps: forward steps; branches: the
    pooled n-grams verified beside the window per step (lookahead; 0 for Jacobi), what a step's cost grows with."""

    tokens: list[int]
    settled: list[int] = field(default_factory=list)
    seconds: float = 0.0
    branches: list[int] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.settled)

    @property
    def tokens_per_step(self) -> float:
        return len(self.tokens) / max(1, self.steps)


def _start(where, model, prompt, max_new_tokens, n, page_size, extra_seqs=0):
    (prompt,), max_new_tokens, _, vocab = _check(where, model, [prompt], max_new_tokens, 0.0)
    n = check_int(where, "n (the window)", n, 1)
    return prompt, max_new_tokens, n, (1 + extra_seqs) * _pages([prompt], max_new_tokens, n + 1, page_size)


@torch.no_grad()
def jacobi_generate(
    model, prompt, max_new_tokens: int, n: int = 4, page_size: int = 16, attention="kernel",
    cuda_graphs: bool = False,
):  # fmt: skip
    """Greedy continuation of one prompt by Jacobi iteration over a window of n guesses (initial guesses:
    the prompt's last token repeated). Returns a `ParallelResult`: the tokens equal greedy decoding's."""
    start = time.perf_counter()
    check_graphs("jacobi_generate", model, check_attention("jacobi_generate", attention), cuda_graphs)
    prompt, max_new_tokens, n, pages = _start("jacobi_generate", model, prompt, max_new_tokens, n, page_size)
    seq, out = list(prompt), ParallelResult([])
    guess = [prompt[-1]] * n
    with step_cache(model, pages, page_size, cuda_graphs) as (cache, graphs):
        cache.add_sequence(0)
        while len(out.tokens) < max_new_tokens:
            width = min(n, max_new_tokens - len(out.tokens) - 1)
            pending = seq[cache.seqs[0].length :]
            (rows,) = forward_tokens(model, cache, [(0, pending + guess[:width])], attention, graphs)
            outputs = rows[-(width + 1) :].argmax(-1).tolist()
            settled, guess = jacobi_update([seq[-1]] + guess[:width], outputs)
            guess = (guess + [guess[-1] if guess else settled[-1]] * n)[:n]
            truncate(cache, 0, len(seq) + len(settled) - 1)
            seq += settled
            out.tokens += settled
            out.settled.append(len(settled))
            out.branches.append(0)
        cache.free(0)
    out.seconds = time.perf_counter() - start
    return out


@torch.no_grad()
def lookahead_generate(
    model, prompt, max_new_tokens: int, n: int = 4, ngram: int = 4, candidates: int = 4, page_size: int = 16,
    attention: str = "kernel", cuda_graphs: bool = False,
):  # fmt: skip
    """Greedy continuation of one prompt by lookahead decoding (module docstring): a Jacobi window of n
    guesses plus up to `candidates` pooled n-grams of `ngram` tokens verified in the same step. Returns a
    `ParallelResult` whose tokens equal greedy decoding's."""
    start = time.perf_counter()
    where = "lookahead_generate"
    check_graphs(where, model, check_attention(where, attention), cuda_graphs)
    ngram = check_int(where, "ngram", ngram, 2)
    candidates = check_int(where, "candidates", candidates, 0)
    prompt, max_new_tokens, n, pages = _start(where, model, prompt, max_new_tokens, n, page_size, candidates)
    pool: dict[int, list[tuple[int, ...]]] = {}
    seq, out = list(prompt), ParallelResult([])
    guess = [prompt[-1]] * n
    with step_cache(model, pages, page_size, cuda_graphs) as (cache, graphs):
        cache.add_sequence(0)
        while len(out.tokens) < max_new_tokens:
            room = max_new_tokens - len(out.tokens) - 1
            width = min(n, room)
            pending = seq[cache.seqs[0].length :]
            grams = [list(g[:room]) for g in pool.get(seq[-1], [])[:candidates] if room > 0]
            for b in range(len(grams)):
                cache.fork(0, b + 1)
            feeds = [(0, pending + guess[:width])] + [(b + 1, pending + g) for b, g in enumerate(grams)]
            logits = forward_tokens(model, cache, feeds, attention, graphs)
            outputs = logits[0][-(width + 1) :].argmax(-1).tolist()
            settled, guess = jacobi_update([seq[-1]] + guess[:width], outputs)
            best = 0
            for b, g in enumerate(grams):  # a verified n-gram: the same greedy acceptance
                got, _ = jacobi_update([seq[-1]] + g, logits[b + 1][-(len(g) + 1) :].argmax(-1).tolist())
                if len(got) > len(settled):
                    settled, best = got, b + 1
            window = [seq[-1]] + guess[:width]
            # pool (fed token, outputs after it) from the Jacobi branch
            for j in range(len(outputs) - ngram + 2):
                key, rest = window[j], tuple(outputs[j : j + ngram - 1])
                if len(rest) == ngram - 1:
                    grams_for = pool.setdefault(key, [])
                    if rest in grams_for:
                        grams_for.remove(rest)
                    grams_for.insert(0, rest)
            if best:  # the winning fork's cache becomes the sequence's
                cache.free(0)
                cache.seqs[0] = cache.seqs.pop(best)
            for b in range(len(grams)):
                if b + 1 in cache.seqs:
                    cache.free(b + 1)
            truncate(cache, 0, len(seq) + len(settled) - 1)
            if best:  # the Jacobi outputs were for positions now settled otherwise: shift them
                shift = len(settled) - 1
                guess = (outputs[1 + shift :] + [outputs[-1]] * n)[:n]
            guess = (guess + [guess[-1] if guess else settled[-1]] * n)[:n]
            seq += settled
            out.tokens += settled
            out.settled.append(len(settled))
            out.branches.append(len(grams))
        cache.free(0)
    out.seconds = time.perf_counter() - start
    return out
