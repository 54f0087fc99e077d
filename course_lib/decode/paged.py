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
This module holds the checks and the call; the kernel is `split_kv.py`'s, and it finds a block's K/V
rows through `paged_lookup.py`. The entry point, `paged_decode_attention`, is in `api.py`.
"""

from __future__ import annotations

from ..checks import (
    AcceptedCalls,
    check_block_table,
    check_lengths,
    check_page_ids,
    should_validate,
    tensors_key,
)
from .split_kv import (
    SplitLaunch,
    check_inference,
    check_kv_pair,
    check_query_and_lengths,
    launch,
    normalise_causal,
    plan_launch,
)

# kinds of calls `check_paged` accepted: 5.6 us of host time a call checked in full, 3.5 seen before (a 2-core CPU)
_PAGED_CALLS = AcceptedCalls()


def check_paged(q, k_pages, v_pages, block_table, cache_seqlens, where: str) -> None:
    """`paged_decode_attention`'s checks of what the shapes, dtypes and devices say (no values read); a
    kind of call accepted before is accepted at once (`checks.AcceptedCalls`)."""
    key = tensors_key(q, k_pages, v_pages, block_table, cache_seqlens)
    if _PAGED_CALLS.seen(key):
        return
    check_kv_pair(k_pages, v_pages, ("k_pages", "v_pages"), "(num_pages, page_size, Hkv, d)", where)
    num_pages, page_size, hkv, d = k_pages.shape
    check_query_and_lengths(q, cache_seqlens, hkv, d, k_pages.dtype, k_pages.device, where)
    check_inference(where, q=q, k_pages=k_pages, v_pages=v_pages)
    check_block_table(where, block_table, q.shape[0], q.device)
    if page_size == 0 or num_pages == 0:
        raise ValueError(f"{where}: empty page pool {tuple(k_pages.shape)}")
    _PAGED_CALLS.add(key)


def paged_checked(
    q, k_pages, v_pages, block_table, cache_seqlens, causal, scale, num_splits, validate, where: str
):
    """`paged_decode_attention` after `check_paged`: the lengths and page ids checked (`should_validate`),
    then the kernels; returns (out, lse). The body of its operator too (`op.py`)."""
    page_size, capacity = _checked_values(q, k_pages, block_table, cache_seqlens, validate, where)
    return launch(
        q, k_pages, v_pages, block_table, cache_seqlens,
        page_size=page_size, capacity=capacity, causal=normalise_causal(causal, where), scale=scale,
        num_splits=num_splits, where=where,
    )  # fmt: skip


def _checked_values(q, k_pages, block_table, cache_seqlens, validate, where: str) -> tuple[int, int]:
    """(page size, capacity in keys) of a paged call, after checking the lengths and page ids it uses where
    `should_validate` allows."""
    num_pages, page_size = k_pages.shape[:2]
    capacity = block_table.shape[1] * page_size
    if should_validate(validate, q.device):
        check_lengths(where, cache_seqlens, capacity)
        check_page_ids(where, block_table, cache_seqlens, num_pages, page_size)
    return page_size, capacity


def paged_plan(
    q, k_pages, v_pages, block_table, cache_seqlens, causal, num_splits, validate, where: str,
    table_row: bool | None = None,
) -> SplitLaunch:  # fmt: skip
    """`paged_decode_attention`'s checks (`check_paged`, then the lengths and page ids) and the plan of its
    split-KV launch, not run: for a caller that gives the kernel its own partial buffers
    (`split_kv.write_partials`; cascade attention writes both of its passes into one, notebook 14).
    table_row: None, decoding's choice of reading the block-table rows whole (`heuristics.table_row_plan`);
    True, whenever they fit (`heuristics.decode_plan`: cascade attention's prefix pass)."""
    check_paged(q, k_pages, v_pages, block_table, cache_seqlens, where)
    page_size, capacity = _checked_values(q, k_pages, block_table, cache_seqlens, validate, where)
    return plan_launch(
        q, k_pages, block_table, page_size=page_size, capacity=capacity,
        causal=normalise_causal(causal, where), num_splits=num_splits, where=where, table_row=table_row,
    )  # fmt: skip
