"""Serving the capstone model: greedy generation, plain and paged (notebook 12).

- `greedy_reference(model, prompt, n)`: the definition. One token at a time, each step recomputes
  the whole sequence with `model(tokens)`: no cache, nothing clever.
- `greedy_cached(model, prompts, n)`: the same tokens through a contiguous `KVCache`, one prompt at a
  time: prefill the prompt, then one token per step (bottom-right causal attention over the cache).
- `stream(model, prompts, n)`: several prompts at once through `course_lib.decode`'s continuous-
  batching loop (notebook 10): K/V in a paged cache, attention by the paged split-KV decode kernel,
  prefill and decode in one step, decode steps replayed as CUDA graphs on a GPU; yields (prompt index,
  token) as each token is produced.
- `serve(model, prompts, n)`: `stream` run to the end, the tokens of each prompt in a list.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .llama import KVCache


def _prompts(prompts) -> list[list[int]]:
    out = [p.tolist() if isinstance(p, torch.Tensor) else list(p) for p in prompts]
    if not out or any(len(p) == 0 for p in out):
        raise ValueError("generation needs at least one prompt, and no prompt may be empty")
    return out


@torch.no_grad()
def greedy_reference(model, prompt, max_new_tokens: int) -> list[int]:
    """Greedy continuation of one prompt (a list of token ids) by full recomputation at each step."""
    tokens = _prompts([prompt])[0]
    for _ in range(max_new_tokens):
        x = torch.tensor([tokens], device=model.device)
        tokens.append(int(model(x)[0, -1].argmax()))
    return tokens[len(_prompts([prompt])[0]) :]


@torch.no_grad()
def greedy_cached(model, prompts, max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations with a contiguous KV cache, one prompt after another (prefill, then one
    token per forward pass)."""
    out = []
    for prompt in _prompts(prompts):
        cache = KVCache(model.config, 1, len(prompt) + max_new_tokens, model.device, model.dtype)
        logits = model(torch.tensor([prompt], device=model.device), cache=cache, start_pos=0)
        generated, pos = [], len(prompt)
        for i in range(max_new_tokens):
            token = int(logits[0, -1].argmax())
            generated.append(token)
            if i + 1 < max_new_tokens:
                logits = model(torch.tensor([[token]], device=model.device), cache=cache, start_pos=pos)
                pos += 1
        out.append(generated)
    return out


def stream(
    model,
    prompts,
    max_new_tokens: int,
    page_size: int = 16,
    num_pages: int | None = None,
    max_batch: int = 8,
    max_step_tokens: int = 512,
    cuda_graphs: bool | None = None,
) -> Iterator[tuple[int, int]]:
    """Generate for all `prompts` at once over course_lib's paged KV cache; yields (prompt index,
    token) as tokens appear. `num_pages` defaults to enough pages for every prompt at full length.
    cuda_graphs: replay the decode steps as CUDA graphs (`course_lib.decode.graphs`); None: when the
    model is on a CUDA device."""
    from ..decode.batching import ContinuousBatcher

    prompts = _prompts(prompts)
    if num_pages is None:
        num_pages = sum(-(-(len(p) + max_new_tokens + 1) // page_size) for p in prompts)
    if cuda_graphs is None:
        cuda_graphs = torch.device(model.device).type == "cuda"
    batcher = ContinuousBatcher(model, num_pages, page_size, max_batch, max_step_tokens, cuda_graphs)
    ids = {batcher.submit(p, max_new_tokens): i for i, p in enumerate(prompts)}
    while batcher.waiting or batcher.running:
        for request_id, token in batcher.step().items():
            yield ids[request_id], token


def serve(model, prompts, max_new_tokens: int, **kwargs) -> list[list[int]]:
    """`stream` to the end: the greedy continuation of each prompt (list of token-id lists)."""
    out = [[] for _ in _prompts(prompts)]
    for i, token in stream(model, prompts, max_new_tokens, **kwargs):
        out[i].append(token)
    return out
