"""Split-KV decoding as a PyTorch custom operator, so `torch.compile` keeps it whole (notebook 08b).

transformers compiles the decoding steps of a static cache by itself on a GPU. There the number of keys
in use is a tensor of the graph (the cache's position), never a Python int, so the attention cannot be
sliced to those keys on the host. `decode_attention` takes them as a tensor anyway (`cache_seqlens`),
and as an operator it is one node of the graph whose output shape a *fake* implementation gives
(`attention/op.py` tells why a Triton launch must be a black box to the compiler):

    course_lib::decode_attention(q, k_cache, v_cache, cache_seqlens, causal, scale, num_splits,
                                 validate) -> out
    course_lib::paged_decode_attention(q, k_pages, v_pages, block_table, cache_seqlens, causal, scale,
                                       num_splits, validate) -> out

Layouts are `api.decode_attention`'s and `api.paged_decode_attention`'s: q (B, Tq, Hq, d),
caches (B, Nmax, Hkv, d) or page pools (num_pages, page_size, Hkv, d) with a (B, max_pages) block
table, cache_seqlens (B,) int32, out like q; num_splits 0 chooses the split count. Inference only: the
operators have no gradient, and a backward through them raises an error that says so. With
validate=False (the default) nothing in them syncs with the GPU, so the steps they run in can be
captured as CUDA graphs; on the CPU the lengths and page ids are always checked. `decode_attention`
and `paged_decode_attention` (`api.py`) call them under torch.compile; this module imports only the
kernel modules below it (`split_kv.py`, `paged.py`).
"""

from __future__ import annotations

import torch

from ..checks import check_cache_seqlens, check_int
from .paged import check_paged, paged_checked
from .split_kv import check_decode, decode_checked

WHERE = "course_lib::decode_attention"


@torch.library.custom_op(WHERE, mutates_args=())
def decode_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    num_splits: int = 0,
    validate: bool = False,
) -> torch.Tensor:
    """`decode_attention(q, k_cache, v_cache, cache_seqlens, causal, scale, num_splits or None,
    validate=validate)` as one operator (its checks and body, `split_kv.check_decode` and
    `decode_checked`, without its routing to this operator under torch.compile): q (B, Tq, Hq, d),
    k_cache and v_cache (B, Nmax, Hkv, d) (any strides), cache_seqlens (B,) int32 in [0, Nmax] (checked
    on the CPU, and on a GPU with validate=True, which syncs). Returns out (B, Tq, Hq, d) in q's dtype
    and memory layout."""
    check_decode(q, k_cache, v_cache, cache_seqlens, WHERE)
    splits = num_splits or None
    return decode_checked(q, k_cache, v_cache, cache_seqlens, causal, scale, splits, validate, WHERE)[0]


def _out_fake(q, cache_seqlens, where):
    """out as the operators allocate it, after the checks of cache_seqlens' dtype and shape. Shapes only
    (this runs on fake tensors while torch.compile traces), so bad input fails there too."""
    check_cache_seqlens(where, cache_seqlens, q.shape[0], None)
    return torch.empty_like(q)  # as `split_kv.launch` allocates it: q's strides


@decode_attention_op.register_fake
def _fake(q, k_cache, v_cache, cache_seqlens, causal=True, scale=None, num_splits=0, validate=False):
    if q.dim() != 4 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"{WHERE}: q must be (B, Tq, Hq, d) and the caches (B, Nmax, Hkv, d) alike; got q "
            f"{tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    return _out_fake(q, cache_seqlens, WHERE)


PAGED = "course_lib::paged_decode_attention"


@torch.library.custom_op(PAGED, mutates_args=())
def paged_decode_attention_op(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    num_splits: int = 0,
    validate: bool = False,
) -> torch.Tensor:
    """`paged_decode_attention(...)` as one operator, the arguments as `decode_attention_op`'s with the
    page pools (num_pages, page_size, Hkv, d) and block_table (B, max_pages) int32 for the caches (page
    ids checked with the lengths)."""
    check_paged(q, k_pages, v_pages, block_table, cache_seqlens, PAGED)
    splits = num_splits or None
    args = (q, k_pages, v_pages, block_table, cache_seqlens, causal, scale, splits, validate, PAGED)
    return paged_checked(*args)[0]


@paged_decode_attention_op.register_fake
def _paged_fake(
    q, k_pages, v_pages, block_table, cache_seqlens, causal=True, scale=None, num_splits=0, validate=False
):
    if q.dim() != 4 or k_pages.dim() != 4 or k_pages.shape != v_pages.shape or block_table.dim() != 2:
        raise ValueError(
            f"{PAGED}: q must be (B, Tq, Hq, d), the page pools (num_pages, page_size, Hkv, d) alike and "
            f"block_table (B, max_pages); got q {tuple(q.shape)}, k_pages {tuple(k_pages.shape)}, v_pages "
            f"{tuple(v_pages.shape)}, block_table {tuple(block_table.shape)}"
        )
    return _out_fake(q, cache_seqlens, PAGED)


def _no_backward(ctx, grad):
    raise RuntimeError(
        "course_lib's decoding operator has no backward (it serves decoding steps); for training, call "
        "course_lib.flash_attention"
    )


decode_attention_op.register_autograd(_no_backward)
paged_decode_attention_op.register_autograd(_no_backward)


def compiled_num_splits(where: str, return_lse: bool, num_splits) -> int:
    """The operators' num_splits (0: chosen) for `decode_attention` and `paged_decode_attention` under
    torch.compile, where they cannot return the logsumexp (the operators return out alone)."""
    if return_lse:
        raise ValueError(
            f"{where}: return_lse=True is not available under torch.compile (its operator returns out)"
        )
    return 0 if num_splits is None else check_int(where, "num_splits", num_splits, 1)
