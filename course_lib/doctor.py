"""`python -m course_lib doctor`: what this machine runs the course with, and what is wrong with it.

Taught in notebook 00. Prints versions, the device (GPU name, compute capability, memory) or that
Triton runs interpreted on the CPU, and the TF32 setting; then runs one tiny Triton kernel. Known-bad
combinations are reported with the command that fixes them, and make `doctor()` return False.
"""

from __future__ import annotations

import importlib.metadata as md
import platform
import re
import sys

import numpy as np
import torch

from . import runtime


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def torch_triton_requirement() -> str | None:
    """The triton version torch's own wheel asks for ('3.7.1'), or None (CPU builds ask for none)."""
    try:
        reqs = md.requires("torch") or []
    except md.PackageNotFoundError:
        return None
    for r in reqs:
        m = re.match(r"\s*triton\s*==\s*([\w.]+)", r)
        if m and "extra" not in r:
            return m.group(1)
    return None


def problems() -> list[str]:
    """Known-bad combinations on this machine, each with a fix. Empty when all is well."""
    found = []
    if sys.platform != "linux" and runtime.triton is None:
        found.append(
            "Triton has Linux wheels only: on macOS or Windows use Linux, WSL 2 or a hosted notebook "
            "(the NumPy and pure-PyTorch notebooks 01-04b still run)."
        )
    elif runtime.triton is None:
        found.append(f"Triton does not import ({runtime.TRITON_IMPORT_ERROR}). Run `make setup` again.")
    if runtime.triton is not None:
        tv = _version_tuple(runtime.triton.__version__)
        if runtime.INTERPRET and tv < (3, 7) and _version_tuple(np.__version__) >= (2, 4):
            found.append(
                f"triton {runtime.triton.__version__} with numpy {np.__version__}: the Triton interpreter breaks "
                "on numpy >= 2.4 before triton 3.7 (loops over a runtime length fail). "
                "Fix: pip install 'numpy<2.4', or triton >= 3.7.1 with a matching torch (`make setup`)."
            )
        want = torch_triton_requirement()
        if want is not None and _version_tuple(want)[:2] != tv[:2]:
            found.append(
                f"torch {torch.__version__} was built for triton {want}, but triton {runtime.triton.__version__} "
                f"is installed. Fix: pip install 'triton=={want}' (or `make setup` for the course's pinned pair)."
            )
    if runtime.ON_GPU:
        major, minor = torch.cuda.get_device_capability(runtime.DEVICE)
        if major < 8:
            found.append(
                f"GPU compute capability {major}.{minor}: the course's kernels need 8.0 or newer (bf16, "
                "large shared memory). Run on the CPU instead: COURSE_DEVICE=cpu."
            )
    return found


def report() -> list[tuple[str, str]]:
    """(label, value) rows describing this machine, in the order the doctor prints them."""
    rows = [
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("platform", f"{platform.system()} {platform.machine()}"),
        ("torch", f"{torch.__version__} (CUDA build: {torch.version.cuda or 'none'})"),
        ("triton", runtime.triton.__version__ if runtime.triton is not None else "not installed"),
        ("numpy", np.__version__),
        ("course_lib mode", runtime.RUNTIME.describe()),
        ("why", runtime.RUNTIME.reason),
        ("triton interpreted", "yes" if runtime.INTERPRET else "no"),
    ]
    if runtime.ON_GPU:
        p = torch.cuda.get_device_properties(runtime.DEVICE)
        rows += [
            ("GPU", p.name),
            ("compute capability", f"{p.major}.{p.minor}"),
            ("GPU memory", f"{p.total_memory / 2**30:.1f} GiB"),
            ("SMs", str(p.multi_processor_count)),
            (
                "TF32 matmul",
                f"allow_tf32={torch.backends.cuda.matmul.allow_tf32}, "
                f"float32_matmul_precision={torch.get_float32_matmul_precision()!r}",
            ),
            ("Hopper kernels", _hopper_kernels(p.major)),
        ]
    else:
        rows.append(("GPU", "none — CPU, Triton interpreter; GPU figures in the notebooks are recorded runs"))
    return rows


def _hopper_kernels(major: int) -> str:
    """Whether `flash_attention` can use the warp-specialised Gluon kernels (forward, dK/dV) here."""
    if major != 9:
        return "no (not a Hopper GPU): the Triton kernel everywhere"
    from .attention import forward

    if forward.hopper_kernels() is None:
        return "no (this Triton has no Gluon): the Triton kernel everywhere"
    return "yes: the warp-specialised Gluon forward and dK/dV kernels where faster (notebook 08)"


def smoke_test() -> str:
    """Run one tiny Triton kernel on the course's device and check its answer."""
    from .primer import add

    x = torch.randn(1000, device=runtime.DEVICE)
    y = torch.randn(1000, device=runtime.DEVICE)
    torch.testing.assert_close(add(x, y, block_size=256), x + y)
    return "ok (" + ("interpreted on the CPU" if runtime.INTERPRET else "compiled for the GPU") + ")"


def doctor(print_fn=print) -> bool:
    """Print the report and any problems; return True when the course can run here."""
    rows = report()
    issues = problems()
    if runtime.triton is not None and not issues:
        try:
            rows.append(("triton smoke test", smoke_test()))
        except Exception as exc:  # report, don't crash: the doctor's job is to explain
            issues.append(f"a tiny Triton kernel failed: {type(exc).__name__}: {exc}")
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print_fn(f"{k:<{width}}  {v}")
    if issues:
        print_fn("\nPROBLEMS:")
        for p in issues:
            print_fn(f"  - {p}")
        return False
    print_fn("\nAll good: the course runs here.")
    return True
