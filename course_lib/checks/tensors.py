"""Checks of single values: a tensor, its dtype and device, an integer, a real number, an epsilon.

The rules every kernel package shares: which floating dtypes exist (`FLOAT_DTYPES`) and which the Triton
kernels of attention and decoding take (`KERNEL_DTYPES`), one dtype check with one message
(`check_dtype`), and the device the kernels run on (`check_kernel_device`, notebook 00).
"""

from __future__ import annotations

import math
import numbers
import operator

import torch

from .. import runtime

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# What the compiled attention and decoding kernels take (float64 runs only under the interpreter)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Offsets the kernels compute from a program's row, column or head with 32-bit integers stay below this
# (`attention.inputs.within_offsets`, `fused.rope.kernel_input`); batch and sequence offsets are 64-bit.
OFFSET_LIMIT = 2**31


def shape_and_dtype(x) -> str:
    """'(2, 5) torch.int64' for a tensor, its type's name for anything else: what an error says it got."""
    return f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__


def describe(name: str, t: torch.Tensor) -> str:
    """'q: shape (2, 5), dtype torch.float16, device cpu': a tensor as an error names it."""
    return f"{name}: shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def dtype_names(dtypes) -> str:
    """'float16, bfloat16, float32': dtypes as an error lists them."""
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def as_int(value) -> int | None:
    """value as an int if it is an integer (Python, NumPy, a 0-dim integer tensor: `operator.index`), not a
    bool; else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_tensor(where: str, name: str, value) -> None:
    """A TypeError naming `name` unless `value` is a torch.Tensor."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(value).__name__}")


def check_dtype(where: str, name: str, t: torch.Tensor, dtypes) -> None:
    """A TypeError naming `name` and the dtypes taken unless t's dtype is one of `dtypes`: "{where}: q has
    dtype torch.float64; supported: float16, bfloat16, float32"."""
    if t.dtype not in dtypes:
        raise TypeError(f"{where}: {name} has dtype {t.dtype}; supported: {dtype_names(dtypes)}")


def check_kernel_device(where: str, **tensors) -> None:
    """Every tensor must be a torch.Tensor on the device where the Triton kernels run (`course_lib.DEVICE`:
    the CPU under the interpreter, a CUDA GPU when they are compiled); else a TypeError or a ValueError
    naming the tensor and saying how to move it."""
    for name, t in tensors.items():
        check_tensor(where, name, t)
        if t.device.type == runtime.DEVICE.type:
            continue
        if runtime.INTERPRET:
            how = (
                "in the interpreter on the CPU (course_lib.INTERPRET is True: no GPU build, or COURSE_DEVICE=cpu). "
                "Move it to the CPU, or start Python on a GPU machine without COURSE_DEVICE=cpu"
            )
        else:
            how = (
                "compiled for the GPU (course_lib.ON_GPU is True). Move it with .to(course_lib.DEVICE), or set "
                "COURSE_DEVICE=cpu before importing course_lib to use the interpreter"
            )
        raise ValueError(
            f"{where}: {name} is on {t.device}, but the Triton kernels run on {runtime.DEVICE} here, {how}"
        )


def check_int(where: str, name: str, value, minimum: int) -> int:
    """`value` as an int (`as_int`) that is >= minimum; else a TypeError or ValueError naming `name`."""
    index = as_int(value)
    if index is None:
        raise TypeError(f"{where}: {name} must be an integer, got {value!r} ({type(value).__name__})")
    if index < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {index}")
    return index


def check_real(where: str, name: str, value, low=None, high=None, low_open: bool = False) -> float:
    """`value` as a float: a real number (Python or NumPy, not a bool), finite, >= low (> low with
    low_open) and < high where given; else a TypeError or ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: {name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    below = low is not None and (value <= low if low_open else value < low)
    if not math.isfinite(value) or below or (high is not None and value >= high):
        bounds = ("" if low is None else f" {'>' if low_open else '>='} {low:g}") + (
            "" if high is None else f"{' and' if low is not None else ''} < {high:g}"
        )
        raise ValueError(f"{where}: {name} must be a finite number{bounds}, got {value!r}")
    return value


# Half the smallest float32 subnormal (2**-149): a float up to it rounds to 0 in float32 (to nearest, ties to even).
FLOAT32_ROUNDS_TO_ZERO = 2.0**-150


def check_eps(where: str, name: str, eps) -> float:
    """A normalisation's epsilon as a float: finite and > 0, also once rounded to float32, where the kernels
    add it (at 0 an all-zero row would be 0 / 0 = NaN); else a TypeError or ValueError naming `name`."""
    eps = check_real(where, name, eps, low=0, low_open=True)
    if abs(eps) <= FLOAT32_ROUNDS_TO_ZERO:  # float32 rounding without a tensor (one took 6 us a call)
        raise ValueError(f"{where}: {name}={eps!r} is 0 in float32, where it is added; give a larger one")
    return eps


def tensors_key(*tensors) -> tuple | None:
    """What a check of tensors' kinds decides on: each one's shape, dtype, device and whether it requires grad,
    with the device the kernels run on (`runtime.DEVICE`) and the grad mode; None when one is not a tensor, or
    while torch.compile traces (`AcceptedCalls`)."""
    if torch.compiler.is_compiling():
        return None
    key = [runtime.DEVICE, runtime.INTERPRET, torch.is_grad_enabled()]
    for t in tensors:
        if isinstance(t, torch.Tensor):
            key += (t.shape, t.dtype, t.device, t.requires_grad)
        elif t is None:
            key.append(None)
        else:
            return None
    return tuple(key)


class AcceptedCalls:
    """The kinds of calls a check accepted, so that a call of a kind accepted before is accepted at once:
    `seen(key)`, then after the check passed `add(key)`, `key` being everything the check decides on
    (`tensors_key`, and any other argument it reads). A check of shapes, dtypes and devices in full costs
    several microseconds of host time per call, the look-up about one (a 2-core CPU, `scripts/host_time.py`).
    A None key is never seen (not a tensor, symbolic sizes, torch.compile tracing: a set changed during a
    trace would fail the guards the trace set on it). At most `limit` kinds, forgotten all at once past it."""

    def __init__(self, limit: int = 4096):
        self.keys: set = set()
        self.limit = limit

    def seen(self, key) -> bool:
        if key is None:
            return False
        try:
            return key in self.keys
        except TypeError:  # symbolic sizes (torch.compile's fake tensors with dynamic shapes) do not hash
            return False

    def add(self, key) -> None:
        if key is None:
            return
        if len(self.keys) >= self.limit:
            self.keys.clear()
        try:
            self.keys.add(key)
        except TypeError:
            pass


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where softmax statistics and sums accumulate: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
