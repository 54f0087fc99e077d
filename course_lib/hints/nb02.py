"""Hints for the exercises of notebook 02_standard_attention (see `course_lib.hints`)."""

HINTS = {
    "my_attention": [
        "Four lines, one per step: S, the mask (only if causal), P, O. `@` multiplies the last two dimensions "
        "and broadcasts the leading ones.",
        "S = (q @ k.transpose(-2, -1)) * d**-0.5 with d = q.shape[-1]; P = torch.softmax(S, dim=-1); O = P @ v.",
        "The mask compares key positions with query positions: build torch.arange(Nk)[None, :] > "
        "torch.arange(Nq)[:, None] (True for the future, shape (Nq, Nk)) and use S.masked_fill(that, "
        "float('-inf')). Use Nq and Nk separately: they differ in some cases.",
    ],
    "attention_hbm_bytes": [
        "Each step reads its inputs once and writes its output once: list the tensors of each step and their sizes.",
        "Q, K, V and O are n × d per head; S and P are n × n per head; multiply by bh and elem_bytes.",
        "S = QKᵀ: read 2nd, write n²; softmax: read n², write n²; O = PV: read n² + nd, write nd (per head, "
        "in elements).",
    ],
    "largest_n": [
        "S and P take 2 · bh · N² · elem_bytes bytes; memory_gb is in units of 10⁹ bytes.",
        "Start at N = 1 and double N while the next power of two still fits.",
    ],
    "qk_intensity": [
        "FLOPs of S = QKᵀ: 2 · N · N · d (a multiply-add per term). Bytes: read Q and K, write S.",
        "Bytes: (2 · N · d + N · N) · elem_bytes; for large N the N² term dominates both.",
    ],
    "middle_fusion_byte_ratio": [
        "`profiling.attention_step_costs(16, 4096, 128, 2, causal=True, dropout=True)` lists the steps; "
        "the middle ones have kind 'element-wise'.",
        "The fused kernel reads S (2 bytes per element), writes P (2 bytes) and the keep-mask (1 byte), "
        "for 16 · 4096² elements.",
    ],
}
