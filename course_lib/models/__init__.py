"""The capstone: a small Llama-style model built from the course's kernels, trained, then served
(notebook 12).

- `llama`: `Llama(config, backend)` and `LlamaConfig`; backend "course_lib" (FlashAttention-2,
  fused RMSNorm and RoPE), "sdpa" or "eager", same weights on every path; `count_parameters`,
  `kv_cache_bytes_per_token`.
- `convert`: the state-dict mapping to and from transformers' LlamaForCausalLM.
- `data`: the shipped corpus (the prose of Python's standard-library docstrings), byte tokens, batches.
- `train`: the training loop (AdamW, gradient accumulation, bf16 autocast on a GPU, live loss plot).
- `generate`: greedy generation, plain and served from the paged KV cache.
"""

from __future__ import annotations

from .llama import BACKENDS, KVCache, Llama, LlamaConfig, count_parameters, kv_cache_bytes_per_token

__all__ = ["BACKENDS", "KVCache", "Llama", "LlamaConfig", "count_parameters", "kv_cache_bytes_per_token"]
