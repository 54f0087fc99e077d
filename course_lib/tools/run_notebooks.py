"""Run every notebook top to bottom as a plain Python script: `make test-gpu`'s notebook step.

A percent-format source (`notebooks/NN_name.py`) is a valid Python script: markdown cells are
comments. On a GPU machine whose image has torch and triton but no Jupyter, this runs each notebook in
its own process, in the notebooks folder (as a Jupyter kernel would), and reports its wall time. The
notebooks therefore use no IPython magics and show figures with `plt.show()`.

    python -m course_lib.tools.run_notebooks [--jobs N] [--cells] [NAME_FILTER ...]

--jobs N runs N notebooks at a time (default 1). Side by side they share the GPU, so their timings
are not clean: `make test-gpu` runs them that way with COURSE_RECORDS=off, so that no record in
assets/ is overwritten by a contended measurement. Each notebook's output goes to a log file
(build/notebook-logs/) when N > 1, and is printed if the notebook fails.

--cells runs each notebook cell by cell (`run_cells`: one namespace, as a kernel keeps) and prints its
slowest cells with their line and section: where a notebook's seconds go, for an instructor trimming
it to the 90 s a notebook may take on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor

from .notebooks import NOTEBOOKS, ROOT, sources

RUN_AS_NOTEBOOK = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__notebook__')"
RUN_BY_CELL = "import sys; from course_lib.tools.run_notebooks import run_cells; run_cells(sys.argv[1])"
SLOWEST_CELLS = 8
# A notebook's time budget on a GPU, alone. The summary marks notebooks over it (side by side, --jobs > 1,
# they share the GPU and the CPUs, so a mark there says to time that notebook alone with --cells).
BUDGET_S = 90


def split_cells(source: str) -> list[tuple[int, str, str]]:
    """Cells of a percent-format notebook source: (first line number, section, code). A cell starts at a
    `# %%` line; its section is the last markdown heading (`# #...`) above it."""
    cells, section, start, lines = [], "", 1, []
    for number, line in enumerate(source.splitlines(keepends=True), 1):
        if line.startswith("# %%") and lines:
            cells.append((start, section, "".join(lines)))
            start, lines = number, []
        lines.append(line)
        if line.startswith("# #"):
            section = line.lstrip("# ").strip()
    if lines:
        cells.append((start, section, "".join(lines)))
    return cells


def finish_compiling() -> str:
    """Wait for the kernels course_lib still compiles ahead in the background (the process would wait
    for them at exit) and say how many and how long: compilations a notebook started but never used."""
    from ..attention import launch

    t0 = time.perf_counter()
    pending = launch.finish_compiling()
    return f"{pending} compilations still running at the end, {time.perf_counter() - t0:.1f} s"


def run_cells(path: str, slowest: int = SLOWEST_CELLS) -> list[tuple[float, int, str]]:
    """Run the notebook source at `path` cell by cell in one namespace (named `__notebook__`, as
    `RUN_AS_NOTEBOOK` does), then print its `slowest` cells: seconds, line, section. Returns every
    (seconds, line, section), slowest first. A failing cell raises, as the whole script would."""
    source = open(path).read()
    # A module, as runpy makes: torch.compile looks functions' globals up by module name, and
    # @triton.jit reads a kernel's source from its file (so each cell keeps its own line numbers).
    module = types.ModuleType("__notebook__")
    module.__file__ = os.path.abspath(path)
    sys.modules["__notebook__"] = module
    times = []
    for line, section, code in split_cells(source):
        t0 = time.perf_counter()
        exec(compile("\n" * (line - 1) + code, module.__file__, "exec"), module.__dict__)
        times.append((time.perf_counter() - t0, line, section))
    times.sort(reverse=True)
    total = sum(t for t, _, _ in times)
    print(f"\n{path}: {len(times)} cells, {total:.1f} s; {finish_compiling()}; the slowest:", flush=True)
    for seconds, line, section in times[:slowest]:
        print(f"  {seconds:7.1f} s  line {line:<5} {section[:70]}", flush=True)
    return times


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib.tools.run_notebooks")
    ap.add_argument("--jobs", type=int, default=1, help="notebooks run at the same time")
    ap.add_argument("--cells", action="store_true", help="time each cell; print the slowest (run_cells)")
    ap.add_argument("names", nargs="*", help="run only notebooks whose file name contains one of these")
    args = ap.parse_args(argv)
    selected = [p for p in sources() if not args.names or any(a in p.name for a in args.names)]
    # The repository root goes first on the path, so course_lib imports even where it is not pip-installed.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONUNBUFFERED="1", PYTHONPATH=path)
    logs = ROOT / "build" / "notebook-logs" if args.jobs > 1 else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)

    def run(py):
        """Run one notebook; with a log folder its output goes to a file, printed if it fails."""
        print(f"==> {py.name}", flush=True)
        t0 = time.perf_counter()
        log = logs / f"{py.stem}.log" if logs else None
        with open(log, "w") if log else contextlib.nullcontext() as out:
            # run_path under another name than __main__: processes a notebook spawns (notebook 13's ranks)
            # then do not re-run the whole notebook when they start, as they would for a __main__ script
            cmd = [sys.executable, "-c", RUN_BY_CELL if args.cells else RUN_AS_NOTEBOOK, py.name]
            rc = subprocess.call(cmd, cwd=NOTEBOOKS, env=env, stdout=out, stderr=out)
        dt = time.perf_counter() - t0
        print(f"<== {py.name}: {'ok' if rc == 0 else 'FAIL'} in {dt:.1f} s", flush=True)
        if log and rc != 0:
            print(log.read_text()[-6000:], flush=True)
        elif log and args.cells:  # the cell table is the notebook's last output
            text = log.read_text()
            print(text[text.rfind(f"\n{py.name}: ") :], flush=True)
        return py.name, rc, dt

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(run, selected))
    print("\nnotebook                                  result   wall time")
    for name, rc, dt in results:
        over = f"  over the {BUDGET_S} s a notebook may take on a GPU" if dt > BUDGET_S else ""
        print(f"{name:<40}  {'ok' if rc == 0 else f'FAIL({rc})':<7}  {dt:7.1f} s{over}")
    failed = sum(rc != 0 for _, rc, _ in results)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
