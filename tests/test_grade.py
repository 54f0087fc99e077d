"""`python -m course_lib grade`: a learner's notebook run headless gives a scorecard (solved / attempted / total,
predictions made and scored), the learner's file is not written, and an unsolved notebook grades to zero.
Names with an apostrophe and f-string names (matched against what the run formatted) are counted too."""

import json

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")


def _notebook(solved: bool, predicted: bool):
    cell = nbformat.v4.new_code_cell
    answer = "    return 2 * x" if solved else '    raise NotImplementedError("Exercise")'
    cells = [
        cell("from course_lib.exercises import check, predict"),
        cell(f"def double(x):\n{answer}"),
        cell('check("double\'s answer", lambda: double(3), 6)', metadata={"tags": ["check"]}),
        cell("def triple(x):\n    return 4 * x  # wrong"),
        cell('check("fused triple", lambda: triple(3), 9)', metadata={"tags": ["check"]}),
        cell("N = 4"),
        cell(f'guess = predict(f"a ratio at {{N}} ranks", {3.0 if predicted else None}, unit="x")'),
        cell("guess.score(4.0)"),
    ]
    return nbformat.v4.new_notebook(
        cells=cells,
        metadata={"kernelspec": {"name": "python3", "language": "python", "display_name": "Python 3"}},
    )


def test_scorecard_counts_solved_attempted_and_predictions(tmp_path, capsys):
    from course_lib.tools import grade

    folder = tmp_path / "student"
    folder.mkdir()
    nbformat.write(_notebook(solved=True, predicted=True), folder / "01_a.ipynb")
    nbformat.write(_notebook(solved=False, predicted=False), folder / "02_b.ipynb")
    before = (folder / "02_b.ipynb").read_text()
    assert grade.main(["--dir", str(folder), "--timeout", "120"]) == 0
    card = json.loads((folder / "grade.json").read_text())
    a, b = card["notebooks"]
    assert (a["exercises"]["solved"], a["exercises"]["attempted"], a["exercises"]["total"]) == (1, 2, 2)
    assert a["predictions"] == {
        "total": 1, "made": 1, "good": 1,
        "each": {"a ratio at {N} ranks": {"predicted": 3.0, "measured": 4.0, "ratio": pytest.approx(4 / 3)}},
    }  # fmt: skip
    assert (b["exercises"]["solved"], b["exercises"]["attempted"]) == (0, 1)  # triple runs, and is wrong
    assert b["exercises"]["each"] == {"double's answer": "not_done", "fused triple": "wrong"}
    assert b["predictions"]["made"] == 0 and b["error"] is None
    assert (folder / "02_b.ipynb").read_text() == before, "grading wrote the learner's notebook"
    assert "1 of 4 exercises solved" in capsys.readouterr().out
