"""Plots of the benchmark records (so that CPU learners see the GPU's figures): TFLOP/s against N per
provider, peak memory against N, the ladder's predicted and measured gains; `save_plots` writes them as
PNGs next to the records.

Taught in notebook 08.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .. import records
from .providers import LABELS
from .report import lookup, ratios, summarise, tflops_of
from .shapes import BYTES, MODE_NAMES, MODES


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


def label(data: dict, provider: str) -> str:
    """A provider's name in the plots: today's (`providers.LABELS`), whatever name the record was written with
    (course_lib's was "course_lib (Triton FA-2)" until its Hopper kernels were Gluon ones); the record's own for a
    provider no longer measured."""
    return LABELS.get(provider) or data["labels"][provider]


def _style(ax, data: dict) -> None:
    """One colour per provider in every panel and figure; course_lib's line drawn thick, on top."""
    by_label = {label(data, p): p for p in data["providers"]}
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
    renderer = fig.canvas.get_renderer()
    for ncol in range(min(4, len(handles)), 0, -1):  # as many columns as fit the figure's width
        legend = fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=ncol, fontsize=12,
                            frameon=False)  # fmt: skip
        if ncol == 1 or legend.get_window_extent(renderer).width <= fig.bbox.width - 10:
            break
        legend.remove()
    rows = math.ceil(len(handles) / ncol)
    fig.tight_layout(rect=(0, (0.3 * rows + 0.15) / fig.get_figheight(), 1, 1))
    return fig


def _n_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def plot_tflops(record: dict, mode: str = "fwd"):
    """TFLOP/s against N for every provider, one panel per (d, causal); returns the Figure."""
    import matplotlib.pyplot as plt

    from ..perf.plotting import plot_series

    data = record["data"]
    heads = sorted({c["d"] for c in data["cells"]})
    fig, axes = plt.subplots(len(heads), 2, figsize=(9.1, 4.4 * len(heads) + 1.4), squeeze=False, sharex=True)
    for i, d in enumerate(heads):
        for j, causal in enumerate((False, True)):
            ns = sorted({c["N"] for c in data["cells"] if c["d"] == d and c["causal"] == causal})
            series = {}
            for p in data["providers"]:
                ys = [tflops_of(data, p, mode, d, causal, n) for n in ns]
                if any(y is not None for y in ys):
                    series[label(data, p)] = [math.nan if y is None else y for y in ys]
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
        "" if geo is None else f":\ncourse_lib at {geo:.2f}x SDPA FLASH_ATTENTION (geomean; min {lo:.2f}x)"
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
    fig, axes = plt.subplots(1, 2, figsize=(9.1, 6.0), squeeze=False)
    for ax, mode in zip(axes[0], ("fwd", "fwd_bwd")):
        series = {}
        for p in data["providers"]:
            rs = [lookup(data, p, mode, d, causal, n) for n in ns]
            ys = [
                r["peak_bytes"] / 1e9 if r and r["status"] == "ok" and r.get("peak_bytes") else math.nan
                for r in rs
            ]
            if not all(math.isnan(y) for y in ys):
                series[label(data, p)] = ys
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
        # Two different floors, so two different black lines in the shared legend: dashed, dotted.
        for line in ax.get_lines():
            if line.get_label() == unavoidable:
                line.set(color="black", linestyle="--" if mode == "fwd" else ":", linewidth=2.5, marker="")
    shape = f"{data['dtype']}, d = {d}, {'causal' if causal else 'not causal'}, B·N fixed"
    fig.suptitle(
        f"Peak memory: standard attention grows with N (N² per sequence),\n"
        f"fused kernels stay at what they must hold: {shape}\n{credit(record)}",
        fontsize=13,
    )
    return _legend_below(fig, axes)


def plot_ladder(record: dict):
    """Predicted and measured gain of each ladder step (top: forward, below: backward), as horizontal bars with the
    steps' names beside them, readable at a laptop's width; returns the Figure"""
    import matplotlib.pyplot as plt

    from ..perf.plotting import bar_chart

    data = record["data"]
    passes = [(p, [s for s in data["steps"] if s["pass_"] == p]) for p in ("fwd", "bwd")]
    rows = [max(len(steps) - 1, 1) for _, steps in passes]  # the first rung has nothing below it
    fig, axes = plt.subplots(
        2, 1, figsize=(9.1, 2.6 + 0.62 * sum(rows)), squeeze=False, gridspec_kw={"height_ratios": rows}
    )
    for ax, (pass_, all_steps) in zip(axes[:, 0], passes):
        steps = all_steps[1:]
        ok = [s for s in all_steps if s.get("status") == "ok"]
        best = max(ok, key=lambda s: s["tflops"], default=None)  # the last rung is not always the best
        span = f": {ok[0]['tflops']:.3g} -> best {best['tflops']:.3g} TFLOP/s" if len(ok) > 1 else ""
        gains = {
            "predicted": [s["predicted_gain"] for s in steps],
            "measured": [s.get("measured_gain") for s in steps],
        }
        title = f"{MODE_NAMES[pass_].capitalize()}{span}"
        bar_chart([s["name"] for s in steps], gains, xlabel="gain over the step before (x)", ylabel="step",
                  title=title, ax=ax, fmt="{:.2f}", horizontal=True)  # fmt: skip
        for bar in ax.containers[0]:
            bar.set_color("0.72")  # the prediction in grey, the measurement in colour
        ax.legend(fontsize=11, loc="lower right")
        ax.axvline(1.0, color="black", lw=1)
    causal = "causal" if data["causal"] else "not causal"
    shape = f"B={data['B']}, H={data['H']}, N={data['N']}, d={data['d']}, {causal}"
    title = f"The optimisation ladder, predicted and measured\n({shape}, {data['dtype']})"
    fig.suptitle(f"{title}\n{credit(record)}", fontsize=13)
    fig.tight_layout()
    return fig


def save_figure(fig, path: Path, tight: bool = True) -> Path:
    """Write `fig` as a PNG at `path` (110 dpi; laid out with `tight_layout` first unless tight=False),
    close it, and return the path: how every benchmark module saves its plots."""
    import matplotlib.pyplot as plt

    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save_plots(attention_path: Path | None, ladder_path: Path | None) -> list[Path]:
    """Draw the plots of the saved records and write them as PNGs next to them; returns the paths."""

    written = []

    def save(fig, path):
        written.append(save_figure(fig, path, tight=False))  # the plots lay themselves out

    if attention_path is not None:
        rec = json.loads(Path(attention_path).read_text())
        for mode in MODES:
            save(plot_tflops(rec, mode), attention_path.with_name(f"{attention_path.stem}-{mode}.png"))
        save(plot_memory(rec), attention_path.with_name(f"{attention_path.stem}-memory.png"))
    if ladder_path is not None:
        save(plot_ladder(json.loads(Path(ladder_path).read_text())), ladder_path.with_suffix(".png"))
    return written
