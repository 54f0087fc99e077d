"""Grouped-query attention against the same call on repeated K/V, forward + backward, on the standard cells.

For every cell of `make bench`'s grid (course_lib.bench.shapes.standard_cells) with 4x fewer K/V heads
than query heads: course_lib.flash_attention(q, k, v) with k, v of H/4 heads, against the same call with
k, v repeated to H heads beforehand (the repeat itself not timed). Prints the time of each and their ratio.

    COURSE_DEVICE=cuda python3 scripts/gqa_speed.py [--out file.json]
"""

from __future__ import annotations

import argparse
import json

import torch

import course_lib
from course_lib.bench import summarise
from course_lib.bench.shapes import standard_cells
from course_lib.perf.timing import benchmark


def fwd_bwd(q, k, v, causal):
    def run():
        for t in (q, k, v):
            t.grad = None
        o = course_lib.flash_attention(q, k, v, causal=causal)
        o.backward(do_cache[o.shape])

    return run


do_cache: dict = {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--group", type=int, default=4, help="query heads per K/V head")
    args = parser.parse_args()
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
        gqa = benchmark(fwd_bwd(q, k, v, causal))
        rep = benchmark(fwd_bwd(q, k_rep, v_rep, causal))
        rows.append(dict(cell, hkv=hkv, gqa_ms=gqa, repeated_ms=rep, ratio=rep / gqa))
        print(
            f"d={d} causal={causal!s:5} N={N:5}: GQA {gqa:.3f} ms, repeated K/V {rep:.3f} ms, {rep / gqa:.2f}x"
        )
    low, geomean = summarise(r["ratio"] for r in rows)
    print(f"repeated / GQA time: min {low:.2f}x, geomean {geomean:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
