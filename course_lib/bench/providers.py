"""Who is measured: course_lib's FlashAttention, each SDPA backend, and standard attention eager and
compiled; and when a provider is left out of a cell.

Taught in notebook 08.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import runtime
from ..attention import reference
from .shapes import MAX_SCORE_BYTES

SDPA_BACKENDS = {
    "sdpa_default": None,
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
}
PROVIDERS = ("course_lib", *SDPA_BACKENDS, "eager", "compiled")
LABELS = {
    "course_lib": "course_lib.flash_attention",  # what it runs depends on the GPU: Triton, Gluon on Hopper
    "sdpa_default": "SDPA default",
    "sdpa_flash": "SDPA FLASH_ATTENTION",
    "sdpa_efficient": "SDPA EFFICIENT_ATTENTION",
    "sdpa_cudnn": "SDPA CUDNN_ATTENTION",
    "eager": "standard, eager",
    "compiled": "standard, torch.compile",
}


def attention_fns(on_gpu: bool | None = None) -> dict:
    """provider -> f(q, k, v, causal) -> O, for q, k, v of shape (B, H, N, d). `compiled` only on a GPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ..attention import flash_attention

    on_gpu = runtime.ON_GPU if on_gpu is None else on_gpu

    def sdpa(backend):
        def f(q, k, v, causal):
            if backend is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return f

    fns = {"course_lib": lambda q, k, v, causal: flash_attention(q, k, v, causal=causal)}
    fns.update({name: sdpa(backend) for name, backend in SDPA_BACKENDS.items()})
    fns["eager"] = lambda q, k, v, causal: reference.attention(q, k, v, causal=causal)
    if on_gpu:
        # Built on first use, so that nothing of torch.compile is loaded while the others are measured.
        compiled = []

        def compiled_attention(q, k, v, causal):
            if not compiled:
                # Inductor compiles in a pool of worker processes that can still be busy while the next
                # provider is timed; small calls are sensitive to CPU contention: compile in this process.
                import torch._functorch.config as functorch_config
                import torch._inductor.config as inductor_config

                inductor_config.compile_threads = 1
                # The backward alone is timed by backpropagating through one forward again and again
                # (retain_graph=True); a compiled backward that reuses ("donates") its saved buffers
                # refuses that, so they are kept.
                functorch_config.donated_buffer = False
                # dynamic=True: one graph for every (B, H, N, d), instead of a recompilation per shape.
                compiled.append(torch.compile(reference.attention, dynamic=True))
            return compiled[0](q, k, v, causal=causal)

        fns["compiled"] = compiled_attention
    return fns


def skip_reason(provider: str, cell: dict, available) -> str | None:
    """Why `provider` is not measured on `cell` (None: it is)."""
    if provider not in available:
        return "torch.compile is left out on the CPU (it would time compiled CPU code, not a GPU kernel)"
    if provider in ("eager", "compiled"):
        score_bytes = cell["B"] * cell["H"] * cell["N"] ** 2 * 4
        if score_bytes > MAX_SCORE_BYTES:
            return (
                f"fp32 scores B*H*N*N would take {score_bytes / 2**30:.0f} GiB "
                f"(cap {MAX_SCORE_BYTES / 2**30:.0f} GiB)"
            )
    return None
