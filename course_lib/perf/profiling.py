"""Where the time of standard attention goes: a cost model per step, labelled steps for the profilers,
and the GPU record that notebook 02 shows a CPU learner.

Taught in notebook 02. Standard attention, as the FlashAttention paper writes it
(its Algorithm 0), with the mask and dropout of a real model:

    S = Q K^T * scale      (B*H, N, N)  written to HBM
    S = mask(S)            read S, write S
    P = softmax(S)         read S, write P
    P = dropout(P)         read P, write P (and a 1-byte keep-mask, saved for backward)
    O = P V                read P and V, write O

Every N x N matrix makes a round trip through HBM; the element-wise steps do almost no arithmetic per
byte, so they take much of the time although they hold a tiny share of the FLOPs.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch.autograd import DeviceType

from .. import runtime
from ..checks import check_attention_inputs, default_scale
from .timing import benchmark, free_memory, peak_memory

STEPS = ("S = QK^T", "mask", "softmax", "dropout", "O = PV")


@contextmanager
def step(name: str):
    """Label a region: `torch.profiler` sees it as a `record_function` range and, on a CUDA GPU, Nsight
    Systems sees it as an NVTX range (`nsys profile python script.py`)."""
    use_nvtx = torch.cuda.is_available()
    with torch.profiler.record_function(name):
        if use_nvtx:
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if use_nvtx:
                torch.cuda.nvtx.range_pop()


def standard_attention(
    q,
    k,
    v,
    causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    label_steps: bool = True,
):
    """Standard attention, one PyTorch op per step, each step labelled with `step` (names in `STEPS`).

    q: (..., Nq, d), k, v: (..., Nk, d), any float dtype and device; returns O (..., Nq, d) in q's dtype.
    causal: query i sees keys j <= i. dropout_p > 0 applies dropout to P (always, as in training).
    Materialises S and P (N x N per batch and head): notebook 02 measures what that costs.
    `label_steps=False` leaves the labels out (for torch.compile)."""
    check_attention_inputs(q, k, v, where="profiling.standard_attention")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    scale = default_scale(q.shape[-1], scale)
    label = step if label_steps else (lambda name: nullcontext())
    with label("S = QK^T"):
        S = torch.matmul(q * scale, k.transpose(-2, -1))  # scaling Q costs N*d, not N*N
    if causal:
        with label("mask"):
            n_q, n_k = q.shape[-2], k.shape[-2]
            future = torch.arange(n_k, device=q.device)[None, :] > torch.arange(n_q, device=q.device)[:, None]
            S = S.masked_fill(future, float("-inf"))  # (Nq, Nk) bool mask, broadcast over batch and heads
    with label("softmax"):
        P = torch.softmax(S, dim=-1)
    if dropout_p > 0:
        with label("dropout"):
            P = F.dropout(P, p=dropout_p, training=True)
    with label("O = PV"):
        O = torch.matmul(P, v)
    return O


def attention_step_costs(
    batch_heads: int,
    n: int,
    d: int,
    elem_bytes: int = 2,
    causal: bool = True,
    dropout: bool = True,
    n_keys: int | None = None,
) -> list[dict]:
    """FLOPs and minimum HBM bytes of each step of `standard_attention` (forward), as dicts with
    step, kind ("matmul" or "element-wise"), flops, bytes.

    batch_heads = B*H; n queries, n_keys keys (default n); head dim d; elem_bytes 2 for fp16/bf16.
    Each step reads its inputs once and writes its output once (what an ideal unfused kernel moves).
    The causal mask is built once per call (1 byte per N x N element) and broadcast over B*H;
    dropout also writes a 1-byte keep-mask. Causal attention here still computes the full S (as
    standard attention does), so FLOPs are not halved."""
    for name, value in (("batch_heads", batch_heads), ("n", n), ("d", d), ("elem_bytes", elem_bytes)):
        if not (isinstance(value, int) and value > 0):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    nk = n if n_keys is None else n_keys
    b = elem_bytes
    nn = batch_heads * n * nk  # elements of S (and of P)
    qd, kd = batch_heads * n * d, batch_heads * nk * d
    steps = [
        {"step": "S = QK^T", "kind": "matmul", "flops": 2.0 * nn * d, "bytes": float((qd + kd + nn) * b)}
    ]
    if causal:
        steps.append(
            {"step": "mask", "kind": "element-wise", "flops": 1.0 * nn, "bytes": float(2 * nn * b + n * nk)}
        )
    steps.append({"step": "softmax", "kind": "element-wise", "flops": 5.0 * nn, "bytes": float(2 * nn * b)})
    if dropout:
        steps.append(
            {"step": "dropout", "kind": "element-wise", "flops": 2.0 * nn, "bytes": float(2 * nn * b + nn)}
        )
    steps.append(
        {"step": "O = PV", "kind": "matmul", "flops": 2.0 * nn * d, "bytes": float((nn + kd + qd) * b)}
    )
    return steps


def predict_step_ms(
    costs: list[dict], matmul_tflops: float, other_tflops: float, bandwidth_gbps: float
) -> list[float]:
    """Roofline time (ms) of each step of `attention_step_costs`: matmuls against `matmul_tflops`, the
    other steps against `other_tflops` (the non-matmul units), all against `bandwidth_gbps`."""
    from .roofline import roofline_ms

    return [
        roofline_ms(
            c["flops"], c["bytes"], matmul_tflops if c["kind"] == "matmul" else other_tflops, bandwidth_gbps
        )
        for c in costs
    ]


def profile_steps(fn, names=STEPS, repeats: int = 3) -> dict:
    """Time each labelled step of `fn()` with `torch.profiler`: {"steps": {name: ms per call}, "top_ops":
    [(aten op, self ms per call, calls per call)], "device": "cuda" or "cpu"}.

    On a GPU a step's time is the GPU time of the kernels launched inside its label; on a CPU it is the
    CPU time spent inside it. `fn` is called once before profiling (warm-up)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    on_gpu = runtime.ON_GPU
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    fn()
    if on_gpu:
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(repeats):
            fn()
        if on_gpu:
            torch.cuda.synchronize()
    totals = dict.fromkeys(names, 0.0)
    for evt in prof.events():
        if evt.name in totals and evt.device_type == DeviceType.CPU:
            totals[evt.name] += evt.device_time_total if on_gpu else evt.cpu_time_total
    top = []
    for avg in prof.key_averages():
        if avg.key in totals or not avg.key.startswith("aten::"):
            continue
        us = avg.self_device_time_total if on_gpu else avg.self_cpu_time_total
        top.append((avg.key, us / repeats / 1e3, avg.count / repeats))
    top.sort(key=lambda row: -row[1])
    return {
        "steps": {k: us / repeats / 1e3 for k, us in totals.items()},
        "top_ops": top[:10],
        "device": "cuda" if on_gpu else "cpu",
    }


def sweep_sequence_length(make_fn, ns, measure_memory: bool = True) -> list[dict]:
    """Time (and, on a GPU, peak memory) of `make_fn(n)()` for each n in `ns`, smallest first.

    `make_fn(n)` allocates the inputs and returns the function to time. Returns one dict per n:
    {"N", "ms", "peak_bytes"} (peak_bytes: bytes allocated above the inputs; None on a CPU) or
    {"N", "oom": True} when the GPU ran out of memory; the sweep stops at the first out-of-memory."""
    rows = []
    for n in ns:
        row, fn, oom = {"N": int(n)}, None, False
        try:
            fn = make_fn(n)
            if measure_memory:
                row["peak_bytes"] = peak_memory(fn)
            row["ms"] = benchmark(fn)
        except torch.OutOfMemoryError:
            oom = True  # handled below, after the exception (and the tensors its traceback holds) is gone
        fn = None
        free_memory()
        if oom:
            rows.append({"N": int(n), "oom": True})
            break
        rows.append(row)
    return rows


def saved_for_backward(fn) -> list[dict]:
    """Run `fn()` with autograd on and list the tensors autograd saves for the backward pass:
    [{"shape", "dtype", "bytes"}], each storage once. This is what training keeps in memory
    between forward and backward."""
    saved, seen = [], set()

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            saved.append(
                {
                    "shape": tuple(t.shape),
                    "dtype": str(t.dtype).replace("torch.", ""),
                    "bytes": t.untyped_storage().nbytes(),
                }
            )
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return saved


def standard_attention_record(
    batch_heads: int = 16,
    head_dim: int = 128,
    ns=(512, 1024, 2048, 4096, 8192, 16384, 32768, 65536),
    breakdown_n: int = 4096,
    dtype=torch.bfloat16,
    dropout_p: float = 0.1,
    compile_fused: bool = True,
    device=None,
) -> dict:
    """The figures notebook 02 shows a CPU learner, measured on this device (meant for a GPU; well under
    a minute on an H200). `make bench` saves it with `records.save_record("standard_attention", ...)`.

    Shape (1, batch_heads, N, head_dim), causal, dropout `dropout_p`. Returns
    {"shape", "sweep": sweep_sequence_length rows (time, peak memory, OOM), "breakdown": profile_steps at
    breakdown_n plus total_ms and the predicted cost of each step, "compiled": eager vs torch.compile
    at breakdown_n (or its error)}. Small arguments make a quick run (the tests do)."""
    device = runtime.DEVICE if device is None else torch.device(device)
    shape = {
        "batch_heads": batch_heads,
        "head_dim": head_dim,
        "dtype": str(dtype).replace("torch.", ""),
        "causal": True,
        "dropout_p": dropout_p,
    }

    def make(n):
        q, k, v = (torch.randn(1, batch_heads, n, head_dim, device=device, dtype=dtype) for _ in range(3))
        return lambda: standard_attention(q, k, v, causal=True, dropout_p=dropout_p)

    rec = {"shape": shape, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    with torch.no_grad():
        rec["sweep"] = sweep_sequence_length(make, ns)
        fn = make(breakdown_n)
        breakdown = profile_steps(fn)
        breakdown["N"] = breakdown_n
        breakdown["total_ms"] = benchmark(fn)
        breakdown["costs"] = attention_step_costs(
            batch_heads, breakdown_n, head_dim, elem_bytes=torch.finfo(dtype).bits // 8
        )
        rec["breakdown"] = breakdown
        compiled = {"N": breakdown_n, "eager_ms": breakdown["total_ms"]}
        if compile_fused:
            try:
                q, k, v = (
                    torch.randn(1, batch_heads, breakdown_n, head_dim, device=device, dtype=dtype)
                    for _ in range(3)
                )
                fused = torch.compile(standard_attention)
                compiled["compiled_ms"] = benchmark(
                    lambda: fused(q, k, v, causal=True, dropout_p=dropout_p, label_steps=False)
                )
                del q, k, v
            except Exception as exc:  # record a compiler problem instead of dying
                compiled["error"] = f"{type(exc).__name__}: {exc}"[:500]
        rec["compiled"] = compiled
        fn = None
    free_memory()
    return rec


def n_squared_bytes(batch_heads: int, n: int, elem_bytes: int = 2, matrices: float = 1.0) -> float:
    """Bytes of `matrices` N x N matrices for B*H = batch_heads (e.g. S and P: matrices=2)."""
    return matrices * batch_heads * n * n * elem_bytes


def largest_fitting_n(
    batch_heads: int, budget_bytes: float, elem_bytes: int = 2, matrices: float = 2.0
) -> int:
    """Largest power of two N whose `matrices` N x N matrices fit in `budget_bytes`."""
    n_max = math.isqrt(int(budget_bytes / (matrices * batch_heads * elem_bytes)))
    if n_max < 1:
        raise ValueError(f"not even N=1 fits in {budget_bytes} bytes")
    return 2 ** int(math.log2(n_max))


def print_host_profile(fn, calls: int, title: str, top: int = 20) -> None:
    """Run fn() `calls` times under cProfile and print its `top` entries by own time under `title`: where a
    call's host time goes (scripts/host_time.py, scripts/launch_overhead.py, `bench.host_time`). On a GPU the
    queued work is waited for after the profiled calls."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    if runtime.ON_GPU:
        torch.cuda.synchronize()
    print(title)
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)
