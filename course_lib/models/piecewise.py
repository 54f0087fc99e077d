"""A serving step's work between its attention calls replayed from CUDA graphs, one set per token count
("piecewise" graphs, as vLLM and SGLang capture them): notebook 14.

A step over T new tokens (`Llama.forward_step`) launches, per layer, about twenty kernels from Python: two
RMSNorms, four matmuls, RoPE, SwiGLU's products, the residual adds, and the attention over the paged cache.
With a few thousand tokens the GPU's work per layer is around a millisecond, and the host's launches take as
long: the GPU waits for them at the start of a step (a cached prompt's first token, notes/serving.md). Only
the attention depends on the cache (its pages, lengths and the kernel's plan); everything between two
attention calls depends on T alone. So, per bucket of token counts, the step is cut at its attention calls:

    piece 0:      embedding, RoPE rows of the positions, layer 0's norm, Q/K/V projection, RoPE
    piece i:      layer i-1's output projection, residual, SwiGLU MLP, residual; layer i's norm, Q/K/V, RoPE
    piece L:      layer L-1's output projection, residual, MLP, residual

and each piece is captured as a CUDA graph over fixed buffers of the bucket's T rows (`_Pieces`: token ids,
positions, the residual stream, Q/K/V, the attention's output), T padded up to the bucket (`bucket`). A step
copies its token ids and positions in, replays piece 0, runs layer 0's attention as usual on the first T rows
(`kv.attend`: the cache write, the paged or prefill kernel), copies its output in, replays piece 1, and so on;
then the final norm and the logits (fp32) as usual: L + 1 replays, L attention calls and 3 launches, where it
launched about 20 L kernels. Padding rows compute on stale but valid ids and positions; rows never mix outside
attention, so they change nothing in the first T rows.

The graphs read the weights where they are, so changes in place are seen; the stacked Q/K/V and W1/W3
weights (`llama.stacked_weight`) are copies, so a graph set is dropped and captured again when any
parameter changes (its version) or moves (its storage), and when the model's backend changes.
Capturing a bucket costs three runs of its step (`perf.timing.graphed`): the first step at a new bucket pays it,
the later ones replay.
"""

from __future__ import annotations

import operator
import weakref

import torch

from ..checks import check_int
from ..perf.timing import graphed

MAX_TOKENS = 8192  # steps of more tokens run as usual: per-token work there outweighs the launches


def bucket(tokens: int) -> int:
    """The token count a step of `tokens` tokens is padded to: the next power of two up to 256 (at least 16),
    then the next multiple of 256 (at most 1/9 of the rows padded past 256; 3280 -> 3328)."""
    if tokens <= 256:
        return max(16, 1 << (tokens - 1).bit_length())
    return -(-tokens // 256) * 256


class Weights:
    """What a captured graph set depends on beyond T: which tensor each parameter slot of the model holds, each
    one's storage, and its version where it has one (a tensor made under `torch.inference_mode` has none; no stack
    is made of those). `changed()` tells, in about 15 us for the bench's 8-layer model (a key built by walking
    `model.parameters()` took 130 us on a 2-core CPU), whether a parameter was replaced, moved, or changed in place
    since this was made."""

    def __init__(self, model):
        slots = [
            (m._parameters, name)
            for m in model.modules()
            for name, p in m._parameters.items()
            if p is not None
        ]
        self.dicts, self.names = (list(x) for x in zip(*slots)) if slots else ([], [])
        self.params = list(map(dict.__getitem__, self.dicts, self.names))
        self.versioned = [p for p in self.params if not p.is_inference()]
        self.key = self._key()

    def _key(self) -> tuple:
        return (
            tuple(map(torch.Tensor.data_ptr, self.params)),
            tuple(map(torch.Tensor._version.__get__, self.versioned)),
        )  # fmt: skip

    def changed(self) -> bool:
        now = map(dict.get, self.dicts, self.names)
        return not all(map(operator.is_, now, self.params)) or self._key() != self.key


class _Pieces:
    """The L + 1 graphs of one bucket of `tokens` rows and the buffers they read and write, one set shared by every
    layer: the residual stream x (added to in place), Q/K/V after RoPE (T, Hq + 2 Hkv, d), the attention's output,
    the token ids, positions and their RoPE rows. The graphs' other tensors live in the pool all buckets share (no two
    graphs run at once), so a bucket holds a few activations of T rows, not L of them."""

    def __init__(self, model, tokens: int, pool):
        c, device, dtype = model.config, model.device, model.dtype
        self.tokens = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.cos = torch.zeros(tokens, c.head_dim, dtype=dtype, device=device)
        self.sin = torch.zeros_like(self.cos)
        self.x = torch.zeros(tokens, c.dim, dtype=dtype, device=device)
        self.qkv = torch.zeros(tokens, c.n_heads + 2 * c.n_kv_heads, c.head_dim, dtype=dtype, device=device)
        self.o = torch.zeros(tokens, c.n_heads * c.head_dim, dtype=dtype, device=device)
        self.heads = (c.n_heads, c.n_heads + c.n_kv_heads)  # where K and V start in qkv's heads
        layers = model.layers
        stacks = [(b.attention.stacked(), b.feed_forward.stacked()) for b in layers]
        self.stacks = stacks  # held: the graphs read them where they were at capture

        def project(i):  # layer i's Q, K, V of x, RoPE applied, into qkv
            block = layers[i]
            block.attention.project_into(
                block.attention_norm(self.x), self.cos, self.sin, stacks[i][0], self.qkv
            )

        def finish(i):  # layer i after its attention: the output projection, the MLP, both residuals, in x
            block = layers[i]
            self.x.add_(block.attention.wo(self.o))
            self.x.add_(block.feed_forward.stacked_step(block.ffn_norm(self.x), stacks[i][1]))

        def first():
            self.x.copy_(model.tok_embeddings(self.tokens))
            self.cos.copy_(model.rope_cos[self.positions])
            self.sin.copy_(model.rope_sin[self.positions])
            project(0)

        def middle(i):
            finish(i - 1)
            project(i)

        self.replays = [graphed(first, pool)]
        self.replays += [graphed(lambda i=i: middle(i), pool) for i in range(1, len(layers))]
        self.replays.append(graphed(lambda: finish(len(layers) - 1), pool))

    def run(self, model, token_ids, positions, kv) -> torch.Tensor:
        t, (k0, v0) = token_ids.shape[0], self.heads
        self.tokens[:t].copy_(token_ids)
        self.positions[:t].copy_(positions)
        qkv = self.qkv[:t]
        q, k, v = qkv[:, :k0], qkv[:, k0:v0], qkv[:, v0:]
        for i, replay in enumerate(self.replays[:-1]):
            replay()
            self.o[:t].copy_(kv.attend(i, q, k, v).reshape(t, -1))
        self.replays[-1]()
        # The logits (T, vocab) as usual, outside the graphs: a bucket would keep them (vocab may be large).
        return model.output(model.norm(self.x[:t])).float()


class PiecewiseGraphs:
    """`Llama.forward_step` with the work between attention calls replayed from CUDA graphs, one set per
    token bucket (`bucket`), captured at first use. `run(token_ids, positions, kv)` returns the logits
    (T, vocab) fp32, or None where the step runs as usual: more than `max_tokens` tokens, or a CUDA graph being
    captured (a caller's graph holds the step)."""

    def __init__(self, model, max_tokens: int = MAX_TOKENS):
        if torch.device(model.device).type != "cuda":
            raise ValueError(
                f"PiecewiseGraphs: CUDA graphs need a model on a CUDA device, got {model.device}"
            )
        # Kept beside the model, in a weak mapping (`Llama.use_piecewise_graphs`): a weak reference back.
        self.model = weakref.ref(model)
        self.max_tokens = max_tokens
        self.pieces: dict[int, _Pieces] = {}
        self.weights: Weights | None = None
        self.backend = model.backend
        self.pool = None
        self.captures = 0  # buckets captured (again after a weight change)

    @torch.no_grad()
    def run(self, token_ids, positions, kv) -> torch.Tensor | None:
        t = token_ids.shape[0]
        if not 0 < t <= self.max_tokens or torch.cuda.is_current_stream_capturing():
            return None
        model = self.model()
        pieces = self._pieces(model, bucket(t))
        return None if pieces is None else pieces.run(model, token_ids, positions, kv)

    @torch.no_grad()
    def capture(self, token_counts) -> None:
        """Capture now the buckets of steps of these token counts (at most max_tokens), as a server captures its
        sizes when it starts, so that no request pays a capture (three runs of a step) on its first token."""
        model = self.model()
        for t in token_counts:
            t = check_int("PiecewiseGraphs.capture", "a token count", t, 1)
            if t > self.max_tokens:
                raise ValueError(
                    f"PiecewiseGraphs.capture: {t} tokens is more than max_tokens={self.max_tokens}; such steps run "
                    "as usual (raise max_tokens to replay them)"
                )
            self._pieces(model, bucket(t))

    def _pieces(self, model, n: int) -> _Pieces | None:
        """The graphs of bucket n, captured if need be; None once the model is off the GPU."""
        if model.device.type != "cuda":
            return None
        # A parameter changed or moved, or the backend (its kernels) changed: every graph is stale.
        if self.weights is None or self.weights.changed() or self.backend != model.backend:
            self.pieces.clear()
            self.pool = torch.cuda.graph_pool_handle()  # the old pool goes with its graphs
            self.weights, self.backend = Weights(model), model.backend
        pieces = self.pieces.get(n)
        if pieces is None:
            pieces = self.pieces[n] = _Pieces(model, n, self.pool)
            self.captures += 1
        return pieces
