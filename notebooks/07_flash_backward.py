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
# 2. Write the three kernels of a backward that needs no atomics: a preprocessing kernel for D, a dK/dV kernel
#    (one program per K/V block, looping over query blocks) and a dQ kernel (one program per query block,
#    looping over K/V blocks).
# 3. Write the single-pass variant that accumulates dQ with atomic adds, and weigh the two: what each costs,
#    and which wins at one shape on a GPU (measured).
# 4. Skip the fully masked blocks in the causal backward, as in the forward: write the dK/dV kernel's loop
#    bounds, and watch its K/V-outer loop fill dK block by block while dQ accumulates from every block.
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
# are this notebook's own.

# %%
import math

import matplotlib.pyplot as plt
import numpy as np
import torch

import course_lib
from course_lib import records
from course_lib.attention import backward as lib_backward
from course_lib.attention import forward as lib_forward
from course_lib.attention.reference import attention
from course_lib.exercises import check, guarded_empty, predict
from course_lib.perf.plotting import plot_series
from course_lib.perf.timing import attention_flops, benchmark
from course_lib.runtime import tl, triton
from course_lib.testing import assert_close_to_reference, random_qkv, reference_outputs, run_cases

DEVICE = course_lib.DEVICE
print(course_lib.RUNTIME.describe())

# %%
B, H, D = course_lib.pick(cpu=(1, 2, 32), gpu=(2, 4, 64))  # batch, heads, head dim
N_Q, N_K = course_lib.pick(cpu=(100, 75), gpu=(1000, 1531))  # ragged and unequal on purpose
BLOCK_M, BLOCK_N = course_lib.pick(cpu=(32, 32), gpu=(64, 64))  # the teaching launches
DTYPES = course_lib.pick(  # dtypes the kernels below are checked in (the GPU's float16 is left to the tests)
    cpu=[torch.float32, torch.float16, torch.bfloat16], gpu=[torch.float32, torch.bfloat16]
)
ATOMIC_DTYPES = course_lib.pick(cpu=DTYPES, gpu=[torch.bfloat16])  # dtypes the atomic dQ mode is checked in
GRADCHECK_SHAPE, GRADCHECK_NK = (1, 2, 24, 16), 20  # float64 gradcheck, CPU only (the interpreter)
BENCH_NS = course_lib.pick(cpu=[], gpu=[4096])  # GPU timing of the two dQ strategies (each length compiles anew)
BENCH_DS, BENCH_TOKENS = (128,), 16384  # head dims timed live; B*N tokens (H*d = 2048, as in the papers)
LOG2E = math.log2(math.e)
torch.manual_seed(0)

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
# To keep the kernels short, this notebook's wrapper makes the (Z = B·H, N, d) tensors contiguous, so a row is
# `HEAD_DIM` elements apart and a head `N * HEAD_DIM`; course_lib's kernels take any strides instead, as the
# forward of notebook 06 did.

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
    hints=[
        "P_ij = exp(S_ij - L_i) is already normalised: L is the log of each row's sum. dP = dO V^T; the "
        "softmax's backward is dS = P * (dP - D) with D broadcast over each row; S = scale * Q K^T gives "
        "dQ = scale * dS K and dK = scale * dS^T Q; O = P V gives dV = P^T dO.",
        "P = torch.exp(S - L_i[:, None]); dP = do_i @ v_j.T; dS = P * (dP - D_i[:, None]); "
        "return dS @ k_j * scale, dS.T @ q_i * scale, P.T @ do_i",
    ],
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
    hints=[
        "exp(S - m) is the forward's *unnormalised* P: each of its rows sums to l, not 1 (the printed sums). "
        "Every gradient built from it is off by a factor per row.",
        "P = torch.exp(S - m_i[:, None]) / l_i[:, None], which is torch.exp(S - (m_i + torch.log(l_i))[:, None]):"
        " the logsumexp L is m + log l, one number per row instead of two.",
    ],
)

# %% [markdown]
# ## 2. Kernel 1: D = rowsum(dO ∘ O)
#
# One program per (query block, z): read a block of O and dO (HBM → registers), multiply, sum each row, write
# BLOCK_M floats.


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


# %% [markdown]
# ## 3. Kernel 2: dK and dV, one program per K/V block
#
# The program loads its K and V blocks once (they stay on chip) and loops over query blocks, streaming Q, dO,
# L and D from HBM. It works on **transposed tiles** — $S^\top = K Q^\top$ of shape (BLOCK_N, BLOCK_M) — so
# that $dV \mathrel{+}= P^\top dO$ and $dK \mathrel{+}= dS^\top Q$ come out as (BLOCK_N, d) blocks directly,
# without transposing P. Per query block: 4 tile products (S, dV, dP, dK).
#
# Ragged lengths need no mask inside the loop: padding query rows load Q = dO = 0, L = D = 0, so their
# $P^\top dO$ and $dS^\top Q$ are exactly 0; padding keys produce rows of dK and dV that are never stored.
# (With `ATOMIC` they also add terms to dQ: K = 0 there, so each is $0 \cdot e^{-L}$, which is NaN once
# $e^{-L}$ overflows, for a row whose scores are all below about -88. course_lib's kernel therefore masks
# every block in its atomic mode.)
#
# Causal: query $i$ sees key $j$ when $j \le i$. For the key block starting at $n_0$, query blocks that end
# before $n_0$ see none of its keys: the loop **starts** at the query block holding row $n_0$. The next query
# blocks, up to row $n_0 + $ BLOCK_N, straddle the diagonal and are masked; the rest see every key of the
# block and run unmasked. With `ATOMIC`, the same loop also adds $s \cdot dS\,K$ into a float32 dQ.


# %%
@triton.jit
def _dkdv_loop(
    dk, dv, k, v, Q, DO, L, Delta, DQ, z, cols, offs_m, offs_d, lo, hi, N_Q, scale, qk_scale,
    MASK: tl.constexpr, ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < N_Q
        ptrs = z * N_Q * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :]
        q = tl.load(Q + ptrs, mask=row_ok[:, None], other=0.0)  # (BLOCK_M, d): HBM -> SRAM
        do = tl.load(DO + ptrs, mask=row_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        l2 = tl.load(L + z * N_Q + rows, mask=row_ok, other=0.0) * 1.4426950408889634  # L in base 2
        delta = tl.load(Delta + z * N_Q + rows, mask=row_ok, other=0.0)
        sT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # S^T / scale: (BLOCK_N, BLOCK_M)
        pT = tl.math.exp2(sT * qk_scale - l2[None, :])  # P^T rebuilt from L, registers
        if MASK:  # diagonal blocks only
            pT = tl.where(rows[None, :] >= cols[:, None], pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do, input_precision=DOT_PRECISION)  # dV += P^T dO
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # dP^T = V dO^T
        dsT = pT * (dpT - delta[None, :])  # dS^T = P^T * (dP^T - D)
        dk += tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PRECISION)  # dK += dS^T Q (scale at the end)
        if ATOMIC:  # dQ[rows] += scale * dS K: a read-modify-write of BLOCK_M x d floats in HBM/L2
            dq_part = tl.dot(tl.trans(dsT).to(k.dtype), k, input_precision=DOT_PRECISION) * scale
            tl.atomic_add(DQ + ptrs, dq_part, mask=row_ok[:, None])
    return dk, dv


@triton.jit
def bwd_dkdv(
    Q, K, V, DO, L, Delta, DQ, DK, DV, scale, qk_scale, N_Q, N_K,
    CAUSAL: tl.constexpr, ATOMIC: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
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
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)  # accumulators, registers
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        lo = start_n * BLOCK_N // BLOCK_M * BLOCK_M  # earlier query blocks see none of these keys: skipped
        hi_masked = tl.minimum(tl.cdiv((start_n + 1) * BLOCK_N, BLOCK_M) * BLOCK_M, N_Q)
    else:
        lo = 0
        hi_masked = 0
    dk, dv = _dkdv_loop(
        dk, dv, k, v, Q, DO, L, Delta, DQ, z, cols, offs_m, offs_d, lo, hi_masked, N_Q, scale, qk_scale,
        True, ATOMIC, BLOCK_M, HEAD_DIM, UPCAST, DOT_PRECISION,
    )  # fmt: skip
    dk, dv = _dkdv_loop(
        dk, dv, k, v, Q, DO, L, Delta, DQ, z, cols, offs_m, offs_d, hi_masked, N_Q, N_Q, scale, qk_scale,
        False, ATOMIC, BLOCK_M, HEAD_DIM, UPCAST, DOT_PRECISION,
    )  # fmt: skip
    tl.store(DK + kv_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=col_ok)  # written once
    tl.store(DV + kv_ptrs, dv.to(DV.dtype.element_ty), mask=col_ok)


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
# ## 4. Kernel 3: dQ, one program per query block
#
# The mirror image: load Q, dO, L and D for a block of query rows once, loop over K/V blocks, accumulate
# $dQ \mathrel{+}= dS\,K$ in registers, write once. Per K/V block: 3 tile products (S, dP, dQ) — S and dP were
# already computed in the dK/dV kernel, and are computed again here. The loop bounds are the forward's: an
# unmasked stage over the full blocks left of the diagonal, a masked stage for the diagonal and the ragged
# last block (padding keys must get P = 0 here: they share the program's rows), nothing above the diagonal.


# %%
@triton.jit
def _dq_loop(
    dq, q, do, l2, delta, K, V, z, rows, offs_n, offs_d, lo, hi, N_K, qk_scale,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_ptrs = z * N_K * HEAD_DIM + cols[:, None] * HEAD_DIM + offs_d[None, :]
        if MASK:
            k = tl.load(K + kv_ptrs, mask=cols[:, None] < N_K, other=0.0)
            v = tl.load(V + kv_ptrs, mask=cols[:, None] < N_K, other=0.0)
        else:
            k = tl.load(K + kv_ptrs)  # (BLOCK_N, d): HBM -> SRAM
            v = tl.load(V + kv_ptrs)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(s * qk_scale - l2[:, None])  # P rebuilt from L
        if MASK:
            visible = cols[None, :] < N_K
            if CAUSAL:
                visible = visible & (rows[:, None] >= cols[None, :])
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # dP = dO V^T
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)  # dQ += dS K
    return dq


@triton.jit
def bwd_dq(
    Q, K, V, DO, L, Delta, DQ, scale, qk_scale, N_Q, N_K,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
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
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    l2 = tl.load(L + z * N_Q + rows, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(Delta + z * N_Q + rows, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        hi = tl.minimum((start_m + 1) * BLOCK_M, N_K)  # keys after the block's last row: skipped
        hi_full = tl.minimum(start_m * BLOCK_M, N_K) // BLOCK_N * BLOCK_N
    else:
        hi = N_K
        hi_full = N_K // BLOCK_N * BLOCK_N
    dq = _dq_loop(
        dq, q, do, l2, delta, K, V, z, rows, offs_n, offs_d, 0, hi_full, N_K, qk_scale,
        False, CAUSAL, BLOCK_N, HEAD_DIM, UPCAST, DOT_PRECISION,
    )  # fmt: skip
    dq = _dq_loop(
        dq, q, do, l2, delta, K, V, z, rows, offs_n, offs_d, hi_full, hi, N_K, qk_scale,
        True, CAUSAL, BLOCK_N, HEAD_DIM, UPCAST, DOT_PRECISION,
    )  # fmt: skip
    tl.store(DQ + ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


# %% [markdown]
# ## 5. The launcher, and the check
#
# `flash_backward` runs kernel 1, then kernel 2, then (two-kernel mode) kernel 3. In atomic mode dQ starts as
# a float32 zero buffer that kernel 2 adds into, and is converted to the input dtype at the end. The dtype
# switches are notebook 06's: `DOT_PRECISION="ieee"` for float32 inputs, `UPCAST` for bfloat16 under the
# interpreter.


# %%
def flash_backward(do, q, k, v, o, L, causal=False, scale=None, dq_mode="two_kernel",
                   block_m=BLOCK_M, block_n=BLOCK_N, num_warps=4, num_stages=2):  # fmt: skip
    """do, q, o: (..., Nq, d); k, v: (..., Nk, d); L: (..., Nq) from the forward. Returns dq, dk, dv."""
    assert dq_mode in ("two_kernel", "atomic")
    *_, n_q, d = q.shape
    n_k = k.shape[-2]
    q3, o3, do3 = (t.reshape(-1, n_q, d).contiguous() for t in (q, o, do))
    k3, v3 = (t.reshape(-1, n_k, d).contiguous() for t in (k, v))
    L3 = L.reshape(-1, n_q).float().contiguous()
    Z = q3.shape[0]
    scale = d**-0.5 if scale is None else scale
    flags = dict(
        UPCAST=course_lib.INTERPRET and q.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    delta = torch.empty(Z, n_q, device=q.device, dtype=torch.float32)
    bwd_preprocess[(triton.cdiv(n_q, block_m), Z)](o3, do3, delta, n_q, HEAD_DIM=d, BLOCK_M=block_m)
    atomic = dq_mode == "atomic"
    dq = torch.zeros(q3.shape, device=q.device, dtype=torch.float32) if atomic else torch.empty_like(q3)
    dk, dv = torch.empty_like(k3), torch.empty_like(v3)
    bwd_dkdv[(triton.cdiv(n_k, block_n), Z)](
        q3, k3, v3, do3, L3, delta, dq, dk, dv, scale, scale * LOG2E, n_q, n_k,
        CAUSAL=causal, ATOMIC=atomic, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, **flags,
    )  # fmt: skip
    if not atomic:
        bwd_dq[(triton.cdiv(n_q, block_m), Z)](
            q3, k3, v3, do3, L3, delta, dq, scale, scale * LOG2E, n_q, n_k,
            CAUSAL=causal, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, **flags,
        )  # fmt: skip
    return dq.to(q.dtype).reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


# %% [markdown]
# The check: for ragged Nq != Nk in both orders, causal and not, in each dtype of `DTYPES`, each gradient is
# held to the course's accuracy rule against the float64 reference (at most twice the error of PyTorch's own
# backward in the same dtype, plus a floor). O and L come from the float64 reference too, so this checks the
# backward alone. The two-kernel mode runs in every dtype; the atomic mode in `ATOMIC_DTYPES` (each dtype and
# mode is one more kernel to compile; the test suite covers the rest). The comparison with course_lib's own
# backward comes in section 8, through the autograd Function.

# %%
def check_backward(case):
    n_q, n_k, causal, dtype = case
    q, k, v = random_qkv((B, H, n_q, D), n_k, dtype=dtype, device=DEVICE)
    do = torch.randn_like(q)
    o64, lse64 = attention(q.double(), k.double(), v.double(), causal=causal, return_lse=True)
    o, lse = o64.to(dtype), lse64.float()
    _, grads64 = reference_outputs(q.double(), k.double(), v.double(), causal, grad_out=do.double())
    _, grads_same = reference_outputs(q, k, v, causal, grad_out=do)
    for dq_mode in ("two_kernel", "atomic") if dtype in ATOMIC_DTYPES else ("two_kernel",):
        what = f"(B, H, Nq, Nk, d)=({B}, {H}, {n_q}, {n_k}, {D}), {dtype}, causal={causal}, {dq_mode}"
        grads = flash_backward(do, q, k, v, o, lse, causal, dq_mode=dq_mode)
        for name, g, g64, g_same in zip(("dQ", "dK", "dV"), grads, grads64, grads_same):
            assert g.dtype == dtype and g.shape == g64.shape, f"{name} {what}"
            assert_close_to_reference(g, g64, g_same, f"{name} {what}")


# On a GPU the cases run side by side, so their kernels compile at the same time (`run_cases`).
cases = [(n_q, n_k, c, dt) for n_q, n_k in [(N_Q, N_K), (N_K, N_Q)] for c in (False, True) for dt in DTYPES]
run_cases(check_backward, cases)
print(f"dQ, dK, dV: within the accuracy rule in every case ({len(DTYPES)} dtypes, causal and not, Nq < Nk and Nq > Nk)")

# %% [markdown]
# ## 6. Causal: which blocks each kernel visits
#
# Which blocks does a program visit, and which of them need the mask? course_lib's kernels ask one helper,
# `course_lib.attention.blocks`: `kv_block_range` gives a query block's keys (the forward and the dQ kernel),
# `q_block_range` a key block's queries (the dK/dV kernel), each as three boundaries `(lo, mid, hi)`; what
# lies before lo is skipped. For a query block's keys, [lo, mid) runs unmasked and [mid, hi) masked (the
# diagonal comes last); for a key block's queries the other way round, [lo, mid) masked and [mid, hi)
# unmasked (the diagonal comes first). Their Python twins, `kv_block_range_py` and `q_block_range_py`, run
# here.
# Below they are compared block by block with the element-wise causal mask: a pair of blocks must be skipped
# exactly when none of its (query, key) pairs is visible, and may run unmasked only when all of them are.


# %% [markdown]
# **Exercise 3 (the dK/dV kernel's causal loop bounds).** A dK/dV program owns the keys `n0 ... n0 +
# block_n - 1` and loops over query blocks starting at multiples of `block_m`. Return `(lo, hi_masked)`:
# the loop starts at query row `lo` (earlier query blocks see none of these keys) and masks the query blocks
# starting in `[lo, hi_masked)`; the blocks from `hi_masked` to the end see every key of the block and run
# unmasked. Both are multiples of `block_m`, or `n_q`. The check compares the blocks your bounds visit and
# mask with the element-wise causal mask.


# %%
def dkdv_bounds(n0, block_m, block_n, n_q):
    ### BEGIN SOLUTION
    lo = n0 // block_m * block_m
    hi_masked = min(math.ceil((n0 + block_n - 1) / block_m) * block_m, n_q)
    return lo, hi_masked
    ### END SOLUTION


# %% tags=["check"]
from course_lib.attention.blocks import kv_block_range_py, q_block_range_py


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
    hints=[
        "Query row i sees key j when j <= i. The first row that sees key n0 is n0: start at the query block "
        "that holds it. Rows from n0 + block_n - 1 on see every key of the block: the masked stage ends at "
        "the first block boundary at or after that row (clip to n_q).",
        "lo = n0 // block_m * block_m; hi_masked = min(math.ceil((n0 + block_n - 1) / block_m) * block_m, n_q)",
    ],
)

# %% [markdown]
# Both kernels' plans from the helpers, for both causal alignments: top-left (query i sees keys j <= i,
# offset 0) and bottom-right (j <= i + Nk - Nq, offset Nk - Nq: the queries are the last Nq positions, as
# with a KV cache), on ragged and unequal shapes:


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
# ## 7. Two kernels or atomics: the trade-off
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
# The useful FLOPs of a backward are 5 products' worth (2.5x the forward), so the two-kernel version does
# 40 % more tensor-core work. The atomic version moves more bytes: for every 4 x BLOCK_N FLOPs saved it adds
# one float32 atomic. Which wins depends on how the GPU's atomic throughput in L2 compares with its
# tensor-core throughput, on d, and on how many programs collide. The measurement below answers for one head
# dim and length on our GPU (and, on a Hopper GPU, with a different dK/dV kernel in the two-kernel mode: see
# after the figure).


# %%
def plot_dq_modes(data, source):
    fig, axes = plt.subplots(
        1, len(data["d"]), figsize=(12.5, 5.5), sharey=True, layout="constrained", squeeze=False
    )
    ratios = []
    for ax, d in zip(axes[0], data["d"]):
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
    fig.suptitle(f"course_lib backward: two kernels or atomic dQ\n{source}", fontsize=15)
    plt.show()
    return ratios


def measure_dq_modes():
    data = {"N": BENCH_NS, "d": list(BENCH_DS), "tokens": BENCH_TOKENS, "tflops": {}}
    cases = [(d, c, m, n) for d in BENCH_DS for c in (False, True) for m in ("two_kernel", "atomic") for n in BENCH_NS]

    def compiled_run(case):  # inputs, and a first call that compiles the kernels
        d, causal, mode, n = case
        q, k, v = random_qkv((BENCH_TOKENS // n * (2048 // d), n, d), dtype=torch.bfloat16, device=DEVICE)
        do = torch.randn_like(q)
        o, lse = lib_forward.forward(q, k, v, causal, None)
        run = lambda: lib_backward.backward(do, q, k, v, o, lse, causal, None, dq_mode=mode)  # noqa: E731
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
    print(f"{got[1]}:")
    print(f"atomic / two-kernel speed between {min(ratios):.2f} and {max(ratios):.2f}x: {winner} wins.")

# %% [markdown]
# course_lib defaults to two kernels for deterministic gradients and no float32 dQ buffer; the figure shows
# what that choice costs or saves on the GPU it was measured on. The balance can tip the other way on a GPU
# whose atomics are fast relative to its tensor cores, or at shapes where few programs collide on the same dQ
# rows: the atomic variant is one flag away in `course_lib.attention.backward.backward(..., dq_mode="atomic")`
# (`flash_attention` and `FlashAttentionTriton` always take two kernels). On a Hopper GPU at d = 128 the
# two-kernel mode's dK/dV step is FlashAttention-3's kernel written in Gluon (notebook 08c), and the atomic
# mode stays in Triton, so there the figure compares more than the tile products.
#
# ### Predict: how much longer than the forward is the backward?
#
# The table above gives the ingredients: the forward does 2 tile products per block pair, the two-kernel
# backward 7 (S in both kernels and dP in both, so three more than a backward that kept P), plus
# D = rowsum(dO ∘ O) (which course_lib's dQ kernel computes itself), and it reads and writes more tensors
# (dO, O, L in; dQ, dK, dV out). For course_lib's kernels in bf16 at N = 4096, d = 64,
# not causal, what is backward time ÷ forward time? Write your number in the next cell before running the
# one after it (a GPU measures it now; a CPU shows the recorded run of `make bench`).

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
# forward and this notebook's backward:


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
        return *flash_backward(do, q, k, v, o, lse, ctx.is_causal), None


q, k, v = random_qkv((B, H, N_Q, D), N_K, device=DEVICE, requires_grad=True)
do = torch.randn(B, H, N_Q, D, device=DEVICE)
grads = torch.autograd.grad(FlashAttention.apply(q, k, v, True), (q, k, v), do)
grads_lib = torch.autograd.grad(course_lib.FlashAttentionTriton.apply(q, k, v, True), (q, k, v), do)
for name, g, g_lib in zip(("dQ", "dK", "dV"), grads, grads_lib):
    torch.testing.assert_close(g, g_lib, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
print("this notebook's Function and course_lib.FlashAttentionTriton give the same gradients")

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
# **Exercise 4 — the softmax backward of one row.** For one row, $P = \mathrm{softmax}(S)$ and $dP$ the
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
# **Exercise 5 — count the work.** Return the tensor-core FLOPs (2 x m x n x k per m x k by k x n product) of
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
# **Exercise 6 — a dV-only kernel.** Write `dv_kernel`: one program per K/V block (keys `cols`), looping over
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
# **Exercise 7 (open).** In atomic mode, every dK/dV program walks the query blocks in the same order, so at
# any moment many programs add into the *same* dQ rows. Make program `start_n` start its loop at a different
# query block (walking around the end). Does the result change? On a GPU, does the atomic mode get faster?

# %% [markdown]
# ## Summary
#
# - The backward rebuilds P from the saved logsumexp L, one tile at a time:
#   $P = 2^{\,S\cdot s\log_2 e - L\log_2 e}$ (S unscaled here). D = rowsum(dO ∘ O) replaces rowsum(P ∘ dP) and
#   costs one small preprocessing kernel — or none: course_lib's dQ kernel, which holds the dO rows anyway,
#   computes D itself and runs first, so its backward is two launches (notebook 08 says why launches count).
# - dK and dV are sums over queries: one program per K/V block keeps K, V and the dK, dV accumulators on chip
#   and loops over query blocks. dQ is a sum over keys: one program per query block, looping over K/V blocks.
# - Two kernels: 7 tile products instead of 5, no atomics, deterministic. One kernel with atomic dQ: 5
#   products, but float32 read-modify-writes of dQ, contention and run-to-run differences. The measurement
#   decides.
# - Causal: both kernels skip the blocks with no visible pair and mask only the diagonal blocks, as the
#   forward (course_lib's atomic mode masks every block of the dK/dV kernel: see section 3).
# - `course_lib.FlashAttentionTriton` saves Q, K, V, O and L (no Nq x Nk tensor); gradcheck passes in float64.
#
# Next, notebook 08 measures the whole thing against PyTorch's attention backends, and climbs the optimisation
# ladder one change at a time.
