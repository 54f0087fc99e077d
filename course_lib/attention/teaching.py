"""The optimisation ladder's first rungs: teaching variants of two pieces of the attention kernels
(notebook 08, `course_lib.bench.ladder`).

The production kernels (`forward.py`, `backward.py`) take each piece as a `tl.constexpr` function
argument whose default is the production helper; a rung swaps in one of the variants below, and the
kernel around it stays the same. `configs.teaching_hooks` maps a `config` dict's switches to them:

- `exp2=False` (rungs FWD0 and BWD0): the textbook softmax in natural-log units. The scores are
  multiplied by the scale, then `tl.exp` is taken (which the hardware computes as ex2(x * log2 e): one
  more multiply per score); the forward's L is m + log(l). The production helpers work in base 2 with
  log2(e) folded into the scale: one multiply-add and one ex2 per score (`kernels.softmax.softmax_step`,
  `kernels.softmax.logsumexp`, `backward.probabilities`). The next rung (FWD1, BWD1) measures that gain.
- `skip_masked_blocks=False` (rungs FWD0, FWD1, BWD0, BWD1): a program visits every block and masks
  every tile, as a first kernel would, including causal tiles above the diagonal where every score is
  masked. The production range (`blocks.kv_block_range`, `blocks.q_block_range`) skips those and
  masks only the diagonal and ragged-end blocks. The rung after (FWD2, BWD2) measures that gain.

Each variant has the production helper's arguments and results, so the two are interchangeable.
"""

from __future__ import annotations

from ..kernels.softmax import LN2
from ..runtime import tl, triton

__all__ = [
    "every_kv_block",
    "every_q_block",
    "logsumexp_natural",
    "probabilities_natural",
    "softmax_step_natural",
]


# --------------------------------------------------------------------------------------------------
# Rung 0 of each pass: natural exponentials (`exp2=False`)
# --------------------------------------------------------------------------------------------------
@triton.jit
def softmax_step_natural(s, m_i, l_i, sm_scale, MASK: tl.constexpr):
    """`kernels.softmax.softmax_step` in natural-log units: scale the (BLOCK_M, BLOCK_N) scores S, then exp.
    m stays in natural-log units (`logsumexp_natural` finishes it). Returns (P, alpha, l, m)."""
    s = s * sm_scale  # one multiply per score, before the exponential's own
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = m_new
    if MASK:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: exp(-inf) = 0, not NaN
    p = tl.exp(s - m_ref[:, None])
    alpha = tl.exp(m_i - m_ref)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def logsumexp_natural(m_i, l_i):
    """`kernels.softmax.logsumexp` for `softmax_step_natural`'s state: L = m + log(l)."""
    return m_i + tl.log(l_i)


@triton.jit
def probabilities_natural(s, lse2, qk_scale):
    """`backward.probabilities` with the natural exponential: P = exp(S * scale - L), scale and L taken
    back to natural units from the base-2 arguments the kernels pass (qk_scale = scale * log2 e,
    L2 = L * log2 e)."""
    return tl.exp(s * (qk_scale * LN2) - lse2 * LN2)


# --------------------------------------------------------------------------------------------------
# Rungs 0 and 1 of each pass: every block visited, every tile masked (`skip_masked_blocks=False`)
# --------------------------------------------------------------------------------------------------
@triton.jit
def every_kv_block(
    m_start, N_Q, N_K, offset, split, NUM_SPLITS: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """`blocks.kv_block_range` of a naive kernel: (lo, mid, hi) = (0, 0, N_K), all keys in the masked
    stage, causal blocks above the diagonal too. (No split: the ladder's kernels take the whole range.)"""
    return 0, 0, N_K


@triton.jit
def every_q_block(n_start, N_Q, offset, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """`blocks.q_block_range` of a naive kernel: every query block in the masked stage, (0, hi, hi)."""
    hi = tl.cdiv(N_Q, BLOCK_M) * BLOCK_M
    return 0, hi, hi
