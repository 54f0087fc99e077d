"""What speculative decoding should gain, from the acceptance rate and the draft's cost (notebook 15).

With each draft kept independently with probability alpha, a round of gamma drafts emits
1 + alpha + ... + alpha^gamma = (1 - alpha^(gamma+1)) / (1 - alpha) tokens on average (Leviathan et al.,
2023). The round costs gamma draft steps and one target step; with c = (draft step time) / (target
step time) and a verification of gamma + 1 tokens costing about one decode step (decoding is
memory-bound: notebook 09), the speed-up over plain decoding is
(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)).
"""

from __future__ import annotations

from ..checks import check_int, check_real


def expected_tokens(alpha: float, gamma: int) -> float:
    """Mean tokens per target step, (1 - alpha^(gamma+1)) / (1 - alpha); gamma + 1 at alpha = 1."""
    alpha = check_real("expected_tokens", "alpha", alpha, low=0, high=1 + 1e-12)
    gamma = check_int("expected_tokens", "gamma", gamma, 0)
    if alpha >= 1:
        return float(gamma + 1)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, gamma: int, c: float) -> float:
    """Wall-clock speed-up over plain decoding: expected_tokens(alpha, gamma) / (gamma c + 1), with c the
    draft's step time over the target's."""
    c = check_real("predicted_speedup", "c", c, low=0)
    return expected_tokens(alpha, gamma) / (gamma * c + 1)


def best_gamma(alpha: float, c: float, largest: int = 16) -> int:
    """The gamma in 1..largest with the largest predicted speed-up."""
    return max(range(1, largest + 1), key=lambda g: predicted_speedup(alpha, g, c))
