"""Hints for the exercises of notebook 01_roofline (see `course_lib.hints`)."""

HINTS = {
    "roofline time": [
        "An operation cannot finish before its arithmetic is done, nor before its bytes have moved: "
        "work out both times and keep the right one.",
        "Compute time = FLOPs / (FLOP per second), memory time = bytes / (bytes per second). "
        "Convert TFLOP/s (x 1e12) and GB/s (x 1e9) to per-second rates first, then seconds to ms (x 1e3).",
        "max(flops / (peak_tflops * 1e12), nbytes / (bandwidth_gbps * 1e9)), in seconds: multiply by 1e3.",
    ],
    "silu_intensity": [
        "Intensity is FLOPs per byte moved: count both per element.",
        "Per element: 4 FLOPs; bytes: x read once and y written once, elem_bytes each.",
    ],
    "compute_bound_n": [
        "Start from the machine balance, `perf.machine_balance(peak_tflops, bandwidth_gbps)` (FLOP per byte).",
        "The matmul's intensity is 2n³ / (3n² · elem_bytes) = 2n / (3 · elem_bytes); set it >= the balance.",
        "Solve 2n / (3 · elem_bytes) >= balance for n and round up to an integer (math.ceil).",
    ],
    "adam_training_gb": [
        "Section 6 counts bytes per parameter for parameters, gradients and optimizer states.",
        "`perf.training_bytes_per_param(mixed_precision)` returns those three counts as a dict.",
        "Multiply the sum of bytes per parameter by n_params, then divide by 1e9 for GB.",
    ],
    "two_input_fusion_speedup": [
        "Count element transfers to and from HBM: every kernel reads each of its inputs and writes its output.",
        "Eager: the add reads x and b and writes a temporary; the multiply reads it and c and writes y.",
        "The fused kernel reads x, b, c once and writes y once; the speed-up is eager transfers / fused transfers.",
    ],
}
