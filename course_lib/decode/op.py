"""Split-KV decoding as a PyTorch custom operator, so `torch.compile` keeps it whole (notebook 08b).

transformers compiles the decoding steps of a static cache by itself on a GPU. There the number of keys
in use is a tensor of the graph (the cache's position), never a Python int, so the attention cannot be
sliced to those keys on the host. `decode_attention` takes them as a tensor anyway (`cache_seqlens`),
and as an operator it is one node of the graph whose output shape a *fake* implementation gives
(`attention/op.py` tells why a Triton launch must be a black box to the compiler):

    course_lib::decode_attention(q, k_cache, v_cache, cache_seqlens, causal, scale) -> out

Layouts are `split_kv.decode_attention`'s: q (B, Tq, Hq, d), caches (B, Nmax, Hkv, d), cache_seqlens
(B,) int32, out like q. Inference only: the operator has no gradient, and a backward through it raises
an error that says so. Nothing in it syncs with the GPU (`validate=False` there), so the
steps it runs in can be captured as CUDA graphs.
"""

from __future__ import annotations

import torch

from .split_kv import decode_attention

WHERE = "course_lib::decode_attention"


@torch.library.custom_op(WHERE, mutates_args=())
def decode_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """`decode_attention(q, k_cache, v_cache, cache_seqlens, causal, scale, validate=False)` as one
    operator: q (B, Tq, Hq, d), k_cache and v_cache (B, Nmax, Hkv, d) (any strides), cache_seqlens (B,)
    int32 in [0, Nmax] (checked on the CPU only: on a GPU reading them would sync). Returns out (B, Tq,
    Hq, d) in q's dtype and memory layout."""
    return decode_attention(q, k_cache, v_cache, cache_seqlens, causal, scale, validate=False)


@decode_attention_op.register_fake
def _fake(q, k_cache, v_cache, cache_seqlens, causal=True, scale=None):
    # Shapes only (this runs on fake tensors while torch.compile traces), so bad input fails there too.
    if q.dim() != 4 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"{WHERE}: q must be (B, Tq, Hq, d) and the caches (B, Nmax, Hkv, d) alike; got q "
            f"{tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if cache_seqlens.dtype != torch.int32:
        raise TypeError(f"{WHERE}: cache_seqlens must be int32, got {cache_seqlens.dtype}")
    if cache_seqlens.shape != (q.shape[0],):
        raise ValueError(
            f"{WHERE}: cache_seqlens must have shape (B,) = ({q.shape[0]},); got {tuple(cache_seqlens.shape)}"
        )
    return torch.empty_like(q)  # as `split_kv.launch` allocates it: q's strides


def _no_backward(ctx, grad):
    raise RuntimeError(
        f"{WHERE} has no backward (it serves decoding steps); for training, call course_lib.flash_attention"
    )


decode_attention_op.register_autograd(_no_backward)
