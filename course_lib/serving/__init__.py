"""Serving many requests (notebook 14): what a serving stack adds on top of the paged cache and the batcher.

- `prefix_cache`: full pages found again by their tokens (a hash chained over the previous page's hash and the
  page's token ids, as vLLM v1 and nano-vllm do), kept after their request ends until evicted (LRU), shared by
  reference count; `PrefixCachingBatcher` skips the prefill of a prompt's cached prefix.
- `cascade`: attention of a batch that shares a prefix: all the batch's query rows over the shared prefix once (one
  multi-query pass over one K/V stream), each sequence over its own suffix with the paged kernel, the two partial
  (O, L) states merged (notebook 03's merge); `CascadeChoice`, the batcher's choice of it for decode steps whose
  sequences share a prefix of pages longer than the measured crossover.
- `scheduling`: static against continuous batching (and chunked prefill) on one request stream: throughput, time
  to first token, time per output token, and the prediction of the gain from the output lengths.

A user of the kernels: it imports the faces of `decode` and `attention` and nothing imports it (README, Layout).
"""

from .cascade import CascadeChoice, cascade_decode_attention, cascade_reference
from .prefix_cache import CachingPageAllocator, PrefixCache, PrefixCachingBatcher, block_hash
from .scheduling import Served, StaticBatcher, Workload, draw_workload, predict_steps, serve_workload

__all__ = [
    "CachingPageAllocator",
    "CascadeChoice",
    "PrefixCache",
    "PrefixCachingBatcher",
    "Served",
    "StaticBatcher",
    "Workload",
    "block_hash",
    "draw_workload",
    "predict_steps",
    "serve_workload",
    "cascade_decode_attention",
    "cascade_reference",
]
