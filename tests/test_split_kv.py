"""course_lib.decode's split-KV decoding (`decode_attention`, decode/split_kv.py, and the combine kernel,
decode/combine.py; notebook 09): contiguous caches against the float64 reference, with lengths and without
(CPU interpreter; `gpu` marks the compiled-kernel tests at real sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import course_lib
from course_lib.attention.merge import merge_many
from course_lib.decode import decode_attention, heuristics, paged_decode_attention
from course_lib.decode.combine import combine
from course_lib.testing import assert_matches, decode_references, make_cache, to_pages

DEV = course_lib.DEVICE


CONTIGUOUS_CASES = [
    # (dtype, d, hq, hkv, tq, lengths, num_splits)
    (torch.float32, 64, 4, 4, 1, [0, 1, 77, 200], None),
    (torch.float16, 64, 4, 2, 1, [200, 13, 1, 0], 3),
    (torch.bfloat16, 128, 8, 2, 1, [131, 64], 2),
    (torch.float32, 64, 8, 1, 3, [3, 2, 0, 150], 4),
    (torch.float16, 128, 4, 1, 4, [200, 1], 1),
]


@pytest.mark.parametrize("dtype,d,hq,hkv,tq,lengths,num_splits", CONTIGUOUS_CASES)
def test_decode_attention_matches_reference(dtype, d, hq, hkv, tq, lengths, num_splits):
    q, k, v = make_cache(len(lengths), 200, hq, hkv, d, tq, dtype)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    out, lse = decode_attention(q, k, v, seqlens, num_splits=num_splits, return_lse=True)
    case = f"{dtype} d={d} Hq={hq} Hkv={hkv} Tq={tq} lengths={lengths} splits={num_splits}"
    assert out.dtype == dtype and out.shape == q.shape, case
    assert_matches(out, lse, decode_references(q, k, v, seqlens), case)


def test_decode_attention_not_causal():
    q, k, v = make_cache(2, 100, 4, 2, 64, 3, torch.float32, seed=1)
    seqlens = torch.tensor([5, 99], dtype=torch.int32, device=DEV)
    out, lse = decode_attention(q, k, v, seqlens, causal=False, num_splits=2, return_lse=True)
    assert_matches(out, lse, decode_references(q, k, v, seqlens, causal=False), "causal=False")
    # the flag's other spellings, as flash_attention takes them: numpy bools, 0 and 1
    for flag, want in ((np.False_, False), (0, False), (np.True_, True), (1, True), ("bottom_right", True)):
        got = decode_attention(q, k, v, seqlens, causal=flag, num_splits=2)
        assert torch.equal(got, decode_attention(q, k, v, seqlens, causal=want, num_splits=2)), repr(flag)
    for flag in ("top_left", 2, torch.tensor([True, False])):
        with pytest.raises(ValueError, match="causal must be True / 'bottom_right' or False"):
            decode_attention(q, k, v, seqlens, causal=flag)


def test_an_empty_batch_gives_an_empty_output():
    """Batch 0, with lengths and without (the whole cache: the plan's wave arithmetic once divided by 0)."""
    q, k, v = make_cache(1, 64, 4, 2, 32, 1, torch.float32)
    q, k, v = q[:0], k[:0], v[:0]
    for lengths in (None, torch.zeros(0, dtype=torch.int32, device=DEV)):
        for splits in (None, 1):
            out, lse = decode_attention(q, k, v, lengths, num_splits=splits, return_lse=True)
            assert out.shape == q.shape and lse.shape == q.shape[:-1]


def test_combine_kernel_equals_merge_many():
    g = torch.Generator().manual_seed(3)
    S, B, T, H, d = 5, 2, 1, 3, 64
    o_part = torch.randn(S, B, T, H, d, generator=g)
    l_part = torch.randn(S, B, T, H, generator=g)
    l_part[1:3] = float("-inf")  # empty splits
    l_part[:, 1, 0, 2] = float("-inf")  # a row no split saw
    o_part[:, 1, 0, 2] = 0.0
    out = torch.empty(B, T, H, d, device=DEV)
    lse = torch.empty(B, T, H, device=DEV)
    combine(o_part.to(DEV), l_part.to(DEV), out, lse)
    ref_o, ref_l = merge_many(o_part.double(), l_part.double(), dim=0)
    torch.testing.assert_close(out.double().cpu(), ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double().cpu(), ref_l, rtol=1e-5, atol=1e-5)
    assert (out[1, 0, 2] == 0).all() and torch.isneginf(lse[1, 0, 2])


@pytest.mark.parametrize("at_once", [True, False], ids=["splits-at-once", "splits-in-turn"])
@pytest.mark.parametrize("rows_per_program", [None, 3])
def test_combine_of_many_rows_equals_merge_many(monkeypatch, rows_per_program, at_once):
    """From `MANY_ROWS` rows on, or with rows_per_program (3: blocks of 4, cascade attention's merge), blocks of
    rows a program (`combine_rows_kernel`, the splits loaded at once or merged one after another): against
    merge_many, with empty splits, a row no split saw, a block's last rows past the end and partials in a
    permuted layout (a prefill's (S, B, Hq, T, d), read as (S, B, T, Hq, d))."""
    from course_lib.decode import combine as combine_mod

    if rows_per_program is None:
        monkeypatch.setattr(combine_mod, "MANY_ROWS", 8)
    if not at_once:
        monkeypatch.setattr(combine_mod, "SLOTS_AT_ONCE", 0)
    g = torch.Generator().manual_seed(4)
    S, B, T, H, d = 3, 2, 5, 3, 48  # 30 rows: two blocks of 16, the second part empty
    o_part = torch.randn(S, B, H, T, d, generator=g).transpose(2, 3)
    l_part = torch.randn(S, B, H, T, generator=g).transpose(2, 3)
    l_part[1] = float("-inf")  # an empty split
    l_part[:, 1, 4, 2] = float("-inf")  # a row no split saw
    o_part[:, 1, 4, 2] = 0.0
    out = torch.empty(B, T, H, d, device=DEV, dtype=torch.float16)
    lse = torch.empty(B, T, H, device=DEV)
    combine(o_part.to(DEV), l_part.to(DEV), out, lse, rows_per_program=rows_per_program)
    ref_o, ref_l = merge_many(o_part.double(), l_part.double(), dim=0)
    torch.testing.assert_close(out.double().cpu(), ref_o, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(lse.double().cpu(), ref_l, rtol=1e-5, atol=1e-5)
    assert (out[1, 4, 2] == 0).all() and torch.isneginf(lse[1, 4, 2])


@pytest.mark.parametrize("bad", [0, -2, True, 2.0, "4"])
def test_combine_refuses_a_bad_rows_per_program(bad):
    o_part, l_part = torch.zeros(2, 1, 1, 2, 16, device=DEV), torch.zeros(2, 1, 1, 2, device=DEV)
    out, lse = torch.empty(1, 1, 2, 16, device=DEV), torch.empty(1, 1, 2, device=DEV)
    with pytest.raises((TypeError, ValueError), match="rows_per_program"):
        combine(o_part, l_part, out, lse, rows_per_program=bad)
    with pytest.raises(ValueError, match="without pdl"):
        combine(o_part, l_part, out, lse, rows_per_program=4, pdl=True)


def assert_whole_cache_matches(q, k, v, what):
    """decode_attention without lengths (cache_seqlens=None) against the float64 reference given every
    length as Nmax."""
    full = torch.full((q.shape[0],), k.shape[1], dtype=torch.int32, device=q.device)
    out, lse = decode_attention(q, k, v, return_lse=True)
    assert_matches(out, lse, decode_references(q, k, v, full), what)


@pytest.mark.parametrize("hq, hkv, tq", [(4, 2, 1), (8, 8, 3)])
def test_decode_attention_without_lengths_reads_the_whole_cache(monkeypatch, hq, hkv, tq):
    """cache_seqlens=None: every sequence holds all Nmax keys, on the sliced plan (few programs) and on
    the rule's plan (programs that fill the SMs), against the float64 reference with full lengths."""
    monkeypatch.setattr(heuristics, "SLICED_MIN_KEYS", 64)
    monkeypatch.setattr(heuristics, "SLICE_KEYS", 64)
    n_max = 150
    for B in (2, 3):
        q, k, v = make_cache(B, n_max, hq, hkv, 64, tq, torch.float32, seed=B)
        plan = heuristics.decode_plan(B, hkv, 1, n_max, 64, full=True)
        what = f"no lengths, B={B} Hq={hq} Hkv={hkv} Tq={tq}, sliced={plan.sliced}"
        rule = heuristics.wave_efficiency(B * hkv, heuristics.sm_count()) >= 0.8 or heuristics.one_wave_plan(
            B * hkv, n_max, 64
        )
        assert plan.sliced == (not rule), what
        assert_whole_cache_matches(q, k, v, what)


def test_decode_attention_without_lengths_on_a_split_plan_of_one_wave():
    """cache_seqlens=None where the rule splits a few programs into one wave (batch 1's plan, and a small
    even batch that is then not sliced): the kernel takes the whole cache with no lengths tensor (FULL),
    against the float64 reference with full lengths."""
    candidates = [(1, 4, 1000), (2, 4, 1000), (1, 8, 16384), (2, 8, 16384)]  # (B, Hkv, Nmax); d = 64

    def one_wave_split(c):
        plan = heuristics.decode_plan(c[0], c[1], 1, c[2], 64, full=True)
        return plan.num_splits > 1 and not plan.sliced and heuristics.one_wave_plan(c[0] * c[1], c[2], 64)

    cases = [c for c in candidates if one_wave_split(c)][:2]
    assert cases, "no candidate takes a split plan of one wave on this device"
    for B, hkv, n_max in cases:
        q, k, v = make_cache(B, n_max, 2 * hkv, hkv, 64, 1, torch.float32, seed=B)
        assert_whole_cache_matches(q, k, v, f"no lengths, B={B} Hkv={hkv} Nmax={n_max}")


# --------------------------------------------------------------------------------------------------
# GPU: compiled kernels, bf16 at real sizes, CUDA-graph capture and replay
# --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize(
    "B,n_max,hkv,d", [(1, 16384, 8, 128), (4, 4096, 8, 128), (8, 1000, 2, 64), (16, 12000, 8, 128)]
)
def test_gpu_bf16_real_sizes(B, n_max, hkv, d):
    if not course_lib.ON_GPU:
        pytest.skip("needs a GPU")
    q, k, v = make_cache(B, n_max, 4 * hkv, hkv, d, 1, torch.bfloat16)
    lengths = torch.randint(1, n_max + 1, (B,), generator=torch.Generator().manual_seed(0))
    lengths[0] = n_max
    seqlens = lengths.to(torch.int32).to(DEV)
    refs = decode_references(q, k, v, seqlens)
    out, lse = decode_attention(q, k, v, seqlens, return_lse=True)
    assert_matches(out, lse, refs, f"contiguous B={B} N={n_max} d={d}")
    k_pages, v_pages, table = to_pages(k, v, 16)
    out, lse = paged_decode_attention(q, k_pages, v_pages, table, seqlens, return_lse=True)
    assert_matches(out, lse, refs, f"paged B={B} N={n_max} d={d}")


@pytest.mark.gpu
@pytest.mark.parametrize("B,n_max", [(16, 12000), (2, 9000), (24, 5000)])
def test_gpu_whole_cache_without_lengths(B, n_max):
    """cache_seqlens=None at real sizes, on each plan a call without lengths can take (132 SMs): B = 16
    the rule's one split (128 programs fill the SMs), B = 2 the rule's splits into one wave, B = 24
    (192 programs, 1.45 waves) the sliced plan."""
    if not course_lib.ON_GPU:
        pytest.skip("needs a GPU")
    q, k, v = make_cache(B, n_max, 32, 8, 128, 1, torch.bfloat16)
    assert_whole_cache_matches(q, k, v, f"no lengths B={B} N={n_max}")
