"""Decoding's public entry points: `decode_attention` over a contiguous KV cache (notebook 09) and
`paged_decode_attention` over a paged one (notebook 10).

Each checks its arguments once (`split_kv.check_decode`, `paged.check_paged`: shapes, dtypes, devices),
then runs the kernels (`split_kv.decode_checked`, `paged.paged_checked`, which read the lengths and page
ids where allowed); under torch.compile it is one opaque node instead, the custom operator of `op.py`,
which runs the same checked body. Layouts and numerics are `split_kv.py`'s and `paged.py`'s.
"""

from __future__ import annotations

import torch

from .op import compiled_num_splits, decode_attention_op, paged_decode_attention_op
from .paged import check_paged, paged_checked
from .split_kv import check_decode, decode_checked, normalise_causal


def decode_attention(
    q,
    k_cache,
    v_cache,
    cache_seqlens=None,
    causal=True,
    scale=None,
    num_splits=None,
    *,
    return_lse: bool = False,
    validate: bool = True,
):
    """Split-KV attention of new query tokens over a contiguous KV cache (Flash-Decoding). Notebook 09.

    q (B, Tq, Hq, d); k_cache, v_cache (B, Nmax, Hkv, d), Hq a multiple of Hkv; cache_seqlens (B,)
    int32 in [0, Nmax], or None when every sequence holds all Nmax keys (as flash_attn_with_kvcache
    reads it: an even batch, which may take another plan, `heuristics.sliced`, and whose kernel reads
    no lengths); float16, bfloat16 or float32; d a multiple of 8 in [16, 256]. causal=True
    (= "bottom_right"): query t sees keys j <= cache_seqlens[b] - Tq + t; False: all valid keys.
    scale defaults to 1/sqrt(d). num_splits: None chooses it from the SM count and the batch shape
    (`heuristics.decode_plan`: FlashAttention-2's rule, or short slices for a long batch of two
    sequences or more), an int forces it. Returns out (B, Tq, Hq, d) in
    q's dtype, and with return_lse=True also lse (B, Tq, Hq) float32. Rows that see no key give out 0 and lse -inf.
    validate=True checks the lengths' values (on a GPU this syncs; it is skipped during CUDA-graph
    capture); on the CPU the check always runs. Nothing here syncs when validate=False."""
    where = "decode_attention"
    check_decode(q, k_cache, v_cache, cache_seqlens, where)
    if torch.compiler.is_compiling():  # one opaque node (`op.py`); the lengths are checked inside it
        splits = compiled_num_splits(where, return_lse, num_splits)
        if cache_seqlens is None:
            cache_seqlens = torch.full((q.shape[0],), k_cache.shape[1], dtype=torch.int32, device=q.device)
        return decode_attention_op(
            q, k_cache, v_cache, cache_seqlens, normalise_causal(causal, where), scale, splits, validate,
        )  # fmt: skip
    out, lse = decode_checked(q, k_cache, v_cache, cache_seqlens, causal, scale, num_splits, validate, where)
    return (out, lse) if return_lse else out


def paged_decode_attention(
    q,
    k_pages,
    v_pages,
    block_table,
    cache_seqlens,
    causal=True,
    scale=None,
    num_splits=None,
    *,
    return_lse: bool = False,
    validate: bool = True,
):
    """Split-KV attention of new query tokens over a paged KV cache (PagedAttention). Notebook 10.

    q (B, Tq, Hq, d); k_pages, v_pages (num_pages, page_size, Hkv, d), Hq a multiple of Hkv;
    block_table (B, max_pages) int32; cache_seqlens (B,) int32 in [0, max_pages * page_size];
    float16, bfloat16 or float32. causal, scale, num_splits, return_lse: as `decode_attention`
    (the split count follows the table's capacity max_pages * page_size, a shape). Returns out
    (B, Tq, Hq, d) in q's dtype (and lse (B, Tq, Hq) float32 with return_lse=True).
    validate=True checks the lengths and the page ids a sequence uses (on a GPU this syncs and is
    skipped during CUDA-graph capture; on the CPU it always runs)."""
    where = "paged_decode_attention"
    check_paged(q, k_pages, v_pages, block_table, cache_seqlens, where)
    if torch.compiler.is_compiling():  # one opaque node (`op.py`); lengths and page ids checked inside it
        splits = compiled_num_splits(where, return_lse, num_splits)
        return paged_decode_attention_op(
            q, k_pages, v_pages, block_table, cache_seqlens, normalise_causal(causal, where), scale, splits,
            validate,
        )  # fmt: skip
    out, lse = paged_checked(
        q, k_pages, v_pages, block_table, cache_seqlens, causal, scale, num_splits, validate, where
    )
    return (out, lse) if return_lse else out
