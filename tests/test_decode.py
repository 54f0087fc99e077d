"""course_lib.decode: split-KV and paged decoding against the float64 reference, the allocator, the
split heuristic and the continuous-batching loop (CPU interpreter; `gpu` marks the compiled-kernel tests)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import course_lib
from course_lib.attention.merge import merge_many
from course_lib.attention.reference import attention
from course_lib.decode import decode_attention, decode_reference, heuristics, paged_decode_attention
from course_lib.decode.batching import ContinuousBatcher
from course_lib.decode.cache import OutOfPages, PageAllocator, PagedKVCache
from course_lib.decode.combine import combine
from course_lib.decode.graphs import table_width
from course_lib.decode.heuristics import (
    SHORT_TILES,
    SHORT_WAVES,
    choose_num_splits,
    longest_first,
    longest_first_block,
    sm_count,
    tile_for,
)
from course_lib.decode.reference import gather_pages
from course_lib.decode.toy_model import ToyModel
from course_lib.runtime import tl, triton
from course_lib.testing import FLOOR, assert_close_to_reference, max_error

DEV = course_lib.DEVICE
# Max |lse - reference lse|, every dtype. The kernels compute the scores and the logsumexp in fp32 from the
# inputs as stored (on a GPU the 16-bit products accumulate in fp32 on the tensor cores), so what is left is
# fp32 rounding: about 1e-6 on the CPU for fp32, fp16 and bf16 alike. Absolute rather than relative to |lse|,
# because lse is used through exp(lse) (merging splits, the backward pass): an error e scales those weights by
# exp(e) ~ 1 + e, whatever the size of lse.
LSE_TOL = 1e-4


def make_cache(B, n_max, hq, hkv, d, tq, dtype, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, tq, hq, d, generator=g).to(dtype=dtype, device=device)
    k = torch.randn(B, n_max, hkv, d, generator=g).to(dtype=dtype, device=device)
    v = torch.randn(B, n_max, hkv, d, generator=g).to(dtype=dtype, device=device)
    return q, k, v


def to_pages(k, v, page_size, seed=0):
    """Scatter contiguous caches (B, Nmax, Hkv, d) into a shuffled page pool with a spare page."""
    B, n_max, hkv, d = k.shape
    max_pages = math.ceil(n_max / page_size)
    num_pages = B * max_pages + 3
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))[: B * max_pages]
    table = perm.reshape(B, max_pages).to(torch.int32)
    pools = []
    for x in (k, v):
        pool = torch.randn(num_pages, page_size, hkv, d).to(dtype=x.dtype, device=x.device)  # junk elsewhere
        padded = torch.zeros(B, max_pages * page_size, hkv, d, dtype=x.dtype, device=x.device)
        padded[:, :n_max] = x
        pool[table.long().to(x.device)] = padded.view(B, max_pages, page_size, hkv, d)
        pools.append(pool)
    return pools[0], pools[1], table.to(k.device)


def same_dtype_baseline(q, k_cache, v_cache, cache_seqlens, causal=True):
    """Plain PyTorch attention (`attention.reference.attention`) in the inputs' dtype, on their device: what
    `decode_reference` computes, one sequence at a time over its valid keys, the kv heads repeated for GQA and
    the bottom-right causal mask, at the precision the dtype allows. Rows that see no key: out 0."""
    out = torch.zeros_like(q)
    for b, n in enumerate(cache_seqlens.tolist()):
        if n:
            qb = q[b : b + 1].transpose(1, 2)  # (1, Hq, Tq, d)
            kb, vb = (x[b : b + 1, :n].transpose(1, 2) for x in (k_cache, v_cache))  # (1, Hkv, n, d)
            out[b] = attention(qb, kb, vb, causal="bottom_right" if causal else False)[0].transpose(0, 1)
    return out


def decode_references(q, k_cache, v_cache, cache_seqlens, causal=True):
    """(out, lse) of the float64 reference and plain PyTorch's out in the inputs' dtype: what `assert_matches`
    judges a decode kernel's result by."""
    ref_out, ref_lse = decode_reference(q, k_cache, v_cache, cache_seqlens, causal=causal)
    return ref_out, ref_lse, same_dtype_baseline(q, k_cache, v_cache, cache_seqlens, causal)


def assert_matches(out, lse, refs, case):
    """out within twice plain PyTorch's error in the inputs' dtype plus a floor, lse within LSE_TOL of the
    float64 reference (`decode_references`), and rows that see no key give out 0 and lse -inf.

    The floor is the dtype's (`testing.FLOOR`, set for outputs of order 1) times the largest |output|: the
    outputs shrink as the cache grows (about 0.05 at 16k keys), and a floor of fixed size would let a result
    that misses keys pass. It still covers rounding the output to the dtype (half an ulp: 2**-9 of |out| in
    bf16, 2**-11 in fp16) twice over on its own."""
    ref_out, ref_lse, baseline = refs
    floor = FLOOR[out.dtype] * ref_out.abs().max().item()
    assert_close_to_reference(out, ref_out, baseline, f"{case}: out", floor=floor)
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse.cpu()), empty), f"{case}: -inf rows differ"
    assert (out.cpu()[empty] == 0).all(), f"{case}: a row that sees no key is not 0"
    if not empty.all():
        lerr = max_error(lse.cpu()[~empty], ref_lse[~empty])
        assert lerr <= LSE_TOL, f"{case}: max |lse - ref| = {lerr:.3g} > {LSE_TOL}"


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


def test_split_heuristic_follows_fa2_rule():
    assert choose_num_splits(programs=128, n_key_blocks=512, num_sms=132) == 1  # >= 80 % of the SMs
    assert choose_num_splits(programs=8, n_key_blocks=4, num_sms=132) == 1  # tiny cache: never split
    s = choose_num_splits(programs=8, n_key_blocks=2048, num_sms=132)
    assert 8 * s / (132 * math.ceil(8 * s / 132)) >= 0.85 and s == 15, s
    assert choose_num_splits(programs=1, n_key_blocks=10, num_sms=132) <= 10


def test_fill_wave_takes_every_slot_of_one_wave_and_leaves_no_split_empty():
    fill = heuristics.fill_wave
    assert fill(15, programs=8, n_key_blocks=512, num_sms=132) == 16  # batch 1, 64k keys, contiguous
    assert fill(29, programs=8, n_key_blocks=1024, num_sms=264) == 32  # 33 would leave a split empty
    assert fill(57, programs=8, n_key_blocks=2048, num_sms=528) == 64
    assert fill(4, programs=96, n_key_blocks=32, num_sms=132) == 4  # the rule's grid is several waves
    assert fill(1, programs=128, n_key_blocks=512, num_sms=132) == 1  # no room for a second split
    assert fill(8, programs=8, n_key_blocks=8, num_sms=132) == 8  # one key block per split already
    for programs in (1, 3, 8, 16, 40):
        for n_blocks in (5, 17, 64, 333, 2048):
            for slots in (16, 132, 264, 528):
                rule = choose_num_splits(programs, n_blocks, slots)
                s = fill(rule, programs, n_blocks, slots)
                assert s >= rule
                if programs * rule <= slots:
                    per_split = math.ceil(n_blocks / s)
                    assert programs * s <= slots and math.ceil(n_blocks / per_split) == s, (
                        programs,
                        n_blocks,
                    )
                else:
                    assert s == rule


def test_a_grid_with_a_mostly_empty_last_wave_takes_the_paged_tile(monkeypatch):
    """Contiguous, more than one wave of the contiguous tile, at most one of the paged tile, and a last
    wave less than LAST_WAVE_MIN full: the paged tile (all programs at once); otherwise the usual one."""
    monkeypatch.setattr(heuristics, "sm_count", lambda *a: 132)
    monkeypatch.setattr(heuristics, "peak_gbps_per_sm", lambda *a: 25.4)  # an H100's: the one-wave tile
    usual, paged = heuristics.TILES[128], heuristics.PAGED_TILES[128]
    for programs, expected in (
        (100, usual),  # the rule splits these
        (120, heuristics.ONE_WAVE_TILES[128]),  # one wave, unsplit
        (132, heuristics.ONE_WAVE_TILES[128]),
        (192, paged),
        (256, usual),
        (320, paged),
        (384, usual),
        (512, paged),
    ):
        assert heuristics.tile_for(128, programs=programs, capacity=4096) == expected, programs
    assert heuristics.tile_for(128, programs=528, capacity=4096) == usual  # four full waves
    assert heuristics.tile_for(128, programs=600, capacity=4096) == usual  # more than a paged wave
    assert heuristics.tile_for(128, paged=True, programs=192, capacity=4096) == paged
    assert heuristics.decode_plan(24, 8, 1, 4096, 128).tile == paged


def test_a_long_batch_is_sliced():
    """Two sequences or more and a cache longer than SLICED_MIN_KEYS: slices of at most SLICE_KEYS keys,
    or the paged rule's count if larger, contiguous or paged; one sequence or a short cache keeps the
    rule's count."""
    slices = heuristics.slice_splits(32768)
    assert slices == 32768 // heuristics.SLICE_KEYS
    for paged in (False, True):
        for batch, heads in ((2, 1), (2, 8), (64, 8)):
            assert heuristics.sliced(batch, 32768)
            expected = max(slices, heuristics.num_splits_for(batch, heads, 1, 32768, 128, paged=True))
            assert heuristics.split_grid(batch, heads, 1, 32768, 128, paged) == expected
        for batch, heads, capacity in ((1, 8, 32768), (64, 8, heuristics.SLICED_MIN_KEYS)):
            assert not heuristics.sliced(batch, capacity), (batch, heads, capacity)
            rule = heuristics.num_splits_for(batch, heads, 1, capacity, 128, paged)
            assert heuristics.split_grid(batch, heads, 1, capacity, 128, paged) == rule


def test_the_one_wave_tile_follows_the_bandwidth_per_sm(monkeypatch):
    """A plan of one wave runs on `ONE_WAVE_TILES` below ONE_WAVE_MAX_GBPS_PER_SM (an H100's 25.4 GB/s
    per SM) and on the usual tile above it (an H200's 36.5), unsplit or split; the split counts and
    the even batch's unsliced plan are the same on both."""
    monkeypatch.setattr(heuristics, "sm_count", lambda *a: 132)
    plans = {}
    for gbps in (25.4, 36.5):
        monkeypatch.setattr(heuristics, "peak_gbps_per_sm", lambda *a, g=gbps: g)
        plans[gbps] = [
            heuristics.decode_plan(b, 8, 1, n, 128, full=True)
            for b, n in ((1, 131072), (8, 8192), (16, 32768))
        ]
    for h100, h200 in zip(plans[25.4], plans[36.5]):
        assert h100.tile == heuristics.ONE_WAVE_TILES[128] and h200.tile == heuristics.TILES[128]
        assert (h100.num_splits, h100.sliced) == (h200.num_splits, h200.sliced) and not h200.sliced
    if (
        course_lib.runtime.ON_GPU
    ):  # this GPU's figure, from its memory clock and bus width: an H100 or H200 is 20-40
        assert 5 < heuristics.peak_gbps_per_sm() < 100


def test_a_full_cache_whose_programs_fill_the_sms_is_not_sliced(monkeypatch):
    """Every sequence known to hold the whole cache (no lengths given): an even batch, so once its
    programs fill the SMs' waves it takes the rule's plan (one wave: `ONE_WAVE_TILES` on an H100's
    bandwidth per SM), not short slices; waves not filled keep the sliced plan."""
    monkeypatch.setattr(heuristics, "peak_gbps_per_sm", lambda *a: 25.4)
    sms = heuristics.sm_count()
    heads = 8
    batch = sms // heads  # one wave of programs, past the threshold
    assert heuristics.unsplit_one_wave(batch * heads)
    assert heuristics.sliced(batch, 32768) and heuristics.sliced(
        batch, 32768, full=False, programs=batch * heads
    )
    assert not heuristics.sliced(batch, 32768, full=True, programs=batch * heads)
    plan = heuristics.decode_plan(batch, heads, 1, 32768, 128, full=True)
    assert not plan.sliced and plan.num_splits == heuristics.num_splits_for(batch, heads, 1, 32768, 128) == 1
    assert (
        plan.tile == tile_for(128, programs=batch * heads, capacity=32768) == heuristics.ONE_WAVE_TILES[128]
    )
    programs = sms + sms // 2  # 1.5 waves: wave efficiency 0.75
    assert heuristics.decode_plan(programs, 1, 1, 32768, 128, full=True).sliced
    assert not heuristics.decode_plan(2 * sms, 1, 1, 32768, 128, full=True).sliced  # two full waves
    assert heuristics.split_grid(batch, heads, 1, 32768, 128, full=True) == 1
    # Few programs that the rule splits into one full wave (batch 1's plan): not sliced either, on
    # `ONE_WAVE_TILES`; few whose rule's plan is several waves stay sliced.
    for programs in range(2, sms):
        plan = heuristics.decode_plan(programs, 1, 1, 32768, 128, full=True)
        splits = heuristics._rule_splits(programs, 32768, heuristics.TILES[128])
        one_wave = heuristics.unsplit_one_wave(programs * splits)
        assert heuristics.one_wave_plan(programs, 32768) == one_wave
        assert plan.sliced != one_wave, programs
        if one_wave:
            assert plan.tile == heuristics.ONE_WAVE_TILES[128], programs
            assert heuristics.unsplit_one_wave(programs * plan.num_splits), programs
    assert not heuristics.decode_plan(2, 1, 1, 32768, 128, full=True).sliced
    assert not all(heuristics.one_wave_plan(p, 32768) for p in range(2, sms))  # both kinds were seen


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


def test_decode_operator_matches_the_function_and_compiles_whole():
    """course_lib::decode_attention: the function's result from strided views (a model's (B, H, N, d)
    tensors transposed), torch.library.opcheck (schema, fake implementation), one node of a
    torch.compile(fullgraph=True) graph, and a clear error for a backward through it."""
    from course_lib.decode.op import _fake, decode_attention_op

    q, k, v = make_cache(2, 40, 4, 2, 16, 1, torch.float32, seed=3)
    qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))  # (B, H, N, d) memory
    seqlens = torch.tensor([7, 40], dtype=torch.int32, device=DEV)
    out = decode_attention_op(qt, kt, vt, seqlens, True, None)
    assert out.stride() == torch.empty_like(qt).stride()
    assert_matches(
        out, decode_attention(q, k, v, seqlens, return_lse=True)[1], decode_references(q, k, v, seqlens), "op"
    )
    torch.library.opcheck(decode_attention_op, (qt, kt, vt, seqlens, True, 0.3))
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda *a: decode_attention_op(*a, True, None) * 2, fullgraph=True, backend="aot_eager"
    )
    torch.testing.assert_close(compiled(qt, kt, vt, seqlens), 2 * out)
    grad_q = q.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="has no backward"):
        decode_attention_op(grad_q, k, v, seqlens, True, None).sum().backward()
    with pytest.raises(TypeError, match="cache_seqlens must be int32"):
        decode_attention_op(q, k, v, seqlens.long(), True, None)
    with pytest.raises(TypeError, match="course_lib::decode_attention: cache_seqlens must be int32"):
        _fake(q, k, v, seqlens.long())
    with pytest.raises(ValueError, match=r"cache_seqlens must have shape \(B,\) = \(2,\)"):
        _fake(q, k, v, seqlens[:1])


def test_longest_first_only_when_programs_wait_for_a_slot():
    """The sort runs for a batch of 2..LONGEST_FIRST_MAX_BATCH sequences whose programs do not all fit
    in the slots at once."""
    tile = tile_for(128, paged=True)
    slots = heuristics.slots(tile)
    assert heuristics.one_wave(slots, tile) and not heuristics.one_wave(slots + 1, tile)
    assert longest_first_block(16, slots + 1, tile) == 16 and longest_first_block(9, slots + 1, tile) == 16
    assert longest_first_block(16, slots, tile) == 0  # one wave: every program starts at once
    assert longest_first_block(1, 10 * slots, tile) == 0
    assert longest_first_block(heuristics.LONGEST_FIRST_MAX_BATCH + 1, 10 * slots, tile) == 0


@triton.jit
def longest_first_probe(SEQLENS, OUT, BATCH, CAPACITY, H_KV, NUM_SPLITS, SORT_B: tl.constexpr):
    """Program p stores the (sequence, kv head, split, length) that `longest_first` gives position p."""
    p = tl.program_id(0)
    b, kvh, split, n = longest_first(SEQLENS, BATCH, CAPACITY, H_KV, NUM_SPLITS, p, SORT_B)
    tl.store(OUT + 4 * p, b.to(tl.int32))
    tl.store(OUT + 4 * p + 1, kvh.to(tl.int32))
    tl.store(OUT + 4 * p + 2, split)
    tl.store(OUT + 4 * p + 3, n)


LONGEST_FIRST_CASES = [[5, 900, 0, 900, 40, 1200, 7], [64] * 4, [3, 2], [(37 * i) % 101 for i in range(70)]]


@pytest.mark.parametrize("lengths", LONGEST_FIRST_CASES, ids=lambda c: f"B={len(c)}")
def test_longest_first_orders_every_program_once(lengths):
    """Every (sequence, kv head, split) exactly once, with its length; sequences by length, longest first
    (ties: lower index first; lengths past the capacity count as the capacity), each one's programs
    together. 70 sequences: a sort over 128 entries, 58 of them padding, indices past 63 packed into the
    key; capacity 90, so ties at it. There one program per sequence (one kv head, one split): each
    interpreted program sorts the whole batch (0.18 s of CPU), and how a sequence's H_KV x NUM_SPLITS
    programs follow one another is checked by the small batches (2 kv heads x 3 splits)."""
    hkv, splits, capacity = (2, 3, 1000) if len(lengths) < 10 else (1, 1, 90)
    B = len(lengths)
    sort_b = 1 << (B - 1).bit_length()
    out = torch.full((B * hkv * splits, 4), -1, dtype=torch.int32, device=DEV)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    longest_first_probe[(B * hkv * splits,)](lens, out, B, capacity, hkv, splits, sort_b)
    got = [tuple(row) for row in out.cpu().tolist()]
    assert sorted(row[:3] for row in got) == [
        (b, h, s) for b in range(B) for h in range(hkv) for s in range(splits)
    ]
    assert all(n == min(lengths[b], capacity) for b, _, _, n in got)
    order = sorted(range(B), key=lambda b: (-min(lengths[b], capacity), b))
    assert [row[0] for row in got] == [b for b in order for _ in range(hkv * splits)]


@pytest.mark.parametrize("uneven", [True, False])
@pytest.mark.parametrize("hq, hkv, tq", [(4, 2, 1), (8, 1, 9)], ids=["one-tile", "two-query-tiles"])
def test_sliced_batch_matches_reference(monkeypatch, uneven, hq, hkv, tq):
    """A long batch at the interpreter's sizes (SLICED_MIN_KEYS and SLICE_KEYS set to 64): 5 slices of
    at most 64 keys, the paged tile, the programs longest sequence first, for a contiguous and a paged
    cache, lengths uneven (0 and 1 among them) or even. With 9 tokens of 8 query heads per kv head each
    (sequence x kv head, split) has 2 query tiles, and the bottom-right causal mask applies."""
    monkeypatch.setattr(heuristics, "SLICED_MIN_KEYS", 64)
    monkeypatch.setattr(heuristics, "SLICE_KEYS", 64)
    rows = hq // hkv * tq  # (token, query head) rows per kv head
    m_tiles = -(-rows // tile_for(64, paged=True).BLOCK_M_MAX)
    n_max = 320
    B = heuristics.slots(tile_for(64, paged=True)) // (hkv * m_tiles * 5) + 1  # more programs than slots
    assert (
        heuristics.sliced(B, n_max)
        and heuristics.split_grid(B, hkv, m_tiles, n_max, 64) == 5
        and longest_first_block(B, B * hkv * m_tiles * 5, tile_for(64, paged=True)) > 0
    )
    q, k, v = make_cache(B, n_max, hq, hkv, 64, tq, torch.float32, seed=5)
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(tq, n_max + 1, (B,), generator=g) if uneven else torch.full((B,), n_max)
    if uneven:
        lens[:3] = torch.tensor([0, 1, n_max]) if tq == 1 else torch.tensor([tq, tq + 1, n_max])
    seqlens = lens.to(torch.int32).to(DEV)
    refs = decode_references(q, k, v, seqlens)
    what = f"sliced batch, uneven={uneven}, tq={tq}"
    out, lse = decode_attention(q, k, v, seqlens, return_lse=True)
    assert_matches(out, lse, refs, what)
    k_pages, v_pages, table = to_pages(k, v, 16, seed=5)
    out, lse = paged_decode_attention(q, k_pages, v_pages, table, seqlens, return_lse=True)
    assert_matches(out, lse, refs, f"paged {what}")


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
    assert tile_for(d, paged=True, table_row=True).BLOCK_N == tile_for(d, paged=True).BLOCK_N
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


def test_many_short_programs_take_the_short_tile():
    """Many short programs read through the two-per-SM tile, and give the same result."""
    waves = SHORT_WAVES * sm_count()
    assert tile_for(128, programs=waves, capacity=1024) == SHORT_TILES[128]
    assert tile_for(128, programs=waves - 1, capacity=1024) == tile_for(128)  # too few programs
    assert tile_for(128, programs=waves, capacity=4096) == tile_for(128)  # programs too long
    assert tile_for(128, paged=True, programs=waves, capacity=1024) == tile_for(128, paged=True)
    hkv, B = 2, -(-waves // 2)
    q, k, v = make_cache(B, 96, 4, hkv, 128, 1, torch.float32, seed=3)
    lens = torch.randint(0, 97, (B,), generator=torch.Generator().manual_seed(3)).to(torch.int32)
    lens[0] = 0
    out, lse = decode_attention(q, k, v, lens.to(DEV), return_lse=True)
    assert_matches(out, lse, decode_references(q, k, v, lens), "short tile")


def test_errors_name_the_problem():
    q, k, v = make_cache(2, 32, 4, 2, 64, 1, torch.float32)
    lens = torch.tensor([3, 4], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="cache_seqlens\\[1\\] = 40"):
        decode_attention(q, k, v, torch.tensor([3, 40], dtype=torch.int32, device=DEV))
    with pytest.raises(TypeError, match="int32"):
        decode_attention(q, k, v, lens.long())
    with pytest.raises(ValueError, match="multiple of Hkv"):
        decode_attention(q[:, :, :3], k, v, lens)
    with pytest.raises(ValueError, match="B, Tq, Hq, d"):
        decode_attention(q[0], k, v, lens)
    with pytest.raises(TypeError, match="share one dtype"):
        decode_attention(q.half(), k, v, lens)
    k_pages, v_pages, table = to_pages(k, v, 16)
    bad = table.clone()
    bad[1, 0] = k_pages.shape[0]
    with pytest.raises(ValueError, match="block_table\\[1, 0\\]"):
        paged_decode_attention(q, k_pages, v_pages, bad, lens)
    with pytest.raises(ValueError, match="outside \\[0, 32\\]"):
        paged_decode_attention(
            q, k_pages, v_pages, table, torch.tensor([3, 33], dtype=torch.int32, device=DEV)
        )
    with pytest.raises(TypeError, match="block_table must be int32"):
        paged_decode_attention(q, k_pages, v_pages, table.long(), lens)
    for splits, error, words in (
        (2.7, TypeError, r"num_splits must be an integer, got 2\.7"),
        ("2", TypeError, "num_splits must be an integer, got '2'"),
        (True, TypeError, "num_splits must be an integer, got True"),
        (0, ValueError, "num_splits must be >= 1, got 0"),
        (33, ValueError, r"num_splits=33 is more than the cache holds keys \(32 per sequence\)"),
        (10**12, ValueError, "num_splits=1000000000000 is more than"),  # never a buffer of that many splits
    ):
        with pytest.raises(error, match=f"^decode_attention: {words}"):
            decode_attention(q, k, v, lens, num_splits=splits)
        with pytest.raises(error, match=f"^paged_decode_attention: {words}"):
            paged_decode_attention(q, k_pages, v_pages, table, lens, num_splits=splits)


def test_decoding_refuses_inputs_that_want_a_gradient():
    """Decoding has no backward: an input that requires grad (grad mode on) is refused by name, where the
    output once came back without a grad_fn and a loss through it silently lost the attention's term."""
    q, k, v = make_cache(2, 32, 4, 2, 16, 1, torch.float32)
    lens = torch.tensor([3, 32], dtype=torch.int32, device=DEV)
    k_pages, v_pages, table = to_pages(k, v, 8)
    calls = {
        "decode_attention": lambda q, k: decode_attention(q, k, v, lens),
        "paged_decode_attention": lambda q, k: paged_decode_attention(q, k, v_pages, table, lens),
    }
    for where, call in calls.items():
        cache = k if where == "decode_attention" else k_pages
        name = "k_cache" if where == "decode_attention" else "k_pages"
        with pytest.raises(
            RuntimeError, match=f"^{where}: q require\\(s\\) grad, but decoding attention has no"
        ):
            call(q.clone().requires_grad_(), cache)
        with pytest.raises(RuntimeError, match=f"^{where}: {name} require"):
            call(q, cache.clone().requires_grad_())
        with torch.no_grad():  # inference: served as usual
            out = call(q.clone().requires_grad_(), cache)
        torch.testing.assert_close(out, call(q, cache))


def test_allocator_shares_and_copies_on_write():
    alloc = PageAllocator(3)
    a = alloc.allocate()
    alloc.share(a)
    alloc.release(a)
    assert alloc.refs[a] == 1 and alloc.num_free == 2
    cache = PagedKVCache(1, 6, 4, 1, 16, torch.float32, "cpu")
    cache.add_sequence(0)
    slots = cache.append(0, 6)  # pages p0 (full) and p1 (2 of 4 slots)
    cache.write(0, slots, torch.randn(6, 1, 16), torch.randn(6, 1, 16))
    cache.fork(0, 1)
    shared_last = cache.seqs[1].pages[-1]
    assert cache.allocator.refs[shared_last] == 2
    before = cache.k_pages[0][shared_last].clone()
    new = cache.append(1, 1)  # writes into the shared, partly filled page: copy first
    assert cache.seqs[1].pages[0] == cache.seqs[0].pages[0]  # the full page stays shared
    assert cache.seqs[1].pages[-1] != shared_last
    torch.testing.assert_close(cache.k_pages[0][cache.seqs[1].pages[-1]], before)
    assert int(new[0]) == cache.seqs[1].pages[-1] * 4 + 2
    cache.free(0)
    cache.free(1)
    assert cache.allocator.num_free == 6
    cache.add_sequence(2)
    with pytest.raises(OutOfPages, match="^sequence 2 needs 7 pages for 25 tokens$"):
        cache.append(2, 25)  # 7 pages of 4 tokens, 6 free: refused before any page is taken
    assert cache.allocator.num_free == 6 and cache.seqs[2].pages == [] and cache.seqs[2].length == 0


# --------------------------------------------------------------------------------------------------
# Continuous batching with a toy model, against a reference that recomputes full attention each step
# --------------------------------------------------------------------------------------------------
def test_continuous_batching_equals_step_by_step_reference():
    model = ToyModel(DEV)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, model.vocab, (n,), generator=g).tolist() for n in (5, 9, 3, 14)]
    new = [3, 2, 4, 2]
    # 9 pages of 4 tokens and at most 3 sequences: requests wait, join and leave; a budget of 8 tokens
    # per step chunks the 14-token prompt's prefill, which then shares steps with decoding requests.
    batcher = ContinuousBatcher(model, num_pages=9, page_size=4, max_batch=3, max_step_tokens=8)
    ids = [batcher.submit(p, n) for p, n in zip(prompts, new)]
    got = batcher.run()
    for i, p, n in zip(ids, prompts, new):
        assert got[i] == model.generate_full(p, n), f"request {i} (prompt {len(p)} tokens)"
    assert batcher.cache.allocator.num_free == 9


def test_graph_table_width_is_the_next_power_of_two():
    assert [table_width(p) for p in (0, 1, 2, 3, 4, 5, 129, 256)] == [1, 1, 2, 4, 4, 8, 256, 256]


def test_cuda_graphs_need_a_cuda_model():
    with pytest.raises(ValueError, match="CUDA"):
        ContinuousBatcher(ToyModel("cpu"), num_pages=4, page_size=4, cuda_graphs=True)


def test_the_batcher_refuses_what_it_could_not_serve_before_a_step():
    """A model the kernel cannot serve (float64, a head dim of 12) is refused when the loop is made, where
    it once failed at the first step with its pages already appended; a bad eos_id at submit."""
    with pytest.raises(ValueError, match="cannot serve this model: dtype torch.float64 is unsupported"):
        ContinuousBatcher(ToyModel("cpu", torch.float64), num_pages=4, page_size=4)
    odd = ToyModel("cpu")
    odd.head_dim = 12
    with pytest.raises(ValueError, match="cannot serve this model: head dim d=12 is unsupported"):
        ContinuousBatcher(odd, num_pages=4, page_size=4)
    batcher = ContinuousBatcher(ToyModel("cpu"), num_pages=4, page_size=4)
    for eos in ("2", -1, ToyModel.vocab, 1.0, True):
        with pytest.raises(ValueError, match="eos_id must be None or a token id of the vocabulary"):
            batcher.submit([1, 2], 3, eos_id=eos)
    assert not batcher.waiting
    batcher.submit([1, 2], 3, eos_id=np.int64(5))  # any integer type


@pytest.mark.gpu
@pytest.mark.skipif(not course_lib.ON_GPU, reason="CUDA graphs need a GPU")
def test_continuous_batching_replays_decode_steps_as_cuda_graphs():
    """Decode-only steps replayed as CUDA graphs give the reference's tokens: batches that shrink as
    requests leave (one graph per batch size) and block tables that outgrow a power of two (page size
    4: 9-24 tokens cross 4 and 8 pages), prefill steps run as they are in between."""
    model = ToyModel(DEV)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, model.vocab, (n,), generator=g).tolist() for n in (5, 9, 3, 14, 2)]
    new = [12, 6, 9, 10, 4]
    batcher = ContinuousBatcher(
        model, num_pages=40, page_size=4, max_batch=3, max_step_tokens=8, cuda_graphs=True
    )
    ids = [batcher.submit(p, n) for p, n in zip(prompts, new)]
    got = batcher.run()
    for i, p, n in zip(ids, prompts, new):
        assert got[i] == model.generate_full(p, n), f"request {i} (prompt {len(p)} tokens)"
    graphs = batcher.graphs
    assert graphs.replays > 10 and len(graphs.graphs) >= 3, (graphs.replays, sorted(graphs.graphs))
    assert {b for b, _ in graphs.graphs} >= {2, 3} and len({w for _, w in graphs.graphs}) >= 2
    assert batcher.cache.allocator.num_free == 40
    # the same loop serves the same requests again: each step shape replays a graph captured above
    captured, replays = dict(graphs.graphs), graphs.replays
    ids = [batcher.submit(p, n) for p, n in zip(prompts, new)]
    got = batcher.run()
    for i, p, n in zip(ids, prompts, new):
        assert got[i] == model.generate_full(p, n), f"request {i} (prompt {len(p)} tokens), second run"
    assert graphs.graphs == captured and graphs.replays > replays, sorted(graphs.graphs)


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


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_cuda_graph_capture_and_replay(paged):
    if not course_lib.ON_GPU:
        pytest.skip("needs a GPU")
    # 16 sequences of up to 8192 keys: the contiguous grid has 2 splits, used only for uneven lengths
    B, n_max, hkv, d = 16, 8192, 8, 128
    q, k, v = make_cache(B, n_max, 32, hkv, d, 1, torch.bfloat16)
    k_pages, v_pages, table = to_pages(k, v, 16)
    seqlens = torch.tensor([1, 100, 1500, 2048] * 4, dtype=torch.int32, device=DEV)

    def step():
        if paged:
            return paged_decode_attention(
                q, k_pages, v_pages, table, seqlens, validate=False, return_lse=True
            )
        return decode_attention(q, k, v, seqlens, validate=False, return_lse=True)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for lengths in ([7, 0, 8192, 33] * 4, [8192] * 16, [2048, 2048, 1, 999] * 4):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        refs = decode_references(q, k, v, seqlens)
        assert_matches(out, lse, refs, f"graph replay paged={paged} lengths={lengths}")


def test_dependent_launch_is_off_without_a_hopper_gpu():
    """Programmatic dependent launch only for compiled kernels on compute capability >= 9 (never in the
    interpreter), and COURSE_PDL=0 turns it off."""
    from course_lib import pdl

    expected = course_lib.ON_GPU and torch.cuda.get_device_capability()[0] >= 9
    assert pdl.enabled() == expected
    assert pdl.launch_options(False) == {} and pdl.launch_options(True) == {"launch_pdl": True}
    assert not pdl.enabled(torch.device("cpu"))


def test_dependent_launch_can_be_turned_off(monkeypatch):
    from course_lib import pdl

    monkeypatch.setenv("COURSE_PDL", "0")
    assert not pdl.enabled()


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_dependent_launch_gives_the_same_bits(paged, monkeypatch):
    """The combine launched early (PDL) reads the partials only once the split kernel has written them:
    the same bits as with plain launches, called directly and in 20 replays of a CUDA graph."""
    from course_lib import pdl
    from course_lib.perf.timing import graphed

    if not course_lib.ON_GPU or not pdl.enabled():
        pytest.skip("needs a GPU with programmatic dependent launch (compute capability >= 9)")
    q, k, v = make_cache(4, 9000, 32, 8, 128, 1, torch.bfloat16, seed=5)
    k_pages, v_pages, table = to_pages(k, v, 16, seed=5)
    seqlens = torch.tensor([5000, 17, 3000, 9000], dtype=torch.int32, device=DEV)

    def step():
        if paged:
            return paged_decode_attention(q, k_pages, v_pages, table, seqlens, validate=False)
        return decode_attention(q, k, v, seqlens, validate=False)

    monkeypatch.setenv("COURSE_PDL", "0")
    plain = step().clone()
    monkeypatch.setenv("COURSE_PDL", "1")
    assert torch.equal(step(), plain)
    out = {}
    replay = graphed(lambda: out.update(value=step()))
    for i in range(20):
        replay()
        torch.cuda.synchronize()
        assert torch.equal(out["value"], plain), f"replay {i} paged={paged}: differs from plain launches"


def test_bench_report_and_plots_on_a_synthetic_record(tmp_path):
    from course_lib.bench import decode as bench

    def timing(ms, nbytes):
        return {"plain_ms": ms * 2, "graph_ms": ms, "graph_read_fraction": nbytes / ms / 1e6 / 4000,
                "plain_read_fraction": nbytes / ms / 2e6 / 4000}  # fmt: skip

    cells = []
    for (B, n), (split_ms, paged_ms, sdpa_ms) in zip(
        [(1, 65536), (16, 32768)], [(0.075, 0.08, 0.1), (0.6, 0.9, 0.55)]
    ):
        nbytes = bench.kv_bytes([n] * B)
        cells.append({
            "name": f"B={B} N={n // 1024}k", "batch": B, "n_max": n, "kv_bytes": nbytes, "num_splits": 1,
            "split_kv": timing(split_ms, nbytes), "paged": timing(paged_ms, nbytes),
            "sdpa": dict(timing(sdpa_ms, nbytes), backend="flash/gqa"),
        })  # fmt: skip
    data = {
        "ceilings": {"read_gbps": 4000.0, "copy_gbps": 3900.0},
        "cells": cells,
        "page_sweep": [
            {"batch": 1, "n": 32768, "page_size": p, "vs_contiguous": 1 - 0.01 * i}
            for i, p in enumerate((1, 16))
        ],
        "split_curve": [
            {
                "batch": 1,
                "n": 32768,
                "num_splits": s,
                "graph_ms": 0.1 / s,
                "predicted_ms": 0.09 / s,
                "chosen": s == 2,
            }
            for s in (1, 2)
        ],  # fmt: skip
    }
    table = bench.format_table(data)
    assert "B=1 N=64k" in table and "1.33x" in table, table
    misses = bench.target_misses(data)
    assert any("B=16 N=32k: split-KV 0.92x SDPA" in m for m in misses), misses
    assert any("B=16 N=32k: paged 0.67x" in m for m in misses), misses
    assert not any(m.startswith("B=1 N=64k") for m in misses), misses
    # the even cell measured without lengths too: that call against SDPA, the paged one against the call
    # with lengths
    cells[1].update(full_num_splits=1, split_kv_full=timing(0.5, cells[1]["kv_bytes"]))
    table = bench.format_table(data)
    assert "| 1 no lengths [1] / " in table and "| 1.10x [0.92x] |" in table, table
    misses = bench.target_misses(data)
    assert not any("B=16 N=32k: split-KV" in m for m in misses), misses
    assert any("B=16 N=32k: paged 0.67x" in m for m in misses), misses
    paths = bench.save_plots(data, tmp_path, "test")
    assert len(paths) == 3 and all(p.exists() for p in paths)


def test_decode_functions_under_torch_compile():
    """decode_attention and paged_decode_attention inside torch.compile(fullgraph=True) (a graph break
    raises; reading the lengths once did: a data-dependent guard): each is one operator there, with the
    eager call's bits, lengths given or not, a forced split count too. The lengths and page ids are
    still checked by name (inside the operators, on the CPU always), and return_lse, which the operators
    do not return, is refused by name."""
    from course_lib.decode.op import paged_decode_attention_op

    q, k, v = make_cache(2, 40, 4, 2, 16, 2, torch.float32, seed=5)
    seqlens = torch.tensor([17, 40], dtype=torch.int32, device=DEV)
    k_pages, v_pages, table = to_pages(k, v, 16, seed=5)
    calls = {
        "contiguous": (decode_attention, (q, k, v, seqlens)),
        "contiguous, no lengths": (decode_attention, (q, k, v)),
        "contiguous, 3 splits": (lambda *a: decode_attention(*a, num_splits=3), (q, k, v, seqlens)),
        "paged": (paged_decode_attention, (q, k_pages, v_pages, table, seqlens)),
    }
    for name, (fn, args) in calls.items():
        torch._dynamo.reset()
        got = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
        assert torch.equal(got, fn(*args)), f"{name}: compiled differs from eager"
    torch.library.opcheck(paged_decode_attention_op, (q, k_pages, v_pages, table, seqlens, True, 0.3))
    bad = table.clone()
    bad[1, 2] = k_pages.shape[0] + 4
    torch._dynamo.reset()
    if not course_lib.ON_GPU:  # on a GPU the compiled call checks nothing unless validate=True (a sync)
        with pytest.raises(ValueError, match="paged_decode_attention: .*page"):
            torch.compile(paged_decode_attention, fullgraph=True, backend="aot_eager")(
                q, k_pages, v_pages, bad, seqlens
            )
    torch._dynamo.reset()
    # raised while tracing: with fullgraph, Dynamo hands it on inside its own error, message and all
    refused = (ValueError, torch._dynamo.exc.Unsupported)
    with pytest.raises(
        refused, match=r"decode_attention: return_lse=True is not available under torch.compile"
    ):
        torch.compile(lambda *a: decode_attention(*a, return_lse=True), fullgraph=True, backend="aot_eager")(
            q, k, v, seqlens
        )
