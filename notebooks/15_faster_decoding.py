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
# # 15 · Faster decoding: more than one token per step
#
# Notebook 09 showed that a decoding step is **memory-bound**: at batch 1 it reads every weight and the whole
# KV cache to produce one token, and the arithmetic units mostly wait. Reading the same bytes for gamma + 1
# query rows costs about the same as for one. This notebook spends that idle arithmetic: guess several tokens
# cheaply, then let the model check them all in one step, keeping only what it would have produced itself.
#
# **Learning goals**
# 1. Speculative decoding: a draft proposes gamma tokens, the target verifies them in one multi-token step
#    over the paged cache (notebook 10), the rejected tail is rolled back. Greedy output unchanged; with
#    sampling, you write the **rejection rule** that keeps the target's distribution exactly.
# 2. Predict, then measure, the tokens per target step, (1 - alpha^(gamma+1)) / (1 - alpha), and the speed-up
#    (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)) from the acceptance rate alpha and the cost ratio c.
# 3. Parallel decoding without a draft: you write the **Jacobi update**; lookahead decoding reuses its n-grams.
# 4. Early exit (leave at an intermediate layer when sure) and why it is not exact, against
#    self-speculative decoding (the first layers draft, the whole model verifies), which is.
#
# The finished pieces live in `course_lib.speculative` (`engine`, `acceptance`, `drafts`, `metrics`,
# `jacobi`, `early_exit`).

# %% [markdown]
# ## 0. Sizes
#
# A target and a one-layer draft of the capstone's architecture (notebook 12), both trained briefly on the
# course corpus so that the draft agrees with the target often enough to measure. On a CPU both are tiny
# and train for a few seconds; the attention of every step reads the paged cache through `TorchPagedKV`
# (the same pages, PyTorch arithmetic: the Triton interpreter takes about a second per step here). On a GPU
# the models are notebook 12's size and attention is course_lib's paged decode kernel.

# %%
import time

import matplotlib.pyplot as plt
import torch

import course_lib
from course_lib.exercises import check, check_cases, predict
from course_lib.models import Llama, LlamaConfig, data, train
from course_lib.models.generate import greedy_reference
from course_lib.perf import plotting
from course_lib.speculative import (
    LayerDraft,
    ModelDraft,
    NGramDraft,
    early_exit_generate,
    expected_tokens,
    forward_tokens,
    jacobi_generate,
    jacobi_update,
    lookahead_generate,
    plain_generate,
    predicted_speedup,
    speculative_generate,
    truncate,
)
from course_lib.speculative.steps import new_cache

CONFIG = course_lib.pick(
    cpu=LlamaConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=176, max_seq_len=256),
    gpu=LlamaConfig(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, hidden_dim=1024, max_seq_len=1024),
)
DRAFT_CONFIG = LlamaConfig(**{**CONFIG.as_dict(), "n_layers": 1})
BACKEND = course_lib.pick(cpu="sdpa", gpu="course_lib")
ATTENTION = course_lib.pick(cpu="torch", gpu="kernel")
TRAIN_SECONDS = course_lib.pick(cpu=(7, 3), gpu=(20, 8))  # target, draft
BATCH, SEQ_LEN = course_lib.pick(cpu=(16, 64), gpu=(32, 256))  # training sequences per step
STEPS = course_lib.pick(cpu=400, gpu=800)  # the learning-rate schedule's length; the time cap stops first
NEW = course_lib.pick(cpu=40, gpu=160)  # tokens generated per prompt
GAMMAS = course_lib.pick(cpu=(1, 2, 4), gpu=(1, 2, 4, 6))
DEVICE = course_lib.DEVICE
if not course_lib.ON_GPU:
    torch.set_num_threads(1)  # one CPU thread: small matrices run 8x faster on a shared 2-core machine
plotting.use_readable_defaults()
_ = torch.manual_seed(0)

# %%
tokens = data.encode(data.load_corpus())
target = Llama(CONFIG, BACKEND).to(DEVICE)
draft_model = Llama(DRAFT_CONFIG, BACKEND).to(DEVICE)
for m, seconds in zip((target, draft_model), TRAIN_SECONDS):
    h = train.train(
        m, tokens, steps=STEPS, batch_size=BATCH, seq_len=SEQ_LEN, warmup=20, max_seconds=seconds, progress=False
    )
    print(f"{m.config.n_layers} layers: {len(h['step'])} steps, loss {h['loss'][0]:.2f} -> {h['loss'][-1]:.2f}")
_ = target.eval(), draft_model.eval()
prompts = [data.encode(p).tolist() for p in ("The ", "Return a new list of ", "If the file does not exist, ")]

# %% [markdown]
# ## 1. Why a step can check several tokens for the price of one
#
# Notebook 09's model of a decoding step: time ≈ (weight bytes + B · KV bytes) / bandwidth, as long as the
# arithmetic, 2 · parameters FLOPs per token, stays below what the GPU does in that time. An H200 reads
# 4.8 TB/s and multiplies at about 990 TFLOP/s (dense bf16): it can do ~200 FLOPs per byte read, and a
# decoding step does about 1 per weight byte (2 FLOPs per 2-byte weight). So feeding gamma + 1 = 5 tokens
# instead of 1 multiplies the FLOPs by 5 and leaves the bytes alone: the step still waits on memory.
#
# Measure it on the target: one step over 1, 2, 4 and 8 new tokens of one sequence.

# %%
def step_time(model, n_new, repeats=9):
    cache = new_cache(model, 16, 16)
    cache.add_sequence(0)
    forward_tokens(model, cache, [(0, prompts[1])], ATTENTION)  # the prompt in the cache
    times = []
    for _ in range(repeats):
        start = cache.seqs[0].length
        if course_lib.ON_GPU:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        forward_tokens(model, cache, [(0, prompts[0][:1] * n_new)], ATTENTION)
        if course_lib.ON_GPU:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        truncate(cache, 0, start)
    return sorted(times)[len(times) // 2]


widths = (1, 2, 4, 8)
step_s = {n: step_time(target, n) for n in widths}
for n in widths:
    print(f"{n} new tokens: {step_s[n] * 1e3:6.2f} ms per step ({step_s[n] / step_s[1]:.2f}x one token)")

# %% [markdown]
# On a GPU the four times are nearly equal: the step is memory- and launch-bound. (On a CPU the small
# model's step is dominated by Python and small-matrix overheads, which hardly grow with the rows either;
# neither tells you about arithmetic.) That is the whole budget of this notebook: checking gamma + 1
# tokens costs about one step.
#
# ## 2. Speculative decoding
#
# One **round** for each sequence (Leviathan et al. 2023; Chen et al. 2023):
# 1. the draft proposes gamma tokens x₁..x_γ (gamma cheap steps, or a look-up);
# 2. the target runs **one** step over the pending token and x₁..x_γ: gamma + 1 query rows, causal over the
#    sequence's paged cache, so row i gives p_i, the target's next-token distribution after x₁..x_i;
# 3. keep a prefix of the drafts and add one token of the target's own (so a round never emits fewer tokens
#    than a plain step);
# 4. **roll back** the K/V of the rejected drafts: the sequence's length shrinks and pages past the new end
#    return to the pool (`course_lib.speculative.truncate`; a page another sequence shares loses one reference
#    and stays with it).
#
# Greedy (temperature 0): keep x_i while it equals argmax p_{i-1}; the output is the target's greedy output,
# token for token. Two drafts: **prompt lookup** (find the last few tokens earlier in the text and propose what
# followed them; no model) and the **one-layer model** trained above.
#
# **Prediction.** Before running it: with gamma = 4 drafts a round, how many tokens will each target step
# of the one-layer draft produce on average (1 = no gain, 5 = every draft kept)? Think of how often a
# one-layer model, trained a third as long, picks the same next byte as the four-layer one. Type your
# estimate in place of the value (the instructor's worked figure: drafts kept about 60 % of the time).

# %%
tokens_guess = predict("tokens per target step (1-layer draft at gamma 4)", 2.3, unit=" tokens")

# %%
def same_tokens(name, got, expected):
    """Greedy output must be plain decoding's, token for token. On a GPU a step over several query rows may
    sum in another order than a one-row step, and a float near-tie can then flip one token: said, not hidden."""
    if got == expected:
        return True
    assert course_lib.ON_GPU, f"{name}: not the tokens of plain greedy decoding"
    print(f"{name}: differs from plain decoding (a near-tie summed in another order on the GPU)")
    return False


reference = plain_generate(target, prompts, NEW, attention=ATTENTION)
ngram = speculative_generate(target, NGramDraft(), prompts, NEW, gamma=4, attention=ATTENTION)
small = speculative_generate(target, draft_model, prompts, NEW, gamma=4, attention=ATTENTION)
same_tokens("n-gram draft", ngram.tokens, reference.tokens)
same_tokens("1-layer draft", small.tokens, reference.tokens)
for name, r in (("plain", reference), ("n-gram draft", ngram), ("1-layer draft", small)):
    print(f"{name:>14}: {r.target_steps:3d} target steps for {NEW} tokens per prompt")
print("continuation:", repr(data.decode(prompts[1]) + data.decode(reference.tokens[1])))

# %% [markdown]
# The prompts in one batch keep different numbers of drafts each round: the next round simply feeds each
# sequence its own pending token and drafts (the verification step is ragged, as notebook 10's steps are).
# Each round of one sequence, drawn as its kept drafts (green), the rejected ones (red, rolled back) and the
# target's own token (blue):

# %%
fig, ax = plt.subplots(figsize=(9, 3.2))
for row, r in enumerate((ngram, small)):
    x = 0
    for proposed, kept in r.rounds[1]:
        ax.barh(row, kept, left=x, color="tab:green")
        ax.barh(row, 1, left=x + kept, color="tab:blue")
        ax.barh(row, proposed - kept, left=x + kept + 1, color="tab:red", alpha=0.5)
        x += proposed + 1
ax.set_yticks([0, 1], ["n-gram draft", "1-layer draft"])
ax.set(xlabel="tokens fed to the target: kept (green), the target's own (blue), rejected (red)",
       title="what each verification step keeps (prompt 2)")
plt.show()

# %% [markdown]
# **Exercise 1 (the rollback).** After a round, a sequence that held `length` tokens in its pages keeps only the
# first `new_length` (its kept drafts and the target's token), and its rejected tail leaves the cache. `pages`
# lists the page ids holding its tokens in order, `page_size` tokens each (the last page may be partly full).
# Write `rollback(pages, new_length, page_size)`, returning `(kept, released)` as int64 tensors: the pages that
# still hold one of the first `new_length` tokens, in order, and the pages that no longer hold any, in order.
# (`course_lib.speculative.truncate` does this on the cache, and hands the released pages back to the
# allocator: a page another sequence shares only loses one reference.)
#
# The check builds a real paged cache, two sequences filled turn by turn (so page ids are not consecutive),
# and compares with `truncate`: cuts inside a page, on a page boundary, to zero tokens, no cut, one-token pages.

# %%
def rollback(pages, new_length, page_size):
    """(kept, released) int64 tensors: the pages still holding one of the first new_length tokens, the rest."""
    ### BEGIN SOLUTION
    keep = -(-new_length // page_size)  # pages needed for new_length tokens, rounded up
    return torch.tensor(pages[:keep], dtype=torch.int64), torch.tensor(pages[keep:], dtype=torch.int64)
    ### END SOLUTION


# %% tags=["check"]
from course_lib.decode.cache import PagedKVCache


def rollback_case(length, new_length, page_size):
    """A cache of two sequences appended one token each in turn; sequence 1's pages before the cut and after."""
    cache = PagedKVCache(1, 2 * (length // page_size + 2), page_size, 1, 8, torch.float32, "cpu")
    cache.add_sequence(0)
    cache.add_sequence(1)
    for _ in range(length):
        cache.append(0, 1)
        cache.append(1, 1)
    before = list(cache.seqs[1].pages)
    truncate(cache, 1, new_length)
    return before, cache


def rollback_reference(length, new_length, page_size):
    before, cache = rollback_case(length, new_length, page_size)
    kept = list(cache.seqs[1].pages)
    return torch.tensor(kept, dtype=torch.int64), torch.tensor(before[len(kept) :], dtype=torch.int64)


rollback_cases = [
    dict(length=37, new_length=20, page_size=8),  # a cut inside a page: that page stays
    dict(length=37, new_length=16, page_size=8),  # a cut on a page boundary
    dict(length=37, new_length=37, page_size=8),  # every draft kept: nothing leaves
    dict(length=12, new_length=0, page_size=4),  # everything leaves
    dict(length=5, new_length=3, page_size=1),  # one token a page
    dict(length=16, new_length=15, page_size=16),  # one page, partly kept
]
def rollback_learner(length, new_length, page_size):
    return rollback(rollback_case(length, new_length, page_size)[0], new_length, page_size)


check_cases(
    "rollback",
    rollback_cases,
    rollback_learner,
    rollback_reference,
    rtol=0,
    atol=0,
    outputs=("kept", "released"),
)

# %% [markdown]
# ## 3. Sampling: the rejection rule
#
# With temperature > 0 we want the **same distribution** as the target's own sampling, not the same tokens.
# The draft drew x from q; the target's distribution at that position is p. The rule:
# - accept x with probability min(1, p(x) / q(x));
# - at the first rejection, draw the token from the residual norm(max(0, p − q)) and stop;
# - if all gamma drafts were accepted, draw one more from p_γ (a free token).
#
# Why it is exact: a token y comes out either as an accepted draft, with probability q(y) · min(1, p(y)/q(y)) =
# min(p(y), q(y)), or from the residual after a rejection, whose probability is 1 − Σ min(p, q) = Σ max(0, p − q);
# the two add up to min(p(y), q(y)) + max(0, p(y) − q(y)) = p(y).
#
# **Exercise 2 (the acceptance rule).** `p` is (k + 1, V), the target's probabilities at the k + 1 positions,
# `q` is (k, V), the draft's, `draft` the k drafted ids. Return `(kept, token)`: how many drafts are kept and
# the token the target adds. Draw with `torch.rand((), dtype=torch.float64, generator=generator)` and
# `torch.multinomial(probs, 1, generator=generator)`. (Where p equals q at a rejected position the residual is
# all zeros; a rejection there has probability 0, so any choice is fine; use p.)

# %%
def accept_draft(p, q, draft, generator=None):
    """p (k+1, V) and q (k, V) float64 probabilities, draft: k ids. Returns (kept, token)."""
    ### BEGIN SOLUTION
    for i, x in enumerate(draft):
        if float(torch.rand((), dtype=torch.float64, generator=generator)) * q[i, x] < p[i, x]:
            continue
        r = (p[i] - q[i]).clamp_min(0)
        r = r / r.sum() if r.sum() > 0 else p[i]
        return i, int(torch.multinomial(r, 1, generator=generator))
    return len(draft), int(torch.multinomial(p[len(draft)], 1, generator=generator))
    ### END SOLUTION


# %% tags=["check"]
def _rule_frequencies(rule, p, q, trials=3000):
    """The frequencies of the first emitted token and of the number of drafts kept, over `trials` rounds
    with fixed distributions p (k+1, V) and q (k, V), drafts drawn from q."""
    g = torch.Generator().manual_seed(0)
    first, kept = torch.zeros(p.shape[1], dtype=torch.float64), torch.zeros(len(q) + 1, dtype=torch.float64)
    for _ in range(trials):
        draft = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(len(q))]
        n, token = rule(p, q, draft, g)
        first[draft[0] if n > 0 else token] += 1
        kept[n] += 1
    return first / trials, kept / trials


def _rule_exact(p, q):
    beta = torch.minimum(p[:-1], q).sum(-1)  # the chance each position accepts
    kept = torch.tensor([beta[:n].prod() * (1 - beta[n] if n < len(q) else 1) for n in range(len(q) + 1)])
    return p[0], kept.double()


def _dist(*rows):
    return torch.tensor(rows, dtype=torch.float64)


_g = torch.Generator().manual_seed(1)
_p = torch.rand(3, 5, generator=_g, dtype=torch.float64).mul(2).softmax(-1)
_q = torch.rand(2, 5, generator=_g, dtype=torch.float64).mul(4).softmax(-1)
_cases = [
    {"p": _p, "q": _q},  # any draft
    {"p": _p, "q": _p[:2].clone()},  # the draft is the target: always kept
    {"p": _p, "q": _dist([0, 0, 1, 0, 0], [0, 1, 0, 0, 0])},  # a look-up draft: one-hot q
    {"p": _dist([0.5, 0.5, 0, 0, 0], [0.2] * 5), "q": _dist([0, 0, 0.5, 0.5, 0])},  # disjoint: never kept
]
check_cases(
    "speculative acceptance rule", _cases,
    lambda p, q: _rule_frequencies(accept_draft, p, q), _rule_exact,
    rtol=0, atol=0.04, outputs=("first token's distribution", "drafts kept"),
)  # fmt: skip

# %% [markdown]
# course_lib's `accept_sampled` stands in from here. With sampling the acceptance rate is another number
# than with greedy decoding: it is the overlap sum min(p, q) of the two distributions, not the chance that
# their top choices agree. The output is distributed as the target's own samples (tests/test_speculative.py
# checks it with a chi-square test, end to end):

# %%
g = torch.Generator().manual_seed(0)
sampled = speculative_generate(
    target, draft_model, prompts, NEW, gamma=4, temperature=0.8, generator=g, attention=ATTENTION
)
print(f"temperature 0.8: acceptance rate {sampled.acceptance_rate:.2f} (greedy: {small.acceptance_rate:.2f})")
print("sample:", repr(data.decode(prompts[2]) + data.decode(sampled.tokens[2])))

# %% [markdown]
# ## 4. How many tokens per step, and how much faster
#
# If each draft is kept with probability alpha, independently, a round emits 1 + alpha + ... + alpha^γ tokens:
#
# $$E[\text{tokens per target step}] = \frac{1 - \alpha^{\gamma + 1}}{1 - \alpha}.$$
#
# A round costs γ draft steps and one target step. With c = (draft step time) / (target step time):
#
# $$\text{speed-up} = \frac{1 - \alpha^{\gamma + 1}}{(1 - \alpha)(\gamma c + 1)}.$$
#
# The acceptance rate is measured as kept / (kept + rejections): a round that keeps all its drafts saw no
# rejection. From the greedy run above, alpha for the one-layer draft:

# %%
alpha = small.acceptance_rate
print(f"alpha (1-layer draft, greedy) = {alpha:.2f}; n-gram draft: {ngram.acceptance_rate:.2f}")

# %%
runs = {g_: speculative_generate(target, draft_model, prompts, NEW, gamma=g_, attention=ATTENTION) for g_ in GAMMAS}
for g_, r in runs.items():
    same_tokens(f"gamma {g_}", r.tokens, reference.tokens)
    print(f"gamma {g_}: alpha {r.acceptance_rate:.2f}, tokens per round {r.tokens_per_round:.2f} "
          f"(formula {expected_tokens(r.acceptance_rate, g_):.2f})")
tokens_guess.score(small.tokens_per_round)

# %% [markdown]
# The formula assumes a fixed acceptance probability; a real draft is right in runs (easy words) and wrong
# in runs, and the last round of a prompt proposes fewer drafts. Now the cost ratio c, from one-token steps
# of each model at batch 1, and the wall-clock speed-up against its prediction:

# %%
one = [prompts[1]]
t_target = plain_generate(target, one, NEW, attention=ATTENTION).seconds / NEW
t_draft = plain_generate(draft_model, one, NEW, attention=ATTENTION).seconds / NEW
c = t_draft / t_target
print(f"c = {t_draft * 1e3:.2f} ms / {t_target * 1e3:.2f} ms = {c:.2f}")
fig, ax = plt.subplots(figsize=(9, 4.5))
spec_runs = {}  # (draft, gamma) -> (run, c), for the measured-cost model below
for name, proposer, cost in (("1-layer draft", draft_model, c), ("n-gram draft", NGramDraft(), 0.0)):
    measured, predicted = [], []
    for g_ in GAMMAS:
        r = speculative_generate(target, proposer, one, NEW, gamma=g_, attention=ATTENTION)
        spec_runs[name, g_] = r, cost
        measured.append(t_target * NEW / r.seconds)
        predicted.append(predicted_speedup(r.acceptance_rate, g_, cost))
        print(f"{name}, gamma {g_}: alpha {r.acceptance_rate:.2f}, measured {measured[-1]:.2f}x, "
              f"predicted {predicted[-1]:.2f}x")
    line = ax.plot(GAMMAS, measured, "s-", label=f"{name}: measured (wall clock, batch 1)")[0]
    ax.plot(GAMMAS, predicted, "o--", color=line.get_color(), label=f"{name}: predicted from alpha and c")
ax.axhline(1, color="0.6", lw=1)
ax.set(xlabel="gamma (drafts per round)", ylabel="speed-up over plain decoding", xticks=GAMMAS,
       title="the speed-up follows alpha and the draft's cost c")
ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)
plt.show()

# %%
# The measured-cost model (`course_lib.speculative.cost_model_speedup`): the verification step timed per gamma
# (section 1's `step_time`) in place of "one step", the tokens per round as measured (n-gram look-ups left out).
from course_lib.speculative import cost_model_speedup

t_one, t_verify = step_time(target, 1), {g_: step_time(target, g_ + 1) for g_ in GAMMAS}
for (name, g_), (r, cost) in spec_runs.items():
    print(f"{name}, gamma {g_}: measured {t_target * NEW / r.seconds:.2f}x, textbook "
          f"{predicted_speedup(r.acceptance_rate, g_, cost):.2f}x, measured costs "
          f"{cost_model_speedup(r.tokens_per_round, t_one, g_ * cost * t_one, t_verify[g_]):.2f}x")

# %% [markdown]
# Read it: the gain needs a high alpha **and** a small c. A one-layer draft of a model of a few layers has c
# far from the ratio of their layers, because a step also pays for the embedding, the head and the launch
# and Python overheads, which the two models share; the real drafts of production systems are 10-50x smaller
# than their targets (Leviathan et al. report 2-3x on T5-XXL). The n-gram draft costs no model step
# (c = 0, its look-up is Python time, which the measurement includes): it wins whenever the text repeats
# itself, as a briefly trained model's greedy output does. On the CPU these models are tiny and barely
# trained: the numbers show that the formula tracks the measurement, not what a trained pair would gain.
#
# ## 5. Parallel decoding without a draft: Jacobi and lookahead
#
# Jacobi decoding (Santilli et al. 2023) guesses the next n tokens, feeds the last settled token and the n
# guesses in one step, and replaces each guess by the model's greedy choice at the position before it.
# If guess g₁ equals the model's first output o₀, then o₁ was computed after the right prefix and is right
# too, and so on: each step settles the agreeing prefix plus one token, and the fixed point is exactly the
# greedy output.
#
# **Exercise 3 (the Jacobi update).** `window = [t, g₁, ..., g_n]` is what was fed (the last settled token and
# the guesses), `outputs` the n + 1 greedy choices after each fed token. Return `(settled, next_guesses)`:
# `settled` = outputs[0..k], where g₁..g_k agreed with outputs[0..k-1]; `next_guesses` = the n guesses for
# the positions after the settled ones: the outputs not settled, then the last output repeated to make n.

# %%
def jacobi_step(window, outputs):
    """window: [t, g_1..g_n] (ints), outputs: n + 1 ints. Returns (settled list, next guesses list)."""
    ### BEGIN SOLUTION
    n, k = len(window) - 1, 0
    while k < n and window[k + 1] == outputs[k]:
        k += 1
    rest = list(outputs[k + 1 :])
    fill = rest[-1] if rest else outputs[k]
    return list(outputs[: k + 1]), (rest + [fill] * n)[:n]
    ### END SOLUTION


# %% tags=["check"]
_cases = [
    {"window": [7, 1, 2, 3], "outputs": [1, 2, 5, 6]},  # two guesses agree
    {"window": [7, 4, 4], "outputs": [1, 2, 3]},  # none agrees: one token settles
    {"window": [7, 1, 2], "outputs": [1, 2, 3]},  # all agree: n + 1 tokens
    {"window": [7, 9], "outputs": [9, 9]},  # one guess
]
check_cases(
    "jacobi update", _cases,
    lambda window, outputs: tuple(torch.tensor(x) for x in jacobi_step(window, outputs)),
    lambda window, outputs: tuple(torch.tensor(x) for x in jacobi_update(window, outputs)),
    outputs=("settled", "next guesses"),
)  # fmt: skip

# %% [markdown]
# course_lib's `jacobi_update` stands in. Lookahead decoding (Fu et al. 2024) keeps the n-grams the Jacobi
# window produces (a fed token and the model's outputs after it) and, in the same step, verifies the pooled
# n-grams that start with the last settled token; here they ride in the step as extra sequences forked
# from the main one (they share its pages). Both are exact:

# %%
N_WINDOW = 4
jac = jacobi_generate(target, prompts[1], NEW, n=N_WINDOW, attention=ATTENTION)
look = lookahead_generate(target, prompts[1], NEW, n=N_WINDOW, ngram=4, candidates=4, attention=ATTENTION)
same_tokens("Jacobi", jac.tokens, reference.tokens[1])
same_tokens("lookahead", look.tokens, reference.tokens[1])
for name, r in (("Jacobi", jac), ("lookahead", look)):
    print(f"{name:>9}: {r.steps} steps for {NEW} tokens = {r.steps / NEW:.2f} iterations per token")
fig, ax = plt.subplots(figsize=(8, 3.5))
ax.plot(jac.settled, "o-", label="Jacobi")
ax.plot(look.settled, "s-", label="lookahead")
ax.set(xlabel="step", ylabel="tokens settled", title="a model not trained for it settles ~1 token per Jacobi step")
ax.legend()
plt.show()

# %% [markdown]
# Vanilla Jacobi rarely settles more than one token per step on a model not trained for it: a guess two
# positions ahead was computed after a wrong guess one position ahead. Lookahead's n-grams help where the
# text repeats itself; Consistency LLMs fine-tune the model so that Jacobi converges quickly (2.4-3.4x).
#
# ## 6. Early exit, and self-speculation
#
# A token that is easy ("the" after "of") may not need every layer. **Early exit** (CALM, Schuster et al.
# 2022) reads the hidden state after layer l through the model's shared final norm and head and stops when
# the top-1 probability passes a threshold. The catch: later tokens attend to this token's K/V at **every**
# layer, and the skipped layers never computed them. CALM copies the exited hidden state up and pushes it
# through each skipped layer's norm and K/V projections (`course_lib.speculative.propagate_kv`); the full
# model would have used a deeper state, so the output is no longer the full model's. (Our briefly trained
# model was never trained to exit early, unlike CALM's or LayerSkip's, so its early layers are seldom sure.)

# %%
thresholds = (1.0, 0.5, 0.3, 0.2)
early = {t: early_exit_generate(target, prompts[1], NEW, t, attention=ATTENTION) for t in thresholds}
same_tokens("threshold 1 (every layer, the full model)", early[1.0].tokens, reference.tokens[1])
fig, ax = plt.subplots(figsize=(9, 4))
for t, r in early.items():
    same = sum(a == b for a, b in zip(r.tokens, reference.tokens[1])) / NEW
    ax.plot(r.layers, ".-", label=f"threshold {t}: {sum(r.layers) / NEW:.1f} layers, {same:.0%} tokens as full")
ax.set(xlabel="generated token", ylabel="layers run", yticks=range(1, CONFIG.n_layers + 1),
       title="early exit: a lower threshold leaves earlier")
ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)
plt.show()

# %% [markdown]
# The legend counts the tokens that still equal the full model's: below a threshold of 1 nothing guarantees
# it (on the repetitive text of a briefly trained model they may all agree; on real text the hard tokens
# differ), and the layers saved are what the threshold buys.
#
# **Self-speculative decoding** (LayerSkip, Elhoushi et al. 2024) keeps the cheap first layers as a draft but
# lets the whole model verify: no second model, and exact. LayerSkip trains with layer dropout and an
# early-exit loss so that the first layers draft well (1.34-2.16x reported); ours were not trained for it.

# %%
k = max(1, CONFIG.n_layers // 2)
selfspec = speculative_generate(target, LayerDraft(target, k), [prompts[1]], NEW, gamma=3, attention=ATTENTION)
same_tokens("self-speculative", selfspec.tokens[0], reference.tokens[1])
print(f"first {k} of {CONFIG.n_layers} layers as the draft: alpha {selfspec.acceptance_rate:.2f}, "
      f"{selfspec.tokens_per_round:.2f} tokens per target step; "
      f"speed-up {t_target * NEW / selfspec.seconds:.2f}x (wall clock, batch 1)")

# %% [markdown]
# ## 7. On an H200
#
# What a GPU run of this notebook measures, at batch 1 against plain decoding through the same paged kernel:
# the speculative speed-up for each gamma beside its prediction (the course's target: at least 1.5x with the
# best gamma, and the measurement within 15 % of the prediction), and the speed-ups of self-speculation and
# lookahead decoding (printed in sections 5 and 6). The verification step of section 1 should cost about one
# decode step up to gamma + 1 = 8.
#
# ## 8. Summary
#
# - A decoding step is memory-bound, so a step over gamma + 1 tokens costs about one step: speculative
#   decoding drafts gamma tokens cheaply and verifies them together, then rolls back the rejected K/V
#   (shrink the sequence, release its emptied pages).
# - Greedy verification gives the target's tokens exactly; the rejection rule (accept with min(1, p/q),
#   else draw from norm(max(0, p − q))) gives the target's distribution exactly.
# - Tokens per target step: (1 − α^(γ+1)) / (1 − α); speed-up: that over (γc + 1). Both the draft's
#   agreement α and its relative cost c matter.
# - Jacobi decoding reaches the greedy output as a fixed point, but an untrained model settles about one
#   token per step; lookahead verifies n-grams collected along the way. Early exit saves layers at the price
#   of exactness (the skipped layers' K/V are estimated); self-speculation keeps exactness.
#
# **Exercises**
# 1. Make the draft proposal adaptive: stop drafting when the draft's top-1 probability falls below 0.5.
#    How do alpha and the speed-up change?
# 2. Derive the gamma that maximises the predicted speed-up for alpha = 0.8 and c = 0.05
#    (`course_lib.speculative.best_gamma`), then check it by measurement.
# 3. Verify a **tree** of drafts (two candidates per position) with the batch-of-forks trick of lookahead
#    decoding. How many target rows does a tree of depth 3 cost?
