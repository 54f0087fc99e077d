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

    python -m course_lib.tools.notebooks sync [NN ...]|check|student OUTDIR
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


def student_notebook(nb):
    """The student edition of an (instructor) notebook: solutions out, checks expected to fail."""
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
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


def student(outdir: Path) -> None:
    import nbformat

    outdir.mkdir(parents=True, exist_ok=True)
    for py in sources():
        nb = nbformat.reads(build(py), as_version=4)
        target = outdir / py.with_suffix(".ipynb").name
        target.write_text(nbformat.writes(student_notebook(nb)) + "\n")
        print(f"wrote {target}")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("sync", "check", "student"):
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
        if len(argv) != 2:
            print("usage: python -m course_lib.tools.notebooks student OUTDIR")
            return 2
        student(Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
