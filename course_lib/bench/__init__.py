"""The attention benchmark behind `make bench`, the optimisation ladder, and notebook 08's plots.

Taught in notebook 08. On a GPU, `main` measures the standard shapes of the FlashAttention papers
(bf16, B·N = 16384 tokens, H·d = 2048, N from 1k to 16k, d in {64, 128}, causal and not; layout
(B, H, N, d)) for:
- course_lib's Triton FlashAttention-2 (`course_lib.flash_attention`);
- `scaled_dot_product_attention` as PyTorch chooses, and with each backend forced through
  `torch.nn.attention.sdpa_kernel` (a backend that refuses a shape is recorded as unsupported);
- standard attention (`course_lib.attention.reference.attention`, notebook 02) in eager PyTorch and under
  `torch.compile`, skipped where its N x N score matrices would be too large;
each for the forward, the backward and both, as TFLOP/s by the papers' convention
(`timing.attention_flops`) and peak memory (`timing.peak_memory`). It then measures the optimisation
ladder (`ladder`), runs the other recorders (`hardware`, `profiling`), saves every record with
`records.save_record`, draws PNG plots next to the records and prints the ratio table with the targets.

A record's `data["results"]` is a flat list, one entry per (provider, cell, mode):
    {"provider", "B", "H", "N", "d", "causal", "mode", "status": "ok" | "unsupported" | "skipped" |
     "oom" | "error", "ms", "tflops", "peak_bytes", "ideal_bytes", "reason"}
`peak_bytes` counts the inputs (q, k, v, and dO for a backward) plus the most allocated while the call
ran; `ideal_bytes` is what the call cannot avoid: inputs + outputs (+ gradients).
"""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .. import records, runtime
from ..perf import timing
from ..attention import reference

TOKENS = 16384  # B * N: the batch shrinks as the sequence grows, so every cell has the same tokens
MODEL_DIM = 2048  # H * d: 32 heads of 64 or 16 heads of 128
SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
MODES = ("fwd", "bwd", "fwd_bwd")
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
MODE_NAMES = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward + backward"}

# Standard attention writes B·H·N·N fp32 scores to HBM (and a backward keeps about 3x that alive).
# Past this size eager and compiled standard attention are recorded as skipped: at N = 16k they would
# need tens of GB and minutes, and the point (they grow as N², a fused kernel does not) is made by then.
MAX_SCORE_BYTES = 8 * 2**30

SDPA_BACKENDS = {
    "sdpa_default": None,
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
}
PROVIDERS = ("course_lib", *SDPA_BACKENDS, "eager", "compiled")
LABELS = {
    "course_lib": "course_lib (Triton FA-2)",
    "sdpa_default": "SDPA default",
    "sdpa_flash": "SDPA FLASH_ATTENTION",
    "sdpa_efficient": "SDPA EFFICIENT_ATTENTION",
    "sdpa_cudnn": "SDPA CUDNN_ATTENTION",
    "eager": "standard, eager",
    "compiled": "standard, torch.compile",
}

# The ratio table: course_lib's TFLOP/s over a baseline's, per cell.
RATIO_COLUMNS = (
    ("fwd", "sdpa_flash"),
    ("fwd", "sdpa_default"),
    ("fwd_bwd", "sdpa_flash"),
    ("fwd_bwd", "sdpa_default"),
)
# (what, mode, baseline, statistic over the cells, threshold): course_lib / baseline must reach it.
TARGETS = (
    ("forward >= 1.0x SDPA FLASH_ATTENTION in every cell", "fwd", "sdpa_flash", "min", 1.0),
    ("forward >= 0.9x SDPA default on the geometric mean", "fwd", "sdpa_default", "geomean", 0.9),
    ("fwd+bwd >= 1.0x SDPA FLASH_ATTENTION in every cell", "fwd_bwd", "sdpa_flash", "min", 1.0),
)
MEMORY_TARGET = 1.10  # fwd+bwd peak at the largest N <= 1.1 x (inputs + outputs + gradients)


# ----------------------------------------------------------------------------------------------------
# The grid and the providers
# ----------------------------------------------------------------------------------------------------


def standard_cells(quick: bool = False, on_gpu: bool | None = None) -> list[dict]:
    """The cells (B, H, N, d, causal) of the benchmark: the papers' shapes on a GPU; with `quick`, a
    few of them (GPU) or tiny ones that the Triton interpreter runs in seconds (CPU)."""
    on_gpu = runtime.ON_GPU if on_gpu is None else on_gpu
    if not on_gpu:
        return [dict(B=1, H=2, N=n, d=32, causal=c) for c in (False, True) for n in (32, 64)]
    seq_lens = (1024, 2048) if quick else SEQ_LENS
    return [
        dict(B=TOKENS // n, H=MODEL_DIM // d, N=n, d=d, causal=c)
        for d in HEAD_DIMS
        for c in (False, True)
        for n in seq_lens
    ]


def attention_fns(on_gpu: bool | None = None) -> dict:
    """provider -> f(q, k, v, causal) -> O, for q, k, v of shape (B, H, N, d). `compiled` only on a GPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ..attention import flash_attention

    on_gpu = runtime.ON_GPU if on_gpu is None else on_gpu

    def sdpa(backend):
        def f(q, k, v, causal):
            if backend is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return f

    fns = {"course_lib": lambda q, k, v, causal: flash_attention(q, k, v, causal=causal)}
    fns.update({name: sdpa(backend) for name, backend in SDPA_BACKENDS.items()})
    fns["eager"] = lambda q, k, v, causal: reference.attention(q, k, v, causal=causal)
    if on_gpu:
        # Built on first use, so that nothing of torch.compile is loaded while the others are measured.
        compiled = []

        def compiled_attention(q, k, v, causal):
            if not compiled:
                # Inductor compiles in a pool of worker processes that can still be busy while the next
                # provider is timed; small calls are sensitive to CPU contention: compile in this process.
                import torch._inductor.config as inductor_config

                inductor_config.compile_threads = 1
                # dynamic=True: one graph for every (B, H, N, d), instead of a recompilation per shape.
                compiled.append(torch.compile(reference.attention, dynamic=True))
            return compiled[0](q, k, v, causal=causal)

        fns["compiled"] = compiled_attention
    return fns


def skip_reason(provider: str, cell: dict, available) -> str | None:
    """Why `provider` is not measured on `cell` (None: it is)."""
    if provider not in available:
        return "torch.compile is left out on the CPU (it would time compiled CPU code, not a GPU kernel)"
    if provider in ("eager", "compiled"):
        score_bytes = cell["B"] * cell["H"] * cell["N"] ** 2 * 4
        if score_bytes > MAX_SCORE_BYTES:
            return (
                f"fp32 scores B*H*N*N would take {score_bytes / 2**30:.0f} GiB "
                f"(cap {MAX_SCORE_BYTES / 2**30:.0f} GiB)"
            )
    return None


# ----------------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------------


# do_bench's budget per measurement (ms of warm-up, ms of timed repetitions): about 400 measurements
# make the grid, so this decides much of `make bench`'s run time. 50 ms is >= 40 repetitions of a
# kernel of a millisecond or less, plenty for a stable median.
TIMER_MS = {False: (10, 50), True: (5, 20)}


def _timer(quick: bool):
    warmup, rep = TIMER_MS[quick]
    return lambda fn: timing.benchmark(fn, warmup_ms=warmup, rep_ms=rep, cpu_reps=1 if quick else 3)


def _timer_name(quick: bool) -> str:
    if not runtime.ON_GPU:
        return "wall-clock median (CPU)"
    return "triton.testing.do_bench median, L2 flushed (warm-up {} ms, {} ms of repetitions)".format(
        *TIMER_MS[quick]
    )


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _measure(call, resident: int, ideal: int, timer, provider: str) -> dict:
    """One mode of one provider: {"status": "ok", "ms", "peak_bytes", "ideal_bytes"} or a failure.

    `resident`: bytes already allocated that the call needs (its inputs); peak_memory adds what the
    call allocates on top of everything allocated before it."""
    try:
        call()  # warm-up: compilation, autotuning, the backend's choice; never timed
        if runtime.ON_GPU:
            torch.cuda.synchronize()
        peak = timing.peak_memory(call)
        ms = timer(call)
    except Exception as exc:  # a refused shape, an OOM: recorded, never a crash of the whole run
        status, reason = _failure(exc, provider)
        return dict(status=status, reason=reason)
    finally:
        if runtime.ON_GPU:
            torch.cuda.empty_cache()
    return dict(status="ok", ms=ms, peak_bytes=None if peak is None else resident + peak, ideal_bytes=ideal)


def measure_provider(fn, q, k, v, do, causal: bool, timer, provider: str = "") -> dict:
    """Time and peak memory of `fn` for the forward, the backward and both; mode -> `_measure`'s dict.

    q, k, v: (B, H, N, d) with requires_grad; do: (B, H, N, d), the gradient of O. The forward runs
    under no_grad; the backward alone backpropagates through one forward kept alive for it."""
    size = _nbytes(q)  # one (B, H, N, d) tensor

    def fwd():
        with torch.no_grad():
            return fn(q, k, v, causal)

    def fwd_bwd():
        return torch.autograd.grad(fn(q, k, v, causal), (q, k, v), do)

    # What each mode cannot avoid holding: q, k, v, O (forward); also dO, dQ, dK, dV (with a backward).
    out = {
        "fwd": _measure(fwd, 3 * size, 4 * size, timer, provider),
        "fwd_bwd": _measure(fwd_bwd, 4 * size, 8 * size, timer, provider),
    }
    try:
        before = torch.cuda.memory_allocated() if runtime.ON_GPU else 0
        o = fn(q, k, v, causal)  # O and what the forward saved for the backward stay resident
        saved = torch.cuda.memory_allocated() - before if runtime.ON_GPU else 0
    except Exception as exc:
        status, reason = _failure(exc, provider)
        out["bwd"] = dict(status=status, reason=reason)
    else:
        bwd = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        out["bwd"] = _measure(bwd, 4 * size + saved, 8 * size, timer, provider)
        del o, bwd
    return out


def _failure(exc: BaseException, provider: str) -> tuple[str, str]:
    """(status, reason) for an exception raised while measuring `provider`."""
    message = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "oom", message
    if provider in SDPA_BACKENDS and isinstance(exc, RuntimeError):
        return "unsupported", message  # "No available kernel": the backend refused this shape or GPU
    return "error", f"{type(exc).__name__}: {message}"


def run_attention(quick: bool = False) -> dict:
    """Measure every provider on every cell (see the module docstring); returns the record's data."""
    on_gpu = runtime.ON_GPU
    dtype = torch.bfloat16 if on_gpu else torch.float32  # the interpreter has no bf16 arithmetic
    cells = standard_cells(quick)
    fns = attention_fns()
    timer = _timer(quick)
    results, seconds = [], dict.fromkeys(PROVIDERS, 0.0)
    jobs = [(cell, p) for cell in cells for p in PROVIDERS]
    bar = tqdm(total=len(jobs), desc="attention", unit="run")
    # torch.compile leaves state behind in the process (dynamo, inductor's caches and graphs), and after it
    # has run, the per-call CPU cost of Python-launched kernels rose 1.3-1.5x (notes/performance.md). So it
    # is measured in a second pass, after every other provider has been measured on every cell.
    passes = [[p for p in PROVIDERS if p != "compiled"], ["compiled"]]
    for providers, cell in ((group, cell) for group in passes for cell in cells):
        B, H, N, d, causal = (cell[key] for key in ("B", "H", "N", "d", "causal"))
        # Fresh random inputs per cell: never zeros (zeros hide bugs, and some kernels run faster on them).
        q, k, v, do = (torch.randn(B, H, N, d, device=runtime.DEVICE, dtype=dtype) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_(True)
        try:  # the output every provider is compared with
            with torch.no_grad():
                o_ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal).float()
        except Exception:
            o_ref = None
        for provider in providers:
            bar.set_postfix_str(f"{provider} N={N} d={d} causal={causal}")
            t0 = time.perf_counter()
            base = dict(provider=provider, **cell)
            reason = skip_reason(provider, cell, fns)
            if reason is not None:
                results += [dict(base, mode=m, status="skipped", reason=reason) for m in MODES]
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # SDPA warns about every backend it cannot use
                    try:
                        with torch.no_grad():  # first call: also checks the output against SDPA's
                            o = fns[provider](q, k, v, causal).float()
                            err = None if o_ref is None else float((o - o_ref).abs().max())
                            del o
                    except Exception as exc:
                        status, why = _failure(exc, provider)
                        measured = dict.fromkeys(MODES, dict(status=status, reason=why))
                    else:
                        measured = measure_provider(fns[provider], q, k, v, do, causal, timer, provider)
                for m in MODES:
                    entry = dict(base, mode=m, **measured[m])
                    if entry["status"] == "ok":
                        flops = timing.attention_flops(B, H, N, N, d, causal=causal, mode=m)
                        entry.update(tflops=flops / (entry["ms"] * 1e-3) / 1e12, max_abs_diff_vs_sdpa=err)
                    results.append(entry)
            if on_gpu:
                torch.cuda.empty_cache()
            seconds[provider] += time.perf_counter() - t0
            bar.update()
        del q, k, v, do, o_ref
    bar.close()
    data = dict(
        dtype=str(dtype).replace("torch.", ""),
        layout="(B, H, N, d)",
        tokens=None if not on_gpu else TOKENS,
        model_dim=None if not on_gpu else MODEL_DIM,
        quick=quick,
        timer=_timer_name(quick),
        seconds_per_provider={p: round(t, 1) for p, t in seconds.items()},
        max_score_bytes=MAX_SCORE_BYTES,
        providers=list(PROVIDERS),
        labels=LABELS,
        cells=cells,
        results=results,
    )
    data["ratios"] = ratio_rows(data)
    data["summary"] = {
        col: dict(zip(("min", "geomean"), summarise(r[col] for r in data["ratios"]))) for col in _cols()
    }
    data["targets"] = check_targets(data)
    return data


# ----------------------------------------------------------------------------------------------------
# Ratios and targets (pure functions of a record's data: tested without a GPU)
# ----------------------------------------------------------------------------------------------------


def _cols() -> list[str]:
    return [f"{mode}/{base}" for mode, base in RATIO_COLUMNS]


def lookup(data: dict, provider: str, mode: str, d: int, causal: bool, N: int) -> dict | None:
    """The result entry of one provider, mode and cell, or None."""
    for r in data["results"]:
        if (r["provider"], r["mode"], r["d"], r["causal"], r["N"]) == (provider, mode, d, causal, N):
            return r
    return None


def tflops_of(data: dict, provider: str, mode: str, d: int, causal: bool, N: int) -> float | None:
    """TFLOP/s of one measurement, None when it was not measured (skipped, unsupported, OOM)."""
    r = lookup(data, provider, mode, d, causal, N)
    return r.get("tflops") if r is not None and r["status"] == "ok" else None


def ratios(data: dict, mode: str, baseline: str) -> list[float | None]:
    """course_lib's TFLOP/s over `baseline`'s, per cell of data["cells"]; None where either is missing."""
    out = []
    for c in data["cells"]:
        ours = tflops_of(data, "course_lib", mode, c["d"], c["causal"], c["N"])
        theirs = tflops_of(data, baseline, mode, c["d"], c["causal"], c["N"])
        out.append(ours / theirs if ours and theirs else None)
    return out


def ratio_rows(data: dict) -> list[dict]:
    """Per cell: d, causal, N and course_lib's TFLOP/s over each baseline's, for the columns of
    RATIO_COLUMNS (keys "fwd/sdpa_flash", ...); None where either figure is missing."""
    rows = [dict(d=c["d"], causal=c["causal"], N=c["N"]) for c in data["cells"]]
    for mode, base in RATIO_COLUMNS:
        for row, r in zip(rows, ratios(data, mode, base)):
            row[f"{mode}/{base}"] = r
    return rows


def summarise(values) -> tuple[float | None, float | None]:
    """(minimum, geometric mean) of the values that are not None; (None, None) if there are none."""
    vals = [float(x) for x in values if x is not None]
    if not vals:
        return None, None
    return min(vals), math.exp(sum(math.log(x) for x in vals) / len(vals))


def check_targets(data: dict) -> list[dict]:
    """Each target with its measured value and `met` (True / False; None when nothing was measured)."""
    rows = ratio_rows(data)
    out = []
    for what, mode, base, stat, threshold in TARGETS:
        values = [r[f"{mode}/{base}"] for r in rows]
        lo, geo = summarise(values)
        value = lo if stat == "min" else geo
        met = None if value is None else value >= threshold
        detail = f"{stat} {value:.4f}x" if value is not None else "not measured"
        # A cell where the baseline ran but course_lib did not (an error, an OOM) fails the target.
        ours_missing = sum(
            tflops_of(data, "course_lib", mode, c["d"], c["causal"], c["N"]) is None
            and tflops_of(data, base, mode, c["d"], c["causal"], c["N"]) is not None
            for c in data["cells"]
        )
        if ours_missing:
            met = False
            detail += f"; course_lib has no figure in {ours_missing} cell(s) where the baseline has one"
        elif value is not None and None in values:
            detail += f" ({values.count(None)} of {len(values)} cells without a baseline figure)"
        out.append(dict(target=what, value=value, met=met, detail=detail))
    n_max = max(c["N"] for c in data["cells"])
    worst = None
    for c in data["cells"]:
        r = lookup(data, "course_lib", "fwd_bwd", c["d"], c["causal"], c["N"])
        if c["N"] == n_max and r is not None and r["status"] == "ok" and r.get("peak_bytes"):
            worst = max(worst or 0.0, r["peak_bytes"] / r["ideal_bytes"])
    out.append(
        dict(
            target=f"fwd+bwd peak memory at N={n_max} within {MEMORY_TARGET - 1:.0%} "
            "of inputs + outputs + gradients",
            value=worst,
            met=None if worst is None else worst <= MEMORY_TARGET,
            detail="not measured" if worst is None else f"worst {worst:.3f}x of the unavoidable bytes",
        )
    )
    return out


def format_report(data: dict) -> str:
    """The ratio table (per cell, then min and geometric mean per column) and the targets, as text."""
    rows, targets = ratio_rows(data), check_targets(data)
    names = {
        "fwd/sdpa_flash": "fwd/FLASH",
        "fwd/sdpa_default": "fwd/default",
        "fwd_bwd/sdpa_flash": "f+b/FLASH",
        "fwd_bwd/sdpa_default": "f+b/default",
    }
    cols = _cols()
    fmt = lambda x: f"{x:>11.2f}x" if x is not None else f"{'-':>12}"
    lines = [
        "course_lib TFLOP/s / SDPA TFLOP/s (f+b = forward + backward; - = not measured)",
        f"{'d':>4} {'causal':>6} {'N':>6} " + "".join(f"{names[c]:>12}" for c in cols),
    ]
    for r in rows:
        lines.append(
            f"{r['d']:>4} {('yes' if r['causal'] else 'no'):>6} {r['N']:>6} "
            + "".join(fmt(r[c]) for c in cols)
        )
    for i, stat in enumerate(("min", "geomean")):
        lines.append(f"{stat:>18} " + "".join(fmt(summarise(r[c] for r in rows)[i]) for c in cols))
    lines.append("targets:")
    for t in targets:
        mark = {True: "met   ", False: "MISSED", None: "n/a   "}[t["met"]]
        lines.append(f"  [{mark}] {t['target']}: {t['detail']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# The optimisation ladder: from notebook 06/07's straightforward kernels to course_lib's tuned ones
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One rung: the kernel configuration it measures, and the gain over the rung below predicted from
    bytes and FLOPs before measuring (at the ladder's shape: d = 128, N = 4096, causal, bf16)."""

    name: str
    pass_: str  # "fwd" (forward.forward) or "bwd" (backward.backward)
    config: dict | None  # None = course_lib's tuned default (autotuned on a GPU)
    predicted: float
    reason: str
    dq_mode: str = "two_kernel"


FWD0 = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1, exp2=False, skip_masked_blocks=False)
FWD1 = dict(FWD0, exp2=True)
FWD2 = dict(FWD1, skip_masked_blocks=True)
FWD3 = dict(FWD2, BLOCK_M=128, num_warps=8)
FWD4 = dict(FWD3, num_stages=3)
# The backward's BLOCK_M, BLOCK_N apply to both kernels; BLOCK_M1/BLOCK_N1 (dK/dV kernel: BLOCK_N1 key
# rows stay on chip) and BLOCK_M2/BLOCK_N2 (dQ kernel: BLOCK_M2 query rows stay on chip) override them.
BWD0 = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1, exp2=False, skip_masked_blocks=False)
BWD1 = dict(BWD0, exp2=True)
BWD2 = dict(BWD1, skip_masked_blocks=True)
BWD3 = dict(BWD2, BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64, num_warps=8)
BWD4 = dict(BWD3, num_stages=3)

# Each rung: (name, pass, config, predicted gain over the rung below, why, from bytes and FLOPs).
# The shape: d = 128, N = 4096, causal, bf16, B*H = 64; with 64 x 64 tiles, 64 x 64 = 4096 tiles per head.
# fmt: off
LADDER = (
    Step("straightforward forward (nb 06)", "fwd", FWD0, 1.0,
         "the start: natural exp, every tile computed and masked, 64x64 tiles, no software pipelining"),
    Step("base-2 exponentials", "fwd", FWD1, 1.06,
         "exp(x) = ex2(x log2 e): log2 e folds into the scale, 1 of ~6 FP32 ops per score (~1/3 of time)"),
    Step("skip fully masked tiles", "fwd", FWD2, 1.9,
         "causal: only 2080 of 4096 tiles reach the diagonal: 1.97x fewer, less the diagonal's masking"),
    Step("BLOCK_M 128 on 8 warps", "fwd", FWD3, 1.3,
         "a K/V tile serves 128 queries: 128 FLOP per K/V byte instead of 64 (H200 ridge ~190); 8 warps "
         "keep the 128 x d fp32 accumulator in registers (4 warps would spill it)"),
    Step("3 pipeline stages", "fwd", FWD4, 1.25,
         "the next K/V tile loads while the tensor cores work on this one: hides ~20% of load waits"),
    Step("autotuned (Triton)", "fwd", {"hopper": False}, 1.05,
         "the best of several configs for this shape; the hand-picked one is already close"),
    Step("warp-specialised (Gluon, Hopper; course_lib)", "fwd", None, 1.2,
         "a producer warp loads, two consumer warpgroups take turns on the tensor cores: the softmax "
         "(~1/3 of a step at d = 128) overlaps products instead of following them; less barriers, short tiles"),
    Step("straightforward backward (nb 07)", "bwd", BWD0, 1.0,
         "the start: two kernels (dQ with D, then dK, dV), natural exp, every tile, 64x64, no pipelining"),
    Step("base-2 exponentials", "bwd", BWD1, 1.03,
         "P = exp(S - L) once per tile against 2.5x the forward's matmuls: a smaller share than there"),
    Step("skip fully masked tiles", "bwd", BWD2, 1.9,
         "causal: about half of the tiles are fully masked, in both kernels"),
    Step("tall resident blocks, 8 warps", "bwd", BWD3, 1.3,
         "128 resident rows (K, V in dK/dV; Q, dO in dQ) halve the re-reads of the streamed operands; "
         "8 warps hold their fp32 accumulators without spilling"),
    Step("3 pipeline stages", "bwd", BWD4, 1.2,
         "the next streamed tile loads during this one's 4 (dK/dV) or 3 (dQ) matmuls"),
    Step("autotuned (course_lib)", "bwd", None, 1.05,
         "the best of several configs for this shape"),
    Step("one pass, atomic dQ", "bwd", None, 1.2,
         "5 tile matmuls, not 7 (S, dP not recomputed for dQ): 1.4x, less fp32 atomic adds to dQ",
         dq_mode="atomic"),
)
# fmt: on


def ladder(quick: bool = False, N: int = 4096, d: int = 128, causal: bool = True, steps=LADDER) -> dict:
    """Measure each step of the optimisation ladder (forward steps through `forward.forward`, backward
    steps through `backward.backward`, with their `config=` switches) on one shape: B·N = 16384
    tokens, H·d = 2048, bf16 on a GPU (tiny fp32 on the CPU, where the timings mean nothing).

    Returns the ladder record's data: the shape, and per step its configuration, predicted gain,
    measured time, TFLOP/s (backward: 2.5x the forward FLOPs), measured gain over the previous step
    of the same pass, and the largest difference of its output from the tuned kernel's."""
    from ..attention import backward, forward

    if runtime.ON_GPU:
        B, H, dtype = TOKENS // N, MODEL_DIM // d, torch.bfloat16
    else:
        B, H, N, d, dtype = 1, 2, 64, 32, torch.float32
    Z, scale, timer = B * H, d**-0.5, _timer(quick)
    q3, k3, v3, do3 = (torch.randn(Z, N, d, device=runtime.DEVICE, dtype=dtype) for _ in range(4))
    o3, L3 = forward.forward(q3, k3, v3, causal, scale)
    tuned_grads = backward.backward(do3, q3, k3, v3, o3, L3, causal, scale)
    out, previous = [], {}
    for step in tqdm(steps, desc="ladder", unit="step"):
        entry = dict(
            name=step.name,
            pass_=step.pass_,
            config=step.config,
            dq_mode=step.dq_mode,
            predicted_gain=step.predicted,
            reason=step.reason,
        )
        if step.pass_ == "fwd":
            fn = lambda s=step: forward.forward(q3, k3, v3, causal, scale, config=s.config)
            want = (o3,)
        else:
            fn = lambda s=step: backward.backward(
                do3, q3, k3, v3, o3, L3, causal, scale, config=s.config, dq_mode=s.dq_mode
            )
            want = tuned_grads
        try:
            got = fn()  # warm-up (compilation) and the output to compare
            got = got[:1] if step.pass_ == "fwd" else got
            entry["max_abs_diff_vs_tuned"] = max(
                float((a.float() - b.float()).abs().max()) for a, b in zip(got, want)
            )
            entry["ms"] = timer(fn)
        except Exception as exc:
            entry.update(status="error", reason_failed=f"{type(exc).__name__}: {str(exc)[:200]}")
            out.append(entry)
            continue
        flops = timing.attention_flops(B, H, N, N, d, causal=causal, mode=step.pass_)
        entry.update(status="ok", tflops=flops / (entry["ms"] * 1e-3) / 1e12)
        prev = previous.get(step.pass_)
        entry["measured_gain"] = None if prev is None else prev / entry["ms"]
        previous[step.pass_] = entry["ms"]
        out.append(entry)
    return dict(
        B=B,
        H=H,
        N=N,
        d=d,
        causal=causal,
        dtype=str(dtype).replace("torch.", ""),
        timer=_timer_name(quick),
        steps=out,
    )


# ----------------------------------------------------------------------------------------------------
# Plots (from records, so that CPU learners see the GPU's figures)
# ----------------------------------------------------------------------------------------------------


def credit(record: dict) -> str:
    """Where a record's figures come from: `records.label`, or a warning for a CPU smoke run."""
    if record["meta"].get("gpu") is None:
        return f"measured on the CPU, {record['meta']['date']}: interpreted kernels, the timings mean nothing"
    return records.label(record)


COLORS = {
    "course_lib": "tab:blue",
    "sdpa_default": "tab:orange",
    "sdpa_flash": "tab:green",
    "sdpa_efficient": "tab:red",
    "sdpa_cudnn": "tab:purple",
    "eager": "tab:brown",
    "compiled": "tab:pink",
}


def _style(ax, data: dict) -> None:
    """One colour per provider in every panel and figure; course_lib's line drawn thick, on top."""
    by_label = {data["labels"][p]: p for p in data["providers"]}
    for line in ax.get_lines():
        p = by_label.get(line.get_label())
        if p is not None:
            line.set_color(COLORS.get(p, "0.4"))
            if p == "course_lib":
                line.set_linewidth(3.5)
                line.set_zorder(5)
    if ax.get_legend() is not None:
        ax.get_legend().remove()


def _legend_below(fig, axes):
    """One legend for all panels, under them (per-panel legends hide the lines)."""
    handles = {}
    for ax in fig.axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    rows = math.ceil(len(handles) / 4)
    fig.tight_layout(rect=(0, (0.3 * rows + 0.15) / fig.get_figheight(), 1, 1))
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(4, len(handles)), fontsize=12,
               frameon=False)  # fmt: skip
    return fig


def _n_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def plot_tflops(record: dict, mode: str = "fwd"):
    """TFLOP/s against N for every provider, one panel per (d, causal); returns the Figure."""
    import matplotlib.pyplot as plt

    from ..perf.plotting import plot_series

    data = record["data"]
    heads = sorted({c["d"] for c in data["cells"]})
    fig, axes = plt.subplots(len(heads), 2, figsize=(14, 4.8 * len(heads) + 1.2), squeeze=False, sharex=True)
    for i, d in enumerate(heads):
        for j, causal in enumerate((False, True)):
            ns = sorted({c["N"] for c in data["cells"] if c["d"] == d and c["causal"] == causal})
            series = {}
            for p in data["providers"]:
                ys = [tflops_of(data, p, mode, d, causal, n) for n in ns]
                if any(y is not None for y in ys):
                    series[data["labels"][p]] = [math.nan if y is None else y for y in ys]
            ax = axes[i][j]
            plot_series(
                ns,
                series,
                xlabel="sequence length N",
                ylabel="TFLOP/s (higher is better)",
                title=f"d = {d}, {'causal' if causal else 'not causal'}",
                logx=True,
                ax=ax,
            )
            ax.set_xticks(ns, [_n_label(n) for n in ns])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            _style(ax, data)
    lo, geo = summarise(ratios(data, mode, "sdpa_flash"))
    finding = (
        "" if geo is None else f": course_lib at {geo:.2f}x SDPA FLASH_ATTENTION (geomean; min {lo:.2f}x)"
    )
    fig.suptitle(f"Attention {MODE_NAMES[mode]}, {data['dtype']}{finding}\n{credit(record)}", fontsize=14)
    return _legend_below(fig, axes)


def plot_memory(record: dict, d: int | None = None, causal: bool = False):
    """Peak memory (GB) against N, forward and forward + backward, for one d; returns the Figure."""
    import matplotlib.pyplot as plt

    from ..perf.plotting import plot_series

    data = record["data"]
    d = max(c["d"] for c in data["cells"]) if d is None else d
    ns = sorted({c["N"] for c in data["cells"] if c["d"] == d and c["causal"] == causal})
    fig, axes = plt.subplots(1, 2, figsize=(14, 6.2), squeeze=False)
    for ax, mode in zip(axes[0], ("fwd", "fwd_bwd")):
        series = {}
        for p in data["providers"]:
            rs = [lookup(data, p, mode, d, causal, n) for n in ns]
            ys = [
                r["peak_bytes"] / 1e9 if r and r["status"] == "ok" and r.get("peak_bytes") else math.nan
                for r in rs
            ]
            if not all(math.isnan(y) for y in ys):
                series[data["labels"][p]] = ys
        # What any implementation must hold: q, k, v, O (+ dO, dQ, dK, dV): 4 (8) tensors of B*H*N*d.
        cells = {c["N"]: c for c in data["cells"] if c["d"] == d and c["causal"] == causal}
        tensor_gb = [cells[n]["B"] * cells[n]["H"] * n * d * BYTES[data["dtype"]] / 1e9 for n in ns]
        unavoidable = "inputs + outputs" + (" + gradients" if mode == "fwd_bwd" else "")
        series[unavoidable] = [(4 if mode == "fwd" else 8) * x for x in tensor_gb]
        plot_series(ns, series, xlabel="sequence length N", ylabel="peak memory (GB)", title=MODE_NAMES[mode],
                    logx=True, logy=True, ax=ax)  # fmt: skip
        ax.set_xticks(ns, [_n_label(n) for n in ns])
        ax.minorticks_off()
        _style(ax, data)
        for line in ax.get_lines():
            if line.get_label() == unavoidable:
                line.set(color="black", linestyle="--", marker="")
    shape = f"{data['dtype']}, d = {d}, {'causal' if causal else 'not causal'}, B·N fixed"
    fig.suptitle(
        f"Peak memory: standard attention grows with N (N² per sequence), fused kernels stay at what\n"
        f"they must hold ({shape}) — {credit(record)}",
        fontsize=13,
    )
    return _legend_below(fig, axes)


def plot_ladder(record: dict):
    """Predicted and measured gain of each ladder step (left: forward, right: backward); returns the Figure"""
    import matplotlib.pyplot as plt

    from ..perf.plotting import bar_chart

    data = record["data"]
    fig, axes = plt.subplots(1, 2, figsize=(15, 6.2), squeeze=False)
    for ax, pass_ in zip(axes[0], ("fwd", "bwd")):
        steps = [s for s in data["steps"] if s["pass_"] == pass_][1:]  # the first rung has nothing below it
        ok = [s for s in data["steps"] if s["pass_"] == pass_ and s.get("status") == "ok"]
        span = f": {ok[0]['tflops']:.3g} -> {ok[-1]['tflops']:.3g} TFLOP/s" if len(ok) > 1 else ""
        gains = {
            "predicted": [s["predicted_gain"] for s in steps],
            "measured": [s.get("measured_gain") for s in steps],
        }
        title = f"{MODE_NAMES[pass_].capitalize()}{span}"
        bar_chart([s["name"] for s in steps], gains, xlabel="step (each over the one before)",
                  ylabel="gain over the step before (x)", title=title, ax=ax, fmt="{:.2f}")  # fmt: skip
        for bar in ax.containers[0]:
            bar.set_color("0.72")  # the prediction in grey, the measurement in colour
        ax.legend(fontsize=12)
        ax.axhline(1.0, color="black", lw=1)
        ax.tick_params(axis="x", labelrotation=25)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    causal = "causal" if data["causal"] else "not causal"
    shape = f"B={data['B']}, H={data['H']}, N={data['N']}, d={data['d']}, {causal}"
    title = f"The optimisation ladder, predicted and measured ({shape}, {data['dtype']})"
    fig.suptitle(f"{title}\n{credit(record)}", fontsize=13)
    fig.tight_layout()
    return fig


def save_plots(attention_path: Path | None, ladder_path: Path | None) -> list[Path]:
    """Draw the plots of the saved records and write them as PNGs next to them; returns the paths."""
    import matplotlib.pyplot as plt

    written = []

    def save(fig, path):
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    if attention_path is not None:
        rec = json.loads(Path(attention_path).read_text())
        for mode in MODES:
            save(plot_tflops(rec, mode), attention_path.with_name(f"{attention_path.stem}-{mode}.png"))
        save(plot_memory(rec), attention_path.with_name(f"{attention_path.stem}-memory.png"))
    if ladder_path is not None:
        save(plot_ladder(json.loads(Path(ladder_path).read_text())), ladder_path.with_suffix(".png"))
    return written


# ----------------------------------------------------------------------------------------------------
# `make bench`
# ----------------------------------------------------------------------------------------------------


def _hardware_record(quick: bool) -> dict:
    from ..perf import ceilings as hardware

    if not quick:
        return hardware.measure_record()
    return hardware.measure_record(
        copy_numel=2**20, matmul_n=256, rows=256, cols=256, matmul_sizes=(64, 128), fusion_numel=2**16
    )


def _standard_attention_record(quick: bool) -> dict:
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
        from .attention.precompile import precompile

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
