"""Attention, from the float64 reference to the fast kernels (notebooks 02, 04, 06, 07, 08).

- `reference`: standard attention in float64, the ground truth every kernel is tested against (02).
- `tiles` and `blocks`: which K/V blocks a query block visits (and the reverse), as pictures and
  traffic counts (04) and as the one helper every kernel calls (06, 07).
- `tiled`: `FlashAttentionTorch`, tiled FlashAttention forward and backward in plain PyTorch (04).
- `forward`, `backward`: the Triton FlashAttention-2 kernels with their launch exposed (06, 07).
- `hopper`: FlashAttention-3's warp-specialised forward in Gluon, which `forward.forward` runs on
  Hopper GPUs where it is faster (imported on first use there; 08).
- `hopper_backward`: FlashAttention-3's dK/dV kernel in Gluon, which `backward.backward` runs on
  Hopper GPUs where it is faster (08).
- `api`: `flash_attention(q, k, v, causal=...)` and the autograd Function `FlashAttentionTriton`.
- `op`: the kernels as PyTorch custom operators, so `torch.compile` keeps them whole (08b).
- `blocks`: which K/V blocks a query block visits (causal alignment, splits) and its Python twin.
- `configs`, `launch`: named launch configurations and how a call picks one; `inputs`: input checks.
- `merge`: merging partial (O, L) results, for split-KV decoding (09) and ring attention (13).
- `animate`: the loops step by step, as strips and sliders (04, 04b, 05, 07).

`attention_forward` and `attention_backward` are the kernels as plain functions, for code that
combines partial results itself (split-KV decoding, ring attention): the forward returns (O, L), the
backward takes O and L (which may be the merged ones of a whole sequence) and returns (dQ, dK, dV).
"""

from __future__ import annotations

from . import backward, forward
from .api import FlashAttentionTriton, flash_attention
from .backward import backward as attention_backward
from .forward import SUPPORTED_HEAD_DIMS
from .forward import forward as attention_forward
from .op import flash_attention_op
from .tiled import FlashAttentionTorch

__all__ = [
    "FlashAttentionTorch",
    "FlashAttentionTriton",
    "SUPPORTED_HEAD_DIMS",
    "attention_backward",
    "attention_forward",
    "backward",
    "flash_attention",
    "flash_attention_op",
    "forward",
]
