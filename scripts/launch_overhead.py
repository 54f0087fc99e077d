"""Is a small attention call bound by the GPU or by the Python that launches it? (GPU only)

For one shape, runs forward+backward back to back without synchronising and compares the wall time
per call (what a training loop sees) with the GPU time of the kernels it launched (torch.profiler).
Wall time well above kernel time means the CPU cannot launch work as fast as the GPU finishes it.

    COURSE_DEVICE=cuda python3 scripts/launch_overhead.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("COURSE_DEVICE", "cuda")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import course_lib  # noqa: E402


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


def main():
    assert course_lib.ON_GPU
    print(f"{'provider':<12} {'N':>6} {'d':>4} causal  wall/call  kernels/call  CPU issue/call (ms)")
    for n, d in ((1024, 128), (1024, 64), (4096, 128)):
        b, h = 16384 // n, 2048 // d
        q, k, v = (
            torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
        )
        for name, fn in providers(q, k, v, torch.randn_like(q)).items():
            wall, gpu, issue = per_call(fn)
            print(f"{name:<12} {n:>6} {d:>4} {'yes':>6}  {wall:9.3f}  {gpu:12.3f}  {issue:9.3f}")


if __name__ == "__main__":
    main()
