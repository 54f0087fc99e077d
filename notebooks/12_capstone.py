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
# # 12 · Capstone: a small Llama, built from the course's kernels, trained, then served
#
# Every earlier notebook built one piece. Here they carry a real model: a decoder-only transformer of the
# Llama family whose attention is our FlashAttention-2, whose RMSNorm and RoPE are our fused kernels, and
# whose serving path reads a paged KV cache with our split-KV decode kernel. On a Hopper GPU (the H200 of
# the recorded runs) part of the attention runs in other kernels of the course: where they measured
# faster, the forward and the backward's dK/dV kernel are the FlashAttention-3-style kernels written in
# Gluon (notebook 08c); the dQ kernel and every other shape stay FlashAttention-2 in Triton.
#
# **Learning goals**
# 1. Assemble a Llama-style model (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, tied embeddings) and
#    say which notebook built each piece.
# 2. Check it: the course_lib kernels give the logits and gradients of plain PyTorch with the same weights,
#    and the logits of Hugging Face transformers' `LlamaForCausalLM` (when installed) through a state-dict
#    mapping.
# 3. Train it on a byte-level corpus with a progress bar, a live loss curve, gradient accumulation and (on a
#    GPU) bf16 autocast; watch the samples go from noise towards words.
# 4. Serve it: several prompts of different lengths at once through the continuous-batching loop of
#    notebook 10, tokens streamed as they come, and the same greedy tokens as the plain path.
# 5. Read the H200 numbers: tokens/s and memory of training with our kernels vs SDPA vs eager attention, the
#    memory of a step split as parameters : gradients : optimizer states : activations (notebook 01's
#    1 : 1 : 6 with bf16 weights, and the 1 : 1 : 2 of autocast's fp32 weights, which the benchmark trains
#    with), and serving against transformers' `generate`.
#
# The finished pieces live in `course_lib.models` (`llama`, `convert`, `data`, `train`, `generate`) and the
# benchmark in `course_lib.bench.train`.

# %% [markdown]
# ## 0. Sizes
#
# On a CPU the model is tiny and trains for a fixed 60 optimizer steps with the plain PyTorch path (the
# Triton interpreter runs our kernels one program at a time, far too slowly to train): under a minute on two
# free cores, longer on a busy machine, and the same steps whatever the speed. Our kernels are still run and
# checked, on a very small model. On a GPU the same cells train a larger model with our kernels, for about
# 25 seconds.

# %%
import copy
import time

import matplotlib.pyplot as plt
import torch

import course_lib
from course_lib import flash_attention, records
from course_lib.bench.train import SERVE_LABELS
from course_lib.exercises import check, check_cases, predict
from course_lib.fused import rms_norm, rope
from course_lib.models import (
    Llama,
    LlamaConfig,
    convert,
    count_parameters,
    data,
    generate,
    kv_cache_bytes_per_token,
    train,
)
from course_lib.perf import plotting

CONFIG = course_lib.pick(
    cpu=LlamaConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=352, max_seq_len=256),
    gpu=LlamaConfig(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, hidden_dim=1024, max_seq_len=1024),
)
TRAIN_BACKEND = course_lib.pick(cpu="sdpa", gpu="course_lib")
SEQ_LEN, BATCH, ACCUM = course_lib.pick(cpu=(128, 8, 1), gpu=(512, 16, 2))
STEPS, MAX_SECONDS = course_lib.pick(cpu=(60, None), gpu=(400, 25))  # optimizer steps, wall-time cap (s)
CHECK_CONFIG = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96, max_seq_len=64)
CHECK_LEN = course_lib.pick(cpu=32, gpu=64)  # tokens in the kernel-vs-PyTorch check
NEW_TOKENS = course_lib.pick(cpu=24, gpu=200)  # tokens generated per prompt when serving
DEVICE = course_lib.DEVICE
plotting.use_readable_defaults()  # projector-sized fonts for every figure, plt's own included
_ = torch.manual_seed(0)

# %% [markdown]
# ## 1. Assemble the model from the pieces
#
# A Llama block is two pre-norm residual branches:
#
# $$h = x + \mathrm{Attention}(\mathrm{RMSNorm}(x)),\qquad \mathrm{out} = h + \mathrm{SwiGLU}(\mathrm{RMSNorm}(h)).$$
#
# | piece | what it computes | built in |
# | --- | --- | --- |
# | RMSNorm | $x / \sqrt{\mathrm{mean}(x^2) + \epsilon} \cdot w$, statistics in fp32 | notebook 11 |
# | RoPE | rotate each pair of dims of q and of k by the angle pos · θᵢ | notebook 11 |
# | attention | softmax(QKᵀ/√d) V, causal, with the online softmax | notebooks 03, 04, 06, 07 |
# | grouped-query attention | `n_heads` query heads share `n_kv_heads` K/V heads, no repeat | notebooks 08b, 09 |
# | KV cache, bottom-right causal | new queries see every cached key up to their own position | notebooks 09, 10 |
# | SwiGLU | $W_2(\mathrm{silu}(W_1 x) \odot W_3 x)$ | matmuls (notebook 01); the gate fused (notebook 11) |
#
# One argument, `backend`, picks the kernels: `"course_lib"` (our Triton kernels), `"sdpa"` (PyTorch's
# `scaled_dot_product_attention` and plain PyTorch norm and rotation), or `"eager"` (attention written out
# as in notebook 02). The weights are the same on every path: the backend only changes which function runs.

# %%
model = Llama(CONFIG, backend=TRAIN_BACKEND).to(DEVICE)
print(model.config)
print(f"{model.num_parameters():,} parameters; head_dim {CONFIG.head_dim}; "
      f"{CONFIG.n_heads} query heads share {CONFIG.n_kv_heads} K/V heads")
print(model.layers[0])
assert model.num_parameters() == count_parameters(CONFIG)

# %% [markdown]
# ### Your block
#
# **Exercise 1 (one block's forward, from the course's kernels).** Write `block_forward(block, x, cos, sin)`:
# the forward of one `TransformerBlock` with course_lib's kernels, from its weights. x is (B, N, dim); cos and
# sin are the RoPE tables of positions 0 .. N − 1, (N, head_dim). The pieces:
# - `rms_norm(x, weight, eps)` (notebook 11) with `block.attention_norm` and `block.ffn_norm` (each has
#   `.weight` and `.eps`);
# - the projections `block.attention.wq`, `wk`, `wv` (`nn.Linear`: call them on a (B, N, dim) tensor), whose
#   outputs are (B, N, heads × head_dim): view them as (B, N, heads, head_dim) and move the heads before
#   the tokens, (B, heads, N, head_dim), with `n_heads` query heads and `n_kv_heads` K/V heads
#   (`block.attention.c` is the config);
# - `rope(q, k, cos, sin)` (notebook 11) rotates q and k; `flash_attention(q, k, v, causal=True)`
#   (notebooks 06-08b; grouped-query attention needs no repeat);
# - the output back to (B, N, heads × head_dim), then `block.attention.wo`, and the residual;
# - the SwiGLU MLP `w2(silu(w1 h) * w3 h)` of `block.feed_forward` on the second norm, and its residual.
#
# The check compares it with the same block run with PyTorch's operations in float64 (its norms take their
# statistics in float32, Llama's rule), on a few lengths N (none a multiple of the kernels' blocks but one).


# %%
def block_forward(block, x, cos, sin):
    """h = x + Attention(RMSNorm(x)), out = h + SwiGLU(RMSNorm(h)) with course_lib's rms_norm, rope and
    flash_attention: x (B, N, dim) -> (B, N, dim); cos, sin (N, head_dim)."""
    c = block.attention.c
    B, N, _ = x.shape
    ### BEGIN SOLUTION
    a = rms_norm(x, block.attention_norm.weight, block.attention_norm.eps)
    q = block.attention.wq(a).view(B, N, c.n_heads, c.head_dim).transpose(1, 2)
    k = block.attention.wk(a).view(B, N, c.n_kv_heads, c.head_dim).transpose(1, 2)
    v = block.attention.wv(a).view(B, N, c.n_kv_heads, c.head_dim).transpose(1, 2)
    q, k = rope(q, k, cos, sin)
    o = flash_attention(q, k, v, causal=True)  # (B, n_heads, N, head_dim)
    h = x + block.attention.wo(o.transpose(1, 2).reshape(B, N, c.n_heads * c.head_dim))
    f = rms_norm(h, block.ffn_norm.weight, block.ffn_norm.eps)
    mlp = block.feed_forward
    return h + mlp.w2(torch.nn.functional.silu(mlp.w1(f)) * mlp.w3(f))
    ### END SOLUTION


# %% tags=["check"]
block_model = Llama(CHECK_CONFIG, "sdpa").to(DEVICE)
block_model.reset_parameters(std=0.1)
block_64 = copy.deepcopy(block_model.layers[0]).double().cpu()  # the reference: float64, PyTorch's attention


def block_case(B, N):
    g = torch.Generator().manual_seed(100 * B + N)
    return torch.randn(B, N, CHECK_CONFIG.dim, generator=g)


def block_learner(B, N):
    with torch.no_grad():
        cos, sin = block_model.rope_cos[:N], block_model.rope_sin[:N]
        return block_forward(block_model.layers[0], block_case(B, N).to(DEVICE), cos, sin)


def block_reference(B, N):
    with torch.no_grad():
        cos, sin = block_model.rope_cos[:N].double().cpu(), block_model.rope_sin[:N].double().cpu()
        return block_64(block_case(B, N).double(), cos, sin)


# float32 kernels against float64; a little looser on a GPU (other summation orders, approximate exp2, rsqrt)
block_tol = 1e-3 if course_lib.ON_GPU else 1e-4
check_cases(
    "Llama block forward",
    [dict(B=1, N=16), dict(B=2, N=7), dict(B=1, N=33), dict(B=2, N=CHECK_LEN - 3)],
    block_learner,
    block_reference,
    rtol=block_tol,
    atol=block_tol,
)

# %% [markdown]
# ## 2. Check it against the reference
#
# First our kernels against plain PyTorch, with the same weights: logits and every parameter's gradient.
# On the CPU this runs through the Triton interpreter, so the model is very small.

# %%
check_model = Llama(CHECK_CONFIG, "sdpa").to(DEVICE)
check_model.reset_parameters(std=0.1)
tokens = torch.randint(0, 256, (2, CHECK_LEN + 1), device=DEVICE)


def logits_and_grads(m, backend):
    m.backend = backend
    m.zero_grad(set_to_none=True)
    logits, loss = m(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


t0 = time.perf_counter()
ref_logits, ref_grads = logits_and_grads(check_model, "sdpa")
our_logits, our_grads = logits_and_grads(check_model, "course_lib")
# looser on a GPU: other float32 kernels there (SDPA's own, other summation orders); the CPU runs one exact path
tol = dict(atol=2e-2, rtol=2e-2) if course_lib.ON_GPU else dict(atol=1e-4, rtol=1e-4)
torch.testing.assert_close(our_logits, ref_logits, **tol)
for name, g in our_grads.items():
    torch.testing.assert_close(g, ref_grads[name], **tol)
worst = max((g - ref_grads[n]).abs().max().item() for n, g in our_grads.items())
print(f"logits: max |course_lib - sdpa| = {(our_logits - ref_logits).abs().max():.2e}; "
      f"largest gradient difference {worst:.2e} over {len(our_grads)} tensors "
      f"({time.perf_counter() - t0:.1f} s)")

# %% [markdown]
# Then the reference implementation everyone uses: transformers' `LlamaForCausalLM` built from a config with
# our sizes, loaded with our weights through a **state-dict mapping** (`course_lib.models.convert`). Both
# use the half-rotation RoPE layout, so the mapping is a renaming:
# `layers.0.attention.wq.weight` ↔ `model.layers.0.self_attn.q_proj.weight`,
# `feed_forward.w1 / w3 / w2` ↔ `mlp.gate_proj / up_proj / down_proj`, and so on.

# %%
print(convert.hf_name("layers.0.attention.wq.weight"), "|", convert.hf_name("layers.1.feed_forward.w2.weight"))
try:
    import transformers
except ImportError:
    transformers = None
    print("transformers is not installed here: `pip install transformers` to run this comparison.")
if transformers is not None:
    hf = convert.to_hf(check_model)
    hf_logits = hf(input_ids=tokens[:, :-1]).logits.detach()
    for backend in ("sdpa", "course_lib"):
        check_model.backend = backend
        ours = check_model(tokens[:, :-1]).detach()
        torch.testing.assert_close(ours, hf_logits, **tol)
        print(f"{backend:10} vs transformers {transformers.__version__}: "
              f"max |difference| of logits {(ours - hf_logits).abs().max():.2e}")

# %% [markdown]
# ## 3. The corpus
#
# We need English text that is already on the machine: no download at run time. Python itself ships
# plenty: the docstrings of its standard library. `course_lib.models.data.build_corpus()` gathered the prose
# paragraphs of about 150 modules once (no code examples, no tables) into `corpus.txt`, shipped with
# course_lib. The text is part of CPython, © Python Software Foundation, under the PSF License Agreement,
# which allows redistribution with the notice kept.
#
# Tokens are bytes: a vocabulary of 256, nothing to train, and a sample is readable as soon as the model
# has learnt to spell.

# %%
text = data.load_corpus()
all_tokens = data.encode(text)
train_tokens, val_tokens = data.split(all_tokens)
print(f"{len(text):,} characters -> {len(all_tokens):,} byte tokens "
      f"({len(train_tokens):,} for training, {len(val_tokens):,} held out)")
print(text[:400])

# %% [markdown]
# ## 4. Train
#
# `course_lib.models.train.train`: AdamW (β = 0.9, 0.95; weight decay on the matrices), a linear warm-up then
# a cosine learning rate, gradient clipping, and **gradient accumulation**: one optimizer step sees
# `BATCH × ACCUM` sequences, run as `ACCUM` micro-batches whose losses are divided by `ACCUM`, so only one
# micro-batch's activations are alive at a time. On a GPU the forward runs under bf16 autocast. Before
# training, the model's guesses are uniform over 256 bytes: a loss of ln 256 ≈ 5.55 nats.
#
# **Predict first: how many tokens per second will training process here?** A training step costs about
# 6 FLOPs per parameter per token (2 in the forward, 4 in the backward), plus attention's share, small at
# this sequence length. Divide a FLOP rate you believe this device sustains on matrices this small by the
# FLOPs per token. The measured rate counts the whole wall time of the `train.train` call, evaluations and
# loss-plot redraws included. Type your estimate in place of the value in `predict(...)` below.

# %%
print(f"{model.num_parameters():,} parameters -> about {6 * model.num_parameters() / 1e6:.0f} MFLOP per token "
      f"for the matmuls of forward and backward")  # fmt: skip
# Your prediction: training throughput in tokens per second on this device.
throughput_guess = predict("training throughput", 3_000, unit=" tokens/s")


# %%
def sample(m, prompt: str, n: int = 120, temperature: float = 0.8, seed: int = 0) -> str:
    """`n` bytes drawn from softmax(logits / temperature) after `prompt` (`generate.sample`: a KV cache,
    plain PyTorch attention, seeded). Greedy decoding of a small model soon loops on its likeliest word;
    sampling shows more of what it knows."""
    backend, m.backend = m.backend, "sdpa"
    g = torch.Generator().manual_seed(seed)
    tokens = generate.sample(m, data.encode(prompt).tolist(), n, temperature, generator=g)
    m.backend = backend
    return data.decode(tokens)


PROMPT = "The function returns "
before = sample(model, PROMPT)
print("before training:", repr(before[:80]))

history = train.train(
    model, train_tokens, steps=STEPS, batch_size=BATCH, seq_len=SEQ_LEN, accum_steps=ACCUM, lr=3e-3,
    val_tokens=val_tokens, eval_every=25, plot=train.LossPlot(every=10, title="loss falls as the model learns"),
    max_seconds=MAX_SECONDS,
)
first, last = history["val_loss"][0], history["val_loss"][-1]
print(f"{len(history['step'])} steps, {history['tokens']:,} tokens in {history['seconds']:.0f} s "
      f"({history['tokens_per_s']:,.0f} tokens/s); validation loss {first:.2f} -> {last:.2f} nats/byte")
assert last < first - 0.5
# what knowing only how often each byte occurs would score on the held-out text (cross-entropy, nats/byte)
freq = torch.bincount(train_tokens, minlength=256).double() / len(train_tokens)
unigram = -freq.clamp_min(1e-12).log()[val_tokens].mean().item()
print(f"byte frequencies alone would score {unigram:.2f} nats/byte on the held-out text; the model {last:.2f}")
assert last < unigram, "the words below: the model has learnt more than byte frequencies"
_ = throughput_guess.score(history["tokens_per_s"])

# %% [markdown]
# The sample after training (drawn at temperature 0.8). On the CPU, 60 steps of 8 sequences (the tokens
# printed above) bring the loss from ln 256 to below what byte frequencies alone score (printed above):
# the model has learnt which bytes are common, that spaces cut the text into word-sized pieces, and a few
# of the commonest short words ("the", "an"). Expect English-looking gibberish, not words. On a GPU, many
# times more tokens bring the loss lower and more real words into the sample. The served continuations
# below are greedy, so they repeat the likeliest words.

# %%
after = sample(model, PROMPT, 200)
print("after training:", PROMPT + after)

# %% [markdown]
# ## 5. Serve
#
# Serving many users means many prompts of different lengths at once. `generate.stream` hands them to
# notebook 10's `ContinuousBatcher`, which asks our model for a few sizes (layers, K/V heads, head dim, dtype,
# device) and one method: `forward_step(token_ids, positions, kv)` over the new tokens of every running
# sequence, laid one after another. Each attention layer calls
# `kv.attend(layer, q, k, v)`: K and V go into the **paged** cache and the **split-KV decode kernel**
# (notebooks 09, 10) attends over each sequence's pages. A prompt's first step is its prefill; after that
# each sequence brings one token per step. The first prompt's tokens are printed as they are streamed; all
# three continuations follow at the end.

# %%
model.eval()
prompts = [data.encode(p).tolist() for p in ("The ", "Return a new list of ", "If the file does not exist, ")]
streamed = [[] for _ in prompts]
t0 = time.perf_counter()
for i, token in generate.stream(model, prompts, NEW_TOKENS, page_size=16):
    streamed[i].append(token)
    if i == 0:
        print(data.decode([token]), end="", flush=True)
seconds = time.perf_counter() - t0
print()
for p, s in zip(prompts, streamed):
    print(repr(data.decode(p) + data.decode(s)))
print(f"{len(prompts) * NEW_TOKENS} tokens in {seconds:.1f} s")

# %% [markdown]
# The paged, batched, split-KV path must produce exactly the greedy tokens of the plain path: one prompt at a
# time, a contiguous cache, PyTorch attention.

# %%
model.backend = "sdpa"
plain = generate.greedy_cached(model, prompts, NEW_TOKENS)
model.backend = TRAIN_BACKEND
same = [a == b for a, b in zip(streamed, plain)]
print("same tokens as the plain path, per prompt:", same)
assert all(same)

# %% [markdown]
# ## 6. Read the numbers (H200)
#
# `python -m course_lib.bench.train` trains a ~100M-parameter model of the same design (dim 768, 16 layers,
# 6 query heads and 2 K/V heads of 128, SwiGLU 2048) at sequence 4096 for a few minutes. On a CPU we show
# the recorded run; on a GPU this notebook also measures its own model live below.
#
# Each row gives a step's wall time, the time of the kernels it ran and how many it ran
# (`course_lib.perf.kernel_stats`, from the profiler). When the two times are close, the GPU is the limit
# and the row compares kernels. When the kernels take much less than the step, the GPU sat waiting for
# the CPU to launch them, and the row compares Python and launch costs instead. The kernel count stays
# the same whatever the batch, while the kernels' time grows with it: the benchmark's micro-batch (8 ×
# 4096 tokens) is chosen large enough that a step takes only a little longer than its kernels (compare
# the two columns).

# %%
rec = records.load_record("train")
if rec is None:
    print("No recorded training run yet: run `python -m course_lib.bench.train` on a GPU.")
else:
    print("Training,", records.label(rec))
    print(f"{'provider':12} {'tokens/s':>10} {'step ms':>8} {'kernels ms':>10} {'kernels':>8} {'peak GiB':>9}")
    for r in rec["data"]["train"]:
        if r["status"] == "ok":
            print(f"{r['provider']:12} {r['tokens_per_s']:10,.0f} {r['step_ms']:8.1f} "
                  f"{r.get('kernel_ms', float('nan')):10.1f} {r.get('kernels_per_step', 0):8d} "
                  f"{r['peak_bytes'] / 2**30:9.1f}")  # fmt: skip
        else:
            print(f"{r['provider']:12} {r['status']}")
    ok = {r["provider"]: r for r in rec["data"]["train"] if r["status"] == "ok"}
    if "course_lib" in ok and "sdpa" in ok:
        ratio = ok["course_lib"]["tokens_per_s"] / ok["sdpa"]["tokens_per_s"]
        fewer = ok["sdpa"].get("kernels_per_step", 0) - ok["course_lib"].get("kernels_per_step", 0)
        print(f"the course_lib path trains at {ratio:.2f}x the tokens/s of the SDPA path in this record "
              f"(a whole step: attention and the fused RMSNorm and RoPE; {fewer} kernels fewer per step)")  # fmt: skip
    arec = records.load_record("attention")  # the attention alone, at the benchmark's nearest shape
    if arec is not None:
        near = {r["provider"]: r for r in arec["data"]["results"] if r["status"] == "ok" and r["mode"] == "fwd_bwd"
                and r["causal"] and r["N"] == 4096 and r["d"] == 128}  # fmt: skip
        if "course_lib" in near and "sdpa_default" in near:
            r = near["course_lib"]
            print(f"attention alone, forward + backward (attention benchmark: B={r['B']}, {r['H']} heads without "
                  f"GQA, N=4096, d=128, causal): course_lib {r['ms']:.2f} ms, SDPA {near['sdpa_default']['ms']:.2f} "
                  f"ms, {near['sdpa_default']['ms'] / r['ms']:.2f}x SDPA's speed")  # fmt: skip
            assert r["ms"] > near["sdpa_default"]["ms"], "the words below: course_lib's attention is the slower here"
    for name in ("course_lib", "sdpa"):  # the words above, checked: a step only a little longer than its kernels
        if ok.get(name, {}).get("kernel_ms"):
            assert ok[name]["step_ms"] < 1.15 * ok[name]["kernel_ms"], f"{name}: this record's steps waited on the CPU"

# %% [markdown]
# The two paths differ in more than the attention: "course_lib" also runs notebook 11's fused RMSNorm and
# RoPE, where "sdpa" runs them as several PyTorch operations each (hence the kernel counts). So the training
# ratio is not an attention-kernel ratio. The record does not split a step by kernel; the attention
# benchmark's nearest cell (other heads, no GQA) times the attention alone, and there course_lib's is the
# slower of the two (printed above). At least at that shape, the step's lead does not come from the
# attention kernel but from the rest of the step, the fused norm and rotation among it.
#
# **Memory of a training step.** Notebook 01 counted 16 bytes per parameter for Adam in mixed precision,
# P : G : optimizer states = 2 : 2 : 12 = **1 : 1 : 6**. That ratio holds for *bf16 weights and gradients
# with fp32 master weights inside the optimizer*. The common `torch.autocast` recipe keeps fp32 weights and
# gradients and casts to bf16 on the fly: 4 : 4 : 8 = **1 : 1 : 2**, still 16 bytes per parameter.
# Activations come on top and grow with batch × sequence; the benchmark measures parameters, optimizer states
# and activations with `torch.cuda.memory_allocated`, and counts the gradient tensors' bytes. The ratios below
# are taken against the gradients, whose bytes are exact: the parameters' figure also holds the model's
# buffers (the RoPE cos/sin tables) and the allocator's rounding, so it reads a little above 2 or 4 bytes.

# %%
if rec is not None:
    for m in rec["data"]["memory"]:
        bpp = m["bytes_per_param"]
        ratio = " : ".join(f"{v / bpp['gradients']:.2f}" for v in bpp.values())
        print(f"{m['scheme']:12} bytes/param P, G, OS = {', '.join(f'{v:.2f}' for v in bpp.values())}"
              f"  -> P : G : OS = {ratio};  activations {m['activations'] / 2**30:.2f} GiB "
              f"for {m['tokens']:,} tokens")
        # the words above: OS : G = 6 with fp32 master weights, 2 with autocast
        optimizer_per_gradient = {"bf16_master": 6, "autocast": 2}.get(m["scheme"])
        if optimizer_per_gradient:
            assert abs(bpp["optimizer_states"] / bpp["gradients"] / optimizer_per_gradient - 1) < 0.05, m["scheme"]

# %% [markdown]
# **Serving.** A decode step of this model is a long chain of small kernels: for every layer its norms,
# matmuls, rotation, attention and residual adds. Launched one at a time from
# Python, they cost the CPU more time than the GPU takes to run them, so the loop waits on the CPU. On a
# GPU, `generate.stream` therefore replays each decode step as a CUDA graph (notebook 10,
# `course_lib.decode.graphs`): the launches are recorded once per batch shape and replayed with one call.
# Capturing a graph costs a few plain runs of its step, so a server captures once and keeps its graphs
# (and its page pool) for every later request: `generate.make_batcher` builds such a loop, and
# `generate.serve(..., batcher=loop)` serves through it. The record times both ways and transformers'
# `generate`, each on its second full run (course_lib's through one kept loop): the first compiles
# kernels and captures the graphs. It also compares the tokens: graphs against plain launches (the same
# kernels, so the same bits), and course_lib's paged serving against the model's own step-by-step greedy
# decoding with SDPA and a contiguous cache. In float32 the tests find those the same token for token; in
# bf16 the two paths round differently, and where two logits of a step are within rounding of each other
# greedy decoding may take the other one, and every later token follows from it.

# %%
srec = records.load_record("serve")
if srec is not None:
    d = srec["data"]
    print("Serving,", records.label(srec))
    print(f"{len(d['prompt_lengths'])} prompts of {d['prompt_lengths']} bytes, {d['new_tokens']} new tokens each")
    print("tokens/s, timed on each provider's second full run (the first compiles kernels):")
    for name, label in SERVE_LABELS.items():
        if d.get(name, {}).get("tokens_per_s"):
            print(f"  {label:48} {d[name]['tokens_per_s']:8,.0f}")
    if "graphs_same_tokens_as_plain_launches" in d:
        print("graphs: same tokens as plain launches, per prompt:", d["graphs_same_tokens_as_plain_launches"])
    print("same tokens as SDPA's step-by-step greedy decoding, per prompt:", d["same_per_prompt"])
    print("  tokens alike before the first difference:", d["matching_prefix"], f"of {d['new_tokens']}")

# %% [markdown]
# On a GPU, this notebook's own (smaller) model, trained live with each path: two warm-up steps first (the
# first steps compile kernels and pick SDPA's backend, and would be timed at many times a later step), then
# the median of five runs of four optimizer steps each. At sequence 512 and dim 384 a step is short, so
# launch costs weigh more than in the record's 4096-token steps: the order of the three need not be the
# record's.

# %%
if course_lib.ON_GPU:
    live = {}
    for backend in ("course_lib", "sdpa", "eager"):
        model.backend = backend
        kw = dict(batch_size=BATCH, seq_len=SEQ_LEN, progress=False)
        train.train(model, train_tokens, steps=2, **kw)  # warm-up, not timed
        runs = sorted(train.train(model, train_tokens, steps=4, **kw)["tokens_per_s"] for _ in range(5))
        live[backend] = runs[2]  # the median
    model.backend = TRAIN_BACKEND
    for backend, rate in live.items():
        print(f"{backend:10} {rate:12,.0f} tokens/s ({rate / live['sdpa']:.2f}x the SDPA path; live, median of 5 "
              f"runs of 4 steps after 2 warm-up steps, seq {SEQ_LEN}, this notebook's model)")  # fmt: skip
    print("fastest here:", max(live, key=live.get))

# %% [markdown]
# ## Exercises
#
# Exercise 1 was one block's forward, in section 1. Each exercise has a cell to fill in and a check cell after
# it; a failed check shows a hint, the next failure the next one, and `course_lib.exercises.solution(name)`
# shows a worked answer.
#
# **Exercise 2 (parameters).** Write `n_params(vocab, dim, n_layers, n_heads, n_kv_heads, hidden)` for a
# Llama with tied embeddings: per layer Wq, Wk, Wv, Wo, the three SwiGLU matrices and two RMSNorm weights;
# then the embedding and the final norm. Check it on the benchmark's model.


# %%
def n_params(vocab, dim, n_layers, n_heads, n_kv_heads, hidden):
    ### BEGIN SOLUTION
    head_dim = dim // n_heads
    per_layer = 2 * dim * dim + 2 * dim * n_kv_heads * head_dim + 3 * dim * hidden + 2 * dim
    return n_layers * per_layer + vocab * dim + dim
    ### END SOLUTION


# %% tags=["check"]
check("parameter count", lambda: n_params(256, 768, 16, 6, 2, 2048),
      count_parameters(LlamaConfig(dim=768, n_layers=16, n_heads=6, n_kv_heads=2, hidden_dim=2048)), rtol=0)

# %% [markdown]
# **Exercise 3 (KV cache).** How many bytes does one token take in the KV cache of the benchmark's model in
# bf16? And how many would it take with as many K/V heads as query heads (no GQA)? Return both.


# %%
def kv_bytes_per_token():
    ### BEGIN SOLUTION
    n_layers, head_dim, bf16 = 16, 128, 2
    return 2 * n_layers * 2 * head_dim * bf16, 2 * n_layers * 6 * head_dim * bf16
    ### END SOLUTION


# %% tags=["check"]
_cfg = LlamaConfig(dim=768, n_layers=16, n_heads=6, n_kv_heads=2, hidden_dim=2048)
check("KV-cache bytes per token", kv_bytes_per_token,
      (kv_cache_bytes_per_token(_cfg), kv_cache_bytes_per_token(LlamaConfig(**{**_cfg.as_dict(), "n_kv_heads": 6}))),
      rtol=0)

# %% [markdown]
# **Exercise 4 (memory of a training step).** Predict the bytes of parameters, gradients and AdamW states
# (exp_avg and exp_avg_sq) for *this notebook's* model trained in fp32 (the CPU path) or under autocast with
# fp32 weights (the GPU path), given its parameter count `n`. Return a dict with the keys `"parameters"`,
# `"gradients"` and `"optimizer states"` (both AdamW states together). The check counts the tensors after
# one optimizer step.


# %%
def training_state_bytes(n):
    ### BEGIN SOLUTION
    return {"parameters": 4 * n, "gradients": 4 * n, "optimizer states": 8 * n}
    ### END SOLUTION


# %% tags=["check"]
def _measured_state_bytes(m):
    opt = train.make_optimizer(m, 1e-4)
    x, y = data.get_batch(train_tokens, 2, 32, torch.Generator().manual_seed(0), DEVICE)
    m.backend = "sdpa"
    m(x, y)[1].backward()
    opt.step()
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)
    states = [v for st in opt.state.values() for k, v in st.items() if k != "step"]
    return {"parameters": size(m.parameters()), "gradients": size(p.grad for p in m.parameters()),
            "optimizer states": size(states)}


check("training-step memory", lambda: training_state_bytes(model.num_parameters()),
      _measured_state_bytes(Llama(CONFIG).to(DEVICE)), rtol=0)

# %% [markdown]
# **Exercise 5 (open).** Train with `ACCUM = 4` and a quarter of the batch: is the loss curve the same? What
# changes in the time per step and in the peak memory (on a GPU, `torch.cuda.max_memory_allocated`)? On a
# GPU, set a step's wall time against `course_lib.perf.kernel_stats(lambda: train.train(model, ..., steps=1))`
# for micro-batches of 1, 4 and 16 sequences: from which size on is the GPU, not the CPU, the limit?
#
# ## Summary
#
# - A Llama block is RMSNorm → grouped-query attention with RoPE → residual, RMSNorm → SwiGLU → residual.
#   Each piece was built in an earlier notebook; `course_lib.models.Llama` puts them together, and one
#   argument switches between our kernels, SDPA and eager attention over the same weights.
# - A state-dict mapping (a renaming, since both use the half-rotation RoPE layout) loads the same weights into
#   transformers' `LlamaForCausalLM`, and its logits agree within the dtype's tolerance (our kernels also
#   give plain PyTorch's gradients).
# - A byte-level model trained for 60 steps on a CPU learns byte frequencies, spaces and a few short words
#   (its samples are English-looking gibberish); 25 seconds on a GPU bring many times more tokens and more
#   real words; training uses AdamW, warm-up and cosine, gradient accumulation and, on a GPU, bf16 autocast.
# - Serving batches prompts of different lengths over a paged KV cache with the split-KV decode kernel, and
#   gives the plain path's greedy tokens exactly.
# - Adam costs 16 bytes per parameter either way; P : G : OS is 1 : 1 : 6 with bf16 weights and fp32 master
#   weights in the optimizer, 1 : 1 : 2 with autocast's fp32 weights. Activations come on top, and the
#   attention's share of them is what FlashAttention keeps linear in the sequence length.
