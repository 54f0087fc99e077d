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
# # 08b · Your kernel in a real model
#
# Notebooks 06–08 built a FlashAttention that is correct and fast on (B, H, N, d) tensors. A real model
# asks more of it: it is compiled with `torch.compile`, its K and V have fewer heads than Q, it decodes
# token by token against a KV cache, and it lives inside a library (Hugging Face transformers) that
# chooses its attention by name. This short notebook makes the kernel a drop-in.
#
# **Learning goals**
# 1. Explain why `torch.compile` needs the attention registered as a **custom operator**, with a *fake*
#    implementation (shapes only) and its autograd, and check that a compiled block holds it as one node.
# 2. Run **grouped-query attention** (GQA: Hq query heads share Hkv K/V heads) without repeating K and V,
#    and count the memory it saves.
# 3. Tell the two **causal alignments** apart, top-left (query i sees keys j ≤ i) and bottom-right
#    (j ≤ i + Nk − Nq, a KV cache), from a picture of both masks, and predict which rows see no key.
# 4. Restrict each query to a **sliding window** of the last W keys (Mistral, Gemma), predict the work it
#    saves from the blocks the kernel visits, and measure it.
# 5. Run a batch of sequences of **different lengths** packed one after another (FlashAttention's "varlen"
#    call), predict the padding it saves, and measure it.
# 6. Plug the kernel into transformers' `LlamaForCausalLM` and check logits and greedy tokens against SDPA,
#    a padded batch of prompts included.
#
# The finished pieces: `course_lib.attention.op` (`flash_attention_op`, the operators
# `course_lib::flash_attention_forward` / `_backward`), `course_lib.attention.varlen`
# (`flash_attention_varlen`, `flash_attention_padded`) and `course_lib.integrations.use_in_transformers`.

# %% [markdown]
# ## 0. Sizes, and an import order that used to break
#
# The setup cell imports `torch`, `triton` and `transformers` **before** `course_lib`, as most scripts do.
# On a machine without a GPU that order matters: Triton decides whether a `@triton.jit` function is
# compiled or interpreted when it is *decorated*, and Triton's own helpers (`tl.cdiv`, `tl.sum`, ...) are
# decorated when `triton` is imported. `import course_lib` decides to interpret and then re-creates those
# helpers in interpreted form (`course_lib.runtime`), so either order works.

# %%
import matplotlib.pyplot as plt
import torch
import transformers
import triton

import course_lib
from course_lib.attention import attention_forward, op
from course_lib.attention.blocks import kv_block_range_py, window_kv_range_py
from course_lib.attention.op import flash_attention_op
from course_lib.attention.reference import attention as reference_attention
from course_lib.attention.reference import attention_varlen
from course_lib.attention.varlen import flash_attention_padded, flash_attention_varlen
from course_lib.exercises import check, predict
from course_lib.integrations import use_in_transformers
from course_lib.perf import plotting
from course_lib.perf.timing import benchmark
from course_lib.testing import assert_close_to_reference

B, HQ, HKV, N, D = course_lib.pick(cpu=(1, 4, 2, 64, 16), gpu=(2, 32, 8, 2048, 128))
DTYPE = course_lib.pick(cpu=torch.float32, gpu=torch.bfloat16)
LLAMA = course_lib.pick(
    cpu=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2),
    gpu=dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4),
)
PROMPT, NEW_TOKENS = course_lib.pick(cpu=(8, 6), gpu=(64, 32))
# Sections 4 and 5 count the tiles a kernel visits at the GPU sizes on every machine (plain Python
# arithmetic, instant: at CPU sizes every sequence fits in one tile and the counts say nothing); they run
# the kernels at these sizes:
WINDOW_GPU, N_WIN_GPU = 1024, 8192  # section 4: window and sequence length
N_SEQS_GPU, MAX_LEN_GPU = 16, 4096  # section 5: packed sequences
WINDOW, N_WIN = course_lib.pick(cpu=(16, 96), gpu=(WINDOW_GPU, N_WIN_GPU))
N_SEQS, MAX_LEN = course_lib.pick(cpu=(4, 80), gpu=(N_SEQS_GPU, MAX_LEN_GPU))
# section 5 checks the packed gradients under the interpreter; on a GPU tests/test_varlen.py does (compiling
# the packed backward kernels here would take this notebook past its time budget there)
PACKED_GRADS = course_lib.pick(cpu=True, gpu=False)
DEV = course_lib.DEVICE
TOL = 1e-4 if DTYPE == torch.float32 else 3e-2
torch.manual_seed(0)
plotting.use_readable_defaults()  # projector-sized fonts for every figure, plt's own included
print(f"triton {triton.__version__}, transformers {transformers.__version__}; {course_lib.RUNTIME.describe()}")
print(f"B={B}, {HQ} query heads over {HKV} K/V heads, N={N}, d={D}, {DTYPE}")

# %% [markdown]
# ## 1. Why `torch.compile` needs a custom operator
#
# `torch.compile` first *traces* your Python into a graph (its front end is called Dynamo). It does not run
# the real computation while tracing: every tensor is a **fake tensor**, which has a shape, a dtype and a
# device but no data. Then a back end (by default Inductor) generates code for the graph.
#
# Our autograd Function, `FlashAttentionTriton` (notebook 07), launches Triton kernels in its forward.
# Dynamo traces *into* such a Function: it sees the autotuner, the launch and the kernel, and hands the
# kernel to Inductor to compile its own way. With our kernels (autotuned, with a launch cache and a
# Hopper-only Gluon variant) that path failed on a GPU with an `InductorError`.
#
# A **custom operator** is a black box for the compiler. We tell PyTorch three things about it:
# - the operator itself, `course_lib::flash_attention_forward(q, k, v, causal, scale, window, sinks) -> (O, L)`,
#   whose body calls the kernels (`torch.library.custom_op`); its arguments have fixed types, so `causal` is
#   a string ("none", "top_left", "bottom_right"), `scale` a float, `window` an int (0: none) and `sinks` an
#   optional tensor;
# - a **fake implementation** (`register_fake`): given fake q, k, v, return fake outputs of the right shape
#   and dtype, O like q and L of shape q.shape[:-1] in float32. This is all Dynamo needs to trace past it;
# - its **autograd** (`register_autograd`): which tensors to save, and a backward that calls a second
#   operator, `course_lib::flash_attention_backward`, also a black box with its own fake implementation.
#
# The fake implementation runs on tensors with no data at all (device "meta"):

# %%
q_meta = torch.empty(B, HQ, N, D, device="meta", dtype=DTYPE)
kv_meta = torch.empty(B, HKV, N, D, device="meta", dtype=DTYPE)
o_meta, lse_meta = op._forward_fake(q_meta, kv_meta, kv_meta, "top_left", D**-0.5)
print("O:", tuple(o_meta.shape), o_meta.dtype, "  L:", tuple(lse_meta.shape), lse_meta.dtype)
assert o_meta.shape == q_meta.shape and lse_meta.shape == q_meta.shape[:-1] and lse_meta.dtype == torch.float32

# %% [markdown]
# A small attention block: projections, grouped-query attention, a loss. We compile it with
# `fullgraph=True`, which turns any graph break into an error, and with a back end of our own that only
# records the graph Dynamo produced, so we can read it.


# %%
def block(x, wq, wk, wv):
    b, n, _ = x.shape
    q = (x @ wq).view(b, n, HQ, D).transpose(1, 2)  # (B, Hq, N, d)
    k = (x @ wk).view(b, n, HKV, D).transpose(1, 2)  # (B, Hkv, N, d)
    v = (x @ wv).view(b, n, HKV, D).transpose(1, 2)
    o = flash_attention_op(q, k, v, "top_left")
    return o.transpose(1, 2).reshape(b, n, HQ * D).float().square().mean()


graphs = []


def recording_backend(gm, example_inputs):
    graphs.append(gm)
    return gm.forward


x = torch.randn(B, N, HQ * D, device=DEV, dtype=DTYPE)
weights = [
    (torch.randn(HQ * D, h * D, device=DEV) / (HQ * D) ** 0.5).to(DTYPE).requires_grad_(True) for h in (HQ, HKV, HKV)
]
torch._dynamo.reset()
loss_traced = torch.compile(block, fullgraph=True, backend=recording_backend)(x, *weights)
calls = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
print(f"{len(graphs)} graph, {len(calls)} calls:")
print("\n".join("  " + c for c in calls))
assert len(graphs) == 1 and any("course_lib.flash_attention_forward" in c for c in calls)

# %% [markdown]
# One graph, and the attention is one node in it: nothing of the kernel was traced. Now the real thing,
# forward and backward, compiled with the `aot_eager` back end (which also traces the backward into a
# graph; on a GPU we use Inductor), compared with eager mode:

# %%
backend = course_lib.pick(cpu="aot_eager", gpu="inductor")
torch._dynamo.reset()
compiled_block = torch.compile(block, fullgraph=True, backend=backend)
loss_eager = block(x, *weights)
grads_eager = torch.autograd.grad(loss_eager, weights)
loss_compiled = compiled_block(x, *weights)
grads_compiled = torch.autograd.grad(loss_compiled, weights)
print(f"loss eager {loss_eager.item():.6f}, compiled ({backend}) {loss_compiled.item():.6f}")
torch.testing.assert_close(loss_compiled, loss_eager, rtol=TOL, atol=TOL)
for g_c, g_e in zip(grads_compiled, grads_eager):
    torch.testing.assert_close(g_c.float(), g_e.float(), rtol=TOL, atol=TOL)

# %% [markdown]
# ## 2. Grouped-query attention
#
# Llama 3, Mistral and Qwen give K and V fewer heads than Q: Hq query heads are split into Hkv groups of
# G = Hq / Hkv, and the heads of a group share one K/V head. Query head h reads K/V head ⌊h / G⌋. With
# G = 1 this is ordinary multi-head attention; with Hkv = 1, multi-query attention.
#
# The easy way to run it is to repeat K and V G times and call ordinary attention. The kernels instead
# compute each query head's K/V head index and read the shared tiles directly: nothing is copied, and in
# the backward dK and dV add up the contributions of the G query heads that share them: on chip, one
# program walking the whole group, or, for long rows where that measured slower on an H200 (head dims of 64
# and below beyond 4096 keys, or from 4096 keys when not causal; on Hopper at d = 128, non-causal rows of 4096
# keys or more), one program per query head writing an fp32 partial sum that a small kernel then adds
# (`backward.dkdv_heads_per_program`, `hopper_backward.heads_per_program`; their docstrings and
# notes/attention.md hold the measurements).

# %%
q, k, v = (torch.randn(B, h, N, D, device=DEV, dtype=DTYPE) for h in (HQ, HKV, HKV))
o_gqa = flash_attention_op(q, k, v, "top_left")
group = HQ // HKV
k_rep, v_rep = (t.repeat_interleave(group, dim=1) for t in (k, v))  # (B, Hq, N, d): the copy we avoid
o_rep = reference_attention(q.double(), k_rep.double(), v_rep.double(), causal=True)
print(f"G = {group}: max |O_gqa - O_repeated| = {(o_gqa.double() - o_rep).abs().max().item():.2e}")
torch.testing.assert_close(o_gqa.double(), o_rep, rtol=TOL, atol=TOL)

# %% [markdown]
# What the repetition would cost: during decoding, K and V of every past token stay in memory (the KV
# cache), 2 · Hkv · d numbers per token per layer. For a model of 32 layers with 32 query heads of d = 128,
# 8 K/V heads instead of 32 means a cache 4 times smaller, and a decoding step reading 4 times fewer bytes.
#
# **Predict first.** One sequence of 8192 tokens, bf16: how many GiB of KV cache do 8 K/V heads save over
# 32? Work it out and type your estimate in place of the value in the next cell; the cell after it counts
# the bytes and scores it.

# %%
# Your prediction: GiB of KV cache saved by 8 K/V heads instead of 32, 8192 tokens, 32 layers, d = 128, bf16.
gqa_guess = predict("KV cache saved by GQA (8 of 32 heads) at 8192 tokens", 3.0, unit=" GiB")

# %%
layers, hq_model, d_model, bytes_per = 32, 32, 128, 2  # bf16
cache_gib = {}
for hkv_model in (32, 8, 1):
    per_token = 2 * hkv_model * d_model * bytes_per * layers
    cache_gib[hkv_model] = per_token * 8192 / 2**30
    print(f"Hkv = {hkv_model:2}: {per_token / 2**10:6.0f} KiB of KV cache per token, "
          f"{cache_gib[hkv_model]:5.2f} GiB for 8192 tokens")  # fmt: skip
_ = gqa_guess.score(cache_gib[32] - cache_gib[8])

# %% [markdown]
# ## 3. Two causal alignments
#
# Causal attention hides the future: query i sees key j only if j comes no later than i. When Nq = Nk
# there is one way to line queries and keys up. When they differ, there are two:
#
# - **top-left** (`"top_left"`, PyTorch SDPA's `is_causal=True`): query i sees keys j ≤ i. The queries are
#   the *first* Nq positions.
# - **bottom-right** (`"bottom_right"`, FlashAttention's `flash_attn_func`): query i sees keys
#   j ≤ i + Nk − Nq. The queries are the *last* Nq positions: this is a KV cache, where Nk − Nq tokens were
#   processed earlier and Nq new ones arrive (a prompt in chunks, a speculative draft, one decoding step).
#
# With Nq > Nk bottom-right, the first Nq − Nk queries see no key at all; the kernels define their output
# as O = 0 and L = −∞ (and zero gradients), never NaN.


# %%
def causal_mask(n_q, n_k, alignment):
    """(n_q, n_k) booleans: True where query i may see key j."""
    i = torch.arange(n_q)[:, None]
    j = torch.arange(n_k)[None, :]
    return j <= i + (n_k - n_q if alignment == "bottom_right" else 0)


panels = [(4, 10, "top_left"), (4, 10, "bottom_right"), (10, 4, "bottom_right")]
fig, axes = plt.subplots(
    1, 3, figsize=(8.8, 4.2), gridspec_kw={"width_ratios": [10, 10, 4]}, layout="constrained"
)
for ax, (n_q, n_k, alignment) in zip(axes, panels):
    ax.imshow(causal_mask(n_q, n_k, alignment), cmap="Blues", vmin=0, vmax=1.4)
    ax.set_title(f"{alignment.replace('_', '-')}\nNq={n_q}, Nk={n_k}")
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    ax.set_xticks(range(n_k))
    ax.set_yticks(range(n_q))
fig.suptitle("A KV cache needs bottom-right: the new queries see every earlier key\n(blue = visible)")
plt.show()

# %% [markdown]
# With 4 queries against 10 keys, top-left lets the last query see only 4 keys; bottom-right lets it see
# all 10, as a token appended after a 6-token cache should. The kernels agree with the float64 reference
# in both alignments, and the rows that see nothing come out as zeros:

# %%
n_new = min(16, N // 2)
q_new = torch.randn(B, HQ, n_new, D, device=DEV, dtype=DTYPE)
for alignment in ("top_left", "bottom_right"):
    o = flash_attention_op(q_new, k, v, alignment)
    ref = reference_attention(q_new.double(), k.double(), v.double(), causal=alignment)
    err = (o.double() - ref).abs().max().item()
    print(f"{alignment:12}: Nq={n_new}, Nk={N}, max error against float64 {err:.1e}")
    torch.testing.assert_close(o.double(), ref, rtol=TOL, atol=TOL)

k_short, v_short = k[:, :, :n_new], v[:, :, :n_new]  # Nq = N > Nk = n_new
o_tall = flash_attention_op(q, k_short, v_short, "bottom_right")
empty_rows = N - n_new
print(f"Nq={N} > Nk={n_new}: the first {empty_rows} rows see no key; their largest |O| is "
      f"{o_tall[:, :, :empty_rows].abs().max().item()}")  # fmt: skip
assert torch.all(o_tall[:, :, :empty_rows] == 0) and torch.isfinite(o_tall).all()

# %% [markdown]
# ## 4. Sliding windows
#
# Mistral 7B, Gemma's local layers and every other layer of gpt-oss attend within a **sliding window**: query
# i sees only the W keys ending at its own position, i + offset − W < j ≤ i + offset (with the offset of
# its causal alignment). Information from further back still arrives, through the layers below. The mask
# is a band along the diagonal:

# %%
def window_mask(n, w):
    """(n, n) booleans of top-left causal attention within a window of w keys."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    return (j <= i) & (j > i - w)


fig, axes = plt.subplots(1, 2, figsize=(9, 4.2))
for ax, (w, title) in zip(axes, [(12, "causal"), (4, "sliding window, W = 4")]):
    ax.imshow(window_mask(12, w), cmap="Blues", vmin=0, vmax=1.4)
    ax.set_title(title)
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
fig.suptitle("A window keeps the last W keys of every row (blue = visible)")
fig.tight_layout()
plt.show()

# %% [markdown]
# For the kernels a window is one more bound on the block range of notebook 06 (its exercise 5 sorted the
# tiles into skipped, masked and whole ones). A query block's first row
# sees keys from m_start + offset − W + 1 on: blocks before that are never loaded. Blocks that the window's
# lower edge crosses are masked, like the diagonal ones; the blocks between are seen whole by every row and
# need no mask. The backward does the same from the keys' side (`blocks.window_kv_range` and
# `blocks.window_q_range`). `flash_attention(q, k, v, causal=True, window=W)` computes it, forward and
# backward, and agrees with the float64 reference:

# %%
o_win = flash_attention_op(q, k, v, "top_left", window=WINDOW)
ref_win = reference_attention(q.double(), k.double(), v.double(), causal=True, window=WINDOW)
print(f"window {WINDOW}, N={N}: max error against float64 {(o_win.double() - ref_win).abs().max().item():.1e}")
torch.testing.assert_close(o_win.double(), ref_win, rtol=TOL, atol=TOL)

# %% [markdown]
# **Predict first.** The work is the number of (query block, key block) tiles a kernel visits. Causal
# attention over N keys visits about half of the (N / block)² tiles; a window of W keys about
# (N / block_m) · (W + block_m) / block_n, with tiles of block_m = 128 queries by block_n = 64 keys. How many
# times faster is forward + backward with a window of W = 1024 keys than causal attention, over N = 8192
# tokens? Type your estimate in place of the value in the next cell.

# %%
# Your prediction: causal time / windowed time, forward + backward, N = 8192, W = 1024.
window_guess = predict("sliding window speed-up, N = 8192, W = 1024", 3.7, unit="x")

# %% [markdown]
# The next cell counts the tiles with the kernels' own block-range functions (their Python twins) for
# N = 8192 and W = 1024 on every machine: that count is the work's prediction of the speed-up. On a GPU,
# the cell after it times forward + backward with the window against the same kernel with a window as long
# as the sequence (which visits the causal tiles), so that only the skipped blocks differ, and scores your
# prediction; on a CPU the tile count stands in for the measurement.

# %%
BLOCK_M, BLOCK_N = 128, 64  # a typical tile; the ratio hardly depends on it


def tiles_visited(n, window):
    """(query block, key block) tiles a causal forward visits over n tokens with this window."""
    total = 0
    for m0 in range(0, n, BLOCK_M):
        lo, mid, hi = kv_block_range_py(m0, n, n, 0, BLOCK_M, BLOCK_N, True)
        w_lo, _, _ = window_kv_range_py(m0, n, 0, window, lo, mid, hi, BLOCK_M, BLOCK_N)
        total += -(-(hi - w_lo) // BLOCK_N)
    return total


causal_tiles, window_tiles = tiles_visited(N_WIN_GPU, N_WIN_GPU), tiles_visited(N_WIN_GPU, WINDOW_GPU)
predicted = causal_tiles / window_tiles
print(f"N={N_WIN_GPU}: causal visits {causal_tiles} tiles, a window of {WINDOW_GPU} {window_tiles}: "
      f"predicted speed-up {predicted:.2f}x")  # fmt: skip
assert predicted > 2  # at these sizes the window skips most of the causal tiles

# %%
if course_lib.ON_GPU:
    qw, kw, vw = (torch.randn(1, h, N_WIN, D, device=DEV, dtype=DTYPE, requires_grad=True) for h in (HQ, HKV, HKV))
    dow = torch.randn_like(qw)

    def fwd_bwd(window):
        o = flash_attention_op(qw, kw, vw, "top_left", window=window)
        torch.autograd.grad(o, (qw, kw, vw), dow)

    ms_causal, ms_window = benchmark(lambda: fwd_bwd(N_WIN)), benchmark(lambda: fwd_bwd(WINDOW))
    measured = ms_causal / ms_window
    print(f"forward + backward, N={N_WIN}: window {N_WIN} (causal) {ms_causal:.2f} ms, "
          f"window {WINDOW} {ms_window:.2f} ms: {measured:.2f}x, "
          f"{measured / predicted:.0%} of the predicted {predicted:.2f}x")  # fmt: skip
    _ = window_guess.score(measured)
else:
    print("Timing runs on a GPU; under the interpreter it would measure Python, not the kernel. "
          "Your prediction against the tile count instead:")  # fmt: skip
    _ = window_guess.score(predicted)

# %% [markdown]
# Where the measured speed-up falls short of the tile count, the difference is work that does not shrink
# with the window: loading each query block and writing its output, the masked tiles at both edges of the
# band (twice as many per row as causal attention's one diagonal), and, in the backward, the same on the
# keys' side.

# %% [markdown]
# ### Attention sinks
#
# gpt-oss also has **attention sinks**, in every layer (the windowed ones and the full-attention ones between
# them): one learned logit s_h per query head that joins every row's softmax as if it were one more key,
# whose value is zero. A row can then put its weight on "nothing"
# instead of spreading it over keys it does not need. In the online softmax of notebook 06 the sink is the
# first "key" every row sees: the running max starts at s_h instead of −∞ and the running sum at
# e^(s_h − s_h) = 1; nothing is added to the accumulator. L then includes the sink, so the backward's P,
# rebuilt from L, is already right for the real keys. The sink's own gradient is that of a key with a zero
# value: dP = 0, so dS = P_sink · (0 − D) and ∂loss/∂s_h = −Σ_rows e^(s_h − L) · D, summed over the head's
# rows from the L and D the backward already has. `flash_attention(..., sinks=s)`, checked against the
# float64 reference, which appends the sink as one more column of S:

# %%
sinks = (2 * torch.randn(HQ, device=DEV)).requires_grad_(True)
q_s, k_s, v_s = (t.detach().requires_grad_(True) for t in (q, k, v))
o_s = flash_attention_op(q_s, k_s, v_s, "top_left", window=WINDOW, sinks=sinks)
d_sinks = torch.autograd.grad(o_s.float().sum(), sinks)[0]
ref = {}  # the reference in float64, and in the inputs' dtype (plain PyTorch's own rounding: the bound)
for name, dtype in (("float64", torch.float64), ("baseline", DTYPE)):
    s_ref = sinks.detach().to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_(True)
    o_ref = reference_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True, window=WINDOW, sinks=s_ref)
    ref[name] = (o_ref.detach(), torch.autograd.grad(o_ref.float().sum(), s_ref)[0])
err_d = (d_sinks.double() - ref["float64"][1]).abs().max().item()
print(f"with sinks: max error of O {(o_s.double() - ref['float64'][0]).abs().max().item():.1e}, "
      f"of dsinks {err_d:.1e} (dsinks up to {ref['float64'][1].abs().max().item():.1f})")  # fmt: skip
assert_close_to_reference(o_s, ref["float64"][0], ref["baseline"][0], what="O with sinks")
assert_close_to_reference(d_sinks, ref["float64"][1], ref["baseline"][1], what="dsinks")

# %% [markdown]
# ## 5. Sequences of different lengths, packed
#
# A batch of prompts, or of training documents, rarely has one length. Padding every sequence to the
# longest and masking the padding computes tiles that are thrown away. **Packing** puts the sequences one
# after another as rows of one tensor, q of shape (total_q, Hq, d) and k, v of shape (total_k, Hkv, d), and
# says where each begins with **cumulative lengths**: sequence b owns rows `cu_seqlens[b]` up to
# `cu_seqlens[b + 1]`. This is FlashAttention's `flash_attn_varlen_func`, and `flash_attention_varlen` here.
#
# The kernels need one change. A program still owns a block of rows of one (sequence, head), on the grid of
# a padded batch of the longest sequence; it reads its sequence's four bounds (`blocks.sequence`), moves its
# pointers to the sequence's first row, and uses the sequence's own lengths wherever the padded kernel used
# Nq and Nk: for masks, block ranges, and the causal offset (bottom-right is each sequence's own Nk − Nq). A
# program whose block starts past its sequence's end visits no key and stores nothing.

# %%
def draw_lengths(n_seqs, max_len):
    """n_seqs random lengths in [1, max_len], the first max_len (the longest sets the padded batch's size)."""
    lengths = torch.randint(1, max_len + 1, (n_seqs,), generator=torch.Generator().manual_seed(5))
    lengths[0] = max_len
    return lengths


lengths = draw_lengths(N_SEQS, MAX_LEN)
cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32).to(DEV)
print("lengths:", lengths.tolist())
print("cu_seqlens:", cu.tolist())
total = int(lengths.sum())
qp, kp, vp = (torch.randn(total, h, D, device=DEV, dtype=DTYPE, requires_grad=True) for h in (HQ, HKV, HKV))
qp.requires_grad_(PACKED_GRADS), kp.requires_grad_(PACKED_GRADS), vp.requires_grad_(PACKED_GRADS)
o_packed = flash_attention_varlen(qp, kp, vp, cu, cu, causal=True)
do_packed = torch.randn_like(o_packed)
ref = {}  # each sequence on its own, in float64 and in the inputs' dtype (plain PyTorch's rounding: the bound)
for name, dtype in (("float64", torch.float64), ("baseline", DTYPE)):
    ins = [t.detach().to(dtype).requires_grad_(PACKED_GRADS) for t in (qp, kp, vp)]
    o_ref, _ = attention_varlen(*ins, cu, cu, causal=True)
    ref[name] = (o_ref.detach(), torch.autograd.grad(o_ref, ins, do_packed.to(dtype)) if PACKED_GRADS else ())
print(f"packed causal: max error of O against float64 {(o_packed.double() - ref['float64'][0]).abs().max().item():.1e}")
assert_close_to_reference(o_packed, ref["float64"][0], ref["baseline"][0], what="packed O")
if PACKED_GRADS:
    grads_packed = torch.autograd.grad(o_packed, (qp, kp, vp), do_packed)
    for name, g, g64, g_base in zip(("dq", "dk", "dv"), grads_packed, ref["float64"][1], ref["baseline"][1]):
        assert_close_to_reference(g, g64, g_base, what=f"packed {name}")
    print("dQ, dK, dV: within twice plain PyTorch's own error of the float64 reference")

# %% [markdown]
# **Predict first.** Causal attention over a sequence of n tokens visits `tiles_visited(n, n)` tiles
# (section 4's count, with a window as long as the sequence); a padded batch visits that for the longest n
# in every sequence. The ratio of the two counts is the predicted speed-up of packing over padding. It is
# counted for the GPU's batch (16 sequences up to 4096 tokens, drawn as above) on every machine: at the CPU's
# sizes every sequence fits in one tile, and the ratio would say nothing. The
# padded call is what a model without varlen support runs: the kernel over (B, H, longest, d), its padding
# computed and then thrown away (here it is only timed). Both calls run the Triton kernel
# (`config={"hopper": False}` keeps the padded one off the warp-specialised Gluon kernel of notebook 08c,
# which has no packed form), so the ratio measures the padding alone.

# %%
gpu_lengths = draw_lengths(N_SEQS_GPU, MAX_LEN_GPU)  # on a GPU, the lengths above
padded_tiles = N_SEQS_GPU * tiles_visited(MAX_LEN_GPU, MAX_LEN_GPU)
packed_tiles = sum(tiles_visited(int(n), int(n)) for n in gpu_lengths)
predicted_pack = padded_tiles / packed_tiles
print(f"{N_SEQS_GPU} sequences of {min(gpu_lengths.tolist())} to {MAX_LEN_GPU} tokens: padded {padded_tiles} tiles, "
      f"packed {packed_tiles}: predicted speed-up {predicted_pack:.2f}x "
      f"({1 - packed_tiles / padded_tiles:.0%} of the padded work is padding)")  # fmt: skip
assert predicted_pack > 1.2

# %%
if course_lib.ON_GPU:
    q_pad, k_pad, v_pad = (torch.randn(N_SEQS, h, MAX_LEN, D, device=DEV, dtype=DTYPE) for h in (HQ, HKV, HKV))
    q_pk, k_pk, v_pk = (t.detach() for t in (qp, kp, vp))
    max_len = int(lengths.max())
    triton_only = {"hopper": False}
    ms_padded = benchmark(lambda: attention_forward(q_pad, k_pad, v_pad, True, config=triton_only))
    ms_packed = benchmark(lambda: flash_attention_varlen(q_pk, k_pk, v_pk, cu, cu, max_len, max_len, True))
    measured_pack = ms_padded / ms_packed
    print(f"causal forward, {N_SEQS} sequences: padded {ms_padded:.3f} ms, packed {ms_packed:.3f} ms: "
          f"{measured_pack:.2f}x, {measured_pack / predicted_pack:.0%} of the predicted {predicted_pack:.2f}x")
    print("short of the tile count: see below" if measured_pack < predicted_pack else "at or above the tile count")
else:
    print("Timing runs on a GPU; under the interpreter it would measure Python, not the kernel.")

# %% [markdown]
# Where the measured speed-up falls short of the tile count, look at what the count leaves out. The packed
# call's grid is still that of the padded batch: programs past a short sequence's end start, read four
# integers and stop. Each sequence has its own ragged last block, masked and partly empty, and its own
# diagonal blocks. And the longest sequences decide the end: a padded batch is all long programs, which
# fill the GPU evenly; a packed one can leave SMs idle while its few longest sequences finish.
#
# A model usually holds its batch padded, (B, H, N, d) with a (B, N) mask of real tokens.
# `flash_attention_padded(q, k, v, padding, causal)` gathers the real rows, runs the packed call, and
# scatters the result back (padded query rows get 0): the padding is never computed.
#
# Under `torch.compile` that gather is the one step a graph cannot hold: how many tokens are real decides
# the packed tensors' shapes, and while the graph is traced the mask is a fake tensor with no values. So
# there the whole padded call is one custom operator of its own (section 1's recipe),
# `course_lib::flash_attention_padded_forward`: its fake implementation returns the padded shapes, and the
# packing happens inside it, where the values are real.

# %%
real_tokens = torch.arange(MAX_LEN)[None, :] >= MAX_LEN - lengths[:, None]  # left padding: real tokens last
real_tokens = real_tokens.to(DEV)
qb, kb, vb = (torch.randn(N_SEQS, h, MAX_LEN, D, device=DEV, dtype=DTYPE) for h in (HQ, HKV, HKV))
o_eager = flash_attention_padded(qb, kb, vb, real_tokens, True)
torch._dynamo.reset()
padded_compiled = torch.compile(flash_attention_padded, fullgraph=True, backend="aot_eager")
o_compiled = padded_compiled(qb, kb, vb, real_tokens, True)
assert torch.equal(o_compiled, o_eager)  # the same kernels on the same rows: the same bits
assert (o_eager.transpose(1, 2)[~real_tokens] == 0).all()  # padded query rows give 0
print(f"padded batch of {N_SEQS}, {int(real_tokens.sum())} real tokens of {real_tokens.numel()}: "
      "compiled (fullgraph) = eager, bit for bit")

# %% [markdown]
# ## 6. Inside transformers
#
# transformers chooses a model's attention by name (`attn_implementation`: "eager", "sdpa",
# "flash_attention_2", ...) through two registries:
#
# - `AttentionMaskInterface` turns the model's inputs (a padding mask, the cache length) into a mask.
#   Ours answers `None` whenever the mask is plain causal with the queries at the end of the keys — prefill,
#   and decoding or chunked prefill with a growing cache — because that is exactly what the kernels compute
#   with `"bottom_right"`, without any mask tensor, a layer's sliding window included (the window is then
#   passed on to the kernels). With padding (prompts of different lengths) it answers the 2-D padding mask,
#   and the layers run the real tokens packed (section 5; under `torch.compile`, through its operator). A
#   sliding-window layer under `torch.compile` is recognised by the model's config, since the mask
#   function's values cannot be looked at in a graph. For a static cache (more slots than keys so far)
#   it answers how many keys are in use, and the layers run on those alone; under `torch.compile` (which
#   transformers applies to a static cache's decoding steps by itself on a GPU) that count is a tensor of
#   the graph, and the layers run the decoding kernel of notebook 09 as a custom operator, which takes the
#   count as a tensor (inference steps without a window or sinks; otherwise SDPA on the equivalent causal
#   mask, with a warning). For anything else (a 4-D mask of the caller's) it builds transformers' boolean mask.
# - `AttentionInterface` maps the name to a function `(module, q, k, v, mask, dropout, scaling, ...)`. Ours
#   calls `course_lib.flash_attention` (the custom operator under `torch.compile`; eagerly, the autograd
#   Function when a gradient may be asked, the forward alone otherwise) with K and V as they come (GQA, no
#   repeat), the layer's window and its sinks (gpt-oss) when the mask is `None`, `flash_attention_padded` for
#   a padding mask, and hands the call to SDPA, with a warning, when there is a mask the kernels cannot apply
#   (to the model's own eager attention for a layer with sinks, which SDPA lacks).
#
# `use_in_transformers()` registers both under the name "course_lib". A tiny Llama with random weights,
# built from a config (nothing is downloaded):

# %%
name = use_in_transformers()
config = transformers.LlamaConfig(
    vocab_size=128, intermediate_size=2 * LLAMA["hidden_size"], max_position_embeddings=512, **LLAMA
)
model = transformers.LlamaForCausalLM(config).to(DEV, DTYPE).eval()
ids = torch.randint(0, config.vocab_size, (2, 3 * PROMPT), device=DEV)
logits = {}
for impl in ("sdpa", name):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        logits[impl] = model(ids).logits.float()
err = (logits[name] - logits["sdpa"]).abs().max().item()
print(f"{config.num_attention_heads} query heads over {config.num_key_value_heads} K/V heads, "
      f"{config.num_hidden_layers} layers: max |logits difference| course_lib vs SDPA = {err:.1e}")  # fmt: skip
assert err < 10 * TOL * max(1.0, logits["sdpa"].abs().max().item())

# %% [markdown]
# A batch of prompts of different lengths comes padded, with a 2-D mask of its real tokens. The mask hook
# answers that mask, and each layer runs the real tokens packed (`flash_attention_padded`, section 5). The
# logits of the real tokens must match SDPA's (the padded positions' logits are never used):

# %%
padding = torch.ones_like(ids)
padding[1, : ids.shape[1] // 2] = 0  # the second sequence: its first half is left padding
for impl in ("sdpa", name):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        logits[impl] = model(ids, attention_mask=padding).logits.float()
real = padding.bool()
err = (logits[name][real] - logits["sdpa"][real]).abs().max().item()
print(f"padded batch ({int(real.sum())} real tokens of {real.numel()}): max |logits difference| = {err:.1e}")
assert err < 10 * TOL * max(1.0, logits["sdpa"][real].abs().max().item())

# %% [markdown]
# Greedy generation runs a prefill (Nq = Nk = the prompt) and then one query at a time against the cache
# (Nq = 1, Nk growing). In float32 both implementations must pick the same tokens.
#
# On a GPU with an empty Triton cache, the first `generate` waits for four compilations of the forward
# kernel: one for the prefill and three for the decoding steps. Triton compiles a kernel once per *class*
# of each integer argument (equal to 1, a multiple of 16, anything else), because knowing that a length is
# a multiple of 16 can make better code; Nq = 1 is one class, and as Nk grows by one a step, Nk and the
# causal offset Nk - Nq pass through three combinations. Telling Triton not to specialise the lengths
# would leave one decoding kernel, but when it was tried on an H100 (notes/attention.md, "Tried and rejected")
# the bf16 forward at training sizes (causal, d = 128) ran slower, and the fp32 kernel spilled its registers
# and ran several times slower, so the course keeps the specialisation and pays these seconds once.

# %%
model.float()
prompt = ids[:1, :PROMPT]
tokens = {}
for impl in ("sdpa", name):
    model.set_attn_implementation(impl)
    tokens[impl] = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
print("sdpa:      ", tokens["sdpa"][0, PROMPT:].tolist())
print("course_lib:", tokens[name][0, PROMPT:].tolist())
assert torch.equal(tokens["sdpa"], tokens[name])

# %% [markdown]
# ## Exercises
#
# Each exercise has a cell to fill in and a check cell after it. Later cells never use your answers.
#
# **Exercise 1 (alignment).** Write `visible_keys(n_q, n_k, alignment)`: a list with, for each query row i,
# how many keys it sees under `"top_left"` or `"bottom_right"` (never negative, never more than n_k).
# Don't build the mask: use the rule j ≤ i + offset.


# %%
def visible_keys(n_q, n_k, alignment):
    ### BEGIN SOLUTION
    offset = n_k - n_q if alignment == "bottom_right" else 0
    return [min(n_k, max(0, i + offset + 1)) for i in range(n_q)]
    ### END SOLUTION


# %% tags=["check"]
_cases = [(4, 10, "top_left"), (4, 10, "bottom_right"), (10, 4, "bottom_right"), (10, 4, "top_left")]
check(
    "visible keys per query row",
    lambda: [visible_keys(*case) for case in _cases],
    [causal_mask(*case).sum(dim=1).tolist() for case in _cases],
)

# %% [markdown]
# **Exercise 2 (the fake implementation).** Write `fake_attention(q, k, v)` as `register_fake` would need
# it for a forward that returns (O, L): tensors on q's device with the right shapes and dtypes, O like q
# and L of shape q.shape[:-1] in float32. It will be called with meta tensors: it must not look at values.


# %%
def fake_attention(q, k, v):
    ### BEGIN SOLUTION
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)
    ### END SOLUTION


# %% tags=["check"]
_q = torch.empty(2, 8, 33, 64, device="meta", dtype=torch.bfloat16)
_kv = torch.empty(2, 2, 50, 64, device="meta", dtype=torch.bfloat16)
check(
    "fake attention shapes and dtypes",
    lambda: [(tuple(t.shape), str(t.dtype), t.device.type) for t in fake_attention(_q, _kv, _kv)],
    [(tuple(t.shape), str(t.dtype), t.device.type) for t in op._forward_fake(_q, _kv, _kv, "none", 0.125)],
)

# %% [markdown]
# **Exercise 3 (GQA by hand).** Write `gqa_attention(q, k, v)` for q (B, Hq, N, d) and k, v (B, Hkv, N, d)
# with `mha_attention`, the non-causal float64 reference for multi-head attention only (it refuses fewer
# K/V heads than Q heads; `reference_attention` itself would do the GQA mapping for you): give query head h
# the K/V head h // G. The check compares with the kernel.


# %%
def mha_attention(q, k, v):
    """The float64 reference, for as many K/V heads as Q heads only."""
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"mha_attention: {q.shape[1]} query heads but {k.shape[1]} K/V heads; map them first")
    return reference_attention(q.double(), k.double(), v.double())


def gqa_attention(q, k, v):
    ### BEGIN SOLUTION
    group = q.shape[1] // k.shape[1]
    heads = torch.arange(q.shape[1], device=q.device) // group
    return mha_attention(q, k[:, heads], v[:, heads])
    ### END SOLUTION


# %% tags=["check"]
check(
    "grouped-query attention from the reference",
    lambda: gqa_attention(q, k, v).float(),
    flash_attention_op(q, k, v, "none").float(),
    rtol=TOL,
    atol=TOL,
)

# %% [markdown]
# **Exercise 4 (cache bytes).** A model has 40 layers, 40 query heads of d = 128 and 8 K/V heads, stored
# in bf16. Return `(per_token_bytes, ratio)`: the bytes of KV cache one token adds, and how many times
# more a model with 40 K/V heads (no GQA) would need.


# %%
def kv_cache_bytes():
    ### BEGIN SOLUTION
    per_token = 2 * 8 * 128 * 2 * 40
    return per_token, (2 * 40 * 128 * 2 * 40) / per_token
    ### END SOLUTION


# %% tags=["check"]
check("KV cache bytes per token", kv_cache_bytes, (163_840, 5.0))

# %% [markdown]
# **Exercise 5 (cumulative lengths).** Write `locate(lengths, row)` for packed sequences of these lengths:
# return `(cu_seqlens, b, i)`, the cumulative lengths as a list (0 first, the total last) and the sequence b
# and the position i within it of packed row `row`. Sequences of length 0 own no row.


# %%
def locate(lengths, row):
    ### BEGIN SOLUTION
    cu_seqlens = [0]
    for n in lengths:
        cu_seqlens.append(cu_seqlens[-1] + n)
    b = max(j for j in range(len(lengths)) if cu_seqlens[j] <= row and lengths[j] > 0)
    return cu_seqlens, b, row - cu_seqlens[b]
    ### END SOLUTION


# %% tags=["check"]
check(
    "rows of packed sequences",
    lambda: [locate([3, 0, 5, 1], r) for r in (0, 2, 3, 7, 8)],
    [([0, 3, 3, 8, 9], b, i) for b, i in ((0, 0), (0, 2), (2, 0), (2, 4), (3, 0))],
)

# %% [markdown]
# ## Summary
#
# - `torch.compile` traces with **fake tensors**. A Triton launch inside an `autograd.Function` is traced
#   into and handed to the compiler; a **custom operator** (`torch.library.custom_op`) with a fake
#   implementation and a registered autograd is one opaque node instead, forward and backward, and the
#   kernels run as in eager mode. `course_lib.attention.op.flash_attention_op` is that operator.
# - **Grouped-query attention**: query head h uses K/V head ⌊h / G⌋. The kernels read shared K/V tiles
#   instead of repeating them and sum dK, dV over each group; the KV cache shrinks by G.
# - **Causal alignment**: top-left (j ≤ i, SDPA's `is_causal`) for a sequence from its start; bottom-right
#   (j ≤ i + Nk − Nq) for new queries after a cache. Rows that see no key give O = 0, L = −∞.
# - **Sliding windows**: query i sees the W keys ending at its position. Blocks before the window are never
#   loaded, so the work falls from about N²/2 to about N · W; the window's edge is masked like the diagonal.
# - **Attention sinks** (gpt-oss, in every layer): a per-head logit that starts each row's running max and sum; its
#   gradient is −Σ e^(s − L) · D over the head's rows.
# - **Packed sequences** (varlen): sequences of different lengths one after another with cumulative lengths;
#   each program reads its sequence's bounds and uses its lengths, so no padding is computed. A padded
#   batch is packed by its mask; under `torch.compile` that is one operator, since the packed shapes depend
#   on the mask's values.
# - **transformers**: `use_in_transformers()` registers a mask hook (no mask for plain causal attention) and
#   an attention function ("course_lib"); `model.set_attn_implementation("course_lib")` then runs prefill,
#   cached decoding and training on the kernels (padded batches packed), and calls with masks they cannot
#   apply go to SDPA.
#
# Next, notebook 09 looks inside the decoding step itself: one query row against a long cache.
