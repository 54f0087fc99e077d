"""The GPU memory hierarchy in numbers: a datasheet table with the source of every figure.

Taught in notebook 01 (used again in 02). `GPUS` holds A100, H100, H200 and RTX 4090. Every figure
carries the address of the vendor document it comes from (`GPUSpec.sources`); the derived figures (the
clock and the SRAM bandwidth) say how they are derived. The roofline maths is in `course_lib.perf.roofline`,
the measured ceilings of the device you run on in `course_lib.perf.ceilings`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .roofline import machine_balance

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
        l2_mb=60,
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
            l2_mb="https://chipsandcheese.com/2023/07/02/nvidias-h100-funny-l2-and-tons-of-bandwidth/ (the GH100 "
            "die's 60 MB of L2; an H200 SXM reports all of it: cudaDeviceProp::l2CacheSize = 62,914,560 bytes)",
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
