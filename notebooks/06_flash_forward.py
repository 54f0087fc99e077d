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
# 2. Build the kernel in runnable, checked steps, writing its heart yourself: softmax · V with every key
#    in one block (a bridge from notebook 05's fused softmax); the online rescale of m, l and the
#    accumulator over K/V blocks, with -inf masks for any lengths (Nq != Nk too); base-2 exponentials with
#    the softmax scale folded in; the loop bounds of causal attention, which skip the blocks above the
#    diagonal and mask only the diagonal ones; float16 / bfloat16 / float32 inputs, float32 accumulators.
# 3. Check it against the float64 reference and against course_lib's finished kernel.
# 4. On a GPU: compare with notebook 04's PyTorch version and PyTorch's `scaled_dot_product_attention`, and
#    sweep block sizes and warps.
#
# The finished kernel is `_fwd_kernel` in `course_lib/attention/forward.py`, which `course_lib.flash_attention`
# (`course_lib/attention/api.py`) calls.

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
from course_lib.attention.reference import attention, causal_mask
from course_lib.exercises import check, guarded_empty, predict
from course_lib.perf.plotting import bar_chart, plot_series
from course_lib.perf.timing import attention_flops, benchmark
from course_lib.runtime import tl, triton
from course_lib.testing import assert_close_to_reference, random_qkv, run_cases

DEVICE = course_lib.DEVICE
print(course_lib.RUNTIME.describe())

# %%
B, H, D = course_lib.pick(cpu=(1, 2, 32), gpu=(2, 4, 64))  # batch, heads, head dim
N_EVEN = course_lib.pick(cpu=128, gpu=1024)  # step 1: a length that is a multiple of the blocks
N_Q, N_K = course_lib.pick(cpu=(100, 75), gpu=(1000, 1531))  # later steps: ragged and unequal lengths
BLOCK_M, BLOCK_N = course_lib.pick(cpu=(32, 32), gpu=(64, 64))  # the teaching launches
DTYPES = course_lib.pick(  # dtypes the kernels below are checked in (the GPU's float16 is left to the tests)
    cpu=[torch.float32, torch.float16, torch.bfloat16], gpu=[torch.float32, torch.bfloat16]
)
BENCH_NS = course_lib.pick(cpu=[], gpu=[1024, 4096, 16384])  # GPU benchmark: sequence lengths
BENCH_D, BENCH_TOKENS = 64, 16384  # GPU benchmark: head dim, B*N tokens (H*d = 2048, as in the papers)
torch.manual_seed(0)

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
SOFTMAX_HINTS = [
    "A safe softmax of each row: subtract the row's max (tl.max(s, axis=1)), exponentiate, divide by "
    "the row's sum. Broadcast a per-row vector over the tile with [:, None].",
    "s_max = tl.max(s, axis=1); p = tl.exp(s - s_max[:, None]); p = p / tl.sum(p, axis=1)[:, None]",
]
# 40 q: scores up to about 200, where exp overflows float32 (past 88.7, notebook 03) unless the max is subtracted
for name, q_in in (("softmax_v_kernel", q), ("softmax_v_kernel, large scores", 40 * q)):
    check(
        name,
        lambda q_in=q_in: softmax_v(q_in, k, v).double(),
        attention(q_in.double(), k.double(), v.double()),
        rtol=1e-4,
        atol=1e-4,
        hints=SOFTMAX_HINTS,
    )

# %% [markdown]
# This is correct, and it is how attention is computed for short sequences. It does not scale: a program
# holds a BLOCK_M x Nk tile of scores in registers, and at Nk = 4096 that is 64 x 4096 floats = 1 MiB for
# one program, four times a whole SM's register file. The keys must come in blocks, and the softmax must
# work on a row it sees one block at a time: the **online softmax** of notebook 03, inside the kernel.

# %% [markdown]
# ## 2. Step 1: the core loop
#
# The smallest kernel that works: lengths that are multiples of the blocks, Nq = Nk, no mask, `tl.exp`.
# Rows are `offs_m`, keys `offs_n`, head-dim columns `offs_d`; the head dim must be a power of two (it is a
# `tl.arange` length) and the last dimension of each tensor contiguous. `tl.dot` multiplies two blocks on the
# tensor cores; its result is float32 whatever the input dtype.


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
    # Q block: HBM -> registers, once. It stays there for the whole loop.
    q = tl.load(Q + z * stride_qz + offs_m[:, None] * stride_qn + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running row max
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running row sum of exp(S - m)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # unnormalised output
    for start_n in range(0, N, BLOCK_N):
        rows_kv = start_n + offs_n
        k = tl.load(K + z * stride_kz + rows_kv[:, None] * stride_kn + offs_d[None, :])  # (BLOCK_N, d)
        v = tl.load(V + z * stride_vz + rows_kv[:, None] * stride_vn + offs_d[None, :])
        s = tl.dot(q, tl.trans(k)) * scale  # S tile (BLOCK_M, BLOCK_N), float32, registers
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)  # rescales what was summed under the old max
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)  # P in the input dtype for the tensor cores
        m_i = m_new
    tl.store(
        O + z * stride_oz + offs_m[:, None] * stride_on + offs_d[None, :],
        (acc / l_i[:, None]).to(O.dtype.element_ty),
    )
    tl.store(L + z * N + offs_m, m_i + tl.log(l_i))


def flash_forward_v1(q, k, v, block_m=BLOCK_M, block_n=BLOCK_N):
    """q, k, v: (Z, N, d), last dim contiguous, N a multiple of both blocks. Returns O (Z, N, d), L (Z, N)."""
    Z, N, d = q.shape
    assert N % block_m == 0 and N % block_n == 0 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    o = torch.empty_like(q)
    lse = torch.empty(Z, N, device=q.device, dtype=torch.float32)
    grid = (N // block_m, Z)
    flash_fwd_v1[grid](
        q, k, v, o, lse, d**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), o.stride(0), o.stride(1), N, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    return o, lse


# %% [markdown]
# Check it against the float64 reference. The accuracy rule of the course
# (`course_lib.testing.assert_close_to_reference`): the kernel's error against float64 may be at most twice
# the error of plain PyTorch attention computed in the kernel's own dtype, plus a small floor. We test in
# float16 here (the tensor cores' native input, on every GPU and in the interpreter).

# %%
q, k, v = random_qkv((B * H, N_EVEN, D), dtype=torch.float16, device=DEVICE)
o1, L1 = flash_forward_v1(q, k, v)
o_ref, L_ref = attention(q.double(), k.double(), v.double(), return_lse=True)
o_same, L_same = attention(q, k, v, return_lse=True)  # plain PyTorch in float16: the baseline
assert_close_to_reference(o1, o_ref, o_same, f"v1 O, (Z, N, d)={tuple(q.shape)}, float16")
assert_close_to_reference(L1, L_ref, L_same, f"v1 L, (Z, N, d)={tuple(q.shape)}, float16")
print(f"step 1: O and L match the float64 reference for (Z, N, d) = {tuple(q.shape)}, float16")

# %% [markdown]
# ## 3. Step 2: any lengths, Nq != Nk
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
# The kernel below is step 1's with both masks added. The heart of it, the online update of the running
# max, the running sum and the accumulator, is yours.
#
# **Exercise 2 (the online rescale, in the kernel).** After the scores `s` of one K/V block are masked, write
# the five lines of section 1's pseudocode: the new running max `m_new`, the tile's unnormalised
# probabilities `p`, the rescaling factor `alpha`, and the updated `l_i` and `acc` (use
# `tl.dot(p, v, input_precision="ieee")` for P V: the inputs here are float32, which a GPU's `tl.dot` would
# otherwise round to TF32). `m_i = m_new` is already written after your lines.


# %%
@triton.jit
def flash_fwd_v2(
    Q, K, V, O, L, scale, N_Q, N_K, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    start_m = tl.program_id(0)
    z = tl.program_id(1).to(tl.int64)
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = rows < N_Q  # padding query rows: computed, never stored
    q_ptrs = z * N_Q * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q + q_ptrs, mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(0, N_K, BLOCK_N):
        cols = start_n + offs_n
        kv_ptrs = z * N_K * HEAD_DIM + cols[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(K + kv_ptrs, mask=cols[:, None] < N_K, other=0.0)
        v = tl.load(V + kv_ptrs, mask=cols[:, None] < N_K, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(cols[None, :] < N_K, s, float("-inf"))  # padding keys
        ### BEGIN SOLUTION
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        ### END SOLUTION
        m_i = m_new
    tl.store(O + q_ptrs, acc / l_i[:, None], mask=row_ok[:, None])
    tl.store(L + z * N_Q + rows, m_i + tl.log(l_i), mask=row_ok)


def flash_forward_v2(q, k, v, block_m=BLOCK_M, block_n=BLOCK_N):
    """q: (Z, Nq, d), k and v: (Z, Nk, d), float32, any lengths. Returns O (Z, Nq, d), L (Z, Nq)."""
    Z, n_q, d = q.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty(Z, n_q, device=q.device, dtype=torch.float32)
    flash_fwd_v2[(triton.cdiv(n_q, block_m), Z)](
        q, k, v, o, lse, d**-0.5, n_q, k.shape[1], HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n
    )
    return o, lse


# %% tags=["check"]
q, k, v = random_qkv((B * H, N_Q, D), N_K, device=DEVICE)
check(
    "flash_fwd_v2 (online rescale)",
    lambda: tuple(t.double() for t in flash_forward_v2(q, k, v)),
    attention(q.double(), k.double(), v.double(), return_lse=True),
    rtol=1e-4,
    atol=1e-4,
    parts=["O", "L"],
    hints=[
        "The new max is the larger of the old one and this tile's row max. Everything summed so far (l_i and "
        "acc) was weighted by exp(. - m_i): multiply both by alpha = exp(m_i - m_new) before adding this "
        "tile's share.",
        "m_new = tl.maximum(m_i, tl.max(s, axis=1)); p = tl.exp(s - m_new[:, None]); "
        "alpha = tl.exp(m_i - m_new); l_i = l_i * alpha + tl.sum(p, axis=1); "
        "acc = acc * alpha[:, None] + tl.dot(p, v, input_precision='ieee')",
    ],
)

# %% [markdown]
# Why -inf and not 0? Set the padding scores to 0 instead and the padding keys (whose V rows were loaded as
# 0) still take a share exp(0 - m) of each row's probability mass: O shrinks towards 0 and L grows. In
# PyTorch, on one row block with the N_K real keys padded to a whole number of 32-key blocks:

# %%
n_pad = -(-N_K // 32) * 32  # N_K rounded up to a multiple of 32
print(f"{N_K} real keys padded to {n_pad}")
s_pad = q[0, :32].double() @ torch.nn.functional.pad(k[0].double(), (0, 0, 0, n_pad - N_K)).T * D**-0.5
v_pad = torch.nn.functional.pad(v[0].double(), (0, 0, 0, n_pad - N_K))
real = torch.arange(n_pad, device=s_pad.device) < N_K
for fill in (float("-inf"), 0.0):
    o_pad = torch.softmax(s_pad.masked_fill(~real, fill), dim=-1) @ v_pad
    err = (o_pad - attention(q[0, :32].double(), k[0].double(), v[0].double())).abs().max()
    print(f"padding scores set to {fill}: max |O error| = {err:.1e}")

# %% [markdown]
# ## 4. Step 3: base-2 exponentials with the scale folded in
#
# The GPU computes $2^x$ in hardware (`ex2.approx` in PTX; notebook 05 showed that `tl.exp(x)` becomes
# `ex2(x * log2(e))`). Write $e^{x} = 2^{x \log_2 e}$ and keep the running max in base-2 units:
# $$p = e^{\,s\cdot\text{scale} - m} = 2^{\,s\cdot(\text{scale}\cdot\log_2 e) - m_2},
#   \qquad m_2 = m \log_2 e .$$
# So we multiply the raw scores by one constant `qk_scale = scale * log2(e)` (computed once, on the host) and
# call `exp2`: one multiply-add and one `ex2` per score, instead of a multiply for the scale, another for
# $\log_2 e$, and the `ex2`. At the end, the logsumexp goes back to natural-log units, which the backward pass
# and the reference expect: $L = m + \ln l = (m_2 + \log_2 l)\cdot\ln 2$.
#
# The identity, checked in PyTorch on one row:

# %%
s_row = torch.randn(1000, dtype=torch.float64) * 5
scale = 0.125
qk_scale = scale * math.log2(math.e)
m2 = (s_row * qk_scale).max()
l2 = torch.exp2(s_row * qk_scale - m2).sum()
p_base2 = torch.exp2(s_row * qk_scale - m2) / l2
torch.testing.assert_close(p_base2, torch.softmax(s_row * scale, dim=0))
torch.testing.assert_close((m2 + torch.log2(l2)) * math.log(2), torch.logsumexp(s_row * scale, dim=0))
print("softmax and logsumexp in base 2 match the natural-log versions")

# %% [markdown]
# ## 5. Step 4: causal attention — skip what is masked, mask only the diagonal
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
# **Exercise 3 (the loop bounds).** Write `kv_bounds`: for the query block starting at row `m0`, return
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
    hints=[
        "Not causal: every key block is visited; only a ragged last block needs the mask. Causal: the last "
        "row of the block is m0 + block_m - 1, so no key at or after m0 + block_m is ever visible; a key block "
        "needs no mask when its last key is <= m0, the block's first row: it ends at or before m0 + 1 (with "
        "the kernels' block sizes, powers of two, that is m0 rounded down to a block). Clip both to n_k.",
        "causal: (min(m0, n_k) // block_n * block_n, min(m0 + block_m, n_k)); "
        "not causal: (n_k // block_n * block_n, n_k)",
    ],
)

# %% [markdown]
# The kernels below compute exactly these bounds (`tl.minimum` for `min`). The plan for a causal 256 x 256
# attention with 32 x 32 blocks: of 64 block pairs, 28 are skipped, 8 are masked (the diagonal) and 28 need
# no mask.


# %%
def kernel_kv_bounds(m0, block_m, block_n, n_k, causal):
    """(hi_full, hi) as the kernels of this notebook compute them."""
    if causal:
        return min(m0, n_k) // block_n * block_n, min(m0 + block_m, n_k)
    return n_k // block_n * block_n, n_k


for case in PLAN_CASES:
    for causal in (False, True):
        assert (plan_from_bounds(kernel_kv_bounds, *case, causal) == block_truth(*case, causal)).all(), case
plan = plan_from_bounds(kernel_kv_bounds, 256, 256, 32, 32, causal=True)
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
# ### A runnable step: base 2 and causal in one kernel
#
# Steps 3 and 4 together, before the last polish: `flash_fwd_v3` is step 2's kernel with the scale folded
# into base 2 (section 4) and a `CAUSAL` switch. It stops its loop at `hi` (the blocks above the diagonal are
# never loaded) but, to stay short, masks every block it visits. Section 6 then splits the loop at
# `hi_full` so that only the diagonal blocks pay for the mask.


# %%
@triton.jit
def flash_fwd_v3(
    Q, K, V, O, L, qk_scale, N_Q, N_K,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0)
    z = tl.program_id(1).to(tl.int64)
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = rows < N_Q
    q_ptrs = z * N_Q * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q + q_ptrs, mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # base-2 units: max of s * qk_scale
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi = tl.minimum((start_m + 1) * BLOCK_M, N_K) if CAUSAL else N_K  # blocks past hi: never loaded
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_ptrs = z * N_K * HEAD_DIM + cols[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(K + kv_ptrs, mask=cols[:, None] < N_K, other=0.0)
        v = tl.load(V + kv_ptrs, mask=cols[:, None] < N_K, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # raw scores: the scale is in qk_scale
        visible = cols[None, :] < N_K
        if CAUSAL:
            visible = visible & (rows[:, None] >= cols[None, :])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])  # one FMA and one ex2 per score
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    tl.store(O + q_ptrs, acc / l_i[:, None], mask=row_ok[:, None])
    tl.store(L + z * N_Q + rows, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=row_ok)  # ln units


def flash_forward_v3(q, k, v, causal=False, block_m=BLOCK_M, block_n=BLOCK_N):
    """q: (Z, Nq, d), k and v: (Z, Nk, d), float32. Returns O (Z, Nq, d), L (Z, Nq) in natural-log units."""
    Z, n_q, d = q.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty(Z, n_q, device=q.device, dtype=torch.float32)
    flash_fwd_v3[(triton.cdiv(n_q, block_m), Z)](
        q, k, v, o, lse, d**-0.5 * math.log2(math.e), n_q, k.shape[1],
        CAUSAL=causal, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    return o, lse


for n_q, n_k in [(N_Q, N_K), (N_K, N_Q)]:
    for causal in (False, True):
        q, k, v = random_qkv((B * H, n_q, D), n_k, device=DEVICE)
        o3, L3 = flash_forward_v3(q, k, v, causal)
        o_ref, L_ref = attention(q.double(), k.double(), v.double(), causal=causal, return_lse=True)
        what = f"v3, Nq={n_q}, Nk={n_k}, causal={causal}"
        torch.testing.assert_close(o3.double(), o_ref, rtol=1e-4, atol=1e-4, msg=lambda m, w=what: f"{w}: {m}")
        torch.testing.assert_close(L3.double(), L_ref, rtol=1e-4, atol=1e-4, msg=lambda m, w=what: f"{w}: {m}")
print("step 3 + 4 (base 2, causal, ragged, Nq != Nk): O and L match the float64 reference")

# %% [markdown]
# ## 6. Step 5: the kernel, with every step
#
# The K/V loop moves into a helper, `_attend`, called once per stage with `MASK` as a compile-time constant:
# the unmasked stage compiles without a single `tl.where`. The helper carries the running state `(acc, l_i,
# m_i)` in and out; Triton inlines it.
#
# Input dtypes: float16 and bfloat16 go into `tl.dot` as they are (the tensor cores' inputs), P is cast to
# V's dtype for the second product, and all accumulation is float32. Two switches depend on the dtype:
# - `DOT_PRECISION = "ieee"` for float32 inputs: on a GPU, `tl.dot` on float32 otherwise uses TF32 (about
#   1e-3 relative error), which would fail our float32 accuracy rule;
# - `UPCAST` for bfloat16 **under the interpreter only**: the interpreter's bfloat16 `tl.dot` gives wrong
#   values, so there the tiles are converted to float32 right after loading. On a GPU, `UPCAST` is False.
#   (The interpreter's own float32 → bfloat16 cast, as in the final store of O, would also drop the low
#   bits where a GPU rounds to nearest: `import course_lib` makes it round as the GPU does,
#   `runtime.BF16_ROUNDS_TO_NEAREST`.)
#
# All strides are passed in, so any view of (Z, N, d) works, and the head dim is any power of two >= 16.
# One limit comes with strides: the offsets are 32-bit integers unless we say otherwise. `z * stride_qz`
# passes 2**31 first (a whole batch), so `z` is made int64 below; inside one (batch, head) slice,
# `offs_m * stride_qn` stays 32-bit. That is enough for a contiguous slice (N * d < 2**31: 16M rows at
# d = 128), but a model's (batch, N, heads, d) tensor seen as (batch, heads, N, d) has rows heads * d
# apart: at 32 heads of 128, 524,288 rows span 2**31 elements and the offsets would wrap. course_lib
# copies such an input to (batch, heads, N, d) before its kernels run (`attention.inputs.within_offsets`;
# the copy is O(N d) bytes against O(N^2 d) work).


# %%
@triton.jit
def _attend(
    acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_n, offs_d, lo, hi, N_K, qk_scale,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # key indices of this block
        k_ptrs = k_base + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd
        if MASK:  # the ragged last block may hold padding keys: load them as 0
            k = tl.load(k_ptrs, mask=cols[:, None] < N_K, other=0.0)
        else:
            k = tl.load(k_ptrs)  # K block (BLOCK_N, d): HBM -> SRAM
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # raw scores Q K^T, float32, registers
        if MASK:  # only the diagonal blocks and the ragged last block
            visible = cols[None, :] < N_K
            if CAUSAL:
                visible = visible & (offs_m[:, None] >= cols[None, :])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # base-2 units
        p = tl.math.exp2(s * qk_scale - m_new[:, None])  # one FMA and one ex2 per score
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if MASK:
            v = tl.load(v_ptrs, mask=cols[:, None] < N_K, other=0.0)
        else:
            v = tl.load(v_ptrs)  # V block (BLOCK_N, d): HBM -> SRAM
        if UPCAST:
            v = v.to(tl.float32)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)  # acc += P V
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def flash_fwd(
    Q, K, V, O, L, qk_scale,
    stride_qz, stride_qn, stride_qd, stride_kz, stride_kn, stride_kd,
    stride_vz, stride_vn, stride_vd, stride_oz, stride_on, stride_od,
    N_Q, N_K,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0)
    z = tl.program_id(1).to(tl.int64)  # int64: z * stride can pass 2**31 for large batches
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < N_Q  # padding rows of the last query block
    q = tl.load(
        Q + z * stride_qz + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # The two stages of section 5. Key 0 is visible to every row and comes first, so after the first
    # block every m_i is finite: no -inf - (-inf) = NaN can occur.
    if CAUSAL:
        hi = tl.minimum((start_m + 1) * BLOCK_M, N_K)  # keys after the block's last row: never loaded
        hi_full = tl.minimum(start_m * BLOCK_M, N_K) // BLOCK_N * BLOCK_N
    else:
        hi = N_K
        hi_full = N_K // BLOCK_N * BLOCK_N
    k_base = K + z * stride_kz
    v_base = V + z * stride_vz
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_n, offs_d, 0, hi_full, N_K, qk_scale, False, CAUSAL, BLOCK_N, UPCAST, DOT_PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_n, offs_d, hi_full, hi, N_K, qk_scale, True, CAUSAL, BLOCK_N, UPCAST, DOT_PRECISION,
    )  # fmt: skip

    o = acc / l_i[:, None]
    tl.store(
        O + z * stride_oz + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od,
        o.to(O.dtype.element_ty),
        mask=row_ok[:, None],
    )
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # back to natural log: (m2 + log2 l) * ln 2
    tl.store(L + z * N_Q + offs_m, lse, mask=row_ok)


def flash_forward(
    q, k, v, causal=False, scale=None, block_m=BLOCK_M, block_n=BLOCK_N, num_warps=4, num_stages=2
):
    """q: (..., Nq, d), k and v: (..., Nk, d); float16, bfloat16 or float32; d a power of two >= 16.

    Returns O (..., Nq, d) in q's dtype and L (..., Nq) in float32 (natural-log units)."""
    *lead, n_q, d = q.shape
    n_k = k.shape[-2]
    assert d >= 16 and d & (d - 1) == 0, f"head dim {d}: this teaching kernel takes powers of two >= 16"
    q3, k3, v3 = q.reshape(-1, n_q, d), k.reshape(-1, n_k, d), v.reshape(-1, n_k, d)  # (Z, N, d) views
    Z = q3.shape[0]
    o = torch.empty_like(q3)
    lse = torch.empty(Z, n_q, device=q.device, dtype=torch.float32)
    scale = d**-0.5 if scale is None else scale
    grid = (triton.cdiv(n_q, block_m), Z)
    flash_fwd[grid](
        q3, k3, v3, o, lse, scale * math.log2(math.e),  # qk_scale: the scale folded into base 2
        *q3.stride(), *k3.stride(), *v3.stride(), *o.stride(), n_q, n_k,
        CAUSAL=causal, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=course_lib.INTERPRET and q.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return o.reshape(*lead, n_q, d), lse.reshape(*lead, n_q)


# %% [markdown]
# ## 7. Check: every case against float64, and against course_lib
#
# (B, H, Nq, d) inputs with Nq and Nk not multiples of the blocks and Nq != Nk, both orders; causal and not;
# each dtype of `DTYPES`. Each result is held to the accuracy rule against the float64 reference, for O and for L, and
# compared with `course_lib.flash_attention` (the finished kernel) and its `forward` (which also returns L).

# %%
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # kernel vs kernel


def check_forward(case):
    n_q, n_k, causal, dtype = case
    what = f"(B, H, Nq, Nk, d)=({B}, {H}, {n_q}, {n_k}, {D}), {dtype}, causal={causal}"
    q, k, v = random_qkv((B, H, n_q, D), n_k, dtype=dtype, device=DEVICE)
    o, lse = flash_forward(q, k, v, causal=causal)
    o_ref, L_ref = attention(q.double(), k.double(), v.double(), causal=causal, return_lse=True)
    o_same, L_same = attention(q, k, v, causal=causal, return_lse=True)
    assert_close_to_reference(o, o_ref, o_same, "O " + what)
    assert_close_to_reference(lse, L_ref, L_same, "L " + what)
    o_lib = course_lib.flash_attention(q, k, v, causal=causal)
    torch.testing.assert_close(o, o_lib, rtol=TOL[dtype], atol=TOL[dtype], msg=lambda m: f"{what}: {m}")
    _, L_lib = lib_forward.forward(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), causal, None)
    torch.testing.assert_close(lse.flatten(0, 1), L_lib, rtol=1e-4, atol=1e-4, msg=lambda m: f"{what}: {m}")


# On a GPU the cases run side by side, so their kernels compile at the same time (`run_cases`).
cases = [(n_q, n_k, c, dt) for n_q, n_k in [(N_Q, N_K), (N_K, N_Q)] for c in (False, True) for dt in DTYPES]
run_cases(check_forward, cases)
print(f"O and L: within the accuracy rule in all {len(cases)} cases, and equal to course_lib's kernel")

# %% [markdown]
# The kernel also honours strides: here K and V are stored transposed (as (…, d, N)), so their rows are not
# contiguous, and the result is unchanged.

# %%
q, k, v = random_qkv((B, H, N_Q, D), N_K, dtype=torch.float16, device=DEVICE, transposed=True)
assert k.stride(-1) != 1
o, _ = flash_forward(q, k, v, causal=True)
torch.testing.assert_close(o, flash_forward(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)[0])
print("non-contiguous inputs: same result")

# %% [markdown]
# ## 8. On the GPU: against notebook 04 and PyTorch (GPU only)
#
# Forward time for the shapes of the FlashAttention papers, reported as TFLOP/s by the papers' convention
# ($4 \cdot B \cdot H \cdot N^2 \cdot d$ useful FLOPs, half of that when causal): bfloat16,
# B·N = 16384 tokens, H·d = 2048, d = 64. Providers: this notebook's kernel (BLOCK_M=128, BLOCK_N=64, 4 warps,
# 3 stages), `course_lib.flash_attention` (its default launch, recorded per GPU or chosen by a rule; on a
# Hopper GPU at long N, FlashAttention-3's kernel written in Gluon, notebook 08c), notebook 04's
# `FlashAttentionTorch` (a Python loop over tiles: only up to N = 2048, it is slow) and
# `scaled_dot_product_attention` (PyTorch picks its fastest backend).
# On a CPU we show the recorded run.
#
# **Predict first.** Section 5's causal kernel skips every fully masked block. At the smallest N of the
# benchmark (1024 tokens, blocks of 128 × 64), how many times faster is this notebook's causal forward than
# its non-causal one? Count the blocks it visits, then think about what the count leaves out (the diagonal
# blocks are masked, and each program's work is shorter). Write your number in the next cell; the cell
# after it scores it against the figure.

# %%
# Your prediction: time of the non-causal forward / time of the causal forward, N = 1024, d = 64.
causal_guess = predict("causal skip speed-up of the forward at N = 1024", 2.0, unit="x")


# %%
def plot_forward_comparison(data, source):
    fig, axes = plt.subplots(1, 2, figsize=(16, 6), sharey=True, layout="constrained")
    for ax, causal in zip(axes, (False, True)):
        tflops = data["tflops"][str(causal)]
        nb, lib = max(tflops["this notebook"]), max(tflops["course_lib.flash_attention"])
        kind = "causal" if causal else "not causal"
        plot_series(
            data["N"], tflops, xlabel="sequence length N (tokens)", ylabel="forward TFLOP/s (bf16)",
            title=f"{kind}: up to {nb:.0f} (this notebook), {lib:.0f} (course_lib)", logx=True, ax=ax,
        )  # fmt: skip
        ax.set_xticks(data["N"], [f"{n // 1024}k" for n in data["N"]])
    title = f"FlashAttention-2 forward (Triton) and course_lib against PyTorch, d = {data['d']}"
    fig.suptitle(f"{title}\n{source}", fontsize=15)
    plt.show()


def measure_forward_comparison():
    from torch.nn.functional import scaled_dot_product_attention

    providers = {
        "this notebook": lambda q, k, v, c: flash_forward(q, k, v, c, block_m=128, block_n=64, num_stages=3)[
            0
        ],
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


got = records.measured_or_recorded(
    "flash_forward_compare",
    measure_forward_comparison,
    missing="No recorded GPU run yet (it is written when this notebook runs on a GPU). What to look for\n"
    "in it: how close the Triton kernels come to SDPA, how close the notebook's fixed launch comes\n"
    "to course_lib's tuned one, and how far notebook 04's PyTorch loop falls behind (every tile\n"
    "costs several kernel launches and round trips to HBM).",
)
if got:
    plot_forward_comparison(*got)
    fwd, n0 = got[0], got[0]["N"][0]
    fwd_ms = {  # time of each mode at the smallest N, from its TFLOP/s and its useful FLOPs
        c: attention_flops(fwd["tokens"] // n0, fwd["heads"], n0, n0, fwd["d"], causal=c)
        / (fwd["tflops"][str(c)]["this notebook"][0] * 1e9)
        for c in (False, True)
    }
    print(f"N = {n0}: the causal forward takes {fwd_ms[True] / fwd_ms[False]:.2f} of the non-causal one's time")
    _ = causal_guess.score(fwd_ms[False] / fwd_ms[True])

# %% [markdown]
# ## 9. Block sizes and warps (GPU only)
#
# BLOCK_M, BLOCK_N, `num_warps` and `num_stages` trade against each other: larger blocks reuse each loaded
# K/V block for more queries (fewer bytes per FLOP) but need more registers and shared memory per program, so
# fewer programs fit on an SM at once and large tiles may spill registers; more warps split a tile over more
# threads; more stages prefetch more K/V blocks ahead (more shared memory). We sweep this notebook's kernel at
# N = 4096 (bf16, d = 64, not causal). Configurations that do not fit are reported as such.

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
    _, ax = plt.subplots(figsize=(10, 0.35 * len(ok) + 2), layout="constrained")
    bar_chart(
        [name for _, name in ok], [t for t, _ in ok], horizontal=True, fmt="{:.0f}", ax=ax,
        xlabel="forward TFLOP/s (bf16, d = 64, not causal)", ylabel="BLOCK_M x BLOCK_N, warps, stages",
        title=f"N = {data['N']}: the best configuration is {ok[0][0] / ok[-1][0]:.1f}x the worst\n{source}",
    )  # fmt: skip
    plt.show()
    if failed:
        print("did not fit (BLOCK_M, BLOCK_N, warps, stages):", failed)


def measure_block_sweep():
    n = 4096
    q, k, v = random_qkv(
        (BENCH_TOKENS // n, 2048 // BENCH_D, n, BENCH_D), dtype=torch.bfloat16, device=DEVICE
    )
    flops = attention_flops(BENCH_TOKENS // n, 2048 // BENCH_D, n, n, BENCH_D)
    data = {"N": n, "configs": SWEEP, "tflops": []}
    for bm, bn, w, s in SWEEP:
        run = lambda bm=bm, bn=bn, w=w, s=s: flash_forward(
            q, k, v, block_m=bm, block_n=bn, num_warps=w, num_stages=s
        )
        try:
            data["tflops"].append(flops / benchmark(run) * 1e-9)
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
# ## 10. More exercises
#
# **Exercise 4 — back from base 2.** A program ends its loop with `m2` (the running max of the scores times
# `qk_scale`, in base-2 units) and `l` (the sum of `2**(s * qk_scale - m2)`), for a block of rows. Return the
# natural-log logsumexp L of the scaled scores `s * scale`, as the kernel stores it.


# %%
def lse_from_base2(m2, l):
    ### BEGIN SOLUTION
    return (m2 + torch.log2(l)) * math.log(2)
    ### END SOLUTION


# %% tags=["check"]
s_rows = torch.randn(4, 300, dtype=torch.float64) * 4
m2_rows = (s_rows * qk_scale).amax(dim=1)
l_rows = torch.exp2(s_rows * qk_scale - m2_rows[:, None]).sum(dim=1)
check(
    "lse_from_base2",
    lambda: lse_from_base2(m2_rows, l_rows),
    torch.logsumexp(s_rows * scale, dim=1),
    hints=[
        "In base 2, m2 + log2(l) is log2 of the sum of 2**(s * qk_scale). Convert a base-2 log to a natural "
        "log by multiplying by ln 2.",
        "(m2 + torch.log2(l)) * math.log(2)",
    ],
)

# %% [markdown]
# **Exercise 5 — which blocks can a sliding window skip?** With a sliding window of W keys, query i sees keys
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
# **Exercise 6 — a logsumexp-only kernel.** Some uses need only L (for example, to rebuild P later). Write
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
# **Exercise 7 (open).** In a causal forward, the programs of the last query blocks do the most work (they see
# the most keys). course_lib's kernel launches the query blocks in reverse order when causal. On a GPU with
# 132 SMs and more programs than SMs, why does starting the longest programs first shorten the whole run?
# Measure it with `flash_forward` by reversing `start_m` in `flash_fwd`.

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
#   `input_precision="ieee"` to avoid TF32's error; under the interpreter bfloat16 tiles are converted to
#   float32 after loading.
#
# Next, notebook 07 writes the backward pass: it rebuilds P from Q, K and L, block by block.
