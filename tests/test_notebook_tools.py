"""Notebooks stay in sync with their sources, and the student edition is made correctly."""

import pytest

from course_lib.tools import notebooks

nbformat = pytest.importorskip("nbformat", reason="the notebook tools need nbformat and jupytext")
pytest.importorskip("jupytext")


def code_cell(source, tags=()):
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["tags"] = list(tags)
    return cell


def test_committed_notebooks_are_in_sync_and_stripped():
    assert notebooks.sources(), "no notebook sources found"
    assert notebooks.check() == []


def test_student_edition_removes_solutions_and_expects_checks_to_fail():
    nb = nbformat.v4.new_notebook(
        cells=[
            code_cell("def f(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION\n"),
            code_cell("answer = 1\n### BEGIN SOLUTION\nanswer = 42\n### END SOLUTION"),
            code_cell("secret = 7", tags=["solution"]),
            code_cell("check('f', lambda: f(2), 4)", tags=["check"]),
            code_cell("print('later cells run as they are')"),
        ]
    )
    out = notebooks.student_notebook(nb)
    f_cell, top_cell, whole, chk, later = out.cells
    assert "return 2 * x" not in f_cell.source and "    raise NotImplementedError" in f_cell.source
    assert "raises-exception" not in f_cell.metadata["tags"]  # defining f does not raise
    assert "answer = 42" not in top_cell.source and "raises-exception" in top_cell.metadata["tags"]
    assert "secret" not in whole.source and "solution" not in whole.metadata["tags"]
    assert "raises-exception" in chk.metadata["tags"]
    assert later.source == nb.cells[4].source
    assert "return 2 * x" in nb.cells[0].source, "the instructor notebook must be left unchanged"


def test_every_notebook_with_exercises_checks_them():
    for py in notebooks.sources():
        nb = nbformat.reads(notebooks.build(py), as_version=4)
        has_solution = any(
            notebooks.BEGIN in c.source or "solution" in c.metadata.get("tags", []) for c in nb.cells
        )
        has_check = any("check" in c.metadata.get("tags", []) for c in nb.cells)
        assert not has_solution or has_check, f"{py.name}: exercises without a `check` cell"


def test_run_notebooks_side_by_side(tmp_path, monkeypatch, capsys):
    """--jobs 2 runs every selected script, reports each failure with its log, and fails overall."""
    from course_lib.tools import run_notebooks

    good, bad, other = tmp_path / "01_good.py", tmp_path / "02_bad.py", tmp_path / "03_other.py"
    good.write_text("print('good ran')\n")
    bad.write_text("raise SystemExit('bad notebook failed here')\n")
    other.write_text("print('other ran')\n")
    monkeypatch.setattr(run_notebooks, "sources", lambda: [good, bad, other])
    monkeypatch.setattr(run_notebooks, "NOTEBOOKS", tmp_path)
    monkeypatch.setattr(run_notebooks, "ROOT", tmp_path)
    assert run_notebooks.main(["--jobs", "2"]) == 1
    out = capsys.readouterr().out
    assert "2 passed, 1 failed" in out and "bad notebook failed here" in out
    assert "good ran" in (tmp_path / "build" / "notebook-logs" / "01_good.log").read_text()
    assert run_notebooks.main(["--jobs", "2", "good", "other"]) == 0
    assert "over the" not in capsys.readouterr().out  # these take well under the budget
    monkeypatch.setattr(run_notebooks, "BUDGET_S", 0)
    assert run_notebooks.main(["good"]) == 0
    assert "over the 0 s a notebook may take" in capsys.readouterr().out


def test_run_cells_times_each_cell_in_one_namespace(tmp_path, capsys):
    """--cells: a percent-format source runs cell by cell in one namespace and its slowest cells are
    printed with their line and section heading; a failing cell raises."""
    import time

    from course_lib.tools import run_notebooks

    source = (
        "# %% [markdown]\n# # Title\n# ## 1. Fast part\n"
        "# %%\nx = 1\n"
        "# %% [markdown]\n# ## 2. Slow part\n"
        "# %%\nimport time\ntime.sleep(0.3)\ny = x + 1\n"
    )
    assert [(line, section) for line, section, _ in run_notebooks.split_cells(source)] == [
        (1, "1. Fast part"), (4, "1. Fast part"), (6, "2. Slow part"), (8, "2. Slow part"),
    ]  # fmt: skip
    nb = tmp_path / "01_cells.py"
    nb.write_text(source)
    t0 = time.perf_counter()
    times = run_notebooks.run_cells(str(nb), slowest=2)
    assert times[0][1:] == (8, "2. Slow part") and 0.3 <= times[0][0] <= time.perf_counter() - t0
    assert "line 8" in capsys.readouterr().out
    nb.write_text(source + "# %%\nassert y == 3, 'y is ' + str(y)\n")
    with pytest.raises(AssertionError, match="y is 2"):
        run_notebooks.run_cells(str(nb))


def test_pairing_is_for_authors_only(tmp_path):
    """notebooks/ pairs .ipynb with percent .py sources; the student edition (elsewhere) is not paired."""
    from jupytext.config import find_jupytext_configuration_file, load_jupytext_configuration_file

    config = find_jupytext_configuration_file(str(notebooks.NOTEBOOKS))
    assert config is not None and config.startswith(str(notebooks.NOTEBOOKS)), config
    assert load_jupytext_configuration_file(config).formats in ("ipynb,py:percent", ["ipynb,py:percent"])
    student = notebooks.ROOT / "build" / "student"
    found = find_jupytext_configuration_file(str(student if student.exists() else notebooks.ROOT / "build"))
    assert found is None, f"the student edition would be paired by {found}"


def test_sources_by_name():
    assert [p.name[:2] for p in notebooks.sources(["00", "03"])] == ["00", "03"]
    with pytest.raises(ValueError, match="no notebook source"):
        notebooks.sources(["99"])


def test_student_edition_blanks_every_prediction():
    nb = nbformat.v4.new_notebook(
        cells=[
            code_cell(
                'g = predict("speed-up", 4.0, unit="x")  # type your estimate\nh = predict("b", value=2)'
            )
        ]
    )
    (cell,) = notebooks.student_notebook(nb).cells
    assert (
        cell.source
        == 'g = predict("speed-up", None, unit="x")  # type your estimate\nh = predict("b", value=None)'
    )


def _student_editions():
    for py in notebooks.sources():
        yield py, notebooks.student_notebook(nbformat.reads(notebooks.build(py), as_version=4))


def test_generated_student_notebooks_hold_no_answer_and_no_prefilled_prediction():
    """In every generated student notebook: no prediction has a value, no check cell holds hints (the last of
    which used to be the solution) or a solution region, and no cell keeps a solution marker."""
    import ast

    for py, nb in _student_editions():
        for k, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            where = f"{py.name}, code cell {k}"
            assert notebooks.BEGIN not in cell.source and notebooks.END not in cell.source, where
            if "check" in cell.metadata.get("tags", []):
                assert "hints=" not in cell.source, (
                    f"{where}: hints belong in course_lib.hints, not on screen"
                )
            try:
                tree = ast.parse(cell.source)
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and getattr(node.func, "id", getattr(node.func, "attr", "")) == "predict"
                ):
                    value = (
                        node.args[1]
                        if len(node.args) > 1
                        else next((kw.value for kw in node.keywords if kw.arg == "value"), None)
                    )
                    assert isinstance(value, ast.Constant) and value.value is None, (
                        f"{where}: a pre-filled prediction"
                    )


def test_rebuilding_the_student_edition_keeps_saved_work(tmp_path, capsys):
    """A learner solves an exercise and saves; `make student` again keeps it, and says so; a notebook the
    learner never changed is brought up to date; `reset` backs the learner's copy up before starting over."""
    out = tmp_path / "student"
    notebooks.student(out, ["00", "03"])
    mine = out / "00_setup.ipynb"
    nb = nbformat.read(mine, as_version=4)
    solved = next(c for c in nb.cells if c.cell_type == "code" and "raise NotImplementedError" in c.source)
    blank = 'raise NotImplementedError("Exercise: replace this line with your code")'
    solved.source = solved.source.replace(blank, "pass  # my answer")
    nbformat.write(nb, mine)
    saved = mine.read_text()
    notebooks.student(out, ["00", "03"])  # the same edition again: nothing to do
    assert mine.read_text() == saved
    untouched = out / "03_softmax.ipynb"
    for name in ("00_setup.ipynb", "03_softmax.ipynb"):  # the course changed since both were built
        older = nbformat.read(out / ".pristine" / name, as_version=4)
        older.cells[0].source += "\n(an older edition's words)"
        nbformat.write(older, out / ".pristine" / name)
        if name == untouched.name:  # the learner never changed this one
            nbformat.write(older, untouched)
    capsys.readouterr()
    notebooks.student(out, ["00", "03"])
    assert mine.read_text() == saved, "the rebuild overwrote the learner's saved work"
    printed = capsys.readouterr().out
    assert "kept your work" in printed and "00_setup.ipynb" in printed and f"wrote {untouched}" in printed
    assert "older edition" not in untouched.read_text()
    notebooks.reset(out, ["00"])
    (backup,) = (out / "backup").glob("*/00_setup.ipynb")
    assert backup.read_text() == saved and "my answer" not in mine.read_text()


def test_verification_edition_runs_the_answer_beside_the_student_edition():
    """After each check cell comes a cell that runs the instructor's exercise cells and the check in a copy of
    the namespace; a check cell without an exercise before it is refused."""
    from course_lib.tools.verify import run_solution

    nb = nbformat.v4.new_notebook(
        cells=[
            code_cell("x = 1"),
            code_cell("def f(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION\n"),
            code_cell("assert f(2) == 4", tags=["check"]),
            code_cell("assert 'f' in globals()"),
        ]
    )
    out = notebooks.verify_notebook(nb, "demo")
    assert [c.metadata.get("tags", []) for c in out.cells][2:4] == [
        ["check", "raises-exception"],
        ["verification"],
    ]
    namespace = {"x": 1}
    exec(out.cells[1].source, namespace)  # the student's unsolved f
    exec(out.cells[3].source, namespace)  # the answer passes its check, in a copy of the namespace
    with pytest.raises(AssertionError, match="instructor's answer failed"):
        run_solution({}, ["def f(x):\n    return 3 * x", "assert f(2) == 4"], "demo")
    bad = nbformat.v4.new_notebook(cells=[code_cell("assert True", tags=["check"])])
    with pytest.raises(ValueError, match="no exercise cell"):
        notebooks.verify_notebook(bad, "bad")
