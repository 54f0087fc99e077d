"""Decoding: split-KV attention over a KV cache (Flash-Decoding), paged caches and serving (notebooks 09, 10).

- `api`: the entry points, `decode_attention(q, k_cache, v_cache, cache_seqlens, ...)` over a contiguous
  cache (09) and `paged_decode_attention(q, k_pages, v_pages, block_table, cache_seqlens, ...)` (10).
- `split_kv`: the split-KV kernel over a contiguous cache, its checks and its launch (09); beside it
  `pack_gqa` (a kv head's query heads and tokens as the rows of one tile) and `paged_lookup` (where a
  block of keys lives: a contiguous cache, page ids, or a block-table row in registers) (09, 10).
- `op`: both as PyTorch custom operators, for compiled graphs (a static cache in transformers, 08b).
- `combine`: the merge of the splits' partial (O, L) (09).
- `heuristics`: how many splits, and the tile sizes per head dim (09).
- `reference`: the float64 reference (`decode_reference`) every decode kernel is tested against (09).
- `paged`: the same kernel reading K/V through a block table, and its checks (10).
- `cache`: the page pool and its allocator (free list, reference counts, copy-on-write) (10).
- `paged_kv`: `PagedKV`, one serving step's view of the paged cache, which a model's layers attend through (10).
- `batching`: the continuous-batching loop and the model interface it serves (10).
- `graphs`: `DecodeGraphs`, decode steps captured once per batch shape and replayed as CUDA graphs (10);
  `StepGraphs`, the same for steps of T tokens per sequence (speculative verification, 15).
- `toy_model`: `ToyModel`, a two-layer model with random weights that follows the serving interface (10).
The read ceiling decoding is judged against is `course_lib.perf.ceilings.measure_read_bandwidth`.
"""

from __future__ import annotations

from .api import decode_attention, paged_decode_attention  # (api imports op: the operators are registered)
from .heuristics import choose_num_splits, num_splits_for
from .reference import decode_reference

__all__ = [
    "choose_num_splits",
    "decode_attention",
    "decode_reference",
    "num_splits_for",
    "paged_decode_attention",
]
