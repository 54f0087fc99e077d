"""Where the course's Triton kernels run: compiled on a CUDA GPU, or interpreted on the CPU.

Taught in notebook 00. The decision is made once, when `course_lib` is imported, and it must come
before any kernel is defined: Triton reads its interpreter switch when `@triton.jit` decorates a
function, not when a kernel is launched. So every module that defines a kernel imports this one first.

The decision, in order:
1. `COURSE_DEVICE=cpu` or `COURSE_DEVICE=cuda` in the environment forces a mode
   (`cpu` on a GPU machine runs everything as a laptop would; `cuda` without a GPU is an error).
2. `TRITON_INTERPRET=1` already set by the user means the interpreter, on the CPU.
3. Otherwise: a CUDA GPU (`torch.cuda.is_available()`) means compiled kernels on it; no GPU means the
   interpreter on the CPU. Without Triton (macOS, Windows) only the pure-PyTorch pieces run.

Import order: when `triton` was imported before `course_lib` (`import torch, triton` first, or a
library that imports it, such as transformers), Triton's own helpers written with `@triton.jit`
(`tl.cdiv`, `tl.sum`, ...) were made for compiled kernels. On a machine that interprets, importing
course_lib re-creates them as interpreted functions (`_interpret_triton_helpers`), so either order
works. A kernel of your own defined before `import course_lib` keeps the mode it was defined in.

What the interpreter cannot do (autotuning over several configs, `triton.testing.do_bench`) is
wrapped here and in `course_lib.perf.timing`, so notebooks and kernels never branch on the mode themselves.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Runtime:
    """The decision: `device` is where tensors for the kernels live; `interpret` says whether Triton
    executes kernels in Python on the CPU (True) or compiles them for the GPU (False)."""

    device: torch.device
    interpret: bool
    reason: str

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def describe(self) -> str:
        if self.on_gpu:
            return f"GPU ({torch.cuda.get_device_name(self.device)}) — Triton kernels compiled"
        return "CPU — Triton interpreter (kernels run in Python: small sizes only)"


def _decide() -> Runtime:
    forced = os.environ.get("COURSE_DEVICE", "").strip().lower()
    if forced not in ("", "cpu", "cuda"):
        raise ValueError(f"COURSE_DEVICE must be 'cpu' or 'cuda', got {forced!r}")
    cuda_ok = torch.cuda.is_available()
    if forced == "cuda":
        if not cuda_ok:
            raise RuntimeError(
                "COURSE_DEVICE=cuda was set but torch sees no CUDA GPU "
                f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}). "
                "Unset COURSE_DEVICE to run on the CPU through the Triton interpreter."
            )
        return Runtime(torch.device("cuda"), False, "COURSE_DEVICE=cuda")
    if forced == "cpu":
        return Runtime(torch.device("cpu"), True, "COURSE_DEVICE=cpu")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return Runtime(torch.device("cpu"), True, "TRITON_INTERPRET=1 was set")
    if cuda_ok:
        return Runtime(torch.device("cuda"), False, "a CUDA GPU is available")
    return Runtime(torch.device("cpu"), True, "no CUDA GPU")


RUNTIME = _decide()
DEVICE: torch.device = RUNTIME.device
INTERPRET: bool = RUNTIME.interpret
ON_GPU: bool = RUNTIME.on_gpu

if INTERPRET:
    # Must happen before `import triton` anywhere decorates a kernel.
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton  # noqa: E402
    import triton.language as tl  # noqa: E402,F401

    TRITON_IMPORT_ERROR: str | None = None
except ImportError as exc:  # macOS / Windows: Triton ships Linux wheels only.
    triton = tl = None
    TRITON_IMPORT_ERROR = str(exc)

if INTERPRET and triton is not None and hasattr(triton, "knobs"):
    # Triton >= 3.4 also keeps the switch in its knobs; set both in case triton was imported earlier.
    triton.knobs.runtime.interpret = True


def _interpret_triton_helpers() -> int:
    """Turn triton.language's own `@triton.jit` helpers into interpreted functions; return how many.

    When `triton` was imported before `course_lib` (`import torch, triton` first, or a library such as
    transformers that imports it), its helpers written in Triton itself — `tl.cdiv`, `tl.max`,
    `tl.sum`, `tl.sigmoid`, `tl.rand`, and the same names as tensor methods (`x.sum()`) — were decorated
    while the switch was still off. They are then compiled-mode `JITFunction`s, and a kernel run by the
    interpreter that calls one fails with "Cannot call @triton.jit'd outside of the scope of a kernel".
    Each such helper is replaced where triton.language keeps it by what `@triton.jit` makes with the
    switch on: in module globals, an `InterpretedFunction` of the same Python function; as a class
    attribute (`tl.tensor.sum`), a plain function calling it, which binds `self` as a method (as
    triton.language itself does for interpreted helpers). One replacement per helper, so a helper
    reachable under two names (`tl.cdiv` and `tl.standard.cdiv`) stays one object."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    functions: dict[int, InterpretedFunction] = {}
    methods: dict[int, object] = {}

    def interpreted(fn: JITFunction) -> InterpretedFunction:
        if id(fn) not in functions:
            functions[id(fn)] = InterpretedFunction(fn.fn)
        return functions[id(fn)]

    def method(fn: JITFunction):
        if id(fn) not in methods:
            target = interpreted(fn)

            def call(*args, **kwargs):
                return target(*args, **kwargs)

            call.__name__ = call.__qualname__ = fn.fn.__name__
            call.__doc__ = fn.fn.__doc__
            methods[id(fn)] = call
        return methods[id(fn)]

    for name, module in list(sys.modules.items()):
        if module is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                setattr(module, attr, interpreted(value))
            elif isinstance(value, type) and value.__module__ == name:
                for member, inner in list(vars(value).items()):
                    if isinstance(inner, JITFunction):
                        setattr(value, member, method(inner))
    return len(functions)


def _round_bf16_casts_to_nearest() -> bool:
    """Make the interpreter round float32 -> bfloat16 casts to nearest, ties to even, as the GPU does;
    return whether it was done.

    A compiled kernel's `x.to(tl.bfloat16)` rounds to nearest (PTX `cvt.rn.bf16.f32`), as PyTorch's
    `.to(torch.bfloat16)` does. Triton's interpreter instead drops the low 16 bits of the float32 (its
    `_convert_float` rounds toward zero unless asked for "rtne", and its "rtne" branch loses the carry
    when the rounding overflows the 7-bit mantissa). Toward zero is twice the error of nearest and always
    in the same direction: a bf16 gradient stored from fp32 (|dQ| in [4, 8) has a bf16 step of 1/32) then
    misses the float64 reference by up to a whole step where the GPU misses by half. The float32 ->
    bfloat16 case is routed through PyTorch's conversion (round to nearest even, NaN kept); every other
    conversion, and an explicit "rtz", keeps Triton's code. `tests/test_runtime.py` checks the result
    against PyTorch bit for bit, so a Triton release that changes these internals is noticed."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_convert_float", None)
    if original is None:
        return False
    if getattr(original, "rounds_bf16_to_nearest", False):  # done already (course_lib imported again)
        return True
    toward_zero = interpreter._ir.ROUNDING_MODE.RTZ

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16 and rounding_mode != toward_zero:
            copy = np.array(input, dtype=np.float32)  # a copy: the interpreter's array may be read-only
            return torch.from_numpy(copy).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return original(input, input_dtype, output_dtype, rounding_mode)

    convert_float.rounds_bf16_to_nearest = True
    interpreter._convert_float = convert_float
    return True


# float32 -> bfloat16 casts under the interpreter round as on the GPU (False where Triton is missing).
BF16_ROUNDS_TO_NEAREST = _round_bf16_casts_to_nearest() if INTERPRET and triton is not None else False

# Helpers re-created when triton was imported before course_lib on a machine that interprets (0 otherwise).
TRITON_HELPERS_REINTERPRETED = _interpret_triton_helpers() if INTERPRET and triton is not None else 0


def _triton_key():
    """Triton's cached hash of its installation (`triton_key`), wherever this Triton keeps it."""
    from triton.runtime import cache

    if hasattr(cache, "triton_key"):
        return cache.triton_key
    from triton.compiler import compiler

    return compiler.triton_key


def _prepare_triton_driver() -> threading.Thread | None:
    """On a GPU, get Triton's CUDA driver ready in a background thread, started at import; return it.

    A process's first compiled kernel needs Triton's driver, and the driver's C utilities are built with
    the system's C compiler the first time a Triton cache sees them (0.3-0.4 s on an H200 host; a few
    milliseconds once cached). It also needs `triton_key`, a hash of every file of the Triton
    installation that keys its compilation cache (0.77 s of a first forward's 2.5 s of profiled CPU time
    on the H200 host, 2026-11-29), computed once per process. Both done here overlap whatever the program
    does between `import course_lib` and its first kernel, instead of adding to the first kernel's wait
    (measured in notes/attention.md, "Why it is so"). Nothing here touches the GPU itself. The process
    waits for the thread at exit, so a script that imports and ends never stops it midway."""
    if INTERPRET or triton is None:
        return None

    def build():
        try:
            triton.runtime.driver.active  # noqa: B018 (the property builds the driver)
        except Exception:  # the first kernel launch builds it again and reports the error there
            pass
        try:  # Triton's hash of its own installation, part of every compiled kernel's cache key
            _triton_key()()
        except Exception:  # the first compilation computes it again and reports the error there
            pass

    thread = threading.Thread(target=build, name="prepare Triton's driver", daemon=True)
    thread.start()
    atexit.register(thread.join)
    return thread


TRITON_DRIVER_THREAD = _prepare_triton_driver()


def require_triton() -> None:
    """Raise a clear error when Triton is not importable (it has Linux wheels only)."""
    if triton is None:
        raise RuntimeError(
            "Triton is not installed or failed to import "
            f"({TRITON_IMPORT_ERROR}). Triton ships Linux wheels only: on macOS or Windows use Linux, "
            "WSL 2 or a hosted notebook. The pure-PyTorch parts of course_lib still work."
        )


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _l2_bytes(index: int) -> int:
    return torch.cuda.get_device_properties(index).L2_cache_size


def l2_cache_size(index: int | None = None) -> int:
    """Bytes of L2 cache of CUDA device `index` (default: the current device), cached per device (60 MiB on an
    H200): what the fused kernels' cache hint compares their inputs with (`fused.launch.keep_hint`)."""
    return _l2_bytes(torch.cuda.current_device() if index is None else int(index))


def sm_count(index: int | None = None) -> int:
    """Streaming multiprocessors of CUDA device `index` (default: the current device), cached per
    device: 132 on an H100 or H200. The size of persistent grids and of decoding's split rule."""
    return _multiprocessors(torch.cuda.current_device() if index is None else int(index))


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n = 0), as `triton.next_power_of_2` gives it, in plain
    integer arithmetic: Triton's, callable inside kernels too, costs microseconds per call on the host,
    and a small launch asks several times."""
    n = int(n)
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, as `triton.cdiv` gives it, in plain integer arithmetic (see
    `next_power_of_2`)."""
    return -(-a // b)


def compile_workers(limit: int) -> int:
    """How many Triton compiles to run side by side on this host: its CPUs less two (left to the
    process that feeds the GPU and to the system), at least 1, at most `limit`."""
    return max(1, min(limit, (os.cpu_count() or 2) - 2))


def gpu_test_workers(limit: int = 14, gib_per_worker: float = 12.0) -> int:
    """How many test processes `make test-gpu` runs side by side: `compile_workers(limit)` (compiling
    kernels is CPU-bound), and no more than the GPU's memory holds at `gib_per_worker` GiB each. The
    float64 references of the real-size tests take several GiB each: 14 processes filled an 80 GB H100
    and failed with out-of-memory errors, and once a 141 GB H200 (in a run with a failed CUDA-graph
    capture too); at 12 GiB each an H200 runs 11, an 80 GB H100 6, a 24 GB card 1."""
    workers = compile_workers(limit)
    if torch.cuda.is_available():
        gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        workers = max(1, min(workers, int(gib // gib_per_worker)))
    return workers


def pick(cpu, gpu):
    """Choose a value by where the kernels run: `N = pick(cpu=256, gpu=8192)`.

    Notebooks call this in one place near the top, so a reader sees every size the notebook uses."""
    return gpu if ON_GPU else cpu


def autotune(configs, key, **kwargs):
    """`triton.autotune` on a GPU; on the interpreter, only the first config (the interpreter
    cannot time configs, and autotune with more than one config fails there)."""
    require_triton()
    if INTERPRET:
        configs = configs[:1]
    return triton.autotune(configs=configs, key=key, **kwargs)
