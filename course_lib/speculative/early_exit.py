"""Early exit: stop a token's forward pass at an intermediate layer when the model is already sure
(CALM, Schuster et al. 2022), and self-speculative decoding (LayerSkip, Elhoushi et al. 2024). Notebook 15.

After layer l the hidden state goes through the model's shared final norm and head; if the top-1
probability reaches `threshold` (in (0, 1]), the token is emitted there. The layers it skipped still owe
the cache this token's K/V, which later tokens attend to: as CALM does, the exited hidden state is
copied up and pushed through each skipped layer's attention norm and K/V projections (RoPE on K) — K/V
that the full model would have computed from a deeper state, so the output is no longer the full
model's. threshold = 1 never exits early in practice (the full model, exactly); lower thresholds trade
exactness for layers. Self-speculative decoding is the exact alternative: the first k layers draft
(`drafts.LayerDraft`), the full model verifies (`engine.speculative_generate`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..checks import check_real
from ..decode.paged_kv import PagedKV
from ..models.llama import rope_torch
from .engine import _check, _pages
from .steps import TorchPagedKV, check_attention, forward_tokens, new_cache


@dataclass
class EarlyExitResult:
    """tokens: the new tokens; layers: the layers each token ran (the first, from the prefill: all);
    cache: the paged cache (sequence 0: the prompt and every fed token) when asked for with keep_cache."""

    tokens: list[int]
    layers: list[int] = field(default_factory=list)
    seconds: float = 0.0
    cache: object = None


def propagate_kv(model, h: torch.Tensor, positions: torch.Tensor, kv, layers) -> None:
    """CALM's fill: the K/V of the tokens in h (T, dim), the hidden state where they exited, for each
    skipped layer in `layers`: K = RoPE(W_k RMSNorm_l(h)), V = W_v RMSNorm_l(h), written at the step's slots."""
    c = model.config
    for i in layers:
        layer = model.layers[i]
        x = layer.attention_norm(h)
        k = layer.attention.wk(x).view(-1, c.n_kv_heads, c.head_dim)
        v = layer.attention.wv(x).view(-1, c.n_kv_heads, c.head_dim)
        cos, sin = (
            model.rope_cos.to(k.dtype)[positions][:, None],
            model.rope_sin.to(k.dtype)[positions][:, None],
        )
        k, _ = rope_torch(k, k, cos, sin)
        kv.cache.write(i, kv.slots, k, v)


@torch.no_grad()
def early_exit_generate(
    model, prompt, max_new_tokens: int, threshold: float, exit_layers=None, page_size: int = 16,
    attention: str = "kernel", keep_cache: bool = False,
) -> EarlyExitResult:  # fmt: skip
    """Greedy continuation of one prompt by a `course_lib.models.Llama`, each new token leaving after the
    first layer of `exit_layers` (layer counts 1..n_layers - 1; default: every one) at which the top-1
    probability through the final norm and head reaches `threshold` in (0, 1]; the skipped layers' K/V
    are filled by `propagate_kv`. The prompt runs through every layer."""
    where = "early_exit_generate"
    threshold = check_real(where, "threshold", threshold, low=0, low_open=True, high=1 + 1e-12)
    check_attention(where, attention)
    (prompt,), max_new_tokens, _, _ = _check(where, model, [prompt], max_new_tokens, 0.0)
    depth = model.config.n_layers
    exits = sorted(set(range(1, depth) if exit_layers is None else exit_layers))
    if any(not isinstance(e, int) or not 1 <= e < depth for e in exits):
        raise ValueError(f"{where}: exit_layers must be layer counts in 1..{depth - 1}, got {exit_layers!r}")
    start = time.perf_counter()
    cache = new_cache(model, _pages([prompt], max_new_tokens, 1, page_size), page_size)
    cache.add_sequence(0)
    (rows,) = forward_tokens(model, cache, [(0, prompt)], attention)
    out = EarlyExitResult([int(rows[-1].argmax())], [depth])
    kv_class = PagedKV if attention == "kernel" else TorchPagedKV
    while len(out.tokens) < max_new_tokens:
        pos = cache.seqs[0].length
        kv = kv_class.for_step(cache, [0], [1], cache.append(0, 1))
        positions = torch.tensor([pos], device=model.device)
        x = model.tok_embeddings(torch.tensor([out.tokens[-1]], device=model.device))
        cos, sin = model.rope_cos.to(x.dtype), model.rope_sin.to(x.dtype)
        for i, layer in enumerate(model.layers):
            h = x + layer.attention.step(layer.attention_norm(x), positions, cos, sin, kv, i)
            x = h + layer.feed_forward.step(layer.ffn_norm(h))
            if i + 1 in exits:
                probs = torch.softmax(model.output(model.norm(x)).float()[0], -1)
                if float(probs.max()) >= threshold:
                    propagate_kv(model, x, positions, kv, range(i + 1, depth))
                    break
        else:
            probs = torch.softmax(model.output(model.norm(x)).float()[0], -1)
        out.tokens.append(int(probs.argmax()))
        out.layers.append(i + 1)
    if keep_cache:
        out.cache = cache
    else:
        cache.free(0)
    out.seconds = time.perf_counter() - start
    return out
