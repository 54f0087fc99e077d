"""Probe of the warp-specialised Gluon dQ kernel (`course_lib/attention/hopper_dq.py`) on a Hopper GPU.

    python3 scripts/hopper_dq_probe.py --out build/hopper_dq_probe.json      # a Hopper GPU
    python3 scripts/hopper_dq_probe.py --record                              # ... and record `hopper_dq`
    python3 scripts/hopper_dq_probe.py --compile-only [--variants]           # any machine, a CPU too

On the GPU, for every cell of the standard grid (bf16, B * Nk = 16k tokens, H * d = 2048, d in {64, 128},
N in {1k, 4k, 16k}; no mask, causal with Nq = Nk, causal bottom-right with Nq = Nk / 2; one query head per
K/V head and four): the Triton dQ launch that `backward.backward` makes today is captured (the backward is
stopped right before it, so no dK/dV kernel compiles or runs) and run (it also writes D = rowsum(dO * O)),
then the Gluon kernel (`hopper_dq.LAUNCHES`) runs on the same L and D.

1. Correctness: dQ of the last min(Nq, 2048) rows of two query heads (batch 0) against the float64
   reference (`attention.reference`) by the rule of the GPU tests (`testing.assert_close_to_reference`:
   error <= 2 x plain PyTorch's bf16 error + 8e-3), and every row of every head against the Triton dQ
   within the same bound. At 1k, also with an fp32 dQ output.
2. Time (`perf.timing.benchmark`, ms): the Gluon kernel, the Triton launch as the backward makes it
   (FUSE_D: it computes D too) and the same launch reading D (FUSE_D=False: the Gluon kernel's work).
   ratio = Triton (FUSE_D) / Gluon, ratio_read_d = Triton (FUSE_D=False) / Gluon: above 1, the Gluon
   kernel is faster. With --variants, each of `hopper_dq.VARIANTS` is timed too at 4k and 16k, one query
   head per K/V head, no mask and causal with Nq = Nk.

A kernel that fails to compile or run becomes a row with its error, and the script goes on; the JSON is
rewritten after every cell, and a cell that runs past --hang-s seconds (a deadlocked kernel) ends the run
with what was measured so far. --compile-only compiles each launch of `hopper_dq.LAUNCHES` (with
--variants, `VARIANTS`), causal and not, for sm_90: on a GPU machine with `warmup` for its own GPU, on a
CPU for `GPUTarget("cuda", 90, 32)` with Gluon's AST source, as `course_lib.tools.compile_check` compiles
the Triton kernels; it prints each launch's registers and local memory (cuobjdump) and exits 1 if one
fails.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

from course_lib import runtime
from course_lib.attention import hopper_dq

TOKENS = 16384  # B * Nk
WIDTH = 2048  # H * d
NS = (1024, 4096, 16384)
MASKS = ("none", "top_left", "bottom_right")  # bottom-right: Nq = Nk / 2
GROUPS = (1, 4)
REFERENCE_ROWS = 2048  # the last rows of two query heads checked against float64


# --------------------------------------------------------------------------------------------------
# Compiling for sm_90
# --------------------------------------------------------------------------------------------------
def compile_launch(d: int, causal: bool, launch: hopper_dq.DqLaunch, device: str):
    """Compile `dq_ws_kernel` for small stand-in tensors on `device` ("cuda": `warmup` for this GPU;
    "cpu": for GPUTarget("cuda", 90, 32) without a GPU). Returns Triton's compiled kernel."""
    B, H, n = 1, 4, 256
    q = torch.zeros(B, H, n, d, dtype=torch.bfloat16, device=device)
    kv = torch.zeros(B, 1, n, d, dtype=torch.bfloat16, device=device)
    l3 = torch.zeros(B, H, n, device=device)
    delta = torch.zeros(B * H, n, device=device)
    grid, args, kwargs = hopper_dq.arguments(q, kv, kv, q, l3, delta, q, 0, causal, d**-0.5, launch)
    if device == "cuda":
        return hopper_dq.dq_ws_kernel.warmup(*args, grid=grid, **kwargs)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    kernel = hopper_dq.dq_ws_kernel
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    # What a launch does to find its compiled kernel (JITFunction.run), for a target given here:
    # the arguments' types and specialisations, the constants and the options.
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constants, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    source = GluonASTSource(kernel, signature, constants, attrs)
    return triton_compile(source, target=target, options=options.__dict__)


def resource_usage(compiled) -> str:
    """cuobjdump's resource line of a compiled kernel's cubin (registers, local memory), or ''."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    cubin = compiled.asm.get("cubin") if hasattr(compiled, "asm") else None
    if not tool.exists() or not cubin:
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    lines = [line.strip() for line in out.splitlines() if "REG:" in line]
    return (
        " ".join(part for part in lines[0].split() if part.split(":")[0] in ("REG", "LOCAL")) if lines else ""
    )


def compile_only(variants: bool) -> list[dict]:
    """Compile every launch (LAUNCHES, or VARIANTS), causal and not; one row each."""
    device = "cuda" if runtime.ON_GPU else "cpu"
    table = hopper_dq.VARIANTS if variants else {d: (launch,) for d, launch in hopper_dq.LAUNCHES.items()}
    rows = []
    for d, launches in table.items():
        for launch in launches:
            for causal in (False, True):
                row = dict(d=d, launch=list(launch), causal=causal, shared_kb=launch.shared_bytes(d) / 1024)
                t0 = time.perf_counter()
                try:
                    row["resources"] = resource_usage(compile_launch(d, causal, launch, device))
                    row["ok"] = True
                except Exception as exc:  # reported as a row; the other launches still compile
                    row["ok"], row["error"] = False, f"{type(exc).__name__}: {exc}"[:2000]
                row["seconds"] = round(time.perf_counter() - t0, 2)
                rows.append(row)
                status = row.get("resources", "") if row["ok"] else "FAILED " + row["error"][:300]
                print(
                    f"d={d} {tuple(launch)} causal={causal!s:5} {row['seconds']:5.1f} s  {status}", flush=True
                )
    where = "this GPU" if device == "cuda" else "sm_90 (GPUTarget('cuda', 90, 32), no GPU)"
    print(f"{sum(r['ok'] for r in rows)} of {len(rows)} launches compile for {where}")
    return rows


# --------------------------------------------------------------------------------------------------
# The GPU probe
# --------------------------------------------------------------------------------------------------
class _Captured(Exception):
    """Raised by `triton_dq_launch`'s stand-in for the launch: the backward stops there."""


@contextlib.contextmanager
def _patched(module, **values):
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def triton_dq_launch(do, q, k, v, o, lse, causal) -> dict:
    """The Triton dQ launch `backward.backward(do, q, k, v, o, lse, causal)` makes: {kernel, grid, args,
    meta, named} (named: its arguments by parameter name). The backward is stopped at that launch, and
    nothing is compiled ahead (no dK/dV kernel)."""
    from course_lib.attention import backward as bwd
    from course_lib.attention import launch as launches

    captured = {}

    def capture(kernel, tuner, table, grid, args, meta, shape):
        config = launches.chosen(table, shape) or table.choose(shape[1], shape[2], shape[0], shape[3], False)
        names = list(inspect.signature(kernel.fn).parameters)
        captured.update(
            kernel=kernel, grid=grid(config), args=args, meta=dict(meta, **config.kwargs()),
            named=dict(zip(names, args)), config=list(config),
        )  # fmt: skip
        raise _Captured

    quiet = lambda *args, **kwargs: None  # noqa: E731
    with _patched(bwd, launch=capture, compile_ahead=quiet, hopper_dkdv=quiet):
        try:
            bwd.backward(do, q, k, v, o, lse, causal)
        except _Captured:
            pass
    if captured.get("kernel") is not bwd._dq_kernel:
        raise RuntimeError("backward.backward made no dQ launch through launch.launch")
    return captured


def reference_check(dq_out, q, k, v, do, causal: bool, group: int) -> dict:
    """dQ of the last rows of query heads 0, 1 (batch 0) against float64, and plain PyTorch's bf16 error:
    {err, base, bound}. Rows and their keys: bottom-right alignment reproduces both causal cells' masks
    on the last rows (offset Nk - Nq; 0 when Nq = Nk)."""
    from course_lib.testing import FLOOR, max_error, reference_outputs

    n_q = q.shape[2]
    rows = slice(n_q - min(n_q, REFERENCE_ROWS), n_q)
    kv_heads = 1 if group > 1 else 2  # query heads 0 and 1 read K/V head 0 (grouped) or 0 and 1
    qs, dos = q[:1, :2, rows], do[:1, :2, rows]
    ks, vs = k[:1, :kv_heads], v[:1, :kv_heads]
    mask = "bottom_right" if causal else False
    _, (ref, _, _) = reference_outputs(*(t.double() for t in (qs, ks, vs)), mask, None, dos.double())
    _, (base, _, _) = reference_outputs(qs, ks, vs, mask, None, dos)
    base_err = max_error(base, ref)
    return dict(
        err=max_error(dq_out[:1, :2, rows], ref), base=base_err, bound=2 * base_err + FLOOR[torch.bfloat16]
    )


def cell_inputs(d: int, mask: str, group: int, n: int, seed: int):
    """q, k, v, dO (bf16, CUDA) of one cell, and its causal argument."""
    n_q = n // 2 if mask == "bottom_right" else n
    b, h = TOKENS // n, WIDTH // d
    gen = torch.Generator(device="cuda").manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)  # noqa: E731
    q, do = randn(b, h, n_q, d), randn(b, h, n_q, d)
    k, v = randn(b, h // group, n, d), randn(b, h // group, n, d)
    causal = {"none": False, "top_left": True, "bottom_right": "bottom_right"}[mask]
    return q, k, v, do, causal


def run_cell(d: int, mask: str, group: int, n: int, time_variants: bool) -> tuple[dict, list[dict]]:
    """One cell: its row, and a row per timed variant."""
    from course_lib.attention.forward import forward
    from course_lib.perf.timing import benchmark

    q, k, v, do, causal = cell_inputs(d, mask, group, n, seed=d * 100003 + n + group)
    row = dict(
        d=d, mask=mask, group=group, n_q=q.shape[2], n_k=k.shape[2], batch=q.shape[0], heads=q.shape[1]
    )
    o, lse = forward(q, k, v, causal)
    tri = triton_dq_launch(do, q, k, v, o, lse, causal)
    named = tri["named"]
    row["triton_launch"] = tri["config"]
    run_triton = lambda meta: tri["kernel"][tri["grid"]](*tri["args"], **meta)  # noqa: E731
    run_triton(tri["meta"])  # dQ, and D for the Gluon kernel
    torch.cuda.synchronize()
    dq_triton = named["DQ"].clone()
    offset, scale, l3, delta = named["OFFSET"], named["sm_scale"], named["L"], named["Dlt"]

    def gluon(launch, out):
        grid, args, kwargs = hopper_dq.arguments(
            q, k, v, do, l3, delta, out, offset, bool(causal), scale, launch
        )
        return lambda: hopper_dq.dq_ws_kernel[grid](*args, **kwargs)

    dq_gluon = torch.empty_like(q)
    launch = hopper_dq.LAUNCHES[d]
    row["launch"] = list(launch)
    try:
        run_gluon = gluon(launch, dq_gluon)
        run_gluon()
        torch.cuda.synchronize()
    except Exception as exc:
        row["error"] = f"Gluon dQ: {type(exc).__name__}: {exc}"[:2000]
        return row, []
    check = reference_check(dq_gluon, q, k, v, do, bool(causal), group)
    row["err"], row["bound"], row["torch_bf16_err"] = check["err"], check["bound"], check["base"]
    row["triton_err"] = reference_check(dq_triton, q, k, v, do, bool(causal), group)["err"]
    row["diff_vs_triton"] = float((dq_gluon.float() - dq_triton.float()).abs().max())
    row["finite"] = bool(torch.isfinite(dq_gluon).all())
    row["ok"] = row["finite"] and row["err"] <= row["bound"] and row["diff_vs_triton"] <= row["bound"]
    if n == NS[0]:  # an fp32 output: the same values before rounding to bf16
        dq32 = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        gluon(launch, dq32)()
        row["fp32_out_err"] = reference_check(dq32, q, k, v, do, bool(causal), group)["err"]
        row["ok"] = row["ok"] and row["fp32_out_err"] <= row["bound"]
    row["ms_gluon"] = benchmark(run_gluon)
    row["ms_triton"] = benchmark(lambda: run_triton(tri["meta"]))
    row["ms_triton_read_d"] = benchmark(lambda: run_triton(dict(tri["meta"], FUSE_D=False)))
    row["ratio"] = row["ms_triton"] / row["ms_gluon"]
    row["ratio_read_d"] = row["ms_triton_read_d"] / row["ms_gluon"]
    extra = []
    if time_variants:
        for variant in hopper_dq.VARIANTS[d]:
            vrow = dict(d=d, mask=mask, group=group, n_q=row["n_q"], n_k=row["n_k"], launch=list(variant))
            try:
                out = torch.empty_like(q)
                fn = gluon(variant, out)
                fn()
                torch.cuda.synchronize()
                vrow["diff_vs_triton"] = float((out.float() - dq_triton.float()).abs().max())
                vrow["ok"] = bool(torch.isfinite(out).all()) and vrow["diff_vs_triton"] <= row["bound"]
                vrow["ms_gluon"] = benchmark(fn)
                vrow["ratio"] = row["ms_triton"] / vrow["ms_gluon"]
            except Exception as exc:
                vrow["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            extra.append(vrow)
    return row, extra


def precompile(variants: bool) -> float:
    """Compile every Gluon launch the cells will make, in threads (compiling runs mostly outside Python's
    lock): stand-ins with the cells' specialisations (16-bit tensors, sizes and strides multiples of 16,
    one or four query heads per K/V head). A failure is left for the cell to report. Returns seconds."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = []
    for d in (64, 128):
        for launch in hopper_dq.VARIANTS[d] if variants else (hopper_dq.LAUNCHES[d],):
            chosen = launch == hopper_dq.LAUNCHES[d]
            for causal in (False, True):
                for group in GROUPS if chosen else (1,):
                    for out_dtype in (torch.bfloat16, torch.float32) if chosen else (torch.bfloat16,):
                        jobs.append((d, launch, causal, group, out_dtype))

    def compile_one(job):
        d, launch, causal, group, out_dtype = job
        q = torch.zeros(1, 16, 256, d, dtype=torch.bfloat16, device="cuda")
        kv = torch.zeros(1, 16 // group, 256, d, dtype=torch.bfloat16, device="cuda")
        l3, delta = torch.zeros(1, 16, 256, device="cuda"), torch.zeros(16, 256, device="cuda")
        out = torch.zeros(q.shape, dtype=out_dtype, device="cuda")
        grid, args, kwargs = hopper_dq.arguments(q, kv, kv, q, l3, delta, out, 0, causal, d**-0.5, launch)
        try:
            hopper_dq.dq_ws_kernel.warmup(*args, grid=grid, **kwargs)
        except Exception:  # the cell's own launch compiles it again and reports the error
            pass

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(compile_one, jobs))
    return time.perf_counter() - t0


def _fmt(row: dict) -> str:
    head = f"{row['d']:4} {row['mask']:>12} {row['group']:2} {row['n_q']:6} {row['n_k']:6}"
    if "error" in row:
        return f"{head}  ERROR {row['error'][:400]}"
    if "ms_triton" not in row:  # a variant
        launch = str(tuple(row["launch"]))
        return f"{head}  {launch:>16} {row['ms_gluon']:8.3f}  ratio {row['ratio']:5.2f}  ok={row['ok']}"
    return (
        f"{head}  {row['ms_gluon']:8.3f} {row['ms_triton']:8.3f} {row['ms_triton_read_d']:8.3f} {row['ratio']:6.2f}"
        f"  {row['err']:.2e} {row['triton_err']:.2e} {row['bound']:.2e} {row['diff_vs_triton']:.2e}  {row['ok']}"
    )


def probe(out: str | None, variants: bool, hang_s: float, keep: bool = False) -> int:
    import triton

    record = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        launches={d: list(launch) for d, launch in hopper_dq.LAUNCHES.items()},
        rows=[],
        variants=[],
    )

    def save():
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(record, indent=1) + "\n")

    current = {"cell": None, "since": time.monotonic()}

    def watchdog():  # a deadlocked kernel never returns: keep what was measured, and stop
        while True:
            time.sleep(5)
            if current["cell"] is not None and time.monotonic() - current["since"] > hang_s:
                record["hung"] = f"{current['cell']}: no result after {hang_s:.0f} s"
                save()
                print(f"\nHUNG at {current['cell']} (> {hang_s:.0f} s); partial results written", flush=True)
                os._exit(2)

    t0 = time.perf_counter()
    threading.Thread(target=watchdog, daemon=True).start()
    current.update(cell="compiling the Gluon launches", since=time.monotonic())
    record["precompile_s"] = round(precompile(variants), 1)
    print(f"Gluon launches compiled in {record['precompile_s']} s", flush=True)
    print("   d         mask  G     Nq     Nk  gluon ms triton ms read-D ms  ratio", end="")
    print("  err      triton   bound    |g-t|     ok")
    for d in (64, 128):
        for mask in MASKS:
            for group in GROUPS:
                for n in NS:
                    current.update(cell=(d, mask, group, n), since=time.monotonic())
                    timed = variants and group == 1 and mask != "bottom_right" and n != NS[0]
                    try:
                        row, extra = run_cell(d, mask, group, n, timed)
                    except Exception as exc:
                        n_q = n // 2 if mask == "bottom_right" else n
                        row = dict(d=d, mask=mask, group=group, n_q=n_q, n_k=n)
                        row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                        row["traceback"] = traceback.format_exc()[-3000:]
                        extra = []
                    record["rows"].append(row)
                    record["variants"].extend(extra)
                    print(_fmt(row), flush=True)
                    for vrow in extra:
                        print("   variant " + _fmt(vrow), flush=True)
                    save()
    current["cell"] = None
    record["seconds"] = round(time.perf_counter() - t0, 1)
    save()
    if keep:  # the record notebooks read, with the GPU, versions and date (`course_lib.records`)
        from course_lib import records

        print(f"record -> {records.save_record('hopper_dq', record)}")
    rows = record["rows"]
    good = [r for r in rows if r.get("ok")]
    print(f"{len(good)} of {len(rows)} cells correct; {record['seconds']} s")
    if good:
        import math

        for key, what in (("ratio", "Triton (FUSE_D) / Gluon"), ("ratio_read_d", "Triton (reads D) / Gluon")):
            geomean = math.exp(sum(math.log(r[key]) for r in good) / len(good))
            print(f"{what}: geomean {geomean:.3f}, min {min(r[key] for r in good):.3f}")
    return 0 if len(good) == len(rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON to this path")
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90 only (no GPU needed)")
    parser.add_argument("--variants", action="store_true", help="also the VARIANTS (timed on the GPU)")
    parser.add_argument(
        "--record", action="store_true", help="also save the record `hopper_dq` in assets/benchmarks/"
    )
    parser.add_argument(
        "--hang-s", type=float, default=120.0, help="seconds after which a cell counts as hung"
    )
    args = parser.parse_args(argv)
    if args.compile_only:
        rows = compile_only(args.variants)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
        return 0 if all(r["ok"] for r in rows) else 1
    if not runtime.ON_GPU or torch.cuda.get_device_capability()[0] != 9:
        print("hopper_dq_probe: needs a Hopper GPU (compute capability 9.x); --compile-only runs anywhere")
        return 2
    return probe(args.out, args.variants, args.hang_s, keep=args.record)


if __name__ == "__main__":
    sys.exit(main())
