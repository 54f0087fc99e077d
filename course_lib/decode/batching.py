"""Continuous batching: requests join and leave between steps, prefill and decode share a step (notebook 10).

The model interface (what a model must offer to be served by `ContinuousBatcher`; the capstone model in
`course_lib.models` implements it):

    model.num_layers    int    number of attention layers (one K/V page pool each)
    model.num_kv_heads  int    Hkv, the K/V heads per layer
    model.head_dim      int    d
    model.dtype         torch.dtype of the K/V cache (float16, bfloat16 or float32)
    model.device        torch.device where the cache lives
    model.forward_step(token_ids, positions, kv) -> logits
        token_ids  (T,) int64  the new tokens of this step, every running sequence's new tokens one
                               after another (a prefill chunk for some, one token for the others)
        positions  (T,) int64  each token's position in its own sequence (for RoPE)
        kv         PagedKV     the step's view of the paged cache; each attention layer `l` calls
                               o = kv.attend(l, q, k, v) with q (T, Hq, d) (after RoPE), k, v (T, Hkv, d);
                               attend writes k, v into the cache and returns o (T, Hq, d) in q's dtype:
                               causal attention of each new token over its sequence's cache.
        logits     (T, vocab)  float; the batcher reads the row of each sequence's last new token.

The model never sees pages, block tables or the batch layout: `PagedKV.attend` (`paged_kv.py`) owns them.
A batcher's `kv_view` may hand the model another view with the same `attend` (cascade attention over a shared
prefix: `course_lib.serving.cascade.CascadeChoice`, notebook 14).
"""

from __future__ import annotations

import numpy as np
import torch

from ..checks import (
    check_generation_fits,
    check_int,
    kernel_support,
    max_positions,
    token_id,
    token_ids_array,
    vocab_size,
)
from .cache import OutOfPages, PagedKVCache, SwappedSequence
from .graphs import DecodeGraphs
from .paged_kv import PagedKV, to_device


class Request:
    """A prompt to continue greedily for up to max_new_tokens tokens (or until eos_id).

    `Request(id, prompt, max_new_tokens, eos_id=None, generated=None, computed=0, prompt_ids=None)`: prompt a list
    of token ids, or None with `prompt_ids`, its int64 NumPy array, given (what `ContinuousBatcher.submit` makes
    from the caller's list). The list is then made only when something reads `prompt`: a serving step reads the
    array alone (`ids`, `num_tokens`), and a 32k-token prompt's list of ids below 32000 took 0.45 ms to make
    (2-core CPU, 2026-11-30). Two requests are equal only if they are the same object."""

    __slots__ = (
        "id",
        "_prompt",
        "max_new_tokens",
        "eos_id",
        "generated",
        "computed",
        "prompt_ids",
        "_n_prompt",
    )

    def __init__(
        self,
        id: int,
        prompt: list[int] | None,
        max_new_tokens: int,
        eos_id: int | None = None,
        generated: list[int] | None = None,
        computed: int = 0,
        prompt_ids: np.ndarray | None = None,
    ):
        if prompt is None and prompt_ids is None:
            raise ValueError("Request: give the prompt as a list, or its ids as prompt_ids")
        self.id, self._prompt, self.max_new_tokens, self.eos_id = id, prompt, max_new_tokens, eos_id
        self.generated = [] if generated is None else generated
        self.computed = computed  # tokens of prompt + generated already in the cache
        self.prompt_ids = prompt_ids  # `ids`' int64 prompt (made once)
        self._n_prompt = len(prompt) if prompt is not None else len(prompt_ids)

    @property
    def prompt(self) -> list[int]:
        """The prompt's token ids as a list (made from `prompt_ids` on first read when only they were given)."""
        if self._prompt is None:
            self._prompt = self.prompt_ids.tolist()
        return self._prompt

    def __repr__(self) -> str:
        return (
            f"Request(id={self.id}, prompt=<{self._n_prompt} tokens>, max_new_tokens={self.max_new_tokens}, "
            f"eos_id={self.eos_id}, generated={self.generated}, computed={self.computed})"
        )

    @property
    def tokens(self) -> list[int]:
        """prompt + generated (a new list each call: `num_tokens`, `token_at` and `ids` copy nothing)."""
        return self.prompt + self.generated

    @property
    def num_tokens(self) -> int:
        return self._n_prompt + len(self.generated)

    def token_at(self, i: int) -> int:
        """tokens[i] (0 <= i < num_tokens)."""
        n = self._n_prompt
        if i >= n:
            return self.generated[i - n]
        return self._prompt[i] if self._prompt is not None else int(self.prompt_ids[i])

    def ids(self, start: int, stop: int) -> np.ndarray:
        """tokens[start:stop] (0 <= start <= stop <= num_tokens) as an int64 NumPy array: within the prompt a view
        of `prompt_ids`, which is made once, so a request's prompt is converted from a list once, not per step
        (read-only: it is the request's own)."""
        if self.prompt_ids is None:
            self.prompt_ids = np.asarray(self._prompt, dtype=np.int64)
        n = self._n_prompt
        if stop <= n:
            return self.prompt_ids[start:stop]
        tail = np.asarray(self.generated[max(start - n, 0) : stop - n], dtype=np.int64)
        return tail if start >= n else np.concatenate([self.prompt_ids[start:], tail])

    @property
    def done(self) -> bool:
        hit_eos = self.eos_id is not None and self.generated[-1:] == [self.eos_id]
        return len(self.generated) >= self.max_new_tokens or hit_eos


PREEMPTION_MODES = ("recompute", "swap")


def _step_inputs(plan: list[tuple[Request, int]]) -> tuple:
    """A step's token ids and positions, where request r brings n tokens from r.computed: lists in a step where
    each brings one (a decode step: what `DecodeGraphs` takes), else int64 NumPy arrays, each request's a slice
    of its `ids` and a range. No Python per token: a 32k-token prefill's lists and their conversion took 2 ms
    on a 2-core CPU, and copying each request's tokens (`Request.tokens`) cost a decode step O(its length)."""
    if all(n == 1 for _, n in plan):
        return [r.token_at(r.computed) for r, _ in plan], [r.computed for r, _ in plan]
    token_ids = _joined([r.ids(r.computed, r.computed + n) for r, n in plan])
    positions = _joined([np.arange(r.computed, r.computed + n, dtype=np.int64) for r, n in plan])
    return token_ids, positions


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    """`arrays` one after another: the one array itself where there is one (a prefill of one request: not
    copied here, `paged_kv.to_device` copies it once)."""
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


class ContinuousBatcher:
    """Serve requests with a model that follows the interface above, over a paged KV cache. Notebook 10.

    Each `step()`: admit waiting requests while there is room (max_batch sequences, free pages for the
    prompt); give every decoding request its next token, then the requests still in prefill chunks of
    their prompt, in the order they were admitted, from what is left of max_step_tokens (so prefill and
    decode share the step: a request in prefill may get no token in a step whose budget the others
    took, and decoding requests always run, even more of them than max_step_tokens); run the model
    once over all of them; append the greedy next token to each request that reached the end of its
    tokens; retire finished requests and free their pages. When the pool runs out mid-step, the most
    recently admitted request is preempted and goes back to the front of the queue, by `preemption`:
    "recompute" frees its pages and computes its tokens again when it is admitted (vLLM's default);
    "swap" copies its pages to host memory (`PagedKVCache.swap_out`, pinned on a GPU), frees them, and
    copies them back into free pages when it is admitted again (`swap_in`), so nothing is recomputed.
    cuda_graphs=True (a model on a CUDA device) replays each step in which every sequence decodes as a
    CUDA graph (`graphs.DecodeGraphs`): the same model code, one launch from the CPU per step; and a model
    that has `use_piecewise_graphs` (`models.Llama`) replays the work between the attention calls of the other
    steps (prefills, mixed steps) from graphs per token count (`models.piecewise`, notebook 14).
    kv_view(cache, seq_ids, new_lens, slots) -> a view with `attend`, or None: asked first at each step
    for the view the model attends through; None (or no kv_view) takes `PagedKV.for_step` (and the CUDA
    graph where one replays the step). `serving.cascade.CascadeChoice` is one: cascade attention for the
    decode steps whose sequences share a long enough prefix of pages."""

    def __init__(
        self,
        model,
        num_pages: int,
        page_size: int = 16,
        max_batch: int = 8,
        max_step_tokens: int = 512,
        cuda_graphs: bool = False,
        preemption: str = "recompute",
        kv_view=None,
    ):
        if problem := kernel_support(model.dtype, model.head_dim):  # refused before a page is taken
            raise ValueError(
                f"ContinuousBatcher: the paged decoding kernel cannot serve this model: {problem}"
            )
        max_batch = check_int("ContinuousBatcher", "max_batch", max_batch, 1)
        max_step_tokens = check_int("ContinuousBatcher", "max_step_tokens", max_step_tokens, 1)
        if not isinstance(preemption, str) or preemption not in PREEMPTION_MODES:
            raise ValueError(
                f"ContinuousBatcher: preemption must be one of {PREEMPTION_MODES}, got {preemption!r}"
            )
        if kv_view is not None and not callable(kv_view):
            raise TypeError(
                f"ContinuousBatcher: kv_view must be None or a callable (cache, seq_ids, new_lens, slots) -> view, "
                f"got {type(kv_view).__name__}"
            )
        self.model = model
        self.cache = PagedKVCache(
            model.num_layers,
            num_pages,
            page_size,
            model.num_kv_heads,
            model.head_dim,
            model.dtype,
            model.device,
        )
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        # decode-only steps replayed as CUDA graphs (`graphs.DecodeGraphs`; a CUDA model only)
        self.graphs = DecodeGraphs(model, self.cache) if cuda_graphs else None
        if cuda_graphs and hasattr(model, "use_piecewise_graphs"):
            model.use_piecewise_graphs()
        self.preemption, self.kv_view = preemption, kv_view
        self.swapped: dict[int, SwappedSequence] = {}  # request id -> its pages in host memory ("swap")
        self.preemptions = 0
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished: dict[int, Request] = {}
        self._next_id = 0
        self.steps = 0
        self.last_plan: list[tuple[int, int]] = []  # (request id, tokens fed) of the last step

    def submit(self, prompt, max_new_tokens: int, eos_id: int | None = None) -> int:
        """Queue a request (prompt: a non-empty list of token ids); returns its id. A request whose
        prompt and new tokens could never fit in the page pool, even alone, is refused here."""
        where = "ContinuousBatcher.submit"
        ids = token_ids_array(where, prompt, vocab_size(self.model), as_list=False)[1]
        max_new_tokens = check_int(where, "max_new_tokens", max_new_tokens, 1)
        if len(ids) == 0:
            raise ValueError(f"{where}: a request needs a non-empty prompt")
        # room for the prompt and the new tokens (admission asks for the prompt and one more)
        need, room = len(ids) + max_new_tokens, self.cache.allocator.num_pages * self.cache.page_size
        if need > room:
            raise ValueError(
                f"{where}: a prompt of {len(ids)} tokens and {max_new_tokens} new ones need room for {need} "
                f"tokens, more than the whole page pool holds ({self.cache.allocator.num_pages} pages of "
                f"{self.cache.page_size} = {room}); ask for fewer tokens or a larger num_pages"
            )
        check_generation_fits(where, len(ids), max_new_tokens, max_positions(self.model))
        if eos_id is not None:
            eos_id = token_id(where, "eos_id", eos_id, vocab_size(self.model))
        req = Request(self._next_id, None, max_new_tokens, eos_id, prompt_ids=ids)  # its list made if read
        self._next_id += 1
        self.waiting.append(req)
        return req.id

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            need = -(-(req.num_tokens + 1) // self.cache.page_size)
            if need > self.cache.allocator.num_free:
                break
            self.waiting.pop(0)
            if req.id in self.swapped:
                self._swap_in(req)
            else:
                self.cache.add_sequence(req.id)
            self.running.append(req)

    def _swap_in(self, req: Request) -> None:
        """Bring a swapped request's pages back from host memory (admission found room for them)."""
        self.cache.swap_in(req.id, self.swapped.pop(req.id))

    def _preempt(self) -> None:
        req = self.running.pop()
        self.preemptions += 1
        if self.preemption == "swap":
            self.swapped[req.id] = self.cache.swap_out(req.id)  # req.computed stays: its K/V are kept
        else:
            self.cache.free(req.id)
            req.computed = 0
        self.waiting.insert(0, req)

    def _launched(self, plan: list[tuple[Request, int]]) -> None:
        """Host work of a step that needs none of its results, run once its model step is launched and before its
        logits are read (on a GPU, while the step computes). `plan`: (request, tokens it brings), its tokens
        already appended to the cache. Nothing here; `serving.PrefixCachingBatcher` registers the pages the step
        fills."""

    @torch.no_grad()
    def step(self) -> dict[int, int]:
        """Run one step (no gradients: serving); returns {request id: new token} for the requests that
        produced one."""
        self._admit()
        if not self.running:
            if self.waiting:
                raise OutOfPages("the page pool cannot hold even one waiting request's prompt")
            return {}
        while True:
            # Decoding requests (one token left) first, then prefill chunks from what the budget leaves.
            decoding = [r for r in self.running if r.num_tokens - r.computed == 1]
            budget = self.max_step_tokens - len(decoding)
            plan = [(r, 1) for r in decoding]
            for req in self.running:
                if req.num_tokens - req.computed > 1 and budget > 0:
                    n = min(req.num_tokens - req.computed, budget)
                    budget -= n
                    plan.append((req, n))
            need = sum(self.cache.pages_needed(r.id, n) for r, n in plan)
            if need <= self.cache.allocator.num_free or len(self.running) == 1:
                break
            self._preempt()
        self.last_plan = [(r.id, n) for r, n in plan]
        slots = [self.cache.append(r.id, n) for r, n in plan]
        slots = slots[0] if len(slots) == 1 else torch.cat(slots)  # one sequence (a prefill): no copy
        token_ids, positions = _step_inputs(plan)
        seq_ids, new_lens = [r.id for r, _ in plan], [n for _, n in plan]
        last = np.cumsum(new_lens) - 1  # each sequence's last new token: its row of the logits
        kv = self.kv_view(self.cache, seq_ids, new_lens, slots) if self.kv_view is not None else None
        if kv is None and self.graphs is not None and len(token_ids) == len(plan):  # all decoding: replay
            logits = self.graphs.step(seq_ids, token_ids, positions, slots)
            last = slice(None)  # one token a sequence: every row is a last one
        else:
            # The step's host arrays (the cache view's, token ids, positions, the rows read) in one copy that does
            # not wait for the GPU (`paged_kv.to_device`): copied one by one, each waited (7 a step). NumPy
            # arrays but in a decode step (`_step_inputs`): torch.tensor of a 32k-int list took 4.7 ms on a 2-core
            # CPU.
            arrays = [np.asarray(x, dtype=np.int64) for x in (token_ids, positions)] + [last]
            if kv is None:
                view, tq = PagedKV.step_arrays(self.cache, seq_ids, new_lens, slots)
                prefill = PagedKV.prefill_plan(new_lens, view[1], self.cache.page_size)
                *view, token_ids, positions, last = to_device(view + arrays, self.model.device)
                kv = PagedKV(self.cache, *view, tq, prefill)
            else:
                token_ids, positions, last = to_device(arrays, self.model.device)
            logits = self.model.forward_step(token_ids, positions, kv)
        self._launched(plan)
        next_tokens = logits[last].argmax(-1).tolist()
        out = {}
        for (req, n), tok in zip(plan, next_tokens):
            req.computed += n
            if req.computed == req.num_tokens:  # the last token's logits predict the next one
                req.generated.append(int(tok))
                out[req.id] = int(tok)
        for req in [r for r in self.running if r.done]:
            self.running.remove(req)
            self.cache.free(req.id)
            self.finished[req.id] = req
        self.steps += 1
        return out

    def stream(self, prompts, max_new_tokens: int, eos_id: int | None = None):
        """Submit `prompts` (lists of token ids) and step until they are all finished; yields (prompt
        index, token) as tokens appear. Requests submitted before keep being served alongside. The
        finished requests are then dropped from `finished`, so a loop kept across calls (a server's)
        does not grow."""
        ids = {self.submit(p, max_new_tokens, eos_id): i for i, p in enumerate(prompts)}
        while any(r.id in ids for r in self.waiting + self.running):
            for request_id, token in self.step().items():
                if request_id in ids:
                    yield ids[request_id], token
        for request_id in ids:
            self.finished.pop(request_id, None)

    def run(self) -> dict[int, list[int]]:
        """Step until every submitted request is finished; returns {id: generated tokens}."""
        while self.waiting or self.running:
            self.step()
        return {i: r.generated for i, r in sorted(self.finished.items())}
