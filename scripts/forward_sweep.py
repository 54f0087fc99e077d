"""Sweep fixed launch configurations of course_lib's Triton forward kernel (GPU only).

    COURSE_DEVICE=cuda python3 scripts/forward_sweep.py [--workers 14] [--ns 1024,4096,16384] [--extra]

`course_lib.attention.configs.FORWARD` holds the forward's launch configurations: `candidates` (what the
autotuner times with COURSE_AUTOTUNE=1) and `choose` (the rule used without autotuning). This script is
how to revisit both on a new GPU:

1. Compiles every configuration (FORWARD.candidates, and EXTRA with --extra) for d in {64, 128}, causal
   and not, in parallel worker processes; Triton's on-disk cache then serves the main process.
2. Checks each against the float64 reference on a ragged shape (Nq = 1000, Nk = 1531, d in {64, 80, 128}).
3. Times each, as a fixed launch (`attention_forward(..., config=...)`), on the standard shapes (bf16,
   B * N = 16384, H * d = 2048) next to SDPA's FLASH_ATTENTION and default backends, in one run
   (`course_lib.perf.timing.benchmark`: `triton.testing.do_bench`, median).

Prints per cell the best configuration and `FORWARD.choose`'s pick; then the geometric means over SDPA's
default backend and, per configuration, its share of each cell's best. Every launch here is the Triton
kernel (config hopper=False); the Gluon forward of Hopper GPUs is swept by scripts/hopper_ws_forward.py.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

os.environ.setdefault("COURSE_DEVICE", "cuda")

TOKENS, HIDDEN = 16384, 2048
# Configurations outside FORWARD.candidates worth a look on a new GPU: (BLOCK_M, BLOCK_N, warps, stages).
EXTRA = [(128, 128, 8, 2), (128, 128, 8, 4), (64, 128, 4, 3), (128, 64, 4, 4), (128, 32, 4, 4)]


def launches(extra: bool) -> list[tuple[int, int, int, int]]:
    """The configurations to sweep, as (BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    from course_lib.attention import configs

    out = [tuple(c.as_list()) for c in configs.FORWARD.candidates]
    return out + [c for c in EXTRA if c not in out] if extra else out


def config(launch: tuple[int, int, int, int]) -> dict:
    """The `config` dict of `attention_forward` for one fixed launch of the Triton kernel."""
    block_m, block_n, warps, stages = launch
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, hopper=False)


def name(launch) -> str:
    return "{}x{}w{}s{}".format(*launch)


def _compile(job):
    """Worker: compile one (d, causal, launch) by running it once; an error message, or None."""
    import torch

    from course_lib.attention import attention_forward

    d, causal, launch = job
    q, k, v = (torch.randn(1, HIDDEN // d, 1024, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    try:
        attention_forward(q, k, v, causal, config=config(launch))
        torch.cuda.synchronize()
    except Exception as exc:
        return f"d={d} causal={causal} {name(launch)}: {type(exc).__name__}: {str(exc)[:200]}"
    return None


def check(sweep) -> list[str]:
    """Every launch against the float64 reference on ragged shapes; returns what failed."""
    import torch

    from course_lib.attention import attention_forward, reference

    bad = []
    for d in (64, 128, 80):
        for causal in (False, True):
            q = torch.randn(2, 3, 1000, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(2, 3, 1531, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            ref = reference.attention(q.double(), k.double(), v.double(), causal)
            for launch in sweep:
                try:
                    o, _ = attention_forward(q, k, v, causal, config=config(launch))
                except Exception as exc:  # reported with the compile errors already
                    bad.append(f"ragged d={d} causal={causal} {name(launch)}: {type(exc).__name__}")
                    continue
                err = float((o.double() - ref).abs().max())
                if not err < 2e-2:
                    bad.append(f"ragged d={d} causal={causal} {name(launch)}: max error {err:.3g}")
    return bad


def measure_cell(d: int, causal: bool, n: int, sweep) -> tuple | None:
    """Time SDPA (FLASH_ATTENTION and default backends) and every launch of `sweep` on one standard cell;
    print the cell and return (d, causal, n, flash, default, {launch: TFLOP/s}, best, chosen), TFLOP/s
    by the papers' convention; None if no launch ran."""
    import torch
    import torch.nn.functional as Fn
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from course_lib.attention import attention_forward, configs
    from course_lib.perf.timing import attention_flops, benchmark, free_memory

    b, h = TOKENS // n, HIDDEN // d
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = attention_flops(b, h, n, n, d, causal)

    def tflops(fn) -> float:
        return flops / benchmark(fn, warmup_ms=10, rep_ms=40) * 1e-9

    def ours(launch) -> float:
        c = config(launch)
        return tflops(lambda: attention_forward(q, k, v, causal, config=c))

    def sdpa():
        return Fn.scaled_dot_product_attention(q, k, v, is_causal=causal)

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        flash = tflops(sdpa)
    default = tflops(sdpa)
    res = {}
    for launch in sweep:
        try:
            res[launch] = ours(launch)
        except Exception as exc:
            print(f"  {name(launch)}: {type(exc).__name__} {str(exc)[:100]}")
    if not res:
        return None
    chosen = tuple(configs.FORWARD.choose(d, causal, n, torch.bfloat16, interpret=False).as_list())
    if chosen not in res:
        res[chosen] = ours(chosen)
    best = max(res, key=res.get)
    print(
        f"d={d:3d} causal={int(causal)} N={n:5d} | flash {flash:4.0f} default {default:4.0f} | "
        f"best {name(best)} {res[best]:4.0f} ({res[best] / default:.2f}x default) | "
        f"choose {name(chosen)} {res[chosen]:4.0f} ({res[chosen] / res[best]:.2f} of best)",
        flush=True,
    )
    print("    " + "  ".join(f"{name(c)}:{x:.0f}" for c, x in res.items()), flush=True)
    free_memory()
    return (d, causal, n, flash, default, res, best, chosen)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=14, help="compiling processes")
    ap.add_argument("--ns", default="1024,2048,4096,8192,16384", help="sequence lengths of the timed cells")
    ap.add_argument("--extra", action="store_true", help="also sweep EXTRA, beyond FORWARD.candidates")
    args = ap.parse_args()

    import course_lib
    from course_lib.bench import summarise

    if not course_lib.ON_GPU:
        raise SystemExit("forward_sweep.py needs a CUDA GPU (COURSE_DEVICE=cuda)")
    t0 = time.time()
    sweep = launches(args.extra)
    jobs = [(d, causal, launch) for d in (64, 128) for causal in (False, True) for launch in sweep]
    with mp.get_context("spawn").Pool(args.workers) as pool:
        errors = [e for e in pool.map(_compile, jobs, chunksize=1) if e]
    print(f"compiled {len(jobs)} jobs in {time.time() - t0:.0f} s; errors: {len(errors)}", flush=True)
    for e in errors:
        print("  ", e)

    bad = check(sweep)
    print("ragged checks:", "ok" if not bad else bad, flush=True)

    rows = []
    for d in (64, 128):
        for causal in (False, True):
            for n in map(int, args.ns.split(",")):
                row = measure_cell(d, causal, n, sweep)
                if row is not None:
                    rows.append(row)
    if rows:
        print(f"geomean best / SDPA default: {summarise([r[5][r[6]] / r[4] for r in rows])[1]:.3f}")
        print(f"geomean choose / SDPA default: {summarise([r[5][r[7]] / r[4] for r in rows])[1]:.3f}")
        print(f"min best / SDPA FLASH: {min(r[5][r[6]] / r[3] for r in rows):.3f}")
        # How good is each configuration alone? Its share of each cell's best.
        for launch in sweep:
            share = [r[5].get(launch, 0.0) / r[5][r[6]] for r in rows]
            mean = sum(share) / len(share)
            print(
                f"  {name(launch)}: {min(share):.2f}-{max(share):.2f} of each cell's best (mean {mean:.2f})"
            )
    print("errors:", errors + bad or "none")
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
