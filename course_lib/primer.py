"""Small Triton kernels from the Triton primer (notebook 05).

Each kernel uses plain pointer arithmetic and masks, so it runs compiled on a GPU and through the
interpreter on a CPU (see `course_lib.runtime`).
"""

from __future__ import annotations

import torch

from . import runtime
from .runtime import tl, triton

runtime.require_triton()


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    """out = x + y. One program handles BLOCK_SIZE consecutive elements; the mask covers the ragged end."""
    pid = tl.program_id(axis=0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements  # the last block may run past the end
    x = tl.load(x_ptr + offsets, mask=mask)  # HBM -> registers: BLOCK_SIZE elements
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)  # registers -> HBM


def add(x: torch.Tensor, y: torch.Tensor, block_size: int = 1024) -> torch.Tensor:
    """Element-wise x + y with a Triton kernel. x, y: same shape, dtype and device (contiguous copies are made)."""
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        raise TypeError("add: x and y must be torch.Tensors")
    if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
        raise ValueError(
            f"add: x and y must match in shape, dtype and device; got x {tuple(x.shape)} {x.dtype} {x.device}, "
            f"y {tuple(y.shape)} {y.dtype} {y.device}"
        )
    if x.device.type != runtime.DEVICE.type:
        raise ValueError(f"add: tensors are on {x.device} but Triton kernels run on {runtime.DEVICE} here")
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    grid = (triton.cdiv(n, block_size),)
    add_kernel[grid](x, y, out, n, BLOCK_SIZE=block_size)
    return out
