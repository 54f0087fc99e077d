"""A small decoder-only transformer of the Llama family, built from the course's pieces (notebook 12).

    tokens (B, N) int64
      -> embedding (vocab, dim)
      -> n_layers x [ h = x + Attention(RMSNorm(x)); x = h + SwiGLU(RMSNorm(h)) ]
      -> RMSNorm -> output projection (tied to the embedding or not) -> logits (B, N, vocab)

Attention is grouped-query (n_heads query heads share n_kv_heads K/V heads) with rotary position
embeddings (RoPE, the half-rotation layout of Llama in transformers) on Q and K; the MLP is SwiGLU,
W2 (silu(W1 x) * W3 x). Module and parameter names follow Meta's Llama code (`wq`, `w1`,
`attention_norm`, ...); `course_lib.models.convert` maps them to and from transformers' names.

One argument, `backend`, chooses the kernels; the weights are the same on every path, and it can be
changed on a built model (`model.backend = "sdpa"`):
- "course_lib": `course_lib.flash_attention` (Triton FlashAttention-2, notebooks 06-07, with GQA and
  bottom-right causal alignment for the KV cache), `course_lib.fused.rms_norm`,
  `course_lib.fused.rope` and `course_lib.fused.swiglu` (notebook 11);
- "sdpa": `torch.nn.functional.scaled_dot_product_attention` and RMSNorm / RoPE in plain PyTorch;
- "eager": attention written out (S = Q K^T, softmax, P V) as in notebook 02, the baseline whose
  N x N matrices the benchmark measures; RMSNorm / RoPE as for "sdpa".
"""

from __future__ import annotations

import math
import weakref
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import check_eps, check_int, check_real, check_token_ids, shape_and_dtype, should_validate
from .piecewise import MAX_TOKENS, PiecewiseGraphs

BACKENDS = ("course_lib", "sdpa", "eager")


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of a Llama-style model. `head_dim` = dim / n_heads; `hidden_dim` is the SwiGLU width."""

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden_dim: int = 352
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "max_seq_len"):
            check_int("LlamaConfig", name, getattr(self, name), 1)
        check_real("LlamaConfig", "rope_theta", self.rope_theta, low=0, low_open=True)
        check_eps("LlamaConfig", "norm_eps", self.norm_eps)
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaConfig: dim={self.dim} is not a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads} (GQA)"
            )
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim={self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def as_dict(self) -> dict:
        return asdict(self)


def count_parameters(config: LlamaConfig) -> int:
    """Number of parameters of `Llama(config)`, from the sizes alone (notebook 12, exercise 1).

    Per layer: Wq and Wo (dim x dim each), Wk and Wv (dim x n_kv_heads*head_dim each), W1, W2, W3
    (dim x hidden_dim each), two RMSNorm weights (dim each). Plus the embedding (vocab x dim), the
    final norm (dim) and, when not tied, the output projection (vocab x dim)."""
    c = config
    kv = c.n_kv_heads * c.head_dim
    per_layer = 2 * c.dim * c.dim + 2 * c.dim * kv + 3 * c.dim * c.hidden_dim + 2 * c.dim
    head = 0 if c.tie_embeddings else c.vocab_size * c.dim
    return c.n_layers * per_layer + c.vocab_size * c.dim + c.dim + head


def kv_cache_bytes_per_token(config: LlamaConfig, bytes_per_element: int = 2) -> int:
    """Bytes one token occupies in the KV cache: K and V, every layer, n_kv_heads heads of head_dim."""
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * bytes_per_element


# ------------------------------------------------------------------------------------------------
# The three pieces that switch with the backend
# ------------------------------------------------------------------------------------------------
def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in plain PyTorch, with Llama's casting rule: statistics in fp32, cast back to x's
    dtype, then multiply by the weight. x: (..., dim), weight: (dim,). Taught in notebook 11."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def rope_cache(config: LlamaConfig, n: int, device=None, dtype=torch.float32):
    """cos, sin of shape (n, head_dim) for positions 0..n-1, half-rotation layout: angle
    theta_i = pos * rope_theta^(-2i/head_dim) for i < head_dim/2, repeated for both halves."""
    d = config.head_dim
    inv_freq = config.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)
    angles = torch.arange(n, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope_torch(q, k, cos, sin):
    """Rotate q (B, Hq, N, d) and k (B, Hkv, N, d) by cos, sin of shape (N, d) (half layout).
    The rotation is computed in the dtype of cos/sin and cast back to q's dtype."""
    qf, kf = q.to(cos.dtype), k.to(cos.dtype)
    q_out = qf * cos + _rotate_half(qf) * sin
    k_out = kf * cos + _rotate_half(kf) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)


def attention_torch(q, k, v, causal: bool, backend: str):
    """Causal attention, bottom-right aligned (query i of Nq sees keys j <= i + Nk - Nq, as with a
    KV cache), in PyTorch. q: (B, Hq, Nq, d); k, v: (B, Hkv, Nk, d) with Hq a multiple of Hkv."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    group = q.shape[1] // k.shape[1]
    mask = None
    if causal and n_q != n_k:
        i = torch.arange(n_q, device=q.device)[:, None]
        j = torch.arange(n_k, device=q.device)[None, :]
        mask = j <= i + (n_k - n_q)
    if backend == "sdpa":
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=group > 1
        )
    if group > 1:  # eager: K/V heads repeated for every query head of their group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        if mask is None:
            mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return p @ v


def _course_lib_kernels():
    """course_lib's kernels, imported on first use (the Triton modules load only when needed)."""
    from .. import flash_attention
    from ..fused import rms_norm, rope, rope_, swiglu

    return flash_attention, rms_norm, rope, rope_, swiglu


def _rope(backend: str, q, k, cos, sin):
    """RoPE with the backend's implementation: q (B, Hq, N, d), k (B, Hkv, N, d), cos/sin (N, d)
    for positions 0..N-1 of q and k."""
    if backend == "course_lib":
        return _course_lib_kernels()[2](q, k, cos, sin)
    return rope_torch(q, k, cos, sin)


# ------------------------------------------------------------------------------------------------
# Modules
# ------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dim (notebook 11)."""

    backend = "sdpa"  # set by `Llama.backend`

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if self.backend == "course_lib":
            return _course_lib_kernels()[1](x, self.weight, self.eps)
        return rms_norm_torch(x, self.weight, self.eps)


def stacked_weight(module: nn.Module, names: tuple[str, ...]) -> torch.Tensor | None:
    """The weights of `module`'s linear layers `names` stacked along their output rows, so that a serving step makes
    one matmul where it made len(names) (as vLLM's merged QKV and gate/up projections): ((sum of outputs), in).

    Made on first use and remade when a weight changes: in place (its version counter), replaced (its storage) or
    moved (dtype, device). Not a parameter or a buffer: `state_dict`, `convert` and training see the separate
    weights only. None while a CUDA graph is being captured (`decode.graphs`): a captured step keeps the separate
    weights, whose changes in place its replays see, where a stack made before them would be stale. None for
    weights made under `torch.inference_mode` too: they count no versions, so a change could not be seen."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    weights = [getattr(module, name).weight for name in names]
    if any(w.is_inference() for w in weights):
        return None  # made under torch.inference_mode: no version counter to follow
    key = tuple((w._version, w.data_ptr(), w.dtype, w.device) for w in weights)
    cached = _STACKS.get(module)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, torch.cat(weights))
        _STACKS[module] = cached
    return cached[1]


# model -> its `PiecewiseGraphs` (`Llama.use_piecewise_graphs`), beside the model as the stacks are.
_PIECEWISE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# module -> (its weights' versions, pointers, dtypes and devices; their stack): held beside the module, not in it,
# so that pickling, `copy.deepcopy` and `state_dict` never carry a stack; it goes when the module does.
_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE. x: (B, N, dim) -> (B, N, dim).

    With a `cache` (a `KVCache`), the new K/V are appended at `start_pos` and the queries attend to
    every cached key up to their own position (bottom-right causal alignment)."""

    backend = "sdpa"  # set by `Llama.backend`

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.c = c
        self.wq = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)

    def project(self, x, cos, sin):
        """Q (B, Hq, N, d), K and V (B, Hkv, N, d) for x (B, N, dim), RoPE applied to Q and K."""
        b, n, _ = x.shape
        c, backend = self.c, self.backend
        q = self.wq(x).view(b, n, c.n_heads, c.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, n, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, n, c.n_kv_heads, c.head_dim).transpose(1, 2)
        q, k = _rope(backend, q, k, cos, sin)
        return q, k, v

    def attend(self, q, k, v):
        """Causal (bottom-right) attention of q over k, v, with the backend's kernel."""
        backend = self.backend
        if backend == "course_lib":
            flash = _course_lib_kernels()[0]
            causal = True if q.shape[-2] == k.shape[-2] else "bottom_right"
            return flash(q, k, v, causal=causal)
        return attention_torch(q, k, v, True, backend)

    def stacked(self) -> torch.Tensor | None:
        """WQ, WK, WV stacked for one matmul (`stacked_weight`), or None."""
        return stacked_weight(self, ("wq", "wk", "wv"))

    def project_step(self, x, positions, cos, sin, w):
        """`step`'s Q (T, Hq, d), K and V (T, Hkv, d) of x (T, dim), RoPE applied; w: the stacked weight
        (`stacked`) or None for the separate ones (`models.piecewise` passes the stack it captured)."""
        t, c = x.shape[0], self.c
        if w is None:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        else:  # one matmul; Q, K, V are column slices of its output (d contiguous, as the kernels take)
            kv_width = c.n_kv_heads * c.head_dim
            q, k, v = F.linear(x, w).split((c.n_heads * c.head_dim, kv_width, kv_width), dim=-1)
        q = q.view(t, c.n_heads, c.head_dim)
        k, v = k.view(t, c.n_kv_heads, c.head_dim), v.view(t, c.n_kv_heads, c.head_dim)
        if self.backend == "course_lib":  # heads first, (H, T, d) views; angles looked up per token
            q, k = _course_lib_kernels()[2](q.transpose(0, 1), k.transpose(0, 1), cos, sin, positions)
            return q.transpose(0, 1), k.transpose(0, 1), v
        if positions is not None:
            cos, sin = cos[positions], sin[positions]
        q, k = rope_torch(q, k, cos[:, None, :], sin[:, None, :])
        return q, k, v

    def project_into(self, x, cos, sin, w, qkv) -> None:
        """`project_step` written into qkv (T, Hq + 2 Hkv, d): Q's heads, then K's, then V's, RoPE applied (cos,
        sin: the (T, d) rows of the tokens' positions; w: the stacked weight or None). With course_lib's kernels and
        the stacked weight, the matmul writes qkv itself and RoPE rotates its Q and K heads in place (`fused.rope_`):
        no Q/K/V tensors of their own, no copy into qkv (`models.piecewise`: 18 us a layer at 3280 tokens)."""
        c = self.c
        if self.backend == "course_lib" and w is not None:
            torch.mm(x, w.t(), out=qkv.view(x.shape[0], -1))
            q, k = qkv[:, : c.n_heads], qkv[:, c.n_heads : c.n_heads + c.n_kv_heads]
            _course_lib_kernels()[3](q.transpose(0, 1), k.transpose(0, 1), cos, sin)
            return
        torch.cat(self.project_step(x, None, cos, sin, w), dim=1, out=qkv)

    def step(self, x, positions, cos, sin, kv, layer: int):
        """One serving step over T new tokens of several sequences: x (T, dim), positions (T,) int64 with cos/sin the
        (max_seq_len, d) tables, or positions None with cos/sin the (T, d) rows of the tokens' positions, looked up
        once a step (`Llama.forward_step`); `kv` is the step's `course_lib.decode.paged_kv.PagedKV`, which writes
        K/V into the paged cache and runs the paged split-KV decode kernel (notebook 10). Returns (T, dim)."""
        q, k, v = self.project_step(x, positions, cos, sin, self.stacked())
        return self.wo(kv.attend(layer, q, k, v).reshape(x.shape[0], -1))

    def forward(self, x, cos, sin, cache=None, layer=0, start_pos=0):
        b, n, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, start_pos, k, v)
        o = self.attend(q, k, v)
        return self.wo(o.transpose(1, 2).reshape(b, n, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: W2 (silu(W1 x) * W3 x). x: (..., dim) -> (..., dim). With course_lib's kernels the gate
    silu(a) * b is one fused kernel (`course_lib.fused.swiglu`, notebook 11)."""

    backend = "sdpa"  # set by `Llama.backend`

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.hidden_dim, bias=False)
        self.w2 = nn.Linear(c.hidden_dim, c.dim, bias=False)
        self.w3 = nn.Linear(c.dim, c.hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(self.gate(self.w1(x), self.w3(x)))

    def gate(self, a, b):
        """silu(a) * b with the backend's kernels."""
        if self.backend == "course_lib":
            return _course_lib_kernels()[4](a, b)
        return F.silu(a) * b

    def stacked(self) -> torch.Tensor | None:
        """W1 and W3 stacked for one matmul (`stacked_weight`), or None."""
        return stacked_weight(self, ("w1", "w3"))

    def step(self, x):
        """`forward` in a serving step (no gradient): W1 and W3 in one matmul (`stacked_weight`)."""
        return self.stacked_step(x, self.stacked())

    def stacked_step(self, x, w):
        """`step` with the stacked W1/W3 given (`stacked`; None: the separate weights)."""
        if w is None:
            return self(x)
        return self.w2(self.gate(*F.linear(x, w).chunk(2, dim=-1)))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: h = x + attention(norm(x)); out = h + mlp(norm(h))."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(c.dim, c.norm_eps)
        self.attention = Attention(c)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)
        self.feed_forward = FeedForward(c)

    def forward(self, x, cos, sin, cache=None, layer=0, start_pos=0):
        h = x + self.attention(self.attention_norm(x), cos, sin, cache, layer, start_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class KVCache:
    """A contiguous KV cache: k, v of shape (n_layers, B, n_kv_heads, max_len, head_dim).

    The plain reference for generation; `course_lib.models.generate` also serves from course_lib's
    paged cache (notebook 10). `update` writes the new K/V at `start_pos` and returns the cached
    K/V of positions 0 .. start_pos + n - 1."""

    def __init__(self, config: LlamaConfig, batch: int, max_len: int, device=None, dtype=torch.float32):
        batch, max_len = check_int("KVCache", "batch", batch, 1), check_int("KVCache", "max_len", max_len, 1)
        shape = (config.n_layers, batch, config.n_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = [0] * config.n_layers  # positions written so far, per layer

    def update(self, layer: int, start_pos: int, k, v):
        """Write k, v (B, n_kv_heads, n, head_dim) at positions start_pos .. start_pos + n - 1 (no gap after
        what is cached: start_pos <= the positions written) and return the cache up to them."""
        expected = (*self.k.shape[1:3], self.k.shape[-1])
        if (k.shape[0], k.shape[1], k.shape[3]) != expected or k.shape != v.shape:
            raise ValueError(
                f"KVCache: k and v must be (batch, n_kv_heads, n, head_dim) with (batch, n_kv_heads, head_dim) = "
                f"{expected}, as the cache was made; got k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        if (k.dtype, v.dtype, k.device, v.device) != (self.k.dtype,) * 2 + (self.k.device,) * 2:
            raise TypeError(
                f"KVCache: the cache was made {self.k.dtype} on {self.k.device}, but the model's k, v are "
                f"{k.dtype} / {v.dtype} on {k.device} / {v.device}: make the cache with the model's dtype "
                "and device (KVCache(config, batch, max_len, device, dtype))"
            )
        end = start_pos + k.shape[-2]
        if end > self.k.shape[-2]:
            raise ValueError(
                f"KVCache: positions up to {end} do not fit a cache of {self.k.shape[-2]} tokens"
            )
        if start_pos > self.length[layer]:
            raise ValueError(
                f"KVCache: start_pos={start_pos} leaves a gap after the {self.length[layer]} positions cached "
                "(their K/V would be zeros)"
            )
        self.length[layer] = max(self.length[layer], end)
        self.k[layer, :, :, start_pos:end] = k
        self.v[layer, :, :, start_pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class Llama(nn.Module):
    """The capstone model (notebook 12). `Llama(config, backend)`; backend in BACKENDS.

    forward(tokens (B, N) int64, targets=None, cache=None, start_pos=0) -> logits (B, N, vocab)
    in the compute dtype, or (logits, loss) with targets (B, N) (mean cross-entropy in fp32)."""

    def __init__(self, config: LlamaConfig, backend: str = "sdpa"):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_cache(config, config.max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.backend = backend
        self.reset_parameters()

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        if name not in BACKENDS:
            raise ValueError(f"Llama: backend must be one of {BACKENDS}, got {name!r}")
        self._backend = name
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, FeedForward)):
                m.backend = name

    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, std) weights as transformers' Llama uses; output projections of each block
        scaled by 1/sqrt(2 n_layers) (GPT-2's rule) so the residual stream does not grow with depth."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, std=std / math.sqrt(2 * self.config.n_layers))
            else:
                nn.init.normal_(p, std=std)

    # The model interface of `course_lib.decode.batching.ContinuousBatcher` (notebook 10).
    @property
    def num_layers(self) -> int:
        return self.config.n_layers

    @property
    def num_kv_heads(self) -> int:
        return self.config.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    @torch.no_grad()
    def forward_step(self, token_ids, positions, kv):
        """One continuous-batching step: token_ids and positions (T,) int64 (the new tokens of every
        running sequence, one sequence after another), kv a `PagedKV`. Returns logits (T, vocab), fp32.

        The RoPE rows of the positions are looked up once for every layer: looked up in each, the PyTorch path
        launched 2 gathers a layer, and the fused kernel checked the positions in every layer (on a GPU a sync
        each, waiting for the layers before). Positions outside 0..max_seq_len - 1 raise here where they are on
        the CPU (`should_validate`); on a GPU the lookup's device-side assert catches those past the end, as the
        embedding does token ids (reading them would sync every step).

        After `use_piecewise_graphs` (on a GPU), the work between the attention calls of a step of up to its
        max_tokens tokens is replayed from CUDA graphs (`piecewise.PiecewiseGraphs`), with the same result."""
        graphs = _PIECEWISE.get(self)
        if graphs is not None and (logits := graphs.run(token_ids, positions, kv)) is not None:
            return logits
        x = self.tok_embeddings(token_ids)
        n = self.rope_cos.shape[0]
        if should_validate(False, positions.device) and positions.numel():  # the CPU: reading them is free
            low, high = torch.stack(torch.aminmax(positions)).tolist()
            if low < 0 or high >= n:
                raise ValueError(
                    f"Llama.forward_step: positions run from {low} to {high}, but the model has positions 0..{n - 1} "
                    "(max_seq_len)"
                )
        cos, sin = self.rope_cos[positions].to(x.dtype), self.rope_sin[positions].to(x.dtype)
        for i, layer in enumerate(self.layers):
            h = x + layer.attention.step(layer.attention_norm(x), None, cos, sin, kv, i)
            x = h + layer.feed_forward.step(layer.ffn_norm(h))
        return self.output(self.norm(x)).float()

    def use_piecewise_graphs(self, enabled: bool = True, max_tokens: int = MAX_TOKENS, capture=()) -> None:
        """Replay the work between a serving step's attention calls from CUDA graphs (`piecewise`, notebook 14):
        on for steps of up to `max_tokens` tokens, or off; `capture`: token counts whose graphs are captured now
        (else each bucket's at its first step). A model on a CUDA device; the graphs are kept beside the model,
        not in it (a copy or a pickle of the model carries none)."""
        if not enabled:
            _PIECEWISE.pop(self, None)
            return
        max_tokens = check_int("Llama.use_piecewise_graphs", "max_tokens", max_tokens, 1)
        graphs = _PIECEWISE.get(self)
        if graphs is None or graphs.max_tokens != max_tokens:
            graphs = _PIECEWISE[self] = PiecewiseGraphs(self, max_tokens)
        graphs.capture(capture)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens, targets=None, cache=None, start_pos: int = 0):
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.int64:
            raise TypeError(
                f"Llama: tokens must be an int64 tensor of shape (batch, seq_len); got {shape_and_dtype(tokens)}"
            )
        if tokens.numel() == 0:
            raise ValueError(
                f"Llama: tokens {tuple(tokens.shape)} hold no token (batch and seq_len must be >= 1)"
            )
        start_pos = check_int("Llama", "start_pos", start_pos, 0)
        check_token_ids("Llama: tokens", tokens, self.config.vocab_size)
        if targets is not None and (
            not isinstance(targets, torch.Tensor)
            or targets.shape != tokens.shape
            or targets.dtype != torch.int64
        ):
            raise ValueError(
                f"Llama: targets must be an int64 tensor of the tokens' shape {tuple(tokens.shape)}; got "
                f"{shape_and_dtype(targets)}"
            )
        if targets is not None:
            check_token_ids("Llama: targets", targets, self.config.vocab_size, ignore=-100)
        n = tokens.shape[1]
        if start_pos + n > self.config.max_seq_len:
            raise ValueError(
                f"Llama: positions {start_pos}..{start_pos + n - 1} exceed max_seq_len={self.config.max_seq_len}"
            )
        x = self.tok_embeddings(tokens)
        dtype = (
            torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        )
        cos = self.rope_cos[start_pos : start_pos + n].to(dtype)
        sin = self.rope_sin[start_pos : start_pos + n].to(dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, start_pos)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss
