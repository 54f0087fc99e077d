"""Measuring one provider on one cell (time and peak memory of the forward, the backward and both), and
the whole grid: `run_attention`, the data of the attention record.

Taught in notebook 08. A record's `data["results"]` is a flat list, one entry per (provider, cell, mode):
    {"provider", "B", "H", "N", "d", "causal", "mode", "status": "ok" | "unsupported" | "skipped" |
     "oom" | "error", "ms", "tflops", "peak_bytes", "ideal_bytes", "reason"}
course_lib and SDPA's default (`PAIRED`) also carry "ms_passes" (and "graph_ms_passes"): their times taken in
turn, "ms" the median of them, and "first_ms" the time of the fixed-order pass (`paired_times`).
`peak_bytes` counts the inputs (q, k, v, and dO for a backward) plus the most allocated while the call
ran; `ideal_bytes` is what the call cannot avoid: inputs + outputs (+ gradients).
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .. import runtime
from ..perf import timing
from .providers import LABELS, PROVIDERS, SDPA_BACKENDS, attention_fns, skip_reason
from .report import check_targets, graph_summary, ratio_rows, report_columns, summarise
from .shapes import MAX_SCORE_BYTES, MODEL_DIM, MODES, TOKENS, standard_cells

# The timer's budget per measurement (ms of warm-up, ms of timed repetitions): about 400 measurements
# make the grid, so this decides much of `make bench`'s run time. 50 ms is >= 40 repetitions of a
# kernel of a millisecond or less, plenty for a stable median.
TIMER_MS = {False: (10, 50), True: (5, 20)}


def make_timer(quick: bool):
    """fn -> median ms: `perf.timing.benchmark` with the budget of TIMER_MS (quick or full run)."""
    warmup, rep = TIMER_MS[quick]
    return lambda fn: timing.benchmark(fn, warmup_ms=warmup, rep_ms=rep, cpu_reps=1 if quick else 3)


def timer_name(quick: bool) -> str:
    """How `make_timer(quick)` times, in words, for the record."""
    if not runtime.ON_GPU:
        return timing.describe()
    return "{} (warm-up {} ms, {} ms of repetitions)".format(timing.describe(), *TIMER_MS[quick])


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _graph_ms(call, timer) -> float | None:
    """The median time of `call` replayed as a CUDA graph (no host time between its kernels), or None
    where it cannot be captured (off the GPU; a provider that refuses capture)."""
    if not runtime.ON_GPU:
        return None
    try:
        replay = timing.graphed(call)
        ms = timer(replay)
    except Exception:
        return None
    finally:
        replay = None
        torch.cuda.empty_cache()
    return ms


def _measure(call, resident: int, ideal: int, timer, provider: str, graph: bool = False) -> dict:
    """One mode of one provider: {"status": "ok", "ms", "peak_bytes", "ideal_bytes"} or a failure; with
    graph=True also "graph_ms", the same call replayed as a CUDA graph (`_graph_ms`).

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
    out = dict(status="ok", ms=ms, peak_bytes=None if peak is None else resident + peak, ideal_bytes=ideal)
    if graph:
        out["graph_ms"] = _graph_ms(call, timer)
    return out


def _mode_calls(fn, q, k, v, do, causal: bool):
    """The forward (under no_grad) and the forward + backward of `fn` on these inputs, as calls to time."""

    def fwd():
        with torch.no_grad():
            return fn(q, k, v, causal)

    def fwd_bwd():
        return torch.autograd.grad(fn(q, k, v, causal), (q, k, v), do)

    return fwd, fwd_bwd


def measure_provider(fn, q, k, v, do, causal: bool, timer, provider: str = "") -> dict:
    """Time and peak memory of `fn` for the forward, the backward and both; mode -> `_measure`'s dict.

    q, k, v: (B, H, N, d) with requires_grad; do: (B, H, N, d), the gradient of O. The forward runs
    under no_grad; the backward alone backpropagates through one forward kept alive for it."""
    size = _nbytes(q)  # one (B, H, N, d) tensor
    fwd, fwd_bwd = _mode_calls(fn, q, k, v, do, causal)
    # What each mode cannot avoid holding: q, k, v, O (forward); also dO, dQ, dK, dV (with a backward).
    out = {
        "fwd": _measure(fwd, 3 * size, 4 * size, timer, provider, graph=provider != "compiled"),
        "fwd_bwd": _measure(fwd_bwd, 4 * size, 8 * size, timer, provider, graph=provider != "compiled"),
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


# The ratio the targets read (course_lib over SDPA's default) is timed in turn, `PAIR_PASSES` passes per mode
# (`paired_times`): timed once each, one after the other, SDPA's eager calls right after course_lib's ran 3-12 %
# faster than its own graph replays and than the same cuDNN kernels timed later (record of 2026-11-30, d = 128);
# in turn the two cuDNN providers agreed within 1 % (notes/attention.md).
PAIRED = ("course_lib", "sdpa_default")
PAIR_PASSES = {False: 4, True: 2}


def paired_times(fns: dict, providers, q, k, v, do, causal: bool, timer, passes: int) -> dict:
    """Medians of each provider's forward, backward and forward + backward (eager; forward and both also as
    CUDA-graph replays, on a GPU), all timed in turn over `passes` passes (`perf.timing.interleaved`): {provider:
    {mode: {"ms", "ms_passes"[, "graph_ms", "graph_ms_passes"]}}}. Inputs as `measure_provider`'s; each call
    ran before (warm). Each timing keeps nothing alive after it (a graph, or the forward a backward is timed
    through, is made for it and dropped), as in `measure_provider`."""

    def bwd_ms(fn):
        o = fn(q, k, v, causal)  # dropped on return
        return timer(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))

    calls = {}
    for p in providers:
        fwd, fwd_bwd = _mode_calls(fns[p], q, k, v, do, causal)
        calls[p, "fwd", "ms"] = lambda fwd=fwd: timer(fwd)
        calls[p, "fwd_bwd", "ms"] = lambda fwd_bwd=fwd_bwd: timer(fwd_bwd)
        calls[p, "bwd", "ms"] = lambda fn=fns[p]: bwd_ms(fn)
        if runtime.ON_GPU:
            calls[p, "fwd", "graph_ms"] = lambda fwd=fwd: _graph_ms(fwd, timer)
            calls[p, "fwd_bwd", "graph_ms"] = lambda fwd_bwd=fwd_bwd: _graph_ms(fwd_bwd, timer)
    times = timing.interleaved(calls, passes, timer=lambda timed: timed())
    out = {p: {} for p in providers}
    for (p, mode, key), ms in times.items():
        if None not in ms:  # a graph that could not be captured keeps `_measure`'s figure
            out[p].setdefault(mode, {}).update({key: statistics.median(ms), f"{key}_passes": ms})
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
    timer = make_timer(quick)
    results, seconds = [], dict.fromkeys(PROVIDERS, 0.0)
    jobs = [(cell, p) for cell in cells for p in PROVIDERS]
    bar = tqdm(total=len(jobs), desc="attention", unit="run")
    # torch.compile leaves state behind in the process (dynamo, inductor's caches and graphs), and after it
    # has run, the per-call CPU cost of Python-launched kernels rose 1.3-1.5x (notes/attention.md). So it
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
        entries = {}  # (provider, mode) -> this cell's result
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
                        entry.update(max_abs_diff_vs_sdpa=err)
                    entries[provider, m] = entry
                    results.append(entry)
            if on_gpu:
                torch.cuda.empty_cache()
            seconds[provider] += time.perf_counter() - t0
            bar.update()
        if all(entries.get((p, m), {}).get("status") == "ok" for p in PAIRED for m in MODES):
            t0 = time.perf_counter()
            paired = paired_times(fns, PAIRED, q, k, v, do, causal, timer, PAIR_PASSES[quick])
            for p in PAIRED:
                for m in MODES:  # the fixed-order timing kept beside the medians of the passes
                    first = {
                        f"first_{key}": entries[p, m][key]
                        for key in ("ms", "graph_ms")
                        if key in entries[p, m]
                    }
                    entries[p, m].update(first, **paired[p].get(m, {}))
            seconds["paired"] = seconds.get("paired", 0.0) + time.perf_counter() - t0
        for (_, m), entry in entries.items():
            if entry["status"] == "ok":
                flops = timing.attention_flops(B, H, N, N, d, causal=causal, mode=m)
                entry["tflops"] = flops / (entry["ms"] * 1e-3) / 1e12
                if entry.get("graph_ms"):
                    entry["graph_tflops"] = flops / (entry["graph_ms"] * 1e-3) / 1e12
        del q, k, v, do, o_ref
    bar.close()
    data = dict(
        dtype=str(dtype).replace("torch.", ""),
        layout="(B, H, N, d)",
        tokens=None if not on_gpu else TOKENS,
        model_dim=None if not on_gpu else MODEL_DIM,
        quick=quick,
        timer=timer_name(quick),
        paired=dict(providers=list(PAIRED), passes=PAIR_PASSES[quick]),
        seconds_per_provider={p: round(t, 1) for p, t in seconds.items()},
        max_score_bytes=MAX_SCORE_BYTES,
        providers=list(PROVIDERS),
        labels=LABELS,
        cells=cells,
        results=results,
    )
    data["ratios"] = ratio_rows(data)
    data["summary"] = {
        col: dict(zip(("min", "geomean"), summarise(r[col] for r in data["ratios"])))
        for col in report_columns()
    }
    data["graph_summary"] = graph_summary(data)
    data["targets"] = check_targets(data)
    return data
