"""What speculative decoding should gain, from the acceptance rate and the draft's cost (notebook 15).

The textbook model (Leviathan et al., 2023). With each draft kept independently with probability alpha, a
round of gamma drafts emits 1 + alpha + ... + alpha^gamma = (1 - alpha^(gamma+1)) / (1 - alpha) tokens on
average. The round costs gamma draft steps and one target step; with c = (draft step time) / (target
step time) and a verification of gamma + 1 tokens costing about one decode step (decoding is
memory-bound: notebook 09), the speed-up over plain decoding is
(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)).

The measured-cost model (`cost_model_speedup`). On a small model a step is host-bound (Python and kernel
launches), and neither assumption holds: the verification step's time grows with gamma, a look-up draft's
time is host time and no multiple of a model step, and a rejected tail's rollback costs its bookkeeping.
Each part is then measured on its own, in seconds: t_step (one plain decode step), t_verify(gamma) (one
step over the pending token and gamma drafts, with the acceptance), t_draft(gamma) (the draft's proposal of
gamma tokens), t_rollback (the caches' truncation), and

    speed-up = tokens per round x t_step / (t_draft + t_verify + t_rollback),

with tokens per round either `expected_tokens(alpha, gamma)` (`measured_cost_speedup`), its mean over the
drafts each round actually proposed (`expected_tokens_of_rounds`), or the mean measured over the rounds. With
t_verify = t_step, t_draft = gamma c t_step and no rollback it is the textbook formula. A batch of B sequences
runs until its slowest one is done, its last rounds with fewer sequences: `expected_batch_time` sums the
rounds' expected costs, each at its expected active sequences (`still_running`), from alpha alone.
`course_lib.bench.speculative` measures the parts and sets the two predictions beside the measurement.
"""

from __future__ import annotations

import math

from ..checks import check_int, check_real


def expected_tokens(alpha: float, gamma: int) -> float:
    """Mean tokens per target step, (1 - alpha^(gamma+1)) / (1 - alpha); gamma + 1 at alpha = 1."""
    alpha = check_real("expected_tokens", "alpha", alpha, low=0, high=1 + 1e-12)
    gamma = check_int("expected_tokens", "gamma", gamma, 0)
    if alpha >= 1:
        return float(gamma + 1)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def expected_tokens_of_rounds(alpha: float, proposed) -> float:
    """The mean of `expected_tokens(alpha, k)` over the rounds' numbers of drafts k (`proposed`, ints): the
    independent-acceptance formula for a draft that proposes fewer than gamma tokens in some rounds (a
    look-up that finds nothing, a sequence's last round). Equals expected_tokens(alpha, gamma) when every
    round drafted gamma."""
    proposed = list(proposed)
    if not proposed:
        raise ValueError("expected_tokens_of_rounds: no rounds")
    return sum(expected_tokens(alpha, k) for k in proposed) / len(proposed)


def still_running(alpha: float, proposed, tokens: int) -> list[float]:
    """P(a sequence is still generating at round r), r = 1, 2, ...: for a sequence of `tokens` new tokens
    whose rounds keep each draft independently with probability alpha, a round proposing k drafts with k
    drawn from `proposed` (ints: the counts the rounds proposed), and emitting the kept drafts plus one
    token. The list ends where the probability falls below 1e-9. A batch runs until its slowest sequence:
    with B sequences, round r runs Binomial(B, p_r) of them (`expected_batch_time`)."""
    tokens = check_int("still_running", "tokens", tokens, 1)
    alpha = check_real("still_running", "alpha", alpha, low=0, high=1 + 1e-12)
    proposed = list(proposed)
    if not proposed:
        raise ValueError("still_running: no rounds")
    step = [0.0] * (max(proposed) + 2)  # P(a round emits k tokens), k = 1 ... max + 1
    for g in proposed:
        for k in range(1, g + 2):
            step[k] += (alpha ** (k - 1) * (1 - alpha) if k <= g else alpha**g) / len(proposed)
    emitted = [1.0] + [0.0] * tokens  # P(emitted so far = s), s capped at `tokens`
    out = []
    while (p := sum(emitted[:tokens])) >= 1e-9:
        out.append(p)
        after = [0.0] * tokens + [emitted[tokens]]
        for s_, ps in enumerate(emitted[:tokens]):
            if ps:
                for k in range(1, len(step)):
                    after[min(tokens, s_ + k)] += ps * step[k]
        emitted = after
    return out


def expected_batch_time(alpha: float, proposed, tokens: int, batch: int, round_time) -> float:
    """Expected seconds for a batch of `batch` sequences of `tokens` new tokens each, acceptances independent
    (`still_running`), a round with a active sequences taking round_time(a) seconds: the sum over rounds of
    E[round_time(A_r)], A_r ~ Binomial(batch, p_r), rounds with no active sequence costing nothing. At
    batch 1 it is the expected number of rounds times round_time(1)."""
    batch = check_int("expected_batch_time", "batch", batch, 1)
    total = 0.0
    for p in still_running(alpha, proposed, tokens):
        for a in range(1, batch + 1):
            total += math.comb(batch, a) * p**a * (1 - p) ** (batch - a) * round_time(a)
    return total


def predicted_speedup(alpha: float, gamma: int, c: float) -> float:
    """Wall-clock speed-up over plain decoding: expected_tokens(alpha, gamma) / (gamma c + 1), with c the
    draft's step time over the target's (the textbook model, module docstring)."""
    c = check_real("predicted_speedup", "c", c, low=0)
    return expected_tokens(alpha, gamma) / (gamma * c + 1)


def best_gamma(alpha: float, c: float, largest: int = 16) -> int:
    """The gamma in 1..largest with the largest predicted speed-up."""
    return max(range(1, largest + 1), key=lambda g: predicted_speedup(alpha, g, c))


def cost_model_speedup(
    tokens_per_round: float, t_step: float, t_draft: float, t_verify: float, t_rollback: float = 0.0
) -> float:
    """Speed-up over plain decoding from measured times (seconds, floats): tokens_per_round x t_step /
    (t_draft + t_verify + t_rollback). tokens_per_round: `expected_tokens(alpha, gamma)` or the mean
    measured per round; t_step: one plain decode step; t_draft: the draft's proposal of one round; t_verify:
    the round's verification step; t_rollback: the round's rollback (module docstring)."""
    where = "cost_model_speedup"
    tokens_per_round = check_real(where, "tokens_per_round", tokens_per_round, low=0)
    t_step = check_real(where, "t_step", t_step, low=0, low_open=True)
    t_draft = check_real(where, "t_draft", t_draft, low=0)
    t_verify = check_real(where, "t_verify", t_verify, low=0, low_open=True)
    t_rollback = check_real(where, "t_rollback", t_rollback, low=0)
    return tokens_per_round * t_step / (t_draft + t_verify + t_rollback)


def measured_cost_speedup(
    alpha: float, gamma: int, t_step: float, t_draft: float, t_verify: float, t_rollback: float = 0.0
) -> float:
    """`cost_model_speedup` with the tokens per round of the textbook's independent acceptances,
    `expected_tokens(alpha, gamma)`: the prediction from the measured acceptance rate and measured times."""
    return cost_model_speedup(expected_tokens(alpha, gamma), t_step, t_draft, t_verify, t_rollback)


def alpha_for_tokens(tokens_per_round: float, gamma: int) -> float | None:
    """The acceptance rate alpha whose `expected_tokens(alpha, gamma)` is `tokens_per_round` (bisection:
    the expectation grows with alpha); 0.0 at or below one token, None above gamma + 1 (out of reach).
    With tokens_per_round = s (t_draft + t_verify + t_rollback) / t_step: the alpha a speed-up s needs."""
    tokens_per_round = check_real("alpha_for_tokens", "tokens_per_round", tokens_per_round, low=0)
    gamma = check_int("alpha_for_tokens", "gamma", gamma, 0)
    if tokens_per_round <= 1:
        return 0.0
    if tokens_per_round > gamma + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, gamma) < tokens_per_round else (lo, mid)
    return (lo + hi) / 2
