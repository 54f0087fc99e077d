"""Compile every kernel launch of `course_lib.tools.compile_check`'s workload for a Hopper GPU (sm_90) on a
machine without one, and write each launch's PTX, without its debug lines, to a folder.

Run it in two checkouts and diff the folders: a change that only moves code (a helper into another module, an
import made one-way) leaves every kernel's PTX as it was, which shows the change cannot have slowed a kernel.
Each file is named by the kernel and a hash of its argument types, compile-time constants (a function passed
as a constant by its name, not its module) and launch options, so a kernel that moved module keeps its name.

    COURSE_DEVICE=cpu python scripts/ptx_dump.py OUTDIR
    diff -r OLD_OUTDIR NEW_OUTDIR && echo "every launch compiles to the same PTX"
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def _key(launch) -> str:
    constants = [(k, getattr(v, "name", v)) for k, v in launch.constants]
    text = repr((launch.signature, constants, launch.options))
    return f"{launch.name}-{hashlib.sha1(text.encode()).hexdigest()[:12]}"


def _normalise(ptx: str) -> str:
    """The PTX without what names places in the source (.file, .loc, comments, the debug sections)."""
    ptx = ptx.split("\t.section\t.debug", 1)[0]
    lines = [line for line in ptx.splitlines() if not re.match(r"\s*(\.file|\.loc|//)", line)]
    return "\n".join(lines) + "\n"


def dump(spec: str, out: str) -> None:
    """In a fresh process: compile the pickled launches (as compile_check does) and write their PTX."""
    import triton

    from course_lib.tools import compile_check

    with open(spec, "rb") as f:
        launches = pickle.load(f)
    results = []
    original = triton.compile

    def keeping(*args, **kwargs):
        try:
            compiled = original(*args, **kwargs)
        except Exception:
            results.append(None)
            raise
        results.append(compiled)
        return compiled

    triton.compile = keeping
    compile_check.compile_launches(launches)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    for launch, compiled in zip(launches, results):
        text = "does not compile\n" if compiled is None else _normalise(compiled.asm["ptx"])
        (folder / f"{_key(launch)}.ptx").write_text(text)
    print(f"ptx_dump: {len(launches)} launches written to {folder}")


def main(out: str) -> None:
    from course_lib.tools import compile_check

    launches = compile_check.record()
    with tempfile.TemporaryDirectory() as tmp:
        spec = os.path.join(tmp, "launches.pkl")
        with open(spec, "wb") as f:
            pickle.dump(launches, f)
        env = dict(os.environ, COURSE_DEVICE="cpu")
        subprocess.run([sys.executable, __file__, "--dump", spec, out], env=env, check=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--dump"]:
        dump(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1])
