"""Compile the attention kernels' launch configurations in parallel worker processes (GPU only).

Used by `make bench` and `make test-gpu` (notebook 08 explains why). Compiling is CPU work, and one
process compiles one kernel at a time: autotuning (`COURSE_AUTOTUNE=1`, which `make bench` sets)
compiles every candidate of `configs.FORWARD`, `configs.DKDV` and `configs.DQ` for each shape class.
Here worker processes each compile one candidate per kernel by running it once, as a fixed launch, on a
small input shaped like the real ones (same dtype, same divisibility of sizes and strides, so the same
specialisation). Triton's on-disk cache then serves the main process, which only has to time them.

    python -m course_lib.attention.precompile          # bf16, d in {64, 128}, causal and not
    python -m course_lib.attention.precompile --setup  # what `make setup` runs: first calls' launches

`--setup` (`precompile_setup`) compiles instead what course_lib itself launches (no autotuning candidates) for
a forward and backward of bf16 and fp16, d in {64, 128}, causal and not, at every size class, for the head
counts and lengths of `SETUP_SHAPES`: a first call on that machine then reads its kernels from Triton's cache.
On a CPU it does nothing.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time


def _compile_candidate(job):
    """Worker: compile candidate i of each kernel for one (d, causal, dtype); return errors, if any."""
    import torch

    from course_lib.attention import attention_backward, attention_forward, configs

    d, causal, i, dtype_name = job
    fwd = configs.FORWARD.candidates[min(i, len(configs.FORWARD.candidates) - 1)]
    dkdv = configs.DKDV.candidates[min(i, len(configs.DKDV.candidates) - 1)]
    dq = configs.DQ.candidates[min(i, len(configs.DQ.candidates) - 1)]
    dtype = getattr(torch, dtype_name)
    q, k, v = (torch.randn(1, 2048 // d, 1024, d, device="cuda", dtype=dtype) for _ in range(3))
    errors = []
    try:
        o, lse = attention_forward(q, k, v, causal, config=dict(fwd.kwargs(), hopper=False))
        do = torch.randn_like(o)
        # The backward's fixed launch shares warps and stages between its two kernels: one call per kernel.
        for launch, keys in ((dkdv, ("BLOCK_M1", "BLOCK_N1")), (dq, ("BLOCK_M2", "BLOCK_N2"))):
            config = {keys[0]: launch.block_m, keys[1]: launch.block_n, "BLOCK_M": 64, "BLOCK_N": 64}
            config.update(num_warps=launch.num_warps, num_stages=launch.num_stages)
            for mode in ("two_kernel", "atomic"):
                attention_backward(do, q, k, v, o, lse, causal, config=config, dq_mode=mode)
        torch.cuda.synchronize()
    except Exception as exc:  # a candidate that does not fit (shared memory, registers) is reported
        errors.append(f"candidate {i}, d={d}, causal={causal}: {type(exc).__name__}: {str(exc)[:160]}")
    return errors


def precompile(
    head_dims=(64, 128), causal=(False, True), dtype: str = "bfloat16", workers: int | None = None
):
    """Fill Triton's cache with every candidate for these shapes; returns (seconds, error messages)."""
    from course_lib import runtime
    from course_lib.attention import configs

    if not runtime.ON_GPU:
        return 0.0, []  # the interpreter compiles nothing and tunes nothing
    n = max(len(t.candidates) for t in (configs.FORWARD, configs.DKDV, configs.DQ))
    jobs = [(d, c, i, dtype) for d in head_dims for c in causal for i in range(n)]
    workers = workers or runtime.compile_workers(min(len(jobs), 16))
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(workers) as pool:
        errors = [e for errs in pool.map(_compile_candidate, jobs, chunksize=1) for e in errs]
    return time.perf_counter() - t0, errors


# What `make setup` compiles on a GPU machine: the launches course_lib itself chooses (no autotuning
# candidates) for these calls, every size class of `launch.n_bucket` (16 ... 16384 keys).
SETUP_DTYPES = ("bfloat16", "float16")
SETUP_HEAD_DIMS = (64, 128)
# Triton compiles a kernel apart for each pattern of its integer arguments that divide by 16 or not (B x H, H,
# lengths, strides). bf16 calls, the models' dtype, are compiled for four: 16 heads (or a multiple: Llama's 32)
# and 12 (GPT-2's; any count that 16 does not divide), each with lengths that 16 divides (powers of two) and
# lengths 8 short of them (a prompt of any length). fp16 for the first alone. (heads, tokens short of n):
SETUP_SHAPES = {"bfloat16": ((16, 0), (12, 0), (16, 8), (12, 8)), "float16": ((16, 0),)}


def _compile_setup(job):
    """Worker: run forward + backward once at every size class for one (dtype, d, causal, heads, tokens short of
    the class's power of two): each launch course_lib chooses is compiled into Triton's on-disk cache (a class
    whose launch is already there costs a cache read). Returns errors, if any."""
    import torch

    from course_lib import flash_attention

    dtype_name, d, causal, heads, short = job
    dtype, errors = getattr(torch, dtype_name), []
    n = 16
    while n <= 16384:
        try:
            q, k, v = (  # SETUP_SHAPES says which heads and lengths, and why
                torch.randn(1, heads, n - short, d, device="cuda", dtype=dtype, requires_grad=True)
                for _ in range(3)
            )
            o = flash_attention(q, k, v, causal=causal)
            o.backward(torch.randn_like(o))
            torch.cuda.synchronize()
        except Exception as exc:
            errors.append(
                f"{dtype_name}, d={d}, causal={causal}, H={heads}, N={n - short}: {type(exc).__name__}: "
                f"{str(exc)[:160]}"
            )
        n *= 2
    return errors


def precompile_setup(workers: int | None = None):
    """Compile, in parallel worker processes, what a first call of `flash_attention` (forward and
    backward) would compile for bf16 and fp16, d in SETUP_HEAD_DIMS, causal and not, at every size class
    of sequence length: `make setup` runs it on a GPU machine, so that a first call finds its kernels in
    Triton's cache (notes/attention.md, "First call"). Returns (seconds, error messages); on a CPU it
    compiles nothing (the interpreter compiles nothing)."""
    from course_lib import runtime

    if not runtime.ON_GPU:
        return 0.0, []
    jobs = [
        (t, d, c, h, short)
        for t in SETUP_DTYPES
        for h, short in SETUP_SHAPES[t]
        for d in SETUP_HEAD_DIMS
        for c in (False, True)
    ]
    workers = workers or runtime.compile_workers(len(jobs))
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(workers) as pool:
        errors = [e for errs in pool.map(_compile_setup, jobs, chunksize=1) for e in errs]
    return time.perf_counter() - t0, errors


if __name__ == "__main__":
    if "--setup" in sys.argv[1:]:
        from course_lib import runtime

        if not runtime.ON_GPU:
            print("no GPU: nothing to precompile (the CPU runs the kernels in Triton's interpreter)")
            sys.exit(0)
        seconds, errors = precompile_setup()
        for e in errors:
            print("  could not compile:", e)
        print(f"precompiled course_lib's FlashAttention launches for first calls in {seconds:.0f} s")
        sys.exit(0)
    seconds, errors = precompile()
    for e in errors:
        print("  could not compile:", e)
    print(f"precompiled course_lib's FlashAttention candidates in {seconds:.0f} s")
    sys.exit(0)
