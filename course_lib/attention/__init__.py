"""Attention, from the float64 reference to the fast kernels (notebooks 02, 04, 04b, 06-08c, 09, 13).

- `reference`: standard attention in float64, the ground truth every kernel is tested against (02).
- `tiles` and `blocks`: which K/V blocks a query block visits (and the reverse), as pictures and
  traffic counts (04) and as the one helper every kernel calls (06, 07).
- `tiled`: `FlashAttentionTorch`, tiled FlashAttention forward and backward in plain PyTorch (04).
- `forward`, `backward`: the Triton FlashAttention-2 kernels with their launch exposed (06, 07).
- `hopper`: FlashAttention-3's warp-specialised forward in Gluon, which `forward.forward` runs on
  Hopper GPUs where it is faster (imported on first use there; the appendix 08c).
- `hopper_backward`: a warp-specialised dK/dV kernel in Gluon after FlashAttention-3, which
  `backward.backward` runs on Hopper GPUs where it is faster (08c); `hopper_onepass`: the one-pass backward
  (dQ, dK, dV from one kernel in FlashAttention-3's transposed layout, dQ added by TMA), which it runs at
  d = 64 from 4096 tokens, and at d = 128 from 2048 causal, 8192 ungrouped (08c,
  section 7); `d_pass`: the backward's pass for
  D = rowsum(dO * O) (07).
- `api`: `flash_attention(q, k, v, causal=...)` and the autograd Function `FlashAttentionTriton`.
- `op`: the kernels as PyTorch custom operators, so `torch.compile` keeps them whole (08b).
- `varlen`: sequences of different lengths packed into one call, and a padded batch run that way (08b).
- `packed`: packed sequences' bounds as the kernels read them, and their checks (08b).
- `decode_route`: which forward runs a call: a decoding step goes to split-KV decoding (09).
- `blocks`: which K/V blocks a query block visits (causal alignment, splits) and its Python twin.
- `configs`, `launch`: named launch configurations and how a call picks one; `inputs`: input checks.
- `merge`: merging partial (O, L) results, for split-KV decoding (09) and ring attention (13).
- `animate`: the loops step by step, as strips and sliders (04, 04b, 05, 07).

`attention_forward` and `attention_backward` are the kernels as plain functions, for code that
combines partial results itself (split-KV decoding, ring attention): the forward returns (O, L), the
backward takes O and L (which may be the merged ones of a whole sequence) and returns (dQ, dK, dV).
`attention_forward` hands a decoding step to split-KV decoding as `flash_attention` does
(`decode_route.attention_forward`); `forward.forward` always runs the FlashAttention-2 kernel.
"""

from __future__ import annotations

import importlib

from .. import runtime
from .tiled import FlashAttentionTorch

# The Triton kernels load on first use: the pure-PyTorch pieces (`reference`, `tiles`, `tiled`, `animate`)
# import without Triton, as on macOS and Windows, where Triton has no wheels (notebooks 01-04b).
_KERNELS = {  # name: (module, attribute; None for the module itself)
    "backward": ("backward", None),
    "forward": ("forward", None),
    "FlashAttentionTriton": ("api", "FlashAttentionTriton"),
    "flash_attention": ("api", "flash_attention"),
    "attention_backward": ("backward", "backward"),
    "attention_forward": ("decode_route", "attention_forward"),
    "SUPPORTED_HEAD_DIMS": ("forward", "SUPPORTED_HEAD_DIMS"),
    "flash_attention_op": ("op", "flash_attention_op"),
    "flash_attention_varlen": ("varlen", "flash_attention_varlen"),
    "flash_attention_padded": ("varlen", "flash_attention_padded"),
}

__all__ = ["FlashAttentionTorch", *_KERNELS]


def __getattr__(name: str):
    if name not in _KERNELS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    runtime.require_triton()
    module, attr = _KERNELS[name]
    loaded = importlib.import_module(f".{module}", __name__)
    value = loaded if attr is None else getattr(loaded, attr)
    globals()[name] = value
    return value
