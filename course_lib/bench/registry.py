"""`python -m course_lib bench [names...]`: every benchmark module present, or the ones named.

Taught in notebook 08. A benchmark is a module `course_lib/bench/<name>.py` with `run(quick) -> dict`
(measures, returns a record's data) and `main(quick=False, out=...)` (measures, saves the record with
`records.save_record`, writes its plots next to it, returns 0 when every part ran). `BENCHMARKS` lists
them in the order they run; a module that is not there (yet) is left out.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import time
from pathlib import Path

from .. import records, runtime

# name -> what it measures; run in this order.
BENCHMARKS = {
    "attention": "FlashAttention forward/backward vs SDPA and standard attention; the ladder; ceilings",
    "host_time": "CPU time to issue a tiny attention call (forward, fwd+bwd, decode step) against SDPA's",
    "decode": "decoding one token against a KV cache: split-KV and paged, in GB/s of the read ceiling",
    "fused": "fused RMSNorm and RoPE kernels, in GB/s of the copy ceiling",
    "train": "a training step of the capstone model",
    "serving": "cascade over a shared prefix, a cached prompt's time to first token, static vs continuous batching",
    "speculative": "speculative decoding and lookahead at batch 1 and 8 against the measured-cost prediction",
}


def available() -> list[str]:
    """The names of `BENCHMARKS` whose module exists in this checkout, in run order."""
    return [name for name in BENCHMARKS if importlib.util.find_spec(f"{__package__}.{name}") is not None]


def load(name: str):
    """The benchmark module `course_lib.bench.<name>`; a ValueError naming the known ones otherwise."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    if name not in available():
        raise ValueError(f"benchmark {name!r} has no module course_lib/bench/{name}.py in this checkout")
    module = importlib.import_module(f"{__package__}.{name}")
    for attr in ("run", "main"):
        if not callable(getattr(module, attr, None)):
            raise TypeError(
                f"course_lib.bench.{name} has no {attr}(): a benchmark needs run(quick) and main(quick)"
            )
    return module


def main(names=None, quick: bool = False, out: str | Path = records.ASSETS) -> int:
    """Run the benchmarks `names` (default: every one available) one after another; each saves its own
    records and plots in `out`. A failing benchmark is reported and the next still runs. Returns 0 when
    all ran, 1 when one failed, 2 when asked for CPU figures in assets/benchmarks/ or for an unknown name."""
    out = Path(out)
    if not runtime.ON_GPU and out.resolve() == Path(records.ASSETS).resolve():
        print(
            "bench: no GPU. CPU timings are not course figures and do not belong in assets/benchmarks/; "
            "pass --out DIR to run the smoke test elsewhere."
        )
        return 2
    names = available() if not names else list(names)
    try:
        modules = {name: load(name) for name in names}
    except (ValueError, TypeError) as exc:
        print(f"bench: {exc}")
        return 2
    failed = []
    for name, module in modules.items():
        t0 = time.perf_counter()
        print(f"bench: === {name} ===")
        kwargs = {"quick": quick}
        if "out" in inspect.signature(module.main).parameters:
            kwargs["out"] = out
        elif out.resolve() != Path(records.ASSETS).resolve():
            print(f"bench: {name}.main() takes no `out` and would write to {records.ASSETS}/; skipped")
            failed.append(name)
            continue
        try:
            rc = module.main(**kwargs)
        except Exception as exc:  # one benchmark's failure must not cost the others' records
            rc = f"{type(exc).__name__}: {exc}"
        if rc not in (0, None):
            failed.append(name)
            print(f"bench: {name} FAILED ({rc}) after {time.perf_counter() - t0:.0f} s")
    if len(modules) > 1:
        print(f"bench: ran {', '.join(modules)}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
