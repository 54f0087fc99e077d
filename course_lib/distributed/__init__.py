"""Context parallelism: one attention shared by several processes (notebook 13).

- `sharding`: which tokens each rank holds, contiguous or zigzag; `shard`, `unshard`, `gather`.
- `plan`: which (query, key) blocks a rank computes at each ring step (full, diagonal or skipped).
- `local`: one block's (O, L) and its backward, with course_lib's Triton kernels or plain PyTorch.
- `ring`: `ring_attention(q, k, v, causal, group, sharding, ...)`, differentiable, on torch.distributed.
- `launch`: `run_ranks(fn, world)` starts a gloo process group of CPU processes (notebook, tests);
  `workers` holds the functions those processes run.
"""

from __future__ import annotations

from .launch import run_ranks
from .plan import Block, plan_step, work_per_rank
from .ring import RingAttention, ring_attention, ring_backward, ring_forward
from .sharding import chunk_ids, gather, padded_length, shard, unshard

__all__ = [
    "Block",
    "RingAttention",
    "chunk_ids",
    "gather",
    "padded_length",
    "plan_step",
    "ring_attention",
    "ring_backward",
    "ring_forward",
    "run_ranks",
    "shard",
    "unshard",
    "work_per_rank",
]
