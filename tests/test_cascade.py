"""Cascade attention (course_lib.serving.cascade, notebook 14) against float64 attention over each full sequence:
the shared prefix read once by every query row, each suffix with the paged kernel, the states merged."""

from __future__ import annotations

import pytest
import torch

import course_lib
from course_lib.serving import cascade_decode_attention, cascade_reference

DEV = course_lib.DEVICE


def _setup(B, Tq, Hq, Hkv, d, prefix_len, suffix_lens, page_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    prefix_pages_n = -(-prefix_len // page_size)
    per_seq = [-(-n // page_size) for n in suffix_lens]
    num_pages = prefix_pages_n + sum(per_seq) + 3
    perm = torch.randperm(num_pages, generator=g)  # pages scattered through the pool
    k_pages = torch.randn(num_pages, page_size, Hkv, d, generator=g).to(DEV, dtype)
    v_pages = torch.randn(num_pages, page_size, Hkv, d, generator=g).to(DEV, dtype)
    prefix_pages = perm[:prefix_pages_n].to(torch.int32)
    table = torch.zeros(B, max(per_seq), dtype=torch.int32)
    start = prefix_pages_n
    for b, n in enumerate(per_seq):
        table[b, :n] = perm[start : start + n]
        start += n
    q = torch.randn(B, Tq, Hq, d, generator=g).to(DEV, dtype)
    lens = torch.tensor(suffix_lens, dtype=torch.int32)
    return q, k_pages, v_pages, prefix_pages.to(DEV), prefix_len, table.to(DEV), lens.to(DEV)


@pytest.mark.parametrize(
    "B,Tq,Hq,Hkv,prefix_len,suffix_lens,dtype",
    [
        (3, 1, 4, 2, 37, [5, 1, 12], torch.float32),  # a ragged prefix (its last page partial), GQA
        (
            2,
            3,
            2,
            2,
            16,
            [3, 9],
            torch.float32,
        ),  # several query tokens each: bottom-right causal in the suffix
        (4, 1, 8, 1, 50, [7, 7, 2, 20], torch.float16),  # multi-query attention, half precision
    ],
)
def test_cascade_matches_float64_attention_over_each_full_sequence(
    B, Tq, Hq, Hkv, prefix_len, suffix_lens, dtype
):
    args = _setup(B, Tq, Hq, Hkv, 16, prefix_len, suffix_lens, 8, dtype)
    out = cascade_decode_attention(*args)
    ref = cascade_reference(*args)
    assert out.shape == (B, Tq, Hq, 16) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.cpu().double(), ref, rtol=tol, atol=tol)


def test_bad_input_is_refused_by_name():
    q, k, v, pp, plen, table, lens = _setup(2, 2, 2, 2, 16, 20, [4, 1], 8, torch.float32)
    with pytest.raises(ValueError, match="at least the Tq = 2 query tokens"):
        cascade_decode_attention(q, k, v, pp, plen, table, lens.cpu())
    with pytest.raises(ValueError, match="prefix_len 99 must be in 1..24"):
        cascade_decode_attention(q, k, v, pp, 99, table, torch.tensor([4, 4], dtype=torch.int32, device=DEV))
    with pytest.raises(TypeError, match="prefix_pages must be a"):
        cascade_decode_attention(q, k, v, pp.long(), plen, table, torch.tensor([4, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="q must be"):
        cascade_decode_attention(q[0], k, v, pp, plen, table, lens)
