"""Long context with bounded memory (notebook 16): a user of course_lib's attention kernel.

- `infini`: Infini-attention, segment-local causal attention (course_lib's FlashAttention kernel) plus a
  compressive memory per head, `infini_attention`, and its float64 token-by-token reference `infini_reference`.
- `memory`: the bytes of the Infini memory, a full-attention KV cache and a ring's per-device share against the
  context length, and (on a GPU) their measured peak memory and time over a stream.
- `passkey`: a synthetic passkey-retrieval task and a one-layer model with full, segment-local or Infini
  attention, to train and compare.

Nothing else in course_lib imports this package.
"""

from __future__ import annotations

from .infini import (
    EPS,
    elu_plus_one,
    infini_attention,
    infini_memory_reference,
    infini_reference,
    kernel_local_attention,
    memory_step,
    sdpa_local_attention,
    segment_attention,
)
from .memory import infini_memory_bytes, kv_cache_bytes, measure_stream, ring_share_bytes
from .passkey import PasskeyModel, PasskeyTask, passkey_accuracy, passkey_batch, train_passkey

__all__ = [
    "EPS",
    "elu_plus_one",
    "infini_attention",
    "infini_memory_bytes",
    "infini_memory_reference",
    "infini_reference",
    "kernel_local_attention",
    "memory_step",
    "kv_cache_bytes",
    "measure_stream",
    "passkey_accuracy",
    "passkey_batch",
    "ring_share_bytes",
    "sdpa_local_attention",
    "segment_attention",
    "train_passkey",
    "PasskeyModel",
    "PasskeyTask",
]
