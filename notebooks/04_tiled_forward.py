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
# # 04 · Tiled attention in PyTorch: the forward pass
#
# Standard attention writes two N × N matrices, S and P, to GPU memory (HBM) and reads them back
# (notebook 02). FlashAttention never forms them: it cuts Q, K and V into blocks, computes one
# tile of S at a time on chip, and folds it into the output with the online softmax of notebook 03. Here
# we build its forward pass in plain PyTorch and count what it saves; notebook 04b builds the backward.
# The Triton kernel of notebook 06 runs these same loops, one tile per step, inside a GPU program.
#
# **Learning goals**
# 1. Cut Q into row blocks and K, V into column blocks, and see how the on-chip memory (SRAM) of size M
#    bounds the block sizes.
# 2. Put the online softmax inside attention: an unnormalised O with a running max m and sum l per row,
#    rescaled as blocks arrive, normalised once at the end; save the logsumexp L = m + log l. Write the
#    rescale yourself, fix a loop that forgets it, and mask padding keys with -inf (not 0).
# 3. Skip the tiles a causal mask hides (write the loop bounds yourself), and count the work saved.
# 4. Write the **whole tiled forward** yourself: both loops, the causal bounds in both alignments, rows that
#    see no key, the final normalisation and L, checked against float64 on ragged sizes.
# 5. Compare FlashAttention-1 with FlashAttention-2's three changes: non-matmul work, parallelism over the
#    sequence (the loop order, and its HBM traffic; watch both orders step by step), and how the threads of
#    one program share a tile.
# 6. Count the HBM bytes of standard and tiled attention as functions of N, d and M; meet Θ(N²d²/M).

# %% [markdown]
# ## 0. Sizes
#
# The main problem runs on `course_lib.DEVICE` (the small figure and exercise problems on the CPU). The
# tiled code is pure PyTorch: every tile costs a few small
# PyTorch calls, so it is slow but exact, and the CPU sizes stay small. `N_FIG` and `BLOCK_FIG` are the
# small problem we draw step by step.

# %%
import math

import matplotlib.pyplot as plt
import numpy as np
import torch

import course_lib
from course_lib.attention import animate, tiles
from course_lib.attention.reference import attention, causal_mask_tile
from course_lib.attention.tiled import flash_forward
from course_lib.exercises import check, check_cases, predict
from course_lib.perf import plotting
from course_lib.perf.plotting import plot_series
from course_lib.testing import random_qkv

DEVICE = course_lib.DEVICE
BATCH, HEADS, N, D = course_lib.pick(cpu=(1, 2, 256, 64), gpu=(2, 4, 1024, 64))
BLOCK_M, BLOCK_N = 64, 64  # the paper's B_r (rows of Q per tile) and B_c (rows of K and V per tile)
N_FIG, D_FIG, BLOCK_FIG = 128, 16, 32
plotting.use_readable_defaults()  # projector-sized fonts for every figure, plt's own included
torch.manual_seed(0)
print(f"device {DEVICE}; batch {BATCH}, heads {HEADS}, N {N}, d {D}; tiles {BLOCK_M} x {BLOCK_N}")

# %% [markdown]
# ## 1. What standard attention stores
#
# For each (batch, head): S = Q Kᵀ / √d, P = softmax(S) row by row, O = P V. S and P are N × N.
# `course_lib.attention.reference.attention` computes exactly this; in float64 it is the reference everything below
# is checked against. The N × N matrices dominate memory long before the inputs do:

# %%
for n in (1024, 4096, 16384, 65536):
    qkvo = 4 * n * 128 * 2  # Q, K, V, O at d = 128 in bf16
    s = n * n * 2  # one N x N matrix in bf16
    print(f"N = {n:6}: Q, K, V, O take {qkvo / 2**20:8.1f} MiB per head; S alone takes {s / 2**20:8.1f} MiB")

# %% [markdown]
# ## 2. Tiles, and how SRAM bounds their size
#
# Cut Q into $T_r = \lceil N_q / B_r \rceil$ row blocks $Q_i$ of $B_r$ rows, and K and V into
# $T_c = \lceil N_k / B_c \rceil$ blocks $K_j, V_j$ of $B_c$ rows. Tile $(i, j)$ of the score matrix is
# $S_{ij} = Q_i K_j^T / \sqrt d$, of size $B_r \times B_c$. To work on it, the chip needs $Q_i$, $K_j$, $V_j$
# and the output rows $O_i$: $(2 B_r + 2 B_c)\, d$ numbers, plus the tile itself.
#
#
# FlashAttention-1 (Dao et al., 2022, Algorithm 1) sizes the blocks from the SRAM size M (in elements):
# $B_c = \lceil M / 4d \rceil$ and $B_r = \min(B_c, d)$. Each piece is then bounded by a fraction of M:
# $K_j, V_j$ take $2 B_c d \approx M/2$, $Q_i, O_i$ take $2 B_r d \le 2 B_c d$, and the tile
# $B_r \times B_c \le d \cdot M/4d = M/4$. Their sum is at most about $1.25\,M$: a small constant times M,
# which is all the paper's analysis needs (its bounds hold up to constant factors). It is not a promise that
# all of them fit in M at once. An H100 or H200 has 228 KiB of shared memory per streaming multiprocessor
# (SM); an A100 has up to 164 KiB. In bf16 (2 bytes) that is M = 116 736 and 83 968 elements, and the cell
# below adds the pieces up: at d = 64 they fit, at d = 128 they do not.

# %%
SRAM_BYTES = {"A100 (164 KiB)": 164 * 1024, "H100/H200 (228 KiB)": 228 * 1024}
print(
    f"{'GPU':20} {'d':>4} {'M':>7} {'B_r':>4} {'B_c':>4} {'K_j,V_j':>8} {'Q_i,O_i':>8} {'tile':>6} {'sum':>8}  fits"
)
fits = {}
for gpu, sram in SRAM_BYTES.items():
    M = sram // 2  # elements of bf16
    for d in (64, 128):
        b_r, b_c = tiles.paper_block_sizes(M, d)
        kv, qo, tile = 2 * b_c * d, 2 * b_r * d, b_r * b_c
        total = kv + qo + tile
        fits[gpu, d] = total <= M
        print(
            f"{gpu:20} {d:4} {M:7} {b_r:4} {b_c:4} {kv:8} {qo:8} {tile:6} {total:8}  {'yes' if fits[gpu, d] else 'NO'}"
        )
        assert kv <= M / 2 + 2 * d and qo <= kv and tile <= M / 4 + d  # each piece: a fraction of M
        assert total <= 1.25 * M + 5 * d  # their sum: a small constant times M
assert fits == {
    ("A100 (164 KiB)", 64): True,
    ("A100 (164 KiB)", 128): False,  # 95 744 elements for M = 83 968
    ("H100/H200 (228 KiB)", 64): True,
    ("H100/H200 (228 KiB)", 128): False,  # 120 320 elements for M = 116 736
}

# %% [markdown]
# Real kernels do not use these numbers. FlashAttention-2 chooses among **{64, 128} × {64, 128}**, tuned
# per head dimension and GPU (128 × 128 at d = 64, 128 × 64 at d = 128 on an A100 or H100), and Triton
# kernels autotune over similar powers of two. The formula assumes the only limit is SRAM; the real limits
# are elsewhere:
# - the tile S, its exponentials P and the accumulator O live in **registers** (256 KiB per SM, shared by
#   every thread on it); past a size, registers spill to slow memory;
# - several warps and a second buffer for the next K, V block (pipelining) must fit at the same time;
# - matrix instructions (tensor cores) work on tiles whose sides are multiples of 16, and powers of two
#   keep the index arithmetic cheap.
#
# In this notebook we use `BLOCK_M = BLOCK_N = 64` (`course_lib.attention.tiled`'s default).

# %% [markdown]
# ## 3. The online softmax inside attention
#
# Take one row block $Q_i$. The keys arrive one block at a time. For each row we keep the running max m,
# the running sum l, and an **unnormalised** output row: $\tilde O = \sum_j e^{s_j - m}\, v_j$ over the
# keys seen so far. When block j arrives with scores $S = Q_i K_j^T/\sqrt d$:
#
# $$m_{new} = \max(m, \mathrm{rowmax}(S)), \quad \tilde P = e^{S - m_{new}}, \quad \alpha = e^{m - m_{new}},$$
# $$l \leftarrow \alpha\, l + \mathrm{rowsum}(\tilde P), \qquad
#   \tilde O \leftarrow \alpha\, \tilde O + \tilde P V_j.$$
#
# $\tilde O$ is rescaled by the same factor α as l, for the same reason (notebook 03, section 5): each of
# its terms was weighted against the old maximum. After the last block, $O = \tilde O / l$: **one**
# division per row, at the end. We also keep one number per row for the backward pass, the logsumexp
# $L = m + \log l$, which is all it takes to rebuild any probability: $P_{rc} = e^{S_{rc} - L_r}$.


# %%
def attend_row_block(Qi, K, V, block_n, record=None):
    """O_i and L_i for one block of query rows Qi (..., B_r, d), keys and values K, V (..., N_k, d)."""
    scale = Qi.shape[-1] ** -0.5
    m = torch.full(Qi.shape[:-1], -math.inf, dtype=Qi.dtype, device=Qi.device)
    l = torch.zeros(Qi.shape[:-1], dtype=Qi.dtype, device=Qi.device)
    O = torch.zeros_like(Qi)
    for j0 in range(0, K.shape[-2], block_n):
        Kj, Vj = K[..., j0 : j0 + block_n, :], V[..., j0 : j0 + block_n, :]
        S = Qi @ Kj.transpose(-1, -2) * scale
        m_new = torch.maximum(m, S.amax(dim=-1))
        P = torch.exp(S - m_new[..., None])
        alpha = torch.exp(m - m_new)
        l = alpha * l + P.sum(dim=-1)
        O = alpha[..., None] * O + P @ Vj
        m = m_new
        if record is not None:
            record.append(
                {"j": j0 // block_n, "m": m.cpu().numpy(), "l": l.cpu().numpy(), "O": O.cpu().numpy()}
            )
    return O / l[..., None], m + torch.log(l)


q, k, v = random_qkv((BATCH, HEADS, N, D), dtype=torch.float32, device=DEVICE)
O_ref, L_ref = attention(q.double(), k.double(), v.double(), return_lse=True)
i0, i1 = BLOCK_M, 2 * BLOCK_M  # the second row block
O_i, L_i = attend_row_block(q[..., i0:i1, :], k, v, BLOCK_N)
torch.testing.assert_close(O_i.double(), O_ref[..., i0:i1, :], atol=1e-5, rtol=1e-5)
torch.testing.assert_close(L_i.double(), L_ref[..., i0:i1], atol=1e-5, rtol=1e-5)
print(
    f"rows {i0}..{i1 - 1}: O and L match the float64 reference, "
    f"max |O error| = {(O_i.double() - O_ref[..., i0:i1, :]).abs().max():.1e}"
)

# %% [markdown]
# **Exercise 1 (find the bug: the accumulator is not rescaled).** Here is a first attempt at
# `attend_row_block`. It runs, its l is right, and its output is wrong. Run it, compare with the reference,
# and find the line that is missing its factor.


# %%
def attend_row_block_buggy(Qi, K, V, block_n):
    scale = Qi.shape[-1] ** -0.5
    m = torch.full(Qi.shape[:-1], -math.inf, dtype=Qi.dtype, device=Qi.device)
    l = torch.zeros(Qi.shape[:-1], dtype=Qi.dtype, device=Qi.device)
    O = torch.zeros_like(Qi)
    for j0 in range(0, K.shape[-2], block_n):
        Kj, Vj = K[..., j0 : j0 + block_n, :], V[..., j0 : j0 + block_n, :]
        S = Qi @ Kj.transpose(-1, -2) * scale
        m_new = torch.maximum(m, S.amax(dim=-1))
        P = torch.exp(S - m_new[..., None])
        alpha = torch.exp(m - m_new)
        l = alpha * l + P.sum(dim=-1)
        O = O + P @ Vj
        m = m_new
    return O / l[..., None], m + torch.log(l)


O_bug, L_bug = attend_row_block_buggy(q[..., i0:i1, :], k, v, BLOCK_N)
print(f"L error: {(L_bug.double() - L_ref[..., i0:i1]).abs().max():.1e}")
print(f"O error: {(O_bug.double() - O_ref[..., i0:i1, :]).abs().max():.1e}")

# %% [markdown]
# Now write the body of the loop yourself, correctly: given the state `(m, l, O)` of a block of rows and the
# scores `S` and values `Vj` of one K/V block, return the new state. (Section 3's formulas; do not look at
# `attend_row_block`.)


# %%
def online_step(m, l, O, S, Vj):
    """m, l: (..., B_r); O: (..., B_r, d) unnormalised; S: (..., B_r, B_c); Vj: (..., B_c, d)."""
    ### BEGIN SOLUTION
    m_new = torch.maximum(m, S.amax(dim=-1))
    P = torch.exp(S - m_new[..., None])
    alpha = torch.exp(m - m_new)
    return m_new, alpha * l + P.sum(dim=-1), alpha[..., None] * O + P @ Vj
    ### END SOLUTION


# %% tags=["check"]
def _run_online(step, Qi, K, V, block_n):
    m = torch.full(Qi.shape[:-1], -math.inf, dtype=Qi.dtype)
    l, O = torch.zeros_like(m), torch.zeros_like(Qi)
    for j0 in range(0, K.shape[-2], block_n):
        S = Qi @ K[..., j0 : j0 + block_n, :].mT * Qi.shape[-1] ** -0.5
        m, l, O = step(m, l, O, S, V[..., j0 : j0 + block_n, :])
    return O / l[..., None], m + torch.log(l)


_q, _k, _v = random_qkv((2, 24, 8), 70, dtype=torch.float64)
check(
    "online_step",
    lambda: _run_online(online_step, _q, _k, _v, 16),
    attention(_q, _k, _v, return_lse=True),
    parts=["O", "L"],
)

# %% [markdown]
# **Exercise 2 (padding keys: -inf, not 0).** When N_k is not a multiple of B_c, a kernel loads a whole last
# block anyway and fills the keys past the end with zeros. Their scores must then be set to **-inf** so that
# exp gives them weight 0; setting them to 0 is a classic bug, because exp(0 - m) is not 0. Write
# `mask_padding(S, j0, n_k)`: S is the score tile of the keys `j0 ... j0 + B_c - 1`; return S with the
# columns of keys >= n_k set to -inf. The cell after the check shows what a 0 would have done.


# %%
def mask_padding(S, j0, n_k):
    ### BEGIN SOLUTION
    cols = j0 + torch.arange(S.shape[-1], device=S.device)
    return S.masked_fill(cols >= n_k, -math.inf)
    ### END SOLUTION


# %% tags=["check"]
def _padded_attention(mask_fn, Qi, K, V, block_n):
    """attend_row_block with K and V zero-padded to whole blocks, and mask_fn applied to each score tile."""
    n_k = K.shape[-2]
    pad = -n_k % block_n
    K, V = torch.nn.functional.pad(K, (0, 0, 0, pad)), torch.nn.functional.pad(V, (0, 0, 0, pad))
    m = torch.full(Qi.shape[:-1], -math.inf, dtype=Qi.dtype)
    l, O = torch.zeros_like(m), torch.zeros_like(Qi)
    for j0 in range(0, K.shape[-2], block_n):
        S = mask_fn(Qi @ K[..., j0 : j0 + block_n, :].mT * Qi.shape[-1] ** -0.5, j0, n_k)
        m_new = torch.maximum(m, S.amax(dim=-1))
        P = torch.exp(S - m_new[..., None])
        alpha = torch.exp(m - m_new)
        l, O, m = alpha * l + P.sum(-1), alpha[..., None] * O + P @ V[..., j0 : j0 + block_n, :], m_new
    return O / l[..., None], m + torch.log(l)


check(
    "mask_padding",
    lambda: _padded_attention(mask_padding, _q, _k, _v, 32),
    attention(_q, _k, _v, return_lse=True),
    parts=["O", "L"],
)

# %%
zero_fill = lambda S, j0, n_k: S.masked_fill(j0 + torch.arange(S.shape[-1]) >= n_k, 0.0)  # noqa: E731
O_zero, L_zero = _padded_attention(zero_fill, _q, _k, _v, 32)
O_true, L_true = attention(_q, _k, _v, return_lse=True)
print(
    f"70 keys padded to 96, padding scores set to 0: max |O error| {(O_zero - O_true).abs().max():.2f}, "
    f"L too large by up to {(L_zero - L_true).max():.2f}"
)

# %% [markdown]
# ## 4. Watching the tile loop
#
# A small problem (N = 128, d = 16, tiles of 32 × 32) makes a 4 × 4 grid of tiles. We record m, l and
# $\tilde O$ of Q block 1 after each K/V block and draw one column per step: which tile is on chip, the
# running max and sum of each of the block's 32 rows, and how far the current estimate $\tilde O / l$ still
# is from the final output. The distance reaches 0 only when the last block has arrived: every key can
# change every output row.

# %%
q_fig, k_fig, v_fig = random_qkv((N_FIG, D_FIG), dtype=torch.float64)
fig_block = 1
steps = []
O_fig, _ = attend_row_block(q_fig[BLOCK_FIG : 2 * BLOCK_FIG], k_fig, v_fig, BLOCK_FIG, record=steps)
for s in steps:
    s["i"] = fig_block
fig = animate.inner_loop_strip(steps, N_FIG, N_FIG, BLOCK_FIG, BLOCK_FIG, O_final=O_fig.numpy())
fig.suptitle("Q block 1's inner loop: m only grows, l is rescaled, O is final at the last K/V block")
plt.show()

# %% [markdown]
# ## 5. Causal masking: skip what is hidden
#
# With a causal mask, query r sees keys c ≤ r (top-left aligned, as in `scaled_dot_product_attention`).
# A tile entirely above the diagonal is fully masked: it is **skipped**, never loaded. A tile entirely below
# needs no mask at all. Only the tiles on the diagonal are computed and then masked. For a square problem
# with T × T tiles: T(T−1)/2 skipped, T diagonal, T(T−1)/2 full, so the work tends to one half.

# %%
counts = tiles.block_counts(N, N, BLOCK_M, BLOCK_N, causal=True)
T = N // BLOCK_M
assert counts == {"skipped": T * (T - 1) // 2, "diagonal": T, "full": T * (T - 1) // 2}
computed = counts["full"] + counts["diagonal"]
print(
    f"N = {N}, tiles of {BLOCK_M}: {counts}; {computed} of {T * T} tiles computed ({computed / (T * T):.0%})"
)
for n in (1024, 4096, 16384):
    c = tiles.block_counts(n, n, 128, 128, causal=True)
    done_n = c["full"] + c["diagonal"]
    print(
        f"N = {n:5}, tiles of 128: computed {done_n / (n // 128) ** 2:.1%} of the tiles, "
        f"of which {c['diagonal'] / done_n:.1%} need a mask"
    )

# %% [markdown]
# **Exercise 3 (the causal loop bounds).** In the FA-2 order (section 6), the program of the query rows
# `i0 ... i1 - 1` loops over K/V blocks starting at `0, B_c, 2 B_c, ...` and stops before `kv_stop`. Which
# tiles need the mask? Write `causal_plan(i0, i1, n_k, block_n)` returning `(kv_stop, first_masked)`: the
# loop visits the K/V blocks starting below `kv_stop` (every block after it is fully hidden and never
# loaded), and the tiles starting at or after `first_masked` (a multiple of B_c) need the mask, the ones
# before do not. The check compares your plan with `tiles.block_map` for ragged lengths and unequal block
# sizes.


# %%
def causal_plan(i0, i1, n_k, block_n):
    ### BEGIN SOLUTION
    kv_stop = min(i1, n_k)
    if n_k <= i0 + 1:  # even the block's first row sees every key: no tile needs the mask
        return kv_stop, kv_stop
    return kv_stop, (i0 + 1) // block_n * block_n
    ### END SOLUTION


# %% tags=["check"]
def _plan_map(plan_fn, n_q, n_k, block_m, block_n):
    kinds = np.full((math.ceil(n_q / block_m), math.ceil(n_k / block_n)), tiles.SKIPPED)
    for i, i0 in enumerate(range(0, n_q, block_m)):
        kv_stop, first_masked = plan_fn(i0, min(i0 + block_m, n_q), n_k, block_n)
        for j, j0 in enumerate(range(0, kv_stop, block_n)):
            kinds[i, j] = tiles.DIAGONAL if j0 >= first_masked else tiles.FULL
    return kinds


_cases = [(256, 256, 64, 64), (100, 75, 32, 16), (90, 130, 16, 32), (40, 21, 20, 16)]
_cases += [(97, 97, 32, 32), (40, 40, 15, 16)]  # a last block of one row; blocks that are not powers of two
check(
    "causal_plan",
    lambda: [_plan_map(causal_plan, *c) for c in _cases],
    [tiles.block_map(*c, causal=True) for c in _cases],
)

# %%
fig, ax = plt.subplots(figsize=(6.5, 5), constrained_layout=True)
tiles.draw_block_map(
    ax,
    N,
    N,
    BLOCK_M,
    BLOCK_N,
    causal=True,
    done=tiles.tile_schedule(N, N, BLOCK_M, BLOCK_N, True),
    legend=True,
    title=f"Causal, N = {N}: {computed} of {T * T} tiles computed, {T} masked (M)",
)
plt.show()

# %% [markdown]
# ## 6. The whole forward pass: two loop orders
#
# The full forward wraps the inner loop of section 3 in a loop over the row blocks of Q. FlashAttention-2
# (Dao, 2023) changed three things relative to FlashAttention-1, and this section shows each:
# 1. **Fewer non-matmul FLOPs**: O stays unnormalised until the very end (one division per element instead
#    of one per tile), and only $L = m + \log l$ is stored for the backward instead of both m and l.
# 2. **Parallelism over the sequence**, from the loop order: Q blocks outside, so every row block is an
#    independent program (below).
# 3. **How the threads of one program share a tile**: each group of threads takes its own rows of the tile
#    instead of its own columns (the paper's §3.3, "split-Q" rather than "split-K"; the end of this section).
#
# **FlashAttention-2**: outer loop over Q blocks, inner over K/V blocks. $Q_i$, m, l and $\tilde O_i$ stay
# on chip for the whole inner loop; $O_i$ and $L_i$ are written once. Row blocks are independent, so
# each one can go to its own GPU program: batch × heads × $T_r$ programs in parallel.
#
# **FlashAttention-1**: outer loop over K/V blocks, inner over Q blocks. $K_j, V_j$ stay on chip, but every
# visit to row block i must read $O_i$, $l_i$, $m_i$ back from HBM and write them again; and O is kept
# normalised after every step (divided by the new l each time). The original kernel parallelised over
# batch × heads only.
#
# **Exercise 4 (the whole forward, FlashAttention-2 order).** Write the body of `forward_fa2`: everything
# of this notebook so far goes in. The outer loop over row blocks; per row block the running m, l and
# unnormalised $\tilde O_i$; the rescale by α; −inf for every score a row must not see; the causal loop
# bounds; one division at the end, and $L = m + \log l$. `causal` is `False`, `"top_left"` (or `True`:
# query i sees keys j ≤ i, as above) or `"bottom_right"` (j ≤ i + N_k − N_q: the queries are the *last*
# N_q positions, as with a KV cache). With bottom-right alignment and N_q > N_k, the first N_q − N_k rows
# see no key at all: they must come out as O = 0 and L = −inf, as the reference's do, not NaN.
# `causal_mask_tile(i0, i1, j0, j1, device, offset)` returns the tile of the mask j ≤ i + offset.
# The check runs your function on ragged sizes (N not a multiple of the block), N_q ≠ N_k, and both
# alignments, against the float64 reference, and compares O and L.


# %%
def forward_fa2(q, k, v, causal=False, block_m=BLOCK_M, block_n=BLOCK_N):
    """Tiled attention forward, FA-2 order. q: (..., N_q, d); k, v: (..., N_k, d); causal: False,
    "top_left" (or True) or "bottom_right". Returns O (..., N_q, d) and L (..., N_q), q's dtype."""
    scale = q.shape[-1] ** -0.5
    n_q, n_k = q.shape[-2], k.shape[-2]
    O = torch.empty_like(q)  # HBM: each row block writes its rows once
    L = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)
    ### BEGIN SOLUTION
    offset = n_k - n_q if causal == "bottom_right" else 0  # row i sees keys j <= i + offset
    for i0 in range(0, n_q, block_m):
        i1 = min(i0 + block_m, n_q)
        Qi = q[..., i0:i1, :]
        m = torch.full(Qi.shape[:-1], -math.inf, dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        Oi = torch.zeros_like(Qi)
        kv_stop = min(n_k, i1 + offset) if causal else n_k  # no key at or after i1 + offset is seen
        for j0 in range(0, kv_stop, block_n):
            j1 = min(j0 + block_n, n_k)
            S = Qi @ k[..., j0:j1, :].mT * scale
            if causal and j1 - 1 > i0 + offset:  # the tile crosses the diagonal
                S = S.masked_fill(~causal_mask_tile(i0, i1, j0, j1, q.device, offset), -math.inf)
            m_new = torch.maximum(m, S.amax(dim=-1))
            m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # a row that has seen no key yet
            P = torch.exp(S - m_safe[..., None])
            alpha = torch.exp(m - m_safe)
            l = alpha * l + P.sum(dim=-1)
            Oi = alpha[..., None] * Oi + P @ v[..., j0:j1, :]
            m = m_new
        O[..., i0:i1, :] = Oi / torch.where(l > 0, l, 1.0)[..., None]  # a row with no key keeps O = 0
        L[..., i0:i1] = m + torch.log(l)  # -inf for a row with no key
    ### END SOLUTION
    return O, L


# %% tags=["check"]
def _case_inputs(n_q, n_k):
    """float32 q (2, n_q, 16), k and v (2, n_k, 16), the same for every call with these lengths."""
    return random_qkv((2, n_q, 16), n_k, generator=torch.Generator().manual_seed(1000 * n_q + n_k))


_forward_cases = [
    dict(n_q=64, n_k=64, causal=False, block_m=16, block_n=16),
    dict(n_q=50, n_k=50, causal=False, block_m=16, block_n=16),  # ragged: the last blocks hold 2 rows
    dict(n_q=40, n_k=75, causal=False, block_m=16, block_n=32),  # N_q != N_k, unequal blocks
    dict(n_q=50, n_k=50, causal="top_left", block_m=16, block_n=16),
    dict(n_q=40, n_k=75, causal="top_left", block_m=16, block_n=32),
    dict(n_q=75, n_k=40, causal="top_left", block_m=32, block_n=16),
    dict(n_q=40, n_k=75, causal="bottom_right", block_m=16, block_n=32),
    dict(n_q=75, n_k=40, causal="bottom_right", block_m=32, block_n=16),  # rows 0..34 see no key
]
check_cases(
    "forward_fa2 (the whole forward)",
    _forward_cases,
    lambda n_q, n_k, causal, block_m, block_n: forward_fa2(*_case_inputs(n_q, n_k), causal, block_m, block_n),
    lambda n_q, n_k, causal, **_: attention(
        *(t.double() for t in _case_inputs(n_q, n_k)), causal=causal, return_lse=True
    ),
    rtol=1e-4,
    atol=1e-5,
    outputs=("O", "L"),
)

# %% [markdown]
# From here on, course_lib's finished forward (`course_lib.attention.tiled.flash_forward`, the same loops)
# stands in for yours. FlashAttention-1's order is written out below for comparison, with a small counter
# on every load and store: everything sliced out of a full-size tensor is "loaded to the chip", everything
# written into one is "stored".


# %%
class HBM:
    """Counts elements moved between HBM (full-size tensors) and the chip, per (batch, head)."""

    def __init__(self, heads=1):
        self.heads, self.reads, self.writes = heads, 0, 0

    def load(self, t):
        self.reads += t.numel() // self.heads
        return t

    def store(self, dst, index, value):
        self.writes += value.numel() // self.heads
        dst[index] = value


def forward_fa1(q, k, v, causal=False, block_m=BLOCK_M, block_n=BLOCK_N, io=None):
    io = io or HBM()
    scale = q.shape[-1] ** -0.5
    n_q, n_k = q.shape[-2], k.shape[-2]
    O = torch.empty_like(q)
    l = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)
    m = torch.empty_like(l)
    io.store(O, np.s_[...], torch.zeros_like(O))  # Algorithm 1, line 2: initialise O, l, m in HBM
    io.store(l, np.s_[...], torch.zeros_like(l))
    io.store(m, np.s_[...], torch.full_like(m, -math.inf))
    for j0 in range(0, n_k, block_n):
        j1 = min(j0 + block_n, n_k)
        Kj, Vj = io.load(k[..., j0:j1, :]), io.load(v[..., j0:j1, :])
        for i0 in range(0, n_q, block_m):
            i1 = min(i0 + block_m, n_q)
            kind = tiles.block_kind(i0, i1, j0, j1, causal)
            if kind == tiles.SKIPPED:
                continue
            Qi = io.load(q[..., i0:i1, :])
            Oi, li, mi = io.load(O[..., i0:i1, :]), io.load(l[..., i0:i1]), io.load(m[..., i0:i1])
            S = Qi @ Kj.transpose(-1, -2) * scale
            if kind == tiles.DIAGONAL:
                S = S.masked_fill(~causal_mask_tile(i0, i1, j0, j1, q.device), -math.inf)
            m_tile = S.amax(dim=-1)  # this tile's own max and sum ...
            P = torch.exp(S - m_tile[..., None])
            l_tile = P.sum(dim=-1)
            m_new = torch.maximum(mi, m_tile)  # ... merged with the state read from HBM
            l_new = torch.exp(mi - m_new) * li + torch.exp(m_tile - m_new) * l_tile
            O_new = (
                (li * torch.exp(mi - m_new))[..., None] * Oi + torch.exp(m_tile - m_new)[..., None] * (P @ Vj)
            ) / l_new[..., None]
            io.store(O, np.s_[..., i0:i1, :], O_new)
            io.store(l, np.s_[..., i0:i1], l_new)
            io.store(m, np.s_[..., i0:i1], m_new)
    return O, m + torch.log(l)


# %% [markdown]
# It gives the reference's O and L (it keeps separate tile maxima, as the paper's Algorithm 1 does; with
# equal block sizes no tile row is entirely masked, so `m_tile` is always finite), and so does
# `course_lib.attention.tiled.flash_forward`, the finished FA-2 forward:

# %%
for causal in (False, True):
    O_ref, L_ref = attention(q.double(), k.double(), v.double(), causal=causal, return_lse=True)
    O_lib, L_lib = flash_forward(q, k, v, causal=causal, block_m=BLOCK_M, block_n=BLOCK_N)
    for name, (O_, L_) in {
        "FA1 loop": forward_fa1(q, k, v, causal),
        "course_lib (FA2)": (O_lib, L_lib),
    }.items():
        torch.testing.assert_close(O_.double(), O_ref, atol=2e-5, rtol=1e-5, msg=f"{name}, causal={causal}")
        torch.testing.assert_close(L_.double(), L_ref, atol=2e-5, rtol=1e-5, msg=f"{name}, causal={causal}")
print(
    "FA1 order and course_lib.attention.tiled.flash_forward both match the float64 reference, causal or not"
)

# %% [markdown]
# ### The two loop orders, step by step
#
# The same small causal problem (N = 128, d = 16, tiles of 32 × 32) run in both orders by
# `course_lib.attention.animate`, which records m, l and the estimate $\tilde O / l$ of every query row after
# each tile. The strip shows steps 1, 4, 7 and 10 of the ten. FA-1 (K/V outer) sweeps every remaining row
# block for each K/V block, re-reading and re-writing their O, l and m in HBM each time; with the causal
# mask, row block i is final only when the sweep of K/V block i reaches it (its diagonal tile is the last
# one its rows see), so after 7 steps only 64 rows are final. FA-2 (Q outer) finishes each row block in one
# pass over its K/V blocks, with its state on chip (96 rows final after 7 steps), so a program can write its
# rows and leave. Tiles above the diagonal are never visited, in either order. In JupyterLab, the slider
# under the strip shows every step with m and l as well (its steps count from 1, as the titles do).

# %%
fwd_frames = {
    order: animate.forward_frames(q_fig, k_fig, v_fig, BLOCK_FIG, BLOCK_FIG, causal=True, order=order)
    for order in ("fa1", "fa2")
}
animate.forward_strip(fwd_frames)
plt.show()
animate.forward_widget(fwd_frames)

# %% [markdown]
# Now count. FA1's counter must agree with the formula in `course_lib.attention.tiles.hbm_elements` (read
# its docstring: it lists every load and store per tile). FA2's loop reads $Q_i$ once, $K_j$ and $V_j$ for
# every tile it computes, and writes $O_i$ and $L_i$ once: `fa2_traffic` walks the loop's tiles
# (`tiles.tile_schedule`) and adds exactly that. The counts tell the two loop orders apart:


# %%
def fa2_traffic(n_q, n_k, d, block_m, block_n, causal=False):
    """(reads, writes) of FA2's forward per (batch, head), in elements, from the tiles its loops visit."""
    cols = lambda j: min((j + 1) * block_n, n_k) - j * block_n  # noqa: E731
    visited = tiles.tile_schedule(n_q, n_k, block_m, block_n, causal)
    reads = n_q * d + sum(2 * cols(j) * d for _, j in visited)  # Q once; K_j, V_j per tile
    return reads, n_q * (d + 1)  # O and L written once


print(f"per (batch, head), N = {N}, d = {D}, tiles {BLOCK_M} x {BLOCK_N}, elements moved:")
for causal in (False, True):
    io = HBM(BATCH * HEADS)
    forward_fa1(q, k, v, causal, io=io)
    counted = {"fa1": (io.reads, io.writes), "fa2": fa2_traffic(N, N, D, BLOCK_M, BLOCK_N, causal)}
    for order, (reads, writes) in counted.items():
        predicted = tiles.hbm_elements(order, N, N, D, BLOCK_M, BLOCK_N, causal)
        assert reads + writes == predicted, (order, causal, reads + writes, predicted)
        print(f"  {order}, causal={causal!s:5}: {reads:8} reads + {writes:7} writes = {predicted:8}")
    print(f"  standard, causal={causal!s:5}: {tiles.hbm_elements('standard', N, N, D):30}")

# %% [markdown]
# At these sizes FA1 moves more than FA2: it re-reads and re-writes $O_i$, $l_i$, $m_i$ on every tile,
# while FA2 re-reads only $K_j, V_j$. FA2 also does less **non-matmul** arithmetic. Count the element-wise
# operations on the output accumulator per tile: FA1 scales the old $O_i$ by $l_i e^{m_i - m_{new}}$, scales
# $\tilde P V_j$ by $e^{\tilde m - m_{new}}$, adds, and divides by $l_{new}$: 4 operations per element of
# $O_i$. FA2 scales by α and adds: 2, plus one division per element at the very end. Non-matmul FLOPs
# matter because they run on the ordinary floating-point units: an A100 does 312 TFLOP/s of bf16 matmul
# but 19.5 TFLOP/s of other fp32 arithmetic, so each non-matmul FLOP costs as much as ~16 matmul FLOPs.

# %%
n_tiles = len(tiles.tile_schedule(N, N, BLOCK_M, BLOCK_N))
fa1_ops = 4 * BLOCK_M * D * n_tiles
fa2_ops = 2 * BLOCK_M * D * n_tiles + N * D
print(
    f"element-wise operations on O per (batch, head): FA1 {fa1_ops}, FA2 {fa2_ops} "
    f"({fa1_ops / fa2_ops:.1f}x fewer)"
)
assert fa2_ops < fa1_ops

# %% [markdown]
# ### The third change: how one program splits a tile between its threads
#
# A GPU program runs on one SM as a few hundred threads. The hardware runs them in groups of 32 that
# execute the same instruction together, called **warps**: a program typically has 4 or 8 warps (notebook 05
# meets them again in Triton, which hides them). The warps work on the same tile at the same time, and how
# they share the work of $S_{ij} = Q_i K_j^T$, $\tilde O_i \mathrel{+}= \tilde P_{ij} V_j$ matters:
# - **split-K** (FlashAttention-1): every warp takes all $B_r$ rows of $Q_i$ and a slice of the columns of
#   $K_j, V_j$. Each warp ends with a *partial* result for every row: its own max, sum and a $B_r \times d$
#   partial output. The warps must write these to shared memory (the SM's SRAM, which every warp of the
#   program can read), wait for each other (a barrier), and merge them with the rule of notebook 03, on
#   every tile.
# - **split-Q** (FlashAttention-2): every warp takes a slice of the rows of $Q_i$ and all of $K_j, V_j$.
#   A row's softmax lives in one warp, so each warp's rows are finished with no exchange at all; the warps
#   only share the $K_j, V_j$ they read.
#
# Both give the same numbers; they differ in what moves through shared memory. We simulate 4 warps on one
# tile in PyTorch and count the elements the split-K warps must exchange.

# %%
WARPS = 4


def tile_split_k(q_i, k_j, v_j, warps=WARPS):
    """softmax(q_i k_j^T) v_j for one tile, the columns split between warps; returns (O, exchanged elements)."""
    parts = []
    for cols in torch.arange(k_j.shape[0]).chunk(warps):
        s = q_i @ k_j[cols].T
        m_w = s.amax(dim=1, keepdim=True)
        p = torch.exp(s - m_w)
        parts.append((m_w, p.sum(dim=1, keepdim=True), p @ v_j[cols]))  # all rows, partial
    exchanged = sum(m_w.numel() + l_w.numel() + o_w.numel() for m_w, l_w, o_w in parts)  # via shared memory
    m = torch.stack([m_w for m_w, _, _ in parts]).amax(dim=0)
    l = sum(l_w * torch.exp(m_w - m) for m_w, l_w, _ in parts)
    o = sum(o_w * torch.exp(m_w - m) for m_w, _, o_w in parts)
    return o / l, exchanged


def tile_split_q(q_i, k_j, v_j, warps=WARPS):
    """The same tile with the rows of q_i split between warps: each warp's rows are complete."""
    rows = [torch.softmax(q_w @ k_j.T, dim=1) @ v_j for q_w in q_i.chunk(warps)]
    return torch.cat(rows), 0


q_t, k_t, v_t = q_fig[:BLOCK_FIG], k_fig[:BLOCK_FIG], v_fig[:BLOCK_FIG]
expected_tile = torch.softmax(q_t @ k_t.T, dim=1) @ v_t
for split in (tile_split_k, tile_split_q):
    o_t, exchanged = split(q_t, k_t, v_t)
    torch.testing.assert_close(o_t, expected_tile)
    print(f"{split.__name__}: correct; elements exchanged between warps per tile: {exchanged}")

# %% [markdown]
# Split-K exchanges $W (B_r d + 2 B_r)$ elements through shared memory per tile, for W warps, plus a barrier;
# with 4 warps and 128 × 64 tiles at d = 128 that is over 66 000 elements, more than the tile's own
# $K_j$ and $V_j$. Split-Q exchanges none. Shared memory is fast but not free: its reads and writes compete
# with the loads of $K_j, V_j$, and the barrier stalls every warp until the slowest arrives. In the Triton
# kernels of notebook 06 we do not write this split ourselves: a program works on one block of rows, and
# the compiler decides which warp computes which part of each block matrix product. For the block shapes
# used there (64 or 128 rows, 4 or 8 warps) it typically gives each warp its own rows, which is the
# split-Q layout (notebook 05 introduces Triton's matrix product, `tl.dot`).

# %% [markdown]
# ## 7. IO complexity: Θ(N²d²/M)
#
# The formulas, for $N_q = N_k = N$ (elements, one head):
# - standard: $4Nd + 4N^2$, i.e. Θ(N² + Nd);
# - FA1 with the paper's blocks: $K, V$ once, and $(3d + 4)$ per row for each of $T_c = N/B_c$ outer steps:
#   about $N^2 (3d+4) / B_c \approx 12 N^2 d^2 / M$;
# - FA2: $K, V$ re-read once per row block, $2Nd \cdot T_r = 2N^2 d / B_r$.
#
# **The blocks must fit.** $Q_i$ and $O_i$ ($B_r \times d$), $K_j$ and $V_j$ ($B_c \times d$) and the tile
# $S_{ij}$ ($B_r \times B_c$) are on chip at the same time. FlashAttention-1's $B_c = \lceil M/4d \rceil$,
# $B_r = \min(B_c, d)$ bound each of them by a fraction of M and their sum by about 1.25 M (section 2: at
# d = 64, the size here, they fit; at d = 128 they overflow M a little). Square blocks of $M/4d$ would be
# far off: at d = 64 and M = 116 736 elements (228 KiB of bf16) that is 456 × 456, and the tile alone holds
# 207 936 elements, almost twice M. With blocks of size proportional to M, the Θ(N²d²/M) bound is what
# FA1's order reaches, and Dao et al. prove that no exact attention algorithm can do asymptotically better
# for every M between d and Nd.
#
# **Predict before you read on.** FlashAttention-2's own kernels use blocks of $B_r \times B_c$ = 128 × 128
# at d = 64. From the formulas above, how many times fewer HBM bytes than standard attention does FA2 move
# at d = 64 and N = 16384? Type your estimate in place of the value in the next cell (a ratio, e.g. 2.5);
# the cell after it counts the bytes and scores your guess.

# %%
# Your prediction: standard attention's HBM bytes / FA2's (blocks 128 x 128), d = 64, N = 16384.
traffic_guess = predict("standard / FA2 HBM bytes (128 x 128 blocks)", 4.0, unit="x")

# %%
D_IO, M_IO, BYTES = 64, 228 * 1024 // 2, 2
N_IO = [2**p for p in range(10, 17)]
b_r, b_c = tiles.paper_block_sizes(M_IO, D_IO)
b_sq = M_IO // (4 * D_IO)  # square blocks of M/4d: the tile would not fit
assert 2 * b_sq * D_IO + 2 * b_sq * D_IO + b_sq**2 > M_IO
assert (
    2 * b_r * D_IO + 2 * b_c * D_IO + b_r * b_c <= M_IO
)  # FA1's blocks fit at d = 64 (not at 128: section 2)
assert 2 * 128 * D_IO + 2 * 128 * D_IO + 128 * 128 <= M_IO  # and so do FA2's 128 x 128
FA2_IO = "FA2, blocks 128 x 128"
curves = {
    "standard": [tiles.hbm_elements("standard", n, n, D_IO) * BYTES for n in N_IO],
    f"FA1, paper blocks {b_r} x {b_c}": [
        tiles.hbm_elements("fa1", n, n, D_IO, b_r, b_c) * BYTES for n in N_IO
    ],
    FA2_IO: [tiles.hbm_elements("fa2", n, n, D_IO, 128, 128) * BYTES for n in N_IO],
}
M_RANGE = [2**p for p in range(13, 20)]
vs_m = {
    "standard": [tiles.hbm_elements("standard", 16384, 16384, D_IO) * BYTES for _ in M_RANGE],
    "FA1, paper blocks": [
        tiles.hbm_elements("fa1", 16384, 16384, D_IO, *tiles.paper_block_sizes(M, D_IO)) * BYTES
        for M in M_RANGE
    ],
    FA2_IO: [tiles.hbm_elements("fa2", 16384, 16384, D_IO, 128, 128) * BYTES for _ in M_RANGE],
}
ratio_fa1 = curves["standard"][-1] / curves[f"FA1, paper blocks {b_r} x {b_c}"][-1]
ratio_fa2 = curves["standard"][-1] / curves[FA2_IO][-1]

GIB = 2**30
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9.0, 9.5), layout="constrained")  # stacked, within the column
ax1.plot(N_IO, [12 * n**2 * D_IO**2 / M_IO * BYTES / GIB for n in N_IO], "k:", label="12 N²d²/M")
plot_series(
    N_IO,
    {name: [y / GIB for y in ys] for name, ys in curves.items()},
    xlabel="sequence length N",
    ylabel="HBM traffic per head (GiB)",
    title=f"Forward HBM traffic, d = {D_IO}, M = 228 KiB of bf16",
    logx=True,
    logy=True,
    ax=ax1,
)
ax2.axvline(228, color="grey", linestyle="--", label="H100/H200: 228 KiB")
plot_series(
    [M * BYTES / 1024 for M in M_RANGE],
    {name: [y / GIB for y in ys] for name, ys in vs_m.items()},
    xlabel="SRAM size M (KiB of bf16)",
    ylabel="HBM traffic per head (GiB)",
    title="N = 16384: FA1's traffic falls as 1/M, FA2's is set by its blocks",
    logx=True,
    logy=True,
    ax=ax2,
)
for ax in (ax1, ax2):  # the key beside the data, not on it
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=plotting.FONT["legend"])
fig.suptitle(
    f"At N = {N_IO[-1]}, tiling with blocks that fit moves {ratio_fa2:.0f}x (FA2, 128 x 128)\n"
    f"to {ratio_fa1:.0f}x (FA1's paper blocks) fewer bytes than standard attention"
)
plt.show()
at_16k = N_IO.index(16384)  # the length the prediction was asked for
_ = traffic_guess.score(curves["standard"][at_16k] / curves[FA2_IO][at_16k])

# %% [markdown]
# FA2's own kernels choose 128 × 128 blocks at d = 64 (and 128 × 64 at d = 128): registers, not SRAM, bound
# them (notebook 06). Then $2N^2 d / B_r = N^2$ elements at d = 64, against standard attention's $4N^2$:
# **about 4x fewer bytes**, and that ratio does not improve with a larger SRAM (only $B_r$ enters it). FA1's
# paper blocks (64 × 456 here) reach about 9x.
# The forward speed-ups notebook 08 records over standard attention (printed below from `make bench`'s
# record) are larger than this 4x, for two reasons the count leaves out. Standard attention pays for S and P
# in more than bytes: each of its steps is a separate kernel that must finish writing its N × N matrix
# before the next one reads it, so that traffic never overlaps with the matmuls, while the fused kernel
# never writes S and P at all and overlaps its loads with compute. And many of FA2's $K_j, V_j$ re-reads
# are served by the GPU's L2 cache (60 MiB on an H200) rather than HBM, because programs that work on the
# same head tend to run at about the same time: the count charges every re-read to HBM, so it overstates
# FA2's bytes.

# %%
for n, std, fa1, fa2 in zip(
    N_IO,
    curves["standard"],
    curves[f"FA1, paper blocks {b_r} x {b_c}"],
    curves[FA2_IO],
):
    print(f"N = {n:6}: standard / FA1 = {std / fa1:4.1f}, standard / FA2 (128 x 128) = {std / fa2:4.1f}")
    assert n < 4096 or (8 < std / fa1 < 10 and 3.5 < std / fa2 <= 4), n  # about 9x and 4x at d = 64
halved = vs_m["FA1, paper blocks"]
assert all(0.45 < b / a < 0.6 for a, b in zip(halved, halved[1:]))  # doubling M about halves FA1's traffic

att_rec = course_lib.records.load_record("attention")
if att_rec is not None:  # the words above: the measured forward speed-ups exceed the 4x of the byte count
    from course_lib.bench import ratios  # course_lib's TFLOP/s over a provider's, per cell of the record

    for std in ("eager", "compiled"):
        gains = [r for r in ratios(att_rec["data"], "fwd", std) if r is not None]  # None: not measured
        print(f"course_lib's forward over standard attention ({std}): {min(gains):.1f}-{max(gains):.1f}x "
              f"({course_lib.records.label(att_rec)})")  # fmt: skip
        assert min(gains) > 4, std

# %% [markdown]
# ## More exercises
#
# Each exercise has a cell to fill in and a check cell after it. Later cells never use your answers.
#
# **Exercise 5 (block sizes).** Write `paper_blocks(M, d)`, the block sizes $(B_r, B_c)$ of
# FlashAttention-1's Algorithm 1 for an SRAM of M elements.


# %%
def paper_blocks(M, d):
    ### BEGIN SOLUTION
    b_c = math.ceil(M / (4 * d))
    return min(b_c, d), b_c
    ### END SOLUTION


# %% tags=["check"]
check(
    "paper block sizes",
    lambda: [paper_blocks(M, d) for M, d in ((116736, 64), (83968, 128), (1000, 64))],
    [tiles.paper_block_sizes(M, d) for M, d in ((116736, 64), (83968, 128), (1000, 64))],
)

# %% [markdown]
# **Exercise 6 (causal tiles).** For a causal square problem of N rows and tiles of B × B (B divides N),
# how many tiles does the forward compute, and what fraction of all tiles is that? Return
# `(computed, fraction)`.


# %%
def causal_tiles(N, B):
    ### BEGIN SOLUTION
    T = N // B
    computed = T * (T + 1) // 2
    return computed, computed / T**2
    ### END SOLUTION


# %% tags=["check"]
_c = tiles.block_counts(8192, 8192, 128, 128, causal=True)
_computed = _c["full"] + _c["diagonal"]
check("causal tiles", lambda: causal_tiles(8192, 128), (_computed, _computed / sum(_c.values())))

# %% [markdown]
# **Exercise 7 (merging two partial outputs: split-KV).** Split the keys and values into two parts A and B.
# Attention over each part gives a normalised output and a logsumexp: $(O_A, L_A)$ and $(O_B, L_B)$.
# Write `combine(O_a, L_a, O_b, L_b)` that returns $(O, L)$ of attention over all the keys, for batched
# torch tensors (notebook 03 wrote the same merge for one row in NumPy). This is how split-KV decoding
# merges the work of several programs.


# %%
def combine(O_a, L_a, O_b, L_b):
    ### BEGIN SOLUTION
    L = torch.logaddexp(L_a, L_b)
    return torch.exp(L_a - L)[..., None] * O_a + torch.exp(L_b - L)[..., None] * O_b, L
    ### END SOLUTION


# %% tags=["check"]
_q, _k, _v = random_qkv((2, 10, 8), 30, dtype=torch.float64)
_Oa, _La = attention(_q, _k[:, :12], _v[:, :12], return_lse=True)
_Ob, _Lb = attention(_q, _k[:, 12:], _v[:, 12:], return_lse=True)
check("split-KV combine", lambda: combine(_Oa, _La, _Ob, _Lb), attention(_q, _k, _v, return_lse=True))

# %% [markdown]
# **Exercise 8 (FA1 traffic).** For a non-causal square problem (N rows, head dim d, blocks $B_r \times B_c$
# that divide N), write the number of elements FlashAttention-1's forward moves to and from HBM, from the
# loops of `forward_fa1` (count its `io.load` and `io.store` calls; do not call `tiles`).


# %%
def fa1_elements(N, d, B_r, B_c):
    ### BEGIN SOLUTION
    T_c = N // B_c
    init = N * d + 2 * N  # O, l, m initialised in HBM
    per_outer_step = N * (3 * d + 4)  # every row: Q_i, O_i, l_i, m_i read; O_i, l_i, m_i written
    return init + 2 * N * d + T_c * per_outer_step  # K_j, V_j read once
    ### END SOLUTION


# %% tags=["check"]
check(
    "FA1 HBM elements",
    lambda: [fa1_elements(n, 64, 64, 128) for n in (1024, 8192)],
    [tiles.hbm_elements("fa1", n, n, 64, 64, 128) for n in (1024, 8192)],
)

# %% [markdown]
# ## Summary
#
# - Tiling cuts Q into row blocks and K, V into column blocks; one tile $S_{ij}$ at a time lives on chip.
#   The paper sizes blocks from SRAM ($B_c = \lceil M/4d \rceil$, $B_r = \min(B_c, d)$): each piece a
#   fraction of M, their sum a small constant times M (it overflows M at d = 128); real kernels tune
#   powers of two such as 64 and 128, limited by registers.
# - Inside attention, the online softmax keeps m, l and an unnormalised $\tilde O$ per row, rescales both l
#   and $\tilde O$ by $e^{m_{old} - m_{new}}$, divides once at the end, and saves $L = m + \log l$. Scores a
#   row must not see are −inf; a row that sees no key at all ends with O = 0 and L = −inf.
# - Causal masking skips the tiles above the diagonal, masks only the diagonal ones: about half the work.
#   Bottom-right alignment shifts the diagonal by $N_k - N_q$.
# - FlashAttention-2 changed three things: fewer non-matmul FLOPs (O unnormalised until the end, only L
#   stored: about half the element-wise work on O); parallelism over the sequence (the Q loop outside, so
#   $O_i$ is written once and row blocks are independent programs); and split-Q work partitioning between
#   a program's warps (no partial outputs exchanged through shared memory, unlike split-K).
# - HBM traffic drops from Θ(N² + Nd) to Θ(N²d²/M) for FA1's SRAM-sized paper blocks (about 9x at d = 64);
#   FA2 with fixed 128 × 128 blocks moves $2N^2 d / B_r$ (about 4x at d = 64), a ratio a larger SRAM does not
#   improve. The rest of the measured win comes from never writing S and P (and their kernels) and from K/V
#   re-reads that hit in L2.
# - Notebook 04b builds the backward pass the same way; `course_lib.FlashAttentionTorch` is the finished,
#   differentiable piece, and notebook 06 writes this forward as one Triton kernel.
