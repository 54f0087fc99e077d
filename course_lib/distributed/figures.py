"""The pictures of notebook 13: causal work per rank, the two-GPU benchmark, and a profiler timeline.

Every function takes plain numbers (from `plan.work_per_rank`, a gloo run, or the `ring` record of
scripts/ring_bench.py) and returns a matplotlib Figure.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from ..perf.plotting import FONT


def work_figure(panels: dict[str, list[list[float]]], unit: str, title: str):
    """Stacked bars of work per rank, one colour per ring step, one panel per sharding scheme.

    panels: {"contiguous": work[rank][step], "zigzag": ...}; unit: the y-axis label."""
    fig, axes = plt.subplots(
        1, len(panels), figsize=(min(9.2, 4.6 * len(panels)), 4.6), layout="constrained", sharey=True
    )
    axes = np.atleast_1d(axes)
    for ax, (scheme, work) in zip(axes, panels.items()):
        work = np.asarray(work, dtype=float)
        bottom = np.zeros(work.shape[0])
        for s in range(work.shape[1]):
            ax.bar(range(work.shape[0]), work[:, s], bottom=bottom, label=f"step {s}")
            bottom += work[:, s]
        ax.set_xticks(range(work.shape[0]))
        ax.set_xlabel("rank", fontsize=FONT["label"])
        ax.set_title(f"{scheme}: max/mean = {bottom.max() / bottom.mean():.2f}", fontsize=FONT["label"])
        ax.tick_params(labelsize=FONT["ticks"])
        ax.grid(True, axis="y", alpha=0.35)
    axes[0].set_ylabel(unit, fontsize=FONT["label"])
    axes[-1].legend(fontsize=FONT["legend"] - 2)
    fig.suptitle(title, fontsize=FONT["title"])
    return fig


def speedup_figure(data: dict, source: str):
    """Throughput of each two-GPU method over one GPU, per total length N (bars; 2.0 is perfect)."""
    rows = data["rows"]
    methods = [
        ("zigzag_s", "ring, zigzag"),
        ("contiguous_s", "ring, contiguous"),
        ("context_parallel_s", "torch CP"),
    ]
    fig, ax = plt.subplots(figsize=(9.0, 5), layout="constrained")
    width = 0.8 / len(methods)
    for i, (key, name) in enumerate(methods):
        vals = [r["one_gpu_s"] / r[key] if r.get(key) and r.get("one_gpu_s") else np.nan for r in rows]
        ax.bar(np.arange(len(rows)) + (i - 1) * width, vals, width, label=name)
    ax.axhline(2.0, color="k", ls="--", lw=1, label="perfect (2 GPUs)")
    ax.axhline(1.8, color="grey", ls=":", lw=1, label="target 1.8x")
    ax.set_xticks(range(len(rows)), [f"{r['N'] // 1024}k" for r in rows])
    ax.set_xlabel("total sequence length N (tokens)", fontsize=FONT["label"])
    ax.set_ylabel("throughput over one GPU (x)", fontsize=FONT["label"])
    ax.set_title(f"Causal fwd+bwd on 2 GPUs vs 1\n({source})", fontsize=FONT["title"] - 2)
    ax.tick_params(labelsize=FONT["ticks"])
    ax.legend(fontsize=FONT["legend"] - 1)
    ax.grid(True, axis="y", alpha=0.35)
    return fig


def timeline_figure(summary: dict, title: str):
    """Compute and communication kernels of one traced step as bars on a time axis (ms)."""
    fig, ax = plt.subplots(figsize=(9.2, 2.8), layout="constrained")
    for y, (kind, colour) in enumerate((("compute", "tab:blue"), ("comm", "tab:orange"))):
        spans = [(a, b - a) for a, b in summary["timeline"][kind]]
        ax.broken_barh(spans, (y - 0.35, 0.7), color=colour)
    ax.set_yticks([0, 1], ["attention kernels", "NCCL send/recv"])
    ax.set_xlabel("time since the first kernel (ms)", fontsize=FONT["label"])
    ax.set_title(title, fontsize=FONT["title"] - 2)
    ax.tick_params(labelsize=FONT["ticks"])
    ax.grid(True, axis="x", alpha=0.35)
    return fig


def record_figures(data: dict, source: str = "measured") -> dict:
    """{"speedup": ..., "trace": ...} figures of one `ring` record's data."""
    t = data["trace"]["ranks"][0]
    return {
        "speedup": speedup_figure(data, source),
        "trace": timeline_figure(
            t,
            f"One zigzag fwd+bwd, N={data['trace']['N'] // 1024}k, rank 0: "
            f"{100 * t['hidden_fraction']:.0f}% of {t['comm_ms']:.1f} ms of NCCL under compute",
        ),
    }
