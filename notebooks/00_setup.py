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
# # 00 · Setup and a tour of the course
#
# **FlashAttention from First Principles** takes you from the roofline model to a fast FlashAttention-2
# written in Triton, forward and backward. Every notebook runs on a laptop CPU; on a CUDA GPU the same
# notebooks compile their kernels and run at real sizes.
#
# **Learning goals of this notebook**
# 1. Check that your environment works, and know whether your Triton kernels are *compiled* (GPU) or
#    *interpreted* (CPU).
# 2. Know where notebook sizes come from, and how GPU figures reach you when you have no GPU.
# 3. Know how the course is laid out, and how homework imports `course_lib`.
# 4. Make a prediction before a measurement, and see how it is scored.
# 5. Do one small exercise and see how exercises are checked, with hints and worked answers.

# %% [markdown]
# ## 1. The environment doctor
#
# `import course_lib` makes one decision before anything else: where Triton kernels run.
# With a CUDA GPU they are compiled to GPU code. Without one, Triton's **interpreter** runs each kernel in
# Python on the CPU, one program instance after another: the results are the same, the speed is not
# (thousands of times slower), so CPU notebooks use small sizes.
#
# The doctor prints what you run with and flags known-bad combinations. The same report is available
# from a terminal: `python -m course_lib doctor`.

# %%
import course_lib
from course_lib.doctor import doctor

healthy = doctor()
assert healthy, "The doctor found a problem: read its PROBLEMS list above and apply the fix it gives."

# %% [markdown]
# ## 2. CPU or GPU: one decision, one place for sizes
#
# The decision is exposed as `course_lib.RUNTIME` (with `DEVICE`, `ON_GPU`, `INTERPRET`). Each notebook
# chooses its sizes in one cell near the top with `course_lib.pick(cpu=..., gpu=...)`, so you can see at a
# glance what it will run. On a GPU you may raise them; on a CPU, keep them small.
#
# To run the CPU path on a GPU machine (to see what a laptop learner sees), start Jupyter with
# `COURSE_DEVICE=cpu make lab`.

# %%
print("device      :", course_lib.DEVICE)
print("interpreted :", course_lib.INTERPRET)
print("why         :", course_lib.RUNTIME.reason)

# The sizes this notebook uses, chosen in one place:
N_TOUR = course_lib.pick(cpu=[64, 128, 256, 512], gpu=[1024, 2048, 4096, 8192])
HEAD_DIM = 64

# %% [markdown]
# ## 3. A first look: attention's cost grows with N²
#
# `course_lib.attention.reference.attention` is standard attention written the obvious way: it builds the full
# N × N score matrix. Every kernel in the course is tested against it (in float64). Let us time it as the
# sequence length N doubles.
#
# **Predict, then measure.** Every measured notebook of the course works this way: you write down a number
# *before* the measurement, and the measurement scores it. Here: suppose the time of one call is spent on
# the N × N matrices (computing and moving them). How many times longer does one call take when N doubles?
# Work it out, then type your estimate in place of the value in `predict(...)` below (in the student
# edition it reads `None`; in the instructor edition it holds a worked answer) and run the cell.
# `course_lib.exercises.predict` notes the number down; after the measurement, `.score(...)` says how close
# it was (within 2x counts as good) and, when it was far off, asks which assumption the measurement broke.
# A prediction left at `None` is not an error: the measurement runs and says "unscored".

# %%
from course_lib.exercises import predict

# Your prediction: how many times longer does one call take when N doubles? (type your number in place of the value)
doubling = predict("time growth per doubling of N", 4, unit="x")

# %%
import torch

from course_lib.attention.reference import attention
from course_lib.perf.plotting import plot_series
from course_lib.perf.timing import benchmark


def fastest_ms(fn, reps=1 if course_lib.ON_GPU else 9):
    """The fastest of `reps` timings (each a median on a GPU): other programs only ever add time."""
    return min(benchmark(fn, cpu_reps=1) for _ in range(reps))


times_ms = []
for n in N_TOUR:
    q, k, v = (torch.randn(1, 4, n, HEAD_DIM, device=course_lib.DEVICE) for _ in range(3))
    times_ms.append(fastest_ms(lambda: attention(q, k, v)))

growth = [b / a for a, b in zip(times_ms, times_ms[1:])]
print("time (ms):", [f"{t:.3f}" for t in times_ms])
print("growth per doubling of N:", [f"{g:.2g}x" for g in growth])
for n, g in zip(N_TOUR[1:], growth):
    if 3 <= g <= 5:
        why = "close to 4x: the N x N matrices dominate"
    elif g < 3:
        why = "less than 4x: fixed costs (Python, launching, allocating) still weigh at this size"
    else:
        why = "more than 4x: the matrices no longer fit a faster cache, or something else used the machine"
    print(f"  N = {n:5}: {g:.2g}x, {why}")
_ = doubling.score(sorted(growth)[len(growth) // 2])  # the median doubling: one disturbed timing does not decide

# %%
import matplotlib.pyplot as plt

ax = plot_series(
    N_TOUR,
    {"measured": times_ms, "N² from the first point": [times_ms[0] * (n / N_TOUR[0]) ** 2 for n in N_TOUR]},
    xlabel="sequence length N",
    ylabel="time per call (ms)",
    title=f"Standard attention time grows about as N² ({course_lib.DEVICE.type})",
    logx=True,
    logy=True,
)
plt.show()

# %% [markdown]
# Read the lines above against your prediction. An N × N matrix has four times the entries when N
# doubles, so if those matrices dominate, each doubling costs about **4×**. Small sizes are partly
# dominated by fixed costs, so early doublings often cost less than 4×; a doubling that costs much more
# than 4× usually means the matrices just outgrew a cache, or another program took the processor for a
# moment (a shared machine's timings scatter: run the cell again and compare). Notebook 02 explains *why*
# the N × N matrices, not the arithmetic, are the real cost on a GPU.
#
# ## 4. Figures from a GPU, when you have none
#
# Speed is a GPU story. The course shows two kinds of GPU numbers, and always says which one you are
# looking at:
#
# - **measured** figures: times, achieved bandwidths and FLOP/s. When you work on a CPU, the notebooks show
#   **recorded** GPU measurements: files in `assets/benchmarks/` written on a real GPU by `make bench` or by
#   a notebook's GPU-only cells (not under `make test-gpu`, which sets `COURSE_RECORDS=off`), each stamped
#   with the GPU, the driver, the versions and the date. No measured number is typed by hand.
# - **datasheet** figures: what the vendor says a GPU can do (peak FLOP/s, HBM bandwidth, memory sizes, SM
#   counts of the A100, H100, H200 and RTX 4090). These *are* typed, from NVIDIA's datasheets, whitepapers
#   and tuning guides, into one table, `course_lib.perf.hardware.GPUS`, each figure with the address of the
#   document it comes from (notebook 01 prints them). They are upper bounds that no real kernel reaches;
#   the measured ceilings are lower.
#
# Next to either you always see what *your* machine measured, labelled as such.

# %%
from course_lib import records

rec = records.load_record("attention")
if rec is None:
    print("No recorded GPU benchmark in assets/benchmarks/ yet (run `make bench` on a GPU to make one).")
else:
    print("Recorded benchmark:", records.label(rec))

# %% [markdown]
# ## 5. The course map
#
# | notebook | what you build | where the finished piece lives |
# | --- | --- | --- |
# | 00 setup | this tour | `course_lib.doctor`, `course_lib.runtime` |
# | 01 roofline | the roofline model, the memory hierarchy, fusion | `course_lib.perf` (hardware, roofline, plotting) |
# | 02 standard attention | why attention is memory-bound | `course_lib.attention.reference`, `.perf.profiling` |
# | 03 softmax | naive, safe and online softmax (NumPy) | `course_lib.softmax` |
# | 04 tiled attention | FlashAttention's forward in PyTorch | `course_lib.attention.tiled` |
# | 04b tiled backward | its backward, by recomputation | `course_lib.FlashAttentionTorch` |
# | 05 Triton primer | vector add, weighted sum, fused softmax | `course_lib.primer` |
# | 06 FA-2 forward | the Triton forward kernel | `course_lib.flash_attention` |
# | 07 FA-2 backward | the Triton backward kernels | `course_lib.FlashAttentionTriton` |
# | 08 benchmarking | timing, profiling, the optimisation ladder | `course_lib.bench`, `course_lib.perf.timing` |
# | 08b real models | custom operator, GQA, causal alignments, transformers | `.attention.op`, `.integrations` |
# | 08c Hopper appendix | warp specialisation in Gluon (optional) | `course_lib.attention.hopper` |
# | 09 decoding | split-KV decoding against a KV cache | `course_lib.decode.decode_attention` |
# | 10 PagedAttention | pages, an allocator, the paged kernel, continuous batching | `course_lib.decode` |
# | 11 RMSNorm and RoPE | fused kernels, forward and backward | `course_lib.fused` |
# | 12 capstone | a small Llama trained and served on the course's kernels | `course_lib.models` |
# | 13 ring attention | one attention over several GPUs | `course_lib.distributed` |
#
# ## 6. course_lib from homework
#
# Homework often asks for a FlashAttention-2 `torch.autograd.Function` (Stanford CS336's assignment 2
# does): an adapter returns the class, and the tests call `Cls.apply(q, k, v, is_causal)` with q of shape
# (batch, n_queries, d). The classes to hand in are **yours**: you write the pieces in this course (the
# tiled forward in notebook 04, its backward in 04b, the Triton forward kernel in 06 and the backward
# kernels in 07) and wrap them in an autograd Function the way notebook 07, section 8 shows:
#
# ```python
# # the homework's adapter file
# from my_flash import MyFlashAttentionTorch, MyFlashAttentionTriton  # your own module
#
# def get_flashattention_autograd_function_pytorch():
#     return MyFlashAttentionTorch   # your forward (notebook 04) and backward (04b), pure PyTorch: runs anywhere
#
# def get_flashattention_autograd_function_triton():
#     return MyFlashAttentionTriton  # your kernels (notebooks 06 and 07): compiled on a GPU, interpreted on a CPU
# ```
#
# `pip install -e .` from the course folder (which `make setup` already did) makes `course_lib` importable
# anywhere in that environment, so your own module can use its helpers (`course_lib.testing`, the float64
# reference `course_lib.attention.reference.attention`) to test your classes before you hand them in.
# For instructors: the finished classes with the same interface are `course_lib.FlashAttentionTorch` and
# `course_lib.FlashAttentionTriton` (the README's section "course_lib from homework").
#
# ## 7. How exercises work
#
# Each notebook has exercises, some in its sections and some at its end. An exercise cell holds a place for
# your code; the cell after it, a **check**, calls `course_lib.exercises.check` (or `check_cases`, which
# runs your function over many cases against a float64 reference), and says whether your answer is missing,
# wrong (and which part: a value, the first array index that differs, the first failing case) or correct.
# A failed check shows a short message, not a traceback.
#
# - **Hints** appear one per failed attempt: the first wrong (or missing) answer shows hint 1, the next wrong
#   attempt hint 2, from a nudge to the formula. None of them is the answer.
# - **A worked answer** appears only when you ask for it: `course_lib.exercises.solution("score matrix
#   bytes")` prints the answer to the exercise of that name (the name the check uses).
# - **Predictions** (section 3) start blank in the student edition: you type the number.
#
# There are two editions of every notebook. In the student edition (`make student`, or `make lab-student`)
# each answer is replaced by `raise NotImplementedError` and each prediction by `None`; in the instructor
# edition (the `notebooks/` folder) they are filled in. If the cell below holds `raise NotImplementedError`,
# you have the student edition: replace that line with your code, run the cell, then run the check. Later
# cells never depend on your answers, so you can always run a notebook to the end.
#
# **Exercise 0.** The standard attention above builds an N × N score matrix per (batch, head). Write a
# function that returns how many bytes that matrix takes for a batch of `b` sequences, `h` heads,
# length `n`, with `bytes_per_element` bytes per entry.

# %%
def score_matrix_bytes(b, h, n, bytes_per_element):
    ### BEGIN SOLUTION
    return b * h * n * n * bytes_per_element
    ### END SOLUTION


# %% tags=["check"]
from course_lib.exercises import check

check("score matrix bytes", lambda: score_matrix_bytes(8, 16, 4096, 2), 4_294_967_296)
check("score matrix bytes (fp32)", lambda: score_matrix_bytes(1, 32, 8192, 4), 8_589_934_592)

# %% [markdown]
# For 8 sequences of 4096 tokens, 16 heads, in bf16, that is 4 GiB for one layer's scores — and the
# softmax output P needs as much again. Keep that number in mind for notebook 02.
#
# ## Summary
# - `import course_lib` decides where Triton kernels run; the doctor says what it decided and why.
# - Sizes are chosen in one place per notebook with `course_lib.pick`.
# - GPU figures on a CPU come from recorded runs, labelled; your own machine's measurements sit next to them.
# - Predict, then measure: a prediction is a number typed before the measurement, and the measurement scores it.
# - Checks show one hint per failed attempt; `course_lib.exercises.solution(name)` shows a worked answer on request.
# - Homework hands in your own autograd Functions (notebooks 04b and 07); `course_lib` holds the finished pieces.
#
# ## Exercises
# 1. Bytes of the N × N score matrix (section 7).
# 2. Run `python -m course_lib doctor` in a terminal and compare with the first cell's output.
# 3. Change `N_TOUR` to larger sizes and see when the measured growth approaches 4× per doubling.
