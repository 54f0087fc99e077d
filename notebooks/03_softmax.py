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
# # 03 · Softmax three ways
#
# Attention applies a softmax to every row of the score matrix S = Q Kᵀ / √d. FlashAttention never holds
# a whole row of S: it sees the keys one block at a time. This notebook builds the piece of arithmetic
# that makes that possible, in plain NumPy, before any GPU appears.
#
# **Learning goals**
# 1. Find where the textbook softmax overflows in float16, bfloat16 and float32, and watch it produce inf
#    and NaN.
# 2. Make it safe by subtracting the row maximum, and count what that costs: three passes over the data.
# 3. Derive the **online softmax** (Milakov & Gimelshein, 2018) and write it yourself: one pass keeps a
#    running max `m` and a running sum `l`, rescaling `l` when `m` grows. Two passes in total instead of three.
# 4. Merge the states `(m, l)` of two blocks exactly, in any order, and the partial attention outputs
#    `(O, L)` of two blocks of keys: what tiled attention (notebook 04) and split-KV decoding rely on.
# 5. Handle the edge cases: `-inf` entries, huge and tiny magnitudes, rows of length 1.
#
# The finished functions live in `course_lib.softmax`: `naive_softmax`, `safe_softmax`, `online_softmax`,
# `softmax_state`, `merge_states`, `online_state`.

# %% [markdown]
# ## 0. Sizes
#
# Everything here is NumPy on the CPU, so the sizes are the same with or without a GPU. `ROWS` × `N` is the
# size of the arrays we test the vectorised functions on; `N_TRACE` is the length of the row whose online
# pass we watch step by step.

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch

import course_lib
from course_lib import softmax
from course_lib.exercises import check, predict
from course_lib.perf import plotting

ROWS, N = course_lib.pick(cpu=(8, 1024), gpu=(8, 1024))
N_TRACE = 24
rng = np.random.default_rng(3)
plotting.use_readable_defaults()  # projector-sized fonts for every figure, plt's own included

# %% [markdown]
# ## 1. The textbook softmax
#
# For a row x of N numbers,
#
# $$\mathrm{softmax}(x)_i = \frac{e^{x_i}}{\sum_{j=1}^{N} e^{x_j}}.$$
#
# Every output is positive and the outputs sum to 1. Written directly:


# %%
def naive_softmax_row(x):
    e = np.exp(x)
    return e / e.sum()


x = rng.standard_normal(8).astype(np.float32)
y = naive_softmax_row(x)
assert (y > 0).all() and abs(float(y.sum()) - 1.0) < 1e-6
print("x          :", np.round(x, 3))
print("softmax(x) :", np.round(y, 3))

# %% [markdown]
# ## 2. Where `exp` overflows
#
# A floating-point type has a largest finite value: 65504 for float16, about 3.4 × 10³⁸ for float32 and
# bfloat16 (bf16: float32's 8 exponent bits with only 8 bits of precision, the course's GPU dtype).
# `exp(x)` is larger than that as soon as x > log(max). Because results are rounded to the nearest
# representable number, the exact boundary is within one unit in the last place of log(max) rounded to the
# type; we find it by walking along the representable numbers with `np.nextafter`.


# %%
def first_overflow(dtype):
    """The smallest value x of `dtype` whose exp(x) is inf in that dtype."""
    x = dtype(np.log(np.float64(np.finfo(dtype).max)))
    with np.errstate(over="ignore"):
        while np.isfinite(np.exp(x)):
            x = np.nextafter(x, dtype(np.inf))
        while not np.isfinite(np.exp(np.nextafter(x, dtype(-np.inf)))):
            x = np.nextafter(x, dtype(-np.inf))
    return x


print(f"{'dtype':8} {'largest finite':>15} {'log(max)':>12} {'last finite x':>20} {'first x -> inf':>20}")
for dtype in (np.float16, np.float32, np.float64):
    x_inf = first_overflow(dtype)
    last_ok = np.nextafter(x_inf, dtype(-np.inf))
    with np.errstate(over="ignore"):
        assert np.isinf(np.exp(x_inf)) and np.isfinite(np.exp(last_ok))
    largest = np.float64(np.finfo(dtype).max)
    print(f"{dtype.__name__:8} {largest:15.4g} {np.log(largest):12.6f}", end="")
    print(f" {float(last_ok)!r:>20} {float(x_inf)!r:>20}")

# NumPy has no bfloat16: torch does. Every bf16 number in [80, 96] (they are 0.5 apart there), exp of each.
xs = torch.linspace(80, 96, 4097).to(torch.bfloat16).unique()
overflows = torch.isinf(torch.exp(xs))
largest = float(torch.finfo(torch.bfloat16).max)
print(f"{'bfloat16':8} {largest:15.4g} {np.log(largest):12.6f}", end="")
print(f" {float(xs[~overflows][-1])!r:>20} {float(xs[overflows][0])!r:>20}")
assert float(xs[overflows][0]) == 89.0 and float(xs[~overflows][-1]) == 88.5

# %% [markdown]
# Scores of 12 or 89 are not exotic: with trained weights, attention logits in the tens are common. Attention
# kernels load bf16 (the course's GPU dtype) or float16 inputs, but they **upcast the scores to float32**
# before `exp`, so a kernel that computes `exp(s)` without subtracting a maximum breaks at the first score
# above 88.72 (float32's limit; bf16's is the same, 88.5 being its last safe number). Code that
# exponentiates in float16 itself, like the NumPy function above, breaks already above 11.09. Watch the naive
# softmax turn one large entry into NaN (NumPy warns about the overflow too):

# %%
row16 = np.array([0.0, 1.0, 2.0, 12.0], dtype=np.float16)
row32 = np.array([0.0, 1.0, 2.0, 89.0], dtype=np.float32)
bad16, bad32 = naive_softmax_row(row16), naive_softmax_row(row32)
print("float16, max entry 12:", bad16)
print("float32, max entry 89:", bad32)
assert np.isnan(bad16).any() and np.isnan(bad32).any()  # exp(12) = inf in float16, inf / inf = NaN

# %% [markdown]
# The other end fails too. When every entry is very negative, every `exp` **underflows** to 0 and the
# softmax is 0 / 0. The true answer does not care about a shift of the whole row: `[-200, -201]` has the
# same softmax as `[0, -1]`.

# %%
tiny = np.array([-200.0, -201.0], dtype=np.float32)
with np.errstate(invalid="ignore"):
    under = naive_softmax_row(tiny)
print(
    "naive softmax of [-200, -201] in float32:",
    under,
    " (true answer:",
    naive_softmax_row(np.array([0.0, -1.0])),
    ")",
)
assert np.isnan(under).all()

# %% [markdown]
# ## 3. Safe softmax: subtract the maximum
#
# For any constant c, multiplying numerator and denominator by $e^{-c}$ changes nothing:
#
# $$\frac{e^{x_i}}{\sum_j e^{x_j}} = \frac{e^{x_i - c}}{\sum_j e^{x_j - c}}.$$
#
# Choose c = m = max(x). Then every exponent is ≤ 0, so no `exp` overflows; and the largest term is
# exactly $e^0 = 1$, so the sum is at least 1 and never 0. The price: we must know m **before** we can
# start summing. That is three passes over the row:


# %%
def safe_softmax_row(x):
    m = x.max()  # pass 1: read x
    l = np.exp(x - m).sum()  # pass 2: read x
    return np.exp(x - m) / l  # pass 3: read x, write y


for row in (row16, row32, tiny):
    expected = naive_softmax_row(row.astype(np.float64) - row.max())  # exact enough: float64, shifted
    got = safe_softmax_row(row)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, rtol=2e-3, atol=1e-6)
print("safe softmax of the rows that broke the naive one:", safe_softmax_row(row16), safe_softmax_row(tiny))

# %% [markdown]
# ## 4. Counting memory passes
#
# Softmax does a handful of operations per element, so on a GPU its time is the time to move the data:
# it is **memory-bound** (notebook 01). If a row is too long to stay on chip, each pass reads it again from
# HBM. Let us count element reads and writes with a stand-in for HBM: an array that counts every access.


# %%
class Counted:
    """A 1-D array standing in for HBM: it counts every element read and written."""

    def __init__(self, data):
        self.data = np.array(data)
        self.reads = 0
        self.writes = 0

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        self.reads += 1
        return self.data[i]

    def __setitem__(self, i, value):
        self.writes += 1
        self.data[i] = value


def safe_softmax_loop(x, y):
    m = -np.inf
    for i in range(len(x)):  # pass 1: the maximum
        m = max(m, x[i])
    l = 0.0
    for i in range(len(x)):  # pass 2: the sum, under that maximum
        l += np.exp(x[i] - m)
    for i in range(len(x)):  # pass 3: normalise
        y[i] = np.exp(x[i] - m) / l


x_hbm, y_hbm = Counted(rng.standard_normal(N)), Counted(np.zeros(N))
safe_softmax_loop(x_hbm, y_hbm)
np.testing.assert_allclose(y_hbm.data, softmax.safe_softmax(x_hbm.data), rtol=1e-12)
print(f"safe softmax, N = {N}: {x_hbm.reads} reads = {x_hbm.reads // N} N, {y_hbm.writes} writes = N")
assert (x_hbm.reads, y_hbm.writes) == (3 * N, N)

# %% [markdown]
# ## 5. Online softmax: the max and the sum in one pass
#
# Can passes 1 and 2 be fused? Define, after seeing the first j entries,
#
# $$m_j = \max_{i \le j} x_i, \qquad l_j = \sum_{i \le j} e^{x_i - m_j}.$$
#
# $l_j$ is the sum of pass 2, but taken under the maximum *seen so far*. When $x_j$ arrives, the maximum
# may grow, and every term already in the sum was computed against the old maximum. Factor it out:
#
# $$l_j = \sum_{i<j} e^{x_i - m_j} + e^{x_j - m_j}
#       = e^{m_{j-1} - m_j} \sum_{i<j} e^{x_i - m_{j-1}} + e^{x_j - m_j}
#       = l_{j-1}\, e^{m_{j-1} - m_j} + e^{x_j - m_j}.$$
#
# So the update for each new entry is
#
# $$m_j = \max(m_{j-1}, x_j), \qquad l_j = l_{j-1}\, e^{m_{j-1} - m_j} + e^{x_j - m_j},$$
#
# starting from $m_0 = -\infty$, $l_0 = 0$. The factor $e^{m_{j-1} - m_j}$ is exactly 1 when the maximum
# did not change and smaller than 1 when it grew: the old sum is **rescaled** to the new maximum. Every
# exponent is ≤ 0, so nothing overflows. After the last entry, $m_N$ and $l_N$ are the m and l of the safe
# softmax, and one more pass normalises.


# %% [markdown]
# **Exercise 1 (the one-pass online softmax).** Write `online_softmax_loop(x, y)`, the counterpart of
# `safe_softmax_loop` above: one pass over `x` that keeps the running max and the running sum together
# (the update above, from $m_0 = -\infty$, $l_0 = 0$), then one pass that writes the softmax into `y`. Read
# each `x[i]` once per pass. The check runs it on a row of N entries stored in `Counted` arrays and
# compares the output with the safe softmax, and the counts with 2 N reads and N writes.


# %%
def online_softmax_loop(x, y):
    ### BEGIN SOLUTION
    m, l = -np.inf, 0.0
    for i in range(len(x)):  # pass 1: running max and running sum together
        xi = x[i]
        m_new = max(m, xi)
        l = l * np.exp(m - m_new) + np.exp(xi - m_new)
        m = m_new
    for i in range(len(x)):  # pass 2: normalise
        y[i] = np.exp(x[i] - m) / l
    ### END SOLUTION


# %% tags=["check"]
def _counted_run(loop, data):
    """(y, reads of x, writes of y) of `loop` on Counted copies of `data`."""
    x_c, y_c = Counted(data), Counted(np.zeros(len(data)))
    loop(x_c, y_c)
    return y_c.data, x_c.reads, y_c.writes


_row = rng.standard_normal(N) * 5
check(
    "online softmax loop (one pass for m and l)",
    lambda: _counted_run(online_softmax_loop, _row),
    (softmax.safe_softmax(_row), 2 * N, N),
    parts=["y", "reads of x", "writes of y"],
)

# %% [markdown]
# For a memory-bound kernel, time follows bytes. Per element, safe softmax moves 3 reads + 1 write and the
# online softmax 2 reads + 1 write (`course_lib.softmax.online_softmax` is the finished piece): a predicted
# speed-up of 4/3 on rows too long to keep on chip. (A row that *does* fit on chip is read once by a fused
# kernel, whatever the algorithm.) The real prize comes in attention: there the "row" is a row of
# S = Q Kᵀ that is never written to memory at all, and the normalisation moves to the output, once per row
# (notebook 04).

# %%
bytes_per_element = 4  # float32
print(
    f"bytes moved per element: safe {4 * bytes_per_element}, online {3 * bytes_per_element}; "
    f"predicted speed-up {4 / 3:.2f}x for long rows"
)

# %% [markdown]
# ## 6. Watching m and l
#
# We record the state after every entry of a short row and plot it. The row is made up so that the
# maximum grows several times, after `l` has had time to build up. Where the running max jumps, the
# rescaling factor $e^{m_{j-1} - m_j}$ drops below 1 and the old sum is scaled down: the old terms count
# for less under the new, larger maximum, and the new entry contributes exactly $e^0 = 1$.

# %%
trace_row = np.array(
    [
        0.0,
        0.4,
        -0.6,
        0.2,
        0.1,
        -0.3,
        2.0,
        1.6,
        1.8,
        0.9,
        1.2,
        1.7,
        1.0,
        1.9,
        3.5,
        2.8,
        3.0,
        3.2,
        2.5,
        3.3,
        2.9,
        3.1,
        4.0,
        3.4,
    ]
)
assert len(trace_row) == N_TRACE
# the state (m_j, l_j) after the first j entries, by course_lib's finished online pass
states_j = [softmax.online_state(trace_row[:j]) for j in range(1, N_TRACE + 1)]
ms, ls = [float(m_j) for m_j, _ in states_j], [float(l_j) for _, l_j in states_j]
factors = np.exp(np.array([-np.inf, *ms[:-1]]) - np.array(ms))  # e^{m_{j-1} - m_j}, from m_0 = -inf
assert np.isclose(ls[-1], np.exp(trace_row - trace_row.max()).sum())  # the safe softmax's denominator

# %%
steps = np.arange(1, N_TRACE + 1)
grew = np.array(factors) < 1
fig, axes = plt.subplots(3, 1, figsize=(9.0, 8), sharex=True, constrained_layout=True)
axes[0].plot(steps, trace_row, "o", color="#555555", label="entry $x_j$")
axes[0].step(steps, ms, where="post", color="#d94801", linewidth=2, label="running max $m_j$")
axes[0].set_ylabel("value")
axes[0].legend(loc="lower right")
axes[1].plot(steps, ls, "o-", color="#2171b5", label="running sum $l_j$")
axes[1].plot(
    steps[grew], np.array(ls)[grew], "o", ms=11, mfc="none", mec="#d94801", label="max grew: l rescaled"
)
axes[1].set_ylabel("$l_j$ (sum of exp)")
axes[1].legend(loc="upper left")
axes[2].bar(steps, factors, color=np.where(grew, "#d94801", "#9ecae1"))
axes[2].set_ylabel(r"factor $e^{m_{j-1}-m_j}$")
axes[2].set_xlabel("entries seen, j")
axes[0].set_title("Online softmax: whenever the running max grows,\nthe running sum is rescaled down")
plt.show()

# %% [markdown]
# (The first factor is $e^{-\infty} = 0$: the empty sum starts from nothing.)
#
# That row was made up to rescale often. How often does the running max grow in a *random* row of N = 1024
# entries, counting the first entry? A kernel that rescaled only when the max grows would pay a multiply
# per element of the accumulator that often (the course's kernels rescale at every block, by the factor
# α = e^{m_old − m_new}, which is 1 when the max did not move, and keeps every thread on one path;
# FlashAttention-4 skips small rescales). Reason it out (how likely is entry j to be the largest of the first
# j?), type your estimate in place of the value in the next cell, then count on random rows.

# %%
rescale_guess = predict("times the max grows in a random row of 1024", 7.5)  # your prediction

# %%
rows = rng.standard_normal((200, 1024))
grows = (rows == np.maximum.accumulate(rows, axis=1)).sum(axis=1)  # entry j is a new running max
print(f"the max grew {grows.mean():.1f} times per row on average (min {grows.min()}, max {grows.max()})")
_ = rescale_guess.score(grows.mean())
harmonic = sum(1 / j for j in range(1, 1025))
print(f"1 + 1/2 + ... + 1/1024 = {harmonic:.2f}")

# %% [markdown]
# Entry j is a new maximum with probability 1/j (each of the first j entries is equally likely to be the
# largest), so the expected count is $1 + 1/2 + \dots + 1/N \approx \ln N + 0.58$: about 7.5 for N = 1024,
# and only about 14 for a million entries. Rescaling is rare after the first few entries; only a row
# whose values keep rising (like the made-up one) rescales often.
#
# ## 7. Merging partial results
#
# The update above is a special case of something more useful. Cut a row into two disjoint parts A and B,
# and summarise each by its own state $(m_A, l_A)$ and $(m_B, l_B)$. The state of the whole row is
#
# $$m = \max(m_A, m_B), \qquad l = l_A\, e^{m_A - m} + l_B\, e^{m_B - m},$$
#
# by the same factoring as in section 5. Nothing is approximated. A single entry $x_j$ is the state
# $(x_j, 1)$, and merging it into the running state is exactly the online update. The merge is
# commutative and associative, so blocks may be processed **in any order, or in parallel, and merged as a
# tree**. Tiled attention processes blocks of keys one after the other (notebook 04); split-KV decoding
# hands blocks of keys to different GPU programs and merges their states at the end.

# %%
row = rng.standard_normal(N) * 3.0
blocks = np.array_split(row, 8)
states = [softmax.softmax_state(b) for b in blocks]
whole = softmax.softmax_state(row)


def merge_all(states):
    acc = states[0]
    for s in states[1:]:
        acc = softmax.merge_states(acc, s)
    return acc


def merge_tree(states):
    while len(states) > 1:
        states = [
            softmax.merge_states(*states[i : i + 2]) if i + 1 < len(states) else states[i]
            for i in range(0, len(states), 2)
        ]
    return states[0]


orders = {
    "left to right": merge_all(states),
    "right to left": merge_all(states[::-1]),
    "random order": merge_all([states[i] for i in rng.permutation(len(states))]),
    "pairwise tree": merge_tree(states),
}
for name, (m_, l_) in orders.items():
    print(f"{name:14}: m = {m_:.6f}, l = {l_:.12f}")
    assert m_ == whole[0] and np.isclose(l_, whole[1], rtol=1e-13), name

# %% [markdown]
# The state has a single-number form too: the **logsumexp** $L = m + \log l = \log \sum_j e^{x_j}$,
# computed without overflow. Merging is then $L = \log(e^{L_A} + e^{L_B})$, NumPy's `logaddexp`.
# FlashAttention-2 keeps exactly this L per row for its backward pass; FlashAttention-1 stored both m and l,
# and storing only L is one of FlashAttention-2's changes (notebook 04).

# %%
L_A = states[0][0] + np.log(states[0][1])
L_B = states[1][0] + np.log(states[1][1])
m_AB, l_AB = softmax.merge_states(states[0], states[1])
assert np.isclose(m_AB + np.log(l_AB), np.logaddexp(L_A, L_B), rtol=1e-14)
print(f"L(A ∪ B) = {m_AB + np.log(l_AB):.12f} = logaddexp(L_A, L_B) = {np.logaddexp(L_A, L_B):.12f}")

# %% [markdown]
# Attention carries one more thing per row: the output $O = \sum_j p_j v_j$, the values weighted by the
# softmax. A part A of the keys gives a *partial* output, normalised over its own keys only:
# $O_A = \sum_{j \in A} e^{x_j - L_A} v_j$, with its logsumexp $L_A$. Part A holds the share $e^{L_A - L}$ of
# the row's probability mass, so the two partial states $(O_A, L_A)$ and $(O_B, L_B)$ merge exactly too:
#
# $$L = \log(e^{L_A} + e^{L_B}), \qquad O = e^{L_A - L}\, O_A + e^{L_B - L}\, O_B.$$
#
# This is how split-KV decoding combines the programs that each saw a block of keys (notebooks 09 and 13);
# exercise 3 asks you to write it.

# %% [markdown]
# ## 8. The finished functions in `course_lib.softmax`
#
# `naive_softmax`, `safe_softmax` and `online_softmax` work along the last axis of an array of any rank and
# return the array's dtype: naive and safe compute in it, online keeps its state (m, l) in at least
# float32, as a kernel does. `online_softmax(x, block_size=B)` walks the row B entries at a time, taking
# each block's state and merging it in: B = 1 is the element-by-element update above, larger B is what
# attention does with a block of keys. We check them against each other and against a float64 reference,
# on a 3-D array. (Block size 1 adds one term at a time to l, so its rounding error grows with N; larger
# blocks sum their terms pairwise first. Both stay far inside what float32 needs.)

# %%
x3 = (rng.standard_normal((2, ROWS // 2, N)) * 4).astype(np.float32)
reference = softmax.safe_softmax(x3.astype(np.float64))
results = {
    "naive": softmax.naive_softmax(x3),
    "safe": softmax.safe_softmax(x3),
    "online, block 1": softmax.online_softmax(x3),
    "online, block 64": softmax.online_softmax(x3, block_size=64),
}
for name, y in results.items():
    assert y.shape == x3.shape and y.dtype == np.float32, name
    err = float(np.abs(y - reference).max())
    print(f"{name:17}: max |error| against float64 = {err:.2e}")
    np.testing.assert_allclose(y, reference, rtol=1e-4, atol=1e-7, err_msg=name)
np.testing.assert_allclose(reference.sum(axis=-1), 1.0, rtol=1e-12)

# %% [markdown]
# ## 9. Edge cases
#
# A kernel meets all of these in practice: masked positions (-inf), rows of huge scores, rows of tiny
# scores, and sequences of length 1. The conventions of `course_lib.softmax`:
# - a `-inf` entry gets probability exactly 0 (exp(-inf) = 0);
# - a row that is `-inf` everywhere has no softmax: all three functions return NaN (as the formula and
#   `torch.softmax` do); its state is (m, l) = (-inf, 0), which merges as "nothing seen".

# %%
inf = np.inf
masked = np.array([[0.5, -inf, 1.5, -inf], [-inf, -inf, -inf, 2.0], [-inf, -inf, -inf, -inf]])
for fn in (softmax.naive_softmax, softmax.safe_softmax, softmax.online_softmax):
    y = fn(masked)
    assert (y[0, [1, 3]] == 0).all() and np.isclose(y[0].sum(), 1.0), fn.__name__
    assert y[1].tolist() == [0.0, 0.0, 0.0, 1.0], fn.__name__
    assert np.isnan(y[2]).all(), fn.__name__
empty = softmax.softmax_state(masked[2])
assert empty == (-inf, 0.0)
merged = softmax.merge_states(empty, softmax.softmax_state(masked[0]))
assert np.allclose(merged, softmax.softmax_state(masked[0]))  # the empty state changes nothing
print("-inf entries: probability 0; all -inf row: NaN; empty state (-inf, 0) merges as a no-op")

# %%
huge = np.array([1e4, 1e4 - 1.0, -1e4, 3e38], dtype=np.float32)
small = (rng.standard_normal(N) * 1e-30).astype(np.float32)
single = np.array([[5.0], [-3e38], [3e38]], dtype=np.float32)

assert np.isnan(softmax.naive_softmax(huge)).any()  # exp(1e4) overflows
for fn in (softmax.safe_softmax, softmax.online_softmax):
    y = fn(huge)
    assert y.tolist() == [0.0, 0.0, 0.0, 1.0], fn.__name__  # 3e38 dominates: everything else is e^(-huge)
    np.testing.assert_allclose(fn(small), np.full(N, 1.0 / N), rtol=1e-6, err_msg=fn.__name__)
    assert (fn(single) == 1.0).all(), fn.__name__
assert np.isnan(softmax.naive_softmax(single)[2])  # even length 1 overflows the naive formula
print("huge magnitudes: safe and online exact, naive NaN; tiny magnitudes: uniform 1/N; length 1: exactly 1")

# %% [markdown]
# Kernels take their inputs in half precision: bf16 on the course's GPU, or float16. They upcast to float32
# before `exp` and keep m and l in float32 (`course_lib.softmax` keeps the online state in float32 for a
# float16 input the same way). NumPy has float16 but no bf16, so float16 stands in here: the safe and online
# softmax stay finite and accurate on float16 inputs, where the naive one, computing in float16, already
# fails at scores above 11:

# %%
x16 = (rng.standard_normal((ROWS, N)) * 6).astype(np.float16)
ref16 = softmax.safe_softmax(x16.astype(np.float64))
assert np.isnan(softmax.naive_softmax(x16)).any()
for fn in (softmax.safe_softmax, softmax.online_softmax):
    y = fn(x16)
    assert y.dtype == np.float16 and np.isfinite(y).all(), fn.__name__
    print(f"{fn.__name__:15} float16: max |error| = {float(np.abs(y - ref16).max()):.1e}")
    np.testing.assert_allclose(y.astype(np.float64), ref16, atol=2e-3, err_msg=fn.__name__)

# %% [markdown]
# ## Exercises
#
# Each exercise has a cell to fill in and a check cell after it. Later cells never use your answers.
#
# **Exercise 2 (overflow).** Which is the smallest float32 input whose `exp` is `inf` in float32? Write
# `smallest_overflowing_float32()` without looping over numbers: start from log(max) and step with
# `np.nextafter` only as far as you must (zero or one step: test `np.exp(x)` first). The check compares
# with the value we found in section 2.


# %%
def smallest_overflowing_float32():
    ### BEGIN SOLUTION
    x = np.float32(np.log(np.float64(np.finfo(np.float32).max)))
    with np.errstate(over="ignore"):
        if np.isfinite(np.exp(x)):
            x = np.nextafter(x, np.float32(np.inf))
    return x
    ### END SOLUTION


# %% tags=["check"]
check(
    "smallest overflowing float32", lambda: smallest_overflowing_float32(), 88.72283935546875, rtol=0, atol=0
)

# %% [markdown]
# **Exercise 3 (merge).** Write `merge(state_a, state_b)`, the merge of two states `(m, l)` of arrays of
# rows, from the formula in section 7. It must handle the empty state (-inf, 0) (no NaN!): exp(-inf - (-inf))
# is NaN in NumPy, so treat a maximum of -inf specially.


# %%
def merge(state_a, state_b):
    ### BEGIN SOLUTION
    (m_a, l_a), (m_b, l_b) = state_a, state_b
    m = np.maximum(m_a, m_b)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    return m, l_a * np.exp(m_a - m_safe) + l_b * np.exp(m_b - m_safe)
    ### END SOLUTION


# %% tags=["check"]
_a = softmax.softmax_state(np.array([[1.0, 2.0], [-inf, -inf], [-inf, -inf], [30.0, -2.0]]))
_b = softmax.softmax_state(np.array([[5.0, -1.0], [0.0, 3.0], [-inf, -inf], [1.0, 29.0]]))
check("merge of two states", lambda: merge(_a, _b), softmax.merge_states(_a, _b))

# %% [markdown]
# **Exercise 4 (merge two partial outputs).** Write `merge_outputs(O_a, L_a, O_b, L_b)`: rows of partial
# attention outputs `O_a`, `O_b` (R, d) and their logsumexps `L_a`, `L_b` (R,), from two disjoint parts of
# the keys; return `(O, L)` of attention over all the keys (the formula at the end of section 7). A part
# in which a row saw no key has O = 0 and L = -inf: it must change nothing, and a row that saw no key in
# either part keeps O = 0 and L = -inf (no NaN). And $e^{L}$ may overflow even in float64: one row's
# scores are near 800.


# %%
def merge_outputs(O_a, L_a, O_b, L_b):
    ### BEGIN SOLUTION
    L = np.logaddexp(L_a, L_b)
    L_safe = np.where(np.isneginf(L), 0.0, L)  # a row empty in both parts: both weights exp(-inf) = 0
    return np.exp(L_a - L_safe)[:, None] * O_a + np.exp(L_b - L_safe)[:, None] * O_b, L
    ### END SOLUTION


# %% tags=["check"]
def _attend(x, values):
    """Attention of score rows x (R, n) over `values` (n, d): (O, L), O = 0 and L = -inf for an all -inf row."""
    m, l = softmax.softmax_state(x)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    with np.errstate(divide="ignore"):
        L = m + np.log(l)
    p = np.exp(x - m_safe[:, None]) / np.where(l > 0, l, 1.0)[:, None]
    return p @ values, L


_x = rng.standard_normal((5, 12)) * 3
_x[1, :5] = -inf  # row 1: no key in part A
_x[2, :] = -inf  # row 2: no key at all
_x[3] += 800.0  # row 3: exp(L) overflows even float64
_x[4, 5:] = -inf  # row 4: no key in part B
_vals = rng.standard_normal((12, 3))
check(
    "merge of two partial outputs (O, L)",
    lambda: merge_outputs(*_attend(_x[:, :5], _vals[:5]), *_attend(_x[:, 5:], _vals[5:])),
    _attend(_x, _vals),
    parts=["O", "L"],
)

# %% [markdown]
# **Exercise 5 (streaming).** Keys often arrive in chunks (a KV cache that grows during generation).
# Write `streaming_softmax(chunks)`: given a list of 1-D arrays, return the softmax of their
# concatenation. Keep only the state (m, l) during the first pass over the chunks (use
# `softmax.softmax_state` and `softmax.merge_states`), then make a second pass to normalise.


# %%
def streaming_softmax(chunks):
    ### BEGIN SOLUTION
    state = (-np.inf, 0.0)
    for c in chunks:
        state = softmax.merge_states(state, softmax.softmax_state(c))
    m, l = state
    return np.concatenate([np.exp(c - m) / l for c in chunks])
    ### END SOLUTION


# %% tags=["check"]
_chunks = [rng.standard_normal(n) * 5 for n in (3, 17, 1, 40)]
check("streaming softmax", lambda: streaming_softmax(_chunks), softmax.safe_softmax(np.concatenate(_chunks)))

# %% [markdown]
# **Exercise 6 (bytes).** A float16 array of R rows and N columns is too long per row to stay on chip.
# How many bytes do the safe softmax and the online softmax move between HBM and the chip (reads plus
# writes)? Return a pair `(safe_bytes, online_bytes)` for R = 4096, N = 32768.


# %%
def softmax_bytes(R, N, bytes_per_element=2):
    ### BEGIN SOLUTION
    elements = R * N
    return 4 * elements * bytes_per_element, 3 * elements * bytes_per_element
    ### END SOLUTION


# %% tags=["check"]
check(
    "bytes of safe and online softmax",
    lambda: [softmax_bytes(4096, 32768), softmax_bytes(1000, 3000, 4)],  # float16, then float32
    [(1_073_741_824, 805_306_368), (4 * 1000 * 3000 * 4, 3 * 1000 * 3000 * 4)],
)

# %% [markdown]
# ## Summary
#
# - The textbook softmax overflows once an input passes log(max): **11.09 in float16, 88.72 in float32**
#   (and in bf16, which has float32's range; kernels upcast bf16 and float16 scores to float32 before
#   `exp`), and gives 0/0 when every input is very negative. Subtracting the row maximum fixes both, at the price of
#   a third pass over the row.
# - The **online softmax** keeps a running max m and a running sum l; when m grows, l is rescaled by
#   $e^{m_{old} - m_{new}}$. The max and the sum then take one pass, and the softmax two instead of three.
# - States (m, l) of disjoint blocks **merge exactly**, in any order or as a tree; the logsumexp
#   L = m + log l is the same state in one number (FlashAttention-2 stores only L). Partial attention
#   outputs merge the same way: $O = e^{L_A - L} O_A + e^{L_B - L} O_B$.
# - Conventions: -inf entries get probability 0; an all -inf row has state (-inf, 0) and softmax NaN.
#
# Next, notebook 04 puts the online softmax inside attention: the row of scores is produced one block of
# keys at a time, and the normalisation moves to the output O, once per row.
