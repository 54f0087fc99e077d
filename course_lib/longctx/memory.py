"""What long context costs in memory: Infini's memory, a KV cache, a ring's share (notebook 16).

Computed (any machine):
- `infini_memory_bytes`: M (d x d_v) and z (d) per head and layer, in float32: constant in the context length.
- `kv_cache_bytes`: K and V of every token, per layer (full attention's decoding state): linear in N.
- `ring_share_bytes`: what one of P devices holds of K/V in ring attention (notebook 13): its own slice and
  the one arriving, 2 x 2 x N/P x H_kv x d elements: linear in N, divided by P.

Measured (a CUDA GPU only): `measure_stream` feeds a context of N tokens chunk by chunk, as a long prompt or
a stream arrives, through Infini-attention (carrying (M, z)) or through full attention over a growing KV cache,
and records peak memory (`torch.cuda.max_memory_allocated`) and wall time for each N.
"""

from __future__ import annotations

import math
import time

import torch

__all__ = ["infini_memory_bytes", "kv_cache_bytes", "measure_stream", "ring_share_bytes"]


def infini_memory_bytes(heads: int, d: int, d_v: int | None = None, layers: int = 1, elem: int = 4) -> int:
    """Bytes of the Infini memory: layers x heads x (d x d_v + d) elements of `elem` bytes (float32: 4)."""
    d_v = d if d_v is None else d_v
    return layers * heads * (d * d_v + d) * elem


def kv_cache_bytes(n: int, heads_kv: int, d: int, layers: int = 1, elem: int = 2) -> int:
    """Bytes of a KV cache of n tokens: layers x 2 (K and V) x n x heads_kv x d elements (bf16: 2 bytes)."""
    return layers * 2 * n * heads_kv * d * elem


def ring_share_bytes(n: int, p: int, heads_kv: int, d: int, layers: int = 1, elem: int = 2) -> int:
    """Bytes of K/V one of p ring devices holds: its slice of ceil(n / p) tokens and the one arriving
    (double buffering), K and V each: layers x 2 x 2 x ceil(n / p) x heads_kv x d elements."""
    return layers * 2 * 2 * math.ceil(n / p) * heads_kv * d * elem


def measure_stream(kind: str, lengths, chunk: int = 2048, heads: int = 8, d: int = 128, segment: int = 2048,
                   dtype=torch.bfloat16) -> list[dict]:  # fmt: skip
    """Peak memory and time of feeding N tokens (batch 1) through one attention layer, `chunk` tokens at a
    time, for each N in `lengths` (multiples of `chunk`). kind "infini": infini_attention with segments of
    `segment` tokens, carrying (M, z) from chunk to chunk (`chunk` a multiple of `segment`); kind "full":
    flash_attention of each chunk's queries over a KV cache of every token so far (bottom-right causal).
    Each chunk's q, k, v are drawn fresh (they would come from the layer's projections). Returns one dict per
    N: n, peak_bytes (above what was allocated before), seconds. A first run of one chunk, not recorded,
    compiles the kernels. A CUDA GPU only (peak memory is CUDA's
    allocator statistics); on a CPU it raises RuntimeError."""
    if not torch.cuda.is_available():
        raise RuntimeError("measure_stream measures CUDA memory: it runs on a GPU only")
    if kind not in ("infini", "full"):
        raise ValueError(f"measure_stream: kind must be 'infini' or 'full', got {kind!r}")
    from ..attention import flash_attention
    from .infini import infini_attention

    device = torch.device("cuda")
    rows = []
    for i, n in enumerate([chunk, *lengths]):  # the first, one chunk, compiles the kernels: not recorded
        if n % chunk or (kind == "infini" and chunk % segment):
            raise ValueError(f"measure_stream: N = {n} must be a multiple of chunk {chunk}, chunk of segment")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with torch.no_grad():
            if kind == "full":
                cache = torch.empty(2, 1, heads, n, d, dtype=dtype, device=device)
            memory = None
            for t in range(0, n, chunk):
                q, k, v = torch.randn(3, 1, heads, chunk, d, dtype=dtype, device=device).unbind(0)
                if kind == "infini":
                    _, memory = infini_attention(q, k, v, segment, memory=memory)
                else:
                    cache[0, :, :, t : t + chunk], cache[1, :, :, t : t + chunk] = k, v
                    flash_attention(q, cache[0, :, :, : t + chunk], cache[1, :, :, : t + chunk],
                                    causal="bottom_right")  # fmt: skip
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if i > 0:
            rows.append(dict(n=n, peak_bytes=torch.cuda.max_memory_allocated() - base, seconds=seconds))
        if kind == "full":
            del cache
        del memory
    return rows
