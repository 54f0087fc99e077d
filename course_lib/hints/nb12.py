"""Hints for the exercises of notebook 12_capstone (see `course_lib.hints`)."""

HINTS = {
    "Llama block forward": [
        "Two residual branches: h = x + (attention of the first norm of x), then out = h + (MLP of the second norm "
        "of h). Each norm is rms_norm(t, norm.weight, norm.eps) with its own module.",
        "After wq / wk / wv: .view(B, N, heads, head_dim).transpose(1, 2) gives (B, heads, N, head_dim), with "
        "c.n_heads for q and c.n_kv_heads for k and v. rope(q, k, cos, sin) returns the rotated pair; "
        "flash_attention(q, k, v, causal=True) takes the K/V heads as they are.",
        "The attention's output (B, n_heads, N, head_dim) goes back with .transpose(1, 2).reshape(B, N, -1) before "
        "wo. The MLP is w2(silu(w1(f)) * w3(f)) on f, the second norm of h (torch.nn.functional.silu).",
    ],
    "parameter count": [
        "Per layer: Wq and Wo are dim x dim; Wk and Wv dim x (n_kv_heads x head_dim), head_dim = dim / n_heads; "
        "three SwiGLU matrices of dim x hidden; two norm weights of dim.",
        "The tied embedding counts once (vocab x dim), then the final norm (dim); add them to n_layers times a "
        "layer's count.",
    ],
    "KV-cache bytes per token": [
        "Per token and layer the cache holds one K and one V row per kv head: 2 x n_kv_heads x head_dim "
        "elements of 2 bytes (bf16).",
        "The benchmark's model: 16 layers, head_dim = 768 / 6 = 128, 2 kv heads (6 without GQA).",
    ],
    "training-step memory": [
        "Count bytes per parameter: which dtype does each of the three hold, on the path this notebook trains "
        "(fp32 on the CPU; autocast keeps fp32 weights on a GPU)?",
        "Under autocast the weights stay fp32: every parameter, its gradient and each of AdamW's two states take "
        "4 bytes per element.",
    ],
}
