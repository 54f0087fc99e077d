"""Hints of notebook 15 (faster decoding), by exercise name: one more after each failed attempt."""

HINTS = {
    "speculative acceptance rule": [
        "Walk the drafts in order. Draft i is accepted with probability min(1, p[i, x] / q[i, x]); the first "
        "rejection ends the round.",
        "Accepting with probability min(1, p/q): draw r uniform in [0, 1) and accept when r * q[i, x] < p[i, x] "
        "(no division, so q = 0 elsewhere does no harm).",
        "At a rejection at position i, the token comes from max(0, p[i] - q[i]) divided by its sum, and you "
        "return (i, token). If every draft is accepted, return (k, a draw from p[k]).",
    ],
    "jacobi update": [
        "Count k, the leading guesses that agree: guess g_{i+1} = window[i + 1] is right when it equals "
        "outputs[i], the model's choice after window[i].",
        "outputs[0] is always right (it follows the settled token), so settled = outputs[: k + 1].",
        "The next guesses are outputs[k + 1:], padded to n with its last element (or with outputs[k] when "
        "nothing is left).",
    ],
    "rollback": [
        "Token j lives in page pages[j // page_size]. The first new_length tokens therefore need the first "
        "ceil(new_length / page_size) pages; every page after those holds only rolled-back tokens.",
        "keep = -(-new_length // page_size) rounds up without floats; kept = pages[:keep], released = "
        "pages[keep:]. A cut inside a page keeps that page (it still holds kept tokens).",
        "Return tensors: torch.tensor(pages[:keep], dtype=torch.int64) and the same for the rest (an empty list "
        "gives an empty tensor, which the check accepts).",
    ],
}
