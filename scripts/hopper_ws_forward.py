"""Sweep of course_lib's warp-specialised Hopper forward (`course_lib/attention/hopper.py`).

    COURSE_DEVICE=cuda python3 scripts/hopper_ws_forward.py [--ns 1024,4096,16384]
    COURSE_DEVICE=cuda python3 scripts/hopper_ws_forward.py --passes 4 [--heads 128]
    COURSE_DEVICE=cuda python3 scripts/hopper_ws_forward.py --bottom-right 3280x32768,1024x8192 [--passes 4]
    COURSE_DEVICE=cuda python3 scripts/hopper_ws_forward.py --grids 64x1x8x4096,128x1x2x2048c   # small grids

Checks every variant below against a float32 reference (ragged, causal, Nq != Nk, bf16 and fp16,
K/V with as many heads as Q and with one: grouped-query attention), then times each on the standard
shapes next to SDPA's default backend (cuDNN on an H200) and the Triton forward
(`course_lib.attention.attention_forward(..., config={"hopper": False})`), all in the same run; the check and
the timing loop are `scripts/hopper_gluon_forward.py`'s. What it measured, and how `hopper.choose`
follows from it: notes/attention.md, "Why it is so".

With `--passes P` it times only the kernels `hopper.choose` picks between (every variant below and the
Triton forward), P times per cell, each first in turn (`perf.timing.interleaved`), and prints each
one's median TFLOP/s, the fastest, and the share of the fastest that `choose`'s pick reaches: one
timing per kernel cannot tell apart kernels a few per cent apart (notes/attention.md,
"Why it is so").
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("COURSE_DEVICE", "cuda")

import torch  # noqa: E402
import triton  # noqa: E402
from hopper_gluon_forward import check, sweep  # noqa: E402  (this script's folder)

from course_lib.attention import attention_forward, hopper  # noqa: E402
from course_lib.bench import summarise  # noqa: E402
from course_lib.perf.timing import attention_flops, benchmark, interleaved  # noqa: E402

# hopper.Variant(BLOCK_N, NUM_STAGES, NUM_CONSUMERS, PINGPONG, PERSISTENT) per head dim.
# Shared memory: (NUM_CONSUMERS * 64 + 2 * NUM_STAGES * BLOCK_N) * d * 2 bytes, at most ~227 KB.
V = hopper.Variant
VARIANTS = {
    128: [
        V(128, 3, 2, True, False),
        V(128, 3, 2, True, True),
        V(128, 3, 2, False, False),
        V(128, 3, 2, False, True),
        # one consumer, two programs an SM (their shared memory halves it: 64-key blocks)
        V(64, 2, 1, False, False),
        V(64, 3, 1, False, False),
        V(64, 2, 1, False, True),
        V(64, 3, 1, False, True),
    ],
    64: [
        V(128, 3, 3, True, True),
        V(128, 3, 3, False, True),
        V(128, 3, 3, True, False),
        V(128, 4, 2, True, True),
        V(128, 4, 2, True, False),
        V(64, 4, 1, False, False),
        V(128, 3, 1, False, False),
        V(128, 3, 1, False, True),
        V(64, 4, 1, False, True),
    ],
}


def attention(q, k, v, causal: bool, variant):
    """(O, L) of contiguous q (B, H, Nq, d), k, v (B, Hkv, Nk, d) with one variant of the kernel."""
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    hopper.forward(q, k, v, o, lse, causal, q.shape[-1] ** -0.5, variant)
    return o, lse


def run_kernel(variant, q, k, v, causal: bool):
    """One variant's forward, or the Triton forward (which `hopper.choose` picks where it returns None)."""
    if variant is None:
        return attention_forward(q, k, v, causal, config={"hopper": False})
    return attention(q, k, v, causal, variant)


TIMERS = {
    # course_lib's timer, the one `make bench` uses (each call after a read flush of the L2)
    "bench": lambda fn: benchmark(fn, warmup_ms=10, rep_ms=50),
    # Triton's (a zero_() flush of the L2 before each call); the sweeps before 2026-11-30 used it. There the
    # Triton forward timed 6-10 % below the bench's figure for the same launch, the Gluon variants 1-2 %.
    "do_bench": lambda fn: triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"),
}


def timed_cell(label: str, runs: dict, flops: float, pick, passes: int, timer: str = "bench") -> float:
    """Time `runs` (kernel -> call; None: the Triton forward) in `passes` rotated passes, print each one's median
    TFLOP/s, the fastest and `pick`'s share of it (returned), and the passes' spread."""
    times = interleaved(runs, passes, TIMERS[timer])
    tflops = {t: flops / statistics.median(ms) * 1e-9 for t, ms in times.items()}
    best = max(tflops, key=tflops.get)
    print(
        f"{label} | "
        + " ".join(f"{'Triton' if t is None else t}:{x:4.0f}" for t, x in tflops.items())
        + f" | best {'Triton' if best is None else best}, pick {'Triton' if pick is None else pick}"
        f" at {tflops[pick] / tflops[best]:.3f} of it"
        + f" | spread {max(max(ms) / min(ms) for ms in times.values()) - 1:.1%}",
        flush=True,
    )
    return tflops[pick] / tflops[best]


def repeated(heads: list[int], ns: list[int], passes: int, masks=(False, True), timer: str = "bench") -> None:
    """Median TFLOP/s of each variant and the Triton forward over `passes` rotated passes per cell
    (bf16, B*N = 16k, H*d = 2048), and the share of the fastest that `hopper.choose`'s pick reaches."""
    shares = []
    for d in heads:
        kernels = [None, *VARIANTS[d]]
        for causal in masks:
            for n in ns:
                b, h = 16384 // n, 2048 // d
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                runs = {t: (lambda t=t: run_kernel(t, q, k, v, causal)) for t in kernels}  # noqa: B023
                label = f"d={d:3d} causal={int(causal)} N={n:5d}"
                flops = attention_flops(b, h, n, n, d, causal)
                shares.append(timed_cell(label, runs, flops, hopper.choose(d, causal, n, n), passes, timer))
    print(f"choose's pick over the fastest: min {min(shares):.3f}, geomean {summarise(shares)[1]:.3f}")


def bottom_right(
    heads: list[int],
    pairs: list[tuple[int, int]],
    passes: int,
    batch: int,
    q_heads: int,
    timer: str = "bench",
) -> None:
    """`repeated` for causal bottom-right calls (Nq queries at the end of Nk keys: a chunk of a prompt over its
    KV cache), Nq x Nk pairs, bf16, H * d = 2048 query heads over a quarter as many K/V heads, B * Nq ~ 8k
    rows (or `batch` sequences of `q_heads` heads, where given); FLOPs counted over the visible (query,
    key) pairs. Each kernel is checked against the float32 reference first."""
    for d in heads:
        for n_q, n_k in pairs:
            b, h, offset = batch or max(1, 8192 // n_q), q_heads or 2048 // d, n_k - n_q
            q = torch.randn(b, h, n_q, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(b, h // 4, n_k, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            flops = 4.0 * b * h * d * (n_q * offset + n_q * (n_q + 1) / 2)
            kernels = [None, *VARIANTS[d]]

            def run(t, q=q, k=k, v=v, offset=offset, d=d):
                if t is None:
                    return attention_forward(q, k, v, "bottom_right", config={"hopper": False})
                o, lse = torch.empty_like(q), torch.empty(q.shape[:-1], device="cuda", dtype=torch.float32)
                hopper.forward(q, k, v, o, lse, True, d**-0.5, t, offset)
                return o, lse

            ref = torch.nn.functional.scaled_dot_product_attention(
                q[:1].float(), k[:1].float(), v[:1].float(), enable_gqa=True,
                attn_mask=torch.ones(n_q, n_k, dtype=torch.bool, device="cuda").tril(offset),
            )  # fmt: skip
            for t in kernels:
                err = (run(t)[0][:1].float() - ref).abs().max().item()
                assert err < 2e-2, f"d={d} {n_q}x{n_k} {t}: max error {err}"
            runs = {t: (lambda t=t: run(t)) for t in kernels}
            pick = hopper.choose(d, True, n_q, n_k, offset)
            timed_cell(f"d={d:3d} bottom-right {n_q}x{n_k} B={b}", runs, flops, pick, passes, timer)


def grids(cells: list[str]) -> None:
    """--grids: d x batch x heads x N (a trailing c: causal) per cell, the Gluon variant `hopper.choose` takes
    for a grid that fills the GPU against the Triton forward, us of CUDA-graph replays (best of two rounds),
    and what `choose` picks with the grid given (its grid rule)."""
    from course_lib.attention import forward
    from course_lib.perf.timing import graph_ms
    from course_lib.runtime import sm_count

    for cell in cells:
        causal = cell.endswith("c")
        d, b, h, n = map(int, cell.rstrip("c").split("x"))
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        variant = hopper.choose(d, causal, n, n)
        row = dict(
            cell=cell, variant=str(variant), pick=str(hopper.choose(d, causal, n, n, 0, b * h, sm_count()))
        )
        if variant is not None:
            o = torch.empty_like(q)
            lse = torch.empty(q.shape[:-1], dtype=torch.float32, device="cuda")
            calls = {  # the Gluon variant itself (`forward.forward` would apply the grid rule)
                "gluon_us": lambda: hopper.forward(q, k, v, o, lse, causal, d**-0.5, variant, 0),  # noqa: B023
                "triton_us": lambda: forward.forward(q, k, v, causal, config={"hopper": False}),  # noqa: B023
            }
            times = interleaved(calls, 2, timer=graph_ms)  # the best of two rounds
            row.update({name: round(min(ms) * 1e3, 1) for name, ms in times.items()})
        print(row, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="1024,2048,4096,8192,16384")
    ap.add_argument("--passes", type=int, default=0, help="time only choose's candidates, this many passes")
    ap.add_argument("--heads", default="64,128", help="head dims for --passes")
    ap.add_argument("--causal", default="0,1", help="for --passes: 0 (no mask), 1 (causal) or both")
    ap.add_argument(
        "--timer", default="bench", choices=sorted(TIMERS), help="for --passes and --bottom-right"
    )
    ap.add_argument("--bottom-right", default="", help="NqxNk,... : time bottom-right causal calls")
    ap.add_argument("--batch", type=int, default=0, help="--bottom-right: sequences (default ~8k rows)")
    ap.add_argument("--q-heads", type=int, default=0, help="--bottom-right: query heads (default 2048 / d)")
    ap.add_argument(
        "--grids", default="", help="dxBxHxN[c],... : small grids, Gluon against Triton (`grids`)"
    )
    args = ap.parse_args()
    t0 = time.time()
    if args.grids:
        grids(args.grids.split(","))
        return
    if args.bottom_right:
        pairs = [tuple(map(int, p.split("x"))) for p in args.bottom_right.split(",")]
        heads = list(map(int, args.heads.split(",")))
        bottom_right(heads, pairs, args.passes or 3, args.batch, args.q_heads, args.timer)
        print(f"total {time.time() - t0:.0f} s")
        return
    if args.passes:
        masks = [bool(int(c)) for c in args.causal.split(",")]
        heads, ns = list(map(int, args.heads.split(","))), list(map(int, args.ns.split(",")))
        repeated(heads, ns, args.passes, masks, args.timer)
        print(f"total {time.time() - t0:.0f} s")
        return
    bad = check(VARIANTS, attention, kv_heads=(3, 1))
    print("correctness:", "ok" if not bad else bad[:12], f"({time.time() - t0:.0f} s)", flush=True)
    rows = sweep(VARIANTS, attention, list(map(int, args.ns.split(","))))
    chosen = [r[5].get(hopper.choose(r[0], r[1], r[2], r[2]), r[4]) / r[3] for r in rows]
    print(f"hopper.choose's pick (the Triton kernel where None): {summarise(chosen)[1]:.3f} of SDPA default")
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
