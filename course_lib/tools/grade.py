"""`python -m course_lib grade [NOTEBOOKS ...]` (and `make grade`): run a learner's notebooks headless and print a
scorecard per notebook, also written as JSON for an instructor.

For each notebook: exercises solved / attempted / total, predictions made and how close they were, the kernel
exercises that pass and, on a GPU, each such kernel's time against course_lib's (`exercises.time_kernels`). The
notebook is executed on a copy (the learner's file is never written), every cell run even after an error, with
`COURSE_GRADE_LOG` set so that `course_lib.exercises` records each check, prediction, score and timing.

Totals come from the notebook itself: its cells tagged `check` (one exercise each, named in the `check(...)` or
`check_cases(...)` call) and its `predict(...)` calls. An exercise is attempted when its check ran the learner's
code and it did not raise NotImplementedError, solved when the check passed.

Why not nbgrader: it shares this course's `### BEGIN SOLUTION` markers, but its grading needs a course database
and an exchange directory, and installing it pulled about a hundred packages (SQLAlchemy, alembic, ...) into the
environment in our trial; the course's checks already name the failing case and give hints, which nbgrader's
assert-based test cells do not. An instructor who uses nbgrader can still grade these notebooks with it: the
markers are the same.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = ROOT / "build" / "student"
# a call's first argument when it is a string literal: (f-prefix, quote, text); an apostrophe inside double quotes
# is part of the name, and an f-string's {fields} match whatever the run formatted into them
_CALL = r"\b{fn}\(\s*(?:name\s*=\s*)?(f?)([\"'])(.*?)(?<!\\)\2"
CHECK_NAME = re.compile(_CALL.format(fn=r"check\w*"))  # check, check_cases, check_merge, ...
PREDICT_NAME = re.compile(_CALL.format(fn="predict"))
TIMED_NAME = re.compile(_CALL.format(fn="time_kernels"))


F_STRING = "\x1f"  # in front of an f-string's name (a character no exercise name holds)


def _names(pattern: re.Pattern, source: str) -> list[str]:
    """The names of the calls `pattern` finds; an f-string's marked with F_STRING in front (see `_matcher`)."""
    return [(F_STRING if f else "") + text for f, _, text in pattern.findall(source)]


def _matcher(name: str):
    """A test of whether a logged name is `name` (an f-string template: its {fields} match anything)."""
    if not name.startswith(F_STRING):
        return lambda logged: logged == name
    parts = re.split(r"(\{[^}]*\})", name[1:])
    regex = re.compile("".join(".+?" if part.startswith("{") else re.escape(part) for part in parts) + "$")
    return lambda logged: bool(regex.match(logged))


def _shown(name: str) -> str:
    return name.removeprefix(F_STRING)


__all__ = ["grade_notebook", "main"]


def _inventory(nb) -> tuple[list[str], list[str], list[str]]:
    """(exercise names in order, kernel exercise names (timed by time_kernels), prediction names)."""
    exercises, kernels, predictions = [], [], []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if "check" in cell.metadata.get("tags", []):
            exercises += [n for n in _names(CHECK_NAME, cell.source) if n not in exercises]
        kernels += [n for n in _names(TIMED_NAME, cell.source) if n not in kernels]
        predictions += [n for n in _names(PREDICT_NAME, cell.source) if n not in predictions]
    return exercises, kernels, predictions


def grade_notebook(path: Path, timeout: int = 900) -> dict:
    """Execute a copy of the notebook at `path` with the grade log on; return its scorecard as a dict."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    exercises, kernels, predictions = _inventory(nb)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "grade.jsonl"
        log.touch()
        # COURSE_HEADLESS: no widgets (a slider in a headless kernel once held a cell until its timeout)
        env = {"COURSE_GRADE_LOG": str(log), "COURSE_GRADE_NOTEBOOK": path.stem, "COURSE_HEADLESS": "1"}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        t0 = time.perf_counter()
        error = None
        try:
            client = NotebookClient(
                nb, timeout=timeout, allow_errors=True, kernel_name="python3",
                resources={"metadata": {"path": str(path.parent)}},
                # the kernel's own log, errors only: ipykernel 7 warns of its local TCP sockets at every start, a
                # line per notebook between the scorecard's (a cell's warnings are its outputs, not this log)
                extra_arguments=["--IPKernelApp.log_level=ERROR"],
            )  # fmt: skip
            client.execute()
        except Exception as exc:  # a kernel that died: grade what was logged before it
            error = f"{type(exc).__name__}: {exc}"
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    seconds = time.perf_counter() - t0

    def named(event: str) -> dict:
        """{inventory name: the events of kind `event` logged under it}"""
        return {n: [e for e in events if e["event"] == event and _matcher(n)(e["name"])] for n in names}

    names = {*exercises, *kernels, *predictions}
    rank = {"correct": 2, "wrong": 1, "not_done": 0}
    status = {n: max((e["status"] for e in es), key=rank.get) for n, es in named("check").items() if es}
    scores = {n: es[-1] for n, es in named("score").items() if es}
    timings = {n: es[-1] for n, es in named("timing").items() if es}
    made = [n for n in predictions if scores.get(n, {}).get("predicted") is not None]
    return {
        "notebook": path.name,
        "seconds": round(seconds, 1),
        "error": error,
        "exercises": {
            "total": len(exercises),
            "solved": sum(status.get(n) == "correct" for n in exercises),
            "attempted": sum(status.get(n) in ("correct", "wrong") for n in exercises),
            "each": {_shown(n): status.get(n, "not run") for n in exercises},
        },
        "predictions": {
            "total": len(predictions),
            "made": len(made),
            "good": sum(bool(scores[n].get("good")) for n in made),
            "each": {
                _shown(n): {k: scores[n].get(k) for k in ("predicted", "measured", "ratio")}
                if n in scores
                else None
                for n in predictions
            },
        },
        "kernels": {
            _shown(n): {
                "passes": status.get(n) == "correct",
                **{k: v for k, v in timings.get(n, {}).items() if k.endswith("_ms")},
            }
            for n in kernels
        },
    }


def _line(card: dict) -> str:
    ex, pr = card["exercises"], card["predictions"]
    kernels = card["kernels"]
    k_pass = sum(k["passes"] for k in kernels.values())
    speed = [
        f"{n}: {k['yours_ms'] / k['course_lib_ms']:.2f}x course_lib's time"
        for n, k in kernels.items()
        if "yours_ms" in k and "course_lib_ms" in k
    ]
    text = (
        f"{card['notebook']:<40} exercises {ex['solved']:>2} solved / {ex['attempted']:>2} attempted / "
        f"{ex['total']:>2}   predictions {pr['made']}/{pr['total']} made, {pr['good']} within 2x"
        f"   kernels passing {k_pass}/{len(kernels)}"
    )
    if speed:
        text += "\n" + " " * 42 + "; ".join(speed)
    if card["error"]:
        text += f"\n{' ' * 42}the run stopped: {card['error']}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib grade", description=__doc__.splitlines()[0])
    parser.add_argument(
        "notebooks", nargs="*",
        help="notebook files, or numbers (06) of the notebooks in --dir (default: every notebook there)",
    )  # fmt: skip
    parser.add_argument(
        "--dir", default=str(DEFAULT_DIR), help="the learner's folder (default build/student)"
    )
    parser.add_argument("--json", default=None, help="where to write the scorecard (default DIR/grade.json)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds a cell may take")
    args = parser.parse_args(argv)
    folder = Path(args.dir)
    paths = []
    for item in args.notebooks or ["*"]:
        p = Path(item)
        if p.suffix == ".ipynb":
            paths.append(p)
        else:
            found = sorted(folder.glob(f"{item}*.ipynb" if item != "*" else "[0-9]*.ipynb"))
            if not found:
                print(f"grade: no notebook {item!r} in {folder}/ (build the student edition: make student)")
                return 2
            paths += found
    cards = []
    for p in paths:
        card = grade_notebook(p, args.timeout)
        cards.append(card)
        print(_line(card), flush=True)
    out = Path(args.json) if args.json else folder / "grade.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    total = {k: sum(c["exercises"][k] for c in cards) for k in ("solved", "attempted", "total")}
    device = "cuda" if shutil.which("nvidia-smi") else "cpu"
    out.write_text(json.dumps({"device": device, "total": total, "notebooks": cards}, indent=1) + "\n")
    print(f"\nall: {total['solved']} of {total['total']} exercises solved, {total['attempted']} attempted. "
          f"Scorecard: {out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
