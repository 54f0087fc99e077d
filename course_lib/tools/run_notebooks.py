"""Run every notebook top to bottom as a plain Python script: `make test-gpu`'s notebook step.

A percent-format source (`notebooks/NN_name.py`) is a valid Python script: markdown cells are
comments. On a GPU machine whose image has torch and triton but no Jupyter, this runs each notebook in
its own process, in the notebooks folder (as a Jupyter kernel would), and reports its wall time. The
notebooks therefore use no IPython magics and show figures with `plt.show()`.

    python -m course_lib.tools.run_notebooks [--jobs N] [NAME_FILTER ...]

--jobs N runs N notebooks at a time (default 1). Side by side they share the GPU, so their timings
are not clean: `make test-gpu` runs them that way with COURSE_RECORDS=off, so that no record in
assets/ is overwritten by a contended measurement. Each notebook's output goes to a log file
(build/notebook-logs/) when N > 1, and is printed if the notebook fails.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from .notebooks import NOTEBOOKS, ROOT, sources

RUN_AS_NOTEBOOK = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__notebook__')"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib.tools.run_notebooks")
    ap.add_argument("--jobs", type=int, default=1, help="notebooks run at the same time")
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
            cmd = [sys.executable, "-c", RUN_AS_NOTEBOOK, py.name]
            rc = subprocess.call(cmd, cwd=NOTEBOOKS, env=env, stdout=out, stderr=out)
        dt = time.perf_counter() - t0
        print(f"<== {py.name}: {'ok' if rc == 0 else 'FAIL'} in {dt:.1f} s", flush=True)
        if log and rc != 0:
            print(log.read_text()[-6000:], flush=True)
        return py.name, rc, dt

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(run, selected))
    print("\nnotebook                                  result   wall time")
    for name, rc, dt in results:
        print(f"{name:<40}  {'ok' if rc == 0 else f'FAIL({rc})':<7}  {dt:7.1f} s")
    failed = sum(rc != 0 for _, rc, _ in results)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
