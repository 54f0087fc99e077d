"""Memory when training: the bytes each parameter holds with Adam.

Taught in notebook 01 (its memory section).
"""

from __future__ import annotations


def training_bytes_per_param(mixed_precision: bool = True) -> dict[str, int]:
    """Bytes per parameter held during training with Adam, by what they hold.

    fp32 training: parameters 4, gradients 4, Adam's two moments 8.
    Mixed precision (the ZeRO paper's accounting, https://arxiv.org/abs/1910.02054): 16-bit parameters 2 and
    gradients 2; optimizer states 12 = fp32 master weights 4 + two fp32 moments 8. So P : G : states =
    1 : 1 : 6, 16 bytes per parameter either way. Activations come on top and depend on the batch."""
    if mixed_precision:
        return {"parameters": 2, "gradients": 2, "optimizer states": 12}
    return {"parameters": 4, "gradients": 4, "optimizer states": 8}
