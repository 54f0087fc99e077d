"""Fused kernels for the rest of a transformer block: RMSNorm, rotary embeddings, SwiGLU's gate (notebook 11).

All are memory-bound: their cost is the bytes they move, so one kernel that reads its inputs once and
writes its outputs once is the goal, reported as GB/s against the copy ceiling (`course_lib.bench.fused`).

- `rms_norm`: `rms_norm(x, weight, eps)`, the module `RMSNorm(hidden, eps)`; forward and backward in
  Triton, numerics of Hugging Face's LlamaRMSNorm; three ways to reduce dW (`dw_mode`).
- `rope`: `rope(q, k, cos, sin, positions, layout)` rotates q and k in one launch (`rope_` in place, for a
  serving step); `rope_cache` builds the cos/sin tables; both pair layouts ("half" as Llama, "interleaved" as GPT-J).
- `swiglu`: `swiglu(a, b)` = silu(a) * b, the gate of Llama's MLP, forward and backward in one kernel each.
- `launch`: the launch sizes both share (warps per row length, persistent programs per SM).
- `op`: both as PyTorch custom operators, which `rms_norm` and `rope` call under torch.compile.
- `api`: the entry points `rms_norm`, `RMSNorm` and `rope` (checks once, then the kernels or the operators).
"""

from __future__ import annotations

from .api import RMSNorm, rms_norm, rope, rope_, swiglu  # (api imports op: the operators are registered)
from .rms_norm import RMSNormFunction, rms_norm_reference
from .rope import RoPEFunction, rope_cache, rope_reference
from .swiglu import SwiGLUFunction, swiglu_reference

__all__ = [
    "RMSNorm",
    "RMSNormFunction",
    "RoPEFunction",
    "SwiGLUFunction",
    "rms_norm",
    "rms_norm_reference",
    "rope",
    "rope_",
    "rope_cache",
    "rope_reference",
    "swiglu",
    "swiglu_reference",
]
