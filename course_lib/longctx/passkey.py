"""Passkey retrieval, a synthetic long-range task, and a one-layer model to train on it (notebook 16).

A sequence of random filler tokens holds, somewhere in its first segment, a KEY marker followed by one value
token (one of `n_values`); its last token is QUERY, and the model must name the value. The value lies segments
before the question, so a model whose attention stays inside a segment sees only filler and guesses (accuracy
1 / n_values); full attention sees it; Infini-attention can only reach it through its memory, and only after
training has taught its keys, values and gate to store it.

The model (`PasskeyModel`): token embedding, one pre-norm attention block (H heads of d), a final norm, and a
head that reads the last position's vector into `n_values` logits. No position encoding: the task is found by
content. `kind` picks the attention: "full" (causal over the whole sequence), "local" (causal inside each
segment, nothing across) or "infini" (local plus the compressive memory and a learned gate per head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .infini import infini_attention, kernel_local_attention, segment_attention

__all__ = ["PasskeyModel", "PasskeyTask", "passkey_accuracy", "passkey_batch", "train_passkey"]

KINDS = ("full", "local", "infini")


@dataclass(frozen=True)
class PasskeyTask:
    """Token ids: filler 0 .. n_filler - 1, values n_filler .. n_filler + n_values - 1, then KEY and QUERY.
    The KEY sits at a random position of the first segment (of `segment` tokens), its value right after."""

    n_values: int = 16
    n_filler: int = 32
    segment: int = 16

    @property
    def key(self) -> int:
        return self.n_filler + self.n_values

    @property
    def query(self) -> int:
        return self.key + 1

    @property
    def vocab(self) -> int:
        return self.key + 2


def passkey_batch(task: PasskeyTask, batch: int, length: int, generator=None, device="cpu"):
    """(tokens (batch, length) int64, answers (batch,) int64 in 0 .. n_values - 1). length >= segment + 1:
    the question is always outside the first segment, where the key is."""
    if length <= task.segment:
        raise ValueError(f"passkey_batch: length {length} must exceed one segment ({task.segment} tokens)")
    tokens = torch.randint(0, task.n_filler, (batch, length), generator=generator)
    answers = torch.randint(0, task.n_values, (batch,), generator=generator)
    where = torch.randint(0, task.segment - 1, (batch,), generator=generator)  # KEY, then its value
    rows = torch.arange(batch)
    tokens[rows, where] = task.key
    tokens[rows, where + 1] = task.n_filler + answers
    tokens[:, -1] = task.query
    return tokens.to(device), answers.to(device)


class PasskeyModel(nn.Module):
    """Embedding -> one attention block (`kind`: "full", "local" or "infini") -> norm -> value logits at the
    last position. dim = heads x head_dim. `local`: the causal attention inside a segment (default
    course_lib's FlashAttention kernel; `sdpa_local_attention` on a CPU, where the kernel is interpreted)."""

    def __init__(self, task: PasskeyTask, kind: str, heads: int = 2, head_dim: int = 16, delta: bool = False,
                 local=None):  # fmt: skip
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"PasskeyModel: kind must be one of {KINDS}, got {kind!r}")
        self.task, self.kind, self.heads, self.head_dim, self.delta = task, kind, heads, head_dim, delta
        self.local = local or kernel_local_attention
        dim = heads * head_dim
        self.embed = nn.Embedding(task.vocab, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.head = nn.Linear(dim, task.n_values)
        self.beta = nn.Parameter(torch.zeros(heads))  # Infini's gate, one per head (used by "infini" only)

    def attend(self, q, k, v):
        if self.kind == "full":
            return self.local(q, k, v)
        if self.kind == "local":
            return segment_attention(q, k, v, self.task.segment, self.local)
        return infini_attention(
            q, k, v, self.task.segment, delta=self.delta, gate=self.beta, local=self.local
        )[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, N) int64 -> logits (B, n_values) of the last position."""
        B, N = tokens.shape
        x = self.embed(tokens)
        q, k, v = self.qkv(self.norm1(x)).view(B, N, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        o = self.attend(q, k, v).transpose(1, 2).reshape(B, N, -1)
        x = x + self.out(o)
        return self.head(self.norm2(x[:, -1]))


def train_passkey(model: PasskeyModel, steps: int, length: int, batch: int = 64, lr: float = 3e-3,
                  seed: int = 0) -> list[float]:  # fmt: skip
    """Adam on cross-entropy of the answer, fresh random sequences of `length` tokens every step, on the
    model's device. Returns the loss of every step."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    model.train()
    for _ in range(steps):
        tokens, answers = passkey_batch(model.task, batch, length, g, device)
        loss = F.cross_entropy(model(tokens), answers)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def passkey_accuracy(model: PasskeyModel, length: int, samples: int = 256, seed: int = 1) -> float:
    """Fraction of `samples` fresh sequences of `length` tokens whose value the model names."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    model.eval()
    tokens, answers = passkey_batch(model.task, samples, length, g, device)
    return (model(tokens).argmax(-1) == answers).float().mean().item()
