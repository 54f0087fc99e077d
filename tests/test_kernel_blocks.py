"""course_lib.kernels.blocks' split ranges (notebook 09): `split_range` and `split_kv_range`, the keys a
split-KV decoding program visits, against their Python twins on the CPU interpreter, and the twins
brute-forced: over a sequence's splits, every (token, head) row of every packed-GQA tile sees each of its
visible keys exactly once, in whole blocks, every split at most its share of blocks."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import course_lib
from course_lib.decode.pack_gqa import packed_rows_py
from course_lib.kernels.blocks import split_kv_range, split_kv_range_py, split_range_py
from course_lib.runtime import tl, triton

DEV = course_lib.DEVICE


@triton.jit
def split_kv_range_probe(CASES, OUT, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program p reads case p (n_k, offset, last_row, split, num_splits) and stores its (lo, hi)."""
    p = tl.program_id(0)
    n_k = tl.load(CASES + 5 * p)
    offset = tl.load(CASES + 5 * p + 1)
    last_row = tl.load(CASES + 5 * p + 2)
    split = tl.load(CASES + 5 * p + 3)
    num_splits = tl.load(CASES + 5 * p + 4)
    lo, hi = split_kv_range(n_k, offset, last_row, split, num_splits, CAUSAL, BLOCK_N)
    tl.store(OUT + 2 * p, lo)
    tl.store(OUT + 2 * p + 1, hi)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_n", [16, 64])
def test_split_kv_range_matches_its_twin(causal, block_n):
    """The kernels' helper and its Python twin give the same (lo, hi) for ragged lengths (0 and 1 among
    them), one to nine query tokens (last rows 0 .. Tq - 1), every split of 1 to 7 (more splits than blocks
    too), the split count a run-time value."""
    cases = [
        (n_k, n_k - tq, last, split, splits)
        for n_k, tq, splits in itertools.product((0, 1, 15, 16, 17, 64, 100, 257), (1, 3, 9), (1, 2, 3, 7))
        if tq <= max(n_k, 1)
        for last in sorted({0, tq - 1})
        for split in range(splits)
    ]
    inputs = torch.tensor(cases, dtype=torch.int32, device=DEV)
    out = torch.full((len(cases), 2), -1, dtype=torch.int32, device=DEV)
    split_kv_range_probe[(len(cases),)](inputs, out, causal, block_n)
    want = [split_kv_range_py(*case, block_n, causal) for case in cases]
    got = [tuple(row) for row in out.cpu().tolist()]
    wrong = [(case, g, w) for case, g, w in zip(cases, got, want) if g != w]
    assert not wrong, f"causal={causal} BLOCK_N={block_n}: (case, kernel, twin) {wrong[:5]}"


@pytest.mark.parametrize("causal", [True, False])
def test_split_kv_ranges_cover_every_visible_key_once(causal):
    """The twin brute-forced over packed-GQA tiles (`pack_gqa.packed_rows_py`): with bottom-right causal
    alignment (token t of Tq sees keys j <= n_k - Tq + t) every visible (row, key) pair lies in exactly one
    split's [lo, hi); lo is a multiple of BLOCK_N, every split holds at most P = cdiv(cdiv(n_k, BLOCK_N), S)
    blocks, and its boundaries are the same for every query tile (only the causal end differs); no key
    past the tile's last token's last visible key is visited."""
    for n_k, tq, group, block_m, block_n, splits in itertools.product(
        (0, 1, 15, 16, 17, 100, 130), (1, 3, 9), (1, 3, 8), (16, 64), (16, 64), (1, 2, 3, 5)
    ):
        if tq > max(n_k, 1):
            continue
        offset = n_k - tq
        per_split = math.ceil(math.ceil(n_k / block_n) / splits)
        for pid_m in range(-(-(tq * group) // block_m)):
            t, _, row_ok, t_last = packed_rows_py(pid_m, 0, tq, group, block_m)
            where = (n_k, tq, group, block_m, block_n, splits, pid_m)
            seen = torch.zeros(block_m, max(n_k, 1), dtype=torch.int64)
            for split in range(splits):
                lo, hi = split_kv_range_py(n_k, offset, t_last, split, splits, block_n, causal)
                plain_lo, plain_hi = split_range_py(n_k, split, splits, block_n)
                assert lo == plain_lo and hi <= plain_hi, where  # the tile changes only the causal end
                assert lo % block_n == 0 and -(-max(hi - lo, 0) // block_n) <= per_split, where
                if causal:
                    assert hi <= offset + t_last + 1, where
                seen[:, lo:hi] += 1
            for r in range(block_m):
                if not row_ok[r]:
                    continue
                visible = torch.zeros(max(n_k, 1), dtype=torch.bool)
                visible[: min(n_k, offset + t[r] + 1) if causal else n_k] = True
                assert (seen[r][visible] == 1).all(), (where, r)
