"""Which drafted tokens the target keeps (notebook 15).

The target has scored the pending token and k drafted tokens x_1..x_k in one step, so it holds k + 1
next-token distributions p_0..p_k (p_i: the distribution after x_1..x_i). The draft drew x_i from q_{i-1}.

- Greedy (temperature 0): keep x_i while it is the target's argmax; the first mismatch is replaced by the
  target's argmax, and if all k are kept the target's argmax after x_k comes free. The output is the
  target's greedy output, token for token.
- Sampling (Leviathan et al. 2023, Chen et al. 2023): keep x_i with probability min(1, p(x_i) / q(x_i));
  at the first rejection draw from norm(max(0, p - q)); if all k are kept, draw one more from p_k. Each
  emitted token is then distributed exactly as the target's p, whatever the draft: P(emit y) =
  min(q(y), p(y)) + (1 - sum_x min(q(x), p(x))) * max(0, p(y) - q(y)) / sum_x max(0, p(x) - q(x)) = p(y).
"""

from __future__ import annotations

import torch


def accept_greedy(draft: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """(tokens kept, next token): draft (k,) token ids, target_argmax (k + 1,) the target's argmax after
    the pending token and after each drafted token."""
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return n, int(target_argmax[n])


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last axis: what to draw from after a rejection. When p == q (no mass
    left: a rejection then has probability 0, floating-point aside) p itself is returned."""
    r = (p - q).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)


def accept_sampled(p: torch.Tensor, q: torch.Tensor, draft: list[int], generator=None) -> tuple[int, int]:
    """(tokens kept, next token) by the rejection-sampling rule. p (k + 1, V) the target's probabilities,
    q (k, V) the draft's (one-hot rows for a deterministic draft such as n-gram lookup), draft (k,) the
    drafted ids; `generator` a CPU torch.Generator. Computed in float64 on the CPU."""
    p, q = p.double().cpu(), q.double().cpu()
    for i, x in enumerate(draft):
        r = float(torch.rand((), dtype=torch.float64, generator=generator))
        if r * float(q[i, x]) < float(p[i, x]):  # r < p/q: accepted with probability min(1, p/q)
            continue
        return i, int(torch.multinomial(residual(p[i], q[i]), 1, generator=generator))
    k = len(draft)
    return k, int(torch.multinomial(p[k], 1, generator=generator))


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / temperature) over the last axis in float64 (temperature > 0), on the CPU."""
    logits = logits.double().cpu()
    return torch.softmax((logits - logits.amax(-1, keepdim=True)) / temperature, -1)
