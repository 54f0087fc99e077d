"""Compile every autotuning candidate of the forward, dK/dV and dQ kernels in parallel (GPU only).

Used by `make bench` and `make test-gpu` (notebook 08 explains why). Autotuning compiles each candidate
configuration one after another in one process, and compiling is CPU work: for two head dims, causal
and not, and three kernels it takes minutes. Here worker processes each compile one candidate per
kernel by running it once on a small input shaped like the real ones (same dtype, same divisibility of
sizes and strides, so the same specialisation). Triton's on-disk cache then serves the autotuner in
the main process, which only has to time the candidates.

    python -m course_lib.attention.precompile      # bf16, d in {64, 128}, causal and not
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time


def _compile_candidate(job):
    """Worker: compile candidate i of each kernel for one (d, causal, dtype); return errors, if any."""
    import torch

    from course_lib.attention import backward as B
    from course_lib.attention import forward as F

    d, causal, i, dtype_name = job
    for tuner, candidates in (
        (F._fwd_tuned, F.GPU_FWD_CANDIDATES),
        (B._dkdv_tuned, B.GPU_DKDV_CANDIDATES),
        (B._dq_tuned, B.GPU_DQ_CANDIDATES),
        (B._dkdv_atomic_tuned, B.GPU_DKDV_CANDIDATES),
    ):
        tuner.configs = F._as_configs([candidates[min(i, len(candidates) - 1)]])
    dtype = getattr(torch, dtype_name)
    q, k, v = (torch.randn(1, 2048 // d, 1024, d, device="cuda", dtype=dtype) for _ in range(3))
    errors = []
    try:
        o, lse = F.forward(q, k, v, causal, None)
        do = torch.randn_like(o)
        for mode in ("two_kernel", "atomic"):
            B.backward(do, q, k, v, o, lse, causal, None, dq_mode=mode)
        torch.cuda.synchronize()
    except Exception as exc:  # a candidate that does not fit (shared memory, registers) is reported
        errors.append(f"candidate {i}, d={d}, causal={causal}: {type(exc).__name__}: {str(exc)[:160]}")
    return errors


def precompile(
    head_dims=(64, 128), causal=(False, True), dtype: str = "bfloat16", workers: int | None = None
):
    """Fill Triton's cache with every candidate for these shapes; returns (seconds, error messages)."""
    from course_lib import runtime
    from course_lib.attention import backward as B
    from course_lib.attention import forward as F

    if not runtime.ON_GPU:
        return 0.0, []  # the interpreter compiles nothing and tunes nothing
    n = max(len(F.GPU_FWD_CANDIDATES), len(B.GPU_DKDV_CANDIDATES), len(B.GPU_DQ_CANDIDATES))
    jobs = [(d, c, i, dtype) for d in head_dims for c in causal for i in range(n)]
    workers = workers or max(1, min(len(jobs), (os.cpu_count() or 2) - 2, 16))
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(workers) as pool:
        errors = [e for errs in pool.map(_compile_candidate, jobs, chunksize=1) for e in errs]
    return time.perf_counter() - t0, errors


if __name__ == "__main__":
    seconds, errors = precompile()
    for e in errors:
        print("  could not compile:", e)
    print(f"precompiled course_lib's FlashAttention candidates in {seconds:.0f} s")
    sys.exit(0)
