"""The ceilings of the device you run on, measured: copy and read bandwidth, matmul TFLOP/s, what common
operations cost, and `measure_record()`, the GPU record that `make bench` saves for CPU learners.

Taught in notebook 01 (copy bandwidth, matmul TFLOP/s, fusion). The read-only bandwidth,
`measure_read_bandwidth`, is the ceiling of kernels that read much and write little: decoding one token
reads the whole KV cache and writes one row per head.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from .. import runtime
from ..runtime import tl, triton
from .roofline import matmul_cost, operation_costs
from .timing import benchmark, free_memory, graph_ms

# Elements each program of the read kernel sums. On a GPU, 8192 fp32 elements over 8 warps are 32 per
# thread: eight 16-byte loads in flight per thread, enough to keep HBM busy.
READ_BLOCK = 8192


def _device(device) -> torch.device:
    return runtime.DEVICE if device is None else torch.device(device)


def _check_dtype(dtype) -> None:
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")


# ---------------------------------------------------------------------------------------------------------
# Bandwidth: copy (read + write) and read only


def _replay_ms(fn) -> float:
    """Median ms of `fn` as a CUDA-graph replay on a GPU (`timing.graph_ms`: the way the benchmarks time
    the kernels a ceiling is compared with, no launch cost), of plain calls on the CPU."""
    ms = graph_ms(fn)
    return benchmark(fn) if ms is None else ms


def _copy_fn(src: torch.Tensor, dst: torch.Tensor):
    # An elementwise kernel, not `dst.copy_(src)`: captured in a CUDA graph, a same-dtype copy becomes a
    # memcpy node, which the driver may hand to a copy engine, slower than the SMs.
    return partial(torch.mul, src, 1, out=dst)


def measure_copy_bandwidth(numel: int | None = None, dtype=torch.float32, device=None) -> float:
    """Bandwidth of a large device-to-device copy (an elementwise kernel, `_copy_fn`), in GB/s,
    counting bytes read plus bytes written (as bandwidth is quoted), timed as a CUDA-graph replay on a
    GPU like the kernels it is compared with (plain launches read about 1 % lower on an H200). Default
    size: 64 MB on a CPU (beyond its caches), 1 GiB on a GPU (far beyond the L2)."""
    _check_dtype(dtype)
    numel = runtime.pick(cpu=2**24, gpu=2**28) if numel is None else int(numel)
    if numel < 1:
        raise ValueError(f"numel must be positive, got {numel}")
    src = torch.randn(numel, device=_device(device), dtype=dtype)
    dst = torch.empty_like(src)
    ms = _replay_ms(_copy_fn(src, dst))
    return 2 * src.nbytes / (ms * 1e-3) / 1e9


if triton is not None:

    @triton.jit
    def _block_sums_kernel(x_ptr, out_ptr, numel, BLOCK: tl.constexpr):
        # Program p reads x[p*BLOCK : (p+1)*BLOCK] from HBM once (masked at the end), adds it up in fp32
        # in registers, and writes one fp32: BLOCK * elem_bytes read, 4 bytes written.
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(x, axis=0))


def block_sums(x: torch.Tensor, block: int = READ_BLOCK) -> torch.Tensor:
    """Sums of consecutive blocks of `block` elements of a contiguous 1-D tensor, by a Triton kernel that
    reads `x` once and writes one fp32 per block: the read-only kernel of `measure_read_bandwidth`.

    x: (numel,), float16 / bfloat16 / float32, on course_lib's device. Returns (ceil(numel / block),)
    float32; the last block is summed over the elements it has."""
    runtime.require_triton()
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() != 1 or not x.is_contiguous() or x.numel() == 0:
        raise ValueError(f"x must be a non-empty contiguous 1-D tensor, got shape {tuple(x.shape)}")
    if x.device.type != runtime.DEVICE.type:
        raise ValueError(f"x is on {x.device}, but Triton kernels run on {runtime.DEVICE} here")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    out = torch.empty(triton.cdiv(x.numel(), block), device=x.device, dtype=torch.float32)
    _block_sums_kernel[(out.numel(),)](x, out, x.numel(), BLOCK=block, num_warps=8)
    return out


def measure_read_bandwidth(
    numel: int | None = None, dtype=torch.float32, device=None, reader: str | None = None
) -> float:
    """Bandwidth of reading a large tensor once and writing almost nothing, in GB/s (bytes read / time).

    The ceiling of memory-bound kernels that mostly read, like decoding (reads the KV cache, writes one
    row per head); a copy's figure counts a write per read and can sit a little lower or higher.
    reader: "triton" times `block_sums` (one fp32 written per 8192 elements read: under 0.05% extra
    traffic); "torch" times `x.sum()`. Default: "triton" for a tensor on the GPU, "torch" on the CPU (the
    interpreter would time Python, not memory). Timed as a CUDA-graph replay on a GPU, like the kernels it
    is compared with (plain launches read about 1 % lower on an H200). Default size: 64 MB on a CPU,
    2 GiB on a GPU (far beyond the L2)."""
    _check_dtype(dtype)
    numel = runtime.pick(cpu=2**24, gpu=2**29) if numel is None else int(numel)
    if numel < 1:
        raise ValueError(f"numel must be positive, got {numel}")
    dev = _device(device)
    reader = ("triton" if dev.type == "cuda" else "torch") if reader is None else reader
    if reader not in ("triton", "torch"):
        raise ValueError(f"reader must be 'triton' or 'torch', got {reader!r}")
    x = torch.randn(numel, device=dev, dtype=dtype)
    fn = partial(block_sums, x) if reader == "triton" else x.sum
    ms = _replay_ms(fn)
    return x.nbytes / (ms * 1e-3) / 1e9


def measure_copy_time(nbytes: int, dtype=torch.bfloat16, device=None) -> float:
    """Milliseconds a copy that moves `nbytes` in all (reads nbytes / 2, writes nbytes / 2) takes, as a
    CUDA-graph replay on a GPU: the floor for a kernel that must move that many bytes, read and write
    about evenly. Like a read, a copy below about 1 GB does not reach `measure_copy_bandwidth`'s figure."""
    _check_dtype(dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    if nbytes < 2 * elem:
        raise ValueError(f"nbytes must be at least two elements ({2 * elem} bytes), got {nbytes}")
    src = torch.randn(int(nbytes) // (2 * elem), device=_device(device), dtype=dtype)
    return _replay_ms(_copy_fn(src, torch.empty_like(src)))


def measure_read_time(nbytes: int, dtype=torch.bfloat16, device=None) -> float:
    """Milliseconds `block_sums` takes to read `nbytes` once (a CUDA-graph replay on a GPU, so no launch
    cost): the floor for a kernel that must read that many bytes. A read of a few hundred MB or less
    does not reach `measure_read_bandwidth`'s figure (the first loads' latency and the last wave do not shrink
    with the size): decoding's tables compare each cell with a read of its own size too."""
    _check_dtype(dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    if nbytes < elem:
        raise ValueError(f"nbytes must be at least one element ({elem} bytes), got {nbytes}")
    x = torch.randn(int(nbytes) // elem, device=_device(device), dtype=dtype)
    return _replay_ms(partial(block_sums, x))


# ---------------------------------------------------------------------------------------------------------
# Compute: matmul TFLOP/s and the cost of common operations


def measure_matmul_tflops(n: int | None = None, dtype=torch.float32, device=None) -> float:
    """TFLOP/s of an (n, n) @ (n, n) matmul (2 n^3 FLOPs) in `dtype`. Default n: 1024 on a CPU, 8192 on a GPU.
    fp32 on a GPU uses the current `torch.backends.cuda.matmul.allow_tf32` setting (off by default)."""
    _check_dtype(dtype)
    n = runtime.pick(cpu=1024, gpu=8192) if n is None else int(n)
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    device = _device(device)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = benchmark(lambda: a @ b)
    return 2 * n**3 / (ms * 1e9)


def measure_operations(rows: int, cols: int, matmul_sizes=(), dtype=torch.float32, device=None) -> list[dict]:
    """Time the operations of `operation_costs` on a fresh random (rows, cols) tensor, and square matmuls
    of each size in `matmul_sizes`. Returns one dict per operation: name, kind ("element-wise",
    "reduction", "matmul"), flops, bytes, ms (median, `course_lib.perf.timing.benchmark`)."""
    _check_dtype(dtype)
    if rows < 1 or cols < 1:
        raise ValueError(f"rows and cols must be positive, got rows={rows}, cols={cols}")
    device = _device(device)
    b = torch.finfo(dtype).bits // 8
    x = torch.randn(rows, cols, device=device, dtype=dtype)
    keep = torch.rand(rows, cols, device=device) > 0.1
    weight = torch.randn(cols, device=device, dtype=dtype)
    bias = torch.randn(cols, device=device, dtype=dtype)
    fns = {
        "ReLU": ("element-wise", torch.relu),
        "dropout": ("element-wise", partial(F.dropout, p=0.1, training=True)),
        "masking": ("element-wise", lambda t: t.masked_fill(keep, float("-inf"))),
        "sum": ("reduction", partial(torch.sum, dim=-1)),
        "softmax": ("reduction", partial(torch.softmax, dim=-1)),
        "layer norm": ("reduction", lambda t: F.layer_norm(t, (cols,), weight, bias)),
    }
    points = []
    with torch.no_grad():
        for name, (flops, nbytes) in operation_costs(rows, cols, b).items():
            kind, fn = fns[name]
            ms = benchmark(partial(fn, x))
            points.append({"name": name, "kind": kind, "flops": flops, "bytes": nbytes, "ms": ms})
        del x, fns
        for n in matmul_sizes:
            a = torch.randn(n, n, device=device, dtype=dtype)
            c = torch.randn(n, n, device=device, dtype=dtype)
            flops, nbytes = matmul_cost(n, b)
            ms = benchmark(partial(torch.matmul, a, c))
            points.append(
                {"name": f"matmul {n}", "kind": "matmul", "flops": flops, "bytes": nbytes, "ms": ms}
            )
            del a, c
    return points


# ---------------------------------------------------------------------------------------------------------
# Fusion, and the recorded figures for CPU learners


def elementwise_chain(x):
    """Four element-wise operations in a row: eager PyTorch runs four kernels and makes four round trips
    to HBM; a fused kernel makes one."""
    return torch.relu(x * 0.5 + 1.0) * 2.0


def measure_fusion(numel: int, device=None, compile_fn=None) -> dict:
    """Eager vs fused time of `elementwise_chain` (4 element-wise ops) on `numel` fp32 elements.

    `compile_fn` turns the chain into a fused function (default `torch.compile`). Returns eager_ms,
    fused_ms, measured and predicted speed-up (predicted from bytes: 4 reads + 4 writes vs 1 + 1), or an
    `error` entry if compiling failed."""
    compile_fn = torch.compile if compile_fn is None else compile_fn
    x = torch.randn(numel, device=_device(device))
    out = {"numel": numel, "dtype": "float32", "ops": 4, "predicted_speedup": 4.0}
    try:
        fused = compile_fn(elementwise_chain)
        torch.testing.assert_close(fused(x), elementwise_chain(x))
        out["eager_ms"] = benchmark(lambda: elementwise_chain(x))
        out["fused_ms"] = benchmark(lambda: fused(x))
        out["speedup"] = out["eager_ms"] / out["fused_ms"]
    except Exception as exc:  # a recorder must not die on a compiler problem: record it instead
        out["error"] = f"{type(exc).__name__}: {exc}"[:500]
    return out


def measure_record(
    copy_numel: int = 2**28,
    read_numel: int = 2**29,
    matmul_n: int = 8192,
    rows: int = 16384,
    cols: int = 8192,
    matmul_sizes=(256, 512, 1024, 2048, 4096, 8192),
    fusion_numel: int = 2**28,
    device=None,
) -> dict:
    """The figures notebook 01 shows a CPU learner, measured on this device (meant for a GPU; takes well
    under a minute on an H200). `make bench` saves it with `records.save_record("hardware", ...)`.

    Returns {"copy_gbps", "read_gbps", "matmul_tflops": {dtype: TFLOP/s}, "matmul_n", "operations": [point, ...]
    (bf16 on a GPU), "fusion": measure_fusion(...)}. Small arguments make a quick run (the tests do)."""
    device = _device(device)
    on_gpu = device.type == "cuda"
    rec = {"device": torch.cuda.get_device_name(device) if on_gpu else "cpu", "matmul_n": matmul_n}
    rec["copy_gbps"] = measure_copy_bandwidth(copy_numel, device=device)
    free_memory()
    rec["read_gbps"] = measure_read_bandwidth(read_numel, device=device)
    free_memory()
    dtypes = [torch.bfloat16, torch.float16, torch.float32] if on_gpu else [torch.float32]
    rec["matmul_tflops"] = {}
    for dtype in dtypes:
        rec["matmul_tflops"][str(dtype).replace("torch.", "")] = measure_matmul_tflops(
            matmul_n, dtype, device
        )
        free_memory()
    if on_gpu:
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            rec["matmul_tflops"]["tf32"] = measure_matmul_tflops(matmul_n, torch.float32, device)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
        free_memory()
    op_dtype = torch.bfloat16 if on_gpu else torch.float32
    rec["operations_dtype"] = str(op_dtype).replace("torch.", "")
    rec["operations"] = measure_operations(rows, cols, matmul_sizes, dtype=op_dtype, device=device)
    free_memory()
    rec["fusion"] = measure_fusion(fusion_numel, device=device)
    free_memory()
    return rec
