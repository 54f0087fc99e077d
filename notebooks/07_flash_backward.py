# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 07 · The FlashAttention-2 backward pass in Triton
#
# The forward pass of notebook 06 kept nothing of size Nq x Nk: only O and the logsumexp L. The backward pass
# must produce dQ, dK and dV from dO without ever holding P either. It rebuilds P tile by tile from Q, K and
# L, exactly as notebook 04 did in PyTorch, but now inside Triton kernels.
#
# **Learning goals**
# 1. Derive the backward of attention in the tile form FlashAttention-2 uses: D = rowsum(dO ∘ O), P rebuilt
#    from L, dS = P ∘ (dP − D). Write one tile's backward yourself, and fix a backward that rebuilds P from
#    the running max m instead of L.
# 2. Write the causal loop bounds of the dK/dV kernel: which query blocks a block of keys visits, and which
#    of them need the mask.
# 3. Write the two loops of a backward that needs no atomics, in Triton: the dK/dV kernel's loop over query
#    blocks (one program per K/V block) and the dQ kernel's loop over K/V blocks (one program per query
#    block). The kernel for D, the kernels' set-up, their loop bounds and the launchers are given. Check
#    them against float64 autograd on ragged, unequal, causal shapes, and (on a GPU) time them beside
#    course_lib's backward and PyTorch's.
# 4. Weigh the single-pass variant that accumulates dQ with atomic adds (course_lib's `dq_mode="atomic"`)
#    against two kernels: what each costs, and which wins at one shape on a GPU (measured, Triton against
#    Triton).
# 5. Use `course_lib.FlashAttentionTriton` (forward + backward in one `autograd.Function`), check what it
#    saves, and run `torch.autograd.gradcheck` on it in float64.
#
# The finished kernels are in `course_lib/attention/backward.py`
# (`course_lib.attention.backward.backward(..., dq_mode="two_kernel" | "atomic")`).

# %% [markdown]
# ## 0. Setup and sizes
#
# `import course_lib` first (it decides, before any kernel is defined, whether Triton compiles or
# interprets). The forward pass is course_lib's (`forward.forward`, notebook 06); the backward kernels below
# are this notebook's own, and you write their loops.

# %%
import functools
import math

import matplotlib.pyplot as plt
import numpy as np
import torch

import course_lib
from course_lib import records
from course_lib.attention import backward as lib_backward
from course_lib.attention import forward as lib_forward
from course_lib.attention.blocks import kv_block_range, kv_block_range_py, q_block_range, q_block_range_py
from course_lib.attention.reference import attention
from course_lib.checks import causal_alignment, causal_offset
from course_lib.exercises import (
    check,
    check_cases,
    check_masked_memory_ops,
    guarded_empty,
    predict,
    time_kernels,
)
from course_lib.perf.plotting import plot_series
from course_lib.perf.timing import attention_flops, benchmark
from course_lib.runtime import tl, triton
from course_lib.testing import random_qkv, reference_outputs, run_cases

DEVICE = course_lib.DEVICE
print(course_lib.RUNTIME.describe())

# %%
B, H, D = course_lib.pick(cpu=(1, 2, 32), gpu=(2, 4, 64))  # batch, heads, head dim
N_Q, N_K = course_lib.pick(cpu=(100, 75), gpu=(1000, 1531))  # ragged and unequal on purpose
BLOCK_M, BLOCK_N = course_lib.pick(cpu=(32, 32), gpu=(64, 64))  # the teaching launches
CHECK_BLOCK = 32  # the float32 checks' tiles (sections 4 and 5): quick to compile (section 4 says why)
TIME_SHAPE = course_lib.pick(cpu=(1, 2, 128, 32), gpu=(4, 16, 4096, 64))  # (B, H, N, d) your backward is timed at
GRADCHECK_SHAPE, GRADCHECK_NK = (1, 2, 24, 16), 20  # float64 gradcheck, CPU only (the interpreter)
BENCH_NS = course_lib.pick(cpu=[], gpu=[4096])  # GPU timing of the two dQ strategies (each length compiles anew)
BENCH_DS, BENCH_TOKENS = (128,), 16384  # head dims timed live; B*N tokens (H*d = 2048, as in the papers)
LOG2E = math.log2(math.e)
_ = torch.manual_seed(0)

# %% [markdown]
# ## 1. The backward, tile by tile
#
# Forward, for one (batch, head), with $s$ the softmax scale: $S = s\,QK^\top$, $P = \mathrm{softmax}(S)$ row
# by row, $O = PV$, and $L_i = \log\sum_j e^{S_{ij}}$. Given $dO = \partial\mathcal L/\partial O$:
#
# $$dV = P^\top dO, \qquad dP = dO\,V^\top, \qquad dS_{ij} = P_{ij}\,(dP_{ij} - D_i), \qquad
#   dQ = s\, dS\,K, \qquad dK = s\, dS^\top Q,$$
#
# where $D_i = \sum_j P_{ij}\,dP_{ij}$ comes from the softmax's Jacobian. Two facts make this work in tiles:
# - **P is rebuilt from L**: $P_{ij} = e^{S_{ij} - L_i}$ needs only row $i$'s L, one float per query saved by
#   the forward. No running max, no second pass.
#   (In base 2: $P = 2^{\,QK^\top \cdot s\log_2 e\, -\, L\log_2 e}$.)
# - **D needs no P**: $D_i = \sum_j P_{ij} (dO_i \cdot V_j) = dO_i \cdot \sum_j P_{ij} V_j = dO_i \cdot O_i$.
#   So $D = \mathrm{rowsum}(dO \circ O)$: one cheap pass over two N x d matrices, before the main kernels.
#
# Check the identity numerically:

# %%
q, k, v = random_qkv((N_Q, D), N_K, dtype=torch.float64)
P = torch.softmax(q @ k.T * D**-0.5, dim=-1)
dO = torch.randn(N_Q, D, dtype=torch.float64)
dP = dO @ v.T
torch.testing.assert_close((P * dP).sum(-1), (dO * (P @ v)).sum(-1))
print("rowsum(P * dP) == rowsum(dO * O)")

# %% [markdown]
# Who computes what. dK and dV sum over **query** rows; dQ sums over **keys**. A program that owns a block of
# keys can accumulate its dK and dV in registers while it loops over all query blocks — but its contribution
# to dQ belongs to rows that every other key-block program also contributes to. Two ways out:
# - **two kernels** (no atomics): a dK/dV kernel (one program per K/V block, looping over query blocks), then
#   a dQ kernel (one program per query block, looping over K/V blocks). Each accumulates in registers and
#   writes its result once; the price is computing S (to rebuild P) and dP in both kernels;
# - **one kernel with atomics**: the dK/dV kernel also adds each contribution dS K into dQ with
#   `tl.atomic_add`, in float32.
#
# You will write the first (sections 4 and 5); section 7 weighs the second, course_lib's `dq_mode="atomic"`.

# %% [markdown]
# **Exercise 1 (the backward of one tile).** Before writing kernels, write the lines every backward kernel
# below runs for one tile, in PyTorch. Given one block of query rows (`q_i`, `do_i`, their saved logsumexp
# `L_i` and `D_i`) and one block of keys (`k_j`, `v_j`), return this tile's contributions
# `(dQ_i, dK_j, dV_j)`. Rebuild P from L (no max, no normalisation), then dP, dS, and the three products.
# Checked against autograd with the keys cut into two tiles: the dQ contributions of the two are summed, their
# dK and dV stacked (normalising inside a tile would be right for one tile holding every key, and wrong here).


# %%
def tile_backward(q_i, k_j, v_j, do_i, L_i, D_i, scale):
    S = q_i @ k_j.T * scale
    ### BEGIN SOLUTION
    P = torch.exp(S - L_i[:, None])
    dP = do_i @ v_j.T
    dS = P * (dP - D_i[:, None])
    return dS @ k_j * scale, dS.T @ q_i * scale, P.T @ do_i
    ### END SOLUTION


# %% tags=["check"]
q1, k1, v1 = random_qkv((N_Q, D), N_K, dtype=torch.float64)
do1 = torch.randn(N_Q, D, dtype=torch.float64)
o1, L1 = attention(q1, k1, v1, return_lse=True)
_, grads1 = reference_outputs(q1, k1, v1, False, grad_out=do1)


def over_two_tiles(tile_fn, *row_stats):
    """tile_fn(q1, k_j, v_j, do1, *row_stats, scale) on two tiles of keys (a third, then the rest): the dQ
    contributions summed, dK and dV stacked, as the kernels below combine their tiles."""
    cut = N_K // 3
    tiles = [tile_fn(q1, k1[a:b], v1[a:b], do1, *row_stats, D**-0.5) for a, b in ((0, cut), (cut, N_K))]
    return tiles[0][0] + tiles[1][0], torch.cat([t[1] for t in tiles]), torch.cat([t[2] for t in tiles])


check(
    "tile_backward",
    lambda: over_two_tiles(tile_backward, L1, (do1 * o1).sum(-1)),
    grads1,
    parts=["dQ", "dK", "dV"],
)

# %% [markdown]
# **Exercise 2 (find the bug: m instead of L).** A first attempt at the backward saved the running max `m` of
# each row in the forward instead of L, and rebuilt P with it. The cell below runs that version: its
# gradients are wrong. Explain why from the values it prints, then write `tile_backward_fixed`: the same
# function with the bug fixed (it may call only what `tile_backward_from_m` calls).


# %%
def tile_backward_from_m(q_i, k_j, v_j, do_i, m_i, D_i, scale):
    S = q_i @ k_j.T * scale
    P = torch.exp(S - m_i[:, None])
    dP = do_i @ v_j.T
    dS = P * (dP - D_i[:, None])
    return dS @ k_j * scale, dS.T @ q_i * scale, P.T @ do_i


m1 = (q1 @ k1.T * D**-0.5).amax(dim=-1)  # what the forward knows as m at the end of its loop
dq_bug, _, dv_bug = tile_backward_from_m(q1, k1, v1, do1, m1, (do1 * o1).sum(-1), D**-0.5)
print(f"max |dV error| with m: {(dv_bug - grads1[2]).abs().max():.2f}")
print(f"rows of exp(S - m) sum to {torch.exp(q1 @ k1.T * D**-0.5 - m1[:, None]).sum(-1)[:4].numpy().round(2)} ...")


# %%
def tile_backward_fixed(q_i, k_j, v_j, do_i, m_i, l_i, D_i, scale):
    """The same inputs, plus l_i: the running sum the forward ended with (L = m + log l)."""
    S = q_i @ k_j.T * scale
    ### BEGIN SOLUTION
    P = torch.exp(S - m_i[:, None]) / l_i[:, None]
    ### END SOLUTION
    dP = do_i @ v_j.T
    dS = P * (dP - D_i[:, None])
    return dS @ k_j * scale, dS.T @ q_i * scale, P.T @ do_i


# %% tags=["check"]
l1 = torch.exp(L1 - m1)
check(
    "tile_backward_fixed",
    lambda: over_two_tiles(tile_backward_fixed, m1, l1, (do1 * o1).sum(-1)),
    grads1,
    parts=["dQ", "dK", "dV"],
)

# %% [markdown]
# ## 2. Causal: which blocks each kernel visits
#
# Before the kernels, their loop bounds. Which blocks does a program visit, and which of them need the mask?
# course_lib's kernels ask one helper, `course_lib.attention.blocks`: `kv_block_range` gives a query block's
# keys (the forward and the dQ kernel), `q_block_range` a key block's queries (the dK/dV kernel), each as
# three boundaries `(lo, mid, hi)`; what lies before lo is skipped. For a query block's keys, [lo, mid) runs
# unmasked and [mid, hi) masked (the diagonal comes last); for a key block's queries the other way round,
# [lo, mid) masked and [mid, hi) unmasked (the diagonal comes first). Their Python twins,
# `kv_block_range_py` and `q_block_range_py`, run here; the kernels of sections 4 and 5 call the Triton ones.
# Below they are compared block by block with the element-wise causal mask: a pair of blocks must be skipped
# exactly when none of its (query, key) pairs is visible, and may run unmasked only when all of them are.


# %% [markdown]
# **Exercise 3 (the dK/dV kernel's causal loop bounds).** A dK/dV program owns the keys `n0 ... n0 +
# block_n - 1` and loops over query blocks starting at multiples of `block_m`. Return `(lo, hi_masked)`:
# the loop starts at query row `lo` (earlier query blocks see none of these keys) and masks the query blocks
# starting in `[lo, hi_masked)`; the blocks from `hi_masked` to the end see every key of the block and run
# unmasked. Both are multiples of `block_m`, or `n_q`. Top-left alignment: query i sees key j when j <= i.
# The check compares the blocks your bounds visit and mask with the element-wise causal mask.


# %%
def dkdv_bounds(n0, block_m, block_n, n_q):
    ### BEGIN SOLUTION
    lo = n0 // block_m * block_m
    hi_masked = min(math.ceil((n0 + block_n - 1) / block_m) * block_m, n_q)
    return lo, hi_masked
    ### END SOLUTION


# %% tags=["check"]
def dkdv_plan(bounds, n_q, n_k, block_m, block_n):
    """Sorted (first query row, key block, masked) triples a dK/dV kernel with these bounds visits, in its
    two stages as the kernel runs them: masked query blocks from lo to hi_masked, then unmasked ones from
    hi_masked to n_q (a bound off a block boundary shows as rows that start mid-block, or twice)."""
    out = []
    for n0 in range(0, n_k, block_n):
        lo, hi_masked = bounds(n0, block_m, block_n, n_q)
        out += [(m0, n0 // block_n, 1) for m0 in range(lo, hi_masked, block_m)]
        out += [(m0, n0 // block_n, 0) for m0 in range(hi_masked, n_q, block_m)]
    return np.array(sorted(out))


def course_lib_dkdv_bounds(n0, block_m, block_n, n_q):
    """The same two bounds from course_lib's helper (top-left causal: offset 0): lo and mid."""
    lo, mid, _hi = q_block_range_py(n0, n_q, 0, block_m, block_n, causal=True)
    return lo, mid


CASES = [(256, 256, 32, 32), (100, 75, 32, 32), (300, 200, 64, 32), (200, 300, 32, 64)]
check(
    "dkdv_bounds",
    lambda: [dkdv_plan(dkdv_bounds, *c) for c in CASES],
    [dkdv_plan(course_lib_dkdv_bounds, *c) for c in CASES],
)

# %% [markdown]
# course_lib's helpers take one more argument, an **offset**, for the two causal alignments: top-left
# (query i sees keys j <= i, offset 0) and bottom-right (j <= i + Nk - Nq, offset Nk - Nq: the queries are
# the last Nq positions, as with a KV cache; with Nq > Nk the first Nq - Nk rows see no key at all). Both
# kernels' plans from the helpers, for both alignments, on ragged and unequal shapes:


# %%
def visited(n_q, n_k, block_m, block_n, offset=0):
    """{(query block, key block): masked?} for each backward kernel's causal loops, from course_lib's helpers."""
    dkdv, dq = {}, {}
    for n0 in range(0, n_k, block_n):  # one dK/dV program per key block: query rows [lo, hi), masked below mid
        lo, mid, hi = q_block_range_py(n0, n_q, offset, block_m, block_n, causal=True)
        for m0 in range(lo, min(hi, n_q), block_m):
            dkdv[m0 // block_m, n0 // block_n] = m0 < mid
    for m0 in range(0, n_q, block_m):  # one dQ program per query block: keys [lo, hi), masked from mid
        lo, mid, hi = kv_block_range_py(m0, n_q, n_k, offset, block_m, block_n, causal=True)
        for n0 in range(lo, hi, block_n):
            dq[m0 // block_m, n0 // block_n] = n0 >= mid
    return dkdv, dq


for n_q, n_k, bm, bn in CASES:
    for alignment, offset in (("top-left", 0), ("bottom-right", n_k - n_q)):
        i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
        mask = j <= i + offset
        dkdv, dq = visited(n_q, n_k, bm, bn, offset)
        blocks = [(mb, nb) for mb in range(math.ceil(n_q / bm)) for nb in range(math.ceil(n_k / bn))]
        for mb, nb in blocks:
            tile = mask[mb * bm : (mb + 1) * bm, nb * bn : (nb + 1) * bn]
            where = f"block ({mb}, {nb}) of {n_q} x {n_k}, {alignment}"
            for kernel, plan in (("dK/dV", dkdv), ("dQ", dq)):
                assert ((mb, nb) in plan) == bool(tile.any()), f"{kernel} {where}: skip is wrong"
                if (mb, nb) in plan and not tile.all():
                    assert plan[mb, nb], f"{kernel} {where}: needs a mask"
        print(f"{n_q} x {n_k}, blocks {bm} x {bn}, {alignment:12}: each kernel visits {len(dq)} of "
              f"{len(blocks)} block pairs")  # fmt: skip

# %% [markdown]
# ## 3. Kernel 1: D = rowsum(dO ∘ O)
#
# One program per (query block, z): read a block of O and dO (HBM → registers), multiply, sum each row, write
# BLOCK_M floats. This one is given.
#
# To keep the kernels short, this notebook's launchers make the (Z = B·H, N, d) tensors contiguous, so a row
# is `HEAD_DIM` elements apart and a head `N * HEAD_DIM`; course_lib's kernels take any strides instead, as
# the forward of notebook 06 did.


# %%
@triton.jit
def bwd_preprocess(O, DO, Delta, N_Q, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    start_m = tl.program_id(0)
    z = tl.program_id(1).to(tl.int64)
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = z * N_Q * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :]
    mask = rows[:, None] < N_Q
    o = tl.load(O + ptrs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Delta + z * N_Q + rows, tl.sum(o * do, axis=1), mask=rows < N_Q)


def prepare(do, q, k, v, o, L, causal, block_m):
    """What both backward kernels take: the contiguous (Z, N, d) tensors, L (Z, Nq) with -inf turned into
    +inf (a row that sees no key, bottom-right with Nq > Nk: its P = exp(S - inf) = 0, not exp(S + inf)),
    D from kernel 1, the scale, the causal offset, and the compile-time flags."""
    *_, n_q, d = q.shape
    n_k = k.shape[-2]
    q3, o3, do3 = (t.reshape(-1, n_q, d).contiguous() for t in (q, o, do))
    k3, v3 = (t.reshape(-1, n_k, d).contiguous() for t in (k, v))
    L3 = L.reshape(-1, n_q).float()
    L3 = torch.where(L3 == float("-inf"), float("inf"), L3).contiguous()
    delta = torch.empty(q3.shape[:2], device=q.device, dtype=torch.float32)
    bwd_preprocess[(triton.cdiv(n_q, block_m), q3.shape[0])](o3, do3, delta, n_q, HEAD_DIM=d, BLOCK_M=block_m)
    alignment = causal_alignment(causal)  # None, "top_left" or "bottom_right"
    scale = d**-0.5
    runtime_args = (scale, scale * LOG2E, n_q, n_k, causal_offset(alignment, n_q, n_k))
    flags = dict(
        CAUSAL=alignment is not None,
        HEAD_DIM=d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # notebook 06's switch
    )
    return (q3, k3, v3, do3, L3, delta), runtime_args, flags


# %% [markdown]
# ## 4. Kernel 2: dK and dV, one program per K/V block
#
# The program loads its K and V blocks once (they stay on chip) and loops over query blocks, streaming Q, dO,
# L and D from HBM. It works on **transposed tiles** — $S^\top = K Q^\top$ of shape (BLOCK_N, BLOCK_M) — so
# that $dV \mathrel{+}= P^\top dO$ and $dK \mathrel{+}= dS^\top Q$ come out as (BLOCK_N, d) blocks directly,
# without transposing P. Per query block: 4 tile products (S, dV, dP, dK).
#
# The kernel `bwd_dkdv` below is given: it loads K and V, asks `q_block_range` (section 2) for its query
# rows, and runs the loop `_dkdv_loop` twice: the masked stage [lo, mid) over the diagonal, then the
# unmasked stage [mid, hi); it stores dK (times the scale, once) and dV at the end. The loop is yours.
#
# **Exercise 4 (the dK/dV kernel's loop).** Write the body of `_dkdv_loop`: for each query block starting at
# `start_m` in `range(lo, hi, BLOCK_M)`,
# 1. load the block's Q and dO rows (`rows = start_m + offs_m`, each row `HEAD_DIM` apart, head `z` at
#    `z * N_Q * HEAD_DIM`), and its L and D (one float per row, `z * N_Q + rows`); mask every load with
#    `rows < N_Q`, `other=0.0`;
# 2. rebuild $P^\top$ from L in base 2: $P^\top = 2^{\,K Q^\top \cdot qk\_scale\, -\, L \log_2 e}$ (qk_scale
#    is scale · log2 e; L broadcast along the columns, one value per query); in the masked stage (`MASK`)
#    set to 0 the pairs a query cannot see: query row i sees key j when $i + \text{offset} \ge j$;
# 3. $dV \mathrel{+}= P^\top dO$, $dP^\top = V\,dO^\top$, $dS^\top = P^\top \circ (dP^\top - D)$ (D along the
#    columns), $dK \mathrel{+}= dS^\top Q$ (unscaled: the kernel multiplies by the scale once, at the store).
#
# Pass `input_precision=DOT_PRECISION` to every `tl.dot`, and convert $P^\top$ and $dS^\top$ to the operands'
# dtype (`.to(q.dtype)`) before they enter a product (for float16 inputs the products take 16-bit operands;
# the accumulators stay float32). Ragged lengths need no mask inside the tile beyond the loads: padding
# query rows load Q = dO = 0 and L = D = 0, so their $P^\top dO$ and $dS^\top Q$ are exactly 0; padding keys
# produce rows of dK and dV that are never stored.


# %%
@triton.jit
def _dkdv_loop(
    dk, dv, k, v, Q, DO, L, Delta, z, cols, offs_m, offs_d, lo, hi, N_Q, offset, qk_scale,
    MASK: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Add to dk, dv (BLOCK_N, d) float32, registers, the contributions of the query blocks starting at rows
    lo, lo + BLOCK_M, ... below hi. k, v: this program's (BLOCK_N, d) blocks, on chip; cols: their key
    indices. Q, DO: (Z, N_Q, d) and L, Delta: (Z, N_Q), in HBM. Returns (dk, dv), dk not yet scaled."""
    ### BEGIN SOLUTION
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < N_Q
        ptrs = z * N_Q * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :]
        q = tl.load(Q + ptrs, mask=row_ok[:, None], other=0.0)  # (BLOCK_M, d): HBM -> SRAM
        do = tl.load(DO + ptrs, mask=row_ok[:, None], other=0.0)
        l2 = tl.load(L + z * N_Q + rows, mask=row_ok, other=0.0) * 1.4426950408889634  # L in base 2
        delta = tl.load(Delta + z * N_Q + rows, mask=row_ok, other=0.0)
        sT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # S^T / scale: (BLOCK_N, BLOCK_M)
        pT = tl.math.exp2(sT * qk_scale - l2[None, :])  # P^T rebuilt from L, registers
        if MASK:  # the diagonal blocks only
            pT = tl.where(rows[None, :] + offset >= cols[:, None], pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do, input_precision=DOT_PRECISION)  # dV += P^T dO
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # dP^T = V dO^T
        dsT = pT * (dpT - delta[None, :])  # dS^T = P^T * (dP^T - D)
        dk += tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PRECISION)  # dK += dS^T Q
    ### END SOLUTION
    return dk, dv


# %%
@triton.jit
def bwd_dkdv(
    Q, K, V, DO, L, Delta, DK, DV, scale, qk_scale, N_Q, N_K, offset,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    start_n = tl.program_id(0)
    z = tl.program_id(1).to(tl.int64)
    cols = start_n * BLOCK_N + tl.arange(0, BLOCK_N)  # this program's keys
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_ptrs = z * N_K * HEAD_DIM + cols[:, None] * HEAD_DIM + offs_d[None, :]
    col_ok = cols[:, None] < N_K
    k = tl.load(K + kv_ptrs, mask=col_ok, other=0.0)  # K, V blocks: loaded once, kept on chip
    v = tl.load(V + kv_ptrs, mask=col_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)  # accumulators, registers
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    # query rows [lo, mid) see part of these keys (masked), [mid, hi) all of them; without CAUSAL lo = mid = 0
    lo, mid, hi = q_block_range(start_n * BLOCK_N, N_Q, offset, CAUSAL, BLOCK_M, BLOCK_N)
    dk, dv = _dkdv_loop(
        dk, dv, k, v, Q, DO, L, Delta, z, cols, offs_m, offs_d, lo, mid, N_Q, offset, qk_scale,
        True, BLOCK_M, HEAD_DIM, DOT_PRECISION,
    )  # fmt: skip
    dk, dv = _dkdv_loop(
        dk, dv, k, v, Q, DO, L, Delta, z, cols, offs_m, offs_d, mid, hi, N_Q, offset, qk_scale,
        False, BLOCK_M, HEAD_DIM, DOT_PRECISION,
    )  # fmt: skip
    tl.store(DK + kv_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=col_ok)  # written once
    tl.store(DV + kv_ptrs, dv.to(DV.dtype.element_ty), mask=col_ok)


def dkdv_backward(do, q, k, v, o, L, causal=False, block_m=BLOCK_M, block_n=BLOCK_N, num_warps=4, num_stages=2):
    """Kernel 1, then kernel 2. do, q, o: (..., Nq, d); k, v: (..., Nk, d); L: (..., Nq) from the forward;
    causal: False, True (top-left) or "bottom_right". Returns dk, dv."""
    (q3, k3, v3, do3, L3, delta), args, flags = prepare(do, q, k, v, o, L, causal, block_m)
    dk, dv = torch.empty_like(k3), torch.empty_like(v3)
    bwd_dkdv[(triton.cdiv(k3.shape[1], block_n), k3.shape[0])](
        q3, k3, v3, do3, L3, delta, dk, dv, *args,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages, **flags,
    )  # fmt: skip
    return dk.reshape(k.shape), dv.reshape(v.shape)


# %% [markdown]
# The check runs your loop (through `bwd_dkdv`) on ragged lengths (not multiples of the blocks), Nq < Nk and
# Nq > Nk, not causal and causal in both alignments, against dK and dV from float64 autograd through standard
# attention. O and L come from the float64 reference too, so it checks the backward alone. First in float32
# (`input_precision="ieee"`: exact products, a tight tolerance), then two cases in float16, which catch a
# product whose operands differ in dtype. The float32 cases run on tiles of `CHECK_BLOCK` = 32 rows: an "ieee"
# product is compiled into plain multiply-adds, not tensor-core instructions, and each of the kernel's
# variants (causal or not, lengths that are multiples of 16 or not) compiles anew after every edit of your
# loop; compiled for sm_90 on a 2-core CPU, a variant took 4-11 s at 64 x 64 tiles, 1-2 s at 32 x 32.


# %%
@functools.cache
def backward_case(n_q, n_k, causal, dtype=torch.float32):
    """Inputs of one case, (B, H, n_q, d) and (B, H, n_k, d) in `dtype`, the same at every call: q, k, v, dO,
    O and L (from float64, O rounded to dtype), and the float64 gradients (dQ, dK, dV)."""
    g = torch.Generator().manual_seed(1000 * n_q + n_k)  # on the CPU: the same draws on every machine
    q, k, v = random_qkv((B, H, n_q, D), n_k, dtype=dtype, device=DEVICE, generator=g)
    do = torch.randn(q.shape, generator=g).to(DEVICE, dtype)
    o64, lse64 = attention(q.double(), k.double(), v.double(), causal=causal, return_lse=True)
    _, grads64 = reference_outputs(q.double(), k.double(), v.double(), causal, grad_out=do.double())
    return (do, q, k, v, o64.to(dtype), lse64.float()), grads64


BWD_CASES = [dict(n_q=2 * BLOCK_M, n_k=2 * BLOCK_N, causal=False)] + [
    dict(n_q=n_q, n_k=n_k, causal=causal)
    for causal in (False, "top_left", "bottom_right")
    for n_q, n_k in ((N_Q, N_K), (N_K, N_Q))
]
BWD_CASES_FP16 = [dict(n_q=N_Q, n_k=N_K, causal="top_left"), dict(n_q=N_K, n_k=N_Q, causal="bottom_right")]


def check_tiles(dtype) -> dict:
    """The checks' launch tiles: `CHECK_BLOCK` in float32 (quick to compile), the teaching launch's otherwise."""
    block = (CHECK_BLOCK, CHECK_BLOCK) if dtype == torch.float32 else (BLOCK_M, BLOCK_N)
    return dict(block_m=block[0], block_n=block[1])


# %% tags=["check"]
def your_dkdv(n_q, n_k, causal, dtype=torch.float32):
    check_masked_memory_ops(_dkdv_loop, "dkdv_kernel_loop")
    return dkdv_backward(*backward_case(n_q, n_k, causal, dtype)[0], causal, **check_tiles(dtype))


def reference_dkdv(n_q, n_k, causal, dtype=torch.float32):
    return backward_case(n_q, n_k, causal, dtype)[1][1:]


check_cases("dkdv_kernel_loop", BWD_CASES, your_dkdv, reference_dkdv, rtol=1e-4, atol=1e-4, outputs=("dK", "dV"))
check_cases(
    "dkdv_kernel_loop (float16)",
    [dict(c, dtype=torch.float16) for c in BWD_CASES_FP16],
    your_dkdv,
    reference_dkdv,
    rtol=5e-3,
    atol=5e-3,
    outputs=("dK", "dV"),
)

# %% [markdown]
# Watch the loop order on a small causal problem (N = 128, blocks of 32, computed in float64 by
# `course_lib.attention.animate`): each K/V block's program walks down its column of tiles, so the map fills
# column by column. A K/V block's dK is final at the end of its own column; a query row's dQ is final only
# when the last column that reaches it is done, which is why dQ needs atomics or a kernel of its own. The
# strip shows four steps; the slider below it (in JupyterLab) shows every step, with dK as well.

# %%
from course_lib.attention import animate

q_fig, k_fig, v_fig = random_qkv((128, 16), dtype=torch.float64)
bwd_frames = animate.backward_frames(q_fig, k_fig, v_fig, torch.randn(128, 16, dtype=torch.float64), 32, 32, True)
animate.backward_strip(bwd_frames)
plt.show()
animate.backward_widget(bwd_frames)

# %% [markdown]
# ## 5. Kernel 3: dQ, one program per query block
#
# The mirror image: load Q, dO, L and D for a block of query rows once, loop over K/V blocks, accumulate
# $dQ \mathrel{+}= dS\,K$ in registers, write once. Per K/V block: 3 tile products (S, dP, dQ) — S and dP were
# already computed in the dK/dV kernel, and are computed again here. The loop bounds are the forward's, from
# `kv_block_range` (section 2): an unmasked stage [lo, mid) over the blocks every row of the program sees
# whole, a masked stage [mid, hi) for the diagonal and the ragged last block, nothing above the diagonal.
# `bwd_dq` below is given; the loop is yours.
#
# **Exercise 5 (the dQ kernel's loop).** Write the body of `_dq_loop`: for each K/V block starting at
# `start_n` in `range(lo, hi, BLOCK_N)`,
# 1. load the block's K and V rows (`cols = start_n + offs_n`, head `z` at `z * N_K * HEAD_DIM`), masked with
#    `cols < N_K`, `other=0.0`;
# 2. $S = Q K^\top$ (BLOCK_M, BLOCK_N) and $P = 2^{\,S \cdot qk\_scale\, -\, l2}$ (`l2`: the rows' L in base 2,
#    given); in the masked stage (`MASK`) set P to 0 where a row cannot see a key: keys past `N_K`, and, with
#    `CAUSAL`, key j for row i when $j > i + \text{offset}$;
# 3. $dP = dO\,V^\top$, $dS = P \circ (dP - D)$ (D along the rows), $dQ \mathrel{+}= dS\,K$ (unscaled:
#    `bwd_dq` multiplies by the scale once, at the store).
#
# The same rules as Exercise 4: `input_precision=DOT_PRECISION` in every `tl.dot`, and dS converted to K's
# dtype before its product. (course_lib's dQ kernel also leaves out the load masks in the unmasked stage,
# where every key exists; mask them all here.)


# %%
@triton.jit
def _dq_loop(
    dq, q, do, l2, delta, K, V, z, rows, offs_n, offs_d, lo, hi, N_K, offset, qk_scale,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Add to dq (BLOCK_M, d) float32, registers, the contributions of the K/V blocks starting at keys lo,
    lo + BLOCK_N, ... below hi. q, do: this program's (BLOCK_M, d) rows, on chip; l2, delta: their L in base 2
    and D, (BLOCK_M,); rows: their indices. K, V: (Z, N_K, d) in HBM. Returns dq, not yet scaled."""
    ### BEGIN SOLUTION
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_ptrs = z * N_K * HEAD_DIM + cols[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(K + kv_ptrs, mask=cols[:, None] < N_K, other=0.0)  # (BLOCK_N, d): HBM -> SRAM
        v = tl.load(V + kv_ptrs, mask=cols[:, None] < N_K, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(s * qk_scale - l2[:, None])  # P rebuilt from L
        if MASK:
            visible = cols[None, :] < N_K
            if CAUSAL:
                visible = visible & (rows[:, None] + offset >= cols[None, :])
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # dP = dO V^T
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)  # dQ += dS K
    ### END SOLUTION
    return dq


# %%
@triton.jit
def bwd_dq(
    Q, K, V, DO, L, Delta, DQ, scale, qk_scale, N_Q, N_K, offset,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0)
    z = tl.program_id(1).to(tl.int64)
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N_Q
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = z * N_Q * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q + ptrs, mask=row_ok[:, None], other=0.0)  # Q, dO, L, D: loaded once, kept on chip
    do = tl.load(DO + ptrs, mask=row_ok[:, None], other=0.0)
    l2 = tl.load(L + z * N_Q + rows, mask=row_ok, other=0.0) * 1.4426950408889634  # L in base 2
    delta = tl.load(Delta + z * N_Q + rows, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # keys [lo, mid) every row of the block sees, [mid, hi) the diagonal and the ragged end (masked)
    lo, mid, hi = kv_block_range(start_m * BLOCK_M, N_Q, N_K, offset, 0, 1, CAUSAL, BLOCK_M, BLOCK_N)
    dq = _dq_loop(
        dq, q, do, l2, delta, K, V, z, rows, offs_n, offs_d, lo, mid, N_K, offset, qk_scale,
        False, CAUSAL, BLOCK_N, HEAD_DIM, DOT_PRECISION,
    )  # fmt: skip
    dq = _dq_loop(
        dq, q, do, l2, delta, K, V, z, rows, offs_n, offs_d, mid, hi, N_K, offset, qk_scale,
        True, CAUSAL, BLOCK_N, HEAD_DIM, DOT_PRECISION,
    )  # fmt: skip
    tl.store(DQ + ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


def dq_backward(do, q, k, v, o, L, causal=False, block_m=BLOCK_M, block_n=BLOCK_N, num_warps=4, num_stages=2):
    """Kernel 1, then kernel 3; the arguments as `dkdv_backward`'s. Returns dq."""
    (q3, k3, v3, do3, L3, delta), args, flags = prepare(do, q, k, v, o, L, causal, block_m)
    dq = torch.empty_like(q3)
    bwd_dq[(triton.cdiv(q3.shape[1], block_m), q3.shape[0])](
        q3, k3, v3, do3, L3, delta, dq, *args,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages, **flags,
    )  # fmt: skip
    return dq.reshape(q.shape)


# %% [markdown]
# The same cases as Exercise 4's, for dQ:


# %% tags=["check"]
def your_dq(n_q, n_k, causal, dtype=torch.float32):
    check_masked_memory_ops(_dq_loop, "dq_kernel_loop")
    return dq_backward(*backward_case(n_q, n_k, causal, dtype)[0], causal, **check_tiles(dtype))


def reference_dq(n_q, n_k, causal, dtype=torch.float32):
    return backward_case(n_q, n_k, causal, dtype)[1][0]


check_cases("dq_kernel_loop", BWD_CASES, your_dq, reference_dq, rtol=1e-4, atol=1e-4, outputs=("dQ",))
check_cases(
    "dq_kernel_loop (float16)",
    [dict(c, dtype=torch.float16) for c in BWD_CASES_FP16],
    your_dq,
    reference_dq,
    rtol=5e-3,
    atol=5e-3,
    outputs=("dQ",),
)

# %% [markdown]
# ## 6. Your backward, whole, and on a GPU
#
# `flash_backward` runs kernel 1 once, then your two kernels: the backward with no atomics, three launches.
# (course_lib's runs two: its dQ kernel, which holds the dO rows anyway, computes D itself and runs first.)
# On a GPU the next cell times it beside course_lib's backward and PyTorch's (SDPA's default backend), in
# bfloat16, not causal, at `TIME_SHAPE`; on a CPU it says why it does not.


# %%
def flash_backward(do, q, k, v, o, L, causal=False, block_m=BLOCK_M, block_n=BLOCK_N, num_warps=4, num_stages=2):
    """Kernel 1, then kernels 2 and 3 (two_kernel mode). Returns dq, dk, dv."""
    (q3, k3, v3, do3, L3, delta), args, flags = prepare(do, q, k, v, o, L, causal, block_m)
    dq, dk, dv = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3)
    launch = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages, **flags)
    bwd_dkdv[(triton.cdiv(k3.shape[1], block_n), k3.shape[0])](q3, k3, v3, do3, L3, delta, dk, dv, *args, **launch)
    bwd_dq[(triton.cdiv(q3.shape[1], block_m), q3.shape[0])](q3, k3, v3, do3, L3, delta, dq, *args, **launch)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


tb, th, tn, td = TIME_SHAPE
ready = True  # on a CPU time_kernels only says why it does not time
if course_lib.ON_GPU:
    qt, kt, vt = random_qkv((tb, th, tn, td), dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    dot = torch.randn_like(qt)
    ot, lset = lib_forward.forward(qt, kt, vt, False, None)
    sdpa_out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)  # its graph, kept for repeated backwards
    qd, kd, vd, od = (t.detach() for t in (qt, kt, vt, ot))
    try:
        flash_backward(dot, qd, kd, vd, od, lset)  # your two kernels, compiled for bfloat16
    except Exception as err:  # noqa: BLE001 (an unsolved or failing kernel: say so, time nothing)
        ready = False
        print(f"your backward does not run yet in bfloat16 ({type(err).__name__}): solve Exercises 4 and 5 first")
if ready:
    time_kernels(
        "dq_kernel_loop",
        learner=lambda: flash_backward(dot, qd, kd, vd, od, lset),
        course_lib=lambda: lib_backward.backward(dot, qd, kd, vd, od, lset),
        sdpa=lambda: torch.autograd.grad(sdpa_out, (qt, kt, vt), dot, retain_graph=True),
        flops=attention_flops(tb, th, tn, tn, td, False, mode="bwd"),
        note="course_lib's backward: launches tuned per shape (block sizes, warps, pipeline stages: notebook 08's "
        "ladder), two launches (D inside its dQ kernel). SDPA's default backend on an H100/H200 is cuDNN's.",
    )


# %% [markdown]
# ## 7. Two kernels or atomics: the trade-off
#
# Your kernels make the backward that needs no atomics. The other way is one kernel: the dK/dV loop also
# computes each query block's contribution to dQ, $s \cdot dS\,K$ (its $dS^\top$ is already in registers),
# and adds it into a float32 dQ with `tl.atomic_add`. course_lib has it as `dq_mode="atomic"` (the `ATOMIC`
# branch of `_dkdv_block` in `course_lib/attention/backward.py`). Its adds are `sem="relaxed"`:
# `tl.atomic_add` by default orders each add against every other memory access of its thread
# (`"acq_rel"`, what a lock needs), and a sum needs no order at all, since nothing reads dQ before the
# kernel ends. On an H200 the ordered adds ran several times slower (`scripts/atomic_throughput.py`;
# the figures are in `notes/attention.md`). It masks every block in that mode:
# a padding key (K = 0) adds $0 \cdot e^{-L}$ to dQ, which is NaN once $e^{-L}$ overflows, for a row whose
# scores are all below about -88.
#
# Per pair of (query block, key block), counting tile products of BLOCK_M x BLOCK_N x d:
#
# | | two kernels | one kernel + atomic dQ |
# | --- | --- | --- |
# | tile products per block pair | 4 (dK/dV) + 3 (dQ) = **7** | **5** |
# | dQ traffic | written once, in the input dtype | float32 **atomic adds**: Nk / BLOCK_N per element |
# | extra memory | none | a float32 dQ buffer, zeroed first, converted last |
# | synchronisation | none | programs of different key blocks add to the same dQ rows (L2 contention) |
# | result | deterministic | summation order varies between runs: dQ differs in the last bits |
#
# The useful work of a backward is 4 products (dV, dP, dQ, dK), twice the forward's 2. The papers count a
# backward as 2.5x the forward's FLOPs, 5 products: those 4 and the recomputation of S, which every
# FlashAttention backward does since it kept no P (`attention_flops(..., mode="bwd")` follows them). The
# atomic version does those 5; the two-kernel version does 7, 40 % more than the papers' count (75 % more
# than the 4 useful products). The atomic version moves more bytes instead: for every 4 x BLOCK_N FLOPs saved
# it adds one float32 atomic. Which wins depends on how the GPU's atomic throughput in L2 compares with its
# tensor-core throughput, on d, and on how many programs collide. The measurement below answers for one head
# dim and length on our GPU, with course_lib's Triton kernels in both modes (`config={"hopper": False}`).


# %%
def plot_dq_modes(data, source):
    rows = len(data["d"])  # one head dim per row, stacked to fit the notebook's column
    fig, axes = plt.subplots(
        rows, 1, figsize=(9.0, 1.5 + 4.5 * rows), sharey=True, layout="constrained", squeeze=False
    )
    ratios = []
    for ax, d in zip(axes[:, 0], data["d"]):
        modes = [(c, m) for c in (False, True) for m in ("two_kernel", "atomic")]
        tf = {(c, m): data["tflops"][f"d={d}, causal={c}, {m}"] for c, m in modes}
        r = [a / t for c in (False, True) for a, t in zip(tf[c, "atomic"], tf[c, "two_kernel"])]
        series = {f"{m}, {'causal' if c else 'not causal'}": values for (c, m), values in tf.items()}
        ratios += r
        plot_series(
            data["N"], series, xlabel="sequence length N (tokens)", ylabel="backward TFLOP/s (bf16)",
            title=f"d = {d}: atomic at {min(r):.2f}-{max(r):.2f}x the speed of two kernels", logx=True, ax=ax,
        )  # fmt: skip
        ax.set_xticks(data["N"], [f"{n // 1024}k" for n in data["N"]])
    fig.suptitle(f"course_lib backward: two kernels or atomic dQ\n({dkdv_kernels(data)})\n{source}", fontsize=14)
    plt.show()
    return ratios


def dkdv_kernels(data):
    """Which dK/dV kernel each mode ran: a record from before the comparison was made Triton against Triton
    ran course_lib's default, whose two-kernel dK/dV step on a Hopper GPU at d = 128 is the Gluon kernel."""
    default = "two_kernel: course_lib's default dK/dV (Gluon on Hopper at d = 128); atomic: Triton"
    return data.get("dkdv_kernel", default)


def measure_dq_modes():
    data = {"N": BENCH_NS, "d": list(BENCH_DS), "tokens": BENCH_TOKENS, "tflops": {}, "dkdv_kernel": "Triton in both"}
    cases = [(d, c, m, n) for d in BENCH_DS for c in (False, True) for m in ("two_kernel", "atomic") for n in BENCH_NS]

    def compiled_run(case):  # inputs, and a first call that compiles the kernels
        d, causal, mode, n = case
        q, k, v = random_qkv((BENCH_TOKENS // n * (2048 // d), n, d), dtype=torch.bfloat16, device=DEVICE)
        do = torch.randn_like(q)
        o, lse = lib_forward.forward(q, k, v, causal, None)
        triton_only = {"hopper": False}  # the Triton dK/dV kernel in both modes: like against like
        run = lambda: lib_backward.backward(do, q, k, v, o, lse, causal, config=triton_only, dq_mode=mode)  # noqa: E731
        run()
        return run

    # compiled side by side (`run_cases`), then timed one at a time
    for (d, causal, mode, n), run in zip(cases, run_cases(compiled_run, cases)):
        flops = attention_flops(BENCH_TOKENS // n, 2048 // d, n, n, d, causal, mode="bwd")
        data["tflops"].setdefault(f"d={d}, causal={causal}, {mode}", []).append(flops / benchmark(run) * 1e-9)
    return data


got = records.measured_or_recorded(
    "flash_backward_dq_mode",
    measure_dq_modes,
    missing="No recorded GPU run yet (it is written when this notebook runs on a GPU). The figure compares\n"
    "course_lib's backward in its two dQ modes, bf16, causal and not, per head dim and length. Read it as:\n"
    "the atomic mode saves 2 of 7 tile products but pays float32 atomics into dQ; above 1.0x it wins.",
)
if got:
    ratios = plot_dq_modes(*got)
    winner = "the atomic mode" if min(ratios) > 1 else ("two kernels" if max(ratios) < 1 else "neither always")
    print(f"{got[1]}; dK/dV kernels: {dkdv_kernels(got[0])}:")
    print(f"atomic / two-kernel speed between {min(ratios):.2f} and {max(ratios):.2f}x: {winner} wins.")

# %% [markdown]
# A record that says "Gluon" compares more than the dQ strategy: on a Hopper GPU at d = 128 course_lib's
# default two-kernel backward runs FlashAttention-3's dK/dV kernel, written in Gluon (notebook 08c), and the
# atomic mode stays in Triton. Triton against Triton at one such shape (d = 128, N = 4096, causal, bf16) is
# in notebook 08's ladder record, its backward rungs "autotuned (Triton)" (two kernels) and "one pass, atomic
# dQ":

# %%
ladder_rec = records.load_record("ladder")
if ladder_rec is None:
    print("No recorded ladder in assets/benchmarks/ yet (make bench on a GPU writes it).")
else:
    rungs = {s["name"]: s for s in ladder_rec["data"]["steps"] if s["pass_"] == "bwd" and s.get("status") == "ok"}
    two, one = rungs["autotuned (Triton)"], rungs["one pass, atomic dQ"]
    assert two["config"] == one["config"] == {"hopper": False}, "both rungs run the Triton kernels"
    print(f"{records.label(ladder_rec)}, d = 128, N = 4096, causal, bf16, Triton kernels in both:")
    print(f"  two kernels {two['ms']:.2f} ms ({two['tflops']:.0f} TFLOP/s), atomic dQ {one['ms']:.2f} ms "
          f"({one['tflops']:.0f} TFLOP/s): atomic at {two['ms'] / one['ms']:.2f}x the two kernels' speed")  # fmt: skip

# %% [markdown]
# course_lib defaults to two kernels for deterministic gradients and no float32 dQ buffer; the measurements
# show what that choice costs or saves on the GPU they were made on. The balance can tip the other way on a
# GPU whose atomics are fast relative to its tensor cores, or at shapes where few programs collide on the
# same dQ rows: the atomic variant is one flag away in
# `course_lib.attention.backward.backward(..., dq_mode="atomic")` (`flash_attention` and
# `FlashAttentionTriton` always take two kernels).
#
# ### Predict: how much longer than the forward is the backward?
#
# The table above gives the ingredients: the forward does 2 tile products per block pair, the two-kernel
# backward 7 (S in both kernels and dP in both, so three more than a backward that kept P), plus
# D = rowsum(dO ∘ O) (which course_lib's dQ kernel computes itself), and it reads and writes more tensors
# (dO, O, L in; dQ, dK, dV out). For course_lib's kernels in bf16 at N = 4096, d = 64,
# not causal, what is backward time ÷ forward time? Type your estimate in place of the value in the next
# cell, run it, then run the one after it (a GPU measures it now; a CPU shows the recorded run of
# `make bench`).

# %%
# Your prediction: backward time / forward time, bf16, N = 4096, d = 64, not causal.
bwd_fwd_guess = predict("backward time / forward time", 2.5, unit="x")


# %%
def time_fwd_bwd(n=4096, d=64):
    """(forward ms, backward ms, source): course_lib's kernels timed now on the GPU, else the record."""
    if course_lib.ON_GPU:
        b, h = BENCH_TOKENS // n, 2048 // d
        q, k, v = random_qkv((b * h, n, d), dtype=torch.bfloat16, device=DEVICE)
        do = torch.randn_like(q)
        o, lse = lib_forward.forward(q, k, v, False, None)
        fwd_ms = benchmark(lambda: lib_forward.forward(q, k, v, False, None))
        bwd_ms = benchmark(lambda: lib_backward.backward(do, q, k, v, o, lse, False, None))
        return fwd_ms, bwd_ms, "measured now on " + torch.cuda.get_device_name(DEVICE)
    rec = records.load_record("attention")
    if rec is None:
        return None
    ms = {
        r["mode"]: r["ms"]
        for r in rec["data"]["results"]
        if r["provider"] == "course_lib" and (r["N"], r["d"], r["causal"]) == (n, d, False) and r["status"] == "ok"
    }
    if "fwd" not in ms or "bwd" not in ms:
        return None
    return ms["fwd"], ms["bwd"], records.label(rec)


timed = time_fwd_bwd()
if timed is None:
    print("No recorded GPU run of the attention benchmark yet (make bench on a GPU writes it).")
else:
    fwd_ms, bwd_ms, source = timed
    print(f"{source}:\nforward {fwd_ms:.3f} ms, backward {bwd_ms:.3f} ms: backward / forward = {bwd_ms / fwd_ms:.2f}")
    _ = bwd_fwd_guess.score(bwd_ms / fwd_ms)

# %% [markdown]
# ## 8. `FlashAttentionTriton`: forward and backward as one autograd Function
#
# The pieces assemble into a `torch.autograd.Function`, with the contract of notebook 04's
# `FlashAttentionTorch`: `apply(q, k, v, is_causal)`; the forward saves Q, K, V, O and L — nothing of size Nq
# x Nk; the backward returns dQ, dK, dV (and None for `is_causal`). Here is one built from course_lib's
# forward and course_lib's backward (the finished version of your kernels: put your `flash_backward` in its
# place to train with your own kernels):


# %%
class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        o, lse = lib_forward.forward(q, k, v, is_causal, None)  # notebook 06's kernel, finished
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return *lib_backward.backward(do, q, k, v, o, lse, ctx.is_causal), None  # notebook 07's kernels, finished


q, k, v = random_qkv((B, H, N_Q, D), N_K, device=DEVICE, requires_grad=True)
do = torch.randn(B, H, N_Q, D, device=DEVICE)
grads = torch.autograd.grad(FlashAttention.apply(q, k, v, True), (q, k, v), do)
grads_lib = torch.autograd.grad(course_lib.FlashAttentionTriton.apply(q, k, v, True), (q, k, v), do)
for name, g, g_lib in zip(("dQ", "dK", "dV"), grads, grads_lib):
    torch.testing.assert_close(g, g_lib, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
print("this Function and course_lib.FlashAttentionTriton give the same gradients")

# %% [markdown]
# What does each implementation keep alive for the backward? PyTorch's saved-tensor hooks see every tensor an
# autograd graph saves. Standard attention saves its Nq x Nk score and probability matrices; FlashAttention
# saves Q, K, V, O and L.


# %%
def saved_shapes(fn):
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return shapes


flash_saved = saved_shapes(lambda: course_lib.FlashAttentionTriton.apply(q, k, v, True))
standard_saved = saved_shapes(lambda: attention(q, k, v, causal=True))
print("FlashAttentionTriton saves:", flash_saved)
print("standard attention saves  :", standard_saved)
assert not any(N_Q in s and N_K in s for s in flash_saved), "FlashAttention must not save an Nq x Nk tensor"
assert any(N_Q in s and N_K in s for s in standard_saved)

# %% [markdown]
# ### Recomputation is gradient checkpointing, one kernel deep
#
# FlashAttention's backward recomputes S = Q Kᵀ and P = exp(S − L) instead of reading them back. That is the
# trade `torch.utils.checkpoint` makes for any piece of a network: keep less between the forward and the
# backward, compute part of the forward again in the backward. The two differ in depth:
# - `checkpoint(attention, q, k, v)` keeps only the inputs, and in the backward runs the whole forward again,
#   **materialising** S and P (Nq x Nk each) once more, then runs the usual backward over them. Less is kept
#   between the passes, but the backward's peak still holds N x N matrices.
# - FlashAttention keeps the inputs plus O and L (one number per query row, Nq per head: the logsumexp).
#   With L, one tile of P is recomputed from one tile of Q and K, exactly, without the rest of its row; so
#   the backward never holds more than a tile of S and P, on chip. The price is recomputation: with atomic
#   dQ one more Q Kᵀ, 2·Nq·Nk·d FLOPs; with course_lib's two-kernel default S in both kernels and dP in
#   both, 6·Nq·Nk·d over a backward that kept P. Checkpoint's full second forward costs 4·Nq·Nk·d and
#   holds N x N matrices again: FlashAttention may spend more FLOPs, but never the memory.
#
# What each keeps for the backward, in bytes (tensors that share memory, such as a view of q, counted once):


# %%
from torch.utils.checkpoint import checkpoint


def saved_bytes(fn):
    """Bytes of distinct storage that autograd keeps for the backward of fn() (saved-tensor hooks)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


kept = {
    "standard attention": saved_bytes(lambda: attention(q, k, v, causal=True)),
    "checkpoint(standard attention)": saved_bytes(
        lambda: checkpoint(attention, q, k, v, True, use_reentrant=False)
    ),
    "FlashAttention (Q, K, V, O, L)": saved_bytes(lambda: course_lib.FlashAttentionTriton.apply(q, k, v, True)),
}
inputs_bytes = sum(t.numel() * t.element_size() for t in (q, k, v))
for name, nbytes in kept.items():
    print(f"{name:32} keeps {nbytes / 1e3:9.1f} kB ({nbytes / inputs_bytes:.2f}x the inputs)")
o_l_bytes = q.numel() * q.element_size() + q[..., 0].numel() * 4  # O (like q), L (one float32 per row)
assert kept["checkpoint(standard attention)"] == inputs_bytes
assert kept["FlashAttention (Q, K, V, O, L)"] == inputs_bytes + o_l_bytes
assert kept["standard attention"] > kept["FlashAttention (Q, K, V, O, L)"]

# %% [markdown]
# checkpoint keeps the least, FlashAttention O and L more; standard attention keeps its Nq x Nk matrices.
# What the table cannot show is the backward's peak: checkpoint's recomputed forward allocates S and P
# again. On a GPU, the next cell measures the peak memory of a forward and backward of each:

# %%
if course_lib.ON_GPU:
    from course_lib.perf.timing import peak_memory

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(), (q, k, v), do)

    peaks = {
        "standard attention": peak_memory(fwd_bwd(lambda: attention(q, k, v, causal=True))),
        "checkpoint(standard attention)": peak_memory(
            fwd_bwd(lambda: checkpoint(attention, q, k, v, True, use_reentrant=False))
        ),
        "FlashAttention": peak_memory(fwd_bwd(lambda: course_lib.FlashAttentionTriton.apply(q, k, v, True))),
    }
    for name, peak in peaks.items():
        print(f"{name:32} peak above the inputs, forward + backward: {peak / 1e6:8.2f} MB")
else:
    print("Peak memory needs a GPU's allocator statistics: run this notebook on a GPU to see it.")

# %% [markdown]
# Finally, `torch.autograd.gradcheck` compares the backward with finite differences of the forward. It needs
# float64, which course_lib's kernels accept under the interpreter (CPU only: compiled GPU kernels stop at
# float32). A tiny shape, ragged and with Nq != Nk; `fast_mode` checks a random projection of the Jacobian.

# %%
if course_lib.INTERPRET:
    q64, k64, v64 = random_qkv(GRADCHECK_SHAPE, GRADCHECK_NK, dtype=torch.float64, requires_grad=True)
    for causal in (False, True):
        fn = lambda q, k, v, c=causal: course_lib.FlashAttentionTriton.apply(q, k, v, c)
        assert torch.autograd.gradcheck(fn, (q64, k64, v64), fast_mode=True), (
            f"gradcheck failed, causal={causal}"
        )
    print(f"gradcheck passed in float64 for q {GRADCHECK_SHAPE}, Nk = {GRADCHECK_NK}, causal and not")
else:
    print(
        "gradcheck runs under the interpreter only (float64); on a GPU, run with COURSE_DEVICE=cpu to see it."
    )

# %% [markdown]
# ### What this backward cannot do: a second derivative
#
# A gradient penalty (a loss on a gradient) or a Hessian-vector product asks autograd to differentiate the
# backward itself: `torch.autograd.grad(..., create_graph=True)`, then a second `grad` of what came out. A
# backward written in PyTorch ops has a derivative of its own; ours is kernels, whose results carry no graph.
# Left alone, the second differentiation takes them for constants, and the attention's share of the penalty
# silently becomes zero: this notebook's `FlashAttention` does exactly that. course_lib's Functions pass their
# gradients through `course_lib.second_derivative.refuse_second_derivative`, so the same request raises an
# error that says what to use instead.


# %%
def penalty_grad(fn):
    """d/dq of |dL/dq|² + |q|² for L = sum(fn(q, k, v)): the second derivative a gradient penalty needs."""
    (g,) = torch.autograd.grad(fn(q, k, v).sum(), q, create_graph=True)
    return torch.autograd.grad(g.pow(2).sum() + q.pow(2).sum(), q)[0]


silent = penalty_grad(lambda q, k, v: FlashAttention.apply(q, k, v, True))
torch.testing.assert_close(silent, 2 * q.detach())  # only |q|²'s term: the attention's was dropped
try:
    penalty_grad(lambda q, k, v: course_lib.FlashAttentionTriton.apply(q, k, v, True))
    raise AssertionError("course_lib's backward should refuse a second derivative")
except RuntimeError as err:
    assert "no second derivative" in str(err)
    print("course_lib refuses:", err)

# %% [markdown]
# ## 9. More exercises
#
# **Exercise 6 — the softmax backward of one row.** For one row, $P = \mathrm{softmax}(S)$ and $dP$ the
# gradient with respect to $P$. Return $dS$. Check it against autograd through `torch.softmax`.


# %%
def softmax_row_backward(p, dp):
    ### BEGIN SOLUTION
    return p * (dp - (p * dp).sum())
    ### END SOLUTION


# %% tags=["check"]
s_row = torch.randn(50, dtype=torch.float64, requires_grad=True)
dp_row = torch.randn(50, dtype=torch.float64)
(ds_expected,) = torch.autograd.grad(torch.softmax(s_row, 0), s_row, dp_row)
check(
    "softmax_row_backward",
    lambda: softmax_row_backward(torch.softmax(s_row, 0).detach(), dp_row),
    ds_expected,
)

# %% [markdown]
# **Exercise 7 — count the work.** Return the tensor-core FLOPs (2 x m x n x k per m x k by k x n product) of
# a non-causal backward for one (batch, head) with Nq queries, Nk keys and head dim d, for `dq_mode`
# "two_kernel" or "atomic" (count whole products, ignore padding).


# %%
def backward_matmul_flops(n_q, n_k, d, dq_mode):
    ### BEGIN SOLUTION
    products = 7 if dq_mode == "two_kernel" else 5
    return products * 2 * n_q * n_k * d
    ### END SOLUTION


# %% tags=["check"]
check(
    "backward_matmul_flops",
    lambda: (
        backward_matmul_flops(4096, 2048, 64, "two_kernel"),
        backward_matmul_flops(4096, 2048, 64, "atomic"),
    ),
    (7 * 2 * 4096 * 2048 * 64, 5 * 2 * 4096 * 2048 * 64),
)

# %% [markdown]
# **Exercise 8 — a dV-only kernel.** Write `dv_kernel`: one program per K/V block (keys `cols`), looping over
# all query blocks (non-causal), rebuilding $P^\top$ from L and accumulating $dV = P^\top dO$. Tensors are
# contiguous (Z, N, d) as in this notebook; Nq and Nk may be ragged.


# %%
@triton.jit
def dv_kernel(
    Q, K, DO, L, DV, qk_scale, N_Q, N_K, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    ### BEGIN SOLUTION
    start_n = tl.program_id(0)
    z = tl.program_id(1).to(tl.int64)
    cols = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_ptrs = z * N_K * HEAD_DIM + cols[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(K + kv_ptrs, mask=cols[:, None] < N_K, other=0.0)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for start_m in range(0, N_Q, BLOCK_M):
        rows = start_m + offs_m
        ptrs = z * N_Q * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :]
        q = tl.load(Q + ptrs, mask=rows[:, None] < N_Q, other=0.0)
        do = tl.load(DO + ptrs, mask=rows[:, None] < N_Q, other=0.0)
        l2 = tl.load(L + z * N_Q + rows, mask=rows < N_Q, other=0.0) * 1.4426950408889634
        pT = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision="ieee") * qk_scale - l2[None, :])
        dv += tl.dot(pT, do, input_precision="ieee")
    tl.store(DV + kv_ptrs, dv, mask=cols[:, None] < N_K)
    ### END SOLUTION


def dv_only(do, q, k, L, block_m=BLOCK_M, block_n=BLOCK_N):
    Z, n_q, d = q.shape
    n_k = k.shape[1]
    # a store past the end is caught: an unmasked last block reaches up to block_n rows of d past it
    dv, check_guard = guarded_empty((Z, n_k, d), torch.float32, q.device, guard=block_n * d)
    dv_kernel[(triton.cdiv(n_k, block_n), Z)](
        q, k, do, L, dv, d**-0.5 * LOG2E, n_q, n_k, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n
    )
    check_guard("dv_kernel")
    return dv


# %% tags=["check"]
q, k, v = random_qkv((B * H, N_Q, D), N_K, device=DEVICE)
do = torch.randn_like(q)
o, lse = lib_forward.forward(q, k, v, False, None)
_, (_, _, dv_expected) = reference_outputs(q.double(), k.double(), v.double(), False, grad_out=do.double())
check("dv_kernel", lambda: dv_only(do, q, k, lse).double(), dv_expected, rtol=1e-4, atol=1e-4)

# %% [markdown]
# **Exercise 9 (open).** Give your dK/dV loop the atomic mode of section 7: under a flag, add each query
# block's $s \cdot dS\,K$ into a float32 dQ with `tl.atomic_add` (mask it with the rows and, as course_lib
# does, mask the padding keys in every block). Then notice that every dK/dV program walks the query blocks in
# the same order, so at any moment many programs add into the *same* dQ rows. Make program `start_n` start its
# loop at a different query block (walking around the end). Does the result change? On a GPU, does the atomic
# mode get faster?

# %% [markdown]
# ## Summary
#
# - The backward rebuilds P from the saved logsumexp L, one tile at a time:
#   $P = 2^{\,S\cdot s\log_2 e - L\log_2 e}$ (S unscaled here). D = rowsum(dO ∘ O) replaces rowsum(P ∘ dP) and
#   costs one small preprocessing kernel — or none: course_lib's dQ kernel, which holds the dO rows anyway,
#   computes D itself and runs first, so its backward is two launches (notebook 08 says why launches count).
# - dK and dV are sums over queries: one program per K/V block keeps K, V and the dK, dV accumulators on chip
#   and loops over query blocks (your loop of Exercise 4). dQ is a sum over keys: one program per query block,
#   looping over K/V blocks (Exercise 5).
# - Two kernels: 7 tile products instead of 5, no atomics, deterministic. One kernel with atomic dQ: 5
#   products, but float32 read-modify-writes of dQ, contention and run-to-run differences. The measurement
#   decides.
# - Causal: both kernels skip the blocks with no visible pair and mask only the diagonal blocks, as the
#   forward (course_lib's atomic mode masks every block of the dK/dV kernel: see section 7).
# - `course_lib.FlashAttentionTriton` saves Q, K, V, O and L (no Nq x Nk tensor); gradcheck passes in float64.
#
# Next, notebook 08 measures the whole thing against PyTorch's attention backends, and climbs the optimisation
# ladder one change at a time.
