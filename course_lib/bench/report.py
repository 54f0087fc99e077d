"""Ratios and targets: course_lib's TFLOP/s over each baseline's, per cell; the minimum and geometric
mean per column; the targets `make bench` checks; the text report. Pure functions of a record's data,
tested without a GPU.

Taught in notebook 08.
"""

from __future__ import annotations

import math

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


def report_columns() -> list[str]:
    """The ratio table's column keys, "mode/baseline" ("fwd/sdpa_flash", ...), from RATIO_COLUMNS."""
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


# The same ratios with both sides replayed as CUDA graphs (no host time between kernels): "graph_tflops".
GRAPH_COLUMNS = (("fwd", "sdpa_default"), ("fwd_bwd", "sdpa_default"))


def graph_summary(data: dict) -> dict:
    """{"fwd/sdpa_default": {"min", "geomean", "cells"}, ...}: course_lib's TFLOP/s over the baseline's
    with both replayed as CUDA graphs, per column of GRAPH_COLUMNS (cells: the per-cell ratios)."""
    out = {}
    for mode, base in GRAPH_COLUMNS:
        cells = []
        for c in data["cells"]:
            ours, theirs = (lookup(data, p, mode, c["d"], c["causal"], c["N"]) for p in ("course_lib", base))
            a, b = ((r or {}).get("graph_tflops") for r in (ours, theirs))
            cells.append(a / b if a and b else None)
        lo, geo = summarise(cells)
        out[f"{mode}/{base}"] = {"min": lo, "geomean": geo, "cells": cells}
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
    cols = report_columns()
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
    for col, g in graph_summary(data).items():
        if g["geomean"] is not None:
            lines.append(f"CUDA-graph replays, {col}: min {g['min']:.2f}x, geomean {g['geomean']:.2f}x")
    lines.append("targets:")
    for t in targets:
        mark = {True: "met   ", False: "MISSED", None: "n/a   "}[t["met"]]
        lines.append(f"  [{mark}] {t['target']}: {t['detail']}")
    return "\n".join(lines)


def record_and_report(kind: str, run, save_plots, format_table, target_misses, quick: bool, out) -> int:
    """What a benchmark module's `main` does: measure (`run(quick)`), save the record `kind` and its plots
    in `out`, print the table and the targets missed. Returns 0, or 2 (nothing measured) when asked to put
    CPU timings into assets/benchmarks/, where only GPU records belong."""
    from pathlib import Path

    from .. import records, runtime

    out = Path(out)
    if not runtime.ON_GPU and out.resolve() == Path(records.ASSETS).resolve():
        print(f"bench {kind}: no GPU; CPU timings do not belong in assets/benchmarks/ (pass --out DIR)")
        return 2
    data = run(quick)
    path = records.save_record(kind, data, out)
    slug = path.stem.split("-", 1)[1] if path else "cpu"
    out.mkdir(parents=True, exist_ok=True)
    for p in save_plots(data, out, slug):
        print(f"bench {kind}: wrote {p}")
    print(format_table(data))
    misses = target_misses(data)
    print(
        f"bench {kind}: every target met"
        if not misses
        else f"bench {kind}: targets missed:\n  " + "\n  ".join(misses)
    )
    return 0


def command_line(main, doc: str, argv=None, flags: dict | None = None) -> int:
    """The command line of a benchmark module, `python -m course_lib.bench.<name> [--quick] [--out DIR]`:
    parses `argv` (default: the process's arguments) and returns `main(quick, out)`. `doc`: the module's
    docstring, whose first line describes the command. flags: {name: help} of a module's own switches,
    passed on as keywords (`--eager` -> main(quick, out, eager=True))."""
    import argparse

    from .. import records

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small grid, for a smoke test")
    parser.add_argument("--out", default=str(records.ASSETS), help="folder for the record")
    for name, text in (flags or {}).items():
        parser.add_argument(f"--{name}", action="store_true", help=text)
    args = parser.parse_args(argv)
    return main(args.quick, args.out, **{name: getattr(args, name) for name in flags or {}})
