"""Hints of notebook 06 (the FlashAttention-2 forward in Triton), by exercise name: from a nudge to the
formula, never the whole answer (`course_lib.exercises.solution(name)` shows a worked one)."""

_SOFTMAX_TILE = [
    "A safe softmax of each row of the tile: subtract the row's max, exponentiate, divide by the row's sum.",
    "tl.max(s, axis=1) and tl.sum(p, axis=1) give one value per row (shape (BLOCK_M,)); broadcast such a "
    "vector back over the tile with [:, None].",
    "p = tl.exp(s - s_max[:, None]), then divide p by its row sums, broadcast the same way.",
]

HINTS = {
    "softmax_v_kernel": _SOFTMAX_TILE,
    "softmax_v_kernel, large scores": [
        "These scores reach about 200, and exp overflows float32 past 88.7: subtract each row's max before "
        "the exp, so that the largest exponent is 0.",
        *_SOFTMAX_TILE[1:],
    ],
    "flash_fwd_v1 (online rescale)": [
        "Follow section 1's pseudocode line by line; the running max, sum and accumulator are m_i, l_i, acc.",
        "The new max is the larger of the old one (m_i) and this tile's row max: tl.maximum of the two. "
        "Everything summed so far (l_i and acc) was weighted by exp(. - m_i): multiply both by "
        "alpha = exp(m_i - m_new) before adding this tile's share.",
        "p = tl.exp(s - m_new[:, None]); l_i grows by tl.sum(p, axis=1); acc grows by "
        "tl.dot(p, v, input_precision='ieee'), after both were multiplied by alpha (acc by alpha[:, None]).",
    ],
    "lse_from_base2": [
        "In base 2, m2 + log2(l) is log2 of the sum of 2**(s * qk_scale), i.e. log2 of the sum of "
        "exp(s * scale).",
        "A base-2 logarithm times ln 2 is a natural logarithm (math.log(2)).",
    ],
    "kv_bounds": [
        "Not causal: every key block is visited; only a ragged last block (keys past n_k) needs the mask.",
        "Causal: the block's last row is m0 + block_m - 1, so no key at or after m0 + block_m is ever "
        "visible: that is hi, clipped to n_k.",
        "Causal: a key block needs no mask when its last key is <= m0, the block's first row. With the "
        "kernels' block sizes (powers of two) that is every block before m0 rounded down to a multiple of "
        "block_n, clipped to n_k first.",
    ],
    "flash_fwd": [
        "Start from your kernel of exercise 2. In _attend, each step of the loop loads one K block and one "
        "V block at k_ptrs + start_n * stride_kn (and the same for V) with mask cols[:, None] < N_K, "
        "other=0.0, where cols = start_n + offs_n.",
        "Base 2 (section 4): m_new = max(m_i, rowmax(s) * qk_scale); p = exp2(s * qk_scale - m_new); "
        "alpha = exp2(m_i - m_new). With MASK, set s to -inf first where cols >= N_K or, if CAUSAL, where "
        "the key comes after the row (cols[None, :] > offs_m[:, None]).",
        "In flash_fwd: load Q with mask offs_m < N_Q; m_i = -inf, l_i = 0, acc = 0 (float32); the bounds "
        "are exercise 4's with m0 = start_m * BLOCK_M; call _attend for [0, hi_full) with MASK=False, "
        "then for [hi_full, hi) with MASK=True.",
        "The epilogue: store (acc / l_i[:, None]).to(O.dtype.element_ty) with the row mask, and L = "
        "(m_i + log2(l_i)) * ln 2 (exercise 3) with mask offs_m < N_Q. P goes into the second tl.dot as "
        "p.to(v.dtype); every tl.dot takes input_precision=DOT_PRECISION.",
    ],
    "window_block_kind": [
        "Work with the block's corners: its first and last query row, its first and last key.",
        "No pair is visible when the first key comes after the last query row, or when the last key lies "
        "at or below the first row's window edge (first_q - W).",
        "Every pair is visible when the last key is <= the first row and the first key is above the last "
        "row's window edge (last_q - W).",
    ],
    "lse_kernel": [
        "It is exercise 5's kernel without V and without the accumulator: keep only m_i and l_i.",
        "Mask the loads (rows < N_Q for Q, cols < N_K for K, other=0.0) and set the scores of padding keys "
        "to -inf before the max.",
        "Per block: m_new = max(m_i, rowmax(s) * qk_scale); l_i = l_i * exp2(m_i - m_new) + rowsum of "
        "exp2(s * qk_scale - m_new). At the end store (m_i + log2(l_i)) * ln 2, masked.",
    ],
}
