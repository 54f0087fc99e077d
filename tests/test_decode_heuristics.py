"""course_lib.decode.heuristics: the decoding plan (split counts, the fill-wave rule, tiles, sliced long
batches, the one-wave plans, longest-first ordering), read directly and through the kernels it launches."""

from __future__ import annotations

import math

import pytest
import torch

import course_lib
from course_lib.decode import decode_attention, heuristics, paged_decode_attention
from course_lib.decode.heuristics import (
    SHORT_TILES,
    SHORT_WAVES,
    choose_num_splits,
    longest_first,
    longest_first_block,
    sm_count,
    tile_for,
)
from course_lib.runtime import tl, triton
from course_lib.testing import assert_matches, decode_references, make_cache, to_pages

DEV = course_lib.DEVICE


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
        splits = heuristics.rule_splits(programs, 32768, heuristics.TILES[128])
        one_wave = heuristics.unsplit_one_wave(programs * splits)
        assert heuristics.one_wave_plan(programs, 32768) == one_wave
        assert plan.sliced != one_wave, programs
        if one_wave:
            assert plan.tile == heuristics.ONE_WAVE_TILES[128], programs
            assert heuristics.unsplit_one_wave(programs * plan.num_splits), programs
    assert not heuristics.decode_plan(2, 1, 1, 32768, 128, full=True).sliced
    assert not all(heuristics.one_wave_plan(p, 32768) for p in range(2, sms))  # both kinds were seen


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
    m_tiles = -(-rows // tile_for(64, paged=True).block_m_max)
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
