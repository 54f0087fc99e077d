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
# # 09 · Decoding attention and Flash-Decoding
#
# Training and prefill push thousands of query rows through attention at once. Generating text does not:
# each step adds **one** token per sequence, and that token's query must attend to every key the sequence
# has produced so far, kept in a **KV cache**. This notebook is about that step.
#
# **Learning goals**
# 1. Place decoding on the roofline: one query row against an N-token cache does about G FLOPs per byte
#    (G = query heads per kv head), far below any GPU's ridge point, so attention's time is the bytes of the
#    cache divided by the bandwidth, and a whole step's is (weights + B · cache) / bandwidth. Predict it,
#    then compare with a measurement.
# 2. Keep a KV cache in PyTorch, tell prefill from decode, and align the causal mask **bottom-right** when a
#    few new tokens (speculative verification, a chunk of a prompt) attend to a longer cache.
# 3. Build **split-KV** decoding (Flash-Decoding) from notebook 03's merge: you write the kernel's split
#    range and its partial (O, L), then the combine that merges the partials.
# 4. Pack the query heads that share a kv head into the rows of one tile (**GQA packing**), so the cache is
#    read once per kv head.
# 5. Choose the number of splits from the SM count (FlashAttention-2's rule) and compare with a measured curve.
#
# The finished pieces live in `course_lib.decode`: `decode_attention`, `decode_reference`, `combine`,
# `heuristics.choose_num_splits`; the benchmark is `course_lib.bench.decode`.

# %% [markdown]
# ## 0. Sizes
#
# One cell sets every size. On the CPU the kernels run in Triton's interpreter, so the cache is a few
# hundred tokens; on a GPU it is the benchmark's shape (32 query heads over 8 kv heads, d = 128).

# %%
import math

import matplotlib.pyplot as plt
import numpy as np
import torch

import course_lib
from course_lib import pdl, records
from course_lib.attention.blocks import LN2
from course_lib.attention.merge import merge_attention_states, merge_many
from course_lib.decode import decode_attention, decode_reference, heuristics
from course_lib.decode.combine import combine
from course_lib.decode.heuristics import choose_num_splits, sm_count, tile_for, wave_efficiency
from course_lib.exercises import check, check_cases, guarded_empty, predict, time_kernels
from course_lib.perf import plotting
from course_lib.perf.hardware import gpu as gpu_spec
from course_lib.runtime import tl, triton

B, N, HQ, HKV, D = course_lib.pick(cpu=(3, 256, 8, 2, 64), gpu=(8, 8192, 32, 8, 128))
DTYPE = course_lib.pick(cpu=torch.float32, gpu=torch.bfloat16)
DEV = course_lib.DEVICE
G = HQ // HKV  # query heads per kv head
torch.manual_seed(0)
plotting.use_readable_defaults()  # projector-sized fonts for every figure, plt's own included
print(f"B={B} sequences, cache of N={N} tokens, {HQ} query heads over {HKV} kv heads, d={D}, {DTYPE}")

# %% [markdown]
# ## 1. Why decoding is different: a roofline reading
#
# One decoding step of one sequence, per layer: the new token's query, Hq heads of d numbers, meets the
# cache's N keys and N values of Hkv heads. The work is two matrix-vector products per query head,
# 2·N·d FLOPs each; the bytes are the whole cache, read once:
#
# $$\text{FLOPs} = 4\,N\,d\,H_q, \qquad \text{bytes} = 2\,N\,d\,H_{kv}\cdot 2 \;(\text{bf16}), \qquad
# \frac{\text{FLOPs}}{\text{byte}} = \frac{H_q}{H_{kv}} = G.$$
#
# A GPU needs hundreds of FLOPs per byte to be compute-bound (its ridge point: peak FLOP/s ÷ bandwidth).

# %%
h200 = gpu_spec("H200")
ridge = h200.matmul16_tflops * 1e12 / (h200.hbm_gbps * 1e9)
for g in (1, 4, 8):
    print(f"G = {g}: {g} FLOP/byte, {ridge / g:.0f}x below the H200's ridge point of {ridge:.0f} FLOP/byte")
assert ridge > 8 * 8  # decoding at G <= 8 sits deep in the memory-bound region

# %% [markdown]
# So attention's share of a decoding step is the bytes of its cache over the bandwidth. It is not the whole
# step: every step also runs the model's matrix products, and those read **every weight** once, whatever the
# batch. For a model the size of Llama-3-8B (8.0 B parameters, 32 layers, 8 kv heads, d = 128, bf16) one
# step of a batch of B sequences of N cached tokens reads about
#
# $$\text{bytes} \approx \underbrace{2 \cdot 8.0\cdot 10^{9}}_{\text{weights}} + B \cdot
# \underbrace{2 \cdot N \cdot 32 \cdot 8 \cdot 128 \cdot 2}_{\text{KV cache of one sequence}}, \qquad
# \text{step time} \approx \frac{\text{bytes}}{\text{bandwidth}},$$
#
# as long as the weights' matrix products stay memory-bound (their FLOPs per byte grow with B: about B, so
# up to a batch of a couple of hundred on an H200, section 1's ridge point).


# %%
def kv_bytes_read_per_step(n_tokens, layers=32, kv_heads=8, head_dim=128, bytes_per_element=2):
    """Bytes of K and V one decoding step reads for one sequence of n_tokens."""
    return 2 * n_tokens * layers * kv_heads * head_dim * bytes_per_element


WEIGHT_BYTES = 8.03e9 * 2  # Llama-3-8B's parameters in bf16, read once per step
decode_rec = records.load_record("decode")
hw_rec = records.load_record("hardware")
if decode_rec:
    read_gbps, source = decode_rec["data"]["ceilings"]["read_gbps"], "measured read ceiling"
elif hw_rec:
    read_gbps, source = hw_rec["data"]["read_gbps"], "measured read ceiling"
else:
    read_gbps, source = h200.hbm_gbps, "datasheet bandwidth"
print(f"batch 1, at the H200's {source} of {read_gbps:.0f} GB/s:")
for n in (1024, 32768, 131072):
    kv = kv_bytes_read_per_step(n)
    print(f"context {n:>6}: KV cache {kv / 2**30:5.2f} GiB + weights {WEIGHT_BYTES / 2**30:5.2f} GiB -> "
          f"{(kv + WEIGHT_BYTES) / (read_gbps * 1e9) * 1e3:5.2f} ms per step; the cache is "
          f"{kv / (kv + WEIGHT_BYTES):4.0%} of the bytes")  # fmt: skip
assert 0.2 < kv_bytes_read_per_step(32768) / (kv_bytes_read_per_step(32768) + WEIGHT_BYTES) < 0.22

# %% [markdown]
# At batch 1 the weights dominate until the context is long. A larger batch reads the weights once for all
# its sequences, and only the caches grow with B. So the time per generated token, step time ÷ B, falls
# with the batch until the caches take over: this is why serving batches requests (notebook 10), and why
# the caches' bytes decide the batch that fits (the figure greys out the batches whose caches do not fit
# beside the weights in the H200's 141 GB). Nothing here is measured; it is the formula above.

# %%
batches = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256])
fits = h200.hbm_gb * 1e9 - WEIGHT_BYTES  # bytes left for KV caches
fig, axes = plt.subplots(1, 2, figsize=(9.0, 4.6), layout="constrained")
for n_ctx, color in ((1024, "tab:blue"), (8192, "tab:orange"), (32768, "tab:red")):
    step_ms = (WEIGHT_BYTES + batches * kv_bytes_read_per_step(n_ctx)) / (read_gbps * 1e9) * 1e3
    ok = batches * kv_bytes_read_per_step(n_ctx) <= fits
    for ax, y in ((axes[0], step_ms), (axes[1], step_ms / batches)):
        ax.plot(batches[ok], y[ok], "o-", color=color, label=f"N = {n_ctx // 1024}k tokens")
        ax.plot(batches[~ok], y[~ok], "o", color=color, alpha=0.2)
weights_ms = WEIGHT_BYTES / (read_gbps * 1e9) * 1e3
axes[0].axhline(weights_ms, color="k", lw=0.8, ls="--", label="the weights alone")
axes[0].set_ylabel("time per step (ms)")
axes[0].set_title("Step time ≈ (weights + B·KV(N)) / bandwidth", fontsize=11)
axes[1].set_ylabel("time per generated token (ms)")
axes[1].set_title("Per token, batching amortises the weights", fontsize=11)
for ax in axes:
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch B (sequences)")
fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=4, fontsize=11)
fig.suptitle(
    f"A Llama-3-8B-sized model decoding at {read_gbps:.0f} GB/s\n(faint: the caches do not fit in 141 GB)"
)
plt.show()

# %% [markdown]
# The rest of this notebook is about the attention part of that step, the B·KV(N) bytes: reading them at
# the full bandwidth. FlashAttention-2's training forward (notebook 06's kernel) launches one program per
# (batch, head, block of 128 query rows). With one query row per sequence, batch 1 and 32 heads give 32
# programs — and a GPU of 132 SMs wants several per SM to hide memory latency. Most of the chip would wait.
# (The flash-attn library itself has had a split-KV path for decoding since v2.2, `flash_attn_with_kvcache`;
# the rest of this notebook builds that path.)

# %%
sms = h200.sms
for batch in (1, 8, 64):
    programs = batch * 32
    print(f"batch {batch:>2}: {programs:>4} programs of one query row each on {sms} SMs "
          f"({min(programs, sms) / sms:.0%} of the SMs busy)")  # fmt: skip

# %% [markdown]
# ## 2. A KV cache in PyTorch: prefill, then decode
#
# A cache is two tensors (B, Nmax, Hkv, d) and the number of valid tokens per sequence. **Prefill** runs the
# prompt's tokens through attention at once (causal over themselves) and stores their K and V; each
# **decode** step appends one token's K and V and attends with its one query. The layout
# (B, N, H, d) — tokens before heads — lets a step write its new row with one indexed store.


# %%
class KVCache:
    """K and V of B sequences, (B, n_max, Hkv, d), and their lengths: append, then read."""

    def __init__(self, batch, n_max, kv_heads, head_dim, dtype=DTYPE, device=DEV):
        self.k = torch.zeros(batch, n_max, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.seqlens = torch.zeros(batch, dtype=torch.int32, device=device)

    def append(self, k_new, v_new):
        """Store k_new, v_new (B, T, Hkv, d) after each sequence's last token (same T for all here)."""
        T = k_new.shape[1]
        pos = self.seqlens[:, None].long() + torch.arange(T, device=k_new.device)[None, :]  # (B, T)
        rows = torch.arange(k_new.shape[0], device=k_new.device)[:, None]
        self.k[rows, pos] = k_new
        self.v[rows, pos] = v_new
        self.seqlens += T


prompt = N // 2
ks = torch.randn(B, N, HKV, D, device=DEV, dtype=DTYPE)  # the keys and values a model would produce
vs = torch.randn(B, N, HKV, D, device=DEV, dtype=DTYPE)
qs = torch.randn(B, N, HQ, D, device=DEV, dtype=DTYPE)
cache = KVCache(B, N, HKV, D)
cache.append(ks[:, :prompt], vs[:, :prompt])  # prefill: the prompt's K and V
outs = []
for t in range(prompt, prompt + 4):  # four decode steps
    cache.append(ks[:, t : t + 1], vs[:, t : t + 1])
    outs.append(decode_attention(qs[:, t : t + 1], cache.k, cache.v, cache.seqlens))
print("after 4 decode steps the cache holds", cache.seqlens.tolist(), "tokens per sequence")

# %% [markdown]
# Each decode step must equal the last row of ordinary causal attention over the whole sequence so far,
# which is the last query attending to every key up to itself. The float64 reference from notebook 02
# checks it, with each kv head repeated for its G query heads:

# %%
t = prompt + 3
ref = course_lib.attention_reference(
    qs[:, t : t + 1].double().transpose(1, 2),  # the last query, (B, Hq, 1, d)
    ks[:, : t + 1].double().repeat_interleave(G, 2).transpose(1, 2),  # keys 0..t, (B, Hq, t + 1, d)
    vs[:, : t + 1].double().repeat_interleave(G, 2).transpose(1, 2),
)[:, :, 0]  # (B, Hq, d)
err = (outs[-1][:, 0].double().cpu() - ref.cpu()).abs().max().item()
print(f"max |decode step - full causal attention| = {err:.2e}")
assert err < course_lib.pick(cpu=1e-4, gpu=3e-2)

# %% [markdown]
# ### Bottom-right alignment
#
# With Tq > 1 new tokens (a speculative draft of a few tokens to verify, or a prompt fed in chunks), the new
# queries are the **last** Tq positions of a sequence of n tokens. Query t may see keys j ≤ n − Tq + t:
# the diagonal of the mask ends in the bottom-right corner. The top-left convention of notebook 02
# (j ≤ t) would let the first new token see only the first key.


# %%
def draw_mask(ax, tq, n, bottom_right):
    t = np.arange(tq)[:, None]
    j = np.arange(n)[None, :]
    visible = j <= (n - tq + t if bottom_right else t)
    ax.imshow(visible, cmap="Greens", vmin=0, vmax=1.3)
    ax.set_xlabel("key j")
    ax.set_ylabel("new query t")
    ax.set_title(("bottom-right: j ≤ n − Tq + t" if bottom_right else "top-left: j ≤ t"), fontsize=11)


fig, axes = plt.subplots(1, 2, figsize=(9.0, 2.6), layout="constrained")
draw_mask(axes[0], 3, 10, False)
draw_mask(axes[1], 3, 10, True)
fig.suptitle("3 new tokens against a cache of 10: only bottom-right lets them see their past")
plt.show()

# %% [markdown]
# `decode_attention(..., causal=True)` uses the bottom-right alignment. Three new tokens at once give the
# same rows as three single-token steps would:

# %%
seq3 = torch.full((B,), t + 1, dtype=torch.int32, device=DEV)
three = decode_attention(qs[:, t - 2 : t + 1], cache.k, cache.v, seq3)  # (B, 3, Hq, d)
one_by_one = torch.stack(outs[1:], 1)[:, :, 0]  # the decode steps t-2, t-1, t
torch.testing.assert_close(three, one_by_one, atol=course_lib.pick(cpu=1e-5, gpu=2e-2), rtol=0)
print("3 tokens in one call == 3 single-token steps")

# %% [markdown]
# ## 3. Split-KV, built from notebook 03's merge
#
# To give the GPU more programs, split the cache along the keys. Program s reduces slice s to a **partial
# result**: O_s, attention normalised over the slice's keys only, and L_s, the logsumexp of its scores.
# Notebook 03 merged softmax states (m, l); the same merge written on (O, L) is
#
# $$L = \log\big(e^{L_a} + e^{L_b}\big), \qquad O = e^{L_a - L}\,O_a + e^{L_b - L}\,O_b,$$
#
# exact in any order, with an empty slice as (0, −∞). First in float64 PyTorch, one sequence, one head:

# %%
n = int(cache.seqlens[0])
q1 = qs[0, n - 1, 0].double().cpu()  # the last token's query, head 0
k1, v1 = ks[0, :n, 0].double().cpu(), vs[0, :n, 0].double().cpu()


def partial_attention(q, k, v):
    """(O, L) of one query over the keys k, v (n_keys, d); (0, -inf) for no key."""
    if k.shape[0] == 0:
        return torch.zeros_like(q), torch.tensor(float("-inf"), dtype=q.dtype)
    s = (k @ q) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(s, 0)
    return torch.exp(s - lse) @ v, lse


S = 4
bounds = [round(i * n / S) for i in range(S + 1)]
parts = [partial_attention(q1, k1[a:b], v1[a:b]) for a, b in zip(bounds, bounds[1:])]
o_full, lse_full = partial_attention(q1, k1, v1)
o_two, lse_two = merge_attention_states(parts[0][0][None], parts[0][1][None], parts[1][0][None], parts[1][1][None])
torch.testing.assert_close(o_two[0], partial_attention(q1, k1[: bounds[2]], v1[: bounds[2]])[0])  # two slices
o_all, lse_all = merge_many(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), dim=0)
torch.testing.assert_close(o_all, o_full)
print(f"{S} slices of {[b - a for a, b in zip(bounds, bounds[1:])]} keys merge to the full result; "
      f"L = {lse_all.item():.4f} (full: {lse_full.item():.4f})")  # fmt: skip

# %% [markdown]
# ### The splits as a picture
#
# The kernel does exactly this with one program per (sequence, kv head, split). Each program walks its own
# slice one block of BLOCK_N keys at a time (online softmax inside the slice, as in notebook 06); all
# splits run at once. Below, one sequence's cache in blocks, step by step: the blocks lit at each step are
# the ones being read, and the last panel is the merge of the S partials.


# %%
def draw_split_step(ax, n_blocks, splits, step):
    per = math.ceil(n_blocks / splits)
    colors = plt.cm.tab10(np.arange(splits) % 10)
    for blk in range(n_blocks):
        s = blk // per
        done = blk - s * per < step
        ax.add_patch(plt.Rectangle((blk, 0), 0.9, 0.9, color=colors[s], alpha=0.95 if done else 0.12))
    ax.set_xlim(0, n_blocks)
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_xlabel("key block")


n_blocks, splits = 16, 4
fig, axes = plt.subplots(5, 1, figsize=(9, 5.5))
for step in range(4):
    draw_split_step(axes[step], n_blocks, splits, step + 1)
    axes[step].set_title(f"step {step + 1}: each of the {splits} programs has read {step + 1} block(s)", fontsize=10)
draw_split_step(axes[4], n_blocks, splits, 4)
axes[4].set_title("merge: L = log Σ exp(L_s), O = Σ exp(L_s − L) O_s  (combine kernel)", fontsize=10)
fig.suptitle("Split-KV: 4 programs read a 16-block cache in 4 steps instead of 16")
plt.tight_layout()
plt.show()

# %% [markdown]
# ### Exercise: the split-KV kernel
#
# Now the kernel, written by you. One program per (sequence, kv head, split): grid (B·Hkv, S). Split s of a
# sequence of n keys covers the key blocks [s·P, (s+1)·P), P = ⌈⌈n / BLOCK_N⌉ / S⌉ blocks per split, the
# last one cut at n. The program computes its range **inside** the kernel from the length it loads, so a
# ragged batch is split per sequence, and the grid depends on the shapes only: no length is read on the
# host. That is what lets a serving engine record a decoding step once as a **CUDA graph** (a recorded
# sequence of kernel launches that the GPU replays with one call, without Python or per-launch costs) and
# replay it at every step whatever the lengths.
#
# The tile's rows are the G query heads that share the program's kv head (**GQA packing**, section 4 says
# why): row r is query head kvh·G + r, padded to BLOCK_M ≥ 16 rows. The loop over the split's blocks is
# notebook 06's online softmax in base 2 (m_i, l_i, acc), given. You write the two pieces that make it
# split-KV:
#
# 1. **the split's range** `[lo, hi)` in keys: `per_split` blocks each, `lo = split · per_split · BLOCK_N`,
#    `hi` the end of the split's blocks or the sequence's length, whichever comes first. A split past the
#    sequence's end gets `lo ≥ hi`: its loop does not run.
# 2. **the partial's store**: O_s = acc / l_i and L_s = (m_i + log₂ l_i) · ln 2 (the natural-log logsumexp
#    of the split's scores; the loop works in base 2), stored at `O_PART[split, b, h, :]` and
#    `L_PART[split, b, h]` for the tile's real rows only. A split that saw no key has l_i = 0: it must
#    store (0, −∞), the merge's identity, and no NaN.
#
# The launcher and the check are given. The check merges your partials with course_lib's merge (section 3's
# `merge_many`; you write the combine next) and compares the result with float64 attention, over ragged
# lengths that are multiples of neither the block nor the split count, empty sequences, more splits than
# blocks, and several GQA group sizes. Every store needs its mask (the tile has padding rows): the check
# also looks past the end of the outputs for a stray store.

# %%
@triton.jit
def my_split_kv_kernel(
    Q, K, V, SEQLENS, O_PART, L_PART, qk_scale,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_os, stride_ob, stride_oh, stride_od,
    stride_ls, stride_lb, stride_lh,
    H_KV, CAPACITY, NUM_SPLITS,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Partial (O, L) of split `tl.program_id(1)` of one (sequence, kv head). Grid (B * Hkv, NUM_SPLITS).

    Q (B, Hq, d): one new token per sequence. K, V (B, CAPACITY, Hkv, d): key j of sequence b is valid for
    j < SEQLENS[b]. O_PART (S, B, Hq, d) fp32, L_PART (S, B, Hq) fp32: this split's partial result.
    qk_scale = softmax scale x log2(e): the scores go straight into base 2."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid_bh // H_KV).to(tl.int64)
    kvh = (pid_bh % H_KV).to(tl.int64)
    seqlen = tl.minimum(tl.load(SEQLENS + b), CAPACITY)  # the clamp keeps every read inside the cache

    # Rows of the tile: the GROUP query heads of kv head kvh, padded to BLOCK_M rows (GQA packing).
    rows = tl.arange(0, BLOCK_M)
    h = kvh * GROUP + rows
    row_ok = rows < GROUP
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    # Q tile: HBM -> registers once, BLOCK_M x d.
    q = tl.load(
        Q + b * stride_qb + h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    # 1. This split's keys [lo, hi): whole blocks of BLOCK_N keys, cut at the sequence's length.
    ### BEGIN SOLUTION
    per_split = tl.cdiv(tl.cdiv(seqlen, BLOCK_N), NUM_SPLITS)  # P, blocks per split
    lo = split * per_split * BLOCK_N
    hi = tl.minimum(lo + per_split * BLOCK_N, seqlen)
    ### END SOLUTION

    # The running state in registers (base 2): row max m_i, row sum l_i, unnormalised output acc.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        col_ok = cols < hi
        kv_mask = col_ok[:, None] & d_ok[None, :]
        kv_rows = b * stride_kb + cols.to(tl.int64)[:, None] * stride_kn + kvh * stride_kh
        # K block: HBM -> on chip, BLOCK_N x d elements of this kv head.
        k = tl.load(K + kv_rows + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N) fp32
        s = tl.where(col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: no NaN
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
        # V block: HBM -> on chip; acc += P V in fp32.
        v_rows = b * stride_vb + cols.to(tl.int64)[:, None] * stride_vn + kvh * stride_vh
        v = tl.load(V + v_rows + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)

    # 2. The partial result: O_s = acc / l_i, L_s = (m_i + log2 l_i) * ln 2; (0, -inf) if no key was seen.
    ### BEGIN SOLUTION
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    tl.store(
        O_PART + split * stride_os + b * stride_ob + h[:, None] * stride_oh + offs_d[None, :] * stride_od,
        o,
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(L_PART + split * stride_ls + b * stride_lb + h * stride_lh, lse, mask=row_ok)
    ### END SOLUTION


# %% [markdown]
# The launcher: it allocates the partials (fp32, S × B × Hq rows), launches one program per (sequence, kv
# head, split), and here merges the partials with course_lib's `merge_many` so that the check compares
# attention with attention.


# %%
def my_split_kv_partials(q, k_cache, v_cache, cache_seqlens, num_splits, block_n=16, guard=True):
    """Your kernel's partials for q (B, 1, Hq, d) over caches (B, Nmax, Hkv, d) holding cache_seqlens[b]
    keys: o_part (S, B, Hq, d) fp32 and l_part (S, B, Hq) fp32. guard=True (the check) also catches a store
    past the end of the outputs."""
    B, _, Hq, d = q.shape
    Hkv = k_cache.shape[2]
    block_m, block_d = max(16, triton.next_power_of_2(Hq // Hkv)), triton.next_power_of_2(d)
    shapes = ((num_splits, B, Hq, d), (num_splits, B, Hq))
    if guard:  # a guard as long as a whole tile: a store without its row mask lands in it, not past it
        (o_part, o_guard), (l_part, l_guard) = (
            guarded_empty(s, torch.float32, q.device, guard=block_m * block_d) for s in shapes
        )
    else:
        o_part, l_part = (torch.empty(s, dtype=torch.float32, device=q.device) for s in shapes)
    q1 = q[:, 0]  # (B, Hq, d)
    my_split_kv_kernel[(B * Hkv, num_splits)](
        q1, k_cache, v_cache, cache_seqlens, o_part, l_part, d**-0.5 * 1.4426950408889634,
        *q1.stride(), *k_cache.stride(), *v_cache.stride(), *o_part.stride(), *l_part.stride(),
        Hkv, k_cache.shape[1], num_splits,
        GROUP=Hq // Hkv, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    if guard:
        o_guard("split-KV partials")
        l_guard("split-KV partials")
    return o_part, l_part


def decode_inputs(lengths, hq, hkv, d, q_scale=1.0, seed=0):
    """q (B, 1, hq, d), k and v caches (B, max(lengths) + 3, hkv, d) in float32 on DEV, lengths int32."""
    g = torch.Generator().manual_seed(seed)
    B, n_max = len(lengths), max(lengths) + 3  # 3 keys past the longest: never read
    q = torch.randn(B, 1, hq, d, generator=g) * q_scale
    k, v = (torch.randn(B, n_max, hkv, d, generator=g) for _ in range(2))
    return q.to(DEV), k.to(DEV), v.to(DEV), torch.tensor(lengths, dtype=torch.int32, device=DEV)


def my_split_kv_merged(lengths, hq, hkv, d, num_splits):
    """Your partials, merged by course_lib's merge: (O (B, 1, Hq, d), L (B, 1, Hq))."""
    q, k, v, lens = decode_inputs(lengths, hq, hkv, d)
    o_part, l_part = my_split_kv_partials(q, k, v, lens, num_splits)
    o, lse = merge_many(o_part, l_part, dim=0)
    return o[:, None], lse[:, None]


# %% tags=["check"]
# ragged lengths (not multiples of 16 keys nor of S), an empty sequence, more splits than blocks, G = 1 to 8
split_cases = [
    dict(lengths=(37,), hq=4, hkv=1, d=32, num_splits=1),
    dict(lengths=(37, 100), hq=4, hkv=2, d=32, num_splits=3),
    dict(lengths=(100, 5, 0), hq=8, hkv=2, d=64, num_splits=4),
    dict(lengths=(50,), hq=2, hkv=2, d=16, num_splits=7),
    dict(lengths=(130, 61), hq=8, hkv=1, d=16, num_splits=5),
]
check_cases(
    "split-KV partials",
    split_cases,
    my_split_kv_merged,
    lambda num_splits, **case: decode_reference(*decode_inputs(**case)),
    rtol=1e-4,
    atol=1e-4,
    outputs=("O", "L"),
)

# %% [markdown]
# On a GPU, your kernel next to course_lib's `decode_attention` and PyTorch's SDPA, on this notebook's
# batch (bf16, every sequence holding the whole cache, the split count of course_lib's rule; your partials
# merged by course_lib's combine kernel):

# %%
if course_lib.ON_GPU:
    q_t = torch.randn(B, 1, HQ, D, device=DEV, dtype=torch.bfloat16)
    k_t, v_t = (torch.randn(B, N, HKV, D, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    lens_t = torch.full((B,), N, dtype=torch.int32, device=DEV)
    splits_t = choose_num_splits(B * HKV, math.ceil(N / 64), sm_count())
    out_t = torch.empty_like(q_t)
    lse_t = torch.empty(B, 1, HQ, dtype=torch.float32, device=DEV)

    def yours_timed():
        o_part, l_part = my_split_kv_partials(q_t, k_t, v_t, lens_t, splits_t, block_n=64, guard=False)
        combine(o_part[:, :, None], l_part[:, :, None], out_t, lse_t)
        return out_t

    q_sdpa, k_sdpa, v_sdpa = (x.transpose(1, 2) for x in (q_t, k_t, v_t))  # (B, H, N, d) views
    _ = time_kernels(
        "split-KV partials",
        learner=yours_timed,
        course_lib=lambda: decode_attention(q_t, k_t, v_t, lens_t, validate=False),
        sdpa=lambda: torch.nn.functional.scaled_dot_product_attention(q_sdpa, k_sdpa, v_sdpa, enable_gqa=True),
        flops=4 * B * N * D * HQ,
        note=f"{splits_t} splits of blocks of 64 keys, one tile for every shape; course_lib also picks its tile and "
        "plan per shape (section 5), and launches its combine early (appendix).",
    )
else:
    print("Timing needs a GPU; on the CPU the check above is the point.")

# %% [markdown]
# ### Exercise: the combine
#
# The second kernel of a split step merges the S partials of every row: section 3's rule over S parts at
# once,
#
# $$L = \log \sum_s e^{L_s}, \qquad O = \sum_s e^{L_s - L}\, O_s.$$
#
# Write it in PyTorch for all rows at once: `my_combine(o_part, l_part)` takes o_part (S, B, Hq, d) and
# l_part (S, B, Hq) and returns O (B, Hq, d) and L (B, Hq). Two things to get right: the L_s can be large
# (the check's last case reaches about 1000, where e^{L_s} overflows even in float64: never form it
# alone), and a row that no split saw (every L_s = −∞, an empty sequence) must give (0, −∞), not NaN. The
# check hands you partials computed in float64 over uneven cuts of each sequence's keys (any partition
# merges to the same attention), so that every difference is the merge's. (course_lib's `combine` is the
# same rule as a Triton kernel, one program per row: `course_lib/decode/combine.py`.)


# %%
def my_combine(o_part, l_part):
    """Merge the partials over the splits (dim 0): (O (B, Hq, d), L (B, Hq))."""
    ### BEGIN SOLUTION
    lse = torch.logsumexp(l_part, dim=0)  # -inf where every split is empty
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w = torch.exp(l_part - safe)  # exp(L_s - L): 0 for an empty split
    return (w[..., None] * o_part).sum(0), lse
    ### END SOLUTION


# %% tags=["check"]
def float64_partials(lengths, hq, hkv, d, cuts, q_scale=1.0):
    """(o_part (S, B, Hq, d), l_part (S, B, Hq)) in float64: part s of sequence b holds its keys
    [cuts[s] * n_b, cuts[s + 1] * n_b) (any partition of the keys merges to the same attention)."""
    q, k, v, lens = decode_inputs(lengths, hq, hkv, d, q_scale)
    parts = []
    for lo_f, hi_f in zip(cuts, cuts[1:]):
        o_s, l_s = [], []
        for b, n in enumerate(lengths):
            lo, hi = round(lo_f * n), round(hi_f * n)
            one = torch.tensor([hi - lo], dtype=torch.int32)
            o, lse = decode_reference(q[b : b + 1], k[b : b + 1, lo:], v[b : b + 1, lo:], one, causal=False)
            o_s.append(o[0, 0])
            l_s.append(lse[0, 0])
        parts.append((torch.stack(o_s), torch.stack(l_s)))
    return torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts])


combine_cases = [
    dict(lengths=(40,), hq=2, hkv=1, d=16, cuts=(0, 1)),  # one part: the merge must change nothing
    dict(lengths=(40, 97), hq=4, hkv=2, d=16, cuts=(0, 0.3, 0.5, 1)),
    dict(lengths=(97, 0, 3), hq=4, hkv=1, d=32, cuts=(0, 0.25, 0.5, 0.75, 1)),  # empty rows and parts
    dict(lengths=(64, 21), hq=4, hkv=2, d=16, cuts=(0, 0.5, 1), q_scale=400.0),  # L_s near 1000
]
check_cases(
    "combine of partials",
    combine_cases,
    lambda **case: my_combine(*float64_partials(**case)),
    lambda cuts, q_scale=1.0, **case: tuple(
        x[:, 0] for x in decode_reference(*decode_inputs(**case, q_scale=q_scale), causal=False)
    ),
    rtol=1e-9,
    atol=1e-9,
    outputs=("O", "L"),
)

# %% [markdown]
# From here on, course_lib's pieces stand in: `decode_attention` runs course_lib's split kernel
# (`course_lib/decode/split_kv.py`, which also takes several new tokens per sequence, the causal mask and
# paged caches) and its `combine` kernel. Against the float64 reference, for a ragged batch (lengths 1
# and 0 included) in 5 splits:

# %%
lengths = torch.tensor(([N - 5, 1, 0, N // 3] * B)[:B], dtype=torch.int32, device=DEV)
q_new = torch.randn(B, 1, HQ, D, device=DEV, dtype=DTYPE)
ref_out, ref_lse = decode_reference(q_new, ks, vs, lengths)
out, lse = decode_attention(q_new, ks, vs, lengths, num_splits=5, return_lse=True)
err = (out.double().cpu() - ref_out).abs().max().item()
print(f"num_splits=5: max error vs float64 = {err:.1e}")
assert err < course_lib.pick(cpu=1e-4, gpu=3e-2)

# %% [markdown]
# ## 4. GQA packing: read each kv head once
#
# With G query heads per kv head, a kernel that gives each query head its own program reads every kv head's
# cache G times. Packing puts the G heads (times Tq tokens) in the **rows of one tile**: row r = t·G + g,
# padded to a power of two, at least 16 rows (the smallest `tl.dot` tile). The K block is loaded once and
# multiplied by all G query rows. The bytes differ by a factor G:

# %%
per_head = 2 * N * D * 2 * HQ  # K and V, bf16, once per query head
packed = 2 * N * D * 2 * HKV  # once per kv head
print(f"per query head: {per_head / 1e6:.1f} MB, packed: {packed / 1e6:.1f} MB per sequence and layer "
      f"({per_head // packed}x)")  # fmt: skip
rows = [f"t={r // G} g={r % G} -> head {r % G}" for r in range(min(G, 4))]
print("tile rows of kv head 0:", rows, "... padded to", max(16, 1 << (G - 1).bit_length()))

# %% [markdown]
# ## 5. Choosing the number of splits
#
# More splits fill more SMs but write more partials, and a grid that does not divide evenly into **waves**
# (one program per SM at a time) leaves a tail. FlashAttention-2's rule, which `heuristics.choose_num_splits`
# follows: no split when batch × kv heads already fills 80 % of the SMs, nor for a cache of 4 key blocks or
# fewer; otherwise the fewest splits whose **wave efficiency**, programs ÷ (SMs × ⌈programs ÷ SMs⌉), is at
# least 85 % of the best count's (from 1 to min(128, SMs, blocks)), skipping a count whose blocks per split
# equal the previous count's (it adds programs, not shorter ones). For the H200's 132 SMs, with the
# contiguous kernel's blocks of `BLOCK_N` keys (128 at d = 128):

# %%
BLOCK_N = tile_for(128).block_n  # keys per block of the contiguous kernel at d = 128
for batch, n_ctx in ((1, 1024), (1, 32768), (8, 8192), (16, 32768), (64, 4096)):
    s = choose_num_splits(batch * 8, math.ceil(n_ctx / BLOCK_N), 132)
    eff = wave_efficiency(batch * 8 * s, 132)
    print(f"batch {batch:>2}, {n_ctx:>6} tokens: {s:>2} splits -> {batch * 8 * s:>4} programs, "
          f"wave efficiency {eff:.2f}")  # fmt: skip
assert choose_num_splits(64 * 8, 64, 132) == 1

# %% [markdown]
# The measured curve. On a GPU this cell measures a few split counts now; on the CPU it shows the
# recorded run of `python -m course_lib.bench.decode` (the interpreter's timings would measure Python).
#
# **Predict first.** One sequence with 32768 tokens in its cache, one layer of 32 query heads over 8 K/V
# heads, d = 128, bf16: with the best number of splits, how many microseconds does a decoding step take?
# Reason from two parts. The bytes the step must read, over section 1's read ceiling, are a floor. On top
# of it comes what does not shrink with the cache: two kernels in a row (the splits, then the combine),
# the first loads' wait for memory, the last programs running while other SMs idle. Type your estimate in
# place of the value in the next cell; the cell after it scores it against the fastest point of the curve
# (CUDA-graph replays, so the CPU's launch costs are not in it; the vertical lines are the rule's count
# and course_lib's, appendix A).

# %%
# Your prediction: µs per decoding step (batch 1, 32k tokens, 32/8 heads, d = 128, bf16), best split count.
decode_guess = predict("decode step at 32k tokens (one layer)", 38.0, unit=" µs")

# %%
if course_lib.ON_GPU:
    from course_lib.perf.timing import graph_ms

    n_ctx = 32768
    qb = torch.randn(1, 1, 32, 128, device=DEV, dtype=torch.bfloat16)
    kb = torch.randn(1, n_ctx, 8, 128, device=DEV, dtype=torch.bfloat16)
    vb = torch.randn_like(kb)
    lb = torch.full((1,), n_ctx, dtype=torch.int32, device=DEV)
    curve = []
    for s in (1, 2, 4, 8, 16, 32, 64):
        # CUDA-graph replays, as the record's curve: plain launches at batch 1 time the CPU's launches
        ms = graph_ms(lambda s=s: decode_attention(qb, kb, vb, lb, num_splits=s, validate=False))
        curve.append({"num_splits": s, "graph_ms": ms})
    source = "measured now on " + torch.cuda.get_device_name(DEV) + " (CUDA-graph replays)"
elif decode_rec and decode_rec["data"].get("split_curve"):
    curve, source = decode_rec["data"]["split_curve"], records.label(decode_rec)
else:
    curve = None
    print("No recorded GPU run of the decode benchmark yet: on a GPU this plot shows time per step falling "
          "as splits fill the SMs, then flattening or rising once the partials cost more than they save.")  # fmt: skip
if curve:
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["num_splits"] for r in curve], [r["graph_ms"] * 1e3 for r in curve], "o-", label="measured")
    if "predicted_ms" in curve[0]:
        predicted = [r["predicted_ms"] * 1e3 for r in curve]
        ax.plot([r["num_splits"] for r in curve], predicted, "--", label="predicted: bytes / read ceiling / SM fill")
    sms = heuristics.sm_count() if course_lib.ON_GPU else 132  # the GPU measured now, or the record's H200
    chosen = choose_num_splits(8, math.ceil(32768 / BLOCK_N), sms)
    filled = heuristics.fill_wave(chosen, 8, math.ceil(32768 / BLOCK_N), sms)
    ax.axvline(chosen, color="g", lw=1, label=f"the rule (choose_num_splits): {chosen} splits")
    ax.axvline(filled, color="m", lw=1, ls=":", label=f"the wave filled: {filled} splits")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("number of splits")
    ax.set_ylabel("time per step (µs)")
    ax.set_title(f"Batch 1, 32k tokens, 32/8 heads, d=128: time by split count\n{source}", fontsize=10)
    ax.legend()
    plt.show()
    best = min(curve, key=lambda r: r["graph_ms"])
    at_ceiling_us = 2 * 32768 * 8 * 128 * 2 / (read_gbps * 1e9) * 1e6
    print(f"fastest: {best['graph_ms'] * 1e3:.1f} µs with {best['num_splits']} splits; the bytes at "
          f"section 1's {read_gbps:.0f} GB/s would take {at_ceiling_us:.1f} µs")  # fmt: skip
    _ = decode_guess.score(best["graph_ms"] * 1e3)

# %% [markdown]
# ### The floor at each size
#
# The read ceiling is measured on a read of 1 GiB. A smaller read need not reach it: its first loads wait
# a whole memory latency before any byte arrives, and at its end the last programs run while other SMs
# already idle; neither cost shrinks with the size. (Nor would the write-back of a timer's dirty L2 lines,
# which is why `timing.benchmark` flushes the L2 with a read: notebook 08, section 1.4.) A decode step
# over a cache of a few hundred MB cannot beat a plain read of the same bytes, so the benchmark times one
# next to every cell (`perf.measure_read_time`, a CUDA-graph replay of the read kernel).
#
# **Predict.** What fraction of the ceiling does a read of 268 MB reach (one layer's KV cache of batch 8 at
# 8k tokens)? At the ceiling it would take about 60 µs; weigh against that a memory latency of about a
# microsecond at the start and a ragged end of a few microseconds. Type your estimate, a fraction such as
# 0.5, in place of the value.

# %%
size_guess = predict("fraction of the read ceiling a 268 MB read reaches", 0.9, "")
if course_lib.ON_GPU:
    from course_lib import perf

    live_ceiling = perf.measure_read_bandwidth(dtype=torch.bfloat16)
    read_by_size = [(mb, perf.measure_read_time(mb * 10**6)) for mb in (4, 34, 134, 268, 537, 1074, 2147)]
    floor_source = f"measured now, against the read ceiling measured now ({live_ceiling:.0f} GB/s)"
elif decode_rec and any("read_same_size_ms" in c for c in decode_rec["data"]["cells"]):
    live_ceiling = read_gbps
    read_by_size = sorted(
        {(c["kv_bytes"] / 1e6, c["read_same_size_ms"]) for c in decode_rec["data"]["cells"] if "read_same_size_ms" in c}
    )
    floor_source = f"from the recorded run ({records.label(decode_rec)})"
else:
    live_ceiling, read_by_size, floor_source = read_gbps, [], "no GPU here and no recorded same-size reads yet"
print(f"reads of each size, {floor_source}:")
for mb, ms in read_by_size:
    fraction = mb * 1e6 / (ms * 1e-3) / 1e9 / live_ceiling
    print(f"  {mb:7.0f} MB: {ms * 1e3:8.1f} µs = {fraction:5.0%} of the read ceiling")
near_268 = [mb * 1e6 / (ms * 1e-3) / 1e9 / live_ceiling for mb, ms in read_by_size if 200 <= mb <= 300]
if near_268:
    _ = size_guess.score(near_268[0])

# %% [markdown]
# The whole benchmark is in `notes/decoding.md` and the record `decode`: every cell against PyTorch's SDPA
# (whose fastest backend on the H200 is **cuDNN**, NVIDIA's library of deep-learning kernels), plainly and
# as CUDA-graph replays, in GB/s, as a fraction of the read ceiling and against a read of the same size:

# %%
if decode_rec:
    from course_lib.bench.decode import format_table

    print(records.label(decode_rec))
    print(format_table(decode_rec["data"]))
else:
    print("No recorded GPU run of the decode benchmark yet (python -m course_lib.bench.decode on a GPU).")

# %% [markdown]
# ## Exercises
#
# Each exercise has a cell to fill in and a check cell after it. Later cells never use your answers.
#
# **Exercise 1 (bytes).** A model with 80 layers, 8 kv heads, d = 128, bf16 generates for a batch of 16
# sequences of 8192 tokens each. How many bytes of KV cache does one decoding step read, and how many
# milliseconds does it take at 4000 GB/s? Return `(bytes, ms)`.


# %%
def step_bytes_and_ms(layers, kv_heads, head_dim, batch, n_tokens, gbps, bytes_per_element=2):
    ### BEGIN SOLUTION
    nbytes = 2 * layers * kv_heads * head_dim * bytes_per_element * batch * n_tokens
    return nbytes, nbytes / (gbps * 1e9) * 1e3
    ### END SOLUTION


# %% tags=["check"]
check(
    "bytes per decoding step",
    lambda: [step_bytes_and_ms(80, 8, 128, 16, 8192, 4000), step_bytes_and_ms(32, 8, 128, 4, 4096, 3000, 4)],
    [(42_949_672_960, 10.73741824), (4_294_967_296, 4_294_967_296 / 3e9)],
)

# %% [markdown]
# **Exercise 2 (the split choice).** Write `my_num_splits(programs, n_key_blocks, num_sms)` following the rule
# in section 5 (1 when programs ≥ 0.8 × SMs or n_key_blocks ≤ 4; otherwise the fewest splits up to
# min(128, SMs, blocks) whose wave efficiency is ≥ 0.85 × the best, skipping a count whose blocks per split
# equal the previous count's; "the best" is over every count from 1 to that limit, the skipped ones
# included, as in course_lib's `choose_num_splits`).


# %%
def my_num_splits(programs, n_key_blocks, num_sms):
    ### BEGIN SOLUTION
    if n_key_blocks <= 4 or programs >= 0.8 * num_sms:
        return 1
    limit = min(128, num_sms, n_key_blocks)
    eff = [wave_efficiency(programs * s, num_sms) for s in range(1, limit + 1)]
    for s in range(1, limit + 1):
        if s > 1 and math.ceil(n_key_blocks / s) == math.ceil(n_key_blocks / (s - 1)):
            continue
        if eff[s - 1] >= 0.85 * max(eff):
            return s
    return 1
    ### END SOLUTION


# %% tags=["check"]
_cases = [(8, 512, 132), (1, 2048, 132), (32, 64, 108), (16, 16, 132), (128, 512, 132), (4, 3, 132)]
_cases += [(1, 4, 132), (2, 8, 132), (64, 16, 80)]  # the edges: 4 blocks, blocks below the SMs, 80 % exactly
_cases += [(1, 1024, 200)]  # the cap of 128 splits binds (without it: 171)
check(
    "split choice",
    lambda: [my_num_splits(*c) for c in _cases],
    [choose_num_splits(*c) for c in _cases],
)

# %% [markdown]
# ## Summary
#
# - Attention in a decoding step does about G = Hq / Hkv FLOPs per byte of KV cache: memory-bound, so its
#   time is the cache's bytes over the read bandwidth. The whole step also reads every weight once:
#   step time ≈ (weights + B·KV(N)) / bandwidth. A Llama-3-8B-sized model at batch 1 and 32k tokens reads
#   4 GiB of cache and 15 GiB of weights per token; batching shares the weights' read among B sequences.
# - A KV cache is (B, Nmax, Hkv, d) plus lengths; prefill fills it with many tokens, decode appends one.
#   New tokens at the end of a sequence use the **bottom-right** causal alignment j ≤ n − Tq + t.
# - **Split-KV** gives each (sequence, kv head, split) a program that writes a partial (O, L); the merge of
#   notebook 03, L = log Σ exp(L_s), O = Σ exp(L_s − L) O_s, combines them exactly.
# - **GQA packing** puts the G query heads of a kv head in one tile's rows: the cache is read once, not G times.
# - FlashAttention-2's split rule fills the SMs with the fewest splits of good wave efficiency; each program
#   finds its split's keys from the length it loads, so the grid depends on shapes only and a decoding step
#   can be captured once as a CUDA graph and replayed. (How course_lib goes further, for ragged batches
#   among others: the appendix.)
# - `course_lib.flash_attention` does the same for you: on a GPU, a call with a few query rows over a long
#   K/V (a model's decoding step, through the transformers integration of notebook 08b too) runs this
#   split-KV kernel instead of FlashAttention-2's forward (`course_lib/attention/decode_route.py` says
#   from which sizes, and what it measured).
#
# Next, notebook 10 stores the cache in pages (PagedAttention) and serves many requests at once.

# %% [markdown]
# ## Appendix (optional): how course_lib tunes the split plan
#
# Nothing later in the course needs this appendix. It is how course_lib's `decode_attention` goes past
# section 5's rule, and what each step measured on an H200: read it if you want to tune a decoding kernel
# yourself. The figures are in `course_lib/decode/heuristics.py` and `notes/decoding.md`.
#
# ### A.1 Filling the wave, and the tile
#
# The rule stops at the *first* count that reaches 85 % of the best. At batch 1 with 32k tokens that is 15
# splits: 120 programs, one per SM, and 12 SMs idle. When the rule's grid fits in one wave anyway, course_lib
# takes one more step, `heuristics.fill_wave`: as many splits as still fit in that wave, each a little
# shorter, so the wave ends sooner (and never a count whose last splits would get no keys: a grid with room
# for 33 splits of 1024 blocks would give each ⌈1024 / 33⌉ = 32, and 32 splits would hold them all, leaving
# the 33rd empty; it takes 32). Measured on an H200, the filled count was as fast or faster in every cell
# where it differs from the rule's (the figures are in the docstring of `course_lib/decode/heuristics.py`);
# the recorded curve of section 5 marks both counts.
#
# A grid of one wave that fills at least 80 % of the SMs (filled in this way, or unsplit) may also run on a
# tile of its own, `heuristics.ONE_WAVE_TILES`: 64-key blocks and 4 warps, a 96 KB pipeline in
# place of the usual 192 KB and 8 warps. Measured on an H100, it streamed slightly faster there; on an
# H200 it was clearly slower (the figures are beside it in `heuristics.py`); with two waves or more it did
# not win on either. The two GPUs have the same 132 SMs, but the H200 has 1.4x the memory bandwidth, so
# each of its SMs must pull 1.4x the bytes per second. The choice therefore follows the GPU's peak
# bandwidth per SM (`heuristics.peak_gbps_per_sm`, from its memory clock and bus width): the tile is taken
# below `heuristics.ONE_WAVE_MAX_GBPS_PER_SM`, a line drawn between the two GPUs measured. Why the shorter
# pipeline wins on one and loses on the other was not established: a question for a profiler with hardware
# counters. A tuning rule learned on one GPU is a hypothesis on the next.
#
# The same arithmetic picks the tile when the programs are many and unsplit. Batch 64 with 8 kv heads is
# 512 programs: 3.88 waves of the contiguous tile (one program per SM), so the fourth wave streams on 88 %
# of the SMs after the others are done. On the paged kernel's tile (four programs per SM, 528 slots) the
# same 512 programs are a single wave that starts at once. `heuristics.tile_for` takes that tile for a
# contiguous grid of a few waves whose last wave is less than `LAST_WAVE_MIN` (90 %) full.

# %%
for batch, n_ctx in ((1, 1024), (1, 32768), (2, 4096), (8, 8192)):
    n_blocks = math.ceil(n_ctx / BLOCK_N)
    rule = choose_num_splits(batch * 8, n_blocks, 132)
    filled = heuristics.fill_wave(rule, batch * 8, n_blocks, 132)
    print(f"batch {batch}, {n_ctx:>6} tokens: the rule {rule:>2} splits, filled {filled:>2} "
          f"({batch * 8 * filled} of 132 SMs)")  # fmt: skip
assert heuristics.fill_wave(choose_num_splits(8, 256, 132), 8, 256, 132) == 16
# batch 1 with 8 kv heads and 32k keys: where the rule's splits make one wave, the one-wave tile
one_wave, tile = heuristics.one_wave_plan(8, 32768), tile_for(128, programs=8, capacity=32768)
gbps_per_sm = heuristics.peak_gbps_per_sm()  # a stand-in under the interpreter
takes_it = one_wave and gbps_per_sm < heuristics.ONE_WAVE_MAX_GBPS_PER_SM
print(f"{gbps_per_sm:.1f} GB/s per SM (the one-wave tile below {heuristics.ONE_WAVE_MAX_GBPS_PER_SM:g}); "
      f"batch 1, 32k tokens: one wave {one_wave}, blocks of {tile.block_n} keys, {tile.num_warps} warps")  # fmt: skip
one_wave_tile = heuristics.ONE_WAVE_TILES[128]
assert ((tile.block_n, tile.num_warps) == (one_wave_tile.block_n, one_wave_tile.num_warps)) == takes_it
for programs in (192, 256, 512):
    waves = programs / 132
    last = waves - math.ceil(waves) + 1
    print(f"{programs} programs: {waves:.2f} waves of the contiguous tile, the last {last:.0%} full")
# course_lib's choice on this device: 1.5 waves (the last half full) -> the paged tile; 2 full waves -> not
sms = sm_count()
for programs, paged_tile in ((sms * 3 // 2, True), (2 * sms, False)):
    chosen = tile_for(128, programs=programs, capacity=4096)
    assert (chosen.programs_per_sm == heuristics.PAGED_TILES[128].programs_per_sm) == paged_tile, programs

# %% [markdown]
# ### A.2 A ragged batch: slices, longest first
#
# The rule looks only at shapes, and a **ragged** batch breaks it. Sixteen sequences of a few hundred to 32k
# keys (the benchmark's ragged batch; its lengths are printed below) give 128 programs, enough for the rule's
# one split; but each program's work is its sequence's length, and at the end the longest ones stream alone on
# a few SMs while the rest idle. The lengths live on the GPU, and reading them on the host would cost a sync
# and break CUDA-graph capture (section 3), so the plan must work for any lengths. A batch of two sequences
# or more with a long cache (`heuristics.sliced`) is therefore cut into short slices whatever its lengths:
# enough that none has more than `heuristics.SLICE_KEYS` keys (at most `heuristics.MAX_SLICES` of those,
# so a longer cache gets longer slices), or more if the split rule asks for more to fill the paged tile's
# slots; read with the paged kernel's tile (64-key blocks, 4 programs per SM: short programs that share
# an SM keep its loads in flight).
# Then **the order** in which the programs start matters. The GPU hands programs to free SMs roughly in
# launch order; in the grid's order (split by split, all sequences at a time, the kernel's last splits
# first) some slices of the longest sequence start when nearly everything else is done. Scheduling theory
# has a classic rule for this, *longest processing time first*: start the longest jobs first, so the short ones fill the
# gaps at the end. The kernel sorts the lengths it loads and hands out its programs longest sequence first
# (`heuristics.longest_first`). The sort delays each program's first load (measured: notes/decoding.md), so a
# grid whose programs all fit on the GPU at once (`heuristics.one_wave`), which start together whatever their
# order, skips it.
#
# A model predicts the effect before any GPU is involved: 132 SMs, each taking the next program when it
# finishes one, a program's time proportional to its keys.

# %%
import heapq

splits = heuristics.split_grid(16, 8, 1, 32768, 128)
sliced_block_n = tile_for(128, paged=True).block_n
print(f"16 sequences of up to 32k keys: sliced plan {heuristics.sliced(16, 32768)}, {splits} splits")
assert heuristics.sliced(16, 32768) and splits * heuristics.SLICE_KEYS >= 32768


def step_time(programs, sms=132):
    """Time (in keys streamed) until the last SM is done, programs taken in order by the first free SM."""
    free_at = [0] * sms
    for keys in programs:
        heapq.heappush(free_at, heapq.heappop(free_at) + keys)
    return max(free_at)


def slice_keys(n, n_splits, block_n):
    """Keys of each split of a sequence of n keys, cut as the kernel cuts them (whole blocks)."""
    per = math.ceil(math.ceil(n / block_n) / n_splits)
    return [max(0, min(n, (s + 1) * per * block_n) - s * per * block_n) for s in range(n_splits)]


ragged_cell = next((c for c in decode_rec["data"]["cells"] if "lengths" in c), None) if decode_rec else None
if ragged_cell:  # the lengths the recorded run measured
    ragged_lengths = ragged_cell["lengths"]
else:  # a draw like the benchmark's: 16 lengths from 64 to 32k
    ragged_lengths = torch.randint(64, 32769, (16,), generator=torch.Generator().manual_seed(0)).tolist()
print(f"{len(ragged_lengths)} sequences of {min(ragged_lengths)} to {max(ragged_lengths)} keys "
      f"({'the recorded run' if ragged_cell else 'a draw like the benchmark'})")  # fmt: skip
perfect = sum(ragged_lengths) * 8 / 132  # 8 kv heads: every SM busy to the end
one_split = [n for n in ragged_lengths for _ in range(8)]
cut = [slice_keys(n, splits, sliced_block_n) for n in ragged_lengths]
grid_order = [cut[b][s] for s in reversed(range(splits)) for b in range(16) for _ in range(8)]
longest = sorted(range(16), key=lambda b: -ragged_lengths[b])
longest_order = [cut[b][s] for b in longest for s in range(splits) for _ in range(8)]
times = {"the rule's one split": one_split, "slices, grid order": grid_order, "slices, longest first": longest_order}
for name, programs in times.items():
    print(f"{name:>22}: {step_time(programs) / perfect:.2f}x a perfect balance")
assert step_time(longest_order) <= step_time(grid_order) < step_time(one_split)

if ragged_cell:
    measured = ragged_cell["split_kv"]["graph_ms"] / ragged_cell["read_same_size_ms"]
    print(f"measured, these lengths: {measured:.2f}x the time of a same-size read ({records.label(decode_rec)})")

# %% [markdown]
# The model ignores what the real kernel adds (the combine, each program's start, the SMs sharing the
# memory system), so read the last line against the model's longest-first figure: how much of the gap
# to a perfect balance is left for those?

# %% [markdown]
# ### A.3 When the batch is known to be even
#
# The slices are insurance against lengths the plan cannot see, and an even batch pays for it: 2048 short
# programs where one per (sequence, kv head) would do, as cuDNN (section 5's table) runs it. A caller
# sometimes *knows* every sequence holds the whole cache: SDPA's dense call does, and so
# does `decode_attention(q, k_cache, v_cache)` with no lengths (`cache_seqlens=None`, as
# `flash_attn_with_kvcache` reads it) and `flash_attention` handed dense K/V from a model's cache. Such a
# batch takes the rule's plan wherever its programs fill the SMs' waves, or where the rule splits them into
# one wave that does, as it splits batch 1 (a few sequences: every split equally long, nothing to balance;
# `heuristics.sliced(..., full=True)`).

# %%
full_plan = heuristics.decode_plan(16, 8, 1, 32768, 128, full=True)
print(f"16 x 32k keys, no lengths, on {heuristics.sm_count()} SMs: {full_plan.num_splits} split(s), "
      f"sliced {full_plan.sliced}")  # fmt: skip
assert not full_plan.sliced  # 128 programs fill the SMs' waves
few_plan = heuristics.decode_plan(2, 8, 1, 32768, 128, full=True)
print(f" 2 x 32k keys, no lengths: {few_plan.num_splits} split(s), sliced {few_plan.sliced}")
assert not few_plan.sliced  # on a GPU the rule's splits fill one wave (16 stand-in SMs: 16 programs already do)
qe, ke, ve = (torch.randn(2, *shape, device=DEV) for shape in ((1, 8, 64), (96, 2, 64), (96, 2, 64)))
every_key = torch.full((2,), 96, dtype=torch.int32, device=DEV)
torch.testing.assert_close(decode_attention(qe, ke, ve), decode_attention(qe, ke, ve, every_key))
even_cell = next((c for c in decode_rec["data"]["cells"] if "split_kv_full" in c), None) if decode_rec else None
if even_cell:  # a record that measured the even cell both ways
    with_l, without = (even_cell[k]["graph_ms"] * 1e3 for k in ("split_kv", "split_kv_full"))
    print(f"{even_cell['name']}: {with_l:.1f} us with lengths, {without:.1f} us without "
          f"({records.label(decode_rec)})")  # fmt: skip

# %% [markdown]
# ### A.4 Two kernels, one gap: programmatic dependent launch
#
# A split step is two kernels, the splits and then the combine. On one stream the second normally starts
# only once the first has finished and its writes are visible, so between them the GPU idles for the
# time it takes to launch the combine's programs, even from a CUDA graph, while a whole batch-1 step over
# a short cache takes only a few times a launch (the batch-1 rows of section 5's decode table).
# Hopper GPUs (compute capability 9.0) can launch a kernel *early*: **programmatic dependent launch** (PDL)
# lets a kernel's programs be scheduled before the kernel it depends on has finished, and wait inside the
# kernel, at the point where they first need its results (`course_lib.pdl`). Here each split program,
# once it has stored its partial, lets the dependents be scheduled (`griddepcontrol.launch_dependents`),
# so the combine's programs are placed on the SMs while the last splits finish, and each waits
# (`griddepcontrol.wait`) until the splits have completed and their partials are visible before it reads
# one. The results are the same bits; only the gap changes. (Letting the combine in as soon as every split
# program has *started* measured slower at batch 1 with 4k-8k keys and at batch 16; `notes/decoding.md`.)
# `decode_attention` does this wherever the GPU supports it, and `COURSE_PDL=0` turns it off.
#
# What it buys is small. Measured on an H200 (CUDA-graph replays, batch 1, 1k-8k keys), it saved at most
# 0.3 µs of a step of 11-18 µs, less than the spread between runs of one setting (`notes/decoding.md`,
# "The early combine"): within the noise. It stays because a two-kernel step should not wait for a launch
# it can overlap, and it cost nothing measurable anywhere. The cell below measures it again, on a GPU that
# has the feature; expect a difference of the size of the noise, either way:

# %%
if course_lib.ON_GPU and pdl.enabled():
    import os
    from unittest import mock

    from course_lib.perf.timing import benchmark, graphed

    for n_ctx in (1024, 8192):
        qp = torch.randn(1, 1, 32, 128, device=DEV, dtype=torch.bfloat16)
        kp, vp = (torch.randn(1, n_ctx, 8, 128, device=DEV, dtype=torch.bfloat16) for _ in range(2))
        lp = torch.full((1,), n_ctx, dtype=torch.int32, device=DEV)
        times = {}
        for flag in ("0", "1"):
            with mock.patch.dict(os.environ, {"COURSE_PDL": flag}):  # set for the capture only, restored after
                replay = graphed(lambda: decode_attention(qp, kp, vp, lp, validate=False))
            times[flag] = benchmark(replay) * 1e3
        change = times["1"] - times["0"]
        print(f"N={n_ctx:5d}: plain launches {times['0']:.1f} µs, combine launched early {times['1']:.1f} µs "
              f"({'saves' if change < 0 else 'costs'} {abs(change):.1f} µs)")  # fmt: skip
else:
    print(f"Programmatic dependent launch is off here ({course_lib.RUNTIME.describe()}): it needs compiled "
          "kernels on a GPU of compute capability 9.0 or later.")  # fmt: skip
