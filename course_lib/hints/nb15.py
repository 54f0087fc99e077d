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
}
