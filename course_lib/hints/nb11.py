"""Hints for the exercises of notebook 11_fused_norm_rope (see `course_lib.hints`)."""

HINTS = {
    "RMSNorm forward kernel": [
        "Program `row` owns one row: its columns are `tl.arange(0, BLOCK_D)`, and only the first n_cols of "
        "them exist. Every tl.load and tl.store needs `mask=cols < n_cols` (a load also `other=0.0`, so the "
        "padding adds nothing to the sum of squares).",
        "Convert x to float32 right after the load. The mean of the squares divides the row's sum by n_cols "
        "(the real length), not by BLOCK_D; rstd = 1 / sqrt(that mean + eps).",
        "LlamaRMSNorm's order: x_hat = (x * rstd) cast to `x_ptr.dtype.element_ty`, then w (loaded, float32) "
        "times x_hat (back in float32), cast to `y_ptr.dtype.element_ty` on the masked store; the row's rstd "
        "goes to `rstd_ptr + row`.",
    ],
    "bytes of the backward": [
        "Count what is read and what is written. Every tensor of T x D or D elements moves in `elem` bytes "
        "per element; rstd is T float32 values, 4 bytes each whatever elem is.",
        "Read: x and dy (T x D each), w (D), rstd (T float32). Written: dx (T x D) and dw (D).",
    ],
    "RMSNorm gradients": [
        "Compute rstd per row (keepdim=True, so it broadcasts over the row), then x_hat = x * rstd and "
        "g = dy * w.",
        "Per row: dx = rstd * (g - x_hat * mean(g * x_hat)), the mean over the row; dw sums dy * x_hat over "
        "the rows (section 3).",
    ],
    "half to interleaved": [
        "perm is a list of d source indices: position p of x[..., perm] holds x[..., perm[p]].",
        "Position 2i of x[..., perm] must hold element i of x, and position 2i + 1 element i + d/2.",
    ],
    "fused residual add and norm": [
        "RMSNorm divides by the root of the mean of the squares, not by the standard deviation: no mean is "
        "subtracted.",
        "h is x + residual; y is RMSNorm of h. `llama_rms_norm`, defined near the top of this notebook, "
        "follows LlamaRMSNorm's casts.",
    ],
    "bytes of the fused kernel": [
        "Four T x D tensors move (x and residual read, h and y written), `elem` bytes per element.",
    ],
}
