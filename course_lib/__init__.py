"""course_lib: the finished pieces of *FlashAttention from First Principles*.

Importing it decides, once, where Triton kernels run (`course_lib.runtime`): compiled on a CUDA GPU,
or through Triton's interpreter on the CPU. Every kernel module imports `runtime` first, so that
decision always comes before a kernel is defined.

Where each piece is taught:
- runtime, doctor ................. notebook 00
- perf (hardware ceilings, roofline, timing, profiling, plotting) ... notebooks 01, 02, 08
- attention.reference ............. notebook 02 (standard attention: the float64 reference)
- softmax ......................... notebook 03 (naive, safe, online softmax in NumPy)
- FlashAttentionTorch, attention.tiles, attention.animate ... notebooks 04 and 04b (tiled attention in PyTorch)
- primer .......................... notebook 05 (Triton primer kernels)
- flash_attention, FlashAttentionTriton, attention.blocks ... notebooks 06 and 07 (Triton FlashAttention-2)
- bench, attention.configs, attention.hopper, attention.hopper_backward ... notebooks 08, 08c, `make bench`
- attention.op, integrations ...... notebook 08b (torch.compile, GQA, causal alignments, transformers)
- decode .......................... notebooks 09 and 10 (split-KV decoding, paged KV cache, continuous batching)
- fused ........................... notebook 11 (RMSNorm and RoPE)
- models .......................... notebook 12 (the capstone Llama: trained and served on course_lib)
- distributed ..................... notebook 13 (ring attention over several devices)
"""

from __future__ import annotations

import importlib

from . import runtime
from .runtime import DEVICE, INTERPRET, ON_GPU, RUNTIME, pick

__version__ = "0.1.0"

# Heavier pieces load on first use, so `import course_lib` stays quick (notebooks 01-04 need no kernels).
_LAZY = {
    "FlashAttentionTorch": "attention",
    "FlashAttentionTriton": "attention",
    "flash_attention": "attention",
    "attention_reference": ("attention.reference", "attention"),
}
# Modules that moved into packages stay reachable as attributes under their old names
# (`course_lib.reference.attention`); their import paths are the new ones.
_MOVED = {
    "reference": "attention.reference",
    "flash_torch": "attention.tiled",
    "flash_triton": "attention",
    "tiles": "attention.tiles",
    "hardware": "perf",
    "timing": "perf.timing",
    "profiling": "perf.profiling",
    "plotting": "perf.plotting",
}

__all__ = [
    "DEVICE",
    "INTERPRET",
    "ON_GPU",
    "RUNTIME",
    "pick",
    "runtime",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        target = _LAZY[name]
        module, attr = target if isinstance(target, tuple) else (target, name)
        value = getattr(importlib.import_module(f".{module}", __name__), attr)
        globals()[name] = value
        return value
    if name in _MOVED:
        value = importlib.import_module(f".{_MOVED[name]}", __name__)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as exc:
        if exc.name == f"{__name__}.{name}":
            raise AttributeError(f"module 'course_lib' has no attribute {name!r}") from None
        raise
