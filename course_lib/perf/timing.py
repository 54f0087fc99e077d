"""Timing that is honest on a GPU and still runs on a CPU.

Taught in notebook 08 (used from notebook 01 on). On a GPU, `benchmark` does what
`triton.testing.do_bench` does (synchronise, warm up, flush the L2 cache before every call, time each
call between two CUDA events, return the median in milliseconds) with one difference: it flushes the
L2 by *reading* a 256 MB buffer, where `do_bench` writes one. A write leaves the L2 full of dirty
lines, and the timed kernel pays for writing them back to memory (about 9 us on an H200, the time to
read 40 MB): every kernel looked that much slower, which is most of the gap between a few-hundred-MB
read and the bandwidth ceiling. A read leaves clean lines that cost nothing to evict, as a profiler's
cache flush does. The interpreter cannot run CUDA events, and interpreter timings measure Python, not
a kernel; on the CPU `benchmark` falls back to a wall-clock median of a few calls, which is right for
timing CPU PyTorch code and meaningless for interpreted Triton kernels.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from .. import runtime
from ..checks import check_int

FLUSH_BYTES = 256 * 2**20  # the buffer read between timed calls: four times an H200's 60 MiB L2
_flush_buffers: dict = {}


def flush_l2() -> None:
    """Evict the L2 cache of the current CUDA device by reading FLUSH_BYTES (a row sum into a small
    buffer): the lines it leaves are clean, and whatever the last call wrote is written back now, before
    the next timed call starts. Taught in notebook 08 (section 1.4)."""
    device = torch.cuda.current_device()
    if device not in _flush_buffers:
        x = torch.zeros(FLUSH_BYTES // 4, device=device, dtype=torch.float32).view(-1, 1024)
        _flush_buffers[device] = (x, torch.empty(x.shape[0], device=device, dtype=torch.float32))
    x, sums = _flush_buffers[device]
    torch.sum(x, dim=1, out=sums)


def _gpu_median(fn, warmup_ms: float, rep_ms: float) -> float:
    """do_bench's procedure (estimate, warm up, then a flushed and event-timed call per repetition),
    with `flush_l2` as the flush."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush_l2()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    n = max(1, int(rep_ms / estimate))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        flush_l2()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def describe() -> str:
    """How `benchmark` times on this device, in words, for the records."""
    if runtime.ON_GPU:
        return "median of CUDA-event timings, L2 flushed by a read before each call"
    return "wall-clock median (CPU)"


def benchmark(fn, *, warmup_ms: float = 25, rep_ms: float = 100, cpu_reps: int = 5) -> float:
    """Median time of `fn()` in milliseconds, on the device course_lib runs on: on a GPU, each call
    timed by CUDA events after a clean L2 flush (`flush_l2`), after `warmup_ms` of warm-up calls and
    for about `rep_ms` of calls; on the CPU, the wall-clock median of `cpu_reps` calls after one."""
    if not callable(fn):
        raise TypeError(f"benchmark: fn must be a function to call (a lambda), got {type(fn).__name__}")
    cpu_reps = check_int("benchmark", "cpu_reps", cpu_reps, 1)
    if runtime.ON_GPU:
        return float(_gpu_median(fn, warmup_ms, rep_ms))
    fn()  # warm-up: first-call costs (allocation, caches, kernel decoration) stay out
    samples = []
    for _ in range(cpu_reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def graphed(fn, pool=None):
    """fn captured once as a CUDA graph; returns a function that replays it (None off the GPU).
    pool: a memory pool (`torch.cuda.graph_pool_handle()`) shared with other graphs that never run at
    the same time (the serving loop's decode graphs, `course_lib.decode.graphs`).

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
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph.replay


def graph_ms(fn) -> float | None:
    """Median ms (`benchmark`) of a CUDA-graph replay of `fn` (`graphed`), None off the GPU; the graph
    and its memory are freed afterwards."""
    replay = graphed(fn)
    if replay is None:
        return None
    try:
        return benchmark(replay)
    finally:
        del replay
        free_memory()


def interleaved(calls: dict, passes: int, timer=benchmark) -> dict:
    """Times of several calls taken in turn, `passes` times each: {name: [ms per pass]}.

    Pass p starts with call number p (mod the number of calls) and goes round in order, so that each call
    goes first, and follows each other, equally often. A GPU's clock and temperature drift over a run by
    a few per cent; timing each call once, in a fixed order, gives that drift to whichever came last.
    Compare medians over the passes (`statistics.median`), and read the spread of each list as the noise.
    `timer` takes a function and returns ms: `benchmark` (default) or `graph_ms`."""
    passes = check_int("interleaved", "passes", passes, 1)
    if not calls or not all(callable(fn) for fn in calls.values()):
        raise TypeError("interleaved: calls must be a non-empty dict of functions to call")
    names = list(calls)
    times = {name: [] for name in names}
    for p in range(passes):
        start = p % len(names)
        for name in names[start:] + names[:start]:
            times[name].append(timer(calls[name]))
    return times


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


def kernel_stats(fn) -> dict | None:
    """The GPU kernels that one call of `fn()` launches, from torch.profiler: {"ms": their device time
    summed, "count": how many, "wall_ms": that call's wall time, the profiler's overhead included}; None
    off the GPU. Set against the call's wall time it says who waits: kernels close to the wall time mean
    the GPU is busy, far below it that the GPU waits on the CPU's launches (notebook 12)."""
    if not runtime.ON_GPU:
        return None
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {
        "ms": sum(e.self_device_time_total for e in kernels) / 1e3,
        "count": sum(e.count for e in kernels),
        "wall_ms": 1e3 * wall,
    }


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

    Forward: two matmuls of 2 * Nq * Nk * d each, so 4 * B * H * Nq * Nk * d; halved when causal
    (Nq = Nk only: with Nq != Nk the visible share depends on the alignment, from 1/Nk of the keys per
    row top-left with one query to all of them bottom-right, so such a call is refused rather than
    miscounted). Backward counts 2.5x the forward (five matmuls, one of them a recomputation);
    fwd+bwd 3.5x."""
    flops = 4.0 * batch * heads * n_queries * n_keys * head_dim
    if causal:
        if n_queries != n_keys:
            raise ValueError(
                f"attention_flops: causal with Nq={n_queries} != Nk={n_keys}: the halving convention holds for "
                "Nq = Nk only (the visible keys depend on the alignment); count the visible pairs instead"
            )
        flops *= 0.5
    factor = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
    if mode not in factor:
        raise ValueError(f"mode must be one of {sorted(factor)}, got {mode!r}")
    return flops * factor[mode]
