"""The combine step of split-KV decoding: merge each row's partial (O, L) over the splits (notebook 09).

Split s of row (b, t, h) left O_s (d floats) and L_s (its logsumexp over that split's keys, -inf when
the split saw no key). The row's result is notebook 03's merge, over S parts at once:

    L = log(sum_s exp(L_s)),   O = sum_s exp(L_s - L) O_s

Bytes moved per row: S x (d + 1) floats read, d outputs and one float written; small next to the cache.
`course_lib.attention.merge.merge_many` is the same rule in PyTorch (the tests compare the two).
"""

from __future__ import annotations

import torch

from .. import runtime
from ..attention.blocks import LN2, LOG2E
from ..runtime import tl, triton

runtime.require_triton()


@triton.jit
def merge_step(m, l, acc, lse_s, o_s):
    """One step of the merge over a chunk of C splits, for R rows at once (the online form of the rule
    above): running state m (R,) (the largest L so far, natural log), l (R,) (sum of exp(L_s - m)),
    acc (R, D) (sum of exp(L_s - m) O_s); chunk lse_s (C, R) and o_s (C, R, D), fp32. Empty splits
    (L_s = -inf) weigh 0, and rows that no split saw keep m = -inf, l = 0 without a NaN."""
    m_new = tl.maximum(m, tl.max(lse_s, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2((m - m_safe) * LOG2E)  # rescales what was summed against the old max
    w = tl.math.exp2((lse_s - m_safe[None, :]) * LOG2E)  # (C, R)
    l = l * alpha + tl.sum(w, 0)
    acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o_s, 0)
    return m_new, l, acc


@triton.jit
def merge_finish(m, l, acc):
    """(O, L) of the merged rows: O = acc / l and L = m + log l, or (0, -inf) for a row no split saw."""
    empty = l == 0.0
    safe_l = tl.where(empty, 1.0, l)
    o = acc / safe_l[:, None]
    lse = tl.where(empty, float("-inf"), m + tl.math.log2(safe_l) * LN2)
    return o, lse


@triton.jit
def last_to_arrive(counter, arrivals):
    """True in the one program that increments `counter` (int32, 0 before the first arrival) to
    `arrivals`: the last of the programs that share it, which may then read what all of them stored.

    The barrier makes every thread's stores precede the atomic; the atomic (acquire-release, GPU
    scope) publishes them and, in the last program, makes the others' visible. The last program sets
    the counter back to 0, so the next launch (or CUDA-graph replay) finds it ready."""
    tl.debug_barrier()
    ticket = tl.atomic_add(counter, 1, sem="acq_rel")
    last = ticket == arrivals - 1
    tl.atomic_xchg(counter, 0, mask=last, sem="relaxed")
    return last


@triton.jit
def combine_kernel(
    O_PART, L_PART, O, L,
    stride_ps, stride_pb, stride_pt, stride_ph, stride_pd,
    stride_qs, stride_qb, stride_qt, stride_qh,
    stride_ob, stride_ot, stride_oh, stride_od,
    stride_lb, stride_lt, stride_lh,
    T_Q, H_Q, NUM_SPLITS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """One program per row (b, t, h). Grid: (B * Tq * Hq,). Partials: O_PART (S, B, Tq, Hq, d) fp32,
    L_PART (S, B, Tq, Hq) fp32; results O (B, Tq, Hq, d) in the output dtype, L (B, Tq, Hq) fp32."""
    pid = tl.program_id(0)
    h = pid % H_Q
    t = (pid // H_Q) % T_Q
    b = (pid // (H_Q * T_Q)).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM
    # All S partials of this row at once, HBM -> registers: L_s (S, 1) and O_s (S, 1, d).
    lse_s = tl.load(
        L_PART + offs_s * stride_qs + b * stride_qb + t * stride_qt + h * stride_qh,
        mask=s_ok,
        other=float("-inf"),
    )
    o_s = tl.load(
        O_PART + offs_s[:, None] * stride_ps + b * stride_pb + t * stride_pt + h * stride_ph
        + offs_d[None, :] * stride_pd,
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # fmt: skip
    m = tl.full([1], float("-inf"), dtype=tl.float32)
    m, l, acc = merge_step(m, tl.zeros([1], dtype=tl.float32), tl.zeros([1, BLOCK_D], dtype=tl.float32),
                           lse_s[:, None], o_s[:, None, :])  # fmt: skip
    o, lse = merge_finish(m, l, acc)
    tl.store(
        O + b * stride_ob + t * stride_ot + h * stride_oh + offs_d[None, :] * stride_od,
        o.to(O.dtype.element_ty),
        mask=d_ok[None, :],
    )
    tl.store(L + b * stride_lb + t * stride_lt + h * stride_lh + tl.arange(0, 1), lse)


def combine(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge partials o_part (S, B, Tq, Hq, d) fp32 and lse_part (S, B, Tq, Hq) fp32 into out
    (B, Tq, Hq, d) (any float dtype) and lse (B, Tq, Hq) fp32, in place. Taught in notebook 09."""
    S, B, T, H, d = o_part.shape
    if B * T * H == 0:
        return
    combine_kernel[(B * T * H,)](
        o_part, lse_part, out, lse,
        *o_part.stride(), *lse_part.stride(), *out.stride(), *lse.stride(),
        T, H, S,
        HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_S=max(16, triton.next_power_of_2(S)),
    )  # fmt: skip
