"""Probe of the one-pass Gluon backward (`course_lib/attention/hopper_onepass.py`) against the two-kernel backward
and SDPA's on a Hopper GPU.

    python3 scripts/hopper_onepass_probe.py --out build/onepass.json [--ns 1024,4096,16384] [--ds 128,64] [--groups 1,4]
    python3 scripts/hopper_onepass_probe.py --ds 64 --stages 2,3,4   # the ring's depth only
    python3 scripts/hopper_onepass_probe.py --ds 64 --ns 4096 --groups 4 --slices 1,2,3,4   # launches only
    python3 scripts/hopper_onepass_probe.py --small 1x2x2048,1x8x2048 --ds 64,128   # grids under a wave
    python3 scripts/hopper_onepass_probe.py --ds 64 --ns 1024,2048,4096 --dkdv-rows 64,128   # dK/dV's query steps

For each cell (bf16, B * N = 16k tokens, H * d = 2048, causal and not, `group` query heads per K/V head): dQ, dK, dV
of `hopper_onepass.backward`, its dQ in 1 or 2 chunks of columns a warpgroup (`dq_chunks`), against the two-kernel
backward (`attention.backward` with hopper_onepass=False; largest difference), then the time of each whole backward
(the one pass with its D pass, which zeroes the accumulator, and dQ cast; the two kernels with D; the default, one
of them by `hopper_onepass.choose`; SDPA's, cuDNN) as TFLOP/s of the backward's 2.5 x forward FLOPs; and the Gluon
dK/dV kernel alone as TFLOP/s of its 4 products (2 x forward). Correctness against float64 is
tests/test_hopper_onepass.py's. A cell that runs past --hang-s seconds (a deadlocked kernel) ends the run with what
was measured.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import threading
import traceback
from pathlib import Path

import torch

from course_lib.attention import backward as bwd
from course_lib.attention import forward as fwd
from course_lib.attention import hopper_backward as hb
from course_lib.attention import hopper_onepass as onepass
from course_lib.attention.d_pass import preprocess
from course_lib.perf.timing import benchmark, graph_ms, interleaved

TOKENS, WIDTH = 16384, 2048


def _inputs(d: int, n: int, causal: bool, group: int):
    """A cell's fresh bf16 q, k, v, dO (B * N = 16k tokens, H * d = 2048), the forward's O and L, the softmax scale,
    the backward's FLOPs (2.5 x the forward's) and B, H."""
    B, H = TOKENS // n, WIDTH // d
    q, do = (torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, H // group, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    o, L = fwd.forward(q, k, v, causal=causal)
    flops = 2.5 * 4 * B * H * n * n * d * (0.5 if causal else 1.0)
    return q, k, v, do, o, L, d**-0.5, flops, B, H


def cell(d: int, n: int, causal: bool, group: int = 1) -> dict:
    q, k, v, do, o, L, scale, flops, B, H = _inputs(d, n, causal, group)
    row = dict(d=d, n=n, causal=causal, group=group)
    two = {"hopper_onepass": False}
    ref = bwd.backward(do, q, k, v, o, L, causal=causal, config=two)
    for name, config in (("two_kernel", two), ("default", None)):
        call = lambda config=config: bwd.backward(do, q, k, v, o, L, causal=causal, config=config)  # noqa: E731
        row[f"{name}_tflops"] = round(flops / benchmark(call) / 1e9, 1)
    for chunks in (1, 2):
        mode = f"onepass_{chunks}chunk"
        grads = onepass.backward(q, k, v, o, do, L, 0, causal, scale, dq_chunks=chunks)
        for g, new, old in zip("qkv", grads, ref):
            row[f"{mode}_d{g}_diff"] = (new.float() - old.float()).abs().max().item()
        call = lambda chunks=chunks: onepass.backward(q, k, v, o, do, L, 0, causal, scale, dq_chunks=chunks)  # noqa: E731
        row[f"{mode}_tflops"] = round(flops / benchmark(call) / 1e9, 1)
    # the dK/dV kernel alone (4 of the two kernels' 7 products), as TFLOP/s of its own 4 products
    delta = torch.empty(B * H, n, dtype=torch.float32, device="cuda")
    preprocess(o, do, delta, q.dtype)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    if hb.supports(q, k, v, do):
        kernel = lambda: hb.dkdv(q, k, v, do, L, delta, dk, dv, 0, causal, scale)  # noqa: E731
        row["dkdv_raw_tflops"] = round(flops * 4 / 5 / benchmark(kernel) / 1e9, 1)
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=group > 1)
    sdpa = lambda: torch.autograd.grad(out, (qs, ks, vs), do, retain_graph=True)  # noqa: E731
    row["sdpa_tflops"] = round(flops / benchmark(sdpa) / 1e9, 1)
    return row


def _set_stages(d: int, s: int) -> None:
    onepass.NUM_STAGES[d] = s


def _set_slices(d: int, s: int) -> None:
    """Exactly s launches over the (batch, K/V head) pairs (or fewer where there are fewer pairs): the wave rule
    of `hopper_onepass.slices` off."""
    onepass.DQ_SLICES = s
    onepass._slices = lambda q4, k4: onepass.slices(q4.shape[0] * k4.shape[1])


KNOBS = {"stages": _set_stages, "slices": _set_slices}


def knob_cell(d: int, n: int, causal: bool, group: int, knob: str, values: list[int]) -> dict:
    """--stages / --slices: the one pass with each value of the knob (`hopper_onepass.NUM_STAGES[d]`, or the number
    of launches `hopper_onepass.slices` makes), its largest difference from the two kernels' gradients, and TFLOP/s
    of the whole backward, timed in two interleaved rounds (the best of each) beside the two kernels' and the
    default's (the knob as shipped)."""
    q, k, v, do, o, L, scale, flops, B, H = _inputs(d, n, causal, group)
    row = dict(d=d, n=n, causal=causal, group=group, default_slices=len(onepass._slices(q, k)))
    ref = bwd.backward(do, q, k, v, o, L, causal=causal, config={"hopper_onepass": False})
    saved = dict(onepass.NUM_STAGES), onepass.DQ_SLICES, onepass._slices

    def restore():
        onepass.NUM_STAGES.update(saved[0])
        onepass.DQ_SLICES, onepass._slices = saved[1], saved[2]

    calls = {
        "two_kernel": lambda: bwd.backward(
            do, q, k, v, o, L, causal=causal, config={"hopper_onepass": False}
        ),
        "onepass_default": lambda: onepass.backward(q, k, v, o, do, L, 0, causal, scale),
    }
    try:
        for s in values:
            KNOBS[knob](d, s)
            grads = onepass.backward(q, k, v, o, do, L, 0, causal, scale)
            row[f"{knob}{s}_diff"] = max(
                (a.float() - b.float()).abs().max().item() for a, b in zip(grads, ref)
            )
            restore()

            def call(s=s):
                KNOBS[knob](d, s)
                try:
                    return onepass.backward(q, k, v, o, do, L, 0, causal, scale)
                finally:
                    restore()

            calls[f"{knob}{s}"] = call
        for _ in range(2):
            for name, call in calls.items():
                tf = round(flops / benchmark(call) / 1e9, 1)
                row[f"{name}_tflops"] = max(tf, row.get(f"{name}_tflops", 0.0))
    finally:
        restore()
    return row


def rows_cell(d: int, n: int, causal: bool, group: int, values: list[int]) -> dict:
    """--dkdv-rows: the two-kernel backward with the Gluon dK/dV kernel (forced on, `hopper_backward.choose`) at
    each number of query rows a step (`DkdvLaunch.q_rows`), its largest difference from the gradients with the
    Triton dK/dV kernel, and TFLOP/s of the whole backward (best of two interleaved rounds) beside the Triton dK/dV
    kernel's and the default's; and the Gluon kernel alone at each value (TFLOP/s of its 4 products)."""
    import dataclasses

    q, k, v, do, o, L, scale, flops, B, H = _inputs(d, n, causal, group)
    row = dict(d=d, n=n, causal=causal, group=group)
    saved_choose, saved_launch = hb.choose, hb.LAUNCHES[d]

    def run(rows: int | None, **config):
        hb.choose = (lambda *a: True) if rows else (lambda *a: False)
        if rows:
            hb.LAUNCHES[d] = dataclasses.replace(saved_launch, q_rows=rows)
        try:
            return bwd.backward(do, q, k, v, o, L, causal=causal, config={"hopper_onepass": False, **config})
        finally:
            hb.choose, hb.LAUNCHES[d] = saved_choose, saved_launch

    ref = run(None)
    calls = {
        "triton_dkdv": lambda: run(None),
        "default": lambda: bwd.backward(do, q, k, v, o, L, causal=causal),
    }
    delta = torch.empty(B * H, n, dtype=torch.float32, device="cuda")
    preprocess(o, do, delta, q.dtype)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    for r in values:
        grads = run(r)
        row[f"rows{r}_diff"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, ref))
        calls[f"rows{r}"] = lambda r=r: run(r)
        hb.LAUNCHES[d] = dataclasses.replace(saved_launch, q_rows=r)
        try:
            kernel = lambda: hb.dkdv(q, k, v, do, L, delta, dk, dv, 0, causal, scale)  # noqa: E731
            row[f"rows{r}_dkdv_raw_tflops"] = round(flops * 4 / 5 / benchmark(kernel) / 1e9, 1)
        finally:
            hb.LAUNCHES[d] = saved_launch
    times = interleaved(calls, 2)
    row.update({f"{name}_tflops": round(flops / min(ms) / 1e9, 1) for name, ms in times.items()})
    return row


def small_cell(d: int, batch: int, heads: int, n: int, causal: bool) -> dict:
    """--small: one shape (batch, heads, n, d) of few programs, the one pass (with its D pass and dQ's cast)
    against the two kernels, us of CUDA-graph replays (the GPU's time alone; `hopper_onepass.choose`'s grid
    rule), L2 flushed; the one pass's programs (pairs x key blocks of 128)."""
    q, k, v, do = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    o, L = fwd.forward(q, k, v, causal=causal)
    two = lambda: bwd.backward(do, q, k, v, o, L, causal=causal, config={"hopper_onepass": False})  # noqa: E731
    one = lambda: onepass.backward(q, k, v, o, do, L, 0, causal, d**-0.5)  # noqa: E731
    row = dict(d=d, shape=[batch, heads, n], causal=causal, programs=batch * heads * -(-n // 128))
    times = interleaved({"two_kernel": two, "onepass": one}, 2, timer=graph_ms)  # the best of two rounds
    row.update({f"{name}_us": round(min(ms) * 1e3, 1) for name, ms in times.items()})
    return row


def _hang(d: int, n: int, causal: bool) -> None:
    print("HANG", d, n, causal, flush=True)
    os._exit(3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="build/onepass.json")
    p.add_argument("--ns", default="1024,4096,16384")
    p.add_argument("--ds", default="128,64")
    p.add_argument("--groups", default="1")
    p.add_argument("--hang-s", type=float, default=120)
    p.add_argument("--stages", default="", help="e.g. 2,3,4: the one pass's ring depths only (`knob_cell`)")
    p.add_argument(
        "--slices", default="", help="e.g. 1,2,3,4: the one pass's launch counts only (`knob_cell`)"
    )
    p.add_argument(
        "--dkdv-rows", default="", help="e.g. 64,128: the Gluon dK/dV's query rows a step (`rows_cell`)"
    )
    p.add_argument(
        "--small", default="", help="e.g. 1x2x2048,1x8x2048: batch x heads x tokens, causal (`small_cell`)"
    )
    a = p.parse_args()
    rows = []
    for d, shape in itertools.product(map(int, a.ds.split(",")), a.small.split(",") if a.small else []):
        rows.append(small_cell(d, *map(int, shape.split("x")), True))
        print(json.dumps(rows[-1]), flush=True)
    if a.small:
        return
    for d in map(int, a.ds.split(",")):
        for n in map(int, a.ns.split(",")):
            for causal, group in itertools.product((False, True), map(int, a.groups.split(","))):
                timer = threading.Timer(a.hang_s, _hang, (d, n, causal))
                timer.start()
                try:
                    knob = "stages" if a.stages else "slices" if a.slices else ""
                    if a.dkdv_rows:
                        row = rows_cell(d, n, causal, group, [int(r) for r in a.dkdv_rows.split(",")])
                    elif knob:
                        values = [int(s) for s in getattr(a, knob).split(",")]
                        row = knob_cell(d, n, causal, group, knob, values)
                    else:
                        row = cell(d, n, causal, group)
                except Exception as e:  # noqa: BLE001 (a failed cell is a row with its error)
                    row = dict(d=d, n=n, causal=causal, group=group, error=f"{type(e).__name__}: {e}"[:400])
                    traceback.print_exc()
                timer.cancel()
                print(json.dumps(row), flush=True)
                rows.append(row)
                Path(a.out).parent.mkdir(parents=True, exist_ok=True)
                Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
