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
# # 06 · The FlashAttention-2 forward pass in Triton
#
# Notebook 04 ran FlashAttention-2's loops in PyTorch: correct, but every tile went to HBM and back
# between two PyTorch calls. Here the same loops become **one Triton kernel**: a program loads its block
# of queries once, keeps the running max, the running sum and the output accumulator in registers, and
# streams the keys and values past them. Nothing of size Nq x Nk ever reaches HBM.
#
# **Learning goals**
# 1. Map FlashAttention-2 onto Triton programs: one program per (query block, batch·head); the K/V loop
#    inside it; what lives in registers and what crosses HBM.
# 2. Build the kernel in checked steps, then **write its body yourself**: softmax · V with every key in one
#    block (a bridge from notebook 05's fused softmax); the online rescale of m, l and the accumulator over
#    K/V blocks; base-2 exponentials with the softmax scale folded in; the loop bounds of causal attention,
#    which skip the blocks above the diagonal and mask only the diagonal ones; and finally the whole
#    forward kernel: -inf masks for any lengths (Nq != Nk too), the causal diagonal, the epilogue that
#    writes O and L.
# 3. Check it against the float64 reference over ragged, unequal and causal cases.
# 4. On a GPU: time your kernel beside course_lib's and PyTorch's `scaled_dot_product_attention`, and see
#    how block sizes and warps change the speed.
#
# The finished kernel is `_fwd_kernel` in `course_lib/attention/forward.py`, which `course_lib.flash_attention`
# (`course_lib/attention/api.py`) calls. After each exercise the notebook goes on with course_lib's
# finished piece, so an exercise you have not solved yet never blocks the cells after it.

# %% [markdown]
# ## 0. Setup and sizes
#
# `import course_lib` first: it decides whether kernels are compiled (GPU) or interpreted (CPU) before any
# kernel below is defined. On the CPU the interpreter runs every program's every loop iteration in Python
# (milliseconds each, where the GPU takes nanoseconds), so the CPU sizes are small and the blocks 32 x 32.

# %%
import math

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.colors import ListedColormap

import course_lib
from course_lib import records
from course_lib.attention import forward as lib_forward
from course_lib.attention.blocks import kv_block_range_py
from course_lib.attention.reference import attention, causal_mask
from course_lib.exercises import (
    check,
    check_cases,
    check_masked_memory_ops,
    guarded_empty,
    predict,
    time_kernels,
)
from course_lib.perf.plotting import bar_chart, plot_series
from course_lib.perf.timing import attention_flops, benchmark
from course_lib.runtime import tl, triton
from course_lib.testing import random_qkv, run_cases

DEVICE = course_lib.DEVICE
print(course_lib.RUNTIME.describe())

# %%
B, H, D = course_lib.pick(cpu=(1, 2, 32), gpu=(2, 4, 64))  # batch, heads, head dim
N_EVEN = course_lib.pick(cpu=128, gpu=1024)  # step 1: a length that is a multiple of the blocks
N_Q, N_K = course_lib.pick(cpu=(100, 75), gpu=(1000, 1531))  # later steps: ragged and unequal lengths
BLOCK_M, BLOCK_N = course_lib.pick(cpu=(32, 32), gpu=(64, 64))  # the teaching launches
TIME_SHAPE = course_lib.pick(cpu=(1, 1, 64, 32), gpu=(4, 16, 4096, 64))  # timing your kernel (GPU only)
BENCH_NS = course_lib.pick(cpu=[], gpu=[1024, 4096, 16384])  # GPU benchmark: sequence lengths
BENCH_D, BENCH_TOKENS = 64, 16384  # GPU benchmark: head dim, B*N tokens (H*d = 2048, as in the papers)
_ = torch.manual_seed(0)

# %% [markdown]
# ## 1. The algorithm, and who does what
#
# For one (batch, head), FlashAttention-2 computes $O = \mathrm{softmax}(QK^\top \cdot \text{scale})\,V$ like
# this (notebook 04):
#
# ```
# for each query block Q_i (BLOCK_M rows):             <- one Triton program each, in parallel
#     m = -inf, l = 0, acc = 0                          <- registers, float32
#     for each key/value block K_j, V_j (BLOCK_N rows): <- a loop inside the program
#         S = Q_i K_j^T * scale                         (BLOCK_M x BLOCK_N, registers)
#         m_new = max(m, rowmax(S))
#         P = exp(S - m_new);  alpha = exp(m - m_new)
#         l = alpha * l + rowsum(P)
#         acc = alpha * acc + P V_j
#         m = m_new
#     O_i = acc / l;  L_i = m + log(l)                  -> HBM
# ```
#
# The grid is two-dimensional: `program_id(0)` picks the query block, `program_id(1)` the (batch, head)
# pair — we flatten (B, H, N, d) tensors to (Z = B·H, N, d). A program reads its Q block once, reads every
# K and V block once, and writes its O block and its BLOCK_M values of L. **L** (the logsumexp of each row) is
# all the backward pass (notebook 07) needs to rebuild P without storing it.
#
# **Bytes.** Per (batch, head): Q and O cross HBM once (2·N·d elements); K and V are read once per query block
# (2·N·d·N/BLOCK_M), which is why larger BLOCK_M helps, and why those reads mostly come from the L2 cache.
# The N x N matrices S and P never leave the chip.

# %% [markdown]
# ## 1b. A bridge from notebook 05: softmax · V in one program
#
# Notebook 05 ended with a fused row softmax: one program per row, the whole row in one block, max, exp,
# sum and divide in registers. Attention is that softmax with a matrix product on each side. If all the keys
# fit in **one** block (Nk <= BLOCK_N), a program can compute its tile of scores, apply 05's softmax to each
# row and multiply by V, and nothing else is needed:
#
# ```
# S = Q_i K^T * scale            (BLOCK_M x BLOCK_N, every key at once)
# P = softmax(S) row by row      (notebook 05's kernel, on a tile)
# O_i = P V
# ```
#
# Padding keys (columns past Nk in the block) are loaded as 0 and their scores set to **-inf**, so that
# exp gives them weight exactly 0. The padding query rows are computed and never stored.
#
# **Exercise 1 (bridge: the softmax of a tile).** Fill in the three lines that turn the scores `s` into
# probabilities `p` (safe softmax: subtract each row's max first). The rest of the kernel is given.


# %%
@triton.jit
def softmax_v_kernel(
    Q, K, V, O, scale, N_Q, N_K, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    start_m = tl.program_id(0)
    z = tl.program_id(1).to(tl.int64)
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # this program's query rows
    cols = tl.arange(0, BLOCK_N)  # every key: this kernel needs N_K <= BLOCK_N
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = z * N_Q * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :]
    kv_ptrs = z * N_K * HEAD_DIM + cols[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q + q_ptrs, mask=rows[:, None] < N_Q, other=0.0)  # (BLOCK_M, d), HBM -> registers
    k = tl.load(K + kv_ptrs, mask=cols[:, None] < N_K, other=0.0)  # (BLOCK_N, d)
    v = tl.load(V + kv_ptrs, mask=cols[:, None] < N_K, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (BLOCK_M, BLOCK_N) scores, registers
    s = tl.where(cols[None, :] < N_K, s, float("-inf"))  # padding keys: weight exactly 0 after exp
    ### BEGIN SOLUTION
    s_max = tl.max(s, axis=1)
    p = tl.exp(s - s_max[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    ### END SOLUTION
    o = tl.dot(p, v, input_precision="ieee")  # (BLOCK_M, d)
    tl.store(O + q_ptrs, o, mask=rows[:, None] < N_Q)


def softmax_v(q, k, v, block_m=BLOCK_M, block_n=64):
    """q: (Z, Nq, d), k and v: (Z, Nk, d) float32 with Nk <= block_n. Returns O (Z, Nq, d)."""
    Z, n_q, d = q.shape
    n_k = k.shape[1]
    assert n_k <= block_n, f"Nk = {n_k}: this kernel holds every key in one block of {block_n}"
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    softmax_v_kernel[(triton.cdiv(n_q, block_m), Z)](
        q, k, v, o, d**-0.5, n_q, n_k, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n
    )
    return o


# %% tags=["check"]
q, k, v = random_qkv((B * H, N_Q, D), 50, device=DEVICE)
# 40 q: scores up to about 200, where exp overflows float32 (past 88.7, notebook 03) unless the max is subtracted
for name, q_in in (("softmax_v_kernel", q), ("softmax_v_kernel, large scores", 40 * q)):
    check(
        name,
        lambda q_in=q_in: softmax_v(q_in, k, v).double(),
        attention(q_in.double(), k.double(), v.double()),
        rtol=1e-4,
        atol=1e-4,
    )

# %% [markdown]
# Once your check passes, this is how attention is computed for short sequences. It does not scale: a
# program holds a BLOCK_M x Nk tile of scores in registers, and at Nk = 4096 that is 64 x 4096 floats =
# 1 MiB for one program, four times a whole SM's register file. The keys must come in blocks, and the
# softmax must work on a row it sees one block at a time: the **online softmax** of notebook 03, inside
# the kernel.

# %% [markdown]
# ## 2. Step 1: the core loop
#
# The smallest kernel that loops over K/V blocks: lengths that are multiples of the blocks, Nq = Nk, no
# mask, `tl.exp`. Rows are `offs_m`, keys `offs_n`, head-dim columns `offs_d`; the head dim must be a power
# of two (it is a `tl.arange` length) and the last dimension of each tensor contiguous. `tl.dot` multiplies
# two blocks on the tensor cores; its result is float32 whatever the input dtype. The inputs here are
# float32, so every `tl.dot` says `input_precision="ieee"` (a GPU would otherwise round them to TF32).
#
# **Exercise 2 (the online rescale, in the kernel).** After the scores `s` of one K/V block, write the
# five lines of section 1's pseudocode: the new running max `m_new`, the tile's unnormalised
# probabilities `p`, the rescaling factor `alpha`, and the updated `l_i` and `acc` (P V with
# `tl.dot(p, v, input_precision="ieee")`). `m_i = m_new` is already written after your lines.


# %%
@triton.jit
def flash_fwd_v1(
    Q, K, V, O, L, scale,
    stride_qz, stride_qn, stride_kz, stride_kn, stride_vz, stride_vn, stride_oz, stride_on,
    N, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0)  # which block of query rows
    z = tl.program_id(1)  # which (batch, head)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # Q block: HBM -> registers, once. It stays there for the whole loop. (N is a multiple of the
    # blocks here, so no load can run past the end: the next sections add the masks.)
    q = tl.load(Q + z * stride_qz + offs_m[:, None] * stride_qn + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running row max
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running row sum of exp(S - m)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # unnormalised output
    for start_n in range(0, N, BLOCK_N):
        rows_kv = start_n + offs_n
        k = tl.load(K + z * stride_kz + rows_kv[:, None] * stride_kn + offs_d[None, :])  # (BLOCK_N, d)
        v = tl.load(V + z * stride_vz + rows_kv[:, None] * stride_vn + offs_d[None, :])
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # S tile (BLOCK_M, BLOCK_N), registers
        ### BEGIN SOLUTION
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)  # rescales what was summed under the old max
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        ### END SOLUTION
        m_i = m_new
    tl.store(O + z * stride_oz + offs_m[:, None] * stride_on + offs_d[None, :], acc / l_i[:, None])
    tl.store(L + z * N + offs_m, m_i + tl.log(l_i))


def flash_forward_v1(q, k, v, block_m=BLOCK_M, block_n=BLOCK_N):
    """q, k, v: (Z, N, d) float32, last dim contiguous, N a multiple of both blocks. Returns O, L (Z, N)."""
    Z, N, d = q.shape
    assert N % block_m == 0 and N % block_n == 0 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    o = torch.empty_like(q)
    lse = torch.empty(Z, N, device=q.device, dtype=torch.float32)
    flash_fwd_v1[(N // block_m, Z)](
        q, k, v, o, lse, d**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), o.stride(0), o.stride(1), N, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    return o, lse


# %% tags=["check"]
q, k, v = random_qkv((B * H, N_EVEN, D), device=DEVICE)
check(
    "flash_fwd_v1 (online rescale)",
    lambda: tuple(t.double() for t in flash_forward_v1(q, k, v)),
    attention(q.double(), k.double(), v.double(), return_lse=True),
    rtol=1e-4,
    atol=1e-4,
    parts=["O", "L"],
)

# %% [markdown]
# ## 3. Any lengths, Nq != Nk: two kinds of padding
#
# Real sequences are not multiples of 32 or 128, and cross-attention has Nq != Nk. Two kinds of padding
# appear:
# - **query rows** past Nq in the last query block: load them as 0 (`mask=rows < N_Q`), compute on them
#   harmlessly, and mask the stores of O and L. Without the store mask they would overwrite memory past the
#   end of O (section 3 of notebook 05: never do that).
# - **key columns** past Nk in the last K/V block: loading K and V as 0 is *not* enough — a score of 0 still
#   gets weight exp(0 - m) in the softmax. Their scores must become **-inf** before the max and the exp,
#   so that they get weight exactly 0 (the bridge kernel of section 1b did the same).
#
# Why -inf and not 0? Set the padding scores to 0 instead and the padding keys (whose V rows were loaded as
# 0) still take a share exp(0 - m) of each row's probability mass: O shrinks towards 0 and L grows. In
# PyTorch, on one block of 32 query rows with the N_K real keys padded to a whole number of 32-key blocks:

# %%
q, k, v = random_qkv((1, 32, D), N_K, dtype=torch.float64, device=DEVICE)
n_pad = -(-N_K // 32) * 32  # N_K rounded up to a multiple of 32
print(f"{N_K} real keys padded to {n_pad}")
s_pad = q[0] @ torch.nn.functional.pad(k[0], (0, 0, 0, n_pad - N_K)).T * D**-0.5
v_pad = torch.nn.functional.pad(v[0], (0, 0, 0, n_pad - N_K))
real = torch.arange(n_pad, device=s_pad.device) < N_K
for fill in (float("-inf"), 0.0):
    o_pad = torch.softmax(s_pad.masked_fill(~real, fill), dim=-1) @ v_pad
    err = (o_pad - attention(q[0], k[0], v[0])).abs().max()
    print(f"padding scores set to {fill}: max |O error| = {err:.1e}")

# %% [markdown]
# ## 4. Base-2 exponentials with the scale folded in
#
# The GPU computes $2^x$ in hardware (`ex2.approx` in PTX; notebook 05 showed that `tl.exp(x)` becomes
# `ex2(x * log2(e))`). Write $e^{x} = 2^{x \log_2 e}$ and keep the running max in base-2 units:
# $$p = e^{\,s\cdot\text{scale} - m} = 2^{\,s\cdot(\text{scale}\cdot\log_2 e) - m_2},
#   \qquad m_2 = m \log_2 e .$$
# So we multiply the raw scores by one constant `qk_scale = scale * log2(e)` (computed once, on the host) and
# call `exp2`: one multiply-add and one `ex2` per score, instead of a multiply for the scale, another for
# $\log_2 e$, and the `ex2`. The probabilities, checked in PyTorch on one row:

# %%
s_row = torch.randn(1000, dtype=torch.float64) * 5
scale = 0.125
qk_scale = scale * math.log2(math.e)
m2 = (s_row * qk_scale).max()
l2 = torch.exp2(s_row * qk_scale - m2).sum()
torch.testing.assert_close(torch.exp2(s_row * qk_scale - m2) / l2, torch.softmax(s_row * scale, dim=0))
print("the softmax in base 2, with the scale folded into qk_scale, matches the natural-log one")

# %% [markdown]
# At the end, the logsumexp L must go back to natural-log units, which the backward pass and the reference
# expect: $L = m + \ln l$ in the units of the scaled scores.
#
# **Exercise 3 (back from base 2).** A program ends its loop with `m2` (the running max of the scores
# times `qk_scale`, in base-2 units) and `l` (the sum of `2**(s * qk_scale - m2)`), for a block of rows.
# Return the natural-log logsumexp L of the scaled scores `s * scale`, as the kernel stores it.


# %%
def lse_from_base2(m2, l):
    ### BEGIN SOLUTION
    return (m2 + torch.log2(l)) * math.log(2)
    ### END SOLUTION


# %% tags=["check"]
s_rows = torch.randn(4, 300, dtype=torch.float64) * 4
m2_rows = (s_rows * qk_scale).amax(dim=1)
l_rows = torch.exp2(s_rows * qk_scale - m2_rows[:, None]).sum(dim=1)
check("lse_from_base2", lambda: lse_from_base2(m2_rows, l_rows), torch.logsumexp(s_rows * scale, dim=1))

# %% [markdown]
# ## 5. Causal attention — skip what is masked, mask only the diagonal
#
# With a causal mask, query $i$ sees keys $j \le i$ (top-left aligned, as in `scaled_dot_product_attention`).
# Seen in blocks, each (query block, key block) pair is one of three kinds:
# - **fully visible**: every key of the block is $\le$ every query row: no mask needed;
# - **on the diagonal**: some pairs are masked: set those scores to -inf;
# - **fully masked**: every key is after every query row: the block contributes exactly nothing, so the
#   kernel **never loads it**. That halves the work.
#
# For a query block starting at row m0, the kernel visits keys in two stages:
# - stage 1, unmasked: the full blocks that end at or before min(m0, Nk);
# - stage 2, masked: from there up to min(m0 + BLOCK_M, Nk) — the diagonal blocks and the ragged last block.
#
# Without causal masking, stage 1 runs over all full blocks and stage 2 over the ragged last block (if any).
#
# First the truth, from the element-wise mask: what each pair of blocks must be at least. A block with
# padding keys needs a mask even when every real key is visible; padding query rows need none (they are
# never stored). Then `plan_from_bounds` turns a function `bounds(m0, block_m, block_n, n_k, causal) ->
# (hi_full, hi)` into the plan a kernel with those two stages would follow.

# %%
SKIP, MASKED, FULL = 0, 1, 2


def block_truth(n_q, n_k, block_m, block_n, causal):
    """(query blocks, key blocks) array of SKIP, MASKED or FULL, from the element-wise mask."""
    visible = causal_mask(n_q, n_k) if causal else torch.ones(n_q, n_k, dtype=torch.bool)
    num_m, num_n = math.ceil(n_q / block_m), math.ceil(n_k / block_n)
    truth = np.zeros((num_m, num_n), dtype=int)
    for i in range(num_m):
        for j in range(num_n):
            tile = visible[i * block_m : (i + 1) * block_m, j * block_n : (j + 1) * block_n]
            full = tile.all() and tile.shape[1] == block_n  # padding keys need a mask; padding rows do not
            truth[i, j] = FULL if full else (MASKED if tile.any() else SKIP)
    return truth


def plan_from_bounds(bounds, n_q, n_k, block_m, block_n, causal):
    """The plan of a two-stage kernel: key blocks starting below hi_full unmasked, then up to hi masked."""
    num_m, num_n = math.ceil(n_q / block_m), math.ceil(n_k / block_n)
    plan = np.full((num_m, num_n), SKIP)
    for i in range(num_m):
        hi_full, hi = bounds(i * block_m, block_m, block_n, n_k, causal)
        for j, n0 in enumerate(range(0, hi, block_n)):
            plan[i, j] = FULL if n0 < hi_full else MASKED
    return plan


PLAN_CASES = [(256, 256, 32, 32), (100, 75, 32, 32), (300, 200, 64, 32), (200, 300, 32, 64)]

# %% [markdown]
# **Exercise 4 (the loop bounds).** Write `kv_bounds`: for the query block starting at row `m0`, return
# `(hi_full, hi)` such that stage 1 runs over the key blocks starting in `[0, hi_full)` without a mask and
# stage 2 over those starting in `[hi_full, hi)` with one. `hi_full` must be a multiple of `block_n`. Skip
# every block that is fully masked, and mask only the blocks that need it: the check compares your plan
# with the truth for causal and non-causal, ragged, Nq != Nk, BLOCK_M != BLOCK_N.


# %%
def kv_bounds(m0, block_m, block_n, n_k, causal):
    ### BEGIN SOLUTION
    if causal:
        return min(m0, n_k) // block_n * block_n, min(m0 + block_m, n_k)
    return n_k // block_n * block_n, n_k
    ### END SOLUTION


# %% tags=["check"]
check(
    "kv_bounds",
    lambda: [plan_from_bounds(kv_bounds, *case, c) for case in PLAN_CASES for c in (False, True)],
    [block_truth(*case, c) for case in PLAN_CASES for c in (False, True)],
)

# %% [markdown]
# course_lib answers the same question for every kernel it has, in one place:
# `course_lib.attention.blocks.kv_block_range` (a `@triton.jit` helper) and its Python twin
# `kv_block_range_py(m0, n_q, n_k, offset, block_m, block_n, causal) -> (lo, mid, hi)`, where `mid` is your
# `hi_full` and `offset` 0 the top-left alignment (a later notebook uses the other). The plan of a causal
# 256 x 256 attention with 32 x 32 blocks, drawn from course_lib's bounds: of 64 block pairs, 28 are
# skipped, 8 are masked (the diagonal) and 28 need no mask.


# %%
def lib_bounds(n_q):
    """course_lib's bounds for queries of length n_q, in kv_bounds's form: (hi_full, hi)."""
    return lambda m0, block_m, block_n, n_k, causal: kv_block_range_py(m0, n_q, n_k, 0, block_m, block_n, causal)[1:]


for case in PLAN_CASES:
    for causal in (False, True):
        assert (plan_from_bounds(lib_bounds(case[0]), *case, causal) == block_truth(*case, causal)).all(), case
plan = plan_from_bounds(lib_bounds(256), 256, 256, 32, 32, causal=True)
fig, ax = plt.subplots(figsize=(5.5, 5))
ax.imshow(plan, cmap=ListedColormap(["#eeeeee", "#fdae6b", "#3182bd"]), vmin=0, vmax=2)
ax.set_xlabel("key block j (BLOCK_N = 32 keys)")
ax.set_ylabel("query block i (BLOCK_M = 32 queries)")
counts = {name: int((plan == c).sum()) for name, c in (("skipped", SKIP), ("masked", MASKED), ("full", FULL))}
ax.set_title(
    f"Causal: {counts['skipped']} of {plan.size} blocks never loaded\n"
    f"grey: skipped, orange: masked ({counts['masked']}), blue: no mask ({counts['full']})"
)
plt.show()
assert counts == {"skipped": 28, "masked": 8, "full": 28}

# %% [markdown]
# ## 6. Exercise 5: the FlashAttention-2 forward kernel
#
# Now all of it, in one kernel: you write its body. What you have built so far, and where it goes:
# - the loop over K/V blocks with the online rescale (exercise 2), in base 2 with `qk_scale` (section 4);
# - the -inf mask for padding keys and the store masks for padding rows (section 3);
# - the two stages of exercise 4: blocks before `hi_full` without a mask, then up to `hi` with one (the
#   causal diagonal and the ragged last block); blocks above the diagonal are never loaded;
# - the epilogue: O = acc / l, and L in natural-log units (exercise 3).

# %% [markdown]
# **Given** (do not change them): the signatures and docstrings, the program ids and the pointer set-up
# (the pointers of the Q and O blocks, of K/V block 0, and of L), and the launcher `flash_forward` with its
# output guard. The kernel takes **top-left** causal masking (query i sees keys j <= i, as SDPA's
# `is_causal=True`); course_lib's kernel also takes the bottom-right alignment of a KV cache, through an
# offset (`course_lib/attention/blocks.py`).
#
# **Yours**: the body of `_attend` (the K/V loop of one stage, a `@triton.jit` helper that Triton inlines;
# `MASK` is a compile-time constant, so the unmasked stage compiles without a single `tl.where`), and the
# rest of `flash_fwd`: load Q, set up the running state, compute the bounds, call `_attend` once per stage,
# write O and L. Every load and store takes a mask (`other=0.0` on loads); P goes into the second `tl.dot`
# in V's dtype (`p.to(v.dtype)`: float16 on the tensor cores), and every `tl.dot` takes
# `input_precision=DOT_PRECISION` ("ieee" for float32 inputs, as in exercise 2).


# %%
@triton.jit
def _attend(
    acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn,
    offs_m, offs_n, lo, hi, N_K, qk_scale,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """The online softmax over the K/V blocks starting at keys lo, lo + BLOCK_N, ... < hi.

    acc (BLOCK_M, HEAD_DIM), l_i and m_i (BLOCK_M,): the running state, float32; m_i in base-2 units (the
    max of the scores times qk_scale). q: the Q block (BLOCK_M, HEAD_DIM), in registers. k_ptrs, v_ptrs:
    the pointers of K/V block 0 (BLOCK_N, HEAD_DIM); the block of keys start_n ... is at
    k_ptrs + start_n * stride_kn. offs_m: this program's query rows; offs_n = arange(BLOCK_N).
    MASK: the blocks may hold keys past N_K or, with CAUSAL, keys j > i for some row i: their scores
    become -inf. Returns the new (acc, l_i, m_i)."""
    ### BEGIN SOLUTION
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # key indices of this block
        key_ok = cols[:, None] < N_K
        k = tl.load(k_ptrs + start_n * stride_kn, mask=key_ok, other=0.0)  # K block: HBM -> SRAM
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # raw scores Q K^T, float32
        if MASK:  # only the diagonal blocks and the ragged last block
            visible = cols[None, :] < N_K
            if CAUSAL:
                visible = visible & (offs_m[:, None] >= cols[None, :])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # base-2 units
        p = tl.math.exp2(s * qk_scale - m_new[:, None])  # one FMA and one ex2 per score
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptrs + start_n * stride_vn, mask=key_ok, other=0.0)  # V block: HBM -> SRAM
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)  # acc += P V
        m_i = m_new
    return acc, l_i, m_i
    ### END SOLUTION


# %%
@triton.jit
def flash_fwd(
    Q, K, V, O, L, qk_scale,
    stride_qz, stride_qn, stride_qd, stride_kz, stride_kn, stride_kd,
    stride_vz, stride_vn, stride_vd, stride_oz, stride_on, stride_od,
    N_Q, N_K,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """O[z, rows] and L[z, rows] for the BLOCK_M query rows of one program: rows start_m * BLOCK_M ...
    of (batch·head) z. Q, O: (Z, N_Q, HEAD_DIM); K, V: (Z, N_K, HEAD_DIM), any strides; L: (Z, N_Q)
    float32, contiguous. qk_scale = scale * log2(e). O = softmax(Q K^T * scale) V in O's dtype; L = the
    natural-log logsumexp of each row's scaled scores. CAUSAL: query i sees keys j <= i (top-left)."""
    start_m = tl.program_id(0)  # which block of query rows
    z = tl.program_id(1).to(tl.int64)  # which (batch, head); int64: z * stride can pass 2**31
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # this program's query rows
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + z * stride_qz + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd  # (BLOCK_M, d)
    k_ptrs = K + z * stride_kz + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd  # K block 0
    v_ptrs = V + z * stride_vz + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd  # V block 0
    o_ptrs = O + z * stride_oz + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od  # (BLOCK_M, d)
    l_ptrs = L + z * N_Q + offs_m  # (BLOCK_M,)
    ### BEGIN SOLUTION
    row_ok = offs_m < N_Q  # padding rows of the last query block: computed, never stored
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)  # Q block: HBM -> registers, once
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # The two stages of exercise 4. Key 0 is visible to every row and comes first, so after the first
    # block every m_i is finite: no -inf - (-inf) = NaN can occur.
    if CAUSAL:
        hi = tl.minimum((start_m + 1) * BLOCK_M, N_K)  # keys after the block's last row: never loaded
        hi_full = tl.minimum(start_m * BLOCK_M, N_K) // BLOCK_N * BLOCK_N
    else:
        hi = N_K
        hi_full = N_K // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, 0, hi_full, N_K, qk_scale,
        False, CAUSAL, BLOCK_N, DOT_PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, hi_full, hi, N_K, qk_scale,
        True, CAUSAL, BLOCK_N, DOT_PRECISION,
    )  # fmt: skip
    tl.store(o_ptrs, (acc / l_i[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(l_ptrs, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=row_ok)  # (m2 + log2 l) ln 2
    ### END SOLUTION


# %% [markdown]
# The launcher (given). It flattens (..., N, d) to (Z, N, d) views, puts a guard after O and L
# (`guarded_empty`: a store past their end is caught, not left to corrupt memory) and launches one program
# per (query block, z).


# %%
def flash_forward(q, k, v, causal=False, block_m=BLOCK_M, block_n=BLOCK_N, num_warps=4, num_stages=2):
    """q: (..., Nq, d), k and v: (..., Nk, d), any strides; float16 or float32 (bfloat16 on a GPU; the
    interpreter's bfloat16 `tl.dot` is wrong, see the note at the end); d a power of two >= 16.
    Returns O (..., Nq, d) in q's dtype and L (..., Nq) float32, natural-log units."""
    *lead, n_q, d = q.shape
    n_k = k.shape[-2]
    assert d >= 16 and d & (d - 1) == 0, f"head dim {d}: this kernel takes powers of two >= 16"
    assert not (course_lib.INTERPRET and q.dtype == torch.bfloat16), "bfloat16: GPU only (see the note at the end)"
    q3, k3, v3 = q.reshape(-1, n_q, d), k.reshape(-1, n_k, d), v.reshape(-1, n_k, d)  # (Z, N, d) views
    Z = q3.shape[0]
    o, o_guard = guarded_empty((Z, n_q, d), q.dtype, q.device)
    lse, l_guard = guarded_empty((Z, n_q), torch.float32, q.device)
    flash_fwd[(triton.cdiv(n_q, block_m), Z)](
        q3, k3, v3, o, lse, d**-0.5 * math.log2(math.e),  # qk_scale: the scale folded into base 2
        *q3.stride(), *k3.stride(), *v3.stride(), *o.stride(), n_q, n_k,
        CAUSAL=causal, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    o_guard("flash_fwd")
    l_guard("flash_fwd")
    return o.reshape(*lead, n_q, d), lse.reshape(*lead, n_q)


# %% [markdown]
# The check runs your kernel over cases from easy to hard and compares O and L with the float64 reference:
# lengths that are multiples of the blocks, then ragged ones with Nq != Nk both ways, causal (top-left) and
# not, float16, and K and V stored transposed (rows not contiguous: the given pointers read the strides).
# It also reads your kernel's source for a load or store without a mask.

# %% tags=["check"]
FWD_CASES = [
    dict(Nq=64, Nk=64, causal=False, dtype=torch.float32),
    dict(Nq=N_Q, Nk=N_K, causal=False, dtype=torch.float32),
    dict(Nq=N_K, Nk=N_Q, causal=False, dtype=torch.float32),
    dict(Nq=64, Nk=64, causal=True, dtype=torch.float32),
    dict(Nq=N_Q, Nk=N_K, causal=True, dtype=torch.float32),
    dict(Nq=N_K, Nk=N_Q, causal=True, dtype=torch.float32),
    dict(Nq=N_Q, Nk=N_K, causal=True, dtype=torch.float16),
    dict(Nq=N_K, Nk=N_Q, causal=False, dtype=torch.float16, transposed=True),
]


def fwd_inputs(Nq, Nk, dtype, transposed=False):
    """The same random (B, H, Nq, d) q and (B, H, Nk, d) k, v for the kernel and the reference."""
    generator = torch.Generator().manual_seed(1000 * Nq + Nk)
    q, k, v = random_qkv((B, H, Nq, D), Nk, transposed=transposed, generator=generator)
    return (t.to(DEVICE, dtype) for t in (q, k, v))


def yours(Nq, Nk, causal, dtype, transposed=False):
    check_masked_memory_ops(flash_fwd, "flash_fwd")
    check_masked_memory_ops(_attend, "flash_fwd")
    return flash_forward(*fwd_inputs(Nq, Nk, dtype, transposed), causal=causal)


def reference(Nq, Nk, causal, dtype, transposed=False):
    q, k, v = (t.double() for t in fwd_inputs(Nq, Nk, dtype, transposed))
    return attention(q, k, v, causal=causal, return_lse=True)


check_cases("flash_fwd", FWD_CASES, yours, reference, rtol=2e-3, atol=2e-3, outputs=("O", "L"))

# %% [markdown]
# **Time it (GPU only).** Your kernel beside course_lib's finished one (`course_lib.flash_attention`: its
# tuned launch, and on a Hopper GPU at long N course_lib's own FlashAttention-3-style kernel written in
# Gluon, notebook 08c) and PyTorch's SDPA, in float16, causal. On a CPU, and before your check passes, the
# cell says why it times nothing.

# %%
q, k, v = random_qkv(TIME_SHAPE, dtype=torch.float16, device=DEVICE)
_ = time_kernels(
    "flash_fwd",
    learner=lambda: flash_forward(q, k, v, causal=True, block_m=128, block_n=64, num_stages=3),
    course_lib=lambda: course_lib.flash_attention(q, k, v, causal=True),
    sdpa=lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
    flops=attention_flops(*TIME_SHAPE[:3], TIME_SHAPE[2], TIME_SHAPE[3], causal=True),
    note="course_lib's launch is tuned per shape and starts the longest causal rows first; yours is one fixed launch.",
)

# %% [markdown]
# ## 7. On the GPU: course_lib against notebook 04 and PyTorch (GPU only)
#
# From here on, course_lib's Triton forward stands in for your kernel: `lib_forward.forward` with a fixed
# launch (BLOCK_M=128, BLOCK_N=64, 4 warps, 3 stages, the Triton kernel only) is the algorithm you wrote.
# Forward time for the shapes of the FlashAttention papers, reported as TFLOP/s by the papers' convention
# ($4 \cdot B \cdot H \cdot N^2 \cdot d$ useful FLOPs, half of that when causal): bfloat16,
# B·N = 16384 tokens, H·d = 2048, d = 64. Providers: that fixed launch, `course_lib.flash_attention` (its
# default launch, recorded per GPU or chosen by a rule; on a Hopper GPU at long N, course_lib's own
# FlashAttention-3-style kernel written in Gluon, notebook 08c), notebook 04's `FlashAttentionTorch` (a
# Python loop over tiles: only up to N = 2048, it is slow) and `scaled_dot_product_attention` (PyTorch
# picks its fastest backend). On a CPU we show the recorded run, which timed section 6's worked answer at
# that launch (when this notebook gave the kernel in full) in place of course_lib's fixed launch: the same
# algorithm.

# %% [markdown]
# **Predict first.** The causal kernel skips every fully masked block. At the smallest N of the benchmark
# (1024 tokens, blocks of 128 × 64), how many times faster is the causal forward than the non-causal one?
# Count the blocks it visits, then think about what the count leaves out (the diagonal blocks are masked,
# and each program's work is shorter). Type your estimate in place of the value in the next cell; the cell
# after it scores it against the figure.

# %%
# Your prediction: time of the non-causal forward / time of the causal forward, N = 1024, d = 64.
causal_guess = predict("causal skip speed-up of the forward at N = 1024", 2.0, unit="x")

# %%
FIXED_LAUNCH = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "hopper": False}
FIXED = ("this notebook", "course_lib, fixed launch")  # the recorded run's name for it, and today's
LABELS = {"this notebook": "worked answer, 128 x 64 (recorded)", FIXED[1]: "course_lib, 128 x 64 launch"}


def fixed_name(tflops):
    return next(name for name in FIXED if name in tflops)


def plot_forward_comparison(data, source):
    fig, axes = plt.subplots(1, 2, figsize=(9.0, 4.6), sharey=True, layout="constrained")
    for ax, causal in zip(axes, (False, True)):
        series = {LABELS.get(name, name): values for name, values in data["tflops"][str(causal)].items()}
        plot_series(
            data["N"], series, xlabel="sequence length N", ylabel="forward TFLOP/s (bf16)",
            title="causal" if causal else "not causal", logx=True, ax=ax,
        )  # fmt: skip
        ax.set_xticks(data["N"], [f"{n // 1024}k" for n in data["N"]])
        ax.get_legend().remove()
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=2, fontsize=11)
    fig.suptitle(f"FlashAttention-2 forward against PyTorch, d = {data['d']}\n{source}", fontsize=13)
    plt.show()
    for causal in (False, True):
        tflops = data["tflops"][str(causal)]
        print(
            f"{'causal' if causal else 'not causal':10}: up to {max(tflops[fixed_name(tflops)]):.0f} TFLOP/s "
            f"(fixed launch), {max(tflops['course_lib.flash_attention']):.0f} (course_lib's tuned launch)"
        )


# %%
def measure_forward_comparison():
    from torch.nn.functional import scaled_dot_product_attention

    providers = {
        FIXED[1]: lambda q, k, v, c: lib_forward.forward(q, k, v, c, config=FIXED_LAUNCH)[0],
        "course_lib.flash_attention": lambda q, k, v, c: course_lib.flash_attention(q, k, v, causal=c),
        "FlashAttentionTorch (nb 04)": lambda q, k, v, c: course_lib.FlashAttentionTorch.apply(q, k, v, c),
        "SDPA": lambda q, k, v, c: scaled_dot_product_attention(q, k, v, is_causal=c),
    }
    heads = 2048 // BENCH_D
    data = {"N": BENCH_NS, "d": BENCH_D, "heads": heads, "tokens": BENCH_TOKENS, "tflops": {}}
    qkv = {n: random_qkv((BENCH_TOKENS // n, heads, n, BENCH_D), dtype=torch.bfloat16, device=DEVICE) for n in BENCH_NS}
    triton_calls = [(name, n, c) for name in list(providers)[:2] for n in BENCH_NS for c in (False, True)]
    run_cases(lambda case: providers[case[0]](*qkv[case[1]], case[2]), triton_calls)  # compile side by side
    for causal in (False, True):
        data["tflops"][str(causal)] = {name: [] for name in providers}
        for n in BENCH_NS:
            q, k, v = qkv[n]
            flops = attention_flops(BENCH_TOKENS // n, heads, n, n, BENCH_D, causal=causal)
            for name, fn in providers.items():
                if name.startswith("FlashAttentionTorch") and n > 2048:
                    data["tflops"][str(causal)][name].append(None)
                    continue
                ms = benchmark(lambda fn=fn, q=q, k=k, v=v, c=causal: fn(q, k, v, c))
                data["tflops"][str(causal)][name].append(flops / ms * 1e-9)
    return data


# %%
got = records.measured_or_recorded(
    "flash_forward_compare",
    measure_forward_comparison,
    missing="No recorded GPU run yet (it is written when this notebook runs on a GPU). What to look for\n"
    "in it: how close the Triton kernels come to SDPA, how close the fixed launch comes to course_lib's\n"
    "tuned one, and how far notebook 04's PyTorch loop falls behind (every tile costs several kernel\n"
    "launches and round trips to HBM).",
)
if got:
    plot_forward_comparison(*got)
    fwd, n0 = got[0], got[0]["N"][0]
    fwd_ms = {  # time of each mode at the smallest N, from its TFLOP/s and its useful FLOPs
        c: attention_flops(fwd["tokens"] // n0, fwd["heads"], n0, n0, fwd["d"], causal=c)
        / (fwd["tflops"][str(c)][fixed_name(fwd["tflops"][str(c)])][0] * 1e9)
        for c in (False, True)
    }
    print(f"N = {n0}: the causal forward takes {fwd_ms[True] / fwd_ms[False]:.2f} of the non-causal one's time")
    _ = causal_guess.score(fwd_ms[False] / fwd_ms[True])

# %% [markdown]
# ## 8. Block sizes and warps (GPU only)
#
# BLOCK_M, BLOCK_N, `num_warps` and `num_stages` trade against each other: larger blocks reuse each loaded
# K/V block for more queries (fewer bytes per FLOP) but need more registers and shared memory per program, so
# fewer programs fit on an SM at once and large tiles may spill registers; more warps split a tile over more
# threads; more stages prefetch more K/V blocks ahead (more shared memory). We sweep course_lib's Triton
# forward through `config=` at N = 4096 (bf16, d = 64, not causal; the recorded run swept the worked answer
# of section 6, the same algorithm). Configurations that do not fit are reported as such.

# %%
# every tile shape and warp count with 3 stages, and 2 stages for two of them (each configuration compiles)
SWEEP = [(bm, bn, w, 3) for bm in (64, 128) for bn in (64, 128) for w in (4, 8)] + [(64, 64, 4, 2), (128, 64, 8, 2)]


def show_sweep(data, source):
    ok = sorted(
        (t, f"{bm} x {bn}, {w} warps, {s} stages")
        for (bm, bn, w, s), t in zip(data["configs"], data["tflops"])
        if t
    )
    failed = [cfg for cfg, t in zip(data["configs"], data["tflops"]) if t is None]
    ok.reverse()  # fastest first (at the top)
    fig, ax = plt.subplots(figsize=(8.8, 0.35 * len(ok) + 2), layout="constrained")
    title = f"N = {data['N']}: the best configuration is {ok[0][0] / ok[-1][0]:.1f}x the worst\n{source}"
    bar_chart(
        [name for _, name in ok], [t for t, _ in ok], horizontal=True, fmt="{:.0f}", ax=ax,
        xlabel="forward TFLOP/s (bf16, d = 64, not causal)", ylabel="launch configuration", title=title,
    )  # fmt: skip
    ax.set_title("")  # the title over the whole figure: the long tick labels push the axes right
    fig.suptitle(title)
    plt.show()
    if failed:
        print("did not fit (BLOCK_M, BLOCK_N, warps, stages):", failed)


# %%
def measure_block_sweep():
    n = 4096
    q, k, v = random_qkv(
        (BENCH_TOKENS // n, 2048 // BENCH_D, n, BENCH_D), dtype=torch.bfloat16, device=DEVICE
    )
    flops = attention_flops(BENCH_TOKENS // n, 2048 // BENCH_D, n, n, BENCH_D)
    data = {"N": n, "configs": SWEEP, "tflops": []}
    for bm, bn, w, s in SWEEP:
        config = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s, "hopper": False}
        try:
            ms = benchmark(lambda config=config: lib_forward.forward(q, k, v, config=config))
            data["tflops"].append(flops / ms * 1e-9)
        except triton.runtime.errors.OutOfResources:
            data["tflops"].append(None)
    return data


got = records.measured_or_recorded(
    "flash_forward_blocks",
    measure_block_sweep,
    missing="No recorded GPU run yet (it is written when this notebook runs on a GPU). What to look for\n"
    "in it: the spread between the best and the worst configuration, and which way each knob pushes.",
)
if got:
    show_sweep(*got)

# %% [markdown]
# ## 9. More exercises
#
# **Exercise 6 — which blocks can a sliding window skip?** With a sliding window of W keys, query i sees keys
# j with i - W < j <= i. For the query block starting at row `m0` (BLOCK_M rows) and the key block starting at
# `n0` (BLOCK_N keys), return `SKIP` if no pair is visible, `FULL` if every pair is, and `MASKED` otherwise.
# (Assume Nq and Nk are multiples of the blocks.)


# %%
def window_block_kind(m0, n0, block_m, block_n, W):
    ### BEGIN SOLUTION
    first_q, last_q = m0, m0 + block_m - 1
    first_k, last_k = n0, n0 + block_n - 1
    if first_k > last_q or last_k <= first_q - W:
        return SKIP
    if last_k <= first_q and first_k > last_q - W:
        return FULL
    return MASKED
    ### END SOLUTION


# %% tags=["check"]
def window_truth(n, block_m, block_n, W):
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = (j <= i) & (j > i - W)
    kinds = []
    for m0 in range(0, n, block_m):
        for n0 in range(0, n, block_n):
            tile = visible[m0 : m0 + block_m, n0 : n0 + block_n]
            kinds.append(FULL if tile.all() else (MASKED if tile.any() else SKIP))
    return kinds


# Windows of several widths: 17, 18, 47 and 48 put a window's edge on a block's edge, where an
# off-by-one shows (18 the skipped tiles' edge, 48 the full tiles'). Blocks of 3 x 5 rows and keys put the
# diagonal's edges where blocks of powers of two never do.
_cases = [(256, 32, 16, W) for W in (17, 18, 47, 48, 70)] + [(30, 3, 5, W) for W in (1, 2, 4, 7, 12)]
check(
    "window_block_kind",
    lambda: [
        window_block_kind(m0, n0, bm, bn, W)
        for n, bm, bn, W in _cases
        for m0 in range(0, n, bm)
        for n0 in range(0, n, bn)
    ],
    [kind for case in _cases for kind in window_truth(*case)],
)

# %% [markdown]
# **Exercise 7 — a logsumexp-only kernel.** Some uses need only L (for example, to rebuild P later). Write
# `lse_kernel`: one program per (query block, z), a loop over key blocks with the online max and sum in
# base 2, no V and no accumulator. Nq and Nk may be ragged (mask the padding keys with -inf), no causal mask.
# It stores L in natural-log units.


# %%
@triton.jit
def lse_kernel(
    Q, K, L, qk_scale, stride_qz, stride_qn, stride_kz, stride_kn, N_Q, N_K,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    ### BEGIN SOLUTION
    start_m = tl.program_id(0)
    z = tl.program_id(1)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        Q + z * stride_qz + offs_m[:, None] * stride_qn + offs_d[None, :],
        mask=offs_m[:, None] < N_Q,
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(0, N_K, BLOCK_N):
        cols = start_n + offs_n
        k = tl.load(
            K + z * stride_kz + cols[:, None] * stride_kn + offs_d[None, :],
            mask=cols[:, None] < N_K,
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
        s = tl.where(cols[None, :] < N_K, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        l_i = l_i * tl.math.exp2(m_i - m_new) + tl.sum(tl.math.exp2(s * qk_scale - m_new[:, None]), axis=1)
        m_i = m_new
    tl.store(L + z * N_Q + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=offs_m < N_Q)
    ### END SOLUTION


def logsumexp_only(q, k, block_m=BLOCK_M, block_n=BLOCK_N):
    Z, n_q, d = q.shape
    lse, check_guard = guarded_empty((Z, n_q), torch.float32, q.device)  # a store past the end is caught
    lse_kernel[(triton.cdiv(n_q, block_m), Z)](
        q, k, lse, d**-0.5 * math.log2(math.e), q.stride(0), q.stride(1), k.stride(0), k.stride(1), n_q,
        k.shape[1], HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    check_guard("lse_kernel")
    return lse


# %% tags=["check"]
q, k, _ = random_qkv((B * H, N_Q, D), N_K, device=DEVICE)
_, L_expected = attention(q.double(), k.double(), k.double(), return_lse=True)
check("lse_kernel", lambda: logsumexp_only(q, k).double(), L_expected, rtol=1e-4, atol=1e-4)

# %% [markdown]
# **Exercise 8 (open).** In a causal forward, the programs of the last query blocks do the most work (they see
# the most keys). course_lib's kernel launches the query blocks in reverse order when causal. On a GPU with
# 132 SMs and more programs than SMs, why does starting the longest programs first shorten the whole run?
# Measure it with your `flash_forward` by reversing `start_m` in `flash_fwd`.

# %% [markdown]
# ## Summary
#
# - One Triton program per (query block, batch·head). It loads its Q block once, streams K and V blocks past
#   it, and keeps the running max m, the running sum l and the accumulator in float32 registers; only O and
#   L (one float per row, for the backward) go back to HBM. S and P exist one tile at a time, on chip.
# - Ragged lengths: padding query rows are computed and not stored; padding keys get score -inf. Only the
#   last block needs the mask, so the loop splits into an unmasked and a masked stage.
# - Base-2 exponentials with `qk_scale = scale * log2(e)` folded in: one FMA and one `ex2` per score;
#   L = (m2 + log2 l) ln 2 at the end.
# - Causal: blocks above the diagonal are never loaded (about half the work), diagonal blocks are masked,
#   the rest runs unmasked.
# - float16 / bfloat16 into the tensor cores, float32 accumulation; float32 inputs need
#   `input_precision="ieee"` to avoid TF32's error.
#
# Next, notebook 07 writes the backward pass: it rebuilds P from Q, K and L, block by block.

# %% [markdown]
# ## Note: the interpreter, bfloat16, and 32-bit offsets
#
# - Under Triton's interpreter (a CPU) bfloat16 `tl.dot` gives wrong values, so this notebook's launcher
#   takes float16 and float32 there; course_lib's kernel converts bfloat16 tiles to float32 right after
#   loading (`UPCAST`), and `import course_lib` makes the interpreter's float32 → bfloat16 cast round to
#   nearest as a GPU does (`runtime.BF16_ROUNDS_TO_NEAREST`).
# - Offsets are 32-bit unless made otherwise: `z * stride_qz` passes 2**31 first, so `z` is int64. Within
#   one (batch, head), `offs_m * stride_qn` stays 32-bit, enough for a contiguous slice (N · d < 2**31).
#   A (batch, N, heads, d) tensor viewed as (batch, heads, N, d) has rows heads · d apart and can wrap at
#   long N: course_lib copies such inputs first (`attention.inputs.within_offsets`).
