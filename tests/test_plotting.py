"""Tests for course_lib.perf.plotting: labels, scales, missing points and clear errors."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from course_lib.perf.plotting import bar_chart, plot_series, print_table, roofline  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_plot_series_labels_scales_and_gaps():
    ax = plot_series(
        [128, 256, 512],
        {"measured": [1.0, None, 16.0], "model": [1, 4, 16]},
        xlabel="N",
        ylabel="time (ms)",
        title="grows as N²",
        logx=True,
        logy=True,
    )
    assert ax.get_xlabel() == "N" and ax.get_ylabel() == "time (ms)" and ax.get_title() == "grows as N²"
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"measured", "model"}
    assert math.isnan(lines["measured"].get_ydata()[1]), "None must become a gap"


def test_plot_series_errors_name_the_problem():
    with pytest.raises(ValueError, match="'b' has 2 values but x has 3"):
        plot_series([1, 2, 3], {"a": [1, 2, 3], "b": [1, 2]}, xlabel="x", ylabel="y", title="t")
    with pytest.raises(ValueError, match="xlabel"):
        plot_series([1], {"a": [1]}, xlabel="", ylabel="y", title="t")
    with pytest.raises(ValueError, match="non-empty dict"):
        plot_series([1], {}, xlabel="x", ylabel="y", title="t")
    with pytest.raises(TypeError, match="series 'a'"):
        plot_series([1], {"a": ["fast"]}, xlabel="x", ylabel="y", title="t")


def test_plot_series_draws_on_a_given_axes():
    fig, (left, right) = plt.subplots(1, 2)
    assert plot_series([1, 2], {"a": [1, 2]}, xlabel="x", ylabel="y", title="t", ax=right) is right
    assert not left.get_lines()


@pytest.mark.parametrize("horizontal", [False, True])
def test_bar_chart_single_and_grouped(horizontal):
    ax = bar_chart(
        ["a", "b", "c"], [1.0, 2.0, None], xlabel="x", ylabel="y", title="t", horizontal=horizontal
    )
    assert len(ax.patches) == 3
    ax = bar_chart(
        ["a", "b"],
        {"time": [1, 2], "flops": [3, 4]},
        xlabel="x",
        ylabel="y",
        title="t",
        horizontal=horizontal,
    )
    assert len(ax.patches) == 4
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["time", "flops"]


def test_bar_chart_length_mismatch():
    with pytest.raises(ValueError, match="series 'flops' has 1 values for 2 labels"):
        bar_chart(["a", "b"], {"time": [1, 2], "flops": [3]}, xlabel="x", ylabel="y", title="t")


def test_roofline_draws_ceilings_and_points():
    points = [
        {"name": "relu", "flops": 1e6, "bytes": 8e6, "ms": 1.0},
        {"name": "matmul", "flops": 2e12, "bytes": 1e9, "ms": 10.0, "label": "recorded"},
    ]
    ax = roofline([("gpu", 100.0, 1000.0), ("gpu fp32", 10.0, 1000.0)], points, title="roofline")
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    roof = ax.get_lines()[0]
    x, y = np.asarray(roof.get_xdata()), np.asarray(roof.get_ydata())
    np.testing.assert_allclose(y, np.minimum(100.0, 1000.0 * x / 1e3))
    assert len(ax.collections) == 2, "one scatter per point group"
    texts = {t.get_text() for t in ax.texts}
    assert {"relu", "matmul", "ridge 100"} <= texts


def test_roofline_rejects_bad_ceilings():
    with pytest.raises(ValueError, match="at least one ceiling"):
        roofline([], title="t")
    with pytest.raises(ValueError, match="peak_tflops > 0"):
        roofline([("gpu", 0, 100)], title="t")


@pytest.mark.parametrize(
    "points, kwargs, words",
    [
        ([{"name": "relu", "flops": 1e6, "ms": 1.0}], {}, 'a point is a dict with "name", "flops", "bytes"'),
        ([("relu", 1e6, 8e6, 1.0)], {}, "a point is a dict"),
        ([{"name": "relu", "flops": 0.0, "bytes": 8e6, "ms": 1.0}], {}, "point 'relu''s flops must be"),
        ([{"name": "relu", "flops": 1e6, "bytes": 8e6, "ms": -1.0}], {}, "point 'relu''s ms must be"),
        ([{"name": "x", "flops": 1e6, "bytes": float("nan"), "ms": 1}], {}, "point 'x''s bytes must be"),
        ([], {"intensity_range": 10}, r"intensity_range is \(low, high\), got 10"),
        ([], {"intensity_range": (10, 1)}, "intensity_range's high must be a finite number > 10"),
        ([], {"intensity_range": (0, 1)}, "intensity_range's low must be a finite number > 0"),
    ],
)
def test_roofline_refuses_points_it_cannot_place(points, kwargs, words):
    """A point of zero FLOPs or time once went to log(0), a missing key raised a bare KeyError, and a
    reversed range drew an empty plot."""
    with pytest.raises(ValueError, match=words):
        roofline([("gpu", 100.0, 1000.0)], points, title="t", **kwargs)


def test_print_table(capsys):
    print_table([{"name": "relu", "ms": 1.23456, "note": None}, {"name": "softmax", "ms": 10.0, "note": "x"}])
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["name", "ms", "note"]
    assert "1.23" in out[2] and "-" in out[2]
    print_table([])
    assert capsys.readouterr().out.strip() == "(no rows)"
    with pytest.raises(TypeError, match="print_table: rows must be dicts, got"):
        print_table([("relu", 1.0)])
    with pytest.raises(TypeError, match="columns is a list of column names, got the string 'ms'"):
        print_table([{"ms": 1.0}], columns="ms")


def test_bar_chart_and_series_refuse_what_is_not_a_list_by_name():
    """Once a ZeroDivisionError (no series), len() of an int, a string split into labels, and a bare
    "'int' object is not iterable" where the message about the series was meant."""
    kw = dict(xlabel="x (n)", ylabel="y (ms)", title="t")
    for make, error, words in (
        (lambda: bar_chart(["a"], {}, **kw), ValueError, "non-empty dict of lists"),
        (lambda: bar_chart(["a"], 5, **kw), ValueError, "values must be a list"),
        (lambda: bar_chart("ab", [1, 2], **kw), TypeError, "labels must be a list of names, got str"),
        (
            lambda: plot_series([1], {"a": 5}, **kw),
            TypeError,
            "series 'a' must be a list of numbers or None, got 5",
        ),
    ):
        with pytest.raises(error, match=words):
            make()
    plt.close("all")
