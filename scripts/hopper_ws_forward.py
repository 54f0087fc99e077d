"""Sweep of course_lib's warp-specialised Hopper forward (`course_lib/flash_triton/hopper.py`).

    COURSE_DEVICE=cuda python3 scripts/hopper_ws_forward.py [--ns 1024,4096,16384]

Checks every variant below against a float32 reference (ragged, causal, Nq != Nk, bf16 and fp16),
then times each on the standard shapes next to SDPA's default backend (cuDNN on an H200) and the
Triton forward (`forward.forward(..., config={"hopper": False})`), all in the same run. What it
measured, and how `hopper.choose` follows from it: notes/performance.md, "Fourth round".
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("COURSE_DEVICE", "cuda")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as Fn  # noqa: E402
import triton  # noqa: E402

from course_lib.flash_triton import hopper  # noqa: E402

# (BLOCK_N, NUM_STAGES, NUM_CONSUMERS, PINGPONG, PERSISTENT) per head dim.
# Shared memory: (NUM_CONSUMERS * 64 + 2 * NUM_STAGES * BLOCK_N) * d * 2 bytes, at most ~227 KB.
VARIANTS = {
    128: [(128, 3, 2, True, False), (128, 3, 2, True, True), (128, 3, 2, False, False), (128, 3, 2, False, True)],
    64: [(128, 3, 3, True, True), (128, 3, 3, False, True), (128, 3, 3, True, False), (128, 4, 2, True, True)],
}


def attention(q, k, v, causal: bool, variant):
    """(O, L) of contiguous q (B, H, Nq, d), k, v (B, H, Nk, d) with one variant of the kernel."""
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    hopper.forward(q, k, v, o, lse, causal, q.shape[-1] ** -0.5, variant)
    return o, lse


def check(variants) -> list[str]:
    """Every variant against a float32 reference (O and L) on ragged, causal and Nq != Nk shapes."""
    from course_lib import reference

    bad = []
    for d in (64, 128):
        for causal in (False, True):
            for nq, nk in [(1000, 1531), (1024, 1024), (77, 300), (300, 77), (4096, 4096), (130, 130)]:
                for dt in (torch.bfloat16, torch.float16):
                    q = torch.randn(2, 3, nq, d, device="cuda", dtype=dt)
                    k, v = (torch.randn(2, 3, nk, d, device="cuda", dtype=dt) for _ in range(2))
                    ref, ref_l = reference.attention(q.float(), k.float(), v.float(), causal, return_lse=True)
                    for var in variants[d]:
                        o, lse = attention(q, k, v, causal, var)
                        eo, el = float((o.float() - ref).abs().max()), float((lse - ref_l).abs().max())
                        if not (eo < 2e-2 and el < 1e-3):
                            bad.append(f"d={d} causal={causal} {nq}x{nk} {dt} {var}: O {eo:.3g} L {el:.3g}")
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="1024,2048,4096,8192,16384")
    args = ap.parse_args()
    from course_lib.flash_triton import forward as F

    t0 = time.time()
    bad = check(VARIANTS)
    print("correctness:", "ok" if not bad else bad[:12], f"({time.time() - t0:.0f} s)", flush=True)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")  # noqa: E731
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            for n in map(int, args.ns.split(",")):
                b, h = 16384 // n, 2048 // d
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
                tf = lambda ms: flops / ms * 1e-9  # noqa: B023,E731
                default = tf(bench(lambda: Fn.scaled_dot_product_attention(q, k, v, is_causal=causal)))  # noqa: B023
                ours = tf(bench(lambda: F.forward(q, k, v, causal, config={"hopper": False})))  # noqa: B023
                res = {t: tf(bench(lambda t=t: attention(q, k, v, causal, t))) for t in VARIANTS[d]}  # noqa: B023
                rows.append((d, default, ours, res, hopper.choose(d, causal, n, n)))
                print(
                    f"d={d:3d} causal={int(causal)} N={n:5d} | SDPA default {default:4.0f} | Triton {ours:4.0f} "
                    f"({ours / default:.2f}x) | WS " + " ".join(f"{t}:{x:4.0f}" for t, x in res.items()),
                    flush=True,
                )
    gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
    chosen = [r[3].get(r[4], r[2]) / r[1] for r in rows]
    print(f"geomean over SDPA default: Triton {gm([r[2] / r[1] for r in rows]):.3f}, "
          f"best WS per cell {gm([max(r[3].values()) / r[1] for r in rows]):.3f}, "
          f"hopper.choose's pick (Triton where None) {gm(chosen):.3f}")  # fmt: skip
    for d in (64, 128):
        for t in VARIANTS[d]:
            print(f"  d={d} {t}: {gm([r[3][t] / r[1] for r in rows if r[0] == d]):.3f} of SDPA default")
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
