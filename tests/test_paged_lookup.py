"""course_lib.decode.paged_lookup (notebooks 09, 10): the K and V rows of a block of keys, from a contiguous
cache, from page ids loaded from the block table, or from the table row held in registers (`tl.gather`),
against the Python twin on the CPU interpreter, and the rows found in a shuffled page pool holding the
contiguous cache's keys."""

from __future__ import annotations

import pytest
import torch

import course_lib
from course_lib.decode.paged_lookup import kv_rows, kv_rows_py, table_row
from course_lib.runtime import tl, triton
from course_lib.testing import to_pages

DEV = course_lib.DEVICE


@triton.jit
def kv_rows_probe(
    K_ROWS, V_ROWS, BLOCK_TABLE, b, start, n_k, stride_tb, stride_tp,
    stride_kb, stride_kn, stride_vb, stride_vn, N_PAGES,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, TABLE_ROW: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The rows of keys start ... start + BLOCK_N - 1 of sequence b (keys past n_k masked), as the split-KV
    kernel finds them: one table row per program when TABLE_ROW > 0."""
    if PAGED and TABLE_ROW > 0:
        row = table_row(BLOCK_TABLE, b, stride_tb, stride_tp, N_PAGES, TABLE_ROW)
    else:
        row = 0
    offs = tl.arange(0, BLOCK_N)
    cols = start + offs
    col_ok = cols < n_k
    k_rows, v_rows = kv_rows(
        cols, col_ok, b, BLOCK_TABLE, row, stride_tb, stride_tp, stride_kb, stride_kn, stride_vb, stride_vn,
        PAGED, PAGE_SIZE, TABLE_ROW,
    )  # fmt: skip
    tl.store(K_ROWS + offs, k_rows, mask=col_ok)
    tl.store(V_ROWS + offs, v_rows, mask=col_ok)


@pytest.mark.parametrize("layout", ["contiguous", "page ids", "table row"])
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_kv_rows_match_their_twin_and_the_cache(layout, page_size):
    """Blocks of 16 keys of sequence 2 of a 3-sequence cache of 45 keys (a ragged last block masked; a
    block across page boundaries): the kernel's rows equal the twin's, and the K and V rows read there
    (plus the head's offset) are the contiguous cache's keys. The pools' K and V have different strides
    (V sliced from a wider pool)."""
    B, n_max, hkv, d, kvh = 3, 45, 2, 8, 1
    g = torch.Generator().manual_seed(page_size)
    k, v = (torch.randn(B, n_max, hkv, d, generator=g).to(DEV) for _ in range(2))
    paged = layout != "contiguous"
    if paged:
        k_src, v_src, table = to_pages(k, v, page_size, seed=page_size)
        block_table = table.cpu().tolist()
    else:  # any table: never read
        k_src, v_src, table, block_table = k, v, torch.zeros(1, 1, dtype=torch.int32, device=DEV), None
    wider = torch.zeros(*v_src.shape[:2], hkv + 1, d, device=DEV)
    wider[:, :, :hkv] = v_src
    v_src = wider[:, :, :hkv]
    width = table.shape[1]
    table_row_len = 1 << (width - 1).bit_length() if layout == "table row" else 0
    b, n_k = 2, 41
    for start in (0, 16, 32):
        k_rows = torch.full((16,), -1, dtype=torch.int64, device=DEV)
        v_rows = torch.full((16,), -1, dtype=torch.int64, device=DEV)
        kv_rows_probe[(1,)](
            k_rows, v_rows, table, b, start, n_k, *table.stride(),
            k_src.stride(0), k_src.stride(1), v_src.stride(0), v_src.stride(1), width,
            paged, page_size, table_row_len, 16,
        )  # fmt: skip
        cols = list(range(start, min(start + 16, n_k)))
        want_k, want_v = kv_rows_py(cols, b, block_table, k_src.stride()[:2], v_src.stride()[:2], page_size)
        case = f"{layout}, page size {page_size}, keys {start}..{start + 15}"
        assert k_rows[: len(cols)].cpu().tolist() == want_k, case
        assert v_rows[: len(cols)].cpu().tolist() == want_v, case
        for src, rows, cache in ((k_src, want_k, k), (v_src, want_v, v)):
            flat = torch.empty(0, device=DEV).set_(src.untyped_storage())  # read at the offsets
            got = torch.stack([flat[r + kvh * src.stride(2) : r + kvh * src.stride(2) + d] for r in rows])
            assert torch.equal(got, cache[b, cols, kvh]), case
