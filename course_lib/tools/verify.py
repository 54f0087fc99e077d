"""Running an instructor's answer inside the student edition, for `make test` (the verification edition).

`course_lib.tools.notebooks verify OUTDIR` writes, for every notebook, its student edition (solutions removed,
predictions blank, checks expected to fail) with one more cell after each check cell. That cell runs the
instructor's exercise cells and the check again, in a copy of the notebook's namespace, so that:
- the student edition with nothing solved is shown to run to the end (the later cells see only the student's
  namespace: the answer never leaks into it), and
- every instructor answer is shown to pass its check,
in one run of each notebook instead of two (one per edition).
"""

from __future__ import annotations

import linecache

__all__ = ["run_solution"]


def run_solution(namespace: dict, sources: list[str], label: str) -> None:
    """Execute `sources` (cells of Python, IPython syntax allowed) one after another in a shallow copy of
    `namespace`. A failure raises, naming `label` (the notebook and the check cell) and the cell's error.

    Each cell is registered in `linecache` under its own file name, as IPython does for its cells, so that
    `inspect.getsource` (and with it `triton.jit`) reads the source of a function defined there."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        shell = None
    scope = dict(namespace)
    for k, source in enumerate(sources):
        code = shell.transform_cell(source) if shell is not None else source
        filename = f"<instructor answer: {label}, cell {k + 1} of {len(sources)}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
        try:
            exec(compile(code, filename, "exec"), scope)
        except Exception as exc:
            raise AssertionError(
                f"the instructor's answer failed ({label}, cell {k + 1} of {len(sources)}): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
