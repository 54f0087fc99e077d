"""Plots for the course: benchmark series, bar charts and the roofline, readable on a projector;
and `print_table` for the same results as text.

Taught in notebook 01 (the roofline), used from notebook 00 on. Every plotting function draws on `ax`
(or a new figure), sets axis labels (give the units: "time (ms)"), a title (state the finding, not the
topic) and large fonts, and returns the Axes. Call `plt.show()` after it.

Importing this module sets matplotlib's defaults to `READABLE` (fonts that stay legible when a notebook
is projected), so figures drawn with plain `plt` after it read the same; `use_readable_defaults()`
applies them again (after `plt.rcdefaults()`, say).

The readable-figure rule, checked on every figure a notebook shows (`install_figure_check`, which
`use_readable_defaults` installs in an IPython kernel): the figure as displayed (the inline backend's PNG,
cropped to its content, at the figure's dpi) is at most `COLUMN_PX` (934) pixels wide, JupyterLab's output
column on a 1366 x 768 screen, so JupyterLab never shrinks it and its labels with it (a 9.3-inch figure at
the default 100 dpi); and its smallest text is at least `MIN_FONT_PT` (9) points at 100 dpi, 12.5 pixels, as
shown. With COURSE_STRICT_FIGURES=1 (as `make test` sets) a figure that breaks the rule fails its cell with
a message naming it; without it, a `FigureReadabilityWarning`.
"""

from __future__ import annotations

import base64
import math
import os
import sys
import warnings
from collections.abc import Mapping

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axis import Axis
from matplotlib.figure import Figure
from matplotlib.text import Text

from course_lib.checks import check_real

FONT = {"title": 15, "label": 14, "ticks": 12, "legend": 12, "note": 11}
FIGSIZE = (9.0, 5.5)
# JupyterLab 4's output area (the notebook column less its 64-pixel prompt) in a 1366 x 768 window with the
# default layout (file browser open), measured in Chromium (tests/test_browser.py measures it again). A
# wider image is scaled down to it, and its text with it: 1136 pixels showed at 82 %.
COLUMN_PX = 934
MIN_FONT_PT = 9  # points at 100 dpi, the size text reads at on a laptop's screen
MIN_FONT_PX = MIN_FONT_PT * 100 / 72  # 12.5 pixels as displayed
MAX_WIDTH = COLUMN_PX / 100  # inches at the default 100 dpi, as displayed (the PNG is cropped to its content)
STRICT_ENV = "COURSE_STRICT_FIGURES"
READABLE = {
    "font.size": 14,
    "axes.titlesize": FONT["title"],
    "axes.labelsize": FONT["label"],
    "xtick.labelsize": FONT["ticks"],
    "ytick.labelsize": FONT["ticks"],
    "legend.fontsize": FONT["legend"],
    "figure.titlesize": FONT["title"],
}


def use_readable_defaults() -> None:
    """Set matplotlib's rcParams to `READABLE` (font sizes 14 / 15 / 14 / 12 / 12 / 12 for text, titles,
    axis labels, tick labels and legends), and in an IPython kernel check every figure it shows against the
    readable-figure rule (`install_figure_check`). Called when this module is imported (notebook 00 on)."""
    plt.rcParams.update(READABLE)
    install_figure_check()


class FigureReadabilityWarning(UserWarning):
    """A figure a notebook shows is wider than JupyterLab's column at 1366 x 768, or its text is too small."""


class FigureReadabilityError(ValueError):
    """A figure breaks the readable-figure rule while COURSE_STRICT_FIGURES is set (as in `make test`)."""


def strict_figures() -> bool:
    """True when COURSE_STRICT_FIGURES is set to anything but "", "0", "false" or "no"."""
    return os.environ.get(STRICT_ENV, "").strip().lower() not in ("", "0", "false", "no")


def figure_name(fig) -> str:
    """The figure as a reader finds it: its suptitle, else its axes' titles, else its label or number."""
    texts = []
    if getattr(fig, "_suptitle", None) is not None:
        texts.append(fig._suptitle.get_text())
    if not any(t.strip() for t in texts):
        texts = [t.get_text() for ax in fig.axes for t in (ax.title, ax._left_title, ax._right_title)]
    texts = [" ".join(t.split()) for t in texts if t.strip()]
    name = (
        texts[0] + (f" (and {len(texts) - 1} more panel titles)" if len(texts) > 1 else "") if texts else ""
    )
    if not name:
        number = getattr(fig, "number", None)
        name = fig.get_label() or (f"Figure {number}" if number is not None else "a figure") + " (no title)"
    return name if len(name) <= 100 else name[:97] + "..."


def _drawn_texts(artist):
    """The non-empty texts of `artist` that are drawn: visible, and not on an axis turned off."""
    for child in artist.get_children():
        if not child.get_visible() or (isinstance(child, Axis) and not child.axes.axison):
            continue
        if isinstance(child, Text):
            if child.get_text().strip():
                yield child
        else:
            yield from _drawn_texts(child)


def _png_width(data: Mapping, metadata: Mapping) -> int | None:
    """The displayed width in pixels of a formatted figure: the PNG's width metadata (set for 'retina'),
    else the width in the PNG's header; None without a PNG."""
    meta = metadata.get("image/png") if isinstance(metadata, Mapping) else None
    if isinstance(meta, Mapping) and isinstance(meta.get("width"), (int, float)):
        return int(meta["width"])
    png = data.get("image/png") if isinstance(data, Mapping) else None
    if isinstance(png, str):
        png = base64.b64decode(png[:44])
    if isinstance(png, (bytes, bytearray)) and png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) >= 24:
        return int.from_bytes(png[16:20], "big")
    return None


def figure_problems(fig, width_px: int | None = None) -> list[str]:
    """What makes `fig` hard to read in JupyterLab at 1366 x 768: wider than `COLUMN_PX` as displayed
    (`width_px`, the inline backend's PNG width; without it, the figure's size at its dpi), or text smaller
    than `MIN_FONT_PX` as displayed. [] when it reads well."""
    dpi = plt.rcParams["savefig.dpi"]
    dpi = fig.dpi if dpi == "figure" else float(dpi)
    if width_px is None:  # not displayed: lay the figure out, so that its tick labels have their text
        fig.draw_without_rendering()
        width_px = round(fig.get_figwidth() * dpi)
    shown = min(1.0, COLUMN_PX / width_px) if width_px > 0 else 1.0
    problems = []
    if width_px > COLUMN_PX:
        problems.append(
            f"it is {width_px} px wide ({width_px / dpi:.2f} in at {dpi:g} dpi; figsize width "
            f"{fig.get_figwidth():.2f} in), wider than JupyterLab's column at 1366x768 ({COLUMN_PX} px = "
            f"{COLUMN_PX / dpi:.2f} in), so it shows at {shown:.0%} and its text with it"
        )
    texts = list(_drawn_texts(fig))
    if texts:
        smallest = min(texts, key=lambda t: t.get_fontsize())
        px = smallest.get_fontsize() * dpi / 72 * shown
        if px < MIN_FONT_PX - 0.01:
            label = " ".join(smallest.get_text().split())
            label = label if len(label) <= 30 else label[:27] + "..."
            problems.append(
                f"its smallest text ({label!r}, {smallest.get_fontsize():g} pt) shows at {px:.1f} px, under "
                f"{MIN_FONT_PX:.1f} px ({MIN_FONT_PT} pt at 100 dpi)"
            )
    return problems


def check_figure(fig, width_px: int | None = None) -> None:
    """Apply the readable-figure rule to `fig` (see `figure_problems`): with COURSE_STRICT_FIGURES set,
    raise FigureReadabilityError naming the figure; else warn (FigureReadabilityWarning)."""
    problems = figure_problems(fig, width_px)
    if not problems:
        return
    message = (
        f"figure {figure_name(fig)!r}: " + "; ".join(problems) + f". Keep a figure at most {COLUMN_PX} px "
        f"wide as shown (figsize width about {COLUMN_PX / 100 - 0.1:.1f} in at 100 dpi with "
        f"layout='constrained') and its text at least {MIN_FONT_PT} pt (course_lib.perf.plotting)."
    )
    if strict_figures():
        raise FigureReadabilityError(message)
    warnings.warn(message, FigureReadabilityWarning, stacklevel=3)


def install_figure_check(shell=None) -> bool:
    """Check every matplotlib figure that IPython `shell` (default: the running one) displays, however it
    is shown (`plt.show()`, the inline backend's display at the end of a cell, `display(fig)`, a figure as a
    cell's value): wrap the shell's display formatter so that a Figure, once formatted, goes through
    `check_figure` with the width of its PNG. Idempotent; False when no IPython shell runs."""
    if shell is None:
        ipython = sys.modules.get("IPython")
        shell = ipython.get_ipython() if ipython is not None else None
    formatter = getattr(shell, "display_formatter", None)
    if formatter is None:
        return False
    original = formatter.format
    if getattr(original, "course_figure_check", False):
        return True

    def format(obj, include=None, exclude=None):
        data, metadata = original(obj, include=include, exclude=exclude)
        if isinstance(obj, Figure):
            check_figure(obj, _png_width(data, metadata))
        return data, metadata

    format.course_figure_check = True
    formatter.format = format
    return True


use_readable_defaults()


def _axes(ax, figsize=FIGSIZE):
    if ax is None:
        _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def _require_text(**texts) -> None:
    for name, text in texts.items():
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{name} must be a non-empty string (with units for axis labels), got {text!r}")


def _finish(ax, xlabel: str, ylabel: str, title: str):
    ax.set_xlabel(xlabel, fontsize=FONT["label"])
    ax.set_ylabel(ylabel, fontsize=FONT["label"])
    ax.set_title(title, fontsize=FONT["title"])
    ax.tick_params(labelsize=FONT["ticks"])
    ax.grid(True, which="major", alpha=0.35)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=FONT["legend"])
    return ax


def _as_float(values, what: str) -> np.ndarray:
    """Numbers as a float array; None (a missing point, e.g. out of memory) becomes NaN, a gap in the line."""
    try:
        return np.array([np.nan if v is None else float(v) for v in values], dtype=float)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} must be a list of numbers or None, got {values!r:.80}") from exc


def plot_series(
    x,
    series: dict,
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
    logy: bool = False,
    ax=None,
    marker: str = "o",
):
    """One line per entry of `series` ({label: values}), all against `x`; None values leave a gap.

    Returns the Axes. Raises ValueError if a series' length differs from x's, naming the series."""
    _require_text(xlabel=xlabel, ylabel=ylabel, title=title)
    if not isinstance(series, dict) or not series:
        raise ValueError("series must be a non-empty dict {label: list of values}")
    xs = _as_float(x, "x")
    ax = _axes(ax)
    for label, values in series.items():
        ys = _as_float(values, f"series {label!r}")
        if len(ys) != len(xs):
            raise ValueError(f"series {label!r} has {len(ys)} values but x has {len(xs)}")
        ax.plot(xs, ys, marker=marker, linewidth=2, markersize=7, label=str(label))
    if logx:
        ax.set_xscale("log", base=2 if _all_powers_of_two(xs) else 10)
    if logy:
        ax.set_yscale("log")
    return _finish(ax, xlabel, ylabel, title)


def _all_powers_of_two(xs: np.ndarray) -> bool:
    return bool(len(xs)) and all(v > 0 and float(v).is_integer() and (int(v) & (int(v) - 1)) == 0 for v in xs)


def bar_chart(
    labels,
    values,
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    ax=None,
    horizontal: bool = False,
    logy: bool = False,
    fmt: str = "{:.3g}",
    annotate: bool = True,
):
    """Bars for `labels`: `values` is a list (one bar per label) or a dict {series: list} (grouped bars).

    With horizontal=True the bars run left to right, labels on the y axis (then `xlabel` names the
    values). Each bar is annotated with its value formatted by `fmt`. Returns the Axes."""
    _require_text(xlabel=xlabel, ylabel=ylabel, title=title)
    if isinstance(labels, (str, bytes)) or not hasattr(labels, "__iter__"):
        raise TypeError(f"bar_chart: labels must be a list of names, got {type(labels).__name__}")
    labels = [str(label) for label in labels]
    if (
        isinstance(values, (str, bytes))
        or not hasattr(values, "__len__")
        or (isinstance(values, dict) and not values)
    ):
        raise ValueError(
            f"bar_chart: values must be a list (one per label) or a non-empty dict of lists, got {values!r:.80}"
        )
    groups = values if isinstance(values, dict) else {"": values}
    for name, vals in groups.items():
        if len(vals) != len(labels):
            raise ValueError(f"bar_chart: series {name!r} has {len(vals)} values for {len(labels)} labels")
    ax = _axes(ax)
    pos = np.arange(len(labels))
    width = 0.8 / len(groups)
    for i, (name, vals) in enumerate(groups.items()):
        vals = _as_float(vals, f"series {name!r}")
        offset = pos - 0.4 + width * (i + 0.5)
        draw = ax.barh if horizontal else ax.bar
        bars = draw(offset, vals, width * 0.9, label=name or None)
        if annotate:
            ax.bar_label(
                bars,
                labels=[fmt.format(v) if math.isfinite(v) else "" for v in vals],
                fontsize=FONT["note"],
                padding=3,
            )
    if horizontal:
        ax.set_yticks(pos, labels)
        ax.invert_yaxis()
        if logy:
            ax.set_xscale("log")
        ax.margins(x=0.15)
    else:
        ax.set_xticks(pos, labels)
        if logy:
            ax.set_yscale("log")
        ax.margins(y=0.25)
    return _finish(ax, xlabel, ylabel, title)


def roofline(
    ceilings,
    points=(),
    *,
    title: str,
    ax=None,
    xlabel: str = "arithmetic intensity (FLOP/byte)",
    ylabel: str = "performance (TFLOP/s)",
    intensity_range=None,
):
    """The roofline model: for each ceiling, performance = min(peak, bandwidth x intensity); operations
    as points at (intensity, achieved TFLOP/s).

    ceilings: list of (label, peak_tflops, bandwidth_gbps); the ridge point (the machine balance) is
    marked. points: dicts with "name", "flops", "bytes", "ms" (as `hardware.measure_operations` returns),
    optionally "label" (a legend group, default: the first ceiling's device). Returns the Axes."""
    _require_text(title=title, xlabel=xlabel, ylabel=ylabel)
    ceilings = list(ceilings)
    if not ceilings:
        raise ValueError("roofline needs at least one ceiling (label, peak_tflops, bandwidth_gbps)")
    for c in ceilings:
        if len(c) != 3 or not all(isinstance(v, (int, float)) and v > 0 for v in c[1:]):
            raise ValueError(f"a ceiling is (label, peak_tflops > 0, bandwidth_gbps > 0), got {c!r}")
    points = [_roofline_point(p) for p in points]
    intensities = [p["flops"] / p["bytes"] for p in points]
    ridges = [peak * 1e3 / bw for _, peak, bw in ceilings]
    if intensity_range is None:
        lo = min(intensities + ridges) / 4
        hi = max(intensities + ridges) * 4
    else:
        lo, hi = _intensity_range(intensity_range)
    ax = _axes(ax, figsize=(9.0, 7.5))
    xs = np.logspace(math.log10(lo), math.log10(hi), 200)
    for i, ((label, peak, bw), ridge) in enumerate(zip(ceilings, ridges)):
        color = f"C{i}"
        ax.plot(
            xs,
            np.minimum(peak, bw * xs / 1e3),
            color=color,
            linewidth=2.5,
            label=f"{label}: {peak:.3g} TFLOP/s, {bw:.4g} GB/s",
        )
        ax.axvline(ridge, color=color, linestyle=":", linewidth=1.2)
        ax.annotate(
            f"ridge {ridge:.3g}",
            (ridge, peak),
            textcoords="offset points",
            xytext=(4, 6),
            fontsize=FONT["note"],
            color=color,
        )
    groups: dict[str, list] = {}
    for p, inten in zip(points, intensities):
        groups.setdefault(p.get("label", "measured"), []).append((p, inten))
    markers = "osD^v"
    for j, (group, members) in enumerate(groups.items()):
        achieved = [p["flops"] / (p["ms"] * 1e9) for p, _ in members]
        ax.scatter(
            [i for _, i in members],
            achieved,
            s=70,
            marker=markers[j % len(markers)],
            color="black",
            zorder=5,
            label=f"operations ({group})",
        )
        by_intensity = sorted(zip(members, achieved), key=lambda m: m[0][1])
        for i, ((p, inten), y) in enumerate(by_intensity):
            ax.annotate(  # alternate above and below, so that neighbours' names do not overlap
                p["name"],
                (inten, y),
                textcoords="offset points",
                xytext=(6, 6 if i % 2 else -12),
                fontsize=FONT["note"],
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    _finish(ax, xlabel, ylabel, title)
    ax.legend(fontsize=FONT["legend"], loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1)
    return ax


def _roofline_point(p) -> dict:
    """A roofline point checked: a dict with a "name" and positive, finite "flops", "bytes" and "ms" (a
    log-log plot has no place for zero FLOPs or zero time)."""
    if not isinstance(p, Mapping) or not {"name", "flops", "bytes", "ms"} <= p.keys():
        raise ValueError(f'roofline: a point is a dict with "name", "flops", "bytes" and "ms", got {p!r}')
    for key in ("flops", "bytes", "ms"):
        check_real("roofline", f"point {p['name']!r}'s {key}", p[key], low=0, low_open=True)
    return p


def _intensity_range(intensity_range) -> tuple[float, float]:
    try:
        lo, hi = intensity_range
    except (TypeError, ValueError):
        raise ValueError(f"roofline: intensity_range is (low, high), got {intensity_range!r}") from None
    lo = check_real("roofline", "intensity_range's low", lo, low=0, low_open=True)
    return lo, check_real("roofline", "intensity_range's high", hi, low=lo, low_open=True)


def print_table(rows, columns=None, fmt: str = "{:.3g}") -> None:
    """Print a list of dicts as an aligned text table; floats formatted with `fmt`, None as "-"."""
    rows = list(rows)
    if not all(isinstance(row, Mapping) for row in rows):
        raise TypeError(f"print_table: rows must be dicts, got {[type(r).__name__ for r in rows][:5]}")
    if isinstance(columns, str):
        raise TypeError(f"print_table: columns is a list of column names, got the string {columns!r}")
    if not rows:
        print("(no rows)")
        return
    columns = list(columns or rows[0].keys())

    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return fmt.format(v)
        return str(v)

    text = [[cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(t[i]) for t in text)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for t in text:
        print("  ".join(v.rjust(w) if _numeric(v) else v.ljust(w) for v, w in zip(t, widths)))


def _numeric(text: str) -> bool:
    try:
        float(text.replace(",", ""))
        return True
    except ValueError:
        return False
