"""Notebook sources, the committed notebooks, and the student edition.

Each notebook is written as a jupytext percent-format script, `notebooks/NN_name.py` (the file
reviewers read and instructors edit); `notebooks/NN_name.ipynb` is generated from it with no outputs
(the file learners open). `sync` regenerates the .ipynb files; `check` fails when one is missing,
stale, or carries outputs.

Exercise marking, used by every notebook:
- `### BEGIN SOLUTION` ... `### END SOLUTION` inside a code cell: the student edition replaces the
  region with `raise NotImplementedError(...)` at the same indentation.
- a cell tagged `solution`: the student edition replaces the whole cell with a placeholder comment.
- a cell tagged `check`: checks a learner's answer (through `course_lib.exercises.check`); in the
  student edition it is tagged `raises-exception`, since it fails until the exercise is solved.
Later cells never depend on a learner's answer: they call course_lib's finished functions.

- predictions: every `predict(name, value, ...)` starts at None in the student edition (the learner types it).

The student edition is written into a folder where learners save their work, so `student` never overwrites a
notebook the learner has changed (it says which it kept); `reset OUTDIR NN` starts one over, backing the old one
up. `verify OUTDIR` writes the verification edition that `make test` runs (course_lib.tools.verify).

    python -m course_lib.tools.notebooks sync [NN ...] | check
    python -m course_lib.tools.notebooks student OUTDIR [NN ...] | reset OUTDIR NN ... | verify OUTDIR [NN ...]
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def sources(names: list[str] | None = None) -> list[Path]:
    """The percent-format sources, all of them or those whose file name starts with one of `names` ("04").

    A source is `NN_name.py` or `NNx_name.py` (04b_tiled_backward.py, 08c_hopper_appendix.py): two digits,
    an optional letter, an underscore. Sorted by file name, so 04 < 04b < 05.
    """
    found = sorted(p for p in NOTEBOOKS.glob("[0-9][0-9]*_*.py"))
    if names:
        found = [p for p in found if any(p.name.startswith(n) for n in names)]
        if not found:
            raise ValueError(f"no notebook source in {NOTEBOOKS} starts with any of {names}")
    return found


def build(py: Path) -> str:
    """The .ipynb text for a percent-format source: outputs empty, ids numbered, kernelspec set."""
    import jupytext  # imported here: a GPU machine without Jupyter still runs `sources()`
    import nbformat

    nb = jupytext.read(py)
    nb.metadata.pop("jupytext", None)
    nb.metadata["kernelspec"] = KERNELSPEC
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):
        cell["id"] = str(i)
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    nb.nbformat, nb.nbformat_minor = 4, 5
    return nbformat.writes(nb) + "\n"


def sync(names: list[str] | None = None) -> None:
    for py in sources(names):
        target = py.with_suffix(".ipynb")
        text = build(py)
        if not target.exists() or target.read_text() != text:
            target.write_text(text)
            print(f"wrote {target.relative_to(ROOT)}")


def check() -> list[str]:
    errors = []
    for py in sources():
        target = py.with_suffix(".ipynb")
        if not target.exists():
            errors.append(f"{target.relative_to(ROOT)} is missing: run `make notebooks`")
        elif target.read_text() != build(py):
            errors.append(
                f"{target.relative_to(ROOT)} is out of sync with {py.name} or has outputs: "
                "run `make notebooks`"
            )
    for ipynb in sorted(NOTEBOOKS.glob("*.ipynb")):
        if not ipynb.with_suffix(".py").exists():
            errors.append(
                f"{ipynb.relative_to(ROOT)} has no percent-format source {ipynb.with_suffix('.py').name}"
            )
    return errors


def _strip_solution_regions(source: str) -> tuple[str, bool]:
    """Replace each BEGIN/END SOLUTION region by a NotImplementedError. Returns (source, raises_at_top)."""
    out, inside, top_level = [], False, False
    for line in source.splitlines():
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise ValueError(f"nested {BEGIN!r}")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            top_level |= indent == ""
            out.append(f"{indent}# YOUR CODE HERE")
            out.append(f'{indent}raise NotImplementedError("Exercise: replace this line with your code")')
        elif stripped == END:
            if not inside:
                raise ValueError(f"{END!r} without {BEGIN!r}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{BEGIN!r} without {END!r}")
    return "\n".join(out), top_level


def _blank_predictions(source: str) -> str:
    """Every `predict(name, value, ...)` call with its value replaced by None: the learner types the number.

    The value is the second positional argument or `value=`; a call whose value is already None is left as it
    is. Cells that are not plain Python (IPython magics) are left unchanged."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    lines = source.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    spans = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", "")) == "predict"
        ):
            continue
        value = (
            node.args[1]
            if len(node.args) > 1
            else next((k.value for k in node.keywords if k.arg == "value"), None)
        )
        if value is None or (isinstance(value, ast.Constant) and value.value is None):
            continue
        start = starts[value.lineno - 1] + len(lines[value.lineno - 1].encode()[: value.col_offset].decode())
        end = starts[value.end_lineno - 1] + len(
            lines[value.end_lineno - 1].encode()[: value.end_col_offset].decode()
        )
        spans.append((start, end))
    for start, end in sorted(spans, reverse=True):
        source = source[:start] + "None" + source[end:]
    return source


def student_notebook(nb):
    """The student edition of an (instructor) notebook: solutions out, predictions blank, checks expected to
    fail."""
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.source = _blank_predictions(cell.source)
        tags = cell.metadata.setdefault("tags", [])
        if "solution" in tags:
            cell.source = "# YOUR CODE HERE: this exercise's answer goes in this cell."
            tags.remove("solution")
        elif BEGIN in cell.source:
            cell.source, top_level = _strip_solution_regions(cell.source)
            if top_level and "raises-exception" not in tags:
                tags.append("raises-exception")
        if "check" in tags and "raises-exception" not in tags:
            tags.append("raises-exception")
    return nb


def _is_solution(cell) -> bool:
    return cell.cell_type == "code" and ("solution" in cell.metadata.get("tags", []) or BEGIN in cell.source)


def verify_notebook(nb, label: str):
    """The verification edition: the student edition, plus after each check cell a cell that runs the
    instructor's exercise cells (from the first solution cell after the previous check, through the check cell)
    in a copy of the namespace (`course_lib.tools.verify.run_solution`). Raises ValueError for a check cell with
    no exercise cell before it."""
    import nbformat

    student_nb = student_notebook(nb)
    cells, start, last_start = [], None, None
    for i, (ours, theirs) in enumerate(zip(nb.cells, student_nb.cells)):
        cells.append(theirs)
        if ours.cell_type != "code":
            continue
        if start is None and _is_solution(ours):
            start = i
        if "check" not in ours.metadata.get("tags", []):
            continue
        first = start if start is not None else last_start
        if first is None:
            raise ValueError(
                f"{label}: the check cell {i} has no exercise cell (### BEGIN SOLUTION) before it"
            )
        block = [c.source for c in nb.cells[first : i + 1] if c.cell_type == "code"]
        code = (
            "# Verification edition only: the instructor's answer to the exercise above, run in a copy of this\n"
            "# notebook's namespace (course_lib.tools.verify). Students never see this cell.\n"
            "from course_lib.tools.verify import run_solution as _run_solution\n\n"
            f"_run_solution(globals(), {block!r}, {f'{label}, check cell {i}'!r})"
        )
        cells.append(nbformat.v4.new_code_cell(code, metadata={"tags": ["verification"]}))
        last_start, start = first, None
    student_nb.cells = cells
    for k, cell in enumerate(student_nb.cells):
        cell["id"] = str(k)
    return student_nb


def _code_sources(nb) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


def student(outdir: Path, names: list[str] | None = None) -> None:
    """Write the student edition into `outdir`, never over a learner's work.

    A notebook that is missing is written. One that is there is replaced only if its code cells are still
    exactly those of the edition it was built from (kept in `outdir/.pristine/`): the learner changed nothing,
    so nothing is lost (outputs aside). Otherwise it is kept and the command says so; `reset` starts one over,
    keeping a backup."""
    import nbformat

    outdir.mkdir(parents=True, exist_ok=True)
    pristine = outdir / ".pristine"
    pristine.mkdir(exist_ok=True)
    kept = []
    for py in sources(names):
        name = py.with_suffix(".ipynb").name
        text = nbformat.writes(student_notebook(nbformat.reads(build(py), as_version=4))) + "\n"
        target, base = outdir / name, pristine / name
        if target.exists():
            if base.exists() and base.read_text() == text:
                continue  # up to date
            mine = _code_sources(nbformat.read(target, as_version=4))
            if not base.exists() or mine != _code_sources(nbformat.read(base, as_version=4)):
                kept.append(name)
                continue
        target.write_text(text)
        base.write_text(text)
        print(f"wrote {target}")
    if kept:
        print(
            f"kept your work in {len(kept)} notebook(s) of {outdir}/ (you changed them, or they predate this "
            f"build): {', '.join(kept)}.\nTo start one over from the course's current edition (your copy is "
            f"backed up first): make student-reset NB={kept[0].split('_')[0]}"
        )


def reset(outdir: Path, names: list[str]) -> None:
    """Start the named student notebooks over: back up the learner's copy into `outdir/backup/`, then write
    the current student edition."""
    import time

    if not names:
        raise SystemExit(
            "name the notebooks to start over, e.g. make student-reset NB=06 (NB=all for every one)"
        )
    if names == ["all"]:
        names = None
    backup = outdir / "backup" / time.strftime("%Y%m%d-%H%M%S")
    for py in sources(names):
        target = outdir / py.with_suffix(".ipynb").name
        if target.exists():
            backup.mkdir(parents=True, exist_ok=True)
            target.rename(backup / target.name)
            print(f"backed up {target.name} to {backup}/")
        (outdir / ".pristine" / target.name).unlink(missing_ok=True)
    student(outdir, names)


def verify(outdir: Path, names: list[str] | None = None) -> None:
    import nbformat

    outdir.mkdir(parents=True, exist_ok=True)
    for py in sources(names):
        nb = nbformat.reads(build(py), as_version=4)
        target = outdir / py.with_suffix(".ipynb").name
        target.write_text(nbformat.writes(verify_notebook(nb, py.stem)) + "\n")
        print(f"wrote {target}")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("sync", "check", "student", "reset", "verify"):
        print(__doc__)
        return 2
    if argv[0] == "sync":
        sync(argv[1:])
    elif argv[0] == "check":
        errors = check()
        for e in errors:
            print(e)
        if errors:
            return 1
        print(f"{len(sources())} notebooks in sync with their sources, no outputs")
    else:
        if len(argv) < 2:
            print(f"usage: python -m course_lib.tools.notebooks {argv[0]} OUTDIR [NN ...]")
            return 2
        command = {"student": student, "reset": reset, "verify": verify}[argv[0]]
        command(Path(argv[1]), argv[2:] or ([] if argv[0] == "reset" else None))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
