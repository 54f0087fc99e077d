"""FlashAttention-2 in Triton: forward (notebook 06) and backward (notebook 07) kernels.

- `flash_attention(q, k, v, causal=False, scale=None)`: the differentiable public function.
- `FlashAttentionTriton`: the autograd Function (`.apply(q, k, v, is_causal)`).
- `forward.forward(q, k, v, causal, scale, config=None) -> (O, L)` and
  `backward.backward(do, q, k, v, o, L, causal, scale, config=None, dq_mode="two_kernel")
  -> (dq, dk, dv)`: the kernels with their launch exposed, for notebook 08's optimisation ladder.
- `hopper`: FlashAttention-3's warp-specialised forward in Gluon, which `forward.forward` runs on
  Hopper GPUs where it is faster (imported on first use there; notebook 08).
"""

from __future__ import annotations

from . import backward, forward
from .api import FlashAttentionTriton, flash_attention
from .forward import SUPPORTED_HEAD_DIMS

__all__ = ["FlashAttentionTriton", "SUPPORTED_HEAD_DIMS", "backward", "flash_attention", "forward"]
