"""Where a block of keys lives in a KV cache: the rows the split-KV kernel reads (notebooks 09, 10).

A contiguous cache (B, Nmax, Hkv, d) holds key j of sequence b at row b * stride_b + j * stride_n. A paged
cache is a pool (num_pages, page_size, Hkv, d) and a block table (B, max_pages) int32 (`paged.py`): key j
of sequence b lives in page block_table[b, j // page_size], at slot j % page_size, so a block of keys first
needs its page ids, a load that its K/V loads wait on. A grid of one wave (`heuristics.table_row_plan`)
instead loads a sequence's whole table row once, at its program's start (`table_row`), and finds each
block's page ids in registers (`tl.gather`): the first K/V load waits for one memory round trip, not two
(the measurements are in `split_kv.py`'s docstring). FlashAttention-3 keeps the same lookup in a file of
its own (hopper/paged_kv.h) beside its main loop; so does this course.

`kv_rows` is the kernel's helper, `kv_rows_py` its plain-Python twin (tests/test_paged_lookup.py).
"""

from __future__ import annotations

from ..runtime import tl, triton


@triton.jit
def table_row(BLOCK_TABLE, b, stride_tb, stride_tp, N_PAGES, TABLE_ROW: tl.constexpr):
    """Sequence b's block-table row, TABLE_ROW (a power of two) int32 page ids into registers; entries
    past the table's width N_PAGES read 0 (never used: `kv_rows` looks up only pages of valid keys)."""
    t_offs = tl.arange(0, TABLE_ROW)
    return tl.load(BLOCK_TABLE + b * stride_tb + t_offs * stride_tp, mask=t_offs < N_PAGES, other=0)


@triton.jit
def kv_rows(
    cols, col_ok, b, BLOCK_TABLE, row, stride_tb, stride_tp, stride_kb, stride_kn, stride_vb, stride_vn,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, TABLE_ROW: tl.constexpr,
):  # fmt: skip
    """Offsets (int64, in elements) of the K rows and the V rows of keys `cols` of sequence b: (k_rows,
    v_rows), each shaped like cols; add the head's and the columns' offsets to read a tile.

    PAGED=False: a contiguous cache; stride_kb, stride_vb step sequences, stride_kn, stride_vn keys.
    PAGED=True: page pools; stride_kb, stride_vb step pages, stride_kn, stride_vn slots. One page id per
    key: from `row` (`table_row`'s registers) when TABLE_ROW > 0, else loaded from BLOCK_TABLE (int32,
    mostly from L1/L2; keys where col_ok is off read page 0). PAGE_SIZE is a compile-time constant: a
    power of two makes the lookup a shift and a mask."""
    if PAGED:
        if TABLE_ROW > 0:
            page = tl.gather(row, tl.minimum(cols // PAGE_SIZE, TABLE_ROW - 1), 0).to(tl.int64)
        else:
            page = tl.load(
                BLOCK_TABLE + b * stride_tb + (cols // PAGE_SIZE) * stride_tp, mask=col_ok, other=0
            ).to(tl.int64)
        k_rows = page * stride_kb + (cols % PAGE_SIZE) * stride_kn
        v_rows = page * stride_vb + (cols % PAGE_SIZE) * stride_vn
    else:
        k_rows = b * stride_kb + cols.to(tl.int64) * stride_kn
        v_rows = b * stride_vb + cols.to(tl.int64) * stride_vn
    return k_rows, v_rows


def kv_rows_py(
    cols: list[int],
    b: int,
    block_table,
    k_strides: tuple[int, int],
    v_strides: tuple[int, int],
    page_size: int,
) -> tuple[list[int], list[int]]:
    """`kv_rows` in Python for valid keys `cols` of sequence b: block_table None (a contiguous cache) or a
    (B, max_pages) nested list or tensor; k_strides, v_strides: (stride_b or stride of a page, stride_n)."""
    if block_table is None:
        starts = [(b, j) for j in cols]
    else:
        starts = [(int(block_table[b][j // page_size]), j % page_size) for j in cols]
    rows = [[first * s_b + second * s_n for first, second in starts] for s_b, s_n in (k_strides, v_strides)]
    return rows[0], rows[1]
