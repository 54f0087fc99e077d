"""How many splits of the K/V cache a decoding step uses, and the tile sizes per head dim (notebook 09).

Decoding has one program per (sequence, kv head, split): at batch 1 with 8 kv heads that is 8 programs
for a GPU of 132 SMs unless the cache is split. FlashAttention-2's rule (its `num_splits_heuristic`),
written out here:
- one split when the programs without splitting already fill 80 % of the SMs;
- otherwise, among 1..min(128, SMs, key blocks) splits, the fewest whose wave efficiency
  (programs / (SMs x waves), waves rounded up) is within 85 % of the best one, skipping a count that
  leaves the blocks per split unchanged from the count before it (more programs, same work each).
FlashAttention-3 also never splits a cache of <= 4 key blocks; so do we. Two more differences. FlashAttention-2
calls its rule with twice the SM count (two of its 128-thread programs per SM); here the count is the
slots our kernels fill, one program per SM for the contiguous tile (SMs x programs per SM where programs
share an SM). And "the best" is taken over every count here, where FlashAttention-2 takes it over the
counts it does not skip, so its function's choice can be one count lower (8 programs, 512 blocks, 132
slots: FA-2's function 14 splits, this rule 15).
Then one step of our own (`fill_wave`): when the rule's grid fits in one wave of the slots, the launch
takes as many splits as still fit in that wave (never a count whose last splits would be empty). The
rule stops at the first count within 85 % of the best, leaving slots idle: at batch 1 with 8 kv heads,
15 splits use 120 of 132 SMs. One wave of more, shorter programs ends sooner. Measured on an H200
(bf16, d = 128, 32/8 heads, CUDA-graph replays, one process, best of four, us, the rule's count ->
filled; contiguous, then paged in pages of 16): batch 1 at 16k 25.4 -> 24.6 (15 -> 16 splits), 26.5 ->
26.3 (29 -> 32); 32k 40.1 -> 39.4, 41.8 -> 41.0; 64k 69.2 -> 69.2, 72.8 -> 70.6; 128k 127.2 -> 127.2,
136.2 -> 132.4 (57 -> 64); B = 2 at 4k 18.2 -> 17.3 (7 -> 8); B = 2 at 16k 41.1 -> 39.9 both; ragged
B = 4 of 64-16k keys 52.8 -> 47.1; other cells (batch 1 at 1k and 8k, B = 2 and 8 at 8k) within 0.4 us.

"The SMs" here are slots: SMs x the programs per SM that the kernel needs resident to keep enough loads in
flight. A contiguous program streams its K/V rows with software pipelining and fills its SM alone (one
slot per SM). A paged program must load a block-table entry before each K/V load, a dependent load the
pipeline cannot run far ahead of, so it needs more programs per SM to cover that wait: the paged tiles
ask for 4 slots per SM, and at batch 1 the paged path splits about 4x finer than the contiguous one;
a paged grid that reads its block-table rows whole (`table_row_plan`) waits on no such load, and its
tile (`ROW_TILES`) asks for 2 slots per SM.
Measured on an H200 (bf16, d = 128, 32/8 heads, CUDA-graph replays): with the contiguous kernel's own
tile and splits the paged kernel ran at 0.55-0.7x its speed; with these, 0.91-1.09x in the benchmark's
cells except batch 1 at 8k tokens (0.84x: 64 splits of two blocks each).

Every input is a shape (batch, heads, cache capacity), never a length's value: the choice, and so the
grid, stays fixed for a batch shape, which CUDA-graph replay needs.

A long batch. When the rule's programs already fill the SMs, a batch whose lengths differ is still
unbalanced: each (sequence, kv head) is one program, and the longest sequence's programs stream alone long
after the short ones have finished. Measured on an H200 (bf16, d = 128, 32/8 heads, 16 sequences of
880-31280 keys, 1080 MB): 385 us with the rule's one split, 62 % of the read ceiling. Which lengths a step
has cannot be read from the shapes, so a batch of two sequences or more whose cache is longer than
SLICED_MIN_KEYS takes the *sliced* plan (`sliced`) whatever its lengths:
- slices of at most SLICE_KEYS keys (`slice_splits`), or more if the rule for the paged tile's slots asks
  for more, so that a long sequence is spread over many SMs;
- the paged tile (`PAGED_TILES`: 64-key blocks, 4 programs per SM), contiguous cache or not: many short
  programs share each SM, and one that starts late does not stream alone;
- when its programs do not all fit in the slots at once (`one_wave`), the programs started longest
  sequence first (`longest_first`): the GPU starts programs roughly in launch order, and in the grid's
  own order some of the longest sequence's slices started when nearly everything else had finished (the
  longest-processing-time rule of scheduling). A model of 132 SMs taking the programs in launch order
  (notebook 09) puts the benchmark's ragged batch, in these slices, 8 % above a perfect balance in the
  grid's order and within 1 % longest first. The sort delays every program's first load (measured: 1-4
  us a step), and a grid of one wave starts all its programs at once anyway, so such a grid skips it.
Measured on an H200 (bf16, d = 128, 32/8 heads, CUDA-graph replays, us), the contiguous kernel before
(8 slices of at most 4096 keys with the usual tile, used only when the lengths it loaded were uneven,
longest first) and with this plan: ragged B = 16 of 880-31280 keys 264.6 -> 259.6; B = 32 of 64-32k
716 -> 540; B = 64 of 64-32k 1036 -> 900; even B = 16 at 32k 499 -> 494; even B = 64 at 16k 966 -> 975.
The longest-first order alone (paged, grid order -> longest first): ragged B = 16 296 -> 269, B = 32 of
64-32k 590 -> 563; an even batch pays for the sort (B = 16 at 32k 490 -> 498).
Small batches (2-8 sequences of 8k-16k keys), the rule against this plan (contiguous / paged): ragged
batches 5-18 % faster (B = 8 of 64-8k: 41.7 -> 36.0 / 41.5 -> 38.7; B = 4 of 64-16k: 50.1 -> 43.8 /
51.5 -> 49.0), even ones within -1 % to +4 % (B = 8 at 8k 70.1 -> 69.6 / 73.0 -> 71.0; B = 4 at 16k
69.9 -> 70.6 / 74.5 -> 72.4; B = 8 at 16k, longest first before, 132.0 -> 127.2 / 136.2 -> 130.2).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import runtime
from ..kernels.launch import Launch, keyword
from ..runtime import tl, triton

# Stand-in SM count under the interpreter, so that the CPU path splits as a mid-size GPU would.
CPU_SM_COUNT = 16


@dataclass(frozen=True)
class DecodeTile(Launch):
    """Launch sizes of the split-KV kernel for one head dim: block_n keys per step of the inner loop
    (BLOCK_N), at most block_m_max (query token x head) rows per program (BLOCK_M: a launch's rows,
    padded to a power of two, up to this), warps and pipeline stages."""

    block_n: int = keyword("BLOCK_N")
    block_m_max: int
    num_warps: int = keyword("num_warps")
    num_stages: int = keyword("num_stages")
    programs_per_sm: int = 1  # slots per SM for the split rule (module docstring)

    def shared_bytes(self, head_dim: int, elem_bytes: int) -> int:
        """Shared memory the pipelined K and V blocks take: stages x 2 x block_n x d x element size."""
        return self.num_stages * 2 * self.block_n * head_dim * elem_bytes


# Named per head dim (padded to a power of two). Decoding is bandwidth-bound: BLOCK_N x num_stages sets how
# many bytes a program has in flight (stages x BLOCK_N x d x 2 bytes for K, the same for V). The d = 128
# entries are the fastest of a sweep on an H200 (BLOCK_N 64/128, stages 2-4, 4/8 warps, 1-4x the splits),
# measured as CUDA-graph replays at batch 1-64 and 4k-128k tokens.
TILES = {
    16: DecodeTile(block_n=128, block_m_max=64, num_warps=4, num_stages=3),
    32: DecodeTile(block_n=128, block_m_max=64, num_warps=4, num_stages=3),
    64: DecodeTile(block_n=128, block_m_max=64, num_warps=4, num_stages=3),
    128: DecodeTile(block_n=128, block_m_max=64, num_warps=8, num_stages=3),
    256: DecodeTile(block_n=32, block_m_max=32, num_warps=4, num_stages=2),
}
# The paged kernel: shorter pipelines (its loads wait on the block table anyway) and 4 programs per SM.
PAGED_TILES = {
    16: DecodeTile(block_n=64, block_m_max=64, num_warps=4, num_stages=2, programs_per_sm=4),
    32: DecodeTile(block_n=64, block_m_max=64, num_warps=4, num_stages=2, programs_per_sm=4),
    64: DecodeTile(block_n=64, block_m_max=64, num_warps=4, num_stages=2, programs_per_sm=4),
    128: DecodeTile(block_n=64, block_m_max=64, num_warps=4, num_stages=2, programs_per_sm=4),
    256: DecodeTile(block_n=32, block_m_max=32, num_warps=4, num_stages=2, programs_per_sm=4),
}


# The paged kernel when it reads each sequence's block-table row whole (`table_row_plan`): its page ids
# come from registers, so its pipeline can run ahead as the contiguous kernel's does, and a third stage
# pays more than a third and fourth program per SM. Measured on an H200 (bf16, d = 128, 32/8 heads, page
# size 16, batch 1, CUDA-graph replays, us, the paged tile with the table row / this one, each with the
# rule's splits for its slots): 1k keys 10.2 / 10.0-10.2, 4k 16.0-16.1 / 14.8-14.9, 8k 19.7-19.8 /
# 18.7-19.0, 16k 27.6 / 26.8; B = 8 at 8k 71.6-71.8 / 70.8. Without the table row (batch 1 at 32k) this
# tile ran 56.2 us against the paged tile's 45.1. The paged tiles' blocks and warps, a third stage, 2
# programs per SM:
ROW_TILES = {d: dataclasses.replace(tile, num_stages=3, programs_per_sm=2) for d, tile in PAGED_TILES.items()}
# The longest block-table row (entries) a program keeps in registers: 64k keys in pages of 16. Measured on
# an H200 (as above, us, page-id loads on the paged tile / the row on the row tile; contiguous): batch 1
# at 32k 44.8 / 42.1 (40.2), 64k 75.0 / 72.6 (68.8), 32k in pages of 8 (4096 entries) 44.9 / 43.4 (40.3);
# B = 2 at 32k 74.8 / 69.5 (70.8); rows of 8192 entries (128k keys) 136.2 / 137.9 (126.4).
TABLE_ROW_MAX = 4096


# Many short programs (at least SHORT_WAVES waves of them, each over at most SHORT_BLOCKS of the usual
# tile's key blocks): a 96 KB pipeline lets two programs share an SM, so one fills its pipeline while the
# other streams. Measured on an H200 (bf16, d = 128, CUDA-graph replays): batch 256 at 1k tokens went
# from 0.98x to 1.00x cuDNN; with fewer or longer programs the usual tile stays as fast or faster.
SHORT_TILES = {128: DecodeTile(block_n=64, block_m_max=64, num_warps=4, num_stages=3, programs_per_sm=2)}
SHORT_WAVES = 4
SHORT_BLOCKS = 8

# One wave of programs on the rule's plan (`one_wave_plan`: batch x kv heads x query tiles x the rule's
# splits fills ONE_SPLIT_FILL of the SMs, at most all of them): one program per SM, each streaming a whole
# (sequence, kv head) or one split of it. There a 96 KB pipeline of 64-key blocks and 4 warps streams
# faster than the usual tile's 192 KB. Measured on an H100 (bf16, d = 128, 32/8 heads, CUDA-graph
# replays, best of four, us, the usual tile / this one; cuDNN). Unsplit, even batches: B = 16 at 32k
# 693.4 / 682.7 (687.7), 16k 352.5 / 350.2 (346.8), 8k 181.3 / 179.0 (176.4), 4k 94.9 / 94.1 (91.7).
# Split, batch 1 (16 splits): 16k 33.1 / 32.4 (32.3), 32k 54.5 / 54.4 (54.1), 64k 97.2 / 95.3 (96.8),
# 128k 183.6 / 180.2 (182.6). With two waves or more the usual tile was as fast or faster (B = 32 at
# 16k 697.2 / 699.9, B = 48 at 8k 526.5 / 530.3). 64 keys x 2 stages ran 25-30 % slower, 128 keys x 4
# warps x 2 stages 3-5 %, 8 warps as fast.
ONE_WAVE_TILES = {128: DecodeTile(block_n=64, block_m_max=64, num_warps=4, num_stages=3)}
# On an H200 the same tile lost (same setup, us, the usual tile / this one; cuDNN): batch 1 at 16k 24.8 /
# 26.0 (25.1), 32k 39.4 / 42.9 (40.2), 64k 68.2 / 75.8 (69.3), 128k 125.6 / 142.3 (127.3); even batches
# without lengths B = 8 at 8k 68.4 / 75.9 (68.7), B = 16 at 32k 467.0 / 557.2 (465.4). The H200 has the
# H100's 132 SMs and 1.4x its memory bandwidth: each SM must pull 1.4x the bytes per second, and there the
# usual tile's 8 warps and 192 KB pipeline win. So the one-wave tile is taken on a GPU whose peak memory
# bandwidth per SM (`peak_gbps_per_sm`) is below ONE_WAVE_MAX_GBPS_PER_SM: between the H100's 25.4 GB/s
# per SM (3.35 TB/s by its datasheet), where it won, and the H200's 36.5 (its driver's memory clock and
# bus width), where it lost. Other GPUs are unmeasured.
ONE_WAVE_MAX_GBPS_PER_SM = 30.0
# Stand-in bandwidth per SM under the interpreter (an H100's), so that the CPU path takes the tile too.
CPU_GBPS_PER_SM = 25.4

# A contiguous grid of a few waves (more programs than the contiguous tile's slots, no more than the paged
# tile's) whose last wave would fill less than LAST_WAVE_MIN of the slots runs on the paged tile: all its
# programs start at once, four to an SM, instead of a last wave that streams on part of the GPU. Measured
# on an H200 (bf16, d = 128, 32/8 heads, even batches, CUDA-graph replays, us, the contiguous tile / the
# paged tile; the contiguous tile's last wave in brackets): B = 24 at 4k 116.2 / 100.8 (45 % full);
# B = 40 at 3000 keys 134.8 / 122.1 (42 %); B = 64 at 4k 243.3 / 240.3 and at 2k 129.2 / 124.1 (88 %);
# but B = 32 at 4k 126.0 / 128.6 (94 %) and B = 48 at 4k 185.0 / 190.4 (91 %).
LAST_WAVE_MIN = 0.9


# Many query rows over one K/V stream with no causal cut: at least MANY_ROWS (query token x head) rows of one
# (sequence, kv head), as in cascade attention's prefix pass (notebook 14: every query of a batch against
# the shared prefix, B x Tq x Hq / Hkv rows per kv head). The work is compute-bound there, and 128-row
# programs do each K/V block's products for twice the rows per load. Measured on an H200 (bf16, d = 128,
# 32/8 heads, 64 sequences' queries over a 32k-key prefix in pages of 64, the split kernel alone, do_bench,
# us): 64-row tiles (4 per kv head) 118.7-196.5 by split count (the paged tile's plan: 145), 128-row tiles of
# 64 keys, 4 warps, 2 stages, 16 splits 93.8 (366 TFLOP/s); 128 keys or 8 warps or 3 stages 101-172; the
# order of the row tiles in the grid (row tile fastest or slowest) within 2-7 us either way. The 93.8 did not
# reproduce: the same launch ran 121.9 us in scripts/prefix_gap.py (graph replays), 114.5 with its table row.
MANY_ROWS = 256
MANY_ROWS_TILES = {128: DecodeTile(block_n=64, block_m_max=128, num_warps=4, num_stages=2, programs_per_sm=2)}


def many_rows_tile(head_dim: int, rows: int, causal: bool) -> DecodeTile | None:
    """`MANY_ROWS_TILES`' tile for a call with `rows` (query tokens x query heads per kv head) rows per
    (sequence, kv head) and no causal mask, where it was measured (MANY_ROWS rows or more); else None."""
    if causal or rows < MANY_ROWS:
        return None
    return MANY_ROWS_TILES.get(max(16, runtime.next_power_of_2(head_dim)))


def tile_for(
    head_dim: int,
    paged: bool = False,
    elem_bytes: int = 2,
    programs: int = 0,
    capacity: int | None = None,
    table_row: bool = False,
) -> DecodeTile:
    """The DecodeTile for head dim `head_dim` (a multiple of 8 in [16, 256]), contiguous or paged
    (`table_row`: the paged kernel reading its block-table rows whole, `ROW_TILES`).

    programs (batch x kv heads x query tiles) and capacity (keys per sequence) pick `SHORT_TILES` for a
    contiguous cache read by many short programs, `ONE_WAVE_TILES` for a plan of one wave (`one_wave_plan`) on
    a GPU of less than ONE_WAVE_MAX_GBPS_PER_SM, and
    the paged tile for a contiguous grid of a few waves whose last one is mostly empty (`LAST_WAVE_MIN`);
    left out, the usual tile.

    On a GPU with less shared memory than the tile's pipeline needs (the d = 128 contiguous tile takes
    192 KB; an A100 has 164 KB, many desktop GPUs about 100 KB), stages are dropped, then BLOCK_N is
    halved, until it fits."""
    padded = max(16, runtime.next_power_of_2(head_dim))
    tile = (ROW_TILES if table_row else PAGED_TILES if paged else TILES)[padded]
    if (
        not paged
        and padded in SHORT_TILES
        and capacity is not None
        and programs >= SHORT_WAVES * sm_count()
        and capacity <= SHORT_BLOCKS * tile.block_n
    ):
        tile = SHORT_TILES[padded]
    elif (
        not (paged or table_row)
        and padded in ONE_WAVE_TILES
        and peak_gbps_per_sm() < ONE_WAVE_MAX_GBPS_PER_SM
        and (
            unsplit_one_wave(programs)
            or (capacity is not None and one_wave_plan(programs, capacity, head_dim))
        )
    ):
        tile = ONE_WAVE_TILES[padded]
    elif not (paged or table_row) and _ragged_last_wave(programs, tile, PAGED_TILES[padded]):
        tile = PAGED_TILES[padded]
    limit = shared_memory_bytes()
    while tile.shared_bytes(head_dim, elem_bytes) > limit and (tile.num_stages > 2 or tile.block_n > 16):
        if tile.num_stages > 2:
            tile = dataclasses.replace(tile, num_stages=tile.num_stages - 1)
        else:
            tile = dataclasses.replace(tile, block_n=tile.block_n // 2)
    return tile


@functools.cache
def shared_memory_bytes(device_index: int | None = None) -> int:
    """Shared memory one program may use on this GPU (opt-in maximum); unlimited under the interpreter."""
    if not runtime.ON_GPU:
        return 1 << 30
    return int(_driver_properties(device_index)["max_shared_mem"])


def _driver_properties(device_index: int | None) -> dict:
    """The driver's properties of a GPU (the current one for None), as Triton reads them."""
    index = torch.cuda.current_device() if device_index is None else device_index
    return triton.runtime.driver.active.utils.get_device_properties(index)


@functools.cache
def peak_gbps_per_sm(device_index: int | None = None) -> float:
    """The GPU's peak memory bandwidth per SM in GB/s, from the driver's device properties: 2 transfers
    per memory clock x the bus width in bytes, over the SMs (an H100 SXM 25.4, an H200 36.5);
    CPU_GBPS_PER_SM under the interpreter."""
    if not runtime.ON_GPU:
        return CPU_GBPS_PER_SM
    props = _driver_properties(device_index)
    peak = 2 * props["mem_clock_rate"] * 1e3 * props["mem_bus_width"] / 8  # clock in kHz, width in bits
    return peak / props["multiprocessor_count"] / 1e9


def sm_count(device_index: int | None = None) -> int:
    """Streaming multiprocessors of the GPU (`runtime.sm_count`); CPU_SM_COUNT under the interpreter."""
    return runtime.sm_count(device_index) if runtime.ON_GPU else CPU_SM_COUNT


def unsplit_one_wave(programs: int) -> bool:
    """Whether `programs` unsplit programs of the contiguous tile take the rule's one split (they fill
    ONE_SPLIT_FILL of the SMs) and fit in one wave of them."""
    return ONE_SPLIT_FILL * sm_count() <= programs <= sm_count()


def one_wave_plan(programs: int, capacity: int, head_dim: int = 128) -> bool:
    """Whether the rule's plan for `programs` unsplit contiguous programs (batch x kv heads x query tiles)
    over a cache of `capacity` keys is one wave that fills ONE_SPLIT_FILL of the SMs: its programs times
    its split count (`rule_splits` on the usual tile) pass `unsplit_one_wave`. Batch 1 with 8 kv heads
    and a long cache (16 splits, 128 programs) is such a plan; so is one split of 120 programs."""
    tile = TILES[max(16, runtime.next_power_of_2(head_dim))]
    return unsplit_one_wave(programs * rule_splits(programs, capacity, tile))


def _ragged_last_wave(programs: int, tile: DecodeTile, one_wave_tile: DecodeTile) -> bool:
    """More than one wave of `tile`, at most one of `one_wave_tile`, and a last wave of `tile` less than
    LAST_WAVE_MIN full."""
    waves = programs / slots(tile)
    last_wave = waves - math.ceil(waves) + 1  # the last wave's share of the slots (1 when all full)
    return 1 < waves and programs <= slots(one_wave_tile) and last_wave < LAST_WAVE_MIN


def wave_efficiency(programs: int, num_sms: int) -> float:
    """Fraction of SM slots busy over the waves: programs / (num_sms x ceil(programs / num_sms))."""
    waves = programs / num_sms
    return waves / math.ceil(waves)


# FlashAttention-2's rule: no split when the programs already fill this share of the SMs.
ONE_SPLIT_FILL = 0.8


@functools.lru_cache(maxsize=4096)
def choose_num_splits(programs: int, n_key_blocks: int, num_sms: int, max_splits: int = 128) -> int:
    """FlashAttention-2's split rule (module docstring).

    programs: programs without splitting (batch x kv heads x query tiles); n_key_blocks: BLOCK_N-key
    blocks of the cache capacity; num_sms: SMs, or slots (SMs x programs per SM) for a kernel that needs
    several programs per SM. Returns a split count in [1, max_splits]. Remembered per argument tuple: the
    rule weighs up to max_splits counts (tens of microseconds of Python), and a decoding loop asks again
    at every step."""
    if programs <= 0 or n_key_blocks <= 4 or programs >= ONE_SPLIT_FILL * num_sms:
        return 1
    limit = max(1, min(max_splits, num_sms, n_key_blocks))
    eff = [wave_efficiency(programs * s, num_sms) for s in range(1, limit + 1)]
    best = max(eff)
    for s in range(1, limit + 1):
        if s > 1 and math.ceil(n_key_blocks / s) == math.ceil(n_key_blocks / (s - 1)):
            continue
        if eff[s - 1] >= 0.85 * best:
            return s
    return 1


def fill_wave(splits: int, programs: int, n_key_blocks: int, num_sms: int, max_splits: int = 128) -> int:
    """The split count after `choose_num_splits`' `splits`: if its grid fits in one wave of `num_sms`
    slots, the most splits that still fit there (at most max_splits and one key block each), counted as
    the splits that get keys (blocks per split rounded up, so no split is left empty); otherwise (or if
    that is fewer) `splits` unchanged."""
    if splits < 1 or programs < 1 or programs * splits > num_sms:
        return splits
    most = min(max_splits, num_sms // programs, n_key_blocks)
    if most <= splits:
        return splits
    per_split = math.ceil(n_key_blocks / most)
    return max(splits, math.ceil(n_key_blocks / per_split))


def num_splits_for(
    batch: int, kv_heads: int, m_tiles: int, capacity: int, head_dim: int, paged: bool = False
) -> int:
    """The rule's split count for a batch shape on the tile `decode_attention` (paged=False) or
    `paged_decode_attention` (paged=True) would run it on: batch, kv heads, query tiles per (sequence, kv
    head), cache capacity in keys (Nmax, or max_pages x page_size), head dim. The rule, then `fill_wave`,
    over SMs x the tile's programs per SM. A launch may take another plan (a sliced batch, a paged grid
    that reads its table rows whole): `split_grid` gives the count it launches."""
    programs = batch * kv_heads * m_tiles
    return rule_splits(programs, capacity, tile_for(head_dim, paged, programs=programs, capacity=capacity))


def rule_splits(programs: int, capacity: int, tile: DecodeTile) -> int:
    """`choose_num_splits`, then `fill_wave`, for `programs` unsplit programs of `tile` over a cache of
    `capacity` keys."""
    n_key_blocks = math.ceil(capacity / tile.block_n)
    rule = choose_num_splits(programs, n_key_blocks, slots(tile))
    return fill_wave(rule, programs, n_key_blocks, slots(tile))


def slots(tile: DecodeTile) -> int:
    """SM slots for the split rule and the sliced plan: SMs x the tile's programs per SM."""
    return sm_count() * tile.programs_per_sm


# A long batch (module docstring): a cache longer than SLICED_MIN_KEYS in a batch of two sequences or more
# is cut in slices of at most SLICE_KEYS keys, at most MAX_SLICES of them.
SLICED_MIN_KEYS = 4096
SLICE_KEYS = 2048
MAX_SLICES = 16


def slice_splits(capacity: int) -> int:
    """Split count that keeps every slice of a sequence of `capacity` keys within SLICE_KEYS."""
    return max(1, min(MAX_SLICES, math.ceil(capacity / SLICE_KEYS)))


def sliced(batch: int, capacity: int, full: bool = False, programs: int = 0, head_dim: int = 128) -> bool:
    """Whether a batch shape takes the sliced plan (module docstring): two sequences or more and a cache
    of `capacity` keys longer than SLICED_MIN_KEYS. Contiguous and paged caches alike.

    full: every sequence is known to hold all `capacity` keys (a call without lengths): such a batch is
    even, and when its `programs` (batch x kv heads x query tiles) fill the SMs' waves (wave efficiency
    of at least ONE_SPLIT_FILL over the SMs), or the rule splits them into one wave that does
    (`one_wave_plan`, for `head_dim`), it takes the rule's plan instead (below)."""
    if full and (
        wave_efficiency(programs, sm_count()) >= ONE_SPLIT_FILL or one_wave_plan(programs, capacity, head_dim)
    ):
        return False
    return batch >= 2 and capacity > SLICED_MIN_KEYS  # one sequence is never uneven


# A batch known to be even (every sequence holds the whole cache: `decode_attention` without lengths, or
# `flash_attention`'s decoding route over dense K/V) has no long sequence to spread, so when its programs
# fill the SMs' waves it runs the rule's plan: one program per (sequence, kv head), as cuDNN's kernel
# does. Measured on an H100 (bf16, d = 128, 32/8 heads, CUDA-graph replays, us, sliced / the rule's plan,
# with the usual contiguous tile; cuDNN): B = 16 at 32k 711.6 / 693.5 (688.0), 16k 359.1 / 352.4 (346.9),
# 8k 186.1 / 180.7 (176.1); B = 32 at 16k 714.1 / 698.4 (698.3); B = 48 at 8k 538.3 / 525.3 (531.6);
# B = 64 at 16k 1419.6 / 1399.0 (1388.0). Where the waves are not full the slices won: B = 20 at 32k
# (160 programs, wave efficiency 0.61) 881.0 / 896.2; B = 24 at 8k (0.73) 276.5 both.
# A few sequences that the rule splits into one full wave (`one_wave_plan`, as it splits batch 1) take
# that plan too, on `ONE_WAVE_TILES` (same machine, us, sliced / the rule's plan; cuDNN): B = 2 at 32k
# 98.9 / 94.2 (96.4), B = 4 at 16k 97.8 / 94.7 (96.6), B = 8 at 8k 97.7 / 94.6 (96.7), B = 3 at 16k
# 76.9 / 75.4 (78.1).


class DecodePlan(NamedTuple):
    """How a decoding step is launched: its tile, its split count, whether it is a `sliced` batch, and
    whether its paged programs read their block-table rows whole (`table_row_plan`)."""

    tile: DecodeTile
    num_splits: int
    sliced: bool
    table_row: bool


def decode_plan(
    batch: int,
    kv_heads: int,
    m_tiles: int,
    capacity: int,
    head_dim: int,
    paged: bool = False,
    table_width: int = 0,
    elem_bytes: int = 2,
    num_splits: int | None = None,
    full: bool = False,
    tile: DecodeTile | None = None,
    table_row: bool | None = None,
) -> DecodePlan:
    """The launch of a batch shape: batch, kv heads, query tiles per (sequence, kv head), cache capacity
    in keys (Nmax, or max_pages x page_size), head dim; paged with table_width entries per block-table
    row; element size; num_splits to force a count; full: every sequence holds all `capacity` keys
    (`sliced`). A paged launch that reads its table rows whole
    (`table_row_plan`) runs on the row tile; a `sliced` batch on the paged tile, with the rule's count
    for its slots but at least `slice_splits`; any other on its own tile with the rule's count. tile: a
    tile chosen by the call (`many_rows_tile`), with the rule's count for its slots.
    table_row: None, decoding's rule (`table_row_plan`: the row only in a grid of one wave; a call's own
    tile, never); True, a paged launch reads its rows whole whenever they hold at most TABLE_ROW_MAX
    entries, whatever its waves, on its own tile or the row tile (cascade attention's prefix pass, whose
    programs are long: `serving.cascade.cascade_passes`); False, never."""
    programs = batch * kv_heads * m_tiles
    fits = paged and 0 < table_width <= TABLE_ROW_MAX
    if tile is not None:
        splits = num_splits or rule_splits(programs, capacity, tile)
        return DecodePlan(tile, splits, False, bool(table_row) and fits)
    long_batch = sliced(batch, capacity, full, programs, head_dim)
    row_splits = (
        table_row_plan(
            batch, kv_heads, m_tiles, capacity, head_dim, table_width, num_splits, any_waves=bool(table_row)
        )
        if paged and table_row is not False
        else 0
    )
    if row_splits:
        return DecodePlan(tile_for(head_dim, True, elem_bytes, table_row=True), row_splits, long_batch, True)
    tile = tile_for(head_dim, paged or long_batch, elem_bytes, programs=programs, capacity=capacity)
    splits = num_splits or _splits(batch, kv_heads, m_tiles, capacity, head_dim, paged, full=full)
    return DecodePlan(tile, splits, long_batch, False)


def split_grid(
    batch: int,
    kv_heads: int,
    m_tiles: int,
    capacity: int,
    head_dim: int,
    paged: bool = False,
    table_width: int = 0,
    full: bool = False,
) -> int:
    """Splits in the grid for a batch shape (`decode_plan`; table_width: entries per block-table row of a
    paged cache; full: every sequence holds the whole cache)."""
    return decode_plan(batch, kv_heads, m_tiles, capacity, head_dim, paged, table_width, full=full).num_splits


def _splits(batch, kv_heads, m_tiles, capacity, head_dim, paged, table_row=False, full=False) -> int:
    """The rule's count (then `fill_wave`) for the launch's tile, and at least `slice_splits` for a
    sliced batch (whose tile is the paged one, or the row tile for a paged launch that reads its table
    rows whole)."""
    programs = batch * kv_heads * m_tiles
    long_batch = sliced(batch, capacity, full, programs, head_dim)
    if not (long_batch or table_row):
        return num_splits_for(batch, kv_heads, m_tiles, capacity, head_dim, paged)
    rule = rule_splits(programs, capacity, tile_for(head_dim, paged=True, table_row=table_row))
    return max(rule, slice_splits(capacity)) if long_batch else rule


def table_row_plan(
    batch: int,
    kv_heads: int,
    m_tiles: int,
    capacity: int,
    head_dim: int,
    table_width: int,
    num_splits: int | None = None,
    any_waves: bool = False,
) -> int:
    """Splits for a paged launch whose programs read their sequence's block-table row whole (rows of at
    most TABLE_ROW_MAX entries; `ROW_TILES`), or 0 when it should look up page ids block by block: the
    rule's count for the row tile's slots (`num_splits` if given), kept only if the grid fits in one
    wave of them (measured: many waves of short programs ran slower with the row), or in any number of
    waves with any_waves (`decode_plan`'s table_row=True)."""
    if not 0 < table_width <= TABLE_ROW_MAX:
        return 0
    tile = tile_for(head_dim, paged=True, table_row=True)
    splits = num_splits or _splits(batch, kv_heads, m_tiles, capacity, head_dim, True, table_row=True)
    return splits if any_waves or one_wave(batch * kv_heads * m_tiles * splits, tile) else 0


# Longest first: a sliced batch's programs in order of their sequence's length (`longest_first`), for
# batches of at most this many sequences (the kernel sorts the lengths in registers).
LONGEST_FIRST_MAX_BATCH = 256


def one_wave(programs: int, tile: DecodeTile) -> bool:
    """Whether `programs` programs of `tile` all fit in the SMs' slots at once."""
    return programs <= slots(tile)


def longest_first_block(batch: int, programs: int, tile: DecodeTile) -> int:
    """SORT_B for `longest_first`: the batch padded to a power of two, or 0 (the grid's own order) for a
    batch of one or more than LONGEST_FIRST_MAX_BATCH sequences, and for a grid of `programs` of `tile`
    that fits in `one_wave`: the order in which programs start matters only when some must wait for a
    slot, and the sort delays every program's first load."""
    if batch < 2 or batch > LONGEST_FIRST_MAX_BATCH or one_wave(programs, tile):
        return 0
    return runtime.next_power_of_2(batch)


@triton.jit
def longest_first(SEQLENS, BATCH, CAPACITY, H_KV, NUM_SPLITS, position, SORT_B: tl.constexpr):
    """(sequence, kv head, split, its length) of the program at `position` of the launch order: the
    sequences by length, longest first (ties: lower index first), each one's NUM_SPLITS x H_KV programs
    together. The GPU starts programs roughly in that order, so the longest pieces start first and the
    shortest fill the SMs at the end (the longest-processing-time rule of scheduling): in the grid's own
    order a long sequence's last slices could start after nearly everything else had finished.
    Sorting packs (length, index) into one int64 key per sequence, so the length comes with the answer
    (no second load)."""
    offs = tl.arange(0, SORT_B)
    n = tl.load(SEQLENS + offs, mask=offs < BATCH, other=0)
    n = tl.minimum(tl.maximum(n, 0), CAPACITY).to(tl.int64)
    key = tl.where(offs < BATCH, n * SORT_B + (SORT_B - 1 - offs), -1)
    key = tl.sort(key, descending=True)
    per_sequence = H_KV * NUM_SPLITS
    chosen = tl.sum(tl.where(offs == position // per_sequence, key, 0), 0)
    b = SORT_B - 1 - chosen % SORT_B
    within = position % per_sequence
    return b.to(tl.int64), (within % H_KV).to(tl.int64), within // H_KV, (chosen // SORT_B).to(tl.int32)
