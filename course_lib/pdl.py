"""Programmatic dependent launch (PDL): a kernel that reads the previous kernel's output starts early.

Taught in notebook 09 (the combine of split-KV decoding). Two kernels in a row on one stream normally
run strictly one after the other: the second is launched only when the first has finished and its
writes are visible, and the gap between them (a few microseconds even when replayed from a CUDA graph)
is much of a short decoding step. On Hopper and later GPUs the second kernel may instead be launched
with PDL: its programs are scheduled as soon as every program of the first has started and called
`allow_dependents()` (or finished), do whatever set-up does not need the first kernel's results, and
call `wait_for_prior_grid()` (`griddepcontrol.wait`), which returns once the first kernel has completed
and its memory operations are visible. Both instructions do nothing in a kernel launched without PDL.

Use: the consuming kernel takes `PDL: tl.constexpr` and calls `wait_for_prior_grid()` under
`if PDL:` before its first read of the producer's output, adding the zero it returns to a loop bound
or a mask of those reads; the producer calls `allow_dependents()` under its own `PDL` flag; the host
launches the consumer with `**launch_options(pdl)`, where `pdl = enabled(device)`. The interpreter
never takes these branches (enabled() is False on the CPU).
"""

from __future__ import annotations

import functools
import os

import torch

from . import runtime
from .runtime import tl, triton

runtime.require_triton()


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device | None = None) -> bool:
    """True when kernels on `device` (default: the current one) may use PDL: compiled kernels on a GPU
    of compute capability 9.0 or later, and `COURSE_PDL` is not 0 (set COURSE_PDL=0 to compare)."""
    if not runtime.ON_GPU or (device is not None and device.type != "cuda"):
        return False
    if os.environ.get("COURSE_PDL", "1").strip() == "0":
        return False
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    return _supported(index)


def launch_options(pdl: bool) -> dict:
    """Launch keywords for the consuming kernel: {"launch_pdl": True} with PDL, else none."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def wait_for_prior_grid():
    """Block until the kernel launched before this one has completed and its writes are visible.

    Returns an int32 zero for the caller to add to a loop bound or a mask of the loads that follow: a
    dependence, so that no compiler pass can move those loads above the wait. (Added to a pointer, it
    would hide the pointer's alignment from the compiler and cost vector loads.)"""
    return tl.inline_asm_elementwise(
        "griddepcontrol.wait;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def allow_dependents():
    """Let the next kernel (launched with PDL) be scheduled once every program here has said so."""
    tl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )
