"""Hints of notebook 08 (08_benchmarking): TFLOP/s by the papers' convention, bytes, ratios, the ladder."""

HINTS = {
    "TFLOP/s (forward)": [
        "A forward does two matmuls per (batch, head), Q K^T and P V, each 2 N N d FLOPs.",
        "FLOPs = 4 b h n^2 d for a forward; TFLOP/s = FLOPs / (ms * 1e-3) / 1e12.",
    ],
    "TFLOP/s (causal fwd+bwd)": [
        "By the papers' convention a causal call gets credit for half the FLOPs, and a forward + backward "
        "counts 3.5 forwards (the backward 2.5).",
        "FLOPs = 4 b h n^2 d x (0.5 if causal) x {fwd: 1, bwd: 2.5, fwd_bwd: 3.5}[mode]; then divide by the "
        "seconds and by 1e12.",
    ],
    "TFLOP/s (backward)": [
        "The backward counts 2.5 forwards: five products of 2 N N d, one of them recomputing S.",
        "FLOPs = 4 b h n^2 d x 2.5 (not causal here); TFLOP/s = FLOPs / (ms * 1e-3) / 1e12.",
    ],
    "bytes ratio": [
        "Add up the elements the text lists for standard attention: four of N x d (Q, K, V, O) and four of "
        "N x N (S written, S read, P written, P read).",
        "standard = 4 n d + 4 n^2 elements, fused = 4 n d; the ratio is 1 + n / d.",
    ],
    "min and geomean": [
        "Drop the None entries first. The geometric mean is the exponential of the mean of the logarithms.",
        "For ratios r_1 ... r_k the geometric mean is exp((log r_1 + ... + log r_k) / k); return it with the "
        "minimum, as a pair.",
    ],
    "geomean of 2x and 0.5x": [
        "log 2 and log 0.5 cancel: their mean is 0. Return the pair (minimum, geometric mean) as the first "
        "check did; this check reads the second element.",
    ],
    "predicted ladder total": [
        "Each rung's gain multiplies the speed of the rung before it: the total is a product, not a sum.",
        "Multiply the `predicted` gains of all the steps (the first rung's 1.0 changes nothing).",
    ],
}
