"""Sweep the split-KV decode kernel's tile (BLOCK_N, stages, warps) and split count per cell against
cuDNN and a plain read of the same bytes; the fastest settings fill course_lib/decode/heuristics.py.

bf16, 32 query / 8 kv heads, d = 128, one new token, every time a CUDA-graph replay. For each tile the
split counts tried are the rule's own (`heuristics.num_splits_for` with that tile), half, 2x, 4x and
8x it, and 1, 2, 4. Prints, per cell, the library's current choice and the five fastest settings.

    COURSE_DEVICE=cuda python3 scripts/decode_sweep.py
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from course_lib import runtime
from course_lib.decode import decode_attention, heuristics
from course_lib.decode.heuristics import DecodeTile, num_splits_for
from course_lib.perf.ceilings import measure_read_bandwidth, measure_read_time
from course_lib.perf.timing import benchmark, graphed

HQ, HKV, D = 32, 8, 128
CELLS = [(8, 8192), (1, 65536), (64, 4096), (256, 1024), (1, 131072), (1, 8192), (16, 32768)]
TILES = {  # name -> (BLOCK_N, warps, stages): shared memory 2 x stages x BLOCK_N x d x 2 bytes
    "128/8w/3s": (128, 8, 3),
    "128/8w/2s": (128, 8, 2),
    "128/8w/4s": (128, 8, 4),
    "64/4w/3s": (64, 4, 3),
    "64/8w/3s": (64, 8, 3),
    "64/4w/2s": (64, 4, 2),
    "64/4w/4s": (64, 4, 4),
}


def graph_us(fn) -> float:
    replay = graphed(fn)
    return benchmark(replay) * 1e3


def main() -> int:
    if not runtime.ON_GPU:
        raise SystemExit("decode_sweep.py times GPU kernels: run it with COURSE_DEVICE=cuda on a GPU")
    read_gbps = measure_read_bandwidth(dtype=torch.bfloat16)
    print(f"read ceiling {read_gbps:.0f} GB/s; bf16; CUDA-graph replays")
    usual = heuristics.TILES[D]
    for B, N in CELLS:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(B, N, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        lengths = torch.full((B,), N, dtype=torch.int32, device="cuda")
        nbytes = 2 * B * N * HKV * D * 2
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        def cudnn(qt=qt, kt=kt, vt=vt):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

        sdpa_us = graph_us(cudnn)
        floor_us = measure_read_time(nbytes) * 1e3
        current_us = graph_us(partial(decode_attention, q, k, v, lengths, validate=False))
        results = []
        try:
            for name, (block_n, warps, stages) in TILES.items():
                heuristics.TILES[D] = DecodeTile(
                    block_n=block_n, block_m_max=usual.block_m_max, num_warps=warps, num_stages=stages
                )
                rule = num_splits_for(B, HKV, 1, N, D)
                for splits in sorted({max(1, rule // 2), rule, 2 * rule, 4 * rule, 8 * rule, 1, 2, 4}):
                    if splits <= 256 and splits * block_n <= N:
                        call = partial(decode_attention, q, k, v, lengths, num_splits=splits, validate=False)
                        results.append((graph_us(call), f"{name} splits {splits}"))
        finally:
            heuristics.TILES[D] = usual
        print(f"B={B} N={N} ({nbytes / 1e6:.0f} MB): cuDNN {sdpa_us:.1f} us, same-size read {floor_us:.1f} us "
              f"({nbytes / floor_us / 1e3 / read_gbps:.0%} of the ceiling), library {current_us:.1f} us "
              f"({sdpa_us / current_us:.3f}x cuDNN)")  # fmt: skip
        for us, name in sorted(results)[:5]:
            print(
                f"    {name:24s} {us:8.1f} us  {sdpa_us / us:.3f}x cuDNN  {nbytes / us / 1e3 / read_gbps:.0%} read"
            )
        del q, k, v
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
