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
    "infini layer": [
        "Three pieces, in this order: A_dot for the whole sequence with segment_attention(q, k, v, segment, "
        "sdpa_local_attention); then a loop over start = 0, segment, 2 * segment, ... that calls memory_step on "
        "the slice [start, start + segment) of elu_plus_one(q), elu_plus_one(k) and v, carrying (M, z) from one "
        "segment to the next; then the gate.",
        "The empty memory: M = q.new_zeros(B, H, d, d_v) and z = q.new_zeros(B, H, d). memory_step returns "
        "(A_mem, M, z): keep each segment's A_mem in a list and torch.cat them along the token dim (2). A slice "
        "past N stops at N, so the last, shorter segment needs nothing special.",
        "The gate is per head: g = torch.sigmoid(beta).view(1, H, 1, 1), and the output g * A_mem + (1 - g) * "
        "A_dot. Reading A_mem and updating M in the wrong order (the update before the read) is the mistake the "
        "check's multi-segment cases catch.",
    ],
    "infini segment attention": [
        "full = N // segment * segment tokens make whole segments. Reshape q[:, :, :full] (and k, v) to "
        "(B, H, full // segment, segment, d): the segments become a batch dimension, and local's causal mask then "
        "stays inside each one.",
        "local(*cut) returns (B, H, full // segment, segment, d): reshape it back to (B, H, full, d). If full < N, "
        "the last tokens q[:, :, full:] (and k, v) are one more, shorter segment: a second call of local.",
        "torch.cat the parts along the token dim (2). With no whole segment (N < segment) the first part is empty: "
        "skip it rather than reshape zero tokens.",
    ],
}
