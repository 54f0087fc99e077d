"""Performance: what a GPU can do, what an operation costs, and how to measure both honestly.

- `hardware` ......... the datasheet table (A100, H100, H200, RTX 4090) with sources ... notebook 01
- `roofline` ......... arithmetic intensity, machine balance, `roofline_ms` ........... notebook 01
- `ceilings` ......... measured copy / read bandwidth, matmul TFLOP/s, fusion ......... notebook 01
- `training_memory` .. bytes per parameter when training with Adam ................... notebook 01
- `profiling` ........ standard attention step by step, under the profilers .......... notebook 02
- `timing` ........... `benchmark`, `interleaved`, `peak_memory`, `kernel_stats`,
                       `attention_flops` ............................................. notebook 08
- `plotting` ......... series, bars, the roofline, tables ............................ notebooks 00-08
- `syncs` ............ where a step would wait for the GPU, its copies and launches, found
                       on a CPU (`watch`) ........................ scripts/serving_probe.py --step

The names of `hardware`, `roofline`, `ceilings` and `training_memory` are also reachable here
(`course_lib.perf.roofline_ms`). `profiling` and `plotting` load on first use (matplotlib is slow to import).
"""

from __future__ import annotations

import importlib

from . import ceilings, hardware, roofline, timing, training_memory
from .ceilings import (
    block_sums,
    elementwise_chain,
    measure_copy_bandwidth,
    measure_copy_time,
    measure_fusion,
    measure_matmul_tflops,
    measure_operations,
    measure_read_bandwidth,
    measure_read_time,
    measure_record,
)
from .hardware import GPUS, GPUSpec, datasheet_rows, gpu, hierarchy, sources_by_document
from .roofline import (
    achieved_tflops,
    arithmetic_intensity,
    attainable_tflops,
    machine_balance,
    matmul_cost,
    operation_costs,
    roofline_ms,
)
from .timing import attention_flops, benchmark, free_memory, kernel_stats, peak_memory
from .training_memory import training_bytes_per_param

_LAZY_MODULES = ("profiling", "plotting")

__all__ = [
    "GPUS",
    "GPUSpec",
    "achieved_tflops",
    "arithmetic_intensity",
    "attainable_tflops",
    "attention_flops",
    "benchmark",
    "block_sums",
    "ceilings",
    "datasheet_rows",
    "elementwise_chain",
    "free_memory",
    "gpu",
    "hardware",
    "hierarchy",
    "kernel_stats",
    "machine_balance",
    "matmul_cost",
    "measure_copy_bandwidth",
    "measure_copy_time",
    "measure_fusion",
    "measure_matmul_tflops",
    "measure_operations",
    "measure_read_bandwidth",
    "measure_read_time",
    "measure_record",
    "operation_costs",
    "peak_memory",
    "roofline",
    "roofline_ms",
    "sources_by_document",
    "timing",
    "training_bytes_per_param",
    "training_memory",
    *_LAZY_MODULES,
]


def __getattr__(name: str):
    if name in _LAZY_MODULES:
        module = importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module 'course_lib.perf' has no attribute {name!r}")
