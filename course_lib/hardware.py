"""The GPU memory hierarchy in numbers, the roofline model, and the ceilings of the device you run on.

Taught in notebook 01 (used again in 02). Three parts:
- `GPUS`: a datasheet table for A100, H100, H200 and RTX 4090. Every figure carries the address of the
  vendor document it comes from (`GPUSpec.sources`); the derived figures (the clock and the SRAM
  bandwidth) say how they are derived.
- The roofline model: arithmetic intensity (FLOP per byte moved to or from HBM), machine balance and the
  time an operation cannot beat, `roofline_ms`.
- Measurements on the current device: copy bandwidth, matmul FLOP/s, the cost and time of a few common
  operations, and `measure_record()`, the GPU record that `make bench` saves for CPU learners.

FLOP convention (for non-matmul operations): one FLOP per add, multiply, compare, max, exp or divide.
Byte convention: the *minimum* traffic to and from HBM, each input read once, each output written once.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from . import runtime
from .timing import benchmark

# Where the figures come from.
A100_DATASHEET = (
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
AMPERE_WHITEPAPER = (
    "https://images.nvidia.com/aem-dam/en-zz/Solutions/data-center/nvidia-ampere-architecture-whitepaper.pdf"
)
AMPERE_TUNING = "https://docs.nvidia.com/cuda/ampere-tuning-guide/index.html"
H100_DATASHEET = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
HOPPER_WHITEPAPER = "https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper"
HOPPER_TUNING = "https://docs.nvidia.com/cuda/hopper-tuning-guide/index.html"
H200_PAGE = "https://www.nvidia.com/en-us/data-center/h200/"
ADA_WHITEPAPER = "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"
ADA_TUNING = "https://docs.nvidia.com/cuda/ada-tuning-guide/index.html"
RTX4090_PAGE = "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4090/"
CUDA_GUIDE_SPECS = (
    "https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#features-and-technical-specifications"
)
CUDA_GUIDE_SHARED_MEMORY = (
    "https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#shared-memory-5-x"
)
FLASHATTENTION_PAPER = "https://arxiv.org/abs/2205.14135"
FLASHATTENTION2_PAPER = "https://arxiv.org/abs/2307.08691"
ZERO_PAPER = "https://arxiv.org/abs/1910.02054"

# Shared memory: 32 banks, each 32 bits (4 bytes) per clock (CUDA C++ Programming Guide).
SHARED_MEMORY_BYTES_PER_CLOCK_PER_SM = 32 * 4


@dataclass(frozen=True)
class GPUSpec:
    """One GPU's datasheet figures. Sizes in the vendor's units (KB = 1024 bytes for on-chip memories),
    bandwidths in GB/s, throughputs in TFLOP/s (dense, no sparsity). `sources` maps a field name to the
    document it comes from."""

    name: str
    sms: int  # streaming multiprocessors
    registers_kb_per_sm: float  # register file per SM
    sram_kb_per_sm: float  # combined L1 cache / shared memory per SM (the "SRAM" of the FlashAttention paper)
    shared_max_kb_per_sm: float  # how much of it a kernel may use as shared memory
    l2_mb: float
    hbm_gb: float
    hbm_kind: str
    hbm_gbps: float
    host_link: str
    host_link_gbps: float  # both directions together, as datasheets quote it
    matmul16_tflops: float  # fp16/bf16 tensor-core matmul, fp32 accumulate, dense
    fp32_tflops: float  # non-matmul fp32 arithmetic on the CUDA cores
    fp32_lanes_per_sm: int  # FP32 cores per SM, to derive the clock from fp32_tflops
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def clock_ghz(self) -> float:
        """Boost clock implied by the fp32 figure: fp32 FLOP/s = SMs x lanes x 2 (an FMA) x clock."""
        return self.fp32_tflops * 1e3 / (self.sms * self.fp32_lanes_per_sm * 2)

    @property
    def sram_total_mb(self) -> float:
        """All SMs' L1/shared memory together, in MB (1 MB = 1024 KB)."""
        return self.sms * self.sram_kb_per_sm / 1024

    @property
    def sram_gbps(self) -> float:
        """Estimated aggregate shared-memory bandwidth: SMs x 128 bytes/clock x clock, in GB/s.

        An estimate (no datasheet publishes it); for the A100 it gives 19.5 TB/s, matching the
        FlashAttention paper's "around 19 TB/s"."""
        return self.sms * SHARED_MEMORY_BYTES_PER_CLOCK_PER_SM * self.clock_ghz

    def balance(self, matmul: bool = True) -> float:
        """Machine balance in FLOP/byte: peak FLOP/s over HBM bandwidth. Below it, an op is memory-bound."""
        return machine_balance(self.matmul16_tflops if matmul else self.fp32_tflops, self.hbm_gbps)


def _sources(**kw) -> dict[str, str]:
    return kw


GPUS: dict[str, GPUSpec] = {
    "A100": GPUSpec(
        name="A100 SXM4 80GB",
        sms=108,
        registers_kb_per_sm=256,
        sram_kb_per_sm=192,
        shared_max_kb_per_sm=164,
        l2_mb=40,
        hbm_gb=80,
        hbm_kind="HBM2e",
        hbm_gbps=2039,
        host_link="PCIe Gen4",
        host_link_gbps=64,
        matmul16_tflops=312,
        fp32_tflops=19.5,
        fp32_lanes_per_sm=64,
        sources=_sources(
            sms=AMPERE_WHITEPAPER,
            registers_kb_per_sm=CUDA_GUIDE_SPECS,
            sram_kb_per_sm=AMPERE_TUNING,
            shared_max_kb_per_sm=AMPERE_TUNING,
            l2_mb=AMPERE_WHITEPAPER,
            hbm_gb=A100_DATASHEET,
            hbm_gbps=A100_DATASHEET,
            host_link_gbps=A100_DATASHEET,
            matmul16_tflops=A100_DATASHEET,
            fp32_tflops=A100_DATASHEET,
            fp32_lanes_per_sm=AMPERE_WHITEPAPER,
        ),
    ),
    "H100": GPUSpec(
        name="H100 SXM5 80GB",
        sms=132,
        registers_kb_per_sm=256,
        sram_kb_per_sm=256,
        shared_max_kb_per_sm=228,
        l2_mb=50,
        hbm_gb=80,
        hbm_kind="HBM3",
        hbm_gbps=3350,
        host_link="PCIe Gen5",
        host_link_gbps=128,
        matmul16_tflops=989,
        fp32_tflops=67,
        fp32_lanes_per_sm=128,
        sources=_sources(
            sms=HOPPER_WHITEPAPER,
            registers_kb_per_sm=CUDA_GUIDE_SPECS,
            sram_kb_per_sm=HOPPER_TUNING,
            shared_max_kb_per_sm=HOPPER_TUNING,
            l2_mb=HOPPER_WHITEPAPER,
            hbm_gb=H100_DATASHEET,
            hbm_gbps=H100_DATASHEET,
            host_link_gbps=H100_DATASHEET,
            matmul16_tflops=H100_DATASHEET + " (1,979 with sparsity; dense is half)",
            fp32_tflops=H100_DATASHEET,
            fp32_lanes_per_sm=HOPPER_WHITEPAPER,
        ),
    ),
    "H200": GPUSpec(
        name="H200 SXM 141GB",
        sms=132,
        registers_kb_per_sm=256,
        sram_kb_per_sm=256,
        shared_max_kb_per_sm=228,
        l2_mb=50,
        hbm_gb=141,
        hbm_kind="HBM3e",
        hbm_gbps=4800,
        host_link="PCIe Gen5",
        host_link_gbps=128,
        matmul16_tflops=989,
        fp32_tflops=67,
        fp32_lanes_per_sm=128,
        sources=_sources(
            sms=HOPPER_WHITEPAPER + " (the H200 uses the H100 SXM5's Hopper GPU)",
            registers_kb_per_sm=CUDA_GUIDE_SPECS,
            sram_kb_per_sm=HOPPER_TUNING,
            shared_max_kb_per_sm=HOPPER_TUNING,
            l2_mb=HOPPER_WHITEPAPER,
            hbm_gb=H200_PAGE,
            hbm_gbps=H200_PAGE,
            host_link_gbps=H200_PAGE,
            matmul16_tflops=H200_PAGE + " (1,979 with sparsity; dense is half)",
            fp32_tflops=H200_PAGE,
            fp32_lanes_per_sm=HOPPER_WHITEPAPER,
        ),
    ),
    "RTX 4090": GPUSpec(
        name="GeForce RTX 4090",
        sms=128,
        registers_kb_per_sm=256,
        sram_kb_per_sm=128,
        shared_max_kb_per_sm=100,
        l2_mb=72,
        hbm_gb=24,
        hbm_kind="GDDR6X",
        hbm_gbps=1008,
        host_link="PCIe Gen4",
        host_link_gbps=64,
        matmul16_tflops=165.2,
        fp32_tflops=82.6,
        fp32_lanes_per_sm=128,
        sources=_sources(
            sms=ADA_WHITEPAPER,
            registers_kb_per_sm=CUDA_GUIDE_SPECS,
            sram_kb_per_sm=ADA_TUNING,
            shared_max_kb_per_sm=ADA_TUNING,
            l2_mb=ADA_WHITEPAPER,
            hbm_gb=RTX4090_PAGE,
            hbm_gbps=ADA_WHITEPAPER,
            host_link_gbps=ADA_WHITEPAPER + " (PCIe 4.0 x16: 32 GB/s each way)",
            matmul16_tflops=ADA_WHITEPAPER + " (FP16 tensor, FP32 accumulate, dense)",
            fp32_tflops=ADA_WHITEPAPER,
            fp32_lanes_per_sm=ADA_WHITEPAPER,
        ),
    ),
}


def gpu(name: str) -> GPUSpec:
    """The datasheet entry for `name` ("A100", "H100", "H200", "RTX 4090"); a clear error otherwise."""
    if name not in GPUS:
        raise KeyError(f"no datasheet entry for {name!r}; known GPUs: {', '.join(GPUS)}")
    return GPUS[name]


def sources_by_document(name: str) -> dict[str, list[str]]:
    """{document address: [figures it gives]} for one GPU of `GPUS`."""
    out: dict[str, list[str]] = {}
    for fig, src in gpu(name).sources.items():
        out.setdefault(src, []).append(fig)
    return out


def datasheet_rows() -> list[dict]:
    """One row per GPU with the figures notebook 01 prints (sizes in MB/GB, bandwidths in GB/s)."""
    return [
        {
            "GPU": g.name,
            "SMs": g.sms,
            "registers / SM (KB)": g.registers_kb_per_sm,
            "L1+shared / SM (KB)": g.sram_kb_per_sm,
            "shared max / SM (KB)": g.shared_max_kb_per_sm,
            "SRAM total (MB)": round(g.sram_total_mb, 1),
            "L2 (MB)": g.l2_mb,
            "HBM (GB)": g.hbm_gb,
            "HBM (GB/s)": g.hbm_gbps,
            "SRAM est. (GB/s)": round(g.sram_gbps),
            "host link (GB/s)": g.host_link_gbps,
            "16-bit matmul (TFLOP/s)": g.matmul16_tflops,
            "fp32 (TFLOP/s)": g.fp32_tflops,
        }
        for g in GPUS.values()
    ]


def hierarchy(name: str) -> list[dict]:
    """The memory hierarchy of one GPU, fastest first: level, capacity (bytes), bandwidth (GB/s or None
    where no vendor document gives one), and the source."""
    g = gpu(name)
    kb, mb = 1024, 1024**2
    return [
        {
            "level": "registers",
            "bytes": g.sms * g.registers_kb_per_sm * kb,
            "gbps": None,
            "source": g.sources["registers_kb_per_sm"],
        },
        {
            "level": "SRAM (L1 / shared, all SMs)",
            "bytes": g.sms * g.sram_kb_per_sm * kb,
            "gbps": g.sram_gbps,
            "source": g.sources["sram_kb_per_sm"]
            + " ; bandwidth estimated: SMs x 128 B/clock x clock, "
            + CUDA_GUIDE_SHARED_MEMORY,
        },
        {"level": "L2 cache", "bytes": g.l2_mb * mb, "gbps": None, "source": g.sources["l2_mb"]},
        {
            "level": f"HBM ({g.hbm_kind})",
            "bytes": g.hbm_gb * 1e9,
            "gbps": g.hbm_gbps,
            "source": g.sources["hbm_gbps"],
        },
        {
            "level": f"host DRAM over {g.host_link}",
            "bytes": None,
            "gbps": g.host_link_gbps,
            "source": g.sources["host_link_gbps"],
        },
    ]


# ---------------------------------------------------------------------------------------------------------
# The roofline model


def machine_balance(peak_tflops: float, bandwidth_gbps: float) -> float:
    """FLOP per byte at which an operation stops being memory-bound: peak FLOP/s / bandwidth."""
    _positive(peak_tflops=peak_tflops, bandwidth_gbps=bandwidth_gbps)
    return peak_tflops * 1e12 / (bandwidth_gbps * 1e9)


def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """FLOP per byte moved to or from memory."""
    _positive(nbytes=nbytes)
    return flops / nbytes


def attainable_tflops(intensity: float, peak_tflops: float, bandwidth_gbps: float) -> float:
    """The roofline: min(peak, bandwidth x intensity), in TFLOP/s."""
    return min(peak_tflops, bandwidth_gbps * intensity / 1e3)


def roofline_ms(flops: float, nbytes: float, peak_tflops: float, bandwidth_gbps: float) -> float:
    """The least time (ms) an operation can take: the larger of compute time and memory time."""
    _positive(peak_tflops=peak_tflops, bandwidth_gbps=bandwidth_gbps)
    return max(flops / (peak_tflops * 1e9), nbytes / (bandwidth_gbps * 1e6))


def _positive(**values) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")


# ---------------------------------------------------------------------------------------------------------
# What operations cost: FLOPs and minimum bytes


def operation_costs(rows: int, cols: int, elem_bytes: int) -> dict[str, tuple[float, float]]:
    """(FLOPs, minimum HBM bytes) of common non-matmul operations on a (rows, cols) tensor.

    Element-wise: ReLU (1 FLOP/element), dropout (compare + scale = 2; also writes a 1-byte keep-mask, as
    PyTorch does), masking with a boolean (rows, cols) mask (1 select; reads 1 mask byte). Reductions over
    the last dim: sum (1), softmax (max, subtract, exp, sum, divide = 5), layer norm (mean 1, variance 3,
    normalise 2, affine 2 = 8). Each reads its input once and writes its output once."""
    n = rows * cols
    b = elem_bytes
    return {
        "ReLU": (1.0 * n, 2.0 * n * b),
        "dropout": (2.0 * n, 2.0 * n * b + n),
        "masking": (1.0 * n, 2.0 * n * b + n),
        "sum": (1.0 * n, 1.0 * n * b + rows * b),
        "softmax": (5.0 * n, 2.0 * n * b),
        "layer norm": (8.0 * n, 2.0 * n * b + 2 * cols * b),
    }


def matmul_cost(n: int, elem_bytes: int) -> tuple[float, float]:
    """(FLOPs, minimum bytes) of an (n, n) @ (n, n) matmul: 2 n^3 FLOPs; read A and B, write C: 3 n^2
    elements. Intensity 2n / (3 * elem_bytes) grows with n: large matmuls are compute-bound."""
    return 2.0 * n**3, 3.0 * n * n * elem_bytes


def _device(device) -> torch.device:
    return runtime.DEVICE if device is None else torch.device(device)


def _check_dtype(dtype) -> None:
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")


def measure_operations(rows: int, cols: int, matmul_sizes=(), dtype=torch.float32, device=None) -> list[dict]:
    """Time the operations of `operation_costs` on a fresh random (rows, cols) tensor, and square matmuls
    of each size in `matmul_sizes`. Returns one dict per operation: name, kind ("element-wise",
    "reduction", "matmul"), flops, bytes, ms (median, `course_lib.timing.benchmark`)."""
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


def achieved_tflops(point: dict) -> float:
    """TFLOP/s an operation reached: its FLOPs over its measured time."""
    return point["flops"] / (point["ms"] * 1e9)


# ---------------------------------------------------------------------------------------------------------
# The ceilings of the device we run on


def measure_copy_bandwidth(numel: int | None = None, dtype=torch.float32, device=None) -> float:
    """Bandwidth of a large device-to-device copy `dst.copy_(src)`, in GB/s, counting bytes read plus
    bytes written (as bandwidth is quoted). Default size: 64 MB on a CPU (beyond its caches), 1 GiB on a
    GPU (far beyond the L2)."""
    _check_dtype(dtype)
    numel = runtime.pick(cpu=2**24, gpu=2**28) if numel is None else int(numel)
    if numel < 1:
        raise ValueError(f"numel must be positive, got {numel}")
    src = torch.randn(numel, device=_device(device), dtype=dtype)
    dst = torch.empty_like(src)
    ms = benchmark(lambda: dst.copy_(src))
    return 2 * src.nbytes / (ms * 1e-3) / 1e9


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


# ---------------------------------------------------------------------------------------------------------
# Memory when training


def training_bytes_per_param(mixed_precision: bool = True) -> dict[str, int]:
    """Bytes per parameter held during training with Adam, by what they hold.

    fp32 training: parameters 4, gradients 4, Adam's two moments 8.
    Mixed precision (the ZeRO paper's accounting, https://arxiv.org/abs/1910.02054): 16-bit parameters 2 and
    gradients 2; optimizer states 12 = fp32 master weights 4 + two fp32 moments 8. So P : G : states =
    1 : 1 : 6, 16 bytes per parameter either way. Activations come on top and depend on the batch."""
    if mixed_precision:
        return {"parameters": 2, "gradients": 2, "optimizer states": 12}
    return {"parameters": 4, "gradients": 4, "optimizer states": 8}


# ---------------------------------------------------------------------------------------------------------
# The recorded figures for CPU learners


def elementwise_chain(x):
    """Four element-wise operations in a row: eager PyTorch runs four kernels and makes four round trips
    to HBM; a fused kernel makes one."""
    return torch.relu(x * 0.5 + 1.0) * 2.0


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
    matmul_n: int = 8192,
    rows: int = 16384,
    cols: int = 8192,
    matmul_sizes=(256, 512, 1024, 2048, 4096, 8192),
    fusion_numel: int = 2**28,
    device=None,
) -> dict:
    """The figures notebook 01 shows a CPU learner, measured on this device (meant for a GPU; takes well
    under a minute on an H200). `make bench` saves it with `records.save_record("hardware", ...)`.

    Returns {"copy_gbps", "matmul_tflops": {dtype: TFLOP/s}, "matmul_n", "operations": [point, ...]
    (bf16 on a GPU), "fusion": measure_fusion(...)}. Small arguments make a quick run (the tests do)."""
    device = _device(device)
    on_gpu = device.type == "cuda"
    rec = {"device": torch.cuda.get_device_name(device) if on_gpu else "cpu", "matmul_n": matmul_n}
    rec["copy_gbps"] = measure_copy_bandwidth(copy_numel, device=device)
    _free()
    dtypes = [torch.bfloat16, torch.float16, torch.float32] if on_gpu else [torch.float32]
    rec["matmul_tflops"] = {}
    for dtype in dtypes:
        rec["matmul_tflops"][str(dtype).replace("torch.", "")] = measure_matmul_tflops(
            matmul_n, dtype, device
        )
        _free()
    if on_gpu:
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            rec["matmul_tflops"]["tf32"] = measure_matmul_tflops(matmul_n, torch.float32, device)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
        _free()
    op_dtype = torch.bfloat16 if on_gpu else torch.float32
    rec["operations_dtype"] = str(op_dtype).replace("torch.", "")
    rec["operations"] = measure_operations(rows, cols, matmul_sizes, dtype=op_dtype, device=device)
    _free()
    rec["fusion"] = measure_fusion(fusion_numel, device=device)
    _free()
    return rec
