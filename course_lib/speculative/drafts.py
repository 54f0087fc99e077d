"""Drafts: what proposes the tokens the target verifies (notebook 15).

A draft offers `propose(batch, temperature, generator)` with batch a list of (seq_id, tokens, k): the
sequence's tokens so far and how many to propose (k >= 0). It returns, per sequence, (draft ids, q):
at most k ids, and q (len, vocab) the probabilities each id was drawn from (None at temperature 0).
After the target has decided, `rollback(seq_id, length)` says that only the first `length` tokens of
the sequence are now settled; `finish(seq_id)` forgets the sequence.

- `NGramDraft`: prompt lookup (vLLM's "ngram" proposer): find the latest earlier occurrence of the
  sequence's last n tokens and propose what followed it. No model, no cost; deterministic, so q is one-hot.
- `ModelDraft`: a smaller model of the same vocabulary (the capstone's architecture with fewer layers,
  or `LayerDraft`, the target's own first layers), with its own paged cache, run one token per step
  (cuda_graphs=True: its steps replayed as CUDA graphs, `steps.forward_tokens`).
"""

from __future__ import annotations

import torch

from ..checks import check_int, vocab_size
from ..decode.graphs import StepGraphs
from .acceptance import probabilities
from .steps import check_attention, check_graphs, forward_tokens, new_cache, truncate


class NGramDraft:
    """Prompt lookup: for n = max_ngram down to min_ngram, the latest earlier place where the last n
    tokens occurred; propose the (up to k) tokens that followed it. Nothing found: no proposal."""

    vocab_size = None  # any vocabulary

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = check_int("NGramDraft", "max_ngram", max_ngram, 1)
        self.min_ngram = check_int("NGramDraft", "min_ngram", min_ngram, 1)
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"NGramDraft: min_ngram={min_ngram} is more than max_ngram={max_ngram}")

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
                if tokens[start : start + n] == tail:
                    return list(tokens[start + n : start + n + k])
        return []

    def propose(self, batch, temperature: float = 0.0, generator=None, vocab: int | None = None):
        out = []
        for _, tokens, k in batch:
            ids = self.lookup(list(tokens), k) if k > 0 else []
            q = None
            if temperature > 0:
                q = torch.zeros(len(ids), vocab, dtype=torch.float64)
                q[torch.arange(len(ids)), torch.tensor(ids, dtype=torch.int64)] = 1.0
            out.append((ids, q))
        return out

    def rollback(self, seq_id, length: int) -> None:
        pass

    def finish(self, seq_id) -> None:
        pass


class ModelDraft:
    """A draft model (any model of the serving interface) with its own paged cache. Each `propose` feeds
    every sequence's tokens not yet in the draft's cache, then one drafted token per step: k draft steps
    for k proposals, all the batch's sequences in each step. cuda_graphs=True (a model on a GPU, the
    kernel path): those steps replayed as CUDA graphs (`StepGraphs` over its cache), kept as long as the
    draft: one ModelDraft serves several generations, its cache empty after each (`finish`)."""

    def __init__(
        self, model, num_pages: int = 256, page_size: int = 16, attention: str = "kernel",
        cuda_graphs: bool = False,
    ):  # fmt: skip
        check_graphs("ModelDraft", model, check_attention("ModelDraft", attention), cuda_graphs)
        cache = new_cache(model, num_pages, page_size)
        self._attach(model, cache, StepGraphs(model, cache) if cuda_graphs else None, attention)

    @classmethod
    def over(cls, model, cache, graphs: StepGraphs | None = None, attention: str = "kernel") -> ModelDraft:
        """A ModelDraft of `model` over a cache it is lent (and `graphs`, the StepGraphs over it, or None):
        what `speculative_generate` builds for a bare draft model (`steps.step_cache`)."""
        return cls.__new__(cls)._attach(model, cache, graphs, attention)

    def _attach(self, model, cache, graphs, attention: str) -> ModelDraft:
        self.model, self.cache, self.graphs = model, cache, graphs
        self.attention = check_attention("ModelDraft", attention)
        self.steps = 0  # forward steps run, for the cost accounting
        return self

    @property
    def vocab_size(self) -> int | None:
        return vocab_size(self.model)

    def propose(self, batch, temperature: float = 0.0, generator=None, vocab: int | None = None):
        ids = {s: [] for s, _, _ in batch}
        qs = {s: [] for s, _, _ in batch}
        feeds = {}
        for s, tokens, k in batch:
            if s not in self.cache.seqs:
                self.cache.add_sequence(s)
            if k > 0:
                feeds[s] = list(tokens[self.cache.seqs[s].length :])
        todo = {s: k for s, _, k in batch if k > 0}
        while todo:
            feed = [(s, feeds[s]) for s in todo]
            logits = forward_tokens(self.model, self.cache, feed, self.attention, self.graphs)
            self.steps += 1
            for (s, _), rows in zip(list(todo.items()), logits):
                last = rows[-1]
                if temperature > 0:
                    q = probabilities(last, temperature)
                    token = int(torch.multinomial(q, 1, generator=generator))
                    qs[s].append(q)
                else:
                    token = int(last.argmax())
                ids[s].append(token)
                feeds[s] = [token]
                todo[s] -= 1
                if todo[s] == 0:
                    del todo[s]
        return [(ids[s], torch.stack(qs[s]) if qs[s] else None) for s, _, _ in batch]

    def rollback(self, seq_id, length: int) -> None:
        if seq_id in self.cache.seqs:
            truncate(self.cache, seq_id, min(length, self.cache.seqs[seq_id].length))

    def finish(self, seq_id) -> None:
        if seq_id in self.cache.seqs:
            self.cache.free(seq_id)


class LayerDraft:
    """The first `k` layers of a `course_lib.models.Llama`, through its final norm and head, as a model of
    the serving interface: the draft of self-speculative decoding (LayerSkip's, without its training).
    It shares the target's weights; as a `ModelDraft` it keeps its own cache of its k layers (LayerSkip
    reuses the target's; the values are the same)."""

    def __init__(self, model, k: int):
        self.target = model
        self.k = check_int("LayerDraft", "k", k, 1)
        if self.k > model.config.n_layers:
            raise ValueError(f"LayerDraft: k={k} is more than the model's {model.config.n_layers} layers")
        self.config = model.config
        self.num_layers, self.num_kv_heads, self.head_dim = self.k, model.num_kv_heads, model.head_dim
        self.dtype, self.device = model.dtype, model.device

    @torch.no_grad()
    def forward_step(self, token_ids, positions, kv):
        m = self.target
        x = m.tok_embeddings(token_ids)
        cos, sin = m.rope_cos.to(x.dtype), m.rope_sin.to(x.dtype)
        for i, layer in enumerate(m.layers[: self.k]):
            h = x + layer.attention.step(layer.attention_norm(x), positions, cos, sin, kv, i)
            x = h + layer.feed_forward.step(layer.ffn_norm(h))
        return m.output(m.norm(x)).float()
