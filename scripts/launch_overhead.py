"""Is a small attention call bound by the GPU or by the Python that launches it? (GPU only)

For one shape, runs forward+backward back to back without synchronising and compares the wall time
per call (what a training loop sees) with the GPU time of the kernels it launched (torch.profiler).
Wall time well above kernel time means the CPU cannot launch work as fast as the GPU finishes it.

    COURSE_DEVICE=cuda python3 scripts/launch_overhead.py [--profile] [--after-compile] [--breakdown] [--hopper]
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("COURSE_DEVICE", "cuda")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import course_lib  # noqa: E402
from course_lib.attention import FlashAttentionTriton, attention_backward, attention_forward  # noqa: E402
from course_lib.perf.profiling import print_host_profile  # noqa: E402
from course_lib.runtime import sm_count, tl, triton  # noqa: E402


def per_call(fn, iters=50):
    """(wall ms per call with one sync per `iters` calls, GPU kernel ms per call, CPU ms to issue one call)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    issue = (time.perf_counter() - t0) / iters * 1e3
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / iters * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    gpu = sum(e.self_device_time_total for e in prof.key_averages()) / iters / 1e3
    return wall, gpu, issue


def providers(q, k, v, do):
    """fwd+bwd callables of course_lib and SDPA's FLASH_ATTENTION backend, causal."""

    def ours():
        return torch.autograd.grad(course_lib.flash_attention(q, k, v, causal=True), (q, k, v), do)

    def sdpa_flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do)

    return {"course_lib": ours, "sdpa_flash": sdpa_flash}


def table(title):
    print(f"\n{title}")
    print(f"{'provider':<12} {'N':>6} {'d':>4} causal  wall/call  kernels/call  CPU issue/call (ms)")
    for n, d in ((1024, 128), (1024, 64), (4096, 128)):
        b, h = 16384 // n, 2048 // d
        q, k, v = (
            torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
        )
        for name, fn in providers(q, k, v, torch.randn_like(q)).items():
            wall, gpu, issue = per_call(fn)
            print(f"{name:<12} {n:>6} {d:>4} {'yes':>6}  {wall:9.3f}  {gpu:12.3f}  {issue:9.3f}")


def profile_issue(n=1024, d=128, calls=300):
    """Where the CPU time of issuing one course_lib forward+backward goes (cProfile, cumulative)."""
    b, h = 16384 // n, 2048 // d
    q, k, v = (
        torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    fn = providers(q, k, v, torch.randn_like(q))["course_lib"]
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    title = f"\ncProfile of {calls} course_lib forward+backward calls (N={n}, d={d}, causal), by own time:"
    print_host_profile(fn, calls, title, 18)


@triton.jit
def noop(X, n, BLOCK: tl.constexpr):
    pass


@triton.jit
def noop40(X0, X1, X2, X3, X4, X5, X6, X7, X8, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4,
           b5, b6, b7, b8, b9, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, BLOCK: tl.constexpr):  # fmt: skip
    pass


def per_call_us(fn, calls=300):
    """CPU microseconds to issue one fn(), (median, mean, 95th percentile) over `calls` calls."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        ts.append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    ts.sort()
    return ts[len(ts) // 2], sum(ts) / len(ts), ts[int(len(ts) * 0.95)]


def issue_us(fn):
    """Mean CPU microseconds to issue one fn() (small shapes: the GPU keeps up, nothing blocks)."""
    return per_call_us(fn)[1]


class TimedBackward(FlashAttentionTriton):
    """course_lib's autograd Function, with the wall time of each backward call appended to `spent`
    (seconds): what the backward costs inside the autograd engine's thread."""

    spent: list[float] = []

    @staticmethod
    def backward(ctx, do):
        t0 = time.perf_counter()
        grads = FlashAttentionTriton.backward(ctx, do)
        TimedBackward.spent.append(time.perf_counter() - t0)
        return grads


class EmptyBackward(FlashAttentionTriton):
    """course_lib's forward with a backward that launches nothing (returns dO three times: q, k and v
    must have one shape), to see what the autograd machinery alone costs."""

    @staticmethod
    def backward(ctx, do):
        return do, do, do, None, None


def breakdown(d=128):
    """CPU cost of each layer of one course_lib forward+backward, on a small (1, 16, 1024, d) shape."""
    q, k, v = (
        torch.randn(1, 16, 1024, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    do = torch.randn_like(q)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    o, lse = attention_forward(qd, kd, vd, True)
    ints = list(range(16, 16 * 31, 16))
    rows = {
        "torch.empty (1, 16, 1024, d) bf16": lambda: torch.empty(q.shape, dtype=q.dtype, device=q.device),
        "triton launch, 1 tensor + 1 int": lambda: noop[(64,)](qd, 1024, BLOCK=64),
        "triton launch, 9 tensors + 30 ints": lambda: noop40[(64,)](
            qd, kd, vd, o, do, qd, kd, vd, o, *ints, BLOCK=64
        ),
        "attention_forward (checks, allocs, 1 launch)": lambda: attention_forward(qd, kd, vd, True),
        "attention_backward (checks, allocs, 2 launches)": lambda: attention_backward(
            do, qd, kd, vd, o, lse, True
        ),
        "flash_attention forward, no_grad": lambda: _no_grad(course_lib.flash_attention, q, k, v),
        "flash_attention forward + autograd.grad": providers(q, k, v, do)["course_lib"],
        "identity autograd.Function + autograd.grad": lambda: torch.autograd.grad(
            _Identity.apply(q), (q,), do
        ),
        "SDPA FLASH forward + autograd.grad": providers(q, k, v, do)["sdpa_flash"],
    }
    o_graph = course_lib.flash_attention(q, k, v, causal=True)
    rows["flash_attention forward, with autograd graph"] = lambda: course_lib.flash_attention(
        q, k, v, causal=True
    )
    rows["autograd.grad of a kept forward"] = lambda: torch.autograd.grad(
        o_graph, (q, k, v), do, retain_graph=True
    )
    print(f"\nCPU time to issue (us per call), shape (1, 16, 1024, {d}), causal:")
    for name, fn in rows.items():
        print(f"  {name:<48} {issue_us(fn):7.1f}")
    import gc

    fwd_bwd = rows["flash_attention forward + autograd.grad"]
    gc.disable()
    print(f"  {'the same, garbage collector off':<48} {issue_us(fwd_bwd):7.1f}")
    gc.enable()
    retained = lambda: torch.autograd.grad(  # noqa: E731
        course_lib.flash_attention(q, k, v, causal=True), (q, k, v), do, retain_graph=True
    )
    print(f"  {'the same, retain_graph=True':<48} {issue_us(retained):7.1f}")
    print(f"  {'the same, again':<48} {issue_us(fwd_bwd):7.1f}")
    sdpa = rows["SDPA FLASH forward + autograd.grad"]
    print(f"  {'SDPA FLASH forward + autograd.grad, again':<48} {issue_us(sdpa):7.1f}")
    # The same backward, timed inside the autograd engine's thread.
    o_timed = TimedBackward.apply(q, k, v, True)
    total = issue_us(lambda: torch.autograd.grad(o_timed, (q, k, v), do, retain_graph=True))
    inside = sum(TimedBackward.spent[-300:]) / 300 * 1e6
    print(f"  autograd.grad {total:.1f} us, of which the backward {inside:.1f} us (in the engine's thread)")


def stalls():
    """Per-call CPU time of course_lib's forward+backward at the full N = 1k cell: median vs mean (a mean
    far above the median means occasional long stalls), and with the launches or the backward removed."""

    def show(name, fn):
        med, mean, p95 = per_call_us(fn)
        print(f"  {name:<40} {med:8.1f} {mean:8.1f} {p95:8.1f}")

    for b, d in ((16, 128), (1, 128)):
        q, k, v = (
            torch.randn(b, 16, 1024, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)
        )
        fns = providers(q, k, v, torch.randn_like(q))
        print(f"\nper-call CPU us (median / mean / p95), ({b}, 16, 1024, {d}) causal:")
        for name in ("course_lib", "sdpa_flash"):
            show(name, fns[name])
        with torch.autograd.set_multithreading_enabled(
            False
        ):  # the backward on this thread, not the engine's
            show("course_lib, backward on the calling thread", fns["course_lib"])
            show("sdpa_flash, backward on the calling thread", fns["sdpa_flash"])
        do = torch.randn_like(q)
        show(
            "course_lib, backward launches nothing",
            lambda q=q, k=k, v=v, do=do: torch.autograd.grad(
                EmptyBackward.apply(q, k, v, True), (q, k, v), do
            ),
        )
        with torch.no_grad():
            show(
                "course_lib forward only, no_grad",
                lambda q=q, k=k, v=v: course_lib.flash_attention(q, k, v, True),
            )


def _no_grad(f, *args):
    with torch.no_grad():
        return f(*args, causal=True)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def hopper_breakdown(d=128, n=1024, calls=300):
    """CPU cost of each layer of one forward with the warp-specialised Gluon kernel (Hopper only), on
    (1, 16, n, d), non-causal, and the Python functions that take it (cProfile, own time)."""
    from course_lib.attention import hopper

    q, k, v = (torch.randn(1, 16, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o, lse = torch.empty_like(q), torch.empty(q.shape[:-1], device="cuda")
    variant, scale = hopper.choose(d, False, n, n), d**-0.5
    block_n, stages, consumers, pingpong, persistent = variant
    descs = (
        hopper.descriptor(q, hopper.QUERY_ROWS),
        hopper.descriptor(k, block_n),
        hopper.descriptor(v, block_n),
    )
    tiles = triton.cdiv(n, hopper.QUERY_ROWS * consumers) * 16
    grid = (min(tiles, sm_count(q.device.index)) if persistent else tiles,)

    def launch_only():  # B * H = 16 programs' heads, H = 16, GROUP = 1 (as many K/V heads as query heads)
        hopper.fwd_ws_kernel[grid](
            *descs, o, lse, scale * hopper.LOG2E,
            o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
            16, 16, 1, n, n, 0, CAUSAL=False, HEAD_DIM=d, BLOCK_N=block_n, NUM_STAGES=stages,
            NUM_CONSUMERS=consumers, PINGPONG=pingpong, PERSISTENT=persistent, **hopper.launch_options(consumers),
        )  # fmt: skip

    rows = {
        "three TMA descriptors (Python objects)": lambda: [hopper.descriptor(t, 128) for t in (q, k, v)],
        "Gluon launch, descriptors built once": launch_only,
        "hopper.forward (descriptors + launch)": lambda: hopper.forward(
            q, k, v, o, lse, False, scale, variant
        ),
        "attention_forward, Gluon kernel": lambda: attention_forward(q, k, v, False, scale),
        "attention_forward, Triton kernel": lambda: attention_forward(
            q, k, v, False, scale, config={"hopper": False}
        ),
    }
    print(
        f"\nCPU time to issue (us per call: median, mean, 95th percentile), shape (1, 16, {n}, {d}), {variant}:"
    )
    for name, fn in rows.items():
        print(f"  {name:<42} " + " ".join(f"{x:7.1f}" for x in per_call_us(fn)))
    fn = rows["hopper.forward (descriptors + launch)"]
    print_host_profile(fn, calls, f"\ncProfile of {calls} hopper.forward calls, by own time:", 14)


def main():
    assert course_lib.ON_GPU
    if "--hopper" in sys.argv:
        hopper_breakdown()
        return
    if "--breakdown" in sys.argv:
        breakdown()
        return
    if "--stalls" in sys.argv:
        stalls()
        return
    table("fresh process")
    if "--profile" in sys.argv:
        profile_issue()
    if "--after-compile" in sys.argv:
        # Does a process that has used torch.compile (as `make bench` has by then) issue calls slower?
        compiled = torch.compile(course_lib.attention.reference.attention, dynamic=True)
        for n in (256, 512):
            x = torch.randn(2, 4, n, 64, device="cuda", requires_grad=True)
            compiled(x, x, x, causal=True).sum().backward()
        table("after torch.compile ran in this process")


if __name__ == "__main__":
    main()
