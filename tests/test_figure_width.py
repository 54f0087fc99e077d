"""The readable-figure rule of course_lib.perf.plotting: a figure a notebook shows fits JupyterLab's column at
1366 x 768 (COLUMN_PX as displayed) and its smallest text is at least 9 pt at 100 dpi; with
COURSE_STRICT_FIGURES=1 a figure that breaks it fails its cell, naming the figure, else it warns."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from course_lib.perf import plotting  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def _figure(width: float, title: str, tick_size: float | None = None):
    fig, ax = plt.subplots(figsize=(width, 3), layout="constrained")
    ax.plot([0, 1], [0, 1], label="a line")
    ax.set_title(title)
    ax.legend()
    if tick_size is not None:
        ax.tick_params(labelsize=tick_size)
    return fig


def test_a_wide_figure_fails_when_strict_and_names_itself(monkeypatch):
    monkeypatch.setenv(plotting.STRICT_ENV, "1")
    fig = _figure(12.5, "Scores of one Q block")
    fig.suptitle("The tile loop, step by step")
    with pytest.raises(plotting.FigureReadabilityError) as info:
        plotting.check_figure(fig, width_px=1250)
    message = str(info.value)
    assert "'The tile loop, step by step'" in message, message  # the suptitle names a figure
    assert "1250 px wide" in message and "12.50 in" in message, message
    assert f"{plotting.COLUMN_PX} px" in message and "1366x768" in message, message


def test_a_wide_figure_warns_without_the_variable(monkeypatch):
    monkeypatch.delenv(plotting.STRICT_ENV, raising=False)
    fig = _figure(14, "Too wide to read")  # no PNG width: the figure's own width at its dpi
    with pytest.warns(plotting.FigureReadabilityWarning, match="'Too wide to read'.*1400 px wide"):
        plotting.check_figure(fig)
    monkeypatch.setenv(plotting.STRICT_ENV, "0")  # "0" is off
    with pytest.warns(plotting.FigureReadabilityWarning):
        plotting.check_figure(fig)


def test_a_narrow_readable_figure_passes(monkeypatch):
    monkeypatch.setenv(plotting.STRICT_ENV, "1")
    fig = _figure(9.0, "Fits the column")
    assert plotting.figure_problems(fig) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plotting.check_figure(fig, width_px=plotting.COLUMN_PX)


def test_small_text_fails_and_turned_off_axes_do_not_count(monkeypatch):
    monkeypatch.setenv(plotting.STRICT_ENV, "1")
    fig = _figure(6, "Tiny ticks", tick_size=7)
    with pytest.raises(plotting.FigureReadabilityError, match=r"'Tiny ticks'.*smallest text.*7 pt"):
        plotting.check_figure(fig)
    fig, ax = plt.subplots(figsize=(4, 4))
    ax.tick_params(labelsize=6)
    ax.axis("off")  # its tick labels are not drawn
    ax.set_title("Tiles")
    assert plotting.figure_problems(fig) == []


def test_a_shrunk_figure_counts_its_text_at_the_shrunk_size():
    fig = _figure(9.0, "Ticks of 10 pt", tick_size=10)
    assert plotting.figure_problems(fig) == []
    problems = plotting.figure_problems(fig, width_px=1400)  # shown at 67 %: 10 pt reads as 9.3 px
    assert len(problems) == 2 and "shows at 67%" in problems[0] and "9.3 px" in problems[1], problems


def test_a_figure_without_a_title_is_named_by_its_label():
    fig = plt.figure(figsize=(12, 3), label="attention weights")
    assert plotting.figure_name(fig) == "attention weights"
    assert plotting.figure_name(plt.figure(figsize=(12, 3))).endswith("(no title)")


def test_an_ipython_shell_fails_a_wide_figure_shown_either_way():
    """Under IPython's inline backend: plt.show() of a wide figure raises in the cell; a wide figure shown
    implicitly at the end of a cell shows the error (a kernel sends it as an error, which fails nbval); a
    narrow one shows."""
    pytest.importorskip("IPython", reason="the inline backend needs IPython (a GPU image may have none)")
    pytest.importorskip("matplotlib_inline", reason="the inline backend needs matplotlib-inline")
    script = textwrap.dedent(
        """
        from IPython.core.interactiveshell import InteractiveShell
        shell = InteractiveShell.instance()
        shell.run_cell("import matplotlib.pyplot as plt; from course_lib.perf import plotting")
        cells = {
            "show": "fig, ax = plt.subplots(figsize=(12, 3)); ax.set_title('shown wide'); plt.show()",
            "implicit": "fig, ax = plt.subplots(figsize=(12, 3)); ax.set_title('implicit wide')",
            "value": "fig, ax = plt.subplots(figsize=(12, 3)); ax.set_title('value wide'); plt.close(fig); fig",
            "narrow": "fig, ax = plt.subplots(figsize=(8, 3)); ax.set_title('narrow'); plt.show()",
        }
        for name, code in cells.items():
            print(f"== {name}", flush=True)
            result = shell.run_cell(code)
            print(f"== {name} raised: {result.error_in_exec is not None}", flush=True)
        """
    )
    env = dict(
        os.environ,
        MPLBACKEND="module://matplotlib_inline.backend_inline",
        COURSE_STRICT_FIGURES="1",
        PYTHONPATH=str(ROOT),
    )
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    sections = {s.split("\n", 1)[0]: s for s in out.split("== ")[1:]}
    assert "FigureReadabilityError" in sections["show"] and "'shown wide'" in sections["show"], out
    assert "show raised: True" in out and "value raised: True" in out, out
    assert "FigureReadabilityError" in sections["implicit"] and "'implicit wide'" in sections["implicit"], out
    assert "'value wide'" in sections["value"], out
    assert "Error" not in sections["narrow"] and "narrow raised: False" in out, out
    assert "<Figure size 800x300 with 1 Axes>" in sections["narrow"], out
