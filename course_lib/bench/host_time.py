"""Host time per call: the CPU time to issue one attention call, course_lib against SDPA (notebook 08).

A model run eagerly (a transformers model, a training loop without CUDA graphs) pays, for every attention
call, the Python and C++ that issue its kernels; at short sequences that host time, not the GPU, sets the
pace. Measured on tiny shapes (B=1, H=2, N=128, d=64, bf16), `CALLS` calls in rounds of `ROUND`, each round
started after a sync and timed until its last call is issued (not finished): the CPU time to issue a call,
whatever the GPU's own time for it (a tiny kernel can take longer on the GPU than its launch on the CPU, and
wall time per call would then measure the GPU); a round is short enough that the GPU's queue of launches
never fills (a full queue would make a launch wait). Best of `REPEATS`; the wall clock per call (after a
sync) is recorded beside it:

- forward: `flash_attention(q, k, v, causal=True)` under `torch.no_grad()` against SDPA's default;
- forward+backward: `torch.autograd.grad` of the same call's output with a given dO, against SDPA;
- fwd+bwd, 4k causal: the same at (1, 4, 4096, 64), where a Hopper GPU's backward is the one-pass kernel (from
  4096 causal tokens on half a wave of programs or more, `hopper_onepass.choose`; the row was (1, 8, 2048, 64)
  until 2026-12-01, when the one pass at d = 64 began at 2048 causal tokens): its launches over slices of the
  heads, the D pass zeroing the accumulator first, dQ cast after each, repeated by its plan;
- decode step: one query token over a 256-token cache, `flash_attention` against SDPA (is_causal=False: a
  single bottom-right query sees every key); at this length the FlashAttention-2 forward keeps the call, one
  launch (`attention.decode_route` hands longer ones to split-KV decoding, two launches).

Beside the rows, the floor of any Python autograd Function (`floor`): forward+backward of `_Empty`, a Function
whose forward and backward only allocate their outputs, on the tiny shape, timed in turns with the
forward+backward row's two calls (its SDPA figure is that row's).
Autograd runs a Python backward for CUDA tensors on its own thread, and the Function's forward goes through Python
too: on the H200's hosts this empty call cost 68-107 us against SDPA's 98-114, and 119 against 163-188 on a slower
one (2026-11-30), so a Python Function that stays within 1.5x has about 0.8x SDPA's time for all it does above
the floor: its checks, plans, launches and allocations.

The target: at most 1.5x SDPA's time per call. `make bench BENCH=host_time` (and `make bench`, after the
attention benchmark) records it as `host_time`; `python -m course_lib.bench.host_time` prints it (GPU only). Setting
COURSE_BOUND_LAUNCH=0 launches through Triton's own path (`kernels.bound`), for the comparison.

The record's rows come from a fresh process (`measure(fresh=True)`): what an eager caller pays. The attention
benchmark times torch.compile, and in its process a Python call's host time was higher afterwards (H200,
2026-11-29: fwd + bwd 247.9 us there, 166.7 in a fresh one; SDPA 144.6 and 129.3). The same code's ratios
also moved between fresh processes on one machine (forward 1.1-1.8x): read several runs before a decision.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from .. import runtime

CALLS = 2000
ROUND = 100  # calls issued between syncs: at most ~500 kernels queued (a forward + backward is 3-5 launches)
REPEATS = 5
TARGET = 1.5


def _per_call_us(providers: dict, calls: int, repeats: int) -> dict:
    """{name: wall clock per call} of `calls` calls of each provider's fn back to back, after a sync, best of
    `repeats`; the providers take turns within each repeat (a machine's drift reaches both)."""
    for fn in providers.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    best = dict.fromkeys(providers, float("inf"))
    for _ in range(repeats):
        for name, fn in providers.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls * 1e6)
    return best


def _issue_us(providers: dict, calls: int, repeats: int) -> dict:
    """{name: CPU time to issue one call} (module docstring): rounds of ROUND calls, each from a synced GPU to its
    last call's return, summed over `calls` calls, best of `repeats`. The providers take turns round by round, so
    that what else the machine does in a repeat reaches each of them alike: timed one after the other (before
    2026-11-30), one provider's five repeats could all fall in a slow spell (the 2k row read 1.34x, 1.96x and
    1.82x SDPA's in three measurements of one process)."""
    for fn in providers.values():
        for _ in range(20):
            fn()
    rounds = max(1, calls // ROUND)
    best = dict.fromkeys(providers, float("inf"))
    for _ in range(repeats):
        spent = dict.fromkeys(providers, 0.0)
        for _ in range(rounds):
            for name, fn in providers.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(ROUND):
                    fn()
                spent[name] += time.perf_counter() - t0
        for name in providers:
            best[name] = min(best[name], spent[name] / (rounds * ROUND) * 1e6)
    torch.cuda.synchronize()
    return best


class _Empty(torch.autograd.Function):
    """The floor of a Python autograd Function (module docstring): the forward saves its inputs and allocates O,
    the backward allocates dQ, dK, dV; no kernel, no check."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _floor(device):
    """A call of the floor: forward+backward of `_Empty` on the tiny shape."""
    q, k, v = (
        torch.randn(1, 2, 128, 64, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in "qkv"
    )
    do = torch.randn_like(q)
    return lambda: torch.autograd.grad(_Empty.apply(q, k, v), (q, k, v), do)


def _calls(device) -> dict:
    from .. import flash_attention

    def rand(*shape, grad=False):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, requires_grad=grad)

    q, k, v = (rand(1, 2, 128, 64, grad=True) for _ in range(3))
    do = rand(1, 2, 128, 64)
    q1, kc, vc = rand(1, 2, 1, 64), rand(1, 2, 256, 64), rand(1, 2, 256, 64)
    ql, kl, vl = (rand(1, 4, 4096, 64, grad=True) for _ in range(3))  # 128 programs: the one pass's grid rule
    dol = rand(1, 4, 4096, 64)
    sdpa = F.scaled_dot_product_attention

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()

        return run

    return {
        "forward": {
            "course_lib": no_grad(lambda: flash_attention(q, k, v, causal=True)),
            "sdpa": no_grad(lambda: sdpa(q, k, v, is_causal=True)),
        },
        "forward+backward": {
            "course_lib": lambda: torch.autograd.grad(flash_attention(q, k, v, causal=True), (q, k, v), do),
            "sdpa": lambda: torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), do),
        },
        "fwd+bwd, 4k causal": {  # a Hopper GPU's one-pass backward (`attention.hopper_onepass`) from here
            "course_lib": lambda: torch.autograd.grad(
                flash_attention(ql, kl, vl, causal=True), (ql, kl, vl), dol
            ),
            "sdpa": lambda: torch.autograd.grad(sdpa(ql, kl, vl, is_causal=True), (ql, kl, vl), dol),
        },
        "decode step": {
            "course_lib": no_grad(lambda: flash_attention(q1, kc, vc, causal=True)),
            "sdpa": no_grad(lambda: sdpa(q1, kc, vc)),
        },
    }


def measure(quick: bool = False, fresh: bool = False) -> dict:
    """{"rows": [{call, course_lib_us, sdpa_us, ratio}], "calls", "target"}: the record's data (GPU).

    fresh=True measures in a new Python process (nothing run before in it)."""
    if fresh:
        cmd = [sys.executable, "-m", "course_lib.bench.host_time", "--json"] + (["--quick"] if quick else [])
        done = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "COURSE_DEVICE": "cuda"}
        )
        if done.returncode != 0:
            raise RuntimeError(f"host_time: the fresh process failed: {done.stderr[-2000:]}")
        data = json.loads(done.stdout.strip().splitlines()[-1])
        data["process"] = "fresh"
        return data
    if not runtime.ON_GPU:
        raise RuntimeError("host_time: a GPU is needed (the CPU time to issue GPU work)")
    from ..attention import plans
    from ..kernels import bound

    calls = CALLS // 4 if quick else CALLS
    rows, floor = [], None
    for call, providers in _calls(torch.device("cuda")).items():
        if call == "forward+backward":  # the floor in turns with this row's calls
            providers = {**providers, "floor": _floor(torch.device("cuda"))}
        us = _issue_us(providers, calls, REPEATS)
        if "floor" in us:
            floor = {"empty_function_us": us["floor"], "sdpa_us": us["sdpa"]}
        wall = _per_call_us(providers, calls, REPEATS)
        rows.append(
            {"call": call, "course_lib_us": us["course_lib"], "sdpa_us": us["sdpa"],
             "ratio": us["course_lib"] / us["sdpa"],
             "course_lib_wall_us": wall["course_lib"], "sdpa_wall_us": wall["sdpa"]}
        )  # fmt: skip
    return {
        "rows": rows, "floor": floor,
        "calls": calls, "round": ROUND, "repeats": REPEATS, "target": TARGET,
        "bound_launch": bound.MODE, "plans": plans.ENABLED, "measure": "CPU time to issue a call",
        "process": "this",
    }  # fmt: skip


def format_table(data: dict) -> str:
    lines = [
        f"host time per call: CPU time to issue it ({data['calls']} calls, best of {data['repeats']}; "
        f"target <= {data['target']}x SDPA; {data.get('process', 'this')} process); wall clock per call beside it"
    ]
    lines.append(
        f"{'call':<19} {'course_lib us':>14} {'SDPA us':>9} {'ratio':>6} {'wall us':>9} {'SDPA wall':>10}"
    )
    for r in data["rows"]:
        lines.append(
            f"{r['call']:<19} {r['course_lib_us']:>14.1f} {r['sdpa_us']:>9.1f} {r['ratio']:>6.2f} "
            f"{r.get('course_lib_wall_us', float('nan')):>9.1f} {r.get('sdpa_wall_us', float('nan')):>10.1f}"
        )
    floor = data.get("floor")
    if floor:
        lines.append(
            f"floor: an empty Python autograd.Function, fwd+bwd {floor['empty_function_us']:.1f} us "
            f"(timed in turns with the forward+backward row: SDPA {floor['sdpa_us']:.1f} us)"
        )
    return "\n".join(lines)


def profile(call: str, calls: int = 500, top: int = 25) -> None:
    """Print where the CPU time of `calls` calls of `call` (a row's name: "forward", "forward+backward", ...)
    goes: cProfile, by own time."""
    from ..perf.profiling import print_host_profile

    fn = _calls(torch.device("cuda"))[call]["course_lib"]
    _per_call_us({"course_lib": fn}, 10, 1)
    print_host_profile(fn, calls, f"cProfile of {calls} course_lib {call} calls, by own time:", top)


def run(quick: bool = False) -> dict:
    """The record's data, measured in a fresh process (`measure(quick, fresh=True)`)."""
    return measure(quick, fresh=True)


def main(quick: bool = False, out=None) -> int:
    """`make bench BENCH=host_time`: measure, save the `host_time` record in `out`, print the table; 0. Without
    a GPU it measures nothing and writes nothing (a CPU issues no launches: `scripts/host_time.py` times the
    Python there), and says so: a CPU smoke run of every benchmark skips it."""
    from .. import records

    if not runtime.ON_GPU:
        print("bench host_time: skipped, a GPU is needed (scripts/host_time.py times the Python on a CPU)")
        return 0
    path = records.save_record("host_time", run(quick), records.ASSETS if out is None else out)
    print(f"bench: host_time record -> {path}")
    print(format_table(json.loads(path.read_text())["data"]))
    return 0


if __name__ == "__main__":
    if "--json" in sys.argv:  # measure(fresh=True)'s child: the data alone, on the last line
        print(json.dumps(measure("--quick" in sys.argv)))
        sys.exit(0)
    if "--profile" in sys.argv:
        for call in _calls(torch.device("cuda")):
            profile(call)
    result = measure()
    print(format_table(result))
    print(json.dumps(result))
