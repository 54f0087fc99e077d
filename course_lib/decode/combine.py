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
from ..checks import check_int
from ..kernels import bound
from ..kernels.softmax import LN2, LOG2E
from ..pdl import launch_options, wait_for_prior_grid
from ..runtime import tl, triton

runtime.require_triton()


@triton.jit
def combine_kernel(
    O_PART, L_PART, O, L,
    stride_ps, stride_pb, stride_pt, stride_ph, stride_pd,
    stride_qs, stride_qb, stride_qt, stride_qh,
    stride_ob, stride_ot, stride_oh, stride_od,
    stride_lb, stride_lt, stride_lh,
    T_Q, H_Q, NUM_SPLITS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program per row (b, t, h). Grid: (B * Tq * Hq,). Partials: O_PART (S, B, Tq, Hq, d) fp32,
    L_PART (S, B, Tq, Hq) fp32; results O (B, Tq, Hq, d) in the output dtype, L (B, Tq, Hq) fp32.
    PDL: launched while the split kernel still runs; every program waits for it before reading anything
    (`course_lib.pdl`)."""
    zero = 0
    if PDL:
        zero = wait_for_prior_grid()  # the masks below, and so the loads, depend on the wait
    pid = tl.program_id(0)
    h = pid % H_Q
    t = (pid // H_Q) % T_Q
    b = (pid // (H_Q * T_Q)).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS + zero
    # The S logsumexps of this row: HBM -> registers.
    lse_s = tl.load(
        L_PART + offs_s * stride_qs + b * stride_qb + t * stride_qt + h * stride_qh,
        mask=s_ok,
        other=float("-inf"),
    )
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # a row no split saw: all weights 0, no NaN
    w = tl.math.exp2((lse_s - m_safe) * LOG2E)  # exp(L_s - max): 0 for empty splits
    total = tl.sum(w, 0)
    # The S partial outputs: (BLOCK_S, d) fp32, HBM -> registers.
    o_s = tl.load(
        O_PART
        + offs_s[:, None] * stride_ps
        + b * stride_pb
        + t * stride_pt
        + h * stride_ph
        + offs_d[None, :] * stride_pd,
        mask=(s_ok & (lse_s > float("-inf")))[:, None]
        & (offs_d < HEAD_DIM)[None, :],  # an empty split's O unread
        other=0.0,
    )
    empty = total == 0.0
    safe_total = tl.where(empty, 1.0, total)
    o = tl.sum(w[:, None] * o_s, 0) / safe_total
    lse = tl.where(empty, float("-inf"), m_safe + tl.math.log2(safe_total) * LN2)
    tl.store(
        O + b * stride_ob + t * stride_ot + h * stride_oh + offs_d * stride_od,
        o.to(O.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )
    tl.store(L + b * stride_lb + t * stride_lt + h * stride_lh, lse)


@triton.jit
def combine_rows_kernel(
    O_PART, L_PART, O, L,
    stride_ps, stride_pb, stride_pt, stride_ph, stride_pd,
    stride_qs, stride_qb, stride_qt, stride_qh,
    stride_ob, stride_ot, stride_oh, stride_od,
    stride_lb, stride_lt, stride_lh,
    T_Q, H_Q, NUM_ROWS, NUM_SPLITS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """`combine_kernel` for many rows (a prefill's keys split: 3280 tokens x 16 heads is 52k rows): BLOCK_R rows
    (b, t, h) a program, the splits taken one after another with notebook 03's running merge (the row max m, the
    sum of exp(L_s - m), the sum of exp(L_s - m) O_s, rescaled when m grows). Grid: (cdiv(rows, BLOCK_R),). One
    program per row took 0.31 ms for 105k rows of d = 128 and 2 splits on an H200, ten times their bytes' time.
    BLOCK_S > 0 (a power of 2 >= NUM_SPLITS): every split's (O, L) loaded at once, (BLOCK_R, BLOCK_S, d), as
    `combine_kernel` does for one row: two waits for memory in all, not two a split."""
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < NUM_ROWS
    h = r % H_Q
    t = (r // H_Q) % T_Q
    b = (r // (H_Q * T_Q)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    o_mask = r_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    l_rows = L_PART + b * stride_qb + t * stride_qt + h * stride_qh
    o_rows = O_PART + (b * stride_pb + t * stride_pt + h * stride_ph)[:, None] + offs_d[None, :] * stride_pd
    if BLOCK_S > 0:
        offs_s = tl.arange(0, BLOCK_S)
        s_ok = r_ok[:, None] & (offs_s < NUM_SPLITS)[None, :]
        lse_s = tl.load(l_rows[:, None] + offs_s[None, :] * stride_qs, mask=s_ok, other=float("-inf"))
        m = tl.max(lse_s, 1)
        m_safe = tl.where(m == float("-inf"), 0.0, m)  # a row no split saw: all weights 0, no NaN
        w = tl.math.exp2((lse_s - m_safe[:, None]) * LOG2E)  # (BLOCK_R, BLOCK_S); 0 for empty splits
        total = tl.sum(w, 1)
        o_s = tl.load(
            o_rows[:, None, :] + (offs_s * stride_ps)[None, :, None],
            mask=o_mask[:, None, :] & (s_ok & (lse_s > float("-inf")))[:, :, None],  # an empty split unread
            other=0.0,
        )
        acc = tl.sum(w[:, :, None] * o_s, 1)
    else:
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        for s in range(NUM_SPLITS):
            lse_s = tl.load(l_rows + s * stride_qs, mask=r_ok, other=float("-inf"))
            m_new = tl.maximum(m, lse_s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows no split saw yet: weights 0, no NaN
            alpha = tl.math.exp2((m - m_safe) * LOG2E)
            w = tl.math.exp2((lse_s - m_safe) * LOG2E)
            # a split that saw no key (L = -inf) is not read: its O may hold anything (stream-K's unused slot)
            o_s = tl.load(o_rows + s * stride_ps, mask=o_mask & (lse_s > float("-inf"))[:, None], other=0.0)
            acc = acc * alpha[:, None] + w[:, None] * o_s
            total = total * alpha + w
            m = m_new
    empty = total == 0.0
    safe_total = tl.where(empty, 1.0, total)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    lse = tl.where(empty, float("-inf"), m_safe + tl.math.log2(safe_total) * LN2)
    o_ptrs = O + (b * stride_ob + t * stride_ot + h * stride_oh)[:, None] + offs_d[None, :] * stride_od
    tl.store(o_ptrs, (acc / safe_total[:, None]).to(O.dtype.element_ty), mask=o_mask)
    tl.store(L + b * stride_lb + t * stride_lt + h * stride_lh, lse, mask=r_ok)


# From this many rows on (and without PDL) `combine` takes `combine_rows_kernel`, ROWS_PER_PROGRAM rows a program:
# decoding's and cascade's few thousand rows keep one program each (their latency counts, not their bytes).
MANY_ROWS = 16384
ROWS_PER_PROGRAM = 16
# `combine_rows_kernel` loads every split at once where a program's (rows, splits, d) block, padded to powers of 2,
# holds at most this many floats (128 registers a thread at 4 warps); else it takes the splits one after another.
# Graph replays on an H200 (2026-12-01), us, in turn / at once: a cached prefill's 3280 tokens x 16 heads, d = 64,
# 16 rows a program, 2 / 3 / 5 splits 15.0 / 14.0, 19.5 / 19.1, 28.2 / 24.3; 32 heads, d = 128, 41.3 / 38.7, 56.3 /
# 52.8, 84.6 / 76.4 (16384 floats); cascade's merge (5 slots, 4 rows) 8.5 / 7.0.
SLOTS_AT_ONCE = 16384


def combine(
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    pdl: bool = False,
    rows_per_program: int | None = None,
) -> None:
    """Merge partials o_part (S, B, Tq, Hq, d) fp32 and lse_part (S, B, Tq, Hq) fp32 into out
    (B, Tq, Hq, d) (any float dtype) and lse (B, Tq, Hq) fp32, in place. Taught in notebook 09.
    From MANY_ROWS rows on, ROWS_PER_PROGRAM rows a program (`combine_rows_kernel`); rows_per_program: that
    many rows a program (rounded up to a power of 2) whatever the count of rows, not with pdl (cascade
    attention's merge takes 4); a program loads all its splits at once where they fit in `SLOTS_AT_ONCE`.
    pdl: launch with programmatic dependent launch (`course_lib.pdl`; GPUs that support it only)."""
    if rows_per_program is not None:
        rows_per_program = check_int("combine", "rows_per_program", rows_per_program, 1)
        if pdl:
            raise ValueError(
                "combine: rows_per_program is for launches without pdl (one program a row with it)"
            )
    S, B, T, H, d = o_part.shape
    if B * T * H == 0:
        return
    if rows_per_program is None and B * T * H >= MANY_ROWS and not pdl:
        rows_per_program = ROWS_PER_PROGRAM
    if rows_per_program is not None:
        rows_per_program = runtime.next_power_of_2(rows_per_program)  # a block of the kernel's rows
        block_d, block_s = runtime.next_power_of_2(d), runtime.next_power_of_2(S)
        at_once = rows_per_program * block_s * block_d <= SLOTS_AT_ONCE
        bound.launch(combine_rows_kernel, (triton.cdiv(B * T * H, rows_per_program),),
            o_part, lse_part, out, lse,
            *o_part.stride(), *lse_part.stride(), *out.stride(), *lse.stride(),
            T, H, B * T * H, S,
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_R=rows_per_program, BLOCK_S=block_s if at_once else 0,
        )  # fmt: skip
        return
    bound.launch(combine_kernel, (B * T * H,),
        o_part, lse_part, out, lse,
        *o_part.stride(), *lse_part.stride(), *out.stride(), *lse.stride(),
        T, H, S,
        HEAD_DIM=d, BLOCK_D=runtime.next_power_of_2(d), BLOCK_S=max(16, runtime.next_power_of_2(S)),
        PDL=pdl, **launch_options(pdl),
    )  # fmt: skip
