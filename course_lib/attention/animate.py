"""Pictures that move: FlashAttention's loops step by step, as a slider and as a static strip of frames.

Taught in notebooks 04 (one Q block's inner loop, `inner_loop_strip`; the forward's tile loop,
FlashAttention-1 against FlashAttention-2 loop order, causal skipping), 04b and 07 (the backward's
K/V-outer loop, dQ accumulating) and 05 (which program of a Triton launch touches which elements).

Each picture comes in two forms, built from the same recorded frames:
- `*_strip(...)`: a matplotlib Figure with a few chosen steps side by side. It shows everywhere, in a
  browser, in a PDF, and when a notebook runs without a front end (nbval, CI).
- `*_widget(...)`: an `ipywidgets` slider over every step, redrawing the figure of one step. In
  JupyterLab it moves; without a front end it displays as a line of text.

Frames are recorded from a real computation in float64 (`forward_frames`, `backward_frames`), so what
moves on the screen is what the algorithm does, not a drawing of it.

Every figure is at most `WIDTH` (9.1) inches wide, so that JupyterLab shows it at full size in its 934-pixel
output column at 1366 x 768 (at the default 100 dpi; `course_lib.perf.plotting`'s readable-figure rule) and
its smallest text stays at 9 points or more; legends and colour keys sit outside the data.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from course_lib.checks import check_int, check_tensor

from . import tiles
from .reference import attention as reference_attention
from .reference import causal_mask

ORDERS = {"fa1": "FlashAttention-1 order (K/V outer)", "fa2": "FlashAttention-2 order (Q outer)"}
# Inches: about 930 pixels as displayed at 100 dpi (the inline backend crops to the content, plus 0.1 inch
# each side), inside JupyterLab's 934-pixel column at 1366 x 768 (`perf.plotting.COLUMN_PX`). JupyterLab
# shrinks a wider figure, and its text, to the column.
WIDTH = 9.1
# Panels are narrow (four across WIDTH): fonts a little below `perf.plotting.READABLE`, never below 9 points.
SMALL_FONTS = {
    "axes.titlesize": 11,
    "axes.labelsize": 11,
    "xtick.labelsize": 10,
    "ytick.labelsize": 10,
    "legend.fontsize": 10,
    "figure.titlesize": 12,
}


def _check_2d(name: str, t, n_cols: int | None = None) -> None:
    check_tensor("animate", name, t)
    if t.dim() != 2 or (n_cols is not None and t.shape[1] != n_cols) or 0 in t.shape:
        want = f"(N, {n_cols})" if n_cols is not None else "(N, d)"
        raise ValueError(
            f"animate: {name} must have shape {want} (one head, N and d >= 1), got {tuple(t.shape)}"
        )


def _scores(q, k, scale: float, causal: bool) -> torch.Tensor:
    """S = Q K^T * scale (Nq, Nk), with -inf where the causal mask (`reference.causal_mask`) hides a key."""
    S = q @ k.T * scale
    if causal:
        S = S.masked_fill(~causal_mask(q.shape[0], k.shape[0]), -math.inf)
    return S


def _block_ranges(n: int, block: int) -> list[tuple[int, int]]:
    return [(s, min(s + block, n)) for s in range(0, n, block)]


def forward_frames(q, k, v, block_m: int, block_n: int, causal: bool = False, order: str = "fa2"):
    """Run a tiled attention forward on one head and record its state after every tile.

    q: (Nq, d), k and v: (Nk, d), any float dtype (computed in float64). `order` is "fa2" (outer loop
    over Q blocks) or "fa1" (outer loop over K/V blocks); causal tiles above the diagonal are skipped.
    Returns a list of frames, one per computed tile, each a dict:
        tile: (i, j); done: tiles computed before this one; m, l: (Nq,) running max and sum of every
        row after the step (-inf and 0 for rows not started); err: (Nq,) max |O/l - O_final| per row
        (NaN for rows not started); order, causal, n_q, n_k, block_m, block_n: the setting.
    The per-row arithmetic is the online softmax of notebook 03, the same in both orders; only the
    order in which tiles arrive differs."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_2d(name, t)
    if k.shape != v.shape or q.shape[1] != k.shape[1]:
        raise ValueError(f"animate: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    tiles._check_sizes(q.shape[0], k.shape[0], block_m, block_n)
    if order not in ORDERS:
        raise ValueError(f"animate: order must be 'fa1' or 'fa2', got {order!r}")
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    n_q, n_k = q.shape[0], k.shape[0]
    scale = q.shape[1] ** -0.5
    S_full = _scores(q, k, scale, causal)
    O_final = torch.softmax(S_full, dim=-1) @ v
    m = torch.full((n_q,), -math.inf, dtype=torch.float64)
    l = torch.zeros(n_q, dtype=torch.float64)
    acc = torch.zeros(n_q, v.shape[1], dtype=torch.float64)
    rows_q, rows_k = _block_ranges(n_q, block_m), _block_ranges(n_k, block_n)
    frames, done = [], []
    for i, j in tiles.tile_schedule(n_q, n_k, block_m, block_n, causal, order=order):
        (i0, i1), (j0, j1) = rows_q[i], rows_k[j]
        S = S_full[i0:i1, j0:j1]
        m_new = torch.maximum(m[i0:i1], S.amax(dim=-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # a row seeing no key yet
        P = torch.exp(S - m_safe[:, None])
        alpha = torch.exp(m[i0:i1] - m_safe)
        l[i0:i1] = alpha * l[i0:i1] + P.sum(dim=-1)
        acc[i0:i1] = alpha[:, None] * acc[i0:i1] + P @ v[j0:j1]
        m[i0:i1] = m_new
        started = l > 0
        err = torch.full((n_q,), math.nan, dtype=torch.float64)
        err[started] = (acc[started] / l[started, None] - O_final[started]).abs().amax(dim=-1)
        frames.append(
            {
                "tile": (i, j),
                "done": list(done),
                "m": m.numpy().copy(),
                "l": l.numpy().copy(),
                "err": err.numpy(),
                "order": order,
                "causal": causal,
                "n_q": n_q,
                "n_k": n_k,
                "block_m": block_m,
                "block_n": block_n,
            }
        )
        done.append((i, j))
    return frames


def backward_frames(q, k, v, dO, block_m: int, block_n: int, causal: bool = False):
    """Run FlashAttention-2's tiled backward (outer loop over K/V blocks) on one head, recording each tile.

    q, dO: (Nq, d), k and v: (Nk, d), any float dtype (computed in float64). Returns one frame per
    computed tile, a dict with tile, done, n_q, n_k, block_m, block_n, causal (as `forward_frames`) and
        dq_left: (Nq,) max |dQ_final - dQ_so_far| per query row, relative to max |dQ_final|: a row's dQ
                 is finished (0) only after every K/V block it sees has been visited;
        dk_left: (Nk,) the same for dK: a K/V block's rows finish at the end of its own inner loop."""
    for name, t in (("q", q), ("k", k), ("v", v), ("dO", dO)):
        _check_2d(name, t)
    tiles._check_sizes(q.shape[0], k.shape[0], block_m, block_n)
    if dO.shape != q.shape or k.shape != v.shape or q.shape[1] != k.shape[1]:
        raise ValueError(
            f"animate: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, dO {tuple(dO.shape)} do not fit"
        )
    q, k, v, dO = (t.double().cpu() for t in (q, k, v, dO))
    n_q, n_k = q.shape[0], k.shape[0]
    scale = q.shape[1] ** -0.5
    S_full = _scores(q, k, scale, causal)
    P_full = torch.softmax(S_full, dim=-1)
    O = P_full @ v
    L = torch.logsumexp(S_full, dim=-1)
    D = (dO * O).sum(dim=-1)
    # The finished gradients, by autograd through the reference: the tiles below must add up to them.
    qg, kg = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    dq_final, dk_final = torch.autograd.grad(reference_attention(qg, kg, v, causal=causal), (qg, kg), dO)
    dq, dk = torch.zeros_like(q), torch.zeros_like(k)
    rows_q, rows_k = _block_ranges(n_q, block_m), _block_ranges(n_k, block_n)
    frames, done = [], []
    for i, j in tiles.tile_schedule(n_q, n_k, block_m, block_n, causal, order="fa1"):
        (i0, i1), (j0, j1) = rows_q[i], rows_k[j]
        P = torch.exp(S_full[i0:i1, j0:j1] - L[i0:i1, None])  # rebuilt from L, as the kernels do
        dS = P * (dO[i0:i1] @ v[j0:j1].T - D[i0:i1, None])
        dq[i0:i1] += dS @ k[j0:j1] * scale
        dk[j0:j1] += dS.T @ q[i0:i1] * scale
        frames.append(
            {
                "tile": (i, j),
                "done": list(done),
                # (a gradient that is all zeros, dO = 0, is scaled by 1: nothing left, not 0 / 0)
                "dq_left": (
                    (dq_final - dq).abs().amax(dim=-1) / dq_final.abs().max().clamp_min(1e-30)
                ).numpy(),
                "dk_left": (
                    (dk_final - dk).abs().amax(dim=-1) / dk_final.abs().max().clamp_min(1e-30)
                ).numpy(),
                "causal": causal,
                "n_q": n_q,
                "n_k": n_k,
                "block_m": block_m,
                "block_n": block_n,
            }
        )
        done.append((i, j))
    return frames


def _tile_map(ax, frame, title):
    tiles.draw_block_map(
        ax,
        frame["n_q"],
        frame["n_k"],
        frame["block_m"],
        frame["block_n"],
        frame["causal"],
        on_chip=frame["tile"],
        done=frame["done"],
        title=title,
    )


def _state_key(fig, names=("skipped", "pending", "computed", "on chip"), masked: bool = True) -> None:
    """The colour key of the tile maps (`names`, and "M" for a tile that needs the mask), once per figure,
    above the panels."""
    from matplotlib.patches import Patch

    handles = [Patch(color=tiles._COLOURS[n], label=n) for n in names]
    if masked:
        handles.append(Patch(color="white", label="M: tile needs the mask"))
    loc = "outside upper center"
    fig.legend(handles=handles, loc=loc, ncol=len(handles), frameon=False)


def _frames(where: str, frames) -> list:
    """Recorded frames checked: a non-empty list of frame dicts (from `forward_frames`/`backward_frames`)."""
    if not isinstance(frames, (list, tuple)) or not frames or not all(isinstance(f, dict) for f in frames):
        raise ValueError(
            f"{where}: frames must be the non-empty list that *_frames returns, got {frames!r:.80}"
        )
    return list(frames)


def _frames_by_order(where: str, frames_by_order) -> dict:
    """{"fa1": frames, "fa2": frames} (one order is fine) checked, as `forward_frames` returns them."""
    if not isinstance(frames_by_order, dict) or not frames_by_order:
        raise ValueError(
            f'{where}: frames_by_order must be a non-empty dict such as {{"fa2": forward_frames(...)}}, '
            f"got {frames_by_order!r:.80}"
        )
    return {order: _frames(f"{where}: {order!r}", frames) for order, frames in frames_by_order.items()}


def _pick_steps(n_frames: int, n_shots: int) -> list[int]:
    n_shots = min(check_int("animate", "n_shots", n_shots, 1), n_frames)
    return sorted({round(s) for s in np.linspace(0, n_frames - 1, n_shots)})


def _forward_panels(axes, frames, step, m_lim, l_max, err_max):
    f = frames[step]
    rows = np.arange(f["n_q"])
    i, j = f["tile"]
    _tile_map(axes[0], f, f"{f['order'].upper()} step {step + 1}/{len(frames)}: tile ({i}, {j})")
    axes[1].plot(rows, np.where(np.isinf(f["m"]), np.nan, f["m"]), ".", color="#d94801", ms=3)
    axes[1].set_ylim(*m_lim)
    axes[1].set_title("running max m")
    axes[2].plot(rows, f["l"], ".", color="#2171b5", ms=3)
    axes[2].set_ylim(0, l_max)
    axes[2].set_title("running sum l")
    axes[3].bar(
        rows, np.nan_to_num(f["err"], nan=err_max), color=np.where(np.isnan(f["err"]), "#dddddd", "#238b45")
    )
    axes[3].set_ylim(0, err_max)
    axes[3].set_title("max |O/l − O_final|")
    for ax in axes[1:]:
        ax.set_xlim(-0.5, f["n_q"] - 0.5)  # the same axes at every step: rows not started yet leave gaps
        ax.set_xlabel("query row")
        ax.axvspan(i * f["block_m"], min((i + 1) * f["block_m"], f["n_q"]) - 0.5, color="#fd8d3c", alpha=0.15)


def _forward_limits(frames_by_order):
    ms = np.concatenate([f["m"] for frames in frames_by_order.values() for f in frames])
    ms = ms[np.isfinite(ms)]
    ls = np.concatenate([f["l"] for frames in frames_by_order.values() for f in frames])
    errs = np.concatenate([f["err"] for frames in frames_by_order.values() for f in frames])
    err_max = float(np.nanmax(errs)) * 1.05 if np.isfinite(errs).any() else 1.0
    return (float(ms.min()) - 0.2, float(ms.max()) + 0.2), float(ls.max()) * 1.05, err_max or 1.0


def forward_step_figure(frames_by_order: dict, step: int):
    """One step of the forward, for each loop order: a row of four panels (tile map, m, l, distance of
    the current estimate O/l from the final O, per query row; grey bars: rows not started). Every step
    has the same axes. frames_by_order: {"fa1": frames, "fa2": frames} from `forward_frames` (one order
    is fine too); step counts from 0. Returns the matplotlib Figure (WIDTH inches wide)."""
    import matplotlib.pyplot as plt

    frames_by_order = _frames_by_order("forward_step_figure", frames_by_order)
    step = check_int("forward_step_figure", "step", step, 0)
    limits = _forward_limits(frames_by_order)
    with plt.rc_context(SMALL_FONTS):
        fig, axes = plt.subplots(
            len(frames_by_order), 4, figsize=(WIDTH, 3.3 * len(frames_by_order) + 0.4), squeeze=False,
            layout="constrained",
        )  # fmt: skip
        for row, frames in zip(axes, frames_by_order.values()):
            _forward_panels(row, frames, min(step, len(frames) - 1), *limits)
        _state_key(fig)
    return fig


def forward_strip(frames_by_order: dict, n_shots: int = 4):
    """Static strip: `n_shots` evenly spaced steps side by side, two rows per loop order (the tile map, and
    the distance of each query row's estimate O/l from its final value), the tiles' colour key on top.
    Returns the Figure (WIDTH inches wide)."""
    import matplotlib.pyplot as plt

    frames_by_order = _frames_by_order("forward_strip", frames_by_order)
    n_frames = min(len(frames) for frames in frames_by_order.values())
    steps = _pick_steps(n_frames, n_shots)
    _, _, err_max = _forward_limits(frames_by_order)
    with plt.rc_context(SMALL_FONTS):
        fig, axes = plt.subplots(
            2 * len(frames_by_order),
            len(steps),
            figsize=(WIDTH, 5.4 * len(frames_by_order) + 0.4),
            squeeze=False,
            layout="constrained",
            height_ratios=[1.35, 1] * len(frames_by_order),
        )
        for r, (order, frames) in enumerate(frames_by_order.items()):
            for c, step in enumerate(steps):
                f = frames[step]
                _tile_map(axes[2 * r, c], f, f"{order.upper()}, step {step + 1}/{len(frames)}")
                ax = axes[2 * r + 1, c]
                ax.bar(
                    np.arange(f["n_q"]),
                    np.nan_to_num(f["err"], nan=err_max),
                    color=np.where(np.isnan(f["err"]), "#dddddd", "#238b45"),
                )
                ax.set_ylim(0, err_max)
                ax.set_xlim(-0.5, f["n_q"] - 0.5)
                ax.set_xlabel("query row")
                finished = int((f["err"] < 1e-12).sum())
                ax.set_title(f"{finished} of {f['n_q']} rows final")
            axes[2 * r + 1, 0].set_ylabel("max |O/l − O_final|\n(grey: not started)")
        _state_key(fig)
    return fig


def _slider(draw, n_steps: int, description: str, first: int = 0):
    """An ipywidgets slider over steps first..first+n_steps-1 that calls draw(step - first) (which shows a
    figure): first=1 numbers the steps as the figures' titles do ("step 1/10"). Without ipywidgets (a
    notebook run as a plain script on a machine without it) there is no slider: a line says so and None
    is returned; the static strips show the same steps. Nor in a headless run (COURSE_HEADLESS set, as
    `python -m course_lib grade` does): a widget there only waits for messages nobody sends."""
    if os.environ.get("COURSE_HEADLESS"):  # `make grade` runs notebooks with no one to move a slider
        print(f"(no slider over the {n_steps} steps in a headless run; the strip above shows them)")
        return None
    try:
        import ipywidgets as widgets
    except ImportError:
        print(
            f"(no slider over the {n_steps} steps here: ipywidgets is not installed; the strip above shows them)"
        )
        return None
    import matplotlib.pyplot as plt

    def show(step):
        draw(step - first)
        plt.show()

    # A saved notebook keeps the widget's place but not the widget: JupyterLab then shows "Error
    # displaying widget: model not found" until the cell runs again.
    print("(If the slider below reads 'model not found', the notebook was reopened: run this cell again.)")
    slider = widgets.IntSlider(
        value=first, min=first, max=first + n_steps - 1, step=1, description=description
    )
    return widgets.interactive(show, step=slider)


def forward_widget(frames_by_order: dict):
    """A slider over the forward's steps 1..n, redrawing `forward_step_figure` (JupyterLab); text elsewhere."""
    frames_by_order = _frames_by_order("forward_widget", frames_by_order)
    n = max(len(frames) for frames in frames_by_order.values())
    return _slider(lambda s: forward_step_figure(frames_by_order, s), n, "step", first=1)


def _backward_panels(axes, frames, step):
    f = frames[step]
    i, j = f["tile"]
    _tile_map(axes[0], f, f"step {step + 1}/{len(frames)}: tile ({i}, {j})")
    for ax, key, n, blk, other, what in (
        (axes[1], "dq_left", f["n_q"], f["block_m"], i, "query row: dQ still missing"),
        (axes[2], "dk_left", f["n_k"], f["block_n"], j, "key row: dK still missing"),
    ):
        ax.bar(np.arange(n), f[key], color="#6a51a3")
        ax.set_ylim(0, 1.05 * max(float(g[key].max()) for g in frames))
        ax.set_xlim(-0.5, n - 0.5)
        ax.axvspan(other * blk - 0.5, min((other + 1) * blk, n) - 0.5, color="#fd8d3c", alpha=0.2)
        ax.set_xlabel(what.split(":")[0])
        ax.set_title(what.split(": ")[1] + f"\n({int((f[key] < 1e-12).sum())} of {n} rows done)")
    axes[1].set_ylabel("max |final − so far|\n(relative)")


def backward_step_figure(frames, step: int):
    """One step of the tiled backward: tile map (K/V blocks outer, so the map fills column by column),
    how much of dQ and of dK each row still misses; the same axes at every step. frames: from
    `backward_frames`; step counts from 0. Returns the Figure (WIDTH inches wide)."""
    import matplotlib.pyplot as plt

    frames = _frames("backward_step_figure", frames)
    step = check_int("backward_step_figure", "step", step, 0)
    with plt.rc_context(SMALL_FONTS):
        fig, axes = plt.subplots(1, 3, figsize=(WIDTH, 4.0), layout="constrained")
        _backward_panels(axes, frames, min(step, len(frames) - 1))
        _state_key(fig)
    return fig


def backward_strip(frames, n_shots: int = 4):
    """Static strip of the backward: `n_shots` steps, each a tile map above the dQ still missing per row,
    the tiles' colour key on top. Returns the Figure (WIDTH inches wide)."""
    import matplotlib.pyplot as plt

    frames = _frames("backward_strip", frames)
    steps = _pick_steps(len(frames), n_shots)
    top = 1.05 * max(float(f["dq_left"].max()) for f in frames)
    with plt.rc_context(SMALL_FONTS):
        fig, axes = plt.subplots(
            2,
            len(steps),
            figsize=(WIDTH - 0.15, 5.8),
            squeeze=False,
            layout="constrained",
            height_ratios=[1.35, 1],
        )
        for c, step in enumerate(steps):
            f = frames[step]
            _tile_map(axes[0, c], f, f"step {step + 1}/{len(frames)}: K/V block {f['tile'][1]}")
            axes[1, c].bar(np.arange(f["n_q"]), f["dq_left"], color="#6a51a3")
            axes[1, c].set_ylim(0, top)
            axes[1, c].set_xlim(-0.5, f["n_q"] - 0.5)
            axes[1, c].set_xlabel("query row")
            axes[1, c].set_title(f"dQ: {int((f['dq_left'] < 1e-12).sum())} of {f['n_q']} rows done")
        axes[1, 0].set_ylabel("dQ still missing\n(relative)")
        _state_key(fig)
    return fig


def backward_widget(frames):
    """A slider over the backward's steps 1..n, redrawing `backward_step_figure`."""
    frames = _frames("backward_widget", frames)
    return _slider(lambda s: backward_step_figure(frames, s), len(frames), "step", first=1)


def inner_loop_strip(steps, n_q: int, n_k: int, block_m: int, block_n: int, O_final):
    """One Q block's inner loop, step by step: one column per K/V block, four rows of panels (the tile on
    chip; m, then l, of each of the block's rows before (grey) and after the step, circles where the
    maximum grew so that l and O were rescaled; how far each row's estimate O/l still is from O_final).

    steps: the dicts a tiled forward records after each K/V block, with keys i, j (the tile), m and l
    (1-D over the block's rows) and O (the unnormalised accumulator, rows x d); O_final: (rows, d), the
    block's final output. Up to five steps fit WIDTH inches. Returns the Figure; the legend is below it."""
    import matplotlib.pyplot as plt

    if not steps:
        raise ValueError("inner_loop_strip: steps is empty; record at least one K/V block")
    m_all = np.concatenate([np.asarray(s["m"]) for s in steps])
    l_all = np.concatenate([np.asarray(s["l"]) for s in steps])
    errs = [
        np.abs(np.asarray(s["O"]) / np.asarray(s["l"])[:, None] - np.asarray(O_final)).max(axis=1)
        for s in steps
    ]
    with plt.rc_context(SMALL_FONTS):
        fig, axes = plt.subplots(
            4, len(steps), figsize=(WIDTH, 9.6), squeeze=False, layout="constrained",
            height_ratios=[1.3, 1, 1, 1], sharex="row",
        )  # fmt: skip
        for c, s in enumerate(steps):
            done = [(t["i"], t["j"]) for t in steps[:c]]
            tiles.draw_block_map(
                axes[0, c], n_q, n_k, block_m, block_n, on_chip=(s["i"], s["j"]), done=done,
                title=f"step {c + 1}/{len(steps)}: tile ({s['i']}, {s['j']})",
            )  # fmt: skip
            m, l = np.asarray(s["m"]), np.asarray(s["l"])
            rows = np.arange(len(m))
            grew = np.zeros(len(m), dtype=bool)
            if c > 0:
                m_prev, l_prev = np.asarray(steps[c - 1]["m"]), np.asarray(steps[c - 1]["l"])
                grew = m > m_prev
                axes[1, c].plot(rows, m_prev, "-", color="#aaaaaa", label="before the step")
                axes[2, c].plot(rows, l_prev, "-", color="#aaaaaa")
            axes[1, c].plot(rows, m, ".-", color="#d94801", label="m after the step")
            axes[1, c].plot(
                rows[grew], m[grew], "o", mfc="none", mec="black", ms=7, label="max grew: l, O rescaled"
            )
            axes[1, c].set_ylim(m_all.min() - 0.2, m_all.max() + 0.2)
            axes[1, c].set_title(f"m: {grew.sum()} rows grew" if c else "m (from −inf)")
            axes[2, c].plot(rows, l, ".-", color="#2171b5", label="l after the step")
            axes[2, c].plot(rows[grew], l[grew], "o", mfc="none", mec="black", ms=7)
            axes[2, c].set_ylim(0, l_all.max() * 1.05)
            axes[2, c].set_title("running sum l")
            axes[3, c].bar(rows, errs[c], color="#238b45")
            axes[3, c].set_ylim(0, max(e.max() for e in errs) * 1.05)
            axes[3, c].set_title("max |O/l − O_final|")
            axes[3, c].set_xlabel(f"row of Q block {s['i']}")
        axes[1, 0].set_ylabel("m (score units)")
        axes[2, 0].set_ylabel("l (sum of exp)")
        axes[3, 0].set_ylabel("distance to\nfinal O")
        handles, labels = [], []
        for ax in (axes[1, -1], axes[2, -1]):
            for h, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in labels:
                    handles.append(h)
                    labels.append(lab)
        fig.legend(handles, labels, loc="outside lower center", ncol=len(labels), frameon=False)
        _state_key(fig, names=("pending", "computed", "on chip"), masked=False)
    return fig


def program_map(shape: tuple[int, int], block: tuple[int, int]) -> np.ndarray:
    """Which program of a 2-D launch touches each element: (M, N) int array of program ids.

    shape: (M, N) elements; block: (BLOCK_M, BLOCK_N) per program; grid = (cdiv(M, BLOCK_M),
    cdiv(N, BLOCK_N)), program (a, b) has id a * cdiv(N, BLOCK_N) + b (row-major, as the drawings
    number them). A 1-D launch over n elements is shape (1, n), block (1, BLOCK_SIZE)."""
    (m, n), (bm, bn) = shape, block
    if min(m, n, bm, bn) < 1:
        raise ValueError(f"program_map: shape {shape} and block {block} must be positive")
    rows, cols = np.arange(m)[:, None] // bm, np.arange(n)[None, :] // bn
    return rows * math.ceil(n / bn) + cols


def _program_panel(ax, shape, block, pid):
    from matplotlib.colors import ListedColormap

    (m, n), (bm, bn) = shape, block
    g_m, g_n = math.ceil(m / bm), math.ceil(n / bn)
    padded = np.full((g_m * bm, g_n * bn), 0)  # 0: a lane past the end (masked)
    owner = program_map((g_m * bm, g_n * bn), block)
    padded[:m, :n] = np.where(owner[:m, :n] % 2 == 0, 1, 2)  # other programs, alternating shades
    lanes = owner == pid
    padded[lanes & (padded > 0)] = 3  # this program's elements
    padded[lanes & (padded == 0)] = 4  # this program's masked lanes
    ax.imshow(
        padded,
        cmap=ListedColormap(["#ffffff", "#c6dbef", "#9ecae1", "#fd8d3c", "#cb181d"]),
        vmin=-0.5,
        vmax=4.5,
        aspect="auto",
        interpolation="nearest",
    )
    ax.axhline(m - 0.5, color="black", linewidth=1)
    ax.axvline(n - 0.5, color="black", linewidth=1)
    masked = int(lanes.sum() - (lanes[:m, :n]).sum())
    ax.set_title(
        f"program {pid} = ({pid // g_n}, {pid % g_n})\n{int(lanes[:m, :n].sum())} elements,\n{masked} masked lanes"
    )
    ax.set_xlabel("column")
    ax.set_ylabel("row")


def program_strip(shape: tuple[int, int], block: tuple[int, int], n_shots: int = 4):
    """Static strip: for `n_shots` program ids, the elements each one loads (orange) and its lanes past
    the end of the array that the mask switches off (red); other programs' elements in blue, the array's
    edge as a black line. Returns the Figure."""
    import matplotlib.pyplot as plt

    n_prog = int(program_map(shape, block).max()) + 1
    pids = _pick_steps(n_prog, n_shots)
    with plt.rc_context(SMALL_FONTS):
        fig, axes = plt.subplots(
            1, len(pids), figsize=(min(WIDTH, 3.3 * len(pids)), 3.4), squeeze=False, layout="constrained"
        )
        for ax, pid in zip(axes[0], pids):
            _program_panel(ax, shape, block, pid)
    return fig


def program_widget(shape: tuple[int, int], block: tuple[int, int]):
    """A slider over program ids showing which elements each one touches (see `program_strip`)."""
    import matplotlib.pyplot as plt

    n_prog = int(program_map(shape, block).max()) + 1

    def draw(pid):
        _, ax = plt.subplots(figsize=(8, 4), layout="constrained")
        _program_panel(ax, shape, block, pid)

    return _slider(draw, n_prog, "program id")
