"""Sweep fixed launch configurations of course_lib's forward kernel, TMA loads on and off (GPU only).

    COURSE_DEVICE=cuda python3 scripts/forward_sweep.py [--workers 14] [--ns 1024,4096,16384]

1. Compiles every (configuration, TMA on/off, d, causal) in parallel worker processes.
2. Checks each against SDPA's output on a ragged shape (N_Q = 1000, N_K = 1531) and on the standard
   shape, then times it with `triton.testing.do_bench` on the standard shapes (bf16, B·N = 16384,
   H·d = 2048), next to SDPA's FLASH_ATTENTION and default backends, in one run.
Prints, per cell, the best configuration with and without TMA, and the geometric mean of the best
forward over SDPA's default backend; candidates for `forward.GPU_FWD_CANDIDATES` come from here.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import time

os.environ.setdefault("COURSE_DEVICE", "cuda")

TOKENS, HIDDEN = 16384, 2048
# (BLOCK_M, BLOCK_N, num_warps, num_stages)
CONFIGS = [
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (128, 128, 8, 2),
    (128, 128, 8, 3),
    (128, 128, 8, 4),
    (64, 64, 4, 3),
    (64, 64, 4, 2),
    (64, 128, 4, 3),
    (128, 64, 4, 3),
    (128, 64, 4, 4),
    (128, 32, 4, 4),
]
POINTER_CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3)]


def jobs():
    out = []
    for d in (64, 128):
        for causal in (False, True):
            out += [(d, causal, cfg, True) for cfg in CONFIGS]
            out += [(d, causal, cfg, False) for cfg in POINTER_CONFIGS]
    return out


def _config(cfg, tma):
    m, n, w, s = cfg
    return dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s, tma=tma)


def _compile(job):
    import torch

    from course_lib.attention import forward as F

    d, causal, cfg, tma = job
    q, k, v = (torch.randn(1, HIDDEN // d, 1024, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    try:
        F.forward(q, k, v, causal, None, config=_config(cfg, tma))
        torch.cuda.synchronize()
    except Exception as exc:
        return f"{job}: {type(exc).__name__}: {str(exc)[:200]}"
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--ns", default="1024,2048,4096,8192,16384")
    args = ap.parse_args()
    t0 = time.time()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        errors = [e for e in pool.map(_compile, jobs(), chunksize=1) if e]
    print(f"compiled {len(jobs())} jobs in {time.time() - t0:.0f} s; errors: {len(errors)}", flush=True)
    for e in errors:
        print("  ", e)

    import torch
    import torch.nn.functional as Fn
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from course_lib.attention import forward as F
    from course_lib.perf.timing import attention_flops
    from course_lib.runtime import triton

    bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")  # noqa: E731

    # Correctness on a ragged shape, TMA path (contiguous) and pointer path (transposed view).
    bad = []
    for d in (64, 128, 80):
        for causal in (False, True):
            q = torch.randn(2, 3, 1000, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(2, 3, 1531, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            ref = Fn.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
            for cfg in CONFIGS[:3] + CONFIGS[5:6]:
                for tma in (True, False):
                    o, _ = F.forward(q, k, v, causal, None, config=_config(cfg, tma))
                    err = float((o.float() - ref).abs().max())
                    if not err < 2e-2:
                        bad.append(f"ragged d={d} causal={causal} {cfg} tma={tma}: {err}")
            qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, N, d) view with N outermost
            o, _ = F.forward(qt, k, v, causal, None)
            if not float((o.float() - ref).abs().max()) < 2e-2:
                bad.append(f"ragged transposed d={d} causal={causal}")
    print("ragged checks:", "ok" if not bad else bad, flush=True)
    print(
        "use_tma on contiguous:",
        F.use_tma(q, k, v),
        "on a misaligned slice:",
        F.use_tma(q[..., 1:41]),
        flush=True,
    )

    rows = []
    for d in (64, 128):
        for causal in (False, True):
            for n in map(int, args.ns.split(",")):
                b, h = TOKENS // n, HIDDEN // d
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = attention_flops(b, h, n, n, d, causal)
                tf = lambda ms: flops / ms * 1e-9  # noqa: B023,E731
                ref = Fn.scaled_dot_product_attention(q, k, v, is_causal=causal).float()
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    flash = tf(bench(lambda: Fn.scaled_dot_product_attention(q, k, v, is_causal=causal)))  # noqa: B023
                default = tf(bench(lambda: Fn.scaled_dot_product_attention(q, k, v, is_causal=causal)))  # noqa: B023
                res = {}
                for _, _, cfg, tma in [j for j in jobs() if j[0] == d and j[1] == causal]:
                    c = _config(cfg, tma)
                    try:
                        o, _ = F.forward(q, k, v, causal, None, config=c)
                        err = float((o.float() - ref).abs().max())
                        if not err < 2e-2:
                            bad.append(f"d={d} causal={causal} N={n} {cfg} tma={tma}: {err}")
                        res[(cfg, tma)] = tf(bench(lambda c=c: F.forward(q, k, v, causal, None, config=c)))  # noqa: B023
                    except Exception as exc:
                        res[(cfg, tma)] = float("nan")
                        print(f"  {cfg} tma={tma}: {type(exc).__name__} {str(exc)[:100]}")
                best_t = max((v_, c) for (c, t), v_ in res.items() if t and v_ == v_)
                best_p = max((v_, c) for (c, t), v_ in res.items() if not t and v_ == v_)
                rows.append((d, causal, n, flash, default, best_t, best_p, res))
                print(
                    f"d={d:3d} causal={int(causal)} N={n:5d} | flash {flash:4.0f} default {default:4.0f} | "
                    f"TMA best {best_t[0]:4.0f} {best_t[1]} ({best_t[0] / default:.2f}x dflt) | "
                    f"pointer best {best_p[0]:4.0f} {best_p[1]} ({best_p[0] / default:.2f}x)",
                    flush=True,
                )
                print("    " + "  ".join(f"{c[0]}x{c[1]}w{c[2]}s{c[3]}{'T' if t else 'P'}:{v_:.0f}"
                                         for (c, t), v_ in res.items()), flush=True)  # fmt: skip
                torch.cuda.empty_cache()
    gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
    print(f"geomean best-TMA / default: {gm([r[5][0] / r[4] for r in rows]):.3f}")
    print(f"geomean best-pointer / default: {gm([r[6][0] / r[4] for r in rows]):.3f}")
    print(f"geomean best-any / default: {gm([max(r[5][0], r[6][0]) / r[4] for r in rows]):.3f}")
    print(f"min best-any / flash: {min(max(r[5][0], r[6][0]) / r[3] for r in rows):.3f}")
    # How good is one fixed list of candidates? The best of each candidate subset, per cell.
    for cfg in CONFIGS:
        share = [r[7].get((cfg, True), 0) / max(r[5][0], r[6][0]) for r in rows]
        mean = sum(share) / len(share)
        print(f"  {cfg} TMA: {min(share):.2f}-{max(share):.2f} of each cell's best (mean {mean:.2f})")
    print("errors:", bad or "none")
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
