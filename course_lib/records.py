"""Recorded GPU figures: how measured numbers reach a learner who has no GPU.

Taught in notebook 00; `measured_or_recorded` is the switch the GPU figures of notebooks 05-07 (and 08c on
a Hopper GPU) go through. `make bench` (on a GPU) measures and writes the benchmark records as JSON to
`assets/benchmarks/`, stamped with the GPU, driver, versions and date; the GPU-only cells of notebooks
05-07 and 08c record their own live measurements the same way when a notebook runs on its own on a GPU
(`make test-gpu` runs them with recording off, `COURSE_RECORDS=off`). Notebooks load the
newest record of a kind and label it as such. No GPU figure shown in the course is typed by hand.

A record file is `assets/benchmarks/<kind>-<gpu>.json`:
    {"kind": ..., "meta": {"gpu": ..., "driver": ..., "torch": ..., "triton": ..., "cuda": ...,
     "date": "YYYY-MM-DD", ...}, "data": {...}}
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import subprocess
from pathlib import Path

import torch

from . import runtime

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "benchmarks"


def machine_meta() -> dict:
    """GPU name, driver, torch/triton/CUDA/cuDNN versions and today's date, for stamping a record."""
    meta = {
        "date": _dt.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": getattr(runtime.triton, "__version__", None),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": "cuda" if runtime.ON_GPU else "cpu",
    }
    if runtime.ON_GPU:
        p = torch.cuda.get_device_properties(runtime.DEVICE)
        meta.update(
            gpu=p.name,
            sm_count=p.multi_processor_count,
            capability=f"{p.major}.{p.minor}",
            memory_gib=round(p.total_memory / 2**30, 1),
        )
        try:
            meta["driver"] = (
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=20,
                )
                .stdout.strip()
                .splitlines()[0]
            )
        except (OSError, IndexError, subprocess.SubprocessError):
            meta["driver"] = None
    else:
        meta["gpu"] = None
    return meta


def _slug(name: str | None) -> str:
    return re.sub(r"[^a-z0-9]+", "-", (name or "cpu").lower()).strip("-")


def save_record(kind: str, data: dict, folder: Path | str = ASSETS) -> Path | None:
    """Write `data` as the record of `kind` for this machine's GPU; returns the path.

    With COURSE_RECORDS=off in the environment (`make test-gpu` sets it: notebooks run there side by
    side, so their timings are not clean) nothing is written and None is returned."""
    if os.environ.get("COURSE_RECORDS", "").lower() == "off":
        print(f"COURSE_RECORDS=off: the {kind!r} record was not written")
        return None
    meta = machine_meta()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{kind}-{_slug(meta['gpu'])}.json"
    path.write_text(json.dumps({"kind": kind, "meta": meta, "data": data}, indent=1) + "\n")
    return path


def load_record(kind: str, gpu: str | None = None, folder: Path | str = ASSETS) -> dict | None:
    """The newest record of `kind` (for `gpu` if given, e.g. "H200"), or None if there is none."""
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"load_record: kind must be a non-empty string, got {kind!r}")
    found = []
    for path in Path(folder).glob(f"{kind}-*.json"):
        try:
            rec = json.loads(path.read_text())
            if not isinstance(rec, dict) or rec.get("kind") != kind:
                continue
            meta = rec["meta"]
            if not isinstance(meta.get("date"), str):
                raise KeyError("meta.date")
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(
                f"load_record: {path} is not a record of course_lib (a JSON object with kind, meta with a date, "
                f"and data): {type(exc).__name__}: {exc}; delete it or run `make bench` again"
            ) from None
        if gpu is not None and gpu.lower() not in (meta.get("gpu") or "").lower():
            continue
        found.append(rec)
    return max(found, key=lambda r: r["meta"]["date"]) if found else None


def label(record: dict) -> str:
    """'recorded on NVIDIA H200, 2026-11-22 (torch 2.11.0, triton 3.6.0)': how a figure is credited."""
    m = record["meta"]
    return f"recorded on {m.get('gpu')}, {m['date']} (torch {m['torch']}, triton {m['triton']})"


def measured_or_recorded(
    kind: str, measure, missing: str, folder: Path | str = ASSETS, measure_here: bool | None = None
) -> tuple[dict, str] | None:
    """Measure on a GPU, else show the record: the one switch every GPU figure of the notebooks goes through.

    On a GPU: `data = measure()` (a JSON-able dict), saved as the record of `kind`; returns
    (data, "measured now on <GPU>"). On a CPU: the newest record of `kind` and its `label`; if there is
    none, prints `missing` (what the figure would show, so the learner knows what to look for) and
    returns None. Used from notebook 05 on; the records themselves are taught in notebook 00.

        got = records.measured_or_recorded("primer_softmax", sweep, missing="No recorded GPU run yet ...")
        if got:
            plot(*got)   # plot(data, source)

    measure_here: whether to measure (default: on any GPU); False shows the record, as on a CPU (for a
    figure only some GPUs can measure, such as the Hopper kernels' of notebook 08c)."""
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"kind must be a non-empty string, got {kind!r}")
    if not callable(measure):
        raise TypeError(f"measure must be a function returning a dict, got {type(measure).__name__}")
    if measure_here is None:
        measure_here = runtime.ON_GPU
    if measure_here and not runtime.ON_GPU:
        raise ValueError(
            f"measured_or_recorded({kind!r}): measure_here=True needs a GPU (course_lib runs on {runtime.DEVICE}); "
            "a CPU shows the record instead"
        )
    if measure_here:
        data = measure()
        if not isinstance(data, dict):
            raise TypeError(f"measure() must return a dict, got {type(data).__name__}")
        save_record(kind, data, folder=folder)
        return data, "measured now on " + torch.cuda.get_device_name(runtime.DEVICE)
    rec = load_record(kind, folder=folder)
    if rec is None:
        print(missing)
        return None
    return rec["data"], label(rec)
