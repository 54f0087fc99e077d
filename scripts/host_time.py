"""Host time per call: the Python that course_lib runs around its kernel launches, measured on a CPU.

On a GPU a small attention call is bound by the host: on an H200 a forward call once cost 147.5 us of host
time against SDPA's 27.4, forward + backward 1133 against 227.5 us, a decoding step 122.8 against 20.7;
with plans (`course_lib/attention/plans.py`) the `host_time` record (`make bench BENCH=host_time`) reads
1.15x, 1.43x and 1.31x SDPA's. All of that but the launch itself is Python that runs the same on any
machine: the checks, the choice of a launch, the allocations, autograd (a call seen before runs its plan). Here
the Triton kernels' launch is replaced by a no-op (`no_launch`: under the interpreter it would run the
kernel in Python, on a GPU it would bind the arguments and enqueue the work), and what remains is timed:

    COURSE_DEVICE=cpu python3 scripts/host_time.py [--calls 2000] [--profile] [--only forward]

- forward: `flash_attention(q, k, v, causal=True)` under no_grad (inference);
- forward, training: the same with q, k, v requiring grad (the autograd node is built);
- forward + backward: `torch.autograd.grad` of that forward (the backward's launches are no-ops too);
- decode step: `decode_attention` of one new token over a contiguous cache;
- paged decode step: `paged_decode_attention` of one new token per sequence over a paged cache;
- the two decode steps again with their lengths and page ids unread (`values_unread`), as a GPU runs a
  step with validate=False (on the CPU the values are always read; on a GPU reading them syncs);
at a tiny shape (the launch is gone, so the size matters only through the allocations). Each row is the
best of five rounds of `--calls` calls, in CPU microseconds of this process per call (the machine may
be shared: CPU time leaves out the time another process holds the core); with --profile, cProfile's
top entries (own time) of each. Only the CPU path is timed: branches taken on a GPU alone (the split-KV
route of a long decoding step, compiling ahead) are not.
The floor rows are what any attention call pays at least: its outputs' allocations, and autograd's own
cost of a Function's forward and backward. SDPA's rows are PyTorch's CPU kernel at (1, 4, 16, 16) and one
query row: its computation is included, so they bound its host time from above.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

os.environ.setdefault("COURSE_DEVICE", "cpu")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import course_lib  # noqa: E402
import course_lib.decode  # noqa: E402
from course_lib.bench.host_time import _Empty  # noqa: E402 (the floor: an empty autograd.Function)
from course_lib.perf.profiling import print_host_profile  # noqa: E402
from course_lib.runtime import triton  # noqa: E402

B, HQ, HKV, N, D = 1, 4, 2, 64, 64  # a tiny shape: (batch, query heads, K/V heads, tokens, head dim)
DTYPE = torch.float16


@contextlib.contextmanager
def no_launch():
    """Within the block, every Triton kernel launch (`kernel[grid](...)`, interpreted or compiled) returns
    at once without running: the launch's `run` is swapped for a no-op on the kernel classes."""
    from triton.runtime import interpreter, jit

    classes = [interpreter.InterpretedFunction, jit.JITFunction]
    saved = [(cls, cls.__dict__["run"]) for cls in classes if "run" in cls.__dict__]
    for cls, _ in saved:
        cls.run = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        for cls, run in saved:
            cls.run = run


@contextlib.contextmanager
def values_unread():
    """Within the block, decoding reads no lengths or page ids (`checks.should_validate` answers
    `validate`): on the CPU it always reads them, on a GPU only with validate=True, which syncs."""
    from course_lib.decode import paged, split_kv

    saved = split_kv.should_validate
    for module in (split_kv, paged):
        module.should_validate = lambda validate, device: False
    try:
        yield
    finally:
        for module in (split_kv, paged):
            module.should_validate = saved


def cases() -> dict:
    """{name: a call} for each row (module docstring), inputs built once."""
    g = torch.Generator().manual_seed(0)
    dev = course_lib.DEVICE

    def randn(*shape, grad=False):
        return torch.randn(*shape, generator=g).to(dev, DTYPE).requires_grad_(grad)

    q, k, v = randn(B, HQ, N, D), randn(B, HKV, N, D), randn(B, HKV, N, D)
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    do = randn(B, HQ, N, D)
    # decoding: one new token per sequence over a cache of N keys (contiguous, and paged in pages of 16)
    qd = randn(B, 1, HQ, D)
    k_cache, v_cache = randn(B, N, HKV, D), randn(B, N, HKV, D)
    seqlens = torch.full((B,), N, dtype=torch.int32, device=dev)
    page = 16
    k_pages, v_pages = (t.reshape(B * N // page, page, HKV, D) for t in (k_cache, v_cache))
    table = torch.arange(B * N // page, dtype=torch.int32, device=dev).view(B, N // page)

    def forward():
        with torch.no_grad():
            return course_lib.flash_attention(q, k, v, causal=True)

    def training_forward():
        return course_lib.flash_attention(qg, kg, vg, causal=True)

    def forward_backward():
        return torch.autograd.grad(course_lib.flash_attention(qg, kg, vg, causal=True), (qg, kg, vg), do)

    def decode():
        with torch.no_grad():
            return course_lib.decode.decode_attention(qd, k_cache, v_cache, seqlens)

    def paged_decode():
        with torch.no_grad():
            return course_lib.decode.paged_decode_attention(qd, k_pages, v_pages, table, seqlens)

    # SDPA's CPU kernel at a smaller shape (computation included: an upper bound of its host time)
    qs, ks, vs = (torch.randn(1, HQ, 16, 16, generator=g).requires_grad_(True) for _ in range(3))
    dos, qs1 = torch.randn(1, HQ, 16, 16, generator=g), torch.randn(1, HQ, 1, 16, generator=g)

    def sdpa_forward():
        with torch.no_grad():
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    def sdpa_forward_backward():
        return torch.autograd.grad(
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=True), (qs, ks, vs), dos
        )

    def sdpa_decode():
        with torch.no_grad():
            return F.scaled_dot_product_attention(qs1, ks, vs)

    def floor_forward():  # what any forward does at least: allocate O and L
        return torch.empty_like(q), torch.empty(q.shape[:-1], device=dev)

    def floor_forward_backward():  # an autograd.Function that allocates its outputs and gradients alone
        return torch.autograd.grad(_Empty.apply(qg, kg, vg), (qg, kg, vg), do)

    return {
        "forward (no_grad)": forward,
        "forward (training)": training_forward,
        "forward + backward": forward_backward,
        "decode step": decode,
        "paged decode step": paged_decode,
        "decode step, values unread": decode,  # measured within `values_unread`
        "paged decode step, values unread": paged_decode,
        "SDPA forward, CPU kernel, (1, 4, 16, 16)": sdpa_forward,
        "SDPA forward + backward, CPU kernel": sdpa_forward_backward,
        "SDPA decode step, CPU kernel": sdpa_decode,
        "floor: allocate O and L": floor_forward,
        "floor: empty autograd.Function + grad": floor_forward_backward,
    }


def per_call_us(fn, calls: int, rounds: int = 5) -> float:
    """Best over `rounds` of the mean CPU microseconds of this process per call of `calls` calls (CPU time,
    not wall time: on a shared machine the time another process holds the core is not counted)."""
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - t0) / calls * 1e6)
    return best


def profile(name: str, fn, calls: int, top: int) -> None:
    print_host_profile(fn, calls, f"\ncProfile of {calls} calls of {name}, by own time:", top)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", action="store_true", help="cProfile's top entries of each row")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--only", default="", help="rows whose name contains this")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f"host time per call, launches replaced by no-ops: q ({B}, {HQ}, {N}, {D}), k and v ({B}, {HKV}, {N}, {D}), "
        f"{str(DTYPE).replace('torch.', '')}, causal; {args.calls} calls, best of 5 rounds; {course_lib.DEVICE}, "
        f"torch {torch.__version__}, triton {triton.__version__}"
    )
    with no_launch():
        rows = {name: fn for name, fn in cases().items() if args.only in name}
        for name, fn in rows.items():
            with values_unread() if "unread" in name else contextlib.nullcontext():
                print(f"  {name:<42} {per_call_us(fn, args.calls):8.1f} us")
        if args.profile:
            for name, fn in rows.items():
                with values_unread() if "unread" in name else contextlib.nullcontext():
                    profile(name, fn, args.calls, args.top)


if __name__ == "__main__":
    main()
