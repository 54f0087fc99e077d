"""A toy language model that follows the serving interface of `batching` (notebook 10, tests).

Two attention layers with random weights (4 query heads over 2 kv heads, d = 16), positions added as a
sinusoid, no MLP or norm: just enough to make greedy generation depend on every cached key, so that the
continuous-batching loop can be checked token for token against `forward_full`, a plain causal
attention over the whole sequence recomputed at every step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class ToyModel:
    """model.forward_step(token_ids (T,), positions (T,), kv) -> logits (T, vocab), as `batching` asks."""

    num_layers, num_kv_heads, head_dim, num_heads, vocab, width = 2, 2, 16, 4, 37, 64

    def __init__(self, device, dtype=torch.float32, seed: int = 7):
        g = torch.Generator().manual_seed(seed)
        self.device, self.dtype = torch.device(device), dtype

        def w(*shape):
            return (torch.randn(*shape, generator=g) / math.sqrt(shape[0])).to(self.device, dtype)

        D, H, Hkv, d = self.width, self.num_heads, self.num_kv_heads, self.head_dim
        self.emb = w(self.vocab, D) * 3
        self.layers = [
            (w(D, H * d), w(D, Hkv * d), w(D, Hkv * d), w(H * d, D)) for _ in range(self.num_layers)
        ]
        self.head = w(D, self.vocab) * 4

    def _embed(self, token_ids, positions):
        freq = 1 + torch.arange(self.width, device=self.device) / self.width
        return self.emb[token_ids] + torch.sin(positions[:, None].float() * freq[None, :]).to(self.dtype)

    def _qkv(self, x, layer):
        wq, wk, wv, _ = self.layers[layer]
        T = x.shape[0]
        return (
            (x @ wq).view(T, self.num_heads, self.head_dim),
            (x @ wk).view(T, self.num_kv_heads, self.head_dim),
            (x @ wv).view(T, self.num_kv_heads, self.head_dim),
        )

    def forward_step(self, token_ids, positions, kv):
        """The serving path: attention through `kv.attend` (the paged cache)."""
        x = self._embed(token_ids, positions)
        for layer in range(self.num_layers):
            q, k, v = self._qkv(x, layer)
            o = kv.attend(layer, q, k, v)
            x = x + o.reshape(x.shape[0], -1) @ self.layers[layer][3]
        return x @ self.head

    def forward_full(self, tokens) -> torch.Tensor:
        """Logits (n, vocab) of every position of one sequence, full causal attention, no cache."""
        ids = torch.tensor(tokens, device=self.device)
        x = self._embed(ids, torch.arange(len(tokens), device=self.device))
        g = self.num_heads // self.num_kv_heads
        for layer in range(self.num_layers):
            q, k, v = self._qkv(x, layer)
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
            )
            x = x + o.transpose(0, 1).reshape(x.shape[0], -1) @ self.layers[layer][3]
        return x @ self.head

    def generate_full(self, prompt, n: int) -> list[int]:
        """Greedy continuation of `prompt` by n tokens, recomputing everything each step (the reference)."""
        tokens = list(prompt)
        for _ in range(n):
            tokens.append(int(self.forward_full(tokens)[-1].argmax()))
        return tokens[len(prompt) :]
