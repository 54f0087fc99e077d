"""Run every notebook top to bottom as a plain Python script: `make test-gpu`'s notebook step.

A percent-format source (`notebooks/NN_name.py`) is a valid Python script: markdown cells are
comments. On a GPU machine whose image has torch and triton but no Jupyter, this runs each notebook in
its own process, in the notebooks folder (as a Jupyter kernel would), and reports its wall time. The
notebooks therefore use no IPython magics and show figures with `plt.show()`.

    python -m course_lib.tools.run_notebooks [NAME_FILTER]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from .notebooks import NOTEBOOKS, ROOT, sources


def main(argv: list[str]) -> int:
    selected = [p for p in sources() if not argv or any(a in p.name for a in argv)]
    # The repository root goes first on the path, so course_lib imports even where it is not pip-installed.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONUNBUFFERED="1", PYTHONPATH=path)
    results = []
    for py in selected:
        print(f"==> {py.name}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, py.name], cwd=NOTEBOOKS, env=env)
        results.append((py.name, rc, time.perf_counter() - t0))
    print("\nnotebook                                  result   wall time")
    for name, rc, dt in results:
        print(f"{name:<40}  {'ok' if rc == 0 else f'FAIL({rc})':<7}  {dt:7.1f} s")
    failed = sum(rc != 0 for _, rc, _ in results)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
