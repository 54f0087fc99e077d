"""How many splits of the K/V cache a decoding step uses, and the tile sizes per head dim (notebook 09).

Decoding has one program per (sequence, kv head, split): at batch 1 with 8 kv heads that is 8 programs
for a GPU of 132 SMs unless the cache is split. FlashAttention-2's rule, written out here:
- one split when the programs without splitting already fill 80 % of the SMs;
- otherwise, among 1..min(128, SMs, key blocks) splits, the fewest whose wave efficiency
  (programs / (SMs x waves), waves rounded up) is within 85 % of the best one, skipping a count that
  leaves the blocks per split unchanged from the count before it (more programs, same work each).
FlashAttention-3 also never splits a cache of <= 4 key blocks; so do we.

Every input is a shape (batch, heads, cache capacity), never a length's value: the choice, and so the
grid, stays fixed for a batch shape, which CUDA-graph replay needs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .. import runtime

# Stand-in SM count under the interpreter, so that the CPU path splits as a mid-size GPU would.
CPU_SM_COUNT = 16


@dataclass(frozen=True)
class DecodeTile:
    """Launch sizes of the split-KV kernel for one head dim: BLOCK_N keys per step of the inner loop,
    at most BLOCK_M_MAX (query token x head) rows per program, warps and pipeline stages."""

    BLOCK_N: int
    BLOCK_M_MAX: int
    num_warps: int
    num_stages: int


# Named per head dim (padded to a power of two). Decoding is bandwidth-bound: BLOCK_N sets how many
# bytes one iteration has in flight (BLOCK_N x d x 2 bytes for K, the same for V).
TILES = {
    16: DecodeTile(BLOCK_N=128, BLOCK_M_MAX=64, num_warps=4, num_stages=3),
    32: DecodeTile(BLOCK_N=128, BLOCK_M_MAX=64, num_warps=4, num_stages=3),
    64: DecodeTile(BLOCK_N=128, BLOCK_M_MAX=64, num_warps=4, num_stages=3),
    128: DecodeTile(BLOCK_N=64, BLOCK_M_MAX=64, num_warps=4, num_stages=3),
    256: DecodeTile(BLOCK_N=32, BLOCK_M_MAX=32, num_warps=4, num_stages=2),
}


def tile_for(head_dim: int) -> DecodeTile:
    """The DecodeTile for head dim `head_dim` (a multiple of 8 in [16, 256])."""
    return TILES[max(16, 1 << (int(head_dim) - 1).bit_length())]


@functools.cache
def sm_count(device_index: int | None = None) -> int:
    """Streaming multiprocessors of the GPU (CPU_SM_COUNT under the interpreter)."""
    if not runtime.ON_GPU:
        return CPU_SM_COUNT
    index = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_properties(index).multi_processor_count


def wave_efficiency(programs: int, num_sms: int) -> float:
    """Fraction of SM slots busy over the waves: programs / (num_sms x ceil(programs / num_sms))."""
    waves = programs / num_sms
    return waves / math.ceil(waves)


def choose_num_splits(programs: int, n_key_blocks: int, num_sms: int, max_splits: int = 128) -> int:
    """FlashAttention-2's split rule (module docstring).

    programs: programs without splitting (batch x kv heads x query tiles); n_key_blocks: BLOCK_N-key
    blocks of the cache capacity; num_sms: SMs. Returns a split count in [1, max_splits]."""
    if programs <= 0 or n_key_blocks <= 4 or programs >= 0.8 * num_sms:
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


def num_splits_for(batch: int, kv_heads: int, m_tiles: int, capacity: int, head_dim: int) -> int:
    """The split count `decode_attention` uses for a batch shape: batch, kv heads, query tiles per
    (sequence, kv head), cache capacity in keys (Nmax, or max_pages x page_size), head dim."""
    block_n = tile_for(head_dim).BLOCK_N
    return choose_num_splits(batch * kv_heads * m_tiles, math.ceil(capacity / block_n), sm_count())
