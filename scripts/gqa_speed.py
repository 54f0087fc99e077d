"""Grouped-query attention against the same call on repeated K/V, forward + backward, on the standard cells.

For every cell of `make bench`'s grid (course_lib.bench.shapes.standard_cells) with 4x fewer K/V heads
than query heads: course_lib.flash_attention(q, k, v) with k, v of H/4 heads, against the same call with
k, v repeated to H heads beforehand (the repeat itself not timed), and against the call a model without
grouped-query support makes: k, v repeated inside the timed call (`repeat_interleave` in the autograd
graph, as transformers' `repeat_kv`; its backward sums dK, dV over the copies). Prints the median time
of each over --passes timings, each call first in turn (single timings vary by 1-2 % over a run),
the ratios to the grouped call, and the first ratio of each pass. --graphs times CUDA-graph replays of
each forward + backward instead: the GPU's work alone, without the CPU's launch cost, which at 1k keys
is about as long as the GPU's work and makes plain timings vary (notes/attention.md, "Open").

    COURSE_DEVICE=cuda python3 scripts/gqa_speed.py [--out file.json]

--backward-modes: for the causal cells, the backward alone of the three ways the dK/dV kernel can sum
a group (`attention.backward.dkdv_heads_per_program`, `dkdv_block_major`): one query head per program
plus fp32 partial sums; two heads per program on chip plus partials of the pairs, head-major and
block-major; the whole group on chip, head-major and block-major; and the same backward on repeated K/V.
--modes-only skips the forward + backward comparison. Both time the Triton dK/dV kernel (on a Hopper GPU
the backward runs the Gluon one where `attention.hopper_backward.choose` picks it).

--tune: for every cell whose dK/dV programs sum several query heads on chip, time the backward alone
with each of the dK/dV kernel's candidates (`configs.DKDV.candidates`; three interleaved passes, best
time) and record the fastest as this GPU's choice for that grouped-query shape class
(`launch.record_choice`, course_lib/attention/tuned/<gpu>.json); the forward + backward comparison then
runs with the recorded choices.
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial

import torch
from triton.runtime.errors import OutOfResources

import course_lib
from course_lib.attention import backward as attention_backward
from course_lib.attention import launch as attention_launch
from course_lib.attention.configs import DKDV
from course_lib.attention.forward import forward as attention_forward
from course_lib.bench import summarise
from course_lib.bench.shapes import standard_cells
from course_lib.perf.timing import benchmark, graph_ms, interleaved


def fwd_bwd(q, k, v, causal, repeat: int = 1):
    """One forward + backward; repeat > 1: k and v repeated that many times inside the call."""

    def run():
        for t in (q, k, v):
            t.grad = None
        kk, vv = (k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)) if repeat > 1 else (k, v)
        o = course_lib.flash_attention(q, kk, vv, causal=causal)
        o.backward(do_cache[o.shape])

    return run


do_cache: dict = {}
# The group-summing modes and --tune concern the Triton dK/dV kernel: keep it on a Hopper GPU too, where
# the backward would otherwise run the Gluon one (`attention.hopper_backward.choose`).
TRITON = {"hopper": False}


BACKWARD_MODES = {  # name -> (query heads summed on chip: None = the whole group, block-major)
    "partials": (1, False),
    "pairs + partials, head-major": (2, False),
    "pairs + partials, block-major": (2, True),
    "on chip, head-major": (None, False),
    "on chip, block-major": (None, True),
}


def backward_modes(group: int) -> None:
    """Time the backward alone for each way of summing a group (module docstring), causal cells."""
    heads_rule, order_rule = attention_backward.dkdv_heads_per_program, attention_backward.dkdv_block_major
    try:
        for cell in standard_cells():
            B, H, N, d = cell["B"], cell["H"], cell["N"], cell["d"]
            if not cell["causal"]:
                continue
            q = torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(B, H // group, N, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
            do = torch.randn_like(q)
            k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            o, lse = attention_forward(q, k_rep, v_rep, causal=True)
            times = {
                "repeated K/V": benchmark(
                    partial(attention_backward.backward, do, q, k_rep, v_rep, o, lse, True, config=TRITON)
                )
            }
            o, lse = attention_forward(q, k, v, causal=True)
            grouped = partial(attention_backward.backward, do, q, k, v, o, lse, True, config=TRITON)
            for name, (on_chip, block_major) in BACKWARD_MODES.items():
                if on_chip is not None and group % on_chip:
                    continue
                attention_backward.dkdv_heads_per_program = lambda g, c, n, d, on_chip=on_chip: (
                    g if on_chip is None else on_chip
                )
                attention_backward.dkdv_block_major = lambda heads, c, block_major=block_major: block_major
                times[name] = benchmark(grouped)
            print(f"backward d={d} N={N:5}: " + ", ".join(f"{n} {t * 1e3:.0f} us" for n, t in times.items()))
    finally:
        attention_backward.dkdv_heads_per_program, attention_backward.dkdv_block_major = (
            heads_rule,
            order_rule,
        )


def tune(group: int, passes: int = 3) -> None:
    """Record the fastest dK/dV launch of each grouped-query shape class of the grid (module docstring)."""
    for cell in standard_cells():
        B, H, N, d, causal = cell["B"], cell["H"], cell["N"], cell["d"], cell["causal"]
        on_chip = attention_backward.dkdv_heads_per_program(group, causal, N, d)
        if on_chip == 1:  # one query head per program: the multi-head kernel's own choice
            continue
        q = torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, H // group, N, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        do = torch.randn_like(q)
        o, lse = attention_forward(q, k, v, causal=causal)
        run = partial(attention_backward.backward, do, q, k, v, o, lse, causal, config=TRITON)
        shape = attention_backward.dkdv_shape_class(N, N, d, causal, q.dtype, False, on_chip)
        best: dict = {}
        for _ in range(passes):
            for config in DKDV.candidates:
                with attention_launch.trying(DKDV, shape, config):
                    try:
                        ms = benchmark(run, warmup_ms=10, rep_ms=60)
                    except OutOfResources:  # a launch this GPU cannot run (shared memory): not a candidate
                        continue
                best[config] = min(ms, best.get(config, float("inf")))
        fastest = min(best, key=best.get)
        attention_launch.record_choice(DKDV.name, attention_launch.shape_key(shape), fastest)
        ranked = sorted(best, key=best.get)[:3]
        print(
            f"d={d} causal={causal!s:5} N={N:5}: recorded {fastest.as_list()}; "
            + ", ".join(f"{c.as_list()} {best[c] * 1e3:.0f} us" for c in ranked)
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--group", type=int, default=4, help="query heads per K/V head")
    parser.add_argument("--backward-modes", action="store_true", help="also compare the group-summing modes")
    parser.add_argument("--modes-only", action="store_true", help="only the group-summing modes")
    parser.add_argument("--tune", action="store_true", help="record the fastest grouped dK/dV launches first")
    parser.add_argument(
        "--passes", type=int, default=4, help="timings of each call per cell, each first in turn"
    )
    parser.add_argument(
        "--graphs", action="store_true", help="time CUDA-graph replays (the GPU's work alone)"
    )
    args = parser.parse_args()
    timer = graph_ms if args.graphs else benchmark
    if args.tune:
        tune(args.group)
    if args.modes_only:
        backward_modes(args.group)
        return 0
    rows = []
    for cell in standard_cells():
        B, H, N, d, causal = cell["B"], cell["H"], cell["N"], cell["d"], cell["causal"]
        hkv = H // args.group
        q, k, v = (
            torch.randn(B, h, N, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for h in (H, hkv, hkv)
        )
        k_rep, v_rep = (t.detach().repeat_interleave(args.group, 1).requires_grad_(True) for t in (k, v))
        do_cache[q.shape] = torch.randn_like(q)
        calls = {
            "gqa": fwd_bwd(q, k, v, causal),
            "rep": fwd_bwd(q, k_rep, v_rep, causal),
            "rep_in_call": fwd_bwd(q, k, v, causal, repeat=args.group),
        }
        times = interleaved(calls, args.passes, timer)  # timings drift by 1-2 % over a run
        gqa, rep, rep_in_call = (statistics.median(times[name]) for name in calls)
        rows.append(
            dict(
                cell, hkv=hkv, gqa_ms=gqa, repeated_ms=rep, repeat_in_call_ms=rep_in_call,
                ratio=rep / gqa, ratio_repeat_in_call=rep_in_call / gqa,
            )
        )  # fmt: skip
        spread = ", ".join(f"{r / g:.3f}" for g, r in zip(times["gqa"], times["rep"]))
        print(
            f"d={d} causal={causal!s:5} N={N:5}: GQA {gqa:.3f} ms, repeated K/V {rep:.3f} ms, {rep / gqa:.3f}x"
            f" (passes: {spread}); repeated in the call {rep_in_call:.3f} ms, {rep_in_call / gqa:.3f}x"
        )
    timed = "CUDA-graph replays" if args.graphs else "plain launches"
    for key, what in (("ratio", "repeated K/V"), ("ratio_repeat_in_call", "repeated in the call")):
        low, geomean = summarise(r[key] for r in rows)
        print(
            f"{what} / GQA time ({timed}, medians of {args.passes} passes): min {low:.3f}x, geomean {geomean:.3f}x"
        )
    if args.backward_modes:
        backward_modes(args.group)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
