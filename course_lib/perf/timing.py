"""Timing that is honest on a GPU and still runs on a CPU.

Taught in notebook 08 (used from notebook 01 on). On a GPU, `benchmark` is
`triton.testing.do_bench`: it synchronises, flushes the L2 cache between runs, warms up, and returns
the median in milliseconds. The interpreter cannot run `do_bench`, and interpreter timings measure
Python, not a kernel; on the CPU `benchmark` falls back to a wall-clock median of a few calls, which
is right for timing CPU PyTorch code and meaningless for interpreted Triton kernels.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from .. import runtime


def benchmark(fn, *, warmup_ms: float = 25, rep_ms: float = 100, cpu_reps: int = 5) -> float:
    """Median time of `fn()` in milliseconds, on the device course_lib runs on."""
    if runtime.ON_GPU:
        return float(runtime.triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()  # warm-up: first-call costs (allocation, caches, kernel decoration) stay out
    samples = []
    for _ in range(cpu_reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def graphed(fn):
    """fn captured once as a CUDA graph; returns a function that replays it (None off the GPU).

    Timing the replay measures the GPU's work without the CPU's launch cost (Python, argument checks,
    one launch per kernel). fn runs twice on a side stream first (warm-up: compilation, allocator), then
    once under capture; the graph keeps fn's tensors (its memory pool) alive while the replay function
    lives. Everything fn reads must exist before the capture, and no autograd node may cross the capture
    boundary: to time a backward, capture a function that runs forward and backward together."""
    if not runtime.ON_GPU:
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def peak_memory(fn) -> int | None:
    """Peak bytes allocated on the GPU while `fn()` runs, above what was allocated before;
    None on the CPU (PyTorch does not track CPU allocations)."""
    if not runtime.ON_GPU:
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def free_memory() -> None:
    """Give memory back between measurements: collect Python garbage and, on a CUDA GPU, return PyTorch's
    cached blocks to the driver, so that one measurement's leftovers do not crowd out the next."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def attention_flops(
    batch: int,
    heads: int,
    n_queries: int,
    n_keys: int,
    head_dim: int,
    causal: bool = False,
    mode: str = "fwd",
) -> float:
    """Useful FLOPs of attention by the convention of the FlashAttention papers.

    Forward: two matmuls of 2 * Nq * Nk * d each, so 4 * B * H * Nq * Nk * d; halved when causal.
    Backward counts 2.5x the forward (five matmuls, one of them a recomputation); fwd+bwd 3.5x."""
    flops = 4.0 * batch * heads * n_queries * n_keys * head_dim
    if causal:
        flops *= 0.5
    factor = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
    if mode not in factor:
        raise ValueError(f"mode must be one of {sorted(factor)}, got {mode!r}")
    return flops * factor[mode]
