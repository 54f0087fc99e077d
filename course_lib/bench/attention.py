"""The attention benchmark of `make bench`: the grid, the ladder and the records notebooks 01, 02 and 08
show a CPU learner.

Taught in notebook 08. On a GPU, `main` measures the standard shapes of the FlashAttention papers
(`course_lib.bench.shapes`) for:
- course_lib's Triton FlashAttention-2 (`course_lib.flash_attention`);
- `scaled_dot_product_attention` as PyTorch chooses, and with each backend forced through
  `torch.nn.attention.sdpa_kernel` (a backend that refuses a shape is recorded as unsupported);
- standard attention (`course_lib.attention.reference.attention`, notebook 02) in eager PyTorch and under
  `torch.compile`, skipped where its N x N score matrices would be too large;
each for the forward, the backward and both, as TFLOP/s by the papers' convention
(`perf.timing.attention_flops`) and peak memory (`perf.timing.peak_memory`). It then measures the
optimisation ladder (`bench.ladder`), runs the other recorders (`perf.ceilings.measure_record`,
`perf.profiling.standard_attention_record`), saves every record with `records.save_record`, draws PNG plots
next to the records and prints the ratio table with the targets.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .. import records, runtime
from .ladder import ladder
from .measure import run_attention
from .plots import save_plots
from .report import format_report


def run(quick: bool = False) -> dict:
    """The attention record's data (`measure.run_attention`): every provider on every cell."""
    return run_attention(quick)


def _hardware_record(quick: bool) -> dict:
    """The `hardware` record notebook 01 shows (`perf.ceilings.measure_record`); small when quick."""
    from ..perf import ceilings

    if not quick:
        return ceilings.measure_record()
    return ceilings.measure_record(
        copy_numel=2**20,
        read_numel=2**20,
        matmul_n=256,
        rows=256,
        cols=256,
        matmul_sizes=(64, 128),
        fusion_numel=2**16,
    )


def _standard_attention_record(quick: bool) -> dict:
    """The `standard_attention` record notebook 02 shows (`perf.profiling`); small when quick."""
    from ..perf import profiling

    if not quick:
        return profiling.standard_attention_record()
    return profiling.standard_attention_record(
        batch_heads=2, head_dim=32, ns=(64, 128), breakdown_n=128,
        dtype=torch.bfloat16 if runtime.ON_GPU else torch.float32, compile_fused=runtime.ON_GPU,
    )  # fmt: skip


def main(quick: bool = False, out: str | Path = records.ASSETS) -> int:
    """Run the benchmark, the ladder and the other recorders; save records and plots in `out`.

    Each part is guarded: a failure is reported and the rest still runs and is saved. Returns 0 when
    every part ran, 1 otherwise (missed performance targets are reported, not failures)."""
    out = Path(out)
    if not runtime.ON_GPU and out.resolve() == records.ASSETS.resolve():
        print(
            "bench: no GPU. CPU timings are not course figures and do not belong in assets/benchmarks/; "
            "pass --out DIR to run the smoke test elsewhere."
        )
        return 2
    start = time.perf_counter()
    meta = records.machine_meta()
    print(
        f"bench: {meta.get('gpu') or 'CPU'} | torch {meta['torch']} | triton {meta['triton']} | "
        f"CUDA {meta['cuda']} | {'quick' if quick else 'full'} grid -> {out}/"
    )
    failures, saved = [], {}
    if runtime.ON_GPU:  # compile every autotuning candidate in parallel first: minutes saved when cold
        from ..attention.precompile import precompile

        seconds, errors = precompile(head_dims=(64,) if quick else (64, 128))
        print(f"bench: precompiled the kernels' autotuning candidates in {seconds:.0f} s")
        for e in errors:
            print(f"bench:   could not compile {e}")

    def part(kind, make_data):
        t0 = time.perf_counter()
        try:
            saved[kind] = records.save_record(kind, make_data(), out)
            print(f"bench: {kind} record -> {saved[kind]} ({time.perf_counter() - t0:.0f} s)")
        except Exception as exc:  # report it, keep going: the other records are still worth having
            failures.append(kind)
            print(f"bench: {kind} FAILED after {time.perf_counter() - t0:.0f} s: {type(exc).__name__}: {exc}")

    part("attention", lambda: run_attention(quick))
    part("ladder", lambda: ladder(quick))
    part("hardware", lambda: _hardware_record(quick))
    part("standard_attention", lambda: _standard_attention_record(quick))
    try:
        for path in save_plots(saved.get("attention"), saved.get("ladder")):
            print(f"bench: plot -> {path}")
    except Exception as exc:
        failures.append("plots")
        print(f"bench: plots FAILED: {type(exc).__name__}: {exc}")
    if "attention" in saved:
        data = json.loads(saved["attention"].read_text())["data"]
        print()
        print(format_report(data))
        if not runtime.ON_GPU:
            print("(CPU: interpreted kernels; these ratios only show that the benchmark runs)")
        spent = ", ".join(f"{p} {t:.0f} s" for p, t in data.get("seconds_per_provider", {}).items())
        print(f"time per provider (compilation and autotuning included): {spent}")
    print(
        f"\nbench: done in {time.perf_counter() - start:.0f} s"
        + (f"; FAILED: {', '.join(failures)}" if failures else "")
    )
    return 1 if failures else 0
