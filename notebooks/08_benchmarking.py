# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 08 · Benchmarking, profiling and the optimisation ladder
#
# Notebooks 06 and 07 built a FlashAttention-2 forward and backward in Triton that are *correct*. This
# notebook is about *fast*, and about knowing it: how to time GPU code without fooling yourself, how to
# see where the time goes, and how the kernels went from a straightforward version to course_lib's
# finished ones one step at a time, each step predicted before it was measured.
#
# **Learning goals**
# 1. Time GPU code honestly: asynchrony and synchronisation, warm-up, medians, the L2 cache,
#    `triton.testing.do_bench` against `torch.utils.benchmark` — and know why interpreter timings mean
#    nothing.
# 2. Count FLOPs by the convention of the FlashAttention papers and turn a time into TFLOP/s.
# 3. Profile: `torch.profiler` (a kernel table and a trace), NVTX ranges, and what Nsight Systems and
#    Nsight Compute show.
# 4. Climb the optimisation ladder: predict each rung's gain yourself from bytes and FLOPs, then score your
#    predictions against the recorded measurement, and name the assumption behind each miss.
# 5. Compare course_lib with PyTorch's attention backends, and know what `make bench` records.

# %% [markdown]
# ## 0. Sizes
#
# Every size this notebook uses, in one place. On a CPU the Triton kernels run in the interpreter, so
# they stay tiny; on a GPU they run at sizes where timing means something.

# %%
import math
import statistics
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import course_lib
from course_lib import bench, records
from course_lib.attention.reference import attention
from course_lib.perf import plotting, timing

plotting.use_readable_defaults()  # projector-sized fonts for every figure below, plt's own included

DEVICE = course_lib.DEVICE
DTYPE = course_lib.pick(cpu=torch.float32, gpu=torch.bfloat16)  # the interpreter has no bf16 arithmetic
MATMUL_N = course_lib.pick(cpu=512, gpu=8192)  # square matmul of the asynchrony demo
SWEEP_BYTES = course_lib.pick(cpu=[2**k for k in range(15, 27, 2)], gpu=[2**k for k in range(18, 32, 2)])
# Attention shape for live timings, (B, H, N, d): the papers' B*N = 16k tokens, H*d = 2048 on a GPU.
B, H, N, D = course_lib.pick(cpu=(1, 2, 256, 32), gpu=(4, 16, 4096, 128))
N_KERNEL = course_lib.pick(cpu=128, gpu=1024)  # course_lib kernels in the correctness checks
print(f"{course_lib.RUNTIME.describe()}; attention shape (B, H, N, d) = {(B, H, N, D)}, {DTYPE}")

# %% [markdown]
# ## 1. How to time GPU code
#
# ### 1.1 Asynchrony: the CPU does not wait for the GPU
#
# A CUDA call from Python *enqueues* work and returns at once; the GPU runs it later. A stopwatch on the
# CPU around `a @ b` therefore measures the **launch** (microseconds), not the matmul. To measure the
# work, wait for the GPU before reading the clock: `torch.cuda.synchronize()` (or CUDA events, which
# the GPU itself timestamps). On a CPU every PyTorch call is synchronous, so the stopwatch is right —
# the pitfall only bites on a GPU, and it bites silently: you get a plausible, tiny number.

# %%
a, b = (torch.randn(MATMUL_N, MATMUL_N, device=DEVICE, dtype=DTYPE) for _ in range(2))


def sync():
    if course_lib.ON_GPU:
        torch.cuda.synchronize()


def stopwatch_ms(fn, wait: bool) -> float:
    """One call timed with the CPU clock; wait=True synchronises before and after."""
    if wait:
        sync()
    t0 = time.perf_counter()
    fn()
    if wait:
        sync()
    return (time.perf_counter() - t0) * 1e3


_ = a @ b  # warm-up (section 1.2)
sync()
no_wait = statistics.median(stopwatch_ms(lambda: a @ b, wait=False) for _ in range(10))
sync()
with_wait = statistics.median(stopwatch_ms(lambda: a @ b, wait=True) for _ in range(10))
flops = 2 * MATMUL_N**3
print(f"{MATMUL_N}^3 matmul ({DTYPE}) on {DEVICE.type}:")
print(f"  stopwatch without synchronising: {no_wait:8.3f} ms  -> '{flops / no_wait / 1e9:.3g} TFLOP/s'")
print(f"  stopwatch with synchronising:    {with_wait:8.3f} ms  -> {flops / with_wait / 1e9:.3g} TFLOP/s")
if course_lib.ON_GPU:
    assert with_wait > 3 * no_wait, "on a GPU the unsynchronised stopwatch should see only the launch"
else:
    gap = max(no_wait, with_wait) / min(no_wait, with_wait)
    print(
        f"On the CPU both stopwatches time the same work (PyTorch's CPU operations finish before they return);"
        f"\nhere they differ by {gap:.2f}x, which is "
        + ("within the scatter of repeated timings." if gap < 1.3 else "the scatter of a busy machine: run it again.")
    )

# %% [markdown]
# On a GPU the unsynchronised "TFLOP/s" is usually far above the hardware's peak — the telltale sign.
#
# ### 1.2 Warm-up: the first call pays for everything that happens once
#
# The first call of a kernel pays for one-time work: CUDA context and library handles, Triton's
# compilation (and autotuning, which times every candidate config), `torch.compile`'s tracing, memory
# the caching allocator has not reserved yet. Always call once before timing; `timing.benchmark` does.
# Here: the first call of course_lib's kernel on a new shape against the median of the next ones.

# %%
q, k, v = (torch.randn(B, H, N_KERNEL + 16, D, device=DEVICE, dtype=DTYPE) for _ in range(3))
first = stopwatch_ms(lambda: course_lib.flash_attention(q, k, v), wait=True)
later = statistics.median(
    stopwatch_ms(lambda: course_lib.flash_attention(q, k, v), wait=True) for _ in range(5)
)
print(f"first call {first:.1f} ms, later calls {later:.1f} ms (median): {first / later:.2g}x")

# %% [markdown]
# **The warm-up sweep.** How many warm-up calls are enough? Time the first eight calls on a shape this
# process has not run yet (causal this time, so its kernel is another compilation, not 1.2's), one by one,
# then see what a timing loop of five calls would report after 0, 1 or 2 warm-up calls (the mean of calls
# w+1 to w+5).

# %%
q, k, v = (torch.randn(B, H, N_KERNEL + 48, D, device=DEVICE, dtype=DTYPE) for _ in range(3))
calls = [stopwatch_ms(lambda: course_lib.flash_attention(q, k, v, causal=True), wait=True) for _ in range(8)]
print("calls one by one (ms):", " ".join(f"{t:.2f}" for t in calls))
steady = statistics.median(calls[3:])
for w in (0, 1, 2):
    reported = statistics.fmean(calls[w : w + 5])
    print(f"  {w} warm-up calls: the loop reports {reported:8.2f} ms, {reported / steady:.2f}x the steady median")

# %% [markdown]
# ### 1.3 Medians, not means
#
# Repeated timings scatter: other processes, clock boost, interrupts, the Python garbage collector. The
# distribution has a long tail to the right (something occasionally gets in the way; nothing makes a
# kernel faster than it is), so the **median** is the robust summary, and the minimum is optimistic.
# Let us time standard attention 60 times, one call at a time. (On a busy shared machine — a CI runner,
# a laptop compiling something — the tail can hold most of the calls: then no single number is honest,
# and the fix is a quiet machine, not a cleverer statistic.)

# %%
q, k, v = (torch.randn(B, H, N, D, device=DEVICE, dtype=DTYPE) for _ in range(3))
samples = [stopwatch_ms(lambda: attention(q, k, v), wait=True) for _ in range(60)]
med, mean = statistics.median(samples), statistics.fmean(samples)
top = 3 * med  # one slow outlier must not squash the rest into a single bar: calls beyond 3x the median
beyond = sum(t > top for t in samples)  # are counted, not drawn
fig, ax = plt.subplots(figsize=(10, 4.5))
ax.hist([min(t, top) for t in samples], bins=30, range=(min(samples), top), color="tab:blue")
for value, name, style in ((med, "median", "-"), (mean, "mean", "--"), (min(samples), "min", ":")):
    ax.axvline(min(value, top), color="black", linestyle=style, label=f"{name} {value:.3f} ms")
ax.set_xlabel("time per call (ms)" + (f"; {beyond} slower calls piled up at the right edge" if beyond else ""))
ax.set_ylabel("number of calls")
ax.set_title(f"60 timings ({DEVICE.type}): the mean is {100 * (mean / med - 1):+.0f}% off the median")
ax.legend()
plt.show()

# %% [markdown]
# Comparing two kernels adds one more trap: drift. Over a run a GPU's clock and temperature move figures by
# a few per cent, so timing A and then B, once each, hands the drift to whichever came second. Time them in
# turn over several passes, each first equally often, and compare medians:
# `course_lib.perf.timing.interleaved({"A": run_a, "B": run_b}, passes=6)` returns each one's times. A
# difference smaller than the spread of one kernel's own passes is a tie, not a result (notebook 08c
# shows a launch rule that was changed only after this kind of timing).

# %% [markdown]
# ### 1.4 The L2 cache: hot data lies
#
# Timing one call many times in a row on the **same** tensors leaves them in the cache after the first
# call; every later call reads from the cache instead of from memory. For data that fits (the H200's L2
# holds 60 MiB; a CPU core's L2 0.5-2 MB), the loop measures a bandwidth the real workload, which
# streams fresh data, never sees. `triton.testing.do_bench` therefore **clears the L2** (by writing a
# 256 MB buffer) before every call, and so does `course_lib.perf.timing.benchmark` (by reading one, for the
# reason at the end of this section); `torch.utils.benchmark` does not.
#
# Below: the bandwidth of `x.sum()` as the array grows, timed hot (repeated calls, `torch.utils.benchmark`)
# and, on a GPU, with the L2 flushed (`timing.benchmark`). Hot small arrays look much faster than memory is.
# (On a CPU, `torch.utils.benchmark.Timer` runs its statement on **one thread** unless given `num_threads`:
# here it gets all of PyTorch's threads, `THREADS`, as the plain calls of `timing.benchmark` use.)

# %%
from torch.utils import benchmark as tbench

THREADS = torch.get_num_threads()  # torch.utils.benchmark's Timer would use 1 on a CPU
hot, flushed = [], []
for nbytes in SWEEP_BYTES:
    x = torch.randn(nbytes // 4, device=DEVICE)
    t = tbench.Timer("x.sum()", globals={"x": x}, num_threads=THREADS).blocked_autorange(min_run_time=0.05).median
    hot.append(nbytes / t / 1e9)
    if course_lib.ON_GPU:
        flushed.append(nbytes / (timing.benchmark(lambda x=x: x.sum()) * 1e-3) / 1e9)
series = {"hot: repeated calls (torch.utils.benchmark)": hot}
if flushed:
    series["L2 flushed before each call (timing.benchmark)"] = flushed
fig, ax = plt.subplots(figsize=(8, 4.5))
for name, ys in series.items():
    ax.plot([n / 2**20 for n in SWEEP_BYTES], ys, marker="o", label=name)
ax.set_xscale("log", base=2)
ax.set_xlabel("array size (MiB)")
ax.set_ylabel("bytes read per second (GB/s)")
ax.set_title(f"x.sum() on {DEVICE.type}: cache-resident data reads faster than memory")
ax.legend()
plt.show()

# %% [markdown]
# **How to flush matters too.** Writing a 256 MB buffer leaves the L2 full of *dirty* lines: data that
# exists only in the cache. The next kernel's first loads must evict them, and an evicted dirty line is
# written back to memory first. So under `do_bench` every kernel starts by writing back tens of MB that
# belong to the timer: a fixed cost (the cell below measures it on a GPU) that looks like a slow start of
# the kernel.
# `timing.benchmark` flushes by reading a 256 MB buffer instead: the lines it leaves are clean and cost
# nothing to evict, which is what a profiler's cache flush gives a kernel too. On a GPU, one read of
# 256 MB timed both ways (on the CPU there is no L2 flush to compare):

# %%
if course_lib.ON_GPU:
    big = torch.randn(2**26, device=DEVICE)  # 256 MiB of float32: four times an H200's L2
    read_big = lambda: big.sum()  # noqa: E731
    t_write_flush = course_lib.runtime.triton.testing.do_bench(read_big, return_mode="median") * 1e3
    t_read_flush = timing.benchmark(read_big) * 1e3
    print(f"flushed by a write (do_bench): {t_write_flush:.1f} us")
    print(f"flushed by a read (timing.benchmark): {t_read_flush:.1f} us")
    write_back = t_write_flush - t_read_flush
    if write_back > 1:
        share = write_back / t_read_flush
        print(f"the timer's own write-back costs this read {write_back:.1f} us, {share:.0%} of its time")
    else:
        print(f"here the flushes agree within {abs(write_back):.1f} us: this GPU writes dirty lines back cheaply")
    del big
else:
    print("CPU: no GPU L2 to flush; this comparison runs on a GPU")

# %% [markdown]
# ### 1.5 `do_bench` against `torch.utils.benchmark`
#
# | | `triton.testing.do_bench` | `torch.utils.benchmark.Timer` |
# | --- | --- | --- |
# | devices | CUDA only (not the interpreter) | CPU and CUDA |
# | synchronises | yes (CUDA events) | yes |
# | warm-up | yes (`warmup` ms) | `blocked_autorange` runs until `min_run_time` |
# | L2 cache | flushed before every call (by a write) | not flushed (hot) |
# | summary | mean by default (`return_mode=`: median, min, max, all), ms | median and IQR, seconds; tables |
# | threads, on a CPU | (no CPU) | **one** by default (`num_threads=`); PyTorch's own calls use all cores |
#
# `course_lib.perf.timing.benchmark(fn)` is `do_bench`'s procedure and median on a GPU, with the L2 flushed by a
# read, and a wall-clock median of a few calls on the CPU, on all of PyTorch's threads. Both ways on standard
# attention, the Timer given the same threads (`num_threads=THREADS`); on a CPU, also at its default of one:

# %%
t_course = timing.benchmark(lambda: attention(q, k, v))
stmt, names = "attention(q, k, v)", dict(attention=attention, q=q, k=k, v=v)
timer = tbench.Timer(stmt, globals=names, num_threads=THREADS)
t_torch = timer.blocked_autorange(min_run_time=0.2).median * 1e3
print(f"course_lib.perf.timing.benchmark: {t_course:.3f} ms   "
      f"torch.utils.benchmark ({THREADS} threads): {t_torch:.3f} ms")
print(f"torch.utils.benchmark / course_lib's benchmark: {t_torch / t_course:.2f}")
if not course_lib.ON_GPU:
    one = tbench.Timer(stmt, globals=names)  # num_threads left at its default, 1
    t_one = one.blocked_autorange(min_run_time=0.2).median * 1e3
    print(f"torch.utils.benchmark at its default of one thread: {t_one:.3f} ms ({t_one / t_torch:.2g}x the time "
          f"on {THREADS} threads): a CPU timing must say how many threads it ran on")

# %% [markdown]
# The two differ in the L2 flush (and on the CPU both are wall-clock medians on the same threads). For a
# kernel whose inputs are much larger than the L2, the flush changes little and the ratio printed above should
# be close to 1; for small inputs `torch.utils.benchmark` reads faster, for the reason of 1.4.
#
# ### 1.6 Interpreter timings mean nothing
#
# On a CPU, Triton's interpreter runs each program instance in Python, one after another, each tile's
# operations as NumPy calls: it models no memory traffic, occupancy or tensor-core use. Below, 32 x 32
# tiles against 64 x 64 tiles: 4x the tiles (program instances x loop iterations). The interpreter's time
# rises with the tile count but does not follow it: each tile's NumPy work also grows with the tile's
# size, so a 64 x 64 tile costs it more than a 32 x 32 one. The cell prints both ratios. On a GPU the
# answer depends on everything the interpreter does not model (and can go either way).

# %%
from course_lib.attention import backward, forward

q3, k3, v3, do3 = (torch.randn(B * H, N_KERNEL, D, device=DEVICE, dtype=DTYPE) for _ in range(4))
tile_count, tile_ms = {}, {}
for bm in (32, 64):
    cfg = dict(BLOCK_M=bm, BLOCK_N=bm, num_warps=4, num_stages=2)
    tile_count[bm] = B * H * math.ceil(N_KERNEL / bm) ** 2
    tile_ms[bm] = timing.benchmark(lambda cfg=cfg: forward.forward(q3, k3, v3, False, None, config=cfg))
    how = "compiled" if course_lib.ON_GPU else "interpreted"
    print(f"{bm} x {bm} tiles: {tile_count[bm]:5d} tiles, {tile_ms[bm]:8.3f} ms ({how})")
count_ratio, time_ratio = tile_count[32] / tile_count[64], tile_ms[32] / tile_ms[64]
print(f"32 x 32 against 64 x 64: {count_ratio:.0f}x the tiles, {time_ratio:.2f}x the time ({how})")
if not course_lib.ON_GPU:
    assert 1 < time_ratio < count_ratio, "the interpreter's time rises with the tile count, by less than it"

# %% [markdown]
# ### 1.7 Counting FLOPs: the papers' convention
#
# TFLOP/s is *useful* floating-point operations per second, counted the same way for every
# implementation, whatever it actually executes:
# - forward: two matmuls, S = Q Kᵀ and O = P V, each 2·N·N·d per (batch, head): **4·B·H·N²·d**;
# - causal: **half** of that (a kernel that computes masked tiles gets no credit for them);
# - backward: **2.5x** the forward (five matmuls, one of them recomputing S); forward + backward: 3.5x.
# Softmax's exponentials are not counted. `course_lib.perf.timing.attention_flops` implements it.

# %%
for causal in (False, True):
    for mode in ("fwd", "bwd", "fwd_bwd"):
        f = timing.attention_flops(4, 16, 4096, 4096, 128, causal=causal, mode=mode)
        print(f"B=4, H=16, N=4096, d=128, causal={causal!s:5}, {mode:7}: {f / 1e12:6.3f} TFLOP")
assert timing.attention_flops(4, 16, 4096, 4096, 128) == 4 * 4 * 16 * 4096**2 * 128

# %% [markdown]
# So a causal forward at that shape, 0.275 TFLOP, that takes 1 ms runs at 275 TFLOP/s: plausible for a good
# kernel on an H200. One that seemed to take 0.1 ms would claim 2750 TFLOP/s, more than any GPU's dense bf16
# peak (the H200's datasheet says 989 TFLOP/s): a number like that means a timing bug. Below it, the bf16
# matmul rates of the recorded hardware run: **measured rates**, of that run and those shapes, not ceilings.
# The record's 4096³ and 8192³ matmuls already differ (cuBLAS picks a kernel per shape), and the live 8192³
# matmul of section 1.1 prints its own rate on a GPU: on the H200 live runs have measured about 770-800
# TFLOP/s, 12-14 % above the record's 8192³, because a GPU's clocks move with its power draw and temperature
# from run to run (and 1.1 times ten back-to-back calls with a stopwatch, the record one call after each L2
# flush).

# %%
causal_fwd = timing.attention_flops(4, 16, 4096, 4096, 128, causal=True, mode="fwd")
for ms in (1.0, 0.1):
    print(f"causal forward, {causal_fwd / 1e12:.3f} TFLOP in {ms} ms: {causal_fwd / (ms * 1e-3) / 1e12:6.0f} TFLOP/s")
hw = records.load_record("hardware")
if hw is not None:
    print(f"bf16 matmul rates measured in one run ({records.label(hw)}):")
    for op in hw["data"]["operations"]:
        if op["name"] == "matmul 4096":
            print(f"  4096³: {op['flops'] / (op['ms'] * 1e-3) / 1e12:.0f} TFLOP/s")
    print(f"  {hw['data']['matmul_n']}³: {hw['data']['matmul_tflops'].get('bfloat16', float('nan')):.0f} TFLOP/s "
          "(the rate later cells divide by)")

# %% [markdown]
# ### 1.8 When the CPU is the bottleneck
#
# `do_bench` reads two CUDA events, recorded just before and just after the call is *issued*. While the
# CPU issues work faster than the GPU finishes it, kernels queue up and the events measure the GPU. When
# issuing one call takes longer than running it, the GPU sits idle between kernels and the events measure
# the CPU instead. Small shapes are where that happens: on a millisecond-sized forward+backward, every
# Triton launch (tens of microseconds of Python: binding and checking each argument), every allocation,
# the autograd bookkeeping, and the Python `autograd.Function.backward` (which PyTorch runs on its own
# autograd thread for CUDA tensors) add up to a large share of the GPU time.
#
# How to tell: time many calls back to back with one synchronisation at the end (wall time per call), time
# how long the loop took to *issue* them, and compare both with the kernels' time from `torch.profiler`.
# Issue time close to wall time means CPU-bound. `scripts/launch_overhead.py` does this for course_lib and
# SDPA; `make bench` records the CPU time of one call on a tiny shape (`course_lib.bench.host_time`, read
# below). course_lib's answer: its backward is two launches (the dQ kernel also computes D = rowsum(dO * O)),
# a call with nothing to differentiate (inference, `torch.no_grad()`) runs the forward alone, without an
# autograd node, and a call seen before runs its **plan** (`course_lib/attention/plans.py`): everything the
# first call of that kind decided (checks passed, route, launch, and each kernel's forty arguments bound
# once, `course_lib/kernels/bound.py`) is kept per key (shapes, strides, dtypes, devices, alignment, causal,
# scale), so the call only allocates its outputs and launches. The one-pass backward of 08c has a plan too, and
# needs it: without one, at 2048 tokens (d = 64, causal, 256 heads) its eager backward ran well below its
# kernel's own speed, the GPU idle while Python prepared each of its launches. A Gluon launch reads each tensor
# through a TMA descriptor (seven for the one pass), a 128-byte record the driver encodes from the tensor's
# address; a plan encodes each once per address and keeps it, since a model's tensors come back at the same
# addresses from call to call. The record's longer causal row, at a shape where the backward is the one pass
# ((1, 4, 4096, 64); (1, 8, 2048, 64) in records before 2026-12-01), still pays for the one pass's steps around
# its kernel, each issued from the host (with fewer heads its grid would be under half the SMs, and the backward
# takes the two kernels there, faster on the GPU as well): the D pass (which
# also zeroes the float32 dQ accumulator, one launch fewer than zeroing it apart) and dQ's cast. `make bench`
# also measures `torch.compile` after every other provider, because after it had run, Python launches in that
# process were measured slower (`notes/attention.md`); the host-time record (`make bench BENCH=host_time`) is
# therefore measured in a fresh process, as an eager caller runs. It also times the floor under every Python
# `autograd.Function`: one whose forward and backward only allocate their outputs, no kernel, no check. Compare
# its forward+backward with SDPA's whole one: what the Function's Python and autograd's thread cost before a
# single kernel is launched. What is left of the host's time per call is
# one reason serving engines replay decoding steps as CUDA graphs: a replay issues every kernel of the step
# from one CPU call.

# %%
host_rec = records.load_record("host_time")
if host_rec is None:
    print("No host-time record yet: `make bench BENCH=host_time` on a GPU writes one.")
else:
    meta = host_rec["meta"]
    print(f"CPU time to issue one call, (1, 2, 128, 64), the longer causal row as named, "
          f"{host_rec['data']['calls']} calls ({meta['gpu']}, torch {meta['torch']}, {meta['date']}):")
    for row in host_rec["data"]["rows"]:
        print(f"  {row['call']:<18} course_lib {row['course_lib_us']:6.1f} us   SDPA {row['sdpa_us']:6.1f} us   "
              f"ratio {row['ratio']:.2f}")
    floor = host_rec["data"].get("floor")
    if floor:
        print(f"  an empty Python autograd.Function, forward+backward: {floor['empty_function_us']:.1f} us "
              f"(timed in turns with the forward+backward row: SDPA {floor['sdpa_us']:.1f} us)")

# %% [markdown]
# ## 2. Profiling: where does the time go?
#
# A benchmark says *how long*; a profiler says *where*. `torch.profiler` records every operator (CPU
# side) and every kernel (GPU side, with `ProfilerActivity.CUDA`), and can export a trace for
# `chrome://tracing` or https://ui.perfetto.dev. `record_function` names a region of your own.

# %%
import contextlib
import os
import sys

from torch.profiler import ProfilerActivity, profile, record_function


@contextlib.contextmanager
def quiet_stderr():
    """Silence the profiler library's own start/stop log lines (written by C++ straight to stderr)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def top_table(prof, rows=12, width=46):
    """The operators (CPU) or kernels (GPU) with the most self time: name, calls, self time, share."""
    attr = "self_device_time_total" if course_lib.ON_GPU else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, attr), reverse=True)
    total = sum(getattr(e, attr) for e in events)
    print(f"{'operator or kernel':{width}} {'calls':>6} {'self ms':>9} {'share':>6}")
    for e in events[:rows]:
        name = e.key if len(e.key) <= width else e.key[: width - 1] + "…"
        t = getattr(e, attr)
        print(f"{name:{width}} {e.count:6d} {t / 1e3:9.3f} {100 * t / total:5.1f}%")


activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if course_lib.ON_GPU else [])
qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
with quiet_stderr(), profile(activities=activities) as prof:
    with record_function("standard attention fwd+bwd"):
        attention(qg, kg, vg, causal=True).sum().backward()
    with record_function("SDPA fwd+bwd"):
        F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).sum().backward()
    sync()
top_table(prof)  # prof.key_averages().table(...) prints every column, too wide for a notebook
trace = Path(tempfile.gettempdir()) / "course_08_attention_trace.json"
prof.export_chrome_trace(str(trace))
print(f"trace written to {trace}: open it in https://ui.perfetto.dev (or chrome://tracing)")

# %% [markdown]
# Read the table top-down: the operators (or, on a GPU, the kernels) that cost the most self time come
# first. In standard attention you see the matmuls, but also the softmax pieces (`exp`, `sub`,
# `logsumexp`, `masked_fill`) — each one a full pass over an N x N matrix in memory. SDPA's fused kernel
# appears as one or two entries.
#
# ### NVTX ranges, Nsight Systems and Nsight Compute
#
# On a GPU, **NVTX ranges** name regions of your program for NVIDIA's tools (they cost almost nothing
# when no tool listens): `with torch.cuda.nvtx.range("attention fwd"): ...`.
#
# - **Nsight Systems** (`nsys`) draws a *timeline*: CPU threads, CUDA API calls, every kernel and copy,
#   and your NVTX ranges. It answers "is the GPU busy, or waiting for Python / launches / copies?"
#   ```
#   nsys profile -t cuda,nvtx -o attention python my_benchmark.py
#   nsys stats attention.nsys-rep            # kernel and NVTX summaries in the terminal
#   ```
# - **Nsight Compute** (`ncu`) replays *one kernel* many times to read hardware counters: achieved
#   occupancy, "speed of light" (compute and memory throughput as % of peak), DRAM and L2 bytes, warp
#   stall reasons, registers and shared memory per thread block, a roofline. It answers "why is this
#   kernel as slow as it is?"
#   ```
#   ncu --set full -k regex:_fwd_kernel -c 1 -o fwd python my_benchmark.py
#   ncu --import fwd.ncu-rep --page details
#   ```
#   Replays make `ncu` slow (seconds per kernel): filter with `-k` (kernel name) and `-c` (count).

# %%
if course_lib.ON_GPU:
    with torch.cuda.nvtx.range("course_lib flash_attention fwd"):
        _ = course_lib.flash_attention(q, k, v, causal=True)
    sync()
    print("NVTX range recorded (visible under nsys)")
else:
    print("NVTX ranges need CUDA; on the CPU, record_function (above) plays that role for torch.profiler.")

# %% [markdown]
# ## 3. The optimisation ladder
#
# course_lib's kernels did not start fast. The ladder retraces the way from the straightforward kernels of
# notebooks 06 and 07 to the finished ones, one change at a time, through the `config=` switches of
# `forward.forward` and `backward.backward` (`"exp2"`, `"skip_masked_blocks"`, `BLOCK_M`, `BLOCK_N`,
# `num_warps`, `num_stages`; `config=None` is the tuned kernel) and the backward's work split `dq_mode`.
# Every rung runs the same production kernels: `"exp2": False` and `"skip_masked_blocks": False` hand them
# the teaching variants of `course_lib/attention/teaching.py` (a softmax step with natural exponentials, a
# block range that visits and masks every tile) in place of the fast pieces, which the kernels take as
# function arguments, so two neighbouring rungs differ by that one piece. One rung breaks the rule: the
# backward's last, atomic dQ, runs in Triton again (`"hopper": False`), so against the Gluon rung before it
# it changes two things, the dQ mode and the dK/dV kernel.
# The forward's last rung leaves Triton's programming model: on a Hopper GPU, `config=None` runs a
# warp-specialised kernel written in Gluon (`course_lib/attention/hopper.py`; the optional appendix
# notebook 08c explains it), and `{"hopper": False}` keeps the autotuned Triton kernel (on other GPUs and
# the CPU the two rungs are the same kernel). The backward does the same for its dK/dV kernel: on a Hopper
# GPU `config=None` runs a warp-specialised one after FlashAttention-3 in Gluon
# (`course_lib/attention/hopper_backward.py`, notebook 08c, section 5) after the Triton dQ kernel.
# The shape: d = 128, N = 4096, causal, bf16, B·N = 16k tokens. Each rung carries a gain predicted from
# bytes and FLOPs, written next to it in `course_lib.bench` *before* it was measured. You will predict each
# rung yourself before you see those. First, what each rung changes:

# %%
import textwrap

previous = {}
for step in bench.LADDER:
    before = previous.get(step.pass_)
    if step.config is None:
        change = f"config=None (tuned), dq_mode={step.dq_mode!r}"
    else:
        changed = {key: val for key, val in step.config.items() if before is None or before.get(key) != val}
        change = ", ".join(f"{key}={val}" for key, val in changed.items())
        if step.dq_mode != "two_kernel":
            change += f", dq_mode={step.dq_mode!r}"
    previous[step.pass_] = step.config
    print(f"[{step.pass_}] {step.name}")
    print(textwrap.fill(f"change: {change}", 100, initial_indent="      ", subsequent_indent="        "))

# %% [markdown]
# ### The ingredients
#
# **Exponentials against products.** Per score $s_{ij}$ the two matmuls do $4d$ FLOPs ($2d$ for $Q K^T$,
# $2d$ for $P V$) on the tensor cores, and the softmax does one exponential on the special-function units
# (`ex2`, 16 per clock per SM on Hopper, against about 4096 dense bf16 matmul FLOPs per clock per SM). In
# time: the exponential costs as much as $4096 / 16 = 256$ matmul FLOPs. At d = 128 the matmuls of a score
# cost 512 FLOPs, so the exponential adds half of that: a third of the total, if nothing overlaps. At d = 64
# it is half of the total. (The rescaling multiplies and the max run on the ordinary fp32 units and add a
# little more.) `exp(x)` itself is computed as `ex2(x · log2 e)`: one multiply more per score, unless log2 e
# is folded into the softmax scale.

# %%
SM_MATMUL_FLOPS_PER_CLOCK, SM_EX2_PER_CLOCK = 4096, 16  # H100/H200, dense bf16 tensor cores; MUFU ex2
for d_head in (64, 128, 256):
    matmul = 4 * d_head / SM_MATMUL_FLOPS_PER_CLOCK  # clocks per score on the tensor cores
    exp = 1 / SM_EX2_PER_CLOCK  # clocks per score on the special-function units
    print(f"d = {d_head:3}: exponentials are {exp / (matmul + exp):.0%} of the time when nothing overlaps")

# %% [markdown]
# **The rest**, rung by rung:
# - *Skipping fully masked tiles*: with 64 x 64 tiles a head of N = 4096 has 64 x 64 = 4096 tiles; count those
#   in which the causal mask leaves at least one visible pair (notebook 06's loop bounds), and remember that
#   the tiles on the diagonal still need the mask.
# - *Block shapes*: a K/V tile read from memory serves BLOCK_M query rows: per byte of K and V the tile does
#   BLOCK_M FLOPs (bf16). Compare with the ridge of the H200, matmul rate over bandwidth (printed below from
#   the hardware record's measured rates).
# - *Pipeline stages*: with one stage a program loads a tile and waits for it before its products can start;
#   with more, the next tile's loads are in flight while the tensor cores work.
# - *Autotuned*: the best of several launches (block shapes, warps, stages) for this shape, against the
#   hand-picked launch of the rung before it.
# - *Warp specialisation (forward, Gluon)*: warps with different jobs let one group's softmax run while
#   another's products do. Notebook 08c derives a ceiling of 1.5x at d = 128 for two groups taking turns.
# - *Tall resident blocks (backward)*: 128 rows stay on chip (K and V in the dK/dV kernel, Q and dO in the
#   dQ kernel), so each streamed tile serves twice the rows.
# - *dK/dV without spills (backward, Gluon)*: the Triton dK/dV kernel needs about 256 registers per thread at
#   d = 128 and spills to local memory; the Gluon one about 196 (notebook 08c, section 5). The dK/dV kernel
#   is about 60 % of the backward.
# - *Warp-specialised dQ (backward, Gluon)*: the dQ kernel's warps take jobs too: one warp streams K and V
#   while two warpgroups keep S, dP and dQ's products in flight behind the softmax. It reads D = rowsum(dO·O),
#   which the Triton dQ kernel computed as it went, from a pass of its own over O and dO.
# - *One pass (backward, Gluon)*: one kernel makes dK, dV and dQ, so S and dP are computed once, not twice:
#   5 tile products instead of 7, with dQ added into a float32 accumulator by TMA (notebook 08c, section 7).
# - *One pass, atomic dQ*: notebook 07, section 7 (this rung's gain is over the Gluon rungs before it).

# %%
if hw is not None:  # the ridge the block-shape rung is compared with
    ridge = hw["data"]["matmul_tflops"]["bfloat16"] * 1e12 / (hw["data"]["copy_gbps"] * 1e9)
    print(f"ridge from measured rates: {ridge:.0f} FLOP/B (bf16 matmul at {hw['data']['matmul_n']}³ over copy "
          f"bandwidth, {records.label(hw)}); the datasheet's: 206 FLOP/B")  # fmt: skip
    assert 128 < ridge < 206, "the bullet below: 128-row blocks stay under the measured ridge, below the datasheet's"

# %% [markdown]
# **Your predictions.** For each rung, how many times faster than the rung before it (1.0: no change; below
# 1.0: slower)? Type your estimate in place of each value, then run the cell. They are scored against the
# recorded H200 run at the end of this section.

# %%
from course_lib.exercises import predict

rung_guesses = {  # (pass, rung): your predicted gain over the rung before it
    ("fwd", "base-2 exponentials"): predict("forward: base-2 exponentials", 1.1, unit="x"),
    ("fwd", "skip fully masked tiles"): predict("forward: skip fully masked tiles", 1.9, unit="x"),
    ("fwd", "BLOCK_M 128 on 8 warps"): predict("forward: BLOCK_M 128 on 8 warps", 1.3, unit="x"),
    ("fwd", "3 pipeline stages"): predict("forward: 3 pipeline stages", 1.3, unit="x"),
    ("fwd", "autotuned (Triton)"): predict("forward: autotuned (Triton)", 1.05, unit="x"),
    ("fwd", "warp-specialised (Gluon, Hopper; course_lib)"): predict("forward: warp-specialised", 1.2, unit="x"),
    ("bwd", "base-2 exponentials"): predict("backward: base-2 exponentials", 1.05, unit="x"),
    ("bwd", "skip fully masked tiles"): predict("backward: skip fully masked tiles", 1.9, unit="x"),
    ("bwd", "tall resident blocks, 8 warps"): predict("backward: tall resident blocks", 1.3, unit="x"),
    ("bwd", "3 pipeline stages"): predict("backward: 3 pipeline stages", 1.2, unit="x"),
    ("bwd", "autotuned (Triton)"): predict("backward: autotuned (Triton)", 1.05, unit="x"),
    ("bwd", "dK/dV without spills (Gluon, Hopper)"): predict("backward: dK/dV, no spills", 1.1, unit="x"),
    ("bwd", "warp-specialised dQ (Gluon, Hopper)"): predict("backward: warp-specialised dQ", 1.1, unit="x"),
    ("bwd", "one pass (Gluon, Hopper; course_lib)"): predict("backward: one pass (Gluon)", 1.2, unit="x"),
    ("bwd", "one pass, atomic dQ"): predict("backward: one pass, atomic dQ", 0.4, unit="x"),
}

# %% [markdown]
# ### The course's predictions
#
# Written in `course_lib.bench` before the ladder was measured, with the reason for each:

# %%
for step in bench.LADDER:
    print(f"[{step.pass_}] {step.name} — predicted {step.predicted:4.2f}x")
    print(textwrap.fill(f"why: {step.reason}", 100, initial_indent="      ", subsequent_indent="        "))

# %% [markdown]
# Some of them in words:
# - **Base-2 exponentials.** Folding log2 e into the softmax scale saves one multiply per score. Small
#   (~1.06x): exponentials and friends are about a third of the time at d = 128, and this removes one of about
#   six operations there.
# - **Skipping fully masked tiles.** The tiles above the diagonal contribute nothing. The straightforward
#   kernel loads and masks them anyway; skipping them halves the work (2080 of 4096 tiles remain at N = 4096
#   with 64 x 64 tiles): ~1.9x.
# - **Block shapes.** Going from 64 to 128 rows doubles the FLOPs per byte of K and V (64 → 128 FLOP/B, still
#   under the ridge printed above; notebook 02 says why the measured and the datasheet's differ, and this
#   notebook uses the measured one, since that is what a real kernel can reach). The premise: every
#   program's K/V tiles come from HBM, so the FLOPs per HBM byte set the speed.
# - **Pipeline stages.** With `num_stages` > 1 the loads of the next K/V tile are issued while the tensor
#   cores work on the current one, hiding memory latency.
# - **Warp specialisation (Hopper).** In the Triton kernel every warp loads, multiplies and exponentiates
#   in turn, so the tensor cores idle during each softmax (about a third of a step at d = 128). The Gluon
#   kernel gives warps different jobs so that one group's softmax runs while another's products do
#   (FlashAttention-3). Predicted ~1.2x: the softmax hidden, less the synchronisation and the causal
#   diagonal's short tiles. How it works, its variants and its comparison with the Triton kernel across
#   shapes: the optional appendix, notebook 08c.
# - **The backward's work split.** The two-kernel backward computes dK, dV in one kernel and dQ in
#   another, which recomputes S and dP: 7 tile matmuls instead of 5. The atomic variant does one pass and
#   adds dQ with fp32 atomics instead: fewer FLOPs, more (atomic) memory traffic.

# %% [markdown]
# Optimisation must not change the answer. Every rung computes the same attention:

# %%
from course_lib.testing import assert_close_to_reference, reference_outputs

causal, scale = True, D**-0.5
q3, k3, v3, do3 = (torch.randn(2, N_KERNEL, D, device=DEVICE, dtype=DTYPE) for _ in range(4))
q64, k64, v64, do64 = (t.double() for t in (q3, k3, v3, do3))
o64, (dq64, dk64, dv64) = reference_outputs(q64, k64, v64, causal, grad_out=do64)
o_base, grads_base = reference_outputs(q3, k3, v3, causal, grad_out=do3)
o3, L3 = forward.forward(q3, k3, v3, causal, scale)
for step in bench.LADDER:
    what = f"ladder step '{step.name}' ({step.pass_}), N={N_KERNEL}, d={D}, {DTYPE}, causal"
    if step.pass_ == "fwd":
        o_step, _ = forward.forward(q3, k3, v3, causal, scale, config=step.config)
        assert_close_to_reference(o_step, o64, o_base, what)
    else:
        grads = backward.backward(
            do3, q3, k3, v3, o3, L3, causal, scale, config=step.config, dq_mode=step.dq_mode
        )
        for name, g, g64, g_base in zip(("dQ", "dK", "dV"), grads, (dq64, dk64, dv64), grads_base):
            assert_close_to_reference(g, g64, g_base, f"{what}: {name}")
print(f"all {len(bench.LADDER)} rungs agree with the float64 reference")

# %% [markdown]
# ### Predicted against measured, on the H200
#
# `make bench` measures the ladder (`course_lib.bench.ladder`) and records it. Above, the forward; below, the
# backward; grey, the prediction; orange, the measurement. Where they disagree, the model behind the
# prediction missed something — that is where to look with Nsight Compute.

# %% [markdown]
# One more prediction first: how many times faster than the straightforward forward (the first rung) is the
# fastest forward rung, measured? The product of your rung predictions is one estimate, the product of the
# course's another (Exercise 4); the rungs interact, so neither need be right. Type your estimate in place
# of the value.

# %%
ladder_guess = predict("fastest forward rung over the first", 3.0, unit="x")  # your prediction

# %%
ladder_rec = records.load_record("ladder")
if ladder_rec is None:
    print("No recorded ladder in assets/benchmarks/ yet: run `make bench` on a GPU to record one.")
else:
    print("Ladder", records.label(ladder_rec))
    for s in ladder_rec["data"]["steps"]:
        if s.get("status") == "ok":
            gain = "" if s.get("measured_gain") is None else f"measured {s['measured_gain']:.2f}x"
            tf = f"{s['tflops']:6.0f} TFLOP/s"
            print(f"[{s['pass_']}] {s['name']:34} {tf}  predicted {s['predicted_gain']:.2f}x  {gain}")
        else:
            print(f"[{s['pass_']}] {s['name']:34} not measured: {s.get('reason_failed')}")
    _ = bench.plot_ladder(ladder_rec)
    plt.show()
    fwd_ok = [s for s in ladder_rec["data"]["steps"] if s["pass_"] == "fwd" and s.get("status") == "ok"]
    _ = ladder_guess.score(max(s["tflops"] for s in fwd_ok) / fwd_ok[0]["tflops"])

# %% [markdown]
# Your rung predictions, each scored against the recorded gain (the course's prediction beside it):

# %%
if ladder_rec is not None:
    for s in ladder_rec["data"]["steps"]:
        guess = rung_guesses.get((s["pass_"], s["name"]))
        if guess is None or s.get("status") != "ok" or s.get("measured_gain") is None:
            continue
        print(f"[{s['pass_']}] the course predicted {s['predicted_gain']:.2f}x; ", end="")
        _ = guess.score(s["measured_gain"])

# %% [markdown]
# **Reading the misses in the recorded H200 run.**
# - *128-row blocks, then pipelining.* The block-shape prediction rested on an assumption worth naming:
#   that each program's K/V tiles come from HBM, so that FLOPs per HBM byte set the speed. The programs of
#   one head run side by side and read the same K and V (2 MiB at N = 4096, d = 128), which the H200's
#   60 MiB L2 holds: most of those re-reads hit the L2 — the re-reads Exercise 2's byte count lets the L2
#   absorb — so doubling the rows saved L2 traffic, not HBM traffic. And each prediction assumed the other
#   step was already there: without software pipelining (one stage), a program with a 128-row tile loads
#   each K/V tile and then waits for it with nothing else to do, so doubling the tile bought nothing; three
#   stages then paid more than predicted, because they hide exactly those waits. Two steps that interact
#   should be predicted together: their product is what to compare.
# - *Atomic dQ.* Predicted faster than the Triton two-kernel backward (5 tile products instead of 7), so a
#   little slower than the Gluon one pass before it; measured about two thirds of it: every K/V program
#   adds a BLOCK_M x d float32 tile into dQ at every step, and those read-modify-writes in L2 cost more than
#   the two products they save. The byte count the prediction left out is the atomics' traffic — notebook 07
#   measures the same trade-off across shapes. The adds are relaxed (notebook 07 says why); with the
#   default, ordered ones this rung ran at about half the speed it runs now (notes/attention.md).
# - *Autotuned.* Within a few per cent of 1.0x in the forward: the launch recorded for this shape (64 x 64
#   tiles, 4 warps) runs about as fast as the hand-picked rung (128 x 64, 8 warps); which of the two leads
#   has changed from one recorded run to the next. In the backward below 1.0x: here the recorded launch
#   choice loses to the hand-picked rung (not investigated further).
# - *dK/dV without spills.* Predicted 1.1x from the dK/dV kernel's share of the backward; the recorded runs
#   measured 1.05-1.10x, no better than predicted (within the few per cent by which runs differ). Long
#   non-causal rows gain more (notebook 08c's record: the whole backward at d = 128, N = 16k). At this
#   causal shape a block of keys sees 32 query blocks on average, so the program's fixed costs (loading K
#   and V, filling the pipeline, storing dK and dV) weigh more.
# - *Warp-specialised dQ.* Predicted 1.1x; recorded runs measured 1.06-1.12x: about as predicted, within
#   the few per cent by which runs differ. Timed by itself at this shape (`scripts/hopper_dq_probe.py`;
#   its figures are in `notes/attention.md`, not in a record), the kernel saves more than it saved inside
#   this backward. Where the rest went is not measured yet:
#   the pass for D (one more launch, a read of O and dO) and what the dK/dV kernel finds in the L2 after it
#   are the first suspects.
# - *One pass.* Predicted 1.2x; measured only a few per cent faster at this shape. Two likely reasons, not
#   yet measured apart: the two warp-specialised kernels already hid much of the products it saves behind
#   the softmax, and it adds costs of its own (both warpgroups must have stored their dS before either can
#   start dQ's product, and dQ goes out in float32 adds). The timings behind `hopper_onepass.choose` (its
#   docstring) put it 2-8 % ahead of the two kernels on causal rows of 2k-16k keys at d = 128.
#
# The figures these words read, from the records, and the words checked against them (a new record that
# tells another story stops this notebook until its words are rewritten):

# %%
def rung_gain(record, pass_, name):
    """A ladder rung's (measured, predicted) gain over the rung before it, printed; `name` up to " (..."."""
    step = next(s for s in record["data"]["steps"] if s["pass_"] == pass_ and s["name"].split(" (")[0] == name)
    print(f"[{pass_}] {name:24} predicted {step['predicted_gain']:.2f}x, measured {step['measured_gain']:.2f}x")
    return step["measured_gain"], step["predicted_gain"]


if ladder_rec is not None:
    tile, _ = rung_gain(ladder_rec, "fwd", "BLOCK_M 128 on 8 warps")
    stages, stages_predicted = rung_gain(ladder_rec, "fwd", "3 pipeline stages")
    atomic, _ = rung_gain(ladder_rec, "bwd", "one pass, atomic dQ")
    tuned_fwd, _ = rung_gain(ladder_rec, "fwd", "autotuned")
    tuned_bwd, _ = rung_gain(ladder_rec, "bwd", "autotuned")
    no_spills, no_spills_predicted = rung_gain(ladder_rec, "bwd", "dK/dV without spills")
    ws_dq, ws_dq_predicted = rung_gain(ladder_rec, "bwd", "warp-specialised dQ")
    one_pass, one_pass_predicted = rung_gain(ladder_rec, "bwd", "one pass")
    assert tile < 1.05 and stages > stages_predicted, "128-row blocks bought nothing; 3 stages beat the prediction"
    assert atomic < 0.8, "atomic dQ measured slower"
    assert 0.95 < tuned_fwd < 1.1 and tuned_bwd < 1.0, "autotuned: within a few % of 1.0x forward, below 1.0x backward"
    assert no_spills < 1.05 * no_spills_predicted, "dK/dV without spills: no better than predicted, within noise"
    assert 1.0 < ws_dq < 1.05 * ws_dq_predicted, "warp-specialised dQ: faster, about as predicted"
    assert 0.98 < one_pass < 1.1 < one_pass_predicted, "one pass: a few per cent at most, well under the prediction"
    hb_rec = records.load_record("hopper_backward")
    if hb_rec is not None:
        cell = [r for r in hb_rec["data"]["results"] if (r["d"], r["N"], r["causal"]) == (128, 16384, False)]
        ms = {r["kernel"]: r["ms"] for r in cell}
        whole = ms["Triton dK/dV"] / ms["as chosen"]
        print(f"notebook 08c's record, d = 128, N = 16k, not causal: the backward {whole:.2f}x faster without spills")
        assert whole > no_spills, "long non-causal rows gain more than this causal cell"

# %% [markdown]
# ## 4. course_lib against PyTorch's attention backends
#
# `scaled_dot_product_attention` (SDPA) dispatches to one of several kernels; `torch.nn.attention.sdpa_kernel`
# forces one: `FLASH_ATTENTION` (FlashAttention-2), `EFFICIENT_ATTENTION` (xFormers' memory-efficient
# kernel), `CUDNN_ATTENTION` (NVIDIA's cuDNN; on Hopper the default choice for bf16). A backend that
# cannot take a shape refuses it ("No available kernel"); the benchmark records that as unsupported.
# `make bench` measures all of them, course_lib's kernels, and standard attention (eager and
# `torch.compile`, capped where its N x N scores would not fit) on the papers' shapes. Its record:

# %%
att_rec = records.load_record("attention")
if att_rec is None:
    print("No recorded attention benchmark in assets/benchmarks/ yet: run `make bench` on a GPU.")
else:
    print("Attention benchmark", records.label(att_rec))
    _ = bench.plot_tflops(att_rec, "fwd")
    plt.show()

# %%
if att_rec is not None:
    _ = bench.plot_tflops(att_rec, "fwd_bwd")
    plt.show()

# %% [markdown]
# Memory tells the other half of the story: standard attention keeps N x N matrices per (batch, head), so
# its peak grows with N (at a fixed number of tokens); the fused kernels stay at what they must hold:
# inputs, outputs and gradients.

# %%
if att_rec is not None:
    _ = bench.plot_memory(att_rec)
    plt.show()

# %% [markdown]
# The attention part of `make bench` ends with this table: course_lib's TFLOP/s over SDPA's, per cell, with
# the minimum and the geometric mean per column (the right average for ratios: a 2x and a 0.5x cancel out),
# and the targets the kernels are held to.

# %%
if att_rec is not None:
    print(bench.format_report(att_rec["data"]))

# %% [markdown]
# **Reading the comparison.** Against FlashAttention-2 (SDPA's FLASH_ATTENTION backend) course_lib's
# kernels are ahead in every cell of the recorded run. Against cuDNN, PyTorch's default on Hopper, the
# forward is level or ahead on long sequences and trails on short ones, causal or not, where each program's
# tile has few K/V blocks to amortise its start and end. The forward+backward trails cuDNN. At d = 64, below
# 4096 tokens, the backward is notebook 07's Triton dQ kernel, where every warp does everything in turn, and a
# warp-specialised Gluon dK/dV kernel after FlashAttention-3 on its tile of 128 query rows (notebook 08c,
# section 5); from 4096 tokens one warp-specialised Gluon kernel makes dQ, dK and dV in one pass (section 7
# there). At d = 128 both backward kernels are warp-specialised Gluon kernels (the dK/dV kernel, which unlike
# the Triton one does not spill registers there; the dQ kernel with a producer warp), and from 2048 causal
# tokens (8192 without a mask) the one pass. Every one of them still trails cuDNN's backward.
#
# cuDNN's lead over a Triton kernel comes from overlapping the softmax with the matrix products, which
# needs warps with different jobs: course_lib's forward does that on Hopper with a Gluon kernel wherever
# it measured faster (`hopper.choose`). Notebook 08c (optional) explains that kernel and compares it with
# the Triton one; `notes/attention.md` records each attempt and the number that decided it.
#
# **Why notebook 06's comparison may disagree with this one.** Notebook 06 ranks its fixed-config kernel,
# `course_lib.flash_attention` and SDPA at d = 64, and re-records that comparison each time it runs on a
# GPU; this record comes from `make bench`. The two need not rank the kernels alike, because they are not
# measured alike:
# - *Possibly different kernels.* `course_lib.flash_attention` runs what `hopper.choose` picks for the
#   shape: on Hopper the warp-specialised Gluon forward wherever it measured faster, otherwise the Triton
#   kernel. A record taken before the Gluon forward existed (each record prints its date and versions)
#   timed the autotuned Triton kernel under that name.
# - *Different processes.* Each figure is a median within one process. Between processes a GPU's clocks and
#   temperature (and a launch choice tuned again with `COURSE_AUTOTUNE=1`, itself a timing, and a noisy one
#   when the gap between configs is a few percent) move the figures by a few percent, often the size of the
#   gaps notebook 06 shows.
# - *Different call paths.* Notebook 06 times `flash_attention` (input checks and a launch lookup; no
#   autograd node, since nothing there needs a gradient) against its own direct launch; at N = 1k a forward
#   takes a fraction of a millisecond, so tens of microseconds of Python per call are visible.
# Compare figures only within one record, where one process measured every provider on the same inputs.
# Within it, the two columns the targets read (course_lib against SDPA's default) come from timings taken in
# turn (the drift trap of section 1): each cell's entries keep their passes (`ms_passes`) beside the median.

# %%
def ratios(rows, column, n=None, d=None):
    """The measured ratios of one column of `bench.ratio_rows`, at one length n and head dim d if given."""
    return [r[column] for r in rows if r[column] is not None and n in (None, r["N"]) and d in (None, r["d"])]


if att_rec is not None:  # the words of this section, checked against the records they read
    rows = bench.ratio_rows(att_rec["data"])
    short, long = min(r["N"] for r in rows), max(r["N"] for r in rows)
    flash = ratios(rows, "fwd/sdpa_flash") + ratios(rows, "fwd_bwd/sdpa_flash")
    assert min(flash) > 1, "ahead of FlashAttention-2 everywhere"
    assert max(ratios(rows, "fwd/sdpa_default", n=short)) < 1, "the forward trails cuDNN on short sequences"
    assert min(ratios(rows, "fwd/sdpa_default", n=long)) > 0.95, "level or ahead on long ones"
    assert max(ratios(rows, "fwd_bwd/sdpa_default")) < 1, "the forward+backward trails cuDNN"
    at_64 = ratios(rows, "fwd/sdpa_default", d=64)
    assert min(at_64) < 1 < max(at_64), "at d = 64 level with SDPA: behind on some cells, ahead on others"
    print("the words above hold for the records")

# %% [markdown]
# ### Live, on this machine
#
# On a GPU: one cell of the grid, now. On a CPU: the CPU's own attention kernels (standard attention and
# SDPA's CPU kernel), timed at small sizes — CPU figures, not GPU ones, and labelled as such. How many times
# faster than standard attention is SDPA's default here? Type your estimate in place of the value first.

# %%
live_guess = predict("SDPA over standard attention, on this machine", 3.0, unit="x")  # your prediction

# %%
q, k, v = (torch.randn(B, H, N, D, device=DEVICE, dtype=DTYPE) for _ in range(3))
live = {"standard attention (eager)": lambda: attention(q, k, v, causal=True)}
live["SDPA default"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
if course_lib.ON_GPU:
    live["course_lib"] = lambda: course_lib.flash_attention(q, k, v, causal=True)
flop = timing.attention_flops(B, H, N, N, D, causal=True)
print(f"live on {course_lib.RUNTIME.describe()}, (B, H, N, d) = {(B, H, N, D)}, causal, {DTYPE}:")
live_ms = {}
for name, fn in live.items():
    live_ms[name] = ms = timing.benchmark(fn)
    print(f"  {name:28} {ms:9.3f} ms  {flop / (ms * 1e-3) / 1e12:9.3g} TFLOP/s")
_ = live_guess.score(live_ms["standard attention (eager)"] / live_ms["SDPA default"])

# %% [markdown]
# ## 5. Mixed precision and memory
#
# ### 5.1 What autocast runs in which dtype
#
# Training keeps weights in fp32 and runs most matmuls in bf16 (or fp16) through `torch.autocast`: inside
# the context, each operation is cast according to a list, matmuls and convolutions to the low precision,
# reductions and losses to fp32 where rounding would hurt. The lists differ between devices (CUDA keeps
# softmax in fp32, for example; the CPU's list is shorter). The inputs here are fp32; the dtypes printed are
# what autocast chose on this device:

# %%
amp_dtype = torch.bfloat16
x32, w32 = torch.randn(64, 64, device=DEVICE), torch.randn(64, 64, device=DEVICE)
with torch.autocast(device_type=DEVICE.type, dtype=amp_dtype):
    ops = {
        "x @ w": x32 @ w32,
        "softmax(x @ w)": torch.softmax(x32 @ w32, dim=-1),
        "layer_norm(x)": F.layer_norm(x32, (64,)),
        "(x @ w).sum()": (x32 @ w32).sum(),
        "x + w": x32 + w32,
        "SDPA(x, x, x)": F.scaled_dot_product_attention(x32[None], x32[None], x32[None]),
    }
for name, out in ops.items():
    print(f"  {name:16} -> {out.dtype}")
assert ops["x @ w"].dtype == amp_dtype  # matmuls always go to the low precision

# %% [markdown]
# ### 5.2 Accumulating in fp16 or fp32
#
# A matmul's inputs can be bf16 or fp16 because each product is exact enough; the **sum** of thousands of
# products is not. Tensor cores multiply in low precision and accumulate in fp32, and every kernel of the
# course keeps its accumulators (`acc`, m, l) in fp32. Here is why: a dot product of length K computed
# in chunks of 64 (as a kernel's K loop does), the running sum kept in fp16 or in fp32, against float64.

# %%
K_LEN = 16384
a16, b16 = (torch.rand(K_LEN, dtype=torch.float64).to(torch.float16) for _ in range(2))
exact = (a16.double() * b16.double()).sum().item()
errors = {}
for acc_dtype in (torch.float16, torch.float32):
    acc = torch.zeros((), dtype=acc_dtype)
    for c in range(0, K_LEN, 64):
        acc = acc + (a16[c : c + 64].float() * b16[c : c + 64].float()).sum().to(acc_dtype)
    errors[str(acc_dtype)] = abs(acc.item() - exact) / exact
    print(f"accumulator {str(acc_dtype):14}: {acc.item():12.4f}, relative error {errors[str(acc_dtype)]:.1e}")
print(f"exact (float64): {exact:.4f}; fp16 keeps 11 significant bits: its spacing is 2 between 2048 and 4096")
print("and 4 above, so once the running sum passes 2048 (about half way) every chunk's contribution (about 16)")
print("is rounded to a multiple of 2 when it is added (to a multiple of 4 for any chunk added past 4096)")
assert errors["torch.float32"] < errors["torch.float16"]

# %% [markdown]
# On a GPU, cuBLAS may use reduced-precision accumulation for fp16 matmuls when
# `torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction` is True; bf16 attention kernels
# (SDPA's, course_lib's) always accumulate in fp32.
#
# ### 5.3 Where the memory goes: the allocator's history
#
# `torch.cuda.max_memory_allocated` gives one number; the allocator can also record *every* allocation with
# the Python stack that made it: `torch.cuda.memory._record_memory_history()`, then
# `torch.cuda.memory._dump_snapshot(path)`, and drag the file onto https://pytorch.org/memory_viz to see
# each tensor's lifetime (an underscore API: its arguments may change between PyTorch versions). On a CPU
# there is no such allocator; `torch.profiler`'s `profile_memory=True` gives the bytes each operator
# allocated instead. Standard attention's forward and backward at this notebook's shape:

# %%
qm, km, vm = (torch.randn(B, H, N, D, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(3))
if course_lib.ON_GPU:
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    attention(qm, km, vm, causal=True).sum().backward()
    torch.cuda.synchronize()
    snapshot = Path(tempfile.gettempdir()) / "course_08_memory_snapshot.pickle"
    torch.cuda.memory._dump_snapshot(str(snapshot))
    torch.cuda.memory._record_memory_history(enabled=None)
    peak_mb = (torch.cuda.max_memory_allocated() - before) / 1e6
    print(f"peak above the inputs: {peak_mb:.0f} MB; snapshot in {snapshot} (open it at pytorch.org/memory_viz)")
else:
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as mprof:
        attention(qm, km, vm, causal=True).sum().backward()
    events = sorted(mprof.key_averages(), key=lambda e: e.self_cpu_memory_usage, reverse=True)
    print(f"{'operator':40} {'calls':>6} {'MB allocated':>13}")
    for e in events[:8]:
        print(f"{e.key[:40]:40} {e.count:6d} {e.self_cpu_memory_usage / 1e6:13.2f}")
nn_mb = B * H * N * N * torch.finfo(DTYPE).bits / 8 / 1e6
print(f"one N x N matrix at this shape: {nn_mb:.1f} MB (B*H*N*N elements)")

# %% [markdown]
# Look for the operators whose allocations are multiples of the last line's figure: those are the N × N
# matrices (scores, probabilities, their gradients). course_lib's kernels allocate none of them.
#
# ## 6. Exercises
#
# **Exercise 1 — TFLOP/s from a time.** Write `tflops(ms, b, h, n, d, causal, mode)`: the attention TFLOP/s
# of a call that took `ms` milliseconds, by the papers' convention (do not call `attention_flops`).

# %%
def tflops(ms, b, h, n, d, causal, mode):
    ### BEGIN SOLUTION
    flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0) * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]
    return flops / (ms * 1e-3) / 1e12
    ### END SOLUTION


# %% tags=["check"]
from course_lib.exercises import check

fwd_flops = 4 * 4 * 16 * 4096**2 * 128
check("TFLOP/s (forward)", lambda: tflops(2.0, 4, 16, 4096, 128, False, "fwd"), fwd_flops / 2e-3 / 1e12)
check(
    "TFLOP/s (causal fwd+bwd)",
    lambda: tflops(5.0, 1, 32, 16384, 64, True, "fwd_bwd"),
    timing.attention_flops(1, 32, 16384, 16384, 64, causal=True, mode="fwd_bwd") / 5e-3 / 1e12,
)
check(
    "TFLOP/s (backward)",
    lambda: tflops(3.0, 2, 8, 2048, 64, False, "bwd"),
    timing.attention_flops(2, 8, 2048, 2048, 64, causal=False, mode="bwd") / 3e-3 / 1e12,
)

# %% [markdown]
# **Exercise 2 — predict a ratio from bytes.** Per (batch, head), count the elements that standard attention
# moves through memory in its forward: it reads Q and K (N·d each), writes S (N²), reads S and writes P
# (the softmax: N² each), reads P (N²) and V (N·d), writes O (N·d). A fused kernel reads Q, K, V and
# writes O once (4·N·d, ignoring re-reads that the L2 absorbs). Write `bytes_ratio(n, d)`: standard over
# fused. For a memory-bound computation, that is the speed-up to expect.

# %%
def bytes_ratio(n, d):
    ### BEGIN SOLUTION
    standard = 4 * n * d + 4 * n * n
    fused = 4 * n * d
    return standard / fused
    ### END SOLUTION


# %% tags=["check"]
check("bytes ratio", lambda: bytes_ratio(4096, 128), 1 + 4096 / 128)
check("bytes ratio", lambda: bytes_ratio(1024, 64), 1 + 1024 / 64)
check("bytes ratio", lambda: bytes_ratio(1000, 96), 1 + 1000 / 96)

# %% [markdown]
# At N = 4096, d = 128 that is 33x fewer bytes by this count. Two corrections turn it into a prediction of
# time. First, the fused kernel is not memory-bound: it does $4N^2d$ FLOPs on $4Nd$ elements, an intensity of
# N/2 = 2048 FLOP/byte in bf16, far right of the ridge, so its time is set by its FLOPs. Second, standard
# attention moves far more than 4 N² bf16 elements. The course's `reference.attention` (the `eager` provider
# of `make bench`) computes its softmax in float32, one PyTorch operation at a time, and each operation is a
# pass over the N x N matrix through HBM (B·H·N² elements do not fit in any cache). In bytes per score, for
# bf16 inputs:
#
# | step of `reference.attention` | reads | writes |
# | --- | --- | --- |
# | S = Q Kᵀ (a bf16 matmul) | | 2 |
# | `.to(float32)` | 2 | 4 |
# | `* scale` | 4 | 4 |
# | causal only: `masked_fill` (its mask, one N x N of bools shared by every head, stays in the L2) | 4 | 4 |
# | `logsumexp`: `amax`, `S − max`, `exp_` in place, `sum` (PyTorch's implementation) | 4 + 4 + 4 + 4 | 4 + 4 |
# | `S − L` | 4 | 4 |
# | `exp` | 4 | 4 |
# | `P.to(bfloat16)` | 4 | 2 |
# | P V (a bf16 matmul) | 2 | |
#
# That is 64 bytes per score (72 causal) where Exercise 2 counted 8: about ten passes, most in float32. So
# predict standard attention's time as those bytes over the copy bandwidth plus its two matmuls at the matmul
# rate, the fused kernel's as its FLOPs (half of them causal) at the matmul rate, both rates from the hardware
# record, and compare with the recorded forward times of the two at this shape:

# %%
PASS_BYTES = {"S = Q K^T": 2, ".to(float32)": 6, "* scale": 8, "logsumexp": 24, "S - L": 8, "exp": 8,
              "P.to(bfloat16)": 6, "P V": 2}  # bytes per score, from the table  # fmt: skip
CAUSAL_PASS_BYTES = {"masked_fill": 8}
n_, d_ = 4096, 128
if hw is None or att_rec is None:
    print("No hardware or attention record in assets/benchmarks/ yet (run `make bench` on a GPU): nothing to "
          "divide by or compare with.")  # fmt: skip
else:
    matmul_tflops, copy_gbps = hw["data"]["matmul_tflops"]["bfloat16"], hw["data"]["copy_gbps"]
    matmuls_us = 4 * n_ * n_ * d_ / (matmul_tflops * 1e12) * 1e6  # Q K^T and P V, per (batch, head)
    labels = dict.fromkeys((records.label(hw), records.label(att_rec)))  # one label when both runs share it
    print(f"per (batch, head), N = {n_}, d = {d_}, bf16 ({'; '.join(labels)}):")
    for causal_ in (False, True):
        per_score = sum(PASS_BYTES.values()) + causal_ * sum(CAUSAL_PASS_BYTES.values())
        standard_us = per_score * n_ * n_ / (copy_gbps * 1e9) * 1e6 + matmuls_us
        fused_us = matmuls_us / (2 if causal_ else 1)  # a fused causal kernel skips the masked half
        ms = {r["provider"]: r["ms"] for r in att_rec["data"]["results"] if r["mode"] == "fwd"
              and (r["N"], r["d"], r["causal"]) == (n_, d_, causal_) and r["status"] == "ok"}  # fmt: skip
        measured = ms["eager"] / ms["course_lib"]
        print(f"  causal={causal_!s:5}: {per_score} B per score; standard {standard_us:.0f} us, fused "
              f"{fused_us:.1f} us: predicted {standard_us / fused_us:.0f}x, recorded {measured:.0f}x "
              "(eager over course_lib)")  # fmt: skip
        assert 0.8 < measured / (standard_us / fused_us) < 1.5, "the prediction from the real passes holds"

# %% [markdown]
#
# **Exercise 3 — summarise ratios.** Write `min_and_geomean(ratios)`: the minimum and the geometric mean
# of a list of ratios, skipping `None` (a cell without a figure). Why the geometric mean: the arithmetic
# mean of 2x and 0.5x is 1.25x, although one cell gained what the other lost.

# %%
def min_and_geomean(ratios):
    ### BEGIN SOLUTION
    vals = [r for r in ratios if r is not None]
    return min(vals), math.exp(sum(math.log(r) for r in vals) / len(vals))
    ### END SOLUTION


# %% tags=["check"]
example = [1.31, 0.94, None, 1.12, 2.0, 0.5]
check("min and geomean", lambda: min_and_geomean(example), bench.summarise(example))
check("geomean of 2x and 0.5x", lambda: min_and_geomean([2.0, 0.5])[1], 1.0)

# %% [markdown]
# When a record exists, the same function summarises it (the learner-independent version is
# `bench.summarise`):

# %%
if att_rec is not None:
    col = "fwd/sdpa_flash"
    lo, geo = bench.summarise(r[col] for r in bench.ratio_rows(att_rec["data"]))
    if lo is not None:
        print(f"course_lib forward / SDPA FLASH_ATTENTION: min {lo:.2f}x, geomean {geo:.2f}x")
        print(records.label(att_rec))

# %% [markdown]
# **Exercise 4 — the ladder's total.** If every prediction of the forward ladder were exact, how much faster
# would the tuned forward be than the straightforward one? Write `predicted_total(steps)` for a list of
# `bench.Step` of one pass.

# %%
def predicted_total(steps):
    ### BEGIN SOLUTION
    return math.prod(s.predicted for s in steps)
    ### END SOLUTION


# %% tags=["check"]
fwd_steps = [s for s in bench.LADDER if s.pass_ == "fwd"]
check("predicted ladder total", lambda: predicted_total(fwd_steps), math.prod(s.predicted for s in fwd_steps))

# %% [markdown]
# Compare with the recorded ladder: the ratio of the last forward rung's TFLOP/s to the first's.
#
# ## Summary
# - A GPU runs asynchronously: synchronise (or use events) before reading a clock; warm up first; report
#   medians; flush the L2 or you time the cache, and flush it with a read, or every kernel pays for writing
#   the flush's dirty lines back. `course_lib.perf.timing.benchmark` does all of it (`do_bench` all but the
#   last), and falls back to a wall clock on the CPU, where interpreted kernels' times mean nothing. On a CPU
#   `torch.utils.benchmark` runs one thread unless given `num_threads`: say how many a CPU timing used.
# - TFLOP/s by the papers' convention: 4·B·H·N²·d for a forward, halved when causal, x2.5 for the backward.
#   A measured matmul rate belongs to its run and its shape: it is not a ceiling.
# - Count the bytes a computation really moves: PyTorch's standard attention makes about ten passes over
#   N x N, most in float32 (64 bytes per score, 72 causal, not 8), and predicted from those its gap to the
#   fused kernel at N = 4096, d = 128 is about 21x (47x causal), against 23x (49x) recorded.
# - `torch.profiler` shows where time goes per operator and kernel; Nsight Systems shows the timeline,
#   Nsight Compute one kernel's hardware counters.
# - Optimise one step at a time, predict each step from bytes and FLOPs, measure, and explain the gap by
#   naming the assumption it broke (K/V re-reads from HBM, when the L2 served them; one rung at a time, when
#   two interact).
# - Past a point the limit is not bytes or FLOPs but overlap: on Hopper the forward's last step gives warps
#   different jobs, which Triton cannot express and Gluon can (the optional appendix, notebook 08c).
# - `make bench` records course_lib against every SDPA backend and standard attention, with plots and a
#   ratio table; the notebooks show those records, labelled, wherever there is no GPU.
#
# ## More exercises
# 5. On a GPU, profile `course_lib.flash_attention` forward + backward with `torch.profiler` and find its
#    kernels in the table: which one takes the longest, and is that what the FLOP count predicts?
# 6. Run `ncu` on the forward kernel at the ladder's shape with `config=bench.FWD0` and with `config=None`;
#    compare the achieved occupancy and the "Compute (SM) Throughput".
# 7. Add a rung to the ladder (for example BLOCK_N = 128 in the forward): write its predicted gain and
#    the reason first, then measure it with `bench.ladder(steps=...)`.
# 8. Notebook 08c (optional) takes the ladder's last forward rung apart: the Gluon kernel's variants
#    against the Triton kernel, and three exercises on why and where it wins.
