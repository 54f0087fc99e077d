"""Hints of notebook 09 (decoding attention and Flash-Decoding), by exercise name: from a nudge to the
formula, never the whole answer (`course_lib.exercises.solution(name)` shows a worked one)."""

HINTS = {
    "split-KV partials": [
        "Two pieces: the range [lo, hi) of keys this program reads, and the store of its partial. The range "
        "is in keys, not blocks: a split covers per_split whole blocks of BLOCK_N keys, and the last one "
        "stops at seqlen. A split that starts past seqlen must get lo >= hi (its loop then never runs).",
        "per_split = tl.cdiv(tl.cdiv(seqlen, BLOCK_N), NUM_SPLITS) blocks; lo = split * per_split * BLOCK_N; "
        "hi = the smaller of lo + per_split * BLOCK_N and seqlen (tl.minimum).",
        "The partial: o = acc / l_i[:, None], lse = (m_i + tl.math.log2(l_i)) * LN2. A split with no key has "
        "l_i == 0: divide by tl.where(l_i == 0, 1.0, l_i) instead, and give lse = -inf there with tl.where "
        "(0 / 0 is NaN, and log2(0) is -inf plus m_i = -inf, NaN again).",
        "The stores: O_PART + split * stride_os + b * stride_ob + h[:, None] * stride_oh + offs_d[None, :] * "
        "stride_od with mask=row_ok[:, None] & d_ok[None, :]; L_PART + split * stride_ls + b * stride_lb + h "
        "* stride_lh with mask=row_ok. Without row_ok, the padding rows write over other heads' results.",
    ],
    "combine of partials": [
        "L is the logsumexp of the L_s over the splits (dim 0), O the sum of exp(L_s - L) * O_s. "
        "torch.logsumexp never forms exp(L_s) alone, so it does not overflow.",
        "The weights exp(l_part - L) have shape (S, B, Hq); O needs them as (S, B, Hq, 1) to multiply "
        "o_part (S, B, Hq, d); then sum over dim 0.",
        "A row that no split saw has L = -inf, and l_part - L is then -inf - (-inf) = NaN. Subtract "
        "torch.where(torch.isneginf(L), 0, L) instead: every weight is then exp(-inf) = 0, O = 0, L stays -inf.",
    ],
    "bytes per decoding step": [
        "Per layer, per sequence, per cached token, a step reads one K row and one V row of every kv head: "
        "2 x kv_heads x head_dim x bytes_per_element bytes. The time is bytes / (GB/s x 1e9) seconds.",
        "nbytes = 2 * layers * kv_heads * head_dim * bytes_per_element * batch * n_tokens; the milliseconds "
        "are nbytes / (gbps * 1e9) * 1e3.",
    ],
    "split choice": [
        "Both early returns are inclusive: 1 split when n_key_blocks <= 4 or programs >= 0.8 x SMs. The "
        "limit is min(128, SMs, n_key_blocks): a split needs at least one key block.",
        "eff = [wave_efficiency(programs * s, num_sms) for s in 1..limit]; return the first s (skipping s "
        "whose ceil(n_key_blocks / s) equals that of s - 1) with eff[s - 1] >= 0.85 * max(eff).",
    ],
}
