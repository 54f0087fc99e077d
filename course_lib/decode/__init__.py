"""Decoding: split-KV attention over a KV cache (Flash-Decoding), paged caches and serving (notebooks 09, 10).

- `split_kv`: `decode_attention(q, k_cache, v_cache, cache_seqlens, ...)` over a contiguous cache (09).
- `op`: `decode_attention` as a PyTorch custom operator, for compiled graphs (a static cache in transformers, 08b).
- `combine`: the merge of the splits' partial (O, L) (09).
- `heuristics`: how many splits, and the tile sizes per head dim (09).
- `reference`: the float64 reference (`decode_reference`) every decode kernel is tested against (09).
- `paged`: `paged_decode_attention(q, k_pages, v_pages, block_table, cache_seqlens, ...)` (10).
- `cache`: the page pool and its allocator (free list, reference counts, copy-on-write) (10).
- `batching`: the continuous-batching loop and the model interface it serves (10).
- `graphs`: `DecodeGraphs`, decode steps captured once per batch shape and replayed as CUDA graphs (10).
- `toy_model`: `ToyModel`, a two-layer model with random weights that follows the serving interface (10).
The read ceiling decoding is judged against is `course_lib.perf.ceilings.measure_read_bandwidth`.
"""

from __future__ import annotations

from . import op  # noqa: F401  (registers the operators before torch.compile traces a call)
from .heuristics import choose_num_splits, num_splits_for
from .paged import paged_decode_attention
from .reference import decode_reference
from .split_kv import decode_attention

__all__ = [
    "choose_num_splits",
    "decode_attention",
    "decode_reference",
    "num_splits_for",
    "paged_decode_attention",
]
