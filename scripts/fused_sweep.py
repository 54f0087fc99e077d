"""Sweep the launch settings of the fused RMSNorm and RoPE kernels; the fastest settings fill the tables
in course_lib/fused/launch.py.

Every setting goes through the library's own keyword overrides (`rms_norm_forward(rows=, warps=,
chunk=)`, `rms_norm_backward(rows=, programs_per_sm=, warps=)`, `rope.rotate(tokens=, warps=)`) and is
timed as a CUDA-graph replay, next to torch.compile of the eager code and to a plain copy moving the
same bytes (`perf.measure_copy_time`). Prints, per cell, the table's setting and the four fastest.
--column-sum sweeps instead the tile of the backward's second dW reduction (`rms_norm_backward(column_tile=)`,
`launch.COLUMN_SUM`), timing the whole backward (its kernel, then the column sum on the partial rows it has
just written) with the table's launch.

    COURSE_DEVICE=cuda python3 scripts/fused_sweep.py [--tokens 16384 65536] [--hidden 2048 4096 8192]
    COURSE_DEVICE=cuda python3 scripts/fused_sweep.py --column-sum [--tokens ...] [--hidden ...]
"""

from __future__ import annotations

import argparse
import itertools
from functools import partial

import torch

from course_lib import runtime
from course_lib.bench.fused import (
    HEAD_DIM,
    HK,
    HQ,
    compiled_for_shape,
    eager_rope,
    llama_rms_norm,
    rms_norm_bytes,
    rope_bytes,
)
from course_lib.fused import launch
from course_lib.fused.rms_norm import rms_norm_backward, rms_norm_forward
from course_lib.fused.rope import rope_cache, rotate
from course_lib.perf.ceilings import measure_copy_bandwidth, measure_copy_time
from course_lib.perf.timing import graph_ms
from course_lib.runtime import triton


def report(what: str, nbytes: int, copy_gbps: float, compiled_ms: float | None, timings: list) -> None:
    timings = sorted((t, name) for name, t in timings if t is not None)
    table = next(t for t, name in timings if name == "table")
    floor = measure_copy_time(nbytes)
    head = f"{what}: table {table * 1e3:.1f} us ({nbytes / table / 1e6 / copy_gbps:.0%} copy ceiling"
    head += f", {floor / table:.0%} of a same-size copy"
    if compiled_ms:
        head += f", {compiled_ms / table:.3f}x compile"
    print(head + ")")
    for t, name in timings[:4]:
        vs = f", {compiled_ms / t:.3f}x compile" if compiled_ms else ""
        print(f"    {name:28s} {t * 1e3:8.1f} us  {nbytes / t / 1e6 / copy_gbps:5.0%} copy{vs}", flush=True)


def rms_inputs(tokens: int, hidden: int):
    """x (tokens, hidden), w (hidden,), dy like x: bf16 on the GPU, fresh random values."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    return x, w, torch.randn_like(x)


def sweep_rms(tokens: int, hidden: int, copy_gbps: float) -> None:
    x, w, dy = rms_inputs(tokens, hidden)
    block = triton.next_power_of_2(hidden)
    forward = partial(rms_norm_forward, x, w, 1e-6)
    fwd = [("table", graph_ms(forward))]
    for rows, warps in itertools.product((1, 2, 4), (4, 8, 16)):
        if rows * block // (warps * 32) <= 64:
            fwd.append(
                (f"rows {rows} warps {warps}", graph_ms(partial(forward, rows=rows, warps=warps, chunk=0)))
            )
    for chunk, warps in itertools.product((1024, 2048, 4096), (4, 8, 16)):
        if chunk < block:
            fwd.append((f"chunk {chunk} warps {warps}", graph_ms(partial(forward, warps=warps, chunk=chunk))))
    compiled = compiled_for_shape(llama_rms_norm)
    nbytes = rms_norm_bytes(tokens, hidden, "fwd")
    report(f"RMSNorm fwd T={tokens} D={hidden}", nbytes, copy_gbps, graph_ms(partial(compiled, x, w)), fwd)
    _, rstd = rms_norm_forward(x, w, 1e-6)
    backward = partial(rms_norm_backward, dy, x, w, rstd)
    bwd = [("table", graph_ms(backward))]
    for per_sm, rows, warps in itertools.product((1, 2, 4), (1, 2, 4), (4, 8, 16)):
        if rows * block // (warps * 32) <= 64:
            setting = dict(rows=rows, programs_per_sm=per_sm, warps=warps)
            bwd.append((f"per SM {per_sm} rows {rows} warps {warps}", graph_ms(partial(backward, **setting))))
    nbytes = rms_norm_bytes(tokens, hidden, "bwd")
    report(f"RMSNorm bwd kernels T={tokens} D={hidden}", nbytes, copy_gbps, None, bwd)


def sweep_column_sum(tokens: int, hidden: int, copy_gbps: float) -> None:
    x, w, dy = rms_inputs(tokens, hidden)
    _, rstd = rms_norm_forward(x, w, 1e-6)
    backward = partial(rms_norm_backward, dy, x, w, rstd)
    runs = [("table", graph_ms(backward)), ("torch.sum", graph_ms(partial(backward, dw_sum="torch")))]
    tiles = {
        f"tile {block_r} x {block_c} warps {warps}": launch.ColumnSumTile(block_r, block_c, warps)
        for block_r, block_c, warps in itertools.product(
            (64, 128, 256, 512, 1024), (4, 8, 16, 32, 64), (2, 4, 8, 16)
        )
        if 1 <= block_r * block_c // (warps * 32) <= 64 and block_c <= hidden  # values per thread
    }
    runs += [(name, graph_ms(partial(backward, column_tile=tile))) for name, tile in tiles.items()]
    best = sorted((t, name) for name, t in runs if t is not None)[:3]
    for _, name in best:  # the fastest three again, next to the table's: one timing can be 1-2 % off
        if name in tiles:
            runs.append((f"{name} (again)", graph_ms(partial(backward, column_tile=tiles[name]))))
    runs.append(("table (again)", graph_ms(backward)))
    nbytes = rms_norm_bytes(tokens, hidden, "bwd")
    report(f"RMSNorm bwd + column sum T={tokens} D={hidden}", nbytes, copy_gbps, None, runs)


def sweep_rope(tokens: int, copy_gbps: float) -> None:
    q = torch.randn(tokens, HQ, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, HK, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    cos, sin = rope_cache(tokens, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    q4, k4 = q.transpose(0, 1)[None], k.transpose(0, 1)[None]  # token-major storage, (1, H, T, d) views
    forward = partial(rotate, q4, k4, cos[None], sin[None], 0, False)
    runs = [("table", graph_ms(forward))]
    for n_tokens, warps in itertools.product((1, 2, 4), (2, 4, 8)):
        runs.append(
            (f"tokens {n_tokens} warps {warps}", graph_ms(partial(forward, tokens=n_tokens, warps=warps)))
        )
    compiled = compiled_for_shape(lambda q, k: eager_rope(q, k, cos, sin))
    report(f"RoPE fwd T={tokens}", rope_bytes(tokens), copy_gbps, graph_ms(partial(compiled, q, k)), runs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--hidden", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--column-sum", action="store_true", help="sweep the dW column-sum tile only")
    args = parser.parse_args()
    if not runtime.ON_GPU:
        raise SystemExit("fused_sweep.py times GPU kernels: run it with COURSE_DEVICE=cuda on a GPU")
    copy_gbps = measure_copy_bandwidth()
    print(f"copy ceiling {copy_gbps:.0f} GB/s; bf16; CUDA-graph replays")
    for tokens in args.tokens:
        if args.column_sum:
            for hidden in args.hidden:
                sweep_column_sum(tokens, hidden, copy_gbps)
                torch.cuda.empty_cache()
            continue
        for hidden in args.hidden:
            sweep_rms(tokens, hidden, copy_gbps)
            torch.cuda.empty_cache()
        sweep_rope(tokens, copy_gbps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
