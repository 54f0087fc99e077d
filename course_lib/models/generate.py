"""Serving the capstone model: greedy generation and sampling, plain and paged (notebook 12).

- `greedy_reference(model, prompt, n)`: the definition. One token at a time, each step recomputes
  the whole sequence with `model(tokens)`: no cache, nothing clever.
- `sample(model, prompt, n, temperature)`: one prompt through a contiguous `KVCache`: prefill the prompt,
  then one token per step (bottom-right causal attention over the cache), drawn at a temperature.
- `greedy_cached(model, prompts, n)`: `sample` at temperature 0 for each prompt: the tokens of
  `greedy_reference`.
- `stream(model, prompts, n)`: several prompts at once through `course_lib.decode`'s continuous-
  batching loop (notebook 10): K/V in a paged cache, attention by the paged split-KV decode kernel,
  prefill and decode in one step, decode steps replayed as CUDA graphs on a GPU; yields (prompt index,
  token) as each token is produced.
- `serve(model, prompts, n)`: `stream` run to the end, the tokens of each prompt in a list.
- `make_batcher(model, prompts, n)`: the loop itself, to pass to several `stream` / `serve` calls: its page
  pool and its captured CUDA graphs then serve them all, as a server's do.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..checks import check_generation_fits, check_int, check_real, prompt_lists
from .llama import KVCache


def _prompts(model, prompts, where: str) -> list[list[int]]:
    """Prompts as lists of ints in the model's vocabulary: a list of token-id lists (or 1-D tensors),
    checked on the host (on a GPU a bad id would be a device-side assert of the embedding)."""
    return prompt_lists(where, prompts, model.config.vocab_size)


def _check_fits(model, prompts, max_new_tokens: int, where: str) -> int:
    """max_new_tokens an int >= 0 (returned), and every prompt with its new tokens within the model's
    max_seq_len (its RoPE table): a ValueError naming the first that does not."""
    max_new_tokens = check_int(where, "max_new_tokens", max_new_tokens, 0)
    for prompt in prompts:
        check_generation_fits(where, len(prompt), max_new_tokens, model.config.max_seq_len)
    return max_new_tokens


@torch.no_grad()
def greedy_reference(model, prompt, max_new_tokens: int) -> list[int]:
    """Greedy continuation of one prompt (a list of token ids) by full recomputation at each step."""
    tokens = _prompts(model, [prompt], "greedy_reference")[0]
    max_new_tokens = check_int("greedy_reference", "max_new_tokens", max_new_tokens, 0)
    n_prompt = len(tokens)
    for _ in range(max_new_tokens):
        x = torch.tensor([tokens], device=model.device)
        tokens.append(int(model(x)[0, -1].argmax()))
    return tokens[n_prompt:]


@torch.no_grad()
def sample(model, prompt, max_new_tokens: int, temperature: float = 0.0, generator=None) -> list[int]:
    """`max_new_tokens` tokens after one prompt (a list of token ids), each drawn from
    softmax(logits / temperature) of the last position (temperature 0: the argmax, greedy), through a
    contiguous `KVCache`: prefill the prompt, then one token per forward pass. `generator`: a CPU
    `torch.Generator` for the draws. The prompt and the new tokens must fit the model's max_seq_len."""
    prompt = _prompts(model, [prompt], "sample")[0]
    max_new_tokens = _check_fits(model, [prompt], max_new_tokens, "sample")
    if max_new_tokens == 0:
        return []
    n_ctx = len(prompt) + max_new_tokens - 1  # the last new token is not fed back
    temperature = check_real("sample", "temperature (0 is greedy)", temperature, low=0)
    cache = KVCache(model.config, 1, n_ctx, model.device, model.dtype)
    logits = model(torch.tensor([prompt], device=model.device), cache=cache, start_pos=0)
    generated = []
    for i in range(max_new_tokens):
        last = logits[0, -1].float()
        if temperature == 0:
            token = int(last.argmax())
        else:
            # logits less their max: <= 0, so a tiny temperature gives -inf (probability 0), never inf - inf
            probs = torch.softmax((last.cpu() - last.max().cpu()) / temperature, -1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        generated.append(token)
        if i + 1 < max_new_tokens:
            logits = model(
                torch.tensor([[token]], device=model.device), cache=cache, start_pos=len(prompt) + i
            )
    return generated


def greedy_cached(model, prompts, max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations with a contiguous KV cache, one prompt after another (`sample` at
    temperature 0: prefill, then one token per forward pass)."""
    return [sample(model, p, max_new_tokens) for p in _prompts(model, prompts, "greedy_cached")]


def make_batcher(
    model,
    prompts,
    max_new_tokens: int,
    page_size: int = 16,
    num_pages: int | None = None,
    max_batch: int = 8,
    max_step_tokens: int = 512,
    cuda_graphs: bool | None = None,
):
    """A `course_lib.decode.batching.ContinuousBatcher` for `model`, sized for `prompts`: `num_pages`
    defaults to enough pages for every prompt at full length; cuda_graphs: replay the decode steps as
    CUDA graphs (`course_lib.decode.graphs`), None: when the model is on a CUDA device. Pass it to
    `stream` / `serve` to serve several calls through one page pool and one set of captured graphs,
    as a server does."""
    from ..decode.batching import ContinuousBatcher

    prompts = _prompts(model, prompts, "make_batcher")
    max_new_tokens = check_int("make_batcher", "max_new_tokens", max_new_tokens, 1)
    page_size = check_int("make_batcher", "page_size", page_size, 1)
    if num_pages is None:
        num_pages = sum(-(-(len(p) + max_new_tokens + 1) // page_size) for p in prompts)
    if cuda_graphs is None:
        cuda_graphs = torch.device(model.device).type == "cuda"
    return ContinuousBatcher(model, num_pages, page_size, max_batch, max_step_tokens, cuda_graphs)


def stream(model, prompts, max_new_tokens: int, batcher=None, **sizes) -> Iterator[tuple[int, int]]:
    """Generate for all `prompts` at once over course_lib's paged KV cache; yields (prompt index,
    token) as tokens appear. `batcher`: a loop from `make_batcher` to serve through (its page pool and
    CUDA graphs are kept from call to call); without one, a new loop sized by `sizes` (`make_batcher`'s
    keywords: page_size, num_pages, max_batch, max_step_tokens, cuda_graphs). Every prompt and its new
    tokens must fit the model's max_seq_len (checked before anything is queued)."""
    prompts = _prompts(model, prompts, "stream")
    max_new_tokens = _check_fits(model, prompts, max_new_tokens, "stream")
    if max_new_tokens == 0:  # nothing to generate, as `serve` and `sample` answer
        return
    if batcher is None:
        batcher = make_batcher(model, prompts, max_new_tokens, **sizes)
    elif sizes:
        raise ValueError(f"stream: {sorted(sizes)} size a new loop; the batcher given has its own sizes")
    elif batcher.model is not model:
        raise ValueError("stream: the batcher given serves another model")
    yield from batcher.stream(prompts, max_new_tokens)


def serve(model, prompts, max_new_tokens: int, **kwargs) -> list[list[int]]:
    """`stream` to the end: the greedy continuation of each prompt (list of token-id lists)."""
    prompts = _prompts(model, prompts, "serve")
    max_new_tokens = _check_fits(model, prompts, max_new_tokens, "serve")
    out = [[] for _ in prompts]
    if max_new_tokens == 0:
        return out
    for i, token in stream(model, prompts, max_new_tokens, **kwargs):
        out[i].append(token)
    return out
