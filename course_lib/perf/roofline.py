"""The roofline model: arithmetic intensity, machine balance, and the least time an operation can take.

Taught in notebook 01 (used again in 02 and 08). An operation that does F FLOPs and moves B bytes to or
from HBM cannot finish before max(F / peak FLOP/s, B / bandwidth); its arithmetic intensity F / B says
which of the two bounds it.

FLOP convention (for non-matmul operations): one FLOP per add, multiply, compare, max, exp or divide.
Byte convention: the *minimum* traffic to and from HBM, each input read once, each output written once.
"""

from __future__ import annotations

import math

from course_lib.checks import check_int


def machine_balance(peak_tflops: float, bandwidth_gbps: float) -> float:
    """FLOP per byte at which an operation stops being memory-bound: peak FLOP/s / bandwidth."""
    _positive(peak_tflops=peak_tflops, bandwidth_gbps=bandwidth_gbps)
    return peak_tflops * 1e12 / (bandwidth_gbps * 1e9)


def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """FLOP per byte moved to or from memory."""
    _positive(nbytes=nbytes)
    _positive(zero_ok=True, flops=flops)
    return flops / nbytes


def attainable_tflops(intensity: float, peak_tflops: float, bandwidth_gbps: float) -> float:
    """The roofline: min(peak, bandwidth x intensity), in TFLOP/s."""
    _positive(peak_tflops=peak_tflops, bandwidth_gbps=bandwidth_gbps)
    _positive(zero_ok=True, intensity=intensity)
    return min(peak_tflops, bandwidth_gbps * intensity / 1e3)


def roofline_ms(flops: float, nbytes: float, peak_tflops: float, bandwidth_gbps: float) -> float:
    """The least time (ms) an operation can take: the larger of compute time and memory time."""
    _positive(peak_tflops=peak_tflops, bandwidth_gbps=bandwidth_gbps)
    _positive(zero_ok=True, flops=flops, nbytes=nbytes)
    return max(flops / (peak_tflops * 1e9), nbytes / (bandwidth_gbps * 1e6))


def achieved_tflops(point: dict) -> float:
    """TFLOP/s an operation reached: its FLOPs over its measured time (`point` has "flops" and "ms")."""
    _positive(ms=point["ms"])
    _positive(zero_ok=True, flops=point["flops"])
    return point["flops"] / (point["ms"] * 1e9)


def _positive(zero_ok: bool = False, **values) -> None:
    """Each value a finite real number (Python, NumPy or a 0-d tensor; not a bool), > 0 (>= 0 with zero_ok)."""
    for name, value in values.items():
        try:
            number = None if isinstance(value, (bool, str, bytes)) else float(value)
        except (TypeError, ValueError, RuntimeError):
            number = None
        if number is None or not math.isfinite(number) or number < 0 or (number == 0 and not zero_ok):
            kind = "non-negative" if zero_ok else "positive"
            raise ValueError(f"{name} must be a {kind} finite number, got {value!r}")


# ---------------------------------------------------------------------------------------------------------
# What operations cost: FLOPs and minimum bytes


def operation_costs(rows: int, cols: int, elem_bytes: int) -> dict[str, tuple[float, float]]:
    """(FLOPs, minimum HBM bytes) of common non-matmul operations on a (rows, cols) tensor.

    Element-wise: ReLU (1 FLOP/element), dropout (compare + scale = 2; also writes a 1-byte keep-mask, as
    PyTorch does), masking with a boolean (rows, cols) mask (1 select; reads 1 mask byte). Reductions over
    the last dim: sum (1), softmax (max, subtract, exp, sum, divide = 5), layer norm (mean 1, variance 3,
    normalise 2, affine 2 = 8). Each reads its input once and writes its output once."""
    rows, cols = (check_int("operation_costs", name, v, 1) for name, v in (("rows", rows), ("cols", cols)))
    n = rows * cols
    b = check_int("operation_costs", "elem_bytes", elem_bytes, 1)
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
    n, elem_bytes = check_int("matmul_cost", "n", n, 1), check_int("matmul_cost", "elem_bytes", elem_bytes, 1)
    return 2.0 * n**3, 3.0 * n * n * elem_bytes
