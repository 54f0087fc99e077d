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
# # 04b · Tiled attention in PyTorch: the backward pass
#
# Notebook 04 built FlashAttention's forward pass in PyTorch: O computed tile by tile, with nothing of size
# N × N kept, and one number per query row saved for later, the logsumexp L = m + log l. Here we build the
# backward pass the same way. It must produce dQ, dK and dV without P, which the forward never stored: it
# rebuilds P tile by tile from Q, K and L. Notebook 07 runs the same loops as Triton kernels.
#
# **Learning goals**
# 1. Derive the backward of attention: dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − D) with
#    D = rowsum(dO ∘ O), dQ = dS K · scale, dK = dSᵀ Q · scale; check it against autograd.
# 2. Compute it tile by tile, recomputing P = exp(S − L) exactly: write one tile's gradients yourself, and
#    fix a backward that rebuilds P from the running max m instead of L.
# 3. Follow FlashAttention-2's backward loop order (K/V blocks outside, dK and dV on chip, dQ accumulated
#    from every K/V block), watch it step by step, and skip the tiles a causal mask hides.
# 4. Write the **whole tiled backward** yourself (D, P from L, dV, dP, dS, dQ, dK, both causal alignments),
#    checked against float64 autograd on ragged sizes.
# 5. Use `course_lib.FlashAttentionTorch`, a drop-in `torch.autograd.Function`, and see what it saves.

# %% [markdown]
# ## 0. Sizes
#
# As in notebook 04: the main problem runs on `course_lib.DEVICE` (the small float64 checks and figures on
# the CPU), every tile costs a few small PyTorch calls, so the CPU sizes stay small. `N_FIG` and
# `BLOCK_FIG` are the small problem we draw step by step.

# %%
import math

import matplotlib.pyplot as plt
import numpy as np
import torch

import course_lib
from course_lib.attention import animate, tiles
from course_lib.attention.reference import attention, causal_mask_tile
from course_lib.attention.tiled import FlashAttentionTorch, flash_backward, flash_forward
from course_lib.exercises import check, check_cases, predict
from course_lib.perf import plotting
from course_lib.testing import assert_close_to_reference, random_qkv, reference_outputs

DEVICE = course_lib.DEVICE
BATCH, HEADS, N, D = course_lib.pick(cpu=(1, 2, 256, 64), gpu=(2, 4, 1024, 64))
BLOCK_M, BLOCK_N = 64, 64  # the paper's B_r (rows of Q per tile) and B_c (rows of K and V per tile)
N_FIG, D_FIG, BLOCK_FIG = 128, 16, 32
plotting.use_readable_defaults()  # projector-sized fonts for every figure, plt's own included
torch.manual_seed(0)
q, k, v = random_qkv((BATCH, HEADS, N, D), dtype=torch.float32, device=DEVICE)
print(f"device {DEVICE}; batch {BATCH}, heads {HEADS}, N {N}, d {D}; tiles {BLOCK_M} x {BLOCK_N}")

# %% [markdown]
# ## 1. The backward pass, by recomputation
#
# Given the gradient dO of the loss with respect to O, we need dQ, dK, dV. Go backwards through
# O = P V, P = softmax(S) row by row, S = scale · Q Kᵀ:
#
# - $O = PV$ gives $dV = P^T dO$ and $dP = dO\, V^T$.
# - Softmax, row r: $P_{rc} = e^{S_{rc}} / \sum_{c'} e^{S_{rc'}}$, so
#   $\partial P_{rc'} / \partial S_{rc} = P_{rc'} (\delta_{cc'} - P_{rc})$ and
#   $dS_{rc} = \sum_{c'} dP_{rc'} P_{rc'} (\delta_{cc'} - P_{rc}) = P_{rc}\,(dP_{rc} - D_r)$ with
#   $D_r = \sum_{c'} P_{rc'} dP_{rc'}$.
# - $D_r$ does not need P:
#   $D_r = \sum_{c'} P_{rc'} (dO_r \cdot V_{c'}) = dO_r \cdot \sum_{c'} P_{rc'} V_{c'} = dO_r \cdot O_r$.
#   So $D = \mathrm{rowsum}(dO \circ O)$: one cheap pass over two N × d matrices.
# - $S = \text{scale} \cdot Q K^T$ gives $dQ = \text{scale} \cdot dS\, K$ and
#   $dK = \text{scale} \cdot dS^T Q$.
#
# In summary: $dV = P^T dO$, $dP = dO\,V^T$, $dS = P \circ (dP - D)$, $dQ = dS\,K \cdot$ scale,
# $dK = dS^T Q \cdot$ scale. First we check these formulas with full matrices in float64 against autograd:

# %%
q64, k64, v64 = random_qkv((2, 48, 16), 40, dtype=torch.float64)
dO64 = torch.randn(2, 48, 16, dtype=torch.float64)
_, (dq_auto, dk_auto, dv_auto) = reference_outputs(q64, k64, v64, causal=False, grad_out=dO64)
scale = 16**-0.5
P64 = torch.softmax(q64 @ k64.mT * scale, dim=-1)
O64 = P64 @ v64
dV = P64.mT @ dO64
dP = dO64 @ v64.mT
D64 = (dO64 * O64).sum(-1)
torch.testing.assert_close(D64, (P64 * dP).sum(-1))  # D = rowsum(dO * O) = rowsum(P * dP)
dS = P64 * (dP - D64[..., None])
for name, ours, auto in (
    ("dQ", dS @ k64 * scale, dq_auto),
    ("dK", dS.mT @ q64 * scale, dk_auto),
    ("dV", dV, dv_auto),
):
    torch.testing.assert_close(ours, auto, msg=name)
print("dQ, dK, dV from the formulas match autograd (float64)")

# %% [markdown]
# The backward must not store P either. It does not need to: with L saved by the forward,
# $P_{rc} = e^{S_{rc} - L_r}$ can be rebuilt exactly, tile by tile, from $Q_i$, $K_j$ and $L_i$: a second
# matmul per tile is cheaper than reading an N × N matrix from HBM. FlashAttention-2's backward loops
# over K/V blocks outside (so $dK_j$ and $dV_j$ accumulate on chip and are written once) and over Q blocks
# inside; $dQ_i$ receives a contribution from every K/V block, so it is accumulated in HBM (a GPU kernel
# uses atomic adds, or a second pass; notebook 07).


# %% [markdown]
# **Exercise 1 (one tile's gradients).** Write `tile_grads`: for one tile (query rows $Q_i$ with their
# $dO_i$, $L_i$ and $D_i$; keys and values $K_j$, $V_j$), rebuild $P = e^{S - L}$ and return this tile's
# contributions to $dQ_i$, $dK_j$ and $dV_j$ (the formulas above, on the tile). The check hands it a
# whole problem as one tile, so your three results must be the full gradients of autograd.


# %%
def tile_grads(Qi, Kj, Vj, dOi, Li, Di, scale):
    """Qi, dOi: (..., B_r, d); Kj, Vj: (..., B_c, d); Li, Di: (..., B_r). Returns this tile's pieces of
    dQ_i (..., B_r, d), dK_j and dV_j (..., B_c, d)."""
    ### BEGIN SOLUTION
    P = torch.exp(Qi @ Kj.mT * scale - Li[..., None])  # recomputed, exact
    dP = dOi @ Vj.mT
    dS = P * (dP - Di[..., None])
    return dS @ Kj * scale, dS.mT @ Qi * scale, P.mT @ dOi
    ### END SOLUTION


# %% tags=["check"]
L64 = torch.logsumexp(q64 @ k64.mT * scale, dim=-1)
check(
    "tile_grads (one tile)",
    lambda: tile_grads(q64, k64, v64, dO64, L64, D64, scale),
    (dq_auto, dk_auto, dv_auto),
    parts=["dQ", "dK", "dV"],
)

# %% [markdown]
# course_lib's finished piece, `course_lib.attention.tiled.flash_backward`, runs these tiles in
# FlashAttention-2's loop order (you write that loop in exercise 4). It matches the float64 reference at
# this notebook's size, causal or not:

# %%
for causal in (False, True):
    O_, L_ = flash_forward(q, k, v, causal, block_m=BLOCK_M, block_n=BLOCK_N)
    dO = torch.randn_like(O_)
    _, grads_ref = reference_outputs(q.double(), k.double(), v.double(), causal, grad_out=dO.double())
    lib = flash_backward(dO, q, k, v, O_, L_, causal, block_m=BLOCK_M, block_n=BLOCK_N)
    for name, b, r in zip(("dQ", "dK", "dV"), lib, grads_ref):
        torch.testing.assert_close(b.double(), r, atol=1e-4, rtol=1e-4, msg=f"{name}, causal={causal}")
print("course_lib.attention.tiled.flash_backward matches the float64 reference, causal or not")

# %% [markdown]
# ### The K/V-outer loop, step by step
#
# A small causal problem (N = 128, d = 16, tiles of 32 × 32), recorded by `course_lib.attention.animate`:
# the tile map fills column by column (one K/V block at a time), tiles above the diagonal are skipped. A
# K/V block's dK and dV are final when its column is done; a query row's dQ receives a piece from every
# column that reaches it, and is final only at the last of them. In JupyterLab the slider under the strip
# shows every step, with dK too (its steps count from 1, as the titles do).

# %%
q_fig, k_fig, v_fig = random_qkv((N_FIG, D_FIG), dtype=torch.float64)
bwd_frames = animate.backward_frames(
    q_fig, k_fig, v_fig, torch.randn(N_FIG, D_FIG, dtype=torch.float64), BLOCK_FIG, BLOCK_FIG, causal=True
)
animate.backward_strip(bwd_frames)
plt.show()
animate.backward_widget(bwd_frames)

# %% [markdown]
# **Exercise 2 (the backward's causal loop start).** In this loop order the program of K/V block `j0 ...
# j0 + B_c - 1` walks down the query blocks. Query blocks that end before key `j0` see none of its keys.
# Write `first_query_block(j0, block_m)`: the first query row `i0` (a multiple of B_r) the loop must visit.
# The check compares the tiles your start visits with `tiles.block_map`.


# %%
def first_query_block(j0, block_m):
    ### BEGIN SOLUTION
    return j0 // block_m * block_m
    ### END SOLUTION


# %% tags=["check"]
def _visited_map(start_fn, n_q, n_k, block_m, block_n):
    seen = np.zeros((math.ceil(n_q / block_m), math.ceil(n_k / block_n)), dtype=bool)
    for j, j0 in enumerate(range(0, n_k, block_n)):
        for i0 in range(start_fn(j0, block_m), n_q, block_m):
            seen[i0 // block_m, j] = True
    return seen


_cases = [(256, 256, 64, 64), (100, 75, 32, 16), (90, 130, 16, 32)]
check(
    "first_query_block",
    lambda: [_visited_map(first_query_block, *c) for c in _cases],
    [tiles.block_map(*c, causal=True) != tiles.SKIPPED for c in _cases],
)

# %% [markdown]
# **Exercise 3 (find the bug: m instead of L).** A first attempt saved the running max m of every row in the
# forward, not L, and rebuilt P as exp(S − m). Those P are the forward's *unnormalised* probabilities: each
# row sums to l, not to 1. The cell below shows how far off the gradients are. Fix it in `L_for_backward`:
# from the forward's final m and l of every row, return what the backward must subtract (one number per row).


# %%
def forward_m_l(q, k):
    """The final running max m and running sum l of every row, as the forward's loop ends."""
    S = q @ k.mT * q.shape[-1] ** -0.5
    m = S.amax(dim=-1)
    return m, torch.exp(S - m[..., None]).sum(dim=-1)


_q, _k, _v = random_qkv((2, 40, 16), 50, dtype=torch.float64)
_dO = torch.randn(2, 40, 16, dtype=torch.float64)
m_, l_ = forward_m_l(_q, _k)
_O_full = attention(_q, _k, _v)
dq_wrong = flash_backward(_dO, _q, _k, _v, _O_full, m_, block_m=16, block_n=16)[0]
dq_true = reference_outputs(_q, _k, _v, False, grad_out=_dO)[1][0]
print(f"dQ with P = exp(S - m): max error {(dq_wrong - dq_true).abs().max():.2f}")
print(f"the forward's l, by which each row of exp(S - m) is too large: {l_.min():.1f} to {l_.max():.1f}")


# %%
def L_for_backward(m, l):
    ### BEGIN SOLUTION
    return m + torch.log(l)
    ### END SOLUTION


# %% tags=["check"]
check(
    "L_for_backward",
    lambda: flash_backward(_dO, _q, _k, _v, _O_full, L_for_backward(m_, l_), block_m=16, block_n=16),
    reference_outputs(_q, _k, _v, False, grad_out=_dO)[1],
    parts=["dQ", "dK", "dV"],
)

# %% [markdown]
# **Exercise 4 (the whole backward, FlashAttention-2 order).** Write the body of `backward_fa2`: D once
# from dO and O; then the K/V blocks outside, with $dK_j$ and $dV_j$ accumulated on chip over the query
# blocks inside and written once; per tile P rebuilt from L, and its pieces of dV, dP, dS, dQ and dK; dQ
# accumulated in place in HBM. Mask what the forward masked: `causal` is `False`, `"top_left"` (or `True`)
# or `"bottom_right"` (query i sees keys j ≤ i + N_k − N_q, as in notebook 04's exercise 4), and start
# each K/V block's loop at the first query block that sees any of its keys (exercise 2, with the offset).
# With bottom-right alignment and N_q > N_k, some rows see no key: their L is −inf, and their gradients
# must come out 0, not NaN. The check compares dQ, dK and dV with float64 autograd through the reference,
# on ragged sizes, N_q ≠ N_k and both alignments (O and L come from the float64 reference, in float32).


# %%
def backward_fa2(dO, q, k, v, O, L, causal=False, block_m=BLOCK_M, block_n=BLOCK_N):
    """Tiled attention backward, FA-2 order. dO, q, O: (..., N_q, d); k, v: (..., N_k, d); L: (..., N_q)
    from the forward; causal: False, "top_left" (or True) or "bottom_right". Returns dQ, dK, dV."""
    scale = q.shape[-1] ** -0.5
    n_q, n_k = q.shape[-2], k.shape[-2]
    dQ = torch.zeros_like(q)  # HBM: every K/V block adds its piece
    dK, dV = torch.empty_like(k), torch.empty_like(v)  # HBM: each K/V block writes its rows once
    ### BEGIN SOLUTION
    offset = n_k - n_q if causal == "bottom_right" else 0  # query i sees keys j <= i + offset
    D = (dO * O).sum(dim=-1)
    L_safe = torch.where(torch.isinf(L), 0.0, L)  # a row that sees no key: P = exp(-inf - 0) = 0
    for j0 in range(0, n_k, block_n):
        j1 = min(j0 + block_n, n_k)
        Kj, Vj = k[..., j0:j1, :], v[..., j0:j1, :]
        dKj, dVj = torch.zeros_like(Kj), torch.zeros_like(Vj)  # on chip for the whole inner loop
        first = max(0, j0 - offset) // block_m * block_m if causal else 0  # first query block that sees j0
        for i0 in range(first, n_q, block_m):
            i1 = min(i0 + block_m, n_q)
            S = q[..., i0:i1, :] @ Kj.mT * scale
            if causal and j1 - 1 > i0 + offset:  # the tile crosses the diagonal
                S = S.masked_fill(~causal_mask_tile(i0, i1, j0, j1, q.device, offset), -math.inf)
            P = torch.exp(S - L_safe[..., i0:i1, None])  # recomputed, exact
            dVj += P.mT @ dO[..., i0:i1, :]
            dP = dO[..., i0:i1, :] @ Vj.mT
            dS = P * (dP - D[..., i0:i1, None])
            dQ[..., i0:i1, :] += dS @ Kj * scale
            dKj += dS.mT @ q[..., i0:i1, :] * scale
        dK[..., j0:j1, :], dV[..., j0:j1, :] = dKj, dVj
    ### END SOLUTION
    return dQ, dK, dV


# %% tags=["check"]
def _case_inputs(n_q, n_k, causal):
    """float32 dO, q, k, v and the float64 reference's O and L (in float32), the same for every call."""
    g = torch.Generator().manual_seed(1000 * n_q + n_k)
    q_, k_, v_ = random_qkv((2, n_q, 16), n_k, generator=g)
    dO_ = torch.randn(2, n_q, 16, generator=g)
    O_, L_ = attention(q_.double(), k_.double(), v_.double(), causal=causal, return_lse=True)
    return dO_, q_, k_, v_, O_.float(), L_.float()


def _reference_grads(n_q, n_k, causal, **_):
    dO_, q_, k_, v_, _, _ = _case_inputs(n_q, n_k, causal)
    return reference_outputs(q_.double(), k_.double(), v_.double(), causal, grad_out=dO_.double())[1]


_backward_cases = [
    dict(n_q=64, n_k=64, causal=False, block_m=16, block_n=16),
    dict(n_q=50, n_k=50, causal=False, block_m=16, block_n=16),  # ragged: the last blocks hold 2 rows
    dict(n_q=40, n_k=75, causal=False, block_m=16, block_n=32),  # N_q != N_k, unequal blocks
    dict(n_q=50, n_k=50, causal="top_left", block_m=16, block_n=16),
    dict(n_q=40, n_k=75, causal="top_left", block_m=16, block_n=32),  # keys 40..74: seen by no query
    dict(n_q=75, n_k=40, causal="top_left", block_m=32, block_n=16),
    dict(n_q=40, n_k=75, causal="bottom_right", block_m=16, block_n=32),
    dict(n_q=75, n_k=40, causal="bottom_right", block_m=32, block_n=16),  # rows 0..34 see no key
]
check_cases(
    "backward_fa2 (the whole backward)",
    _backward_cases,
    lambda n_q, n_k, causal, block_m, block_n: backward_fa2(
        *_case_inputs(n_q, n_k, causal), causal, block_m, block_n
    ),
    _reference_grads,
    rtol=1e-4,
    atol=1e-5,
    outputs=("dQ", "dK", "dV"),
)

# %% [markdown]
# ## 2. `course_lib.FlashAttentionTorch`
#
# The finished piece wraps `flash_forward` and `flash_backward` in a `torch.autograd.Function`, with the
# interface homework usually asks for: `FlashAttentionTorch.apply(q, k, v, is_causal)`, inputs
# (batch, N, d) or (batch, heads, N, d) (any leading dims), scale 1/√d. The forward saves Q, K, V, O and L;
# the backward recomputes P. We hold it to the course's accuracy rule (`course_lib.testing`): its error
# against the float64 reference may be at most twice that of plain PyTorch in the same dtype, plus a small
# floor.

# %%
for shape_q, n_k, causal in (((BATCH, N, D), N, True), ((BATCH, HEADS, N, D), N // 2 + 3, False)):
    q1, k1, v1 = random_qkv(shape_q, n_k, dtype=torch.float32, device=DEVICE, requires_grad=True)
    out = FlashAttentionTorch.apply(q1, k1, v1, causal)
    dO = torch.randn_like(out)
    out.backward(dO)
    ref64, grads64 = reference_outputs(q1.double(), k1.double(), v1.double(), causal, grad_out=dO.double())
    base, grads32 = reference_outputs(q1, k1, v1, causal, grad_out=dO)
    what = f"q {tuple(shape_q)}, Nk {n_k}, causal={causal}, {DEVICE.type}"
    assert_close_to_reference(out, ref64, base, f"O, {what}")
    for name, g, r, b in zip(("dq", "dk", "dv"), (q1.grad, k1.grad, v1.grad), grads64, grads32):
        assert_close_to_reference(g, r, b, f"{name}, {what}")
    print(f"{what}: O, dq, dk, dv within the accuracy rule")

# %% [markdown]
# `torch.autograd.gradcheck` compares the backward with finite differences of the forward, in float64:

# %%
qg, kg, vg = random_qkv((2, 9, 4), 7, dtype=torch.float64, requires_grad=True)
for causal in (False, True):
    fn = lambda a, b, c, causal=causal: FlashAttentionTorch.apply(a, b, c, causal, None, 4, 3)
    assert torch.autograd.gradcheck(fn, (qg, kg, vg))
print("gradcheck passes (float64, blocks 4 x 3, odd lengths, causal and not)")

# %% [markdown]
# And the point of it all: nothing of size $N_q \times N_k$ is kept for the backward. PyTorch's
# `saved_tensors_hooks` shows every tensor autograd saves:

# %%
saved = []
with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
    q1, k1, v1 = random_qkv((BATCH, HEADS, N, D), N + 32, device=DEVICE, requires_grad=True)
    out = FlashAttentionTorch.apply(q1, k1, v1, True)
print("saved for backward:", saved)
assert (BATCH, HEADS, N) in saved  # L, one number per query row
assert all(s[-2:] != (N, N + 32) for s in saved) and max(math.prod(s) for s in saved) <= k1.numel()

# %% [markdown]
# What does the tiling do to the time, written in Python? Each tile costs several small PyTorch calls (on a
# GPU, each one a separate kernel launch), and the causal call timed here visits about half of the (N/64)²
# tiles, while standard attention makes a few calls on whole $N \times N$ matrices (matmul, mask,
# logsumexp, exp, matmul). Predict first: how many times the time of standard attention does the tiled
# version take here, at N = 256 on a CPU (N = 1024 on a GPU)? Count the calls each makes and guess what one
# call costs at these sizes; type your estimate in place of the value in the next cell.

# %%
# Your prediction: time of FlashAttentionTorch / time of standard attention, this notebook's size, this device.
tiled_guess = predict("tiled PyTorch / standard attention time", 5.0, unit="x")

# %% [markdown]
# Here is the measurement at this notebook's size, on this machine:

# %%
from course_lib.perf.timing import benchmark

q1, k1, v1 = random_qkv((BATCH, HEADS, N, D), device=DEVICE)
t_std = benchmark(lambda: attention(q1, k1, v1, causal=True))
t_tiled = benchmark(lambda: FlashAttentionTorch.apply(q1, k1, v1, True))
ratio = t_tiled / t_std
if ratio > 1.1:
    verdict = f"slower than standard attention ({ratio:.2f}x the time)"
elif ratio < 1 / 1.1:
    verdict = f"faster than standard attention ({ratio:.2f}x the time)"
else:
    verdict = f"about as fast as standard attention ({ratio:.2f}x the time, within 10%)"
print(f"{DEVICE.type}, N = {N}: standard {t_std:.2f} ms, tiled in PyTorch {t_tiled:.2f} ms")
print(f"here the tiled version is {verdict}")
_ = tiled_guess.score(ratio)

# %% [markdown]
# The algorithm is right and needs only O(N) memory beyond its inputs and output. What tiling buys in
# PyTorch is that memory, not speed: the ratio above depends on the device, the size and the number of
# threads, and nothing in the Python loops makes them faster by design. Each call of a tile still
# materialises its result as a new tensor for the next call to read (on a GPU, each call is a separate
# kernel launch), so a tile never stays on chip for its whole computation. Speed has to come from moving both
# loops into one GPU kernel, where a tile really stays in SRAM and registers. Notebooks 05 to 07 do that in
# Triton.

# %% [markdown]
# ## Summary
#
# - The backward of attention: $dV = P^T dO$, $dP = dO V^T$, $dS = P \circ (dP - D)$ with
#   $D = \mathrm{rowsum}(dO \circ O)$ (no P needed), $dQ = dS K$·scale, $dK = dS^T Q$·scale.
# - P is never stored: it is rebuilt tile by tile as $e^{S - L}$ from Q, K and the logsumexp L, one number
#   per row. The running max m alone is not enough: $e^{S - m}$ is P times l.
# - FlashAttention-2's backward puts the K/V loop outside: $dK_j$, $dV_j$ stay on chip and are written once;
#   $dQ_i$ collects a piece from every K/V block (atomics or a second kernel on a GPU, notebook 07).
# - Causal: each K/V block's loop starts at the query block holding the first query that sees its first key;
#   the tiles above the diagonal are skipped, as in the forward. Rows that see no key (L = −inf) get zero
#   gradients.
# - `course_lib.FlashAttentionTorch.apply(q, k, v, is_causal)` is the finished, tested piece: it saves Q, K, V,
#   O and L, nothing of size $N_q \times N_k$. It is exact; written in Python it saves memory, not time, and
#   notebooks 05 to 07 write the same loops as Triton kernels.
