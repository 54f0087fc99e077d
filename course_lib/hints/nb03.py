"""Hints for notebook 03 (softmax three ways), by exercise name."""

HINTS = {
    "online softmax loop (one pass for m and l)": [
        "Keep two numbers, m = -inf and l = 0. For each x[i] (read it once, into a local variable): the new "
        "maximum is max(m, x[i]); the old sum was taken under the old maximum, so rescale it before adding.",
        "l = l * exp(m - m_new) + exp(x_i - m_new), then m = m_new. The second pass writes "
        "y[i] = exp(x[i] - m) / l.",
    ],
    "smallest overflowing float32": [
        "Start from x = float32(log(float32 max)): log of the largest finite float32, rounded to float32. "
        "Rounding may have put x just below or just above the true boundary.",
        "If exp(x) is still finite in float32, the answer is the next float32 up: "
        "np.nextafter(x, np.float32(np.inf)). Otherwise x is the answer.",
    ],
    "merge of two states": [
        "m = np.maximum(m_a, m_b); each l is rescaled to the common maximum by exp(m_part - m).",
        "When both parts are empty, m = -inf and exp(-inf - (-inf)) is NaN: subtract "
        "np.where(np.isneginf(m), 0.0, m) instead, so that exp(-inf - 0) = 0.",
    ],
    "merge of two partial outputs (O, L)": [
        "Each part's share of a row's probability mass is exp(L_part - L), with L = log(exp(L_a) + exp(L_b)). "
        "np.logaddexp computes that L without forming exp(800).",
        "O = exp(L_a - L)[:, None] * O_a + exp(L_b - L)[:, None] * O_b. For a row empty in both parts L is "
        "-inf: subtract np.where(np.isneginf(L), 0.0, L) so that both weights are 0, not NaN.",
    ],
    "streaming softmax": [
        "First pass: start from the empty state (-inf, 0) and merge in softmax.softmax_state(chunk) of each "
        "chunk. The final (m, l) is the state of the whole row.",
        "Second pass: every entry's softmax is exp(x - m) / l; normalise each chunk and concatenate.",
    ],
    "bytes of safe and online softmax": [
        "Count element moves per entry: the safe softmax reads x three times and writes y once; the online "
        "softmax reads x twice and writes y once.",
        "Multiply by R * N entries and the bytes per element (2 for float16).",
    ],
}
