"""How much of the communication a profiler trace shows hidden behind compute (notebook 13).

A GPU trace from `torch.profiler` (exported with `export_chrome_trace`) lists every kernel with its
stream, start and duration. NCCL's send/receive kernels run on their own stream; ring attention hides
them when they run while an attention kernel runs on the compute stream.
"""

from __future__ import annotations

import json
from pathlib import Path


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, non-overlapping cover of the given (start, end) intervals."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(xs, ys) -> float:
    """Total length of the intersection of two unions of intervals."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_summary(trace: str | Path | dict, max_intervals: int = 300) -> dict:
    """Compute and communication time in a chrome trace of GPU kernels, and how much of it overlaps.

    trace: the JSON file written by `prof.export_chrome_trace` (or its parsed dict). Kernels whose
    name contains "nccl" count as communication, all others as compute. Returns (times in ms):
    compute_ms, comm_ms (busy time: the union of the kernels' intervals), overlapped_ms (communication
    while compute runs), hidden_fraction (overlapped / comm), span_ms, and "timeline": up to
    max_intervals (start, end) intervals per kind, relative to the first kernel, for a picture."""
    if not isinstance(trace, dict):
        trace = json.loads(Path(trace).read_text())
    compute, comm = [], []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") != "kernel":
            continue
        start, end = float(e["ts"]) / 1e3, (float(e["ts"]) + float(e.get("dur", 0))) / 1e3  # us -> ms
        (comm if "nccl" in e.get("name", "").lower() else compute).append((start, end))
    if not compute and not comm:
        raise ValueError(
            "overlap_summary: the trace holds no GPU kernels (was it recorded with CUDA activity?)"
        )
    compute, comm = _union(compute), _union(comm)
    t0 = min(iv[0][0] for iv in (compute, comm) if iv)
    t1 = max(iv[-1][1] for iv in (compute, comm) if iv)
    overlapped = _intersection(compute, comm)
    comm_ms = _length(comm)

    def coarse(intervals):
        # merge the shortest gaps until few enough intervals are left to draw
        iv = [(a - t0, b - t0) for a, b in intervals]
        while len(iv) > max_intervals:
            gaps = sorted(iv[i + 1][0] - iv[i][1] for i in range(len(iv) - 1))
            cut = gaps[len(iv) - max_intervals - 1]
            merged = [iv[0]]
            for a, b in iv[1:]:
                if a - merged[-1][1] <= cut:
                    merged[-1] = (merged[-1][0], b)
                else:
                    merged.append((a, b))
            iv = merged
        return [[round(a, 4), round(b, 4)] for a, b in iv]

    return {
        "compute_ms": _length(compute),
        "comm_ms": comm_ms,
        "overlapped_ms": overlapped,
        "hidden_fraction": overlapped / comm_ms if comm_ms else 1.0,
        "span_ms": t1 - t0,
        "timeline": {"compute": coarse(compute), "comm": coarse(comm)},
    }
