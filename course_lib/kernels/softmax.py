"""The online softmax of every attention kernel, in base 2 (notebooks 03, 06; decoding, notebook 09).

exp(x) = exp2(x * LOG2E) and log(x) = log2(x) * LN2: the kernels fold LOG2E into the softmax scale,
so a score costs one multiply-add and one ex2, and keep the running max m in base-2 units.
`softmax_step` is one step of the online softmax over a tile of scores, `logsumexp` its finish.
"""

from __future__ import annotations

from ..runtime import tl, triton

# The base-2 constants of the kernels' softmax: exp(x) = exp2(x * LOG2E), log(x) = log2(x) * LN2.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def softmax_step(s, m_i, l_i, sm_scale, MASK: tl.constexpr, SCALED: tl.constexpr = False):
    """One online-softmax step over a (BLOCK_M, BLOCK_N) tile of raw scores S = Q K^T (notebook 06).

    Base-2 exponentials with the scale folded in: exp(x * scale) = exp2(x * qk_scale), one multiply-add
    and one ex2 per score; the running max m is kept in those base-2 units (`logsumexp` converts).
    MASK: the tile may hold masked (-inf) scores, so a row may have seen no key yet (m = -inf); its
    exponentials are then taken against 0 instead of -inf. SCALED: s already holds S x scale x log2(e)
    (split-KV decoding, notebook 09, scales the scores before it masks them, with log2(e) folded into
    the scale on the host); sm_scale is then not used. Returns (P, alpha, l, m): the tile's
    unnormalised probabilities, the factor that rescales the old l and accumulator, the new l and m."""
    if SCALED:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    else:
        qk_scale = sm_scale * LOG2E
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_ref = m_new
    if MASK:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: exp(-inf) = 0, not NaN
    if SCALED:
        p = tl.math.exp2(s - m_ref[:, None])
    else:
        p = tl.math.exp2(s * qk_scale - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def logsumexp(m_i, l_i):
    """L = logsumexp of a row's scaled scores, natural-log units, from `softmax_step`'s base-2 m and l."""
    return (m_i + tl.math.log2(l_i)) * LN2
