"""PagedAttention decoding: the split-KV kernel reading K/V through a block table (notebook 10).

Layout of a paged cache (vLLM's Triton-backend layout):
  k_pages, v_pages  (num_pages, page_size, Hkv, d)  one pool of pages per layer; a page holds the K (or V)
                                                    rows of page_size consecutive tokens of one sequence
  block_table       (B, max_pages) int32            block_table[b, p] = the physical page that holds
                                                    tokens [p * page_size, (p + 1) * page_size) of
                                                    sequence b; entries past the sequence's last page
                                                    are never read (any value)
  cache_seqlens     (B,) int32                      tokens of sequence b, <= max_pages * page_size
Key j of sequence b is k_pages[block_table[b, j // page_size], j % page_size]. q, out, lse, GQA and the
causal alignment are those of `api.decode_attention`. Any page size >= 1 works: the kernel looks
up one page id per key, so a BLOCK_N-key block may span many small pages or part of a large one.
The entry point, `paged_decode_attention`, is in `api.py`.
"""

from __future__ import annotations

import torch

from .split_kv import (
    check_inference,
    check_kv_pair,
    check_lengths,
    check_query_and_lengths,
    launch,
    normalise_causal,
    should_validate,
)


def check_block_table(block_table, cache_seqlens, num_pages: int, page_size: int, where: str) -> None:
    """Every page a sequence uses (the first cdiv(cache_seqlens[b], page_size) entries of its row) must
    be a page id in [0, num_pages). Reads values: syncs on a GPU."""
    pages_used = (cache_seqlens.to(torch.int64) + page_size - 1) // page_size  # (B,)
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < pages_used[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    if bool(bad.any()):
        b, p = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"{where}: block_table[{b}, {p}] = {int(block_table[b, p])} is not a page id in [0, {num_pages}) "
            f"(sequence {b} has {int(cache_seqlens[b])} tokens, so it uses its first {int(pages_used[b])} pages)"
        )


def check_paged(q, k_pages, v_pages, block_table, cache_seqlens, where: str) -> None:
    """`paged_decode_attention`'s checks of what the shapes, dtypes and devices say (no values read)."""
    check_kv_pair(k_pages, v_pages, ("k_pages", "v_pages"), "(num_pages, page_size, Hkv, d)", where)
    num_pages, page_size, hkv, d = k_pages.shape
    check_query_and_lengths(q, cache_seqlens, hkv, d, k_pages.dtype, k_pages.device, where)
    check_inference(where, q=q, k_pages=k_pages, v_pages=v_pages)
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        raise ValueError(f"{where}: block_table must be a (B, max_pages) int32 tensor")
    if block_table.dtype != torch.int32:
        raise TypeError(f"{where}: block_table must be int32, got {block_table.dtype}")
    if block_table.shape[0] != q.shape[0]:
        raise ValueError(f"{where}: block_table has {block_table.shape[0]} rows, q has batch {q.shape[0]}")
    if block_table.device != q.device:
        raise ValueError(f"{where}: block_table is on {block_table.device}, q on {q.device}")
    if page_size == 0 or num_pages == 0:
        raise ValueError(f"{where}: empty page pool {tuple(k_pages.shape)}")


def paged_checked(
    q, k_pages, v_pages, block_table, cache_seqlens, causal, scale, num_splits, validate, where: str
):
    """`paged_decode_attention` after `check_paged`: the lengths and page ids checked (`should_validate`),
    then the kernels; returns (out, lse). The body of its operator too (`op.py`)."""
    num_pages, page_size = k_pages.shape[:2]
    capacity = block_table.shape[1] * page_size
    if should_validate(validate, q.device):
        check_lengths(cache_seqlens, capacity, where)
        check_block_table(block_table, cache_seqlens, num_pages, page_size, where)
    return launch(
        q, k_pages, v_pages, block_table, cache_seqlens,
        page_size=page_size, capacity=capacity, causal=normalise_causal(causal, where), scale=scale,
        num_splits=num_splits, where=where,
    )  # fmt: skip
