"""course_lib.decode's paged decoding (`paged_decode_attention`, decode/paged.py; notebook 10): a shuffled page
pool read through a block table against the contiguous cache and the float64 reference, the table row
read whole against one page-id load per block."""

from __future__ import annotations

import pytest
import torch

import course_lib
from course_lib.decode import heuristics, paged_decode_attention
from course_lib.decode.heuristics import tile_for
from course_lib.decode.reference import gather_pages
from course_lib.testing import assert_matches, decode_references, make_cache, to_pages

DEV = course_lib.DEVICE


PAGED_CASES = [
    # (page_size, dtype, hq, hkv, tq, lengths)
    (1, torch.float32, 4, 4, 1, [0, 1, 37]),
    (16, torch.float16, 8, 2, 2, [1, 47, 130]),
    (64, torch.bfloat16, 8, 8, 1, [130, 0, 63]),
    (16, torch.float32, 8, 1, 1, [17, 100, 2]),
]


@pytest.mark.parametrize("page_size,dtype,hq,hkv,tq,lengths", PAGED_CASES)
def test_paged_matches_contiguous_and_reference(page_size, dtype, hq, hkv, tq, lengths):
    q, k, v = make_cache(len(lengths), 130, hq, hkv, 64, tq, dtype, seed=page_size)
    k_pages, v_pages, table = to_pages(k, v, page_size, seed=page_size)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    case = f"page {page_size} {dtype} Hq={hq} Hkv={hkv} Tq={tq} lengths={lengths}"
    capacity = table.shape[1] * page_size
    torch.testing.assert_close(gather_pages(k_pages, table, capacity)[:, :130], k, msg=case)
    out, lse = paged_decode_attention(q, k_pages, v_pages, table, seqlens, num_splits=2, return_lse=True)
    assert_matches(out, lse, decode_references(q, k, v, seqlens), case)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_row_gives_the_same_bits_as_page_id_loads(monkeypatch, page_size, dtype):
    """A grid of one wave reads its block-table row whole, beside the length, and finds each block's
    pages in it (`heuristics.table_row_plan`); the result has the same bits as one page-id load per
    block (both tiles take blocks of the same size), for ragged lengths (0 and 1 among them), GQA, a few
    query tokens and a shuffled page pool."""
    B, n_max, hq, hkv, d, tq = 3, 83, 8, 2, 64, 2
    q, k, v = make_cache(B, n_max, hq, hkv, d, tq, dtype, seed=11)
    k_pages, v_pages, table = to_pages(k, v, page_size, seed=11)
    width = table.shape[1]
    assert tile_for(d, paged=True, table_row=True).block_n == tile_for(d, paged=True).block_n
    assert heuristics.table_row_plan(B, hkv, 1, width * page_size, d, width, 3) == 3
    row_slots = heuristics.slots(tile_for(d, paged=True, table_row=True))
    assert heuristics.table_row_plan(B, hkv, 1, width * page_size, d, width, row_slots) == 0  # 2+ waves
    wide = heuristics.TABLE_ROW_MAX + 1
    assert heuristics.table_row_plan(1, 1, 1, wide * page_size, d, wide) == 0  # too long a row
    for lengths in ([0, 1, 83], [5, 17, 40]):
        lens = torch.tensor(lengths, dtype=torch.int32, device=DEV)
        outs = []
        for row_max in (heuristics.TABLE_ROW_MAX, 0):
            monkeypatch.setattr(heuristics, "TABLE_ROW_MAX", row_max)
            for splits in (1, 3):
                outs.append(
                    paged_decode_attention(
                        q, k_pages, v_pages, table, lens, num_splits=splits, return_lse=True
                    )
                )
        for (o1, l1), (o2, l2) in zip(outs[:2], outs[2:]):
            assert torch.equal(o1, o2) and torch.equal(l1, l2)
        assert_matches(
            *outs[0], decode_references(q, k, v, lens), f"table row, page {page_size}, lengths {lengths}"
        )


def test_many_query_rows_take_128_row_programs_and_match_the_reference():
    """A cascade's prefix pass: many (query token x head) rows of one kv head over one K/V stream, no causal
    mask (`heuristics.many_rows_tile`): 128-row programs, the same attention as the float64 reference,
    ragged lengths included. Causal calls and fewer rows keep the usual tile."""
    d, hq, hkv, tq = 128, 8, 2, 64  # 4 heads a group x 64 tokens = 256 rows per (sequence, kv head)
    assert heuristics.many_rows_tile(d, 4 * tq, causal=False).block_m_max == 128
    assert heuristics.many_rows_tile(d, 4 * tq, causal=True) is None
    assert heuristics.many_rows_tile(d, heuristics.MANY_ROWS - 1, causal=False) is None
    q, k, v = make_cache(2, 70, hq, hkv, d, tq, torch.float32, seed=5)
    k_pages, v_pages, table = to_pages(k, v, 16, seed=5)
    seqlens = torch.tensor([70, 33], dtype=torch.int32, device=DEV)
    out, lse = paged_decode_attention(q, k_pages, v_pages, table, seqlens, causal=False, return_lse=True)
    assert_matches(out, lse, decode_references(q, k, v, seqlens, causal=False), "many rows, paged")
