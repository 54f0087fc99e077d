"""Hints for the exercises of notebook 16_long_context_bounded_memory (see `course_lib.hints`)."""

HINTS = {
    "infini memory segment": [
        "Retrieval first, from the memory as it was before the segment: the features sigma(Q) = elu_plus_one(q) "
        "times M, divided row by row by sigma(Q) times z. An empty memory must read as 0, not NaN: clamp each "
        "denominator with .clamp_min(EPS).",
        "Shapes: sigma(Q) (B, H, n, d) @ M (B, H, d, d_v) gives (B, H, n, d_v); sigma(Q) @ z.unsqueeze(-1) gives "
        "(B, H, n, 1), which divides it. The update adds sigma(K)^T V, i.e. sigma(K).transpose(-1, -2) @ V, to M "
        "and the sum of sigma(K) over the segment's tokens (dim 2) to z.",
        "The delta rule changes only the values stored: V - (sigma(K) @ M) / (sigma(K) @ z.unsqueeze(-1)), with "
        "the old M and z and the same clamp; the z update is the same for both rules.",
    ],
}
