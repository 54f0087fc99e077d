"""Compile the course's kernels for a GPU on a machine that has none: CI's check that the compiler
accepts what the interpreter ran.

The Triton interpreter runs a kernel as Python, and Python is more lenient than Triton's compiler: a
name bound in one branch of a compile-time `if` and used after it, for instance, runs in the
interpreter and is a `NameError` for the compiler. A CPU-only CI would never see such a kernel fail.
So this tool:

1. runs a set of small calls (`WORKLOAD`) through the interpreter, recording every kernel launch: the
   kernel, the type of each argument (pointer dtype, integer, float), its compile-time constants and
   its launch options (warps, stages);
2. in a fresh process (one in which no kernel was interpreted: the interpreter patches
   `triton.language` for good), compiles each distinct launch for a Hopper GPU (`GPUTarget("cuda",
   90, 32)`, to PTX and a cubin with the ptxas that Triton ships), and reports the failures.

The bf16 launches are compiled twice: as the interpreter ran them (UPCAST=True: its dot products want
fp32 operands) and as the GPU runs them (UPCAST=False: bf16 tensor-core products). What it cannot see:
launch settings the interpreter never takes (the CPU's tile sizes are used), and anything that only
fails when a kernel runs. `make test-gpu` covers those.

    python -m course_lib.tools.compile_check            # exit status 1 if a launch does not compile
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")  # compile options among launch keywords
LAUNCH_ONLY = ("launch_pdl",)  # launch keywords that are no compile option
POINTER_TYPES = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}


@dataclass(frozen=True)
class FunctionRef:
    """A @triton.jit function passed as a compile-time constant (a teaching hook), by where it lives."""

    module: str
    name: str

    @classmethod
    def of(cls, value) -> FunctionRef:
        fn = getattr(value, "fn", value)
        return cls(fn.__module__, fn.__name__)

    def resolve(self):
        return getattr(sys.modules[self.module], self.name)


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the compiler needs it: where the kernel is defined, the type of each
    run-time argument ("*bf16", "i32", ... or "constexpr"), the compile-time values and options."""

    module: str
    name: str
    signature: tuple[tuple[str, str], ...]
    constants: tuple[tuple[str, object], ...]
    options: tuple[tuple[str, int], ...]

    def describe(self) -> str:
        consts = ", ".join(f"{k}={v}" for k, v in self.constants)
        return f"{self.module}.{self.name}({consts}; {dict(self.options)})"


def _argument_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"an argument of type {type(value).__name__} has no Triton type here: {value!r}")


def describe_launch(kernel, args: tuple, kwargs: dict) -> Launch:
    """The `Launch` of `kernel[grid](*args, **kwargs)` (kernel: an interpreted @triton.jit function)."""
    fn = kernel.fn
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args))
    options = {k: kwargs[k] for k in OPTIONS if kwargs.get(k) is not None}
    bound.update({k: v for k, v in kwargs.items() if k not in OPTIONS and k not in LAUNCH_ONLY})
    signature, constants = [], []
    for name, param in params.items():
        value = bound[name] if name in bound else param.default
        if value is inspect.Parameter.empty:
            raise TypeError(f"{fn.__name__}: no value for {name}")
        constexpr = "constexpr" in str(param.annotation) or value is None
        signature.append((name, "constexpr" if constexpr else _argument_type(value)))
        if constexpr:
            constants.append((name, FunctionRef.of(value) if callable(value) else value))
    return Launch(
        fn.__module__, fn.__name__, tuple(signature), tuple(constants), tuple(sorted(options.items()))
    )


@contextlib.contextmanager
def recorded_launches():
    """Record every interpreted kernel launch in the list this yields (the kernels still run)."""
    from triton.runtime.interpreter import InterpretedFunction

    launches: list[Launch] = []
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        launches.append(describe_launch(self, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    try:
        yield launches
    finally:
        InterpretedFunction.run = run


def workload() -> None:
    """Small calls that reach every kernel of course_lib and their main variants, on the CPU."""
    from course_lib import flash_attention, primer
    from course_lib.attention import attention_backward, attention_forward
    from course_lib.attention import backward as attention_backward_module
    from course_lib.decode import decode_attention, heuristics, paged_decode_attention
    from course_lib.fused import rms_norm, rope, rope_cache, swiglu
    from course_lib.fused.rms_norm import rms_norm_backward, rms_norm_forward

    gen = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float32, grad=False):
        return torch.randn(*shape, generator=gen).to(dtype).requires_grad_(grad)

    # attention: both dtypes the kernels specialise on, no mask / top-left / bottom-right with Nq != Nk,
    # grouped-query heads (summed on chip, and as partial sums), the atomic dQ, a teaching variant
    for dtype in (torch.float32, torch.bfloat16):
        q = randn(1, 4, 40, 32, dtype=dtype, grad=True)
        k, v = randn(1, 2, 48, 32, dtype=dtype, grad=True), randn(1, 2, 48, 32, dtype=dtype, grad=True)
        for causal in (False, True, "bottom_right"):
            flash_attention(q, k, v, causal=causal).float().sum().backward()
    q, k, v = (randn(1, 2, 40, 32) for _ in range(3))
    o, lse = attention_forward(q, k, v, True)
    do = randn(1, 2, 40, 32)
    attention_backward(do, q, k, v, o, lse, True, dq_mode="atomic")
    attention_forward(q, k, v, True, config={"exp2": False, "skip_masked_blocks": False})
    attention_backward(do, q, k, v, o, lse, True, config={"exp2": False, "skip_masked_blocks": False})
    # a sliding window with attention sinks: both dQ modes
    sinks = randn(2)
    o, lse = attention_forward(q, k, v, True, window=9, sinks=sinks)
    for mode in ("two_kernel", "atomic"):
        attention_backward(do, q, k, v, o, lse, True, dq_mode=mode, window=9, sinks=sinks)
    rule = attention_backward_module.dkdv_heads_per_program
    attention_backward_module.dkdv_heads_per_program = lambda group, causal, n, d: 1
    try:
        q = randn(1, 4, 40, 32)
        k, v = randn(1, 2, 40, 32), randn(1, 2, 40, 32)
        o, lse = attention_forward(q, k, v, True)
        attention_backward(randn(1, 4, 40, 32), q, k, v, o, lse, True)
        o, lse = attention_forward(q, k, v, True, window=9)  # one head per program, windowed
        attention_backward(randn(1, 4, 40, 32), q, k, v, o, lse, True, window=9)
    finally:
        attention_backward_module.dkdv_heads_per_program = rule

    # decoding: one split and several (the combine), a few query tokens, paged, a sliced batch
    q = randn(2, 2, 4, 32)
    k, v = randn(2, 70, 2, 32), randn(2, 70, 2, 32)
    lengths = torch.tensor([70, 33], dtype=torch.int32)
    for splits in (1, 3):
        decode_attention(q, k, v, lengths, num_splits=splits)
    pages = torch.randperm(10, generator=gen)[:10].to(torch.int32).view(2, 5)
    k_pages, v_pages = randn(10, 16, 2, 32), randn(10, 16, 2, 32)
    paged_decode_attention(q, k_pages, v_pages, pages, lengths, num_splits=2)
    limits = heuristics.SLICED_MIN_KEYS, heuristics.SLICE_KEYS
    heuristics.SLICED_MIN_KEYS, heuristics.SLICE_KEYS = 16, 16  # a long batch at the interpreter's sizes
    try:
        batch = heuristics.slots(heuristics.tile_for(32, paged=True)) // (2 * 3) + 1
        assert heuristics.sliced(batch, 48)
        assert not heuristics.one_wave(batch * 2 * 3, heuristics.tile_for(32, paged=True))
        k, v = randn(batch, 48, 2, 32), randn(batch, 48, 2, 32)
        lengths = torch.randint(0, 49, (batch,), generator=gen).int()
        decode_attention(randn(batch, 1, 4, 32), k, v, lengths)
        # more programs than slots: longest first, and one page-id load per block (no table row)
        table = torch.randperm(batch * 3, generator=gen).to(torch.int32).view(batch, 3)
        k_pages, v_pages = randn(batch * 3, 16, 2, 32), randn(batch * 3, 16, 2, 32)
        paged_decode_attention(randn(batch, 1, 4, 32), k_pages, v_pages, table, lengths)
    finally:
        heuristics.SLICED_MIN_KEYS, heuristics.SLICE_KEYS = limits
    # a cached prefill's pieces (`decode.prefill_split`): K/V gathered head-major, the combine of many rows
    from course_lib.decode import combine as combine_module
    from course_lib.decode.gather import gather_heads

    gather_heads(k_pages, v_pages, table[0], 40)
    many = combine_module.MANY_ROWS
    combine_module.MANY_ROWS = 8
    try:
        out = torch.empty(1, 5, 4, 32)
        combine_module.combine(randn(3, 1, 5, 4, 32), randn(3, 1, 5, 4), out, torch.empty(1, 5, 4))
    finally:
        combine_module.MANY_ROWS = many

    # fused: RMSNorm (whole rows; pieces that divide the row and pieces that do not; the three dW
    # reductions; the streaming hints), RoPE (both layouts, an offset and a positions tensor, the backward), SwiGLU
    for dtype in (torch.float32, torch.bfloat16):
        x, w = randn(3, 96, dtype=dtype, grad=True), randn(96, dtype=dtype, grad=True)
        rms_norm(x, w, 1e-6).float().sum().backward()
    x, w = randn(3, 96), randn(96)
    for chunk in (32, 64):
        y, rstd = rms_norm_forward(x, w, 1e-6, chunk=chunk)
    for mode in ("partials", "atomics", "locked"):
        rms_norm_backward(randn(3, 96), x, w, rstd, mode)
    rms_norm_backward(randn(3, 96), x, w, rstd, stream=True)  # the long rows' cache hints
    for layout in ("half", "interleaved"):
        q, k = randn(2, 3, 5, 16, grad=True), randn(2, 1, 5, 16, grad=True)
        cos, sin = rope_cache(12, 16, layout=layout)
        for positions in (4, torch.arange(5).view(1, 5)):
            q_rot, k_rot = rope(q, k, cos, sin, positions=positions, layout=layout)
            (q_rot.sum() + k_rot.sum()).backward()
    # SwiGLU's gate: contiguous inputs (the flat kernels) and the halves of one projection (the 2-D tiles), both ways
    for dtype in (torch.float32, torch.bfloat16):
        ab = randn(3, 2 * 40, dtype=dtype, grad=True)
        a, b = randn(3, 40, dtype=dtype, grad=True), randn(3, 40, dtype=dtype, grad=True)
        (swiglu(*ab.chunk(2, dim=-1)).float().sum() + swiglu(a, b).float().sum()).backward()

    # the read kernel of the bandwidth ceiling (notebooks 01 and 09)
    from course_lib.perf.ceilings import block_sums

    block_sums(randn(1000), block=256)

    # the primer's kernels (notebook 05)
    primer.add(randn(100), randn(100))
    primer.softmax(randn(3, 50))
    primer.weighted_sum(randn(4, 40, grad=True), randn(40, grad=True)).sum().backward()


def record() -> list[Launch]:
    """Run `workload` through the interpreter; the distinct launches, in first-seen order, each launch
    with UPCAST=True (bf16 upcast to fp32: an interpreter-only switch) followed by its GPU form."""
    with recorded_launches() as launches:
        workload()
    distinct = []
    for launch in dict.fromkeys(launches):
        distinct.append(launch)
        if ("UPCAST", True) in launch.constants:
            gpu = tuple((k, False if k == "UPCAST" else v) for k, v in launch.constants)
            distinct.append(dataclasses.replace(launch, constants=gpu))
    return list(dict.fromkeys(distinct))


def _compilable(modules: set[str]) -> None:
    """Make every interpreted @triton.jit function of course_lib, triton.language and `modules` a
    JITFunction, so that Triton's compiler can inline the helpers a kernel calls (this process
    interprets nothing)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    compiled: dict = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name.startswith(("course_lib", "triton.language")) or name in modules):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, InterpretedFunction):
                if value not in compiled:
                    compiled[value] = JITFunction(value.fn)
                setattr(module, attr, compiled[value])


def compile_launches(launches: list[Launch], capability: int = 90) -> list[tuple[Launch, str]]:
    """Compile each launch for compute capability `capability`; returns (launch, error) for failures."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    importlib.import_module("course_lib")
    for launch in launches:
        importlib.import_module(launch.module)
        for _, value in launch.constants:
            if isinstance(value, FunctionRef):
                importlib.import_module(value.module)
    _compilable({launch.module for launch in launches})
    target = GPUTarget("cuda", capability, 32)
    failures = []
    for launch in launches:
        kernel = getattr(sys.modules[launch.module], launch.name)
        constants = {k: v.resolve() if isinstance(v, FunctionRef) else v for k, v in launch.constants}
        source = ASTSource(kernel, dict(launch.signature), constexprs=constants)
        try:
            triton.compile(source, target=target, options=dict(launch.options))
        except Exception as exc:  # the report names the launch and the compiler's message
            failures.append((launch, f"{type(exc).__name__}: {exc}"))
    return failures


def compile_in_fresh_process(
    launches: list[Launch], capability: int = 90, paths: tuple[str, ...] = ()
) -> list[tuple[Launch, str]]:
    """`compile_launches` in a new Python process (COURSE_DEVICE=cpu, `paths` added to PYTHONPATH for
    kernels defined outside course_lib): (launch, error) for each launch that does not compile."""
    with tempfile.TemporaryDirectory() as tmp:
        specs, report = os.path.join(tmp, "launches.pkl"), os.path.join(tmp, "failures.pkl")
        with open(specs, "wb") as f:
            pickle.dump(launches, f)
        python_path = os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)
        env = dict(os.environ, COURSE_DEVICE="cpu", PYTHONPATH=python_path)
        cmd = [sys.executable, "-m", "course_lib.tools.compile_check", "--compile", specs, report]
        subprocess.run(cmd + ["--capability", str(capability)], env=env, check=True)
        with open(report, "rb") as f:
            return pickle.load(f)


def check(capability: int = 90) -> tuple[list[Launch], list[tuple[Launch, str]]]:
    """Record the workload's launches here, compile them in a fresh process: (launches, failures)."""
    launches = record()
    return launches, compile_in_fresh_process(launches, capability)


def kernels_defined() -> set[tuple[str, str]]:
    """(module, name) of every @triton.jit function named *_kernel in course_lib's modules (the ones
    that import here: an optional dependency may be missing)."""
    import pkgutil

    from triton.runtime.interpreter import InterpretedFunction

    import course_lib

    found = set()
    for info in pkgutil.walk_packages(course_lib.__path__, "course_lib."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # an optional dependency (transformers, ...) is missing
            continue
        for attr, value in vars(module).items():
            if (
                isinstance(value, InterpretedFunction)
                and attr.endswith("kernel")
                and value.fn.__module__ == info.name
            ):
                found.add((info.name, attr))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capability", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    parser.add_argument("--compile", nargs=2, metavar=("LAUNCHES", "REPORT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile:  # the fresh process of step 2
        with open(args.compile[0], "rb") as f:
            launches = pickle.load(f)
        with open(args.compile[1], "wb") as f:
            pickle.dump(compile_launches(launches, args.capability), f)
        return 0
    from course_lib import runtime

    if not runtime.INTERPRET:
        print("compile_check: kernels are compiled on this machine already (run the GPU tests instead)")
        return 0
    t0 = time.perf_counter()
    launches, failures = check(args.capability)
    n = len(launches)
    for launch, error in failures:
        print(f"does not compile: {launch.describe()}\n  {error}\n")
    print(f"compile_check: {n - len(failures)} of {n} launches compile for sm_{args.capability} "
          f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    # Run the package's copy of this module, not __main__: the pickled launches name its classes.
    from course_lib.tools.compile_check import main as package_main

    raise SystemExit(package_main())
