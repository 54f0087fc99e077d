"""Launching the Triton attention kernels: which configuration, and remembering it (notebook 08).

Without autotuning (the default), a launch compiles exactly one configuration per kernel and shape
class, so the first call of a new shape costs one compilation per kernel, not one per candidate:

1. a choice recorded for this GPU in `tuned/<gpu>.json` (`make bench` autotunes the benchmark grid and
   records what the autotuner picked, so later processes on that GPU launch the same kernels);
2. for a grouped-query shape of the dK/dV kernel with no choice of its own, the one recorded for the
   same shape with one query head per K/V head (group 1);
3. otherwise `configs.<KERNEL>.choose(...)`, the rule the sweeps on an H200 found.

Only the production kernels come here: the ladder's teaching variants (`teaching.py`) always run with
a fixed launch, so neither a shape class nor the record knows of them.

With `COURSE_AUTOTUNE=1` in the environment, a shape class seen for the first time is autotuned over
the kernel's candidates (each compiled and timed: seconds per kernel) and the choice is added to the
GPU's record. Either way a process remembers its choice per shape class, and later calls launch the
kernel directly: the autotuner's own dispatch costs tens of microseconds of Python per call.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import re
import threading
from pathlib import Path

import torch

from .. import runtime
from ..kernels import bound
from ..runtime import triton
from .configs import KernelConfigs, Launch

TUNED_DIR = Path(__file__).resolve().parent / "tuned"


def autotune_enabled() -> bool:
    """True when COURSE_AUTOTUNE=1 asks for autotuning on a GPU (never under the interpreter)."""
    return runtime.ON_GPU and os.environ.get("COURSE_AUTOTUNE", "0") not in ("", "0")


def n_bucket(n: int) -> int:
    """A coarse size class: the power of two >= n, capped at 16384, so that a configuration is chosen
    once per class instead of on every new sequence length."""
    return min(runtime.next_power_of_2(max(int(n), 16)), 16384)


def cuda_device(t: torch.Tensor):
    """Context that makes t's GPU current during a launch (Triton launches on the current device);
    a no-op when it already is (switching costs microseconds that a small call can feel)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NO_DEVICE


_NO_DEVICE = contextlib.nullcontext()  # reusable: it holds no state


# --------------------------------------------------------------------------------------------------
# The GPU's record of autotuned choices
# --------------------------------------------------------------------------------------------------
def gpu_slug() -> str:
    """This GPU's name as a file name ("nvidia-h200"); "cpu" under the interpreter."""
    if not runtime.ON_GPU:
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(runtime.DEVICE).lower()).strip("-")


@functools.cache
def tuned_record() -> dict:
    """{kernel name: {shape-class key: [block_m, block_n, num_warps, num_stages]}} for this GPU."""
    path = TUNED_DIR / f"{gpu_slug()}.json"
    if not runtime.ON_GPU or not path.exists():
        return {}
    return json.loads(path.read_text())


def record_choice(kernel: str, key: str, launch: Launch) -> None:
    """Add an autotuned choice to this GPU's record (the file is rewritten, keys sorted)."""
    record = tuned_record()
    record.setdefault(kernel, {})[key] = launch.as_list()
    TUNED_DIR.mkdir(exist_ok=True)
    path = TUNED_DIR / f"{gpu_slug()}.json"
    ordered = {name: dict(sorted(choices.items())) for name, choices in sorted(record.items())}
    path.write_text(json.dumps(ordered, indent=1) + "\n")


# --------------------------------------------------------------------------------------------------
# Autotuners (COURSE_AUTOTUNE=1) and the launch itself
# --------------------------------------------------------------------------------------------------
def _as_configs(candidates) -> list:
    return [
        triton.Config(
            {"BLOCK_M": c.block_m, "BLOCK_N": c.block_n}, num_warps=c.num_warps, num_stages=c.num_stages
        )
        for c in candidates
    ]


def make_tuner(kernel, table: KernelConfigs, key: list[str], **kwargs):
    """`runtime.autotune` of `kernel` over `table.candidates` (GPU only; on the CPU its one config)."""
    if runtime.INTERPRET:
        return runtime.autotune(_as_configs([table.cpu]), key=key, **kwargs)(kernel)
    return runtime.autotune(
        _as_configs(table.candidates),
        key=key,
        do_bench=lambda fn, quantiles: triton.testing.do_bench(fn, warmup=10, rep=40, quantiles=quantiles),
        **kwargs,
    )(kernel)


CHOSEN: dict = {}  # (kernel table, shape class) -> the Launch this process uses
COMPILING: dict = {}  # (kernel table, shape class) -> a thread compiling that launch ahead of its first use
_SEEN: set = set()  # (kernel table, shape class) compiled, compiling or launched in this process


def chosen(table: KernelConfigs, shape: tuple) -> Launch | None:
    """The launch this process uses for a shape class: the one it chose before, else the one recorded for
    this GPU, else (dK/dV, grouped-query) the one recorded for group 1, else the table's rule; None when
    COURSE_AUTOTUNE=1 is to choose it (first use only). shape = (n_bucket, d, causal, dtype), and for
    the dK/dV kernel (n_bucket, d, causal, dtype, atomic, group): what the choice may depend on."""
    config = CHOSEN.get((table.name, shape))
    if config is None:
        n, d, causal, dtype = shape[:4]
        record = tuned_record().get(table.name, {})
        recorded = record.get(shape_key(shape))
        if (
            recorded is None
            and autotune_enabled()
            and dtype not in (torch.float32, torch.float64)
            and d <= 128
        ):
            return None
        if recorded is None and table.name == "dkdv" and shape[-1] != 1:
            # grouped-query: the multi-head choice of the same shape is a better start than the rule
            recorded = record.get(shape_key(shape[:-1] + (1,)))
        config = Launch(*recorded) if recorded else table.choose(d, causal, n, dtype, runtime.INTERPRET)
        CHOSEN[(table.name, shape)] = config
    return config


@contextlib.contextmanager
def trying(table: KernelConfigs, shape: tuple, config: Launch):
    """Within the block, this process launches `config` for the shape class (a sweep timing its
    candidates, e.g. `scripts/gqa_speed.py --tune`); afterwards, what it chose before."""
    name = (table.name, shape)
    before = CHOSEN.get(name)
    choose(name, config)
    _SEEN.add(name)  # nothing to compile ahead: the launch compiles it
    try:
        yield
    finally:
        choose(name, before)


def shape_key(shape: tuple) -> str:
    """A shape class as the text key of the GPU's record: "4096/128/True/bfloat16" (dK/dV kernel:
    "4096/128/True/bfloat16/False/1", atomic dQ and group size appended)."""
    return "/".join(map(str, shape)).replace("torch.", "")


def launch(kernel, tuner, table: KernelConfigs, grid, args: tuple, meta: dict, shape: tuple) -> None:
    """Launch `kernel` on `grid(launch)` with the configuration chosen for this shape class (`chosen`).

    Fixed launches (a `config` dict) do not come here; they call the kernel directly."""
    name = (table.name, shape)
    config = chosen(table, shape)
    if config is None:  # COURSE_AUTOTUNE=1 and a shape class seen for the first time
        bound.unrepeatable()  # the autotuner's launches are not `bound.launch`'s: no plan can repeat them
        tuner[lambda META: grid(Launch(META["BLOCK_M"], META["BLOCK_N"], 0, 0))](*args, **meta)
        best = tuner.best_config
        config = Launch(best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.num_warps, best.num_stages)
        record_choice(table.name, shape_key(shape), config)
        choose(name, config)
        _SEEN.add(name)
        return
    wait_compiled(name)  # if compiled ahead, its compilation is in Triton's cache now: this launch finds it
    _SEEN.add(name)
    bound.launch(kernel, grid(config), *args, **meta, **config.kwargs())


CHOICE_LISTENERS: list = []  # functions called whenever a shape class's launch changes (`attention.plans`)


def choose(name: tuple, config: Launch | None) -> None:
    """Make `config` the launch of shape class `name` ((table name, shape)) in this process; None forgets the
    choice. Every listener hears of it: what was planned with the old launch must be planned again."""
    if config is None:
        CHOSEN.pop(name, None)
    else:
        CHOSEN[name] = config
    for listener in CHOICE_LISTENERS:
        listener()


def compile_ahead(kernel, tuner, table: KernelConfigs, grid, args: tuple, meta: dict, shape: tuple) -> None:
    """Compile the launch `launch` would use, in a background thread, without running it.

    A new shape's first call compiles one kernel per pass (seconds each): started ahead, the backward's
    kernels compile while the forward compiles and runs, and the first forward + backward waits for the
    slowest compilation rather than their sum. Compiling hands most of its work to MLIR, LLVM and ptxas,
    which run outside Python's lock. Only the argument types and the integers' values matter to what is
    compiled, so tensors may be stand-ins (on the meta device). GPU only, never when autotuning; once
    per shape class and process. Same arguments as `launch`."""
    name = (table.name, shape)
    if not runtime.ON_GPU or name in _SEEN:
        return
    config = chosen(table, shape)
    if config is None:
        return
    compile_kernel_ahead(name, kernel, grid(config), args, dict(meta, **config.kwargs()))


def compile_kernel_ahead(name, kernel, grid: tuple, args: tuple, meta: dict) -> None:
    """Compile the launch `kernel[grid](*args, **meta)` in the background (`compile_in_background`,
    under `name`), without running it: GPU only. Only the argument types and the integers' values
    matter to what is compiled, so a tensor is passed as its dtype (it may be a stand-in on the meta
    device)."""
    if not runtime.ON_GPU:
        return
    stand_ins = tuple(a.dtype if isinstance(a, torch.Tensor) else a for a in args)  # a pointer's dtype only
    compile_in_background(name, lambda: kernel.warmup(*stand_ins, grid=grid, **meta))


def compile_in_background(name, work) -> None:
    """Run `work()` (a compilation) in a daemon thread, on the current GPU, registered under `name`,
    once per name and process: `wait_compiled(name)` joins it before the launch that needs it. What
    `work` returns (Triton's compiled kernel, from `warmup`) is also loaded there (`load_compiled`), so the
    first launch finds its launcher built and its binary on the GPU. An error
    is swallowed: the launch compiles again and reports it where it belongs. At exit the process waits
    for every compilation still running: a thread stopped inside the compiler at interpreter shutdown
    aborts the process ("exception not rethrown"), as a script that runs one forward and ends would
    otherwise see."""
    if name in _SEEN:
        return
    _SEEN.add(name)
    device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def run():
        try:
            with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
                load_compiled(work())
        except Exception:
            pass

    thread = threading.Thread(target=run, name=f"compile {name}", daemon=True)
    thread.start()
    COMPILING[name] = thread


def load_compiled(compiled) -> None:
    """Do what Triton otherwise does at a compiled kernel's first launch: build its launcher (a C
    extension compiled with the system's C compiler, a few tenths of a second on an empty cache) and load
    its binary onto the current GPU. A no-op for anything else, or a Triton without this step."""
    init = getattr(compiled, "_init_handles", None)
    if callable(init):
        init()


def wait_compiled(name) -> None:
    """Wait for the compilation started under `name` by `compile_in_background`, if there is one."""
    pending = COMPILING.pop(name, None)
    if pending is not None:
        pending.join()


@atexit.register
def finish_compiling() -> int:
    """Wait for every compilation `compile_in_background` still runs (at exit, and for a tool that
    times what a script left compiling); returns how many were still running."""
    pending = [thread for thread in list(COMPILING.values()) if thread.is_alive()]
    for thread in pending:
        thread.join()
    return len(pending)
