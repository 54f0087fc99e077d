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
# # 05 · A Triton primer: programs, blocks and masks
#
# Notebook 04 built FlashAttention out of PyTorch operations: every tile went through HBM between two
# operations. To keep a tile in fast on-chip memory for a whole loop, we need to write the kernel ourselves.
# Triton lets us do that in Python, one *block* of elements at a time.
#
# **Learning goals**
# 1. Explain Triton's programming model (a *program* works on a block of elements) and how it maps onto a
#    GPU: threads, warps, thread blocks, SMs, registers and shared memory.
# 2. Write, launch and check a kernel: the launch grid, `tl.program_id`, `tl.arange`, pointer arithmetic,
#    masks for ragged edges.
# 3. Wrap a forward and a backward kernel in a `torch.autograd.Function`, with a reduction across programs.
# 4. Write a fused row softmax kernel yourself, predict its time from the bytes it moves, and (on a GPU)
#    measure it.
# 5. Debug kernels: the interpreter, `tl.device_print`, assertions against a reference; see what goes wrong
#    without a mask; read what the compiler generated.
#
# The finished kernels of this notebook live in `course_lib.primer` (`add`, `weighted_sum`, `softmax`).

# %% [markdown]
# ## 0. Setup and sizes
#
# `import course_lib` comes first: it decides whether Triton kernels are compiled for a GPU or run by the
# interpreter on the CPU, and that decision must be made before any `@triton.jit` runs (Triton reads the
# switch when it decorates a kernel). So `triton` and `tl` are taken from `course_lib.runtime`.

# %%
import statistics

import matplotlib.pyplot as plt
import torch

import course_lib
from course_lib import primer, records
from course_lib.exercises import check, check_cases, check_masked_memory_ops, guarded_empty, predict
from course_lib.perf.plotting import plot_series
from course_lib.perf.timing import benchmark
from course_lib.runtime import tl, triton

DEVICE = course_lib.DEVICE
print(course_lib.RUNTIME.describe())

# %% [markdown]
# All sizes of this notebook, in one place. On the CPU every program instance runs in Python: tiny sizes.

# %%
N_ADD = course_lib.pick(cpu=1000, gpu=98_432)  # vector length (not a multiple of the block on purpose)
WS_ROWS, WS_COLS = course_lib.pick(cpu=(37, 100), gpu=(8192, 1000))  # weighted sum: x is (rows, D)
SM_ROWS, SM_COLS = course_lib.pick(cpu=(8, 100), gpu=(4096, 1000))  # fused softmax: x is (M, N)
SWEEP_COLS = course_lib.pick(cpu=[], gpu=[256 * i for i in range(1, 49, 2)])  # softmax benchmark, GPU only
torch.manual_seed(0)

# %% [markdown]
# ## 1. The programming model
#
# **CUDA** asks you to write the code of *one thread*. Threads come in **warps** of 32 that execute one
# instruction at a time together; warps are grouped into a **thread block** (up to 1024 threads). The GPU schedules
# each thread block onto one **streaming multiprocessor (SM)** — an H200 has 132 of them — and the block stays
# there until it finishes. While it runs, its threads share that SM's **registers** (64 K 32-bit registers per SM)
# and **shared memory** (SRAM, up to 228 KB per SM): small, but several times faster than HBM (about 7x on an H200,
# by notebook 01's estimate), the 141 GB of main GPU memory that every kernel reads its inputs from and writes its
# outputs to.
#
# **Triton** asks you to write the code of *one program*: one instance of the kernel that works on whole
# **blocks** (tiles) of elements — `tl.arange(0, 1024)` is a vector of 1024 offsets, `tl.load` of 1024
# pointers brings 1024 values into registers. Each program becomes one CUDA thread block; the compiler
# spreads the block over `num_warps` warps, picks vector loads, and stages data in shared memory where it
# helps. You think in tiles; it thinks in threads.
#
# | | CUDA | Triton |
# | --- | --- | --- |
# | you write the code of | one thread | one program (= one thread block) |
# | unit of data | a scalar per thread | a block (tensor) of elements |
# | which one am I? | `blockIdx`, `threadIdx` | `tl.program_id(axis)` |
# | how many? | grid of blocks x threads per block | grid of programs; threads via `num_warps` |
# | shared memory, sync, vector loads | by hand | by the compiler |
#
# Why this matters for FlashAttention: a program lives on one SM for its whole life, so whatever it holds
# in registers and shared memory — a Q tile, the running max and sum, the output accumulator — it can
# reuse across a whole loop without going back to HBM. That is exactly what notebook 04 could not do.
#
# Programs run in no guaranteed order, many at once (several per SM, all SMs busy). They cannot talk to
# each other except through HBM (and atomic operations). The **launch grid** says how many programs to
# start: `kernel[(n_programs,)](args...)`; each asks `tl.program_id(0)` which one it is.

# %% [markdown]
# ### SIMT and warp divergence
#
# NVIDIA calls its model **SIMT**, single instruction, multiple threads: each thread has its own registers
# and may take its own branch, but the 32 threads of a warp share one instruction stream. When the threads
# of a warp disagree at an `if`, the warp **diverges**: it runs the `if` side with the other threads
# switched off, then the `else` side with the first group switched off. The warp pays for both paths. When
# all 32 threads agree, it pays for one. So *which* elements take a branch matters, not only how many.
#
# Triton hides this but does not remove it: a branch on a block's values is written `tl.where(cond, a, b)`
# or as a `mask=`, and both sides are computed for every lane. A branch on a scalar that is the same for the
# whole program (`if pid < n:`, a loop bound) costs nothing of the kind. That is why the causal kernels of
# notebook 06 decide *per tile* (a loop bound) whether a tile is needed at all, and only apply an
# element-wise mask on the diagonal tiles. A small model of a warp's cost, in units of one path's work:

# %%
def warp_cost(cond, warp=32):
    """Paths executed, summed over warps: 2 where a warp's lanes disagree, 1 where they agree."""
    per_warp = cond.reshape(-1, warp)
    return int(sum(1 + bool(w.any() and not w.all()) for w in per_warp))


lane = torch.arange(1024)
layouts = {
    "same branch everywhere": lane >= 0,
    "branch on i // 32 (warps agree)": (lane // 32) % 2 == 0,
    "branch on i % 2 (every warp splits)": lane % 2 == 0,
}
for name, cond in layouts.items():
    print(f"{name:38}: {int(cond.sum()):4} of 1024 take the if, cost {warp_cost(cond)} warp-paths")
assert warp_cost(layouts["branch on i % 2 (every warp splits)"]) == 2 * warp_cost(layouts["same branch everywhere"])

# %% [markdown]
# ## 2. The first kernel: vector add
#
# One program adds `BLOCK_SIZE` consecutive elements. Its offsets are `pid * BLOCK_SIZE + arange(BLOCK_SIZE)`.
# The last program usually runs past the end of the vector: the **mask** `offsets < n` switches those
# lanes off, for the load and for the store.


# %%
@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(axis=0)  # which block of the vector is mine
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)  # BLOCK_SIZE offsets, in registers
    mask = offsets < n  # False past the end of the vector
    x = tl.load(x_ptr + offsets, mask=mask)  # HBM -> registers
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)  # registers -> HBM


def add(x, y, block_size=256):
    out = torch.empty_like(x)
    n = x.numel()
    grid = (triton.cdiv(n, block_size),)  # ceil(n / block_size) programs
    add_kernel[grid](x, y, out, n, BLOCK_SIZE=block_size)
    return out


x = torch.randn(N_ADD, device=DEVICE)
y = torch.randn(N_ADD, device=DEVICE)
torch.testing.assert_close(add(x, y), x + y)
torch.testing.assert_close(add(x, y), primer.add(x, y, block_size=256))
print(f"n = {N_ADD}: {triton.cdiv(N_ADD, 256)} programs of 256 elements; matches x + y and primer.add")

# %% [markdown]
# Two details. `BLOCK_SIZE` is a `tl.constexpr`: a compile-time constant (each value compiles its own
# kernel), and it must be a power of two for `tl.arange`. And a pointer plus a block of offsets is a block
# of pointers: that is all the "indexing" Triton has.
#
# Which program handled which element? Let each program write its own id:


# %%
@triton.jit
def whoami_kernel(out_ptr, n, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    tl.store(out_ptr + offsets, tl.zeros([BLOCK_SIZE], dtype=tl.int32) + pid, mask=offsets < n)


owner = torch.full((10,), -1, dtype=torch.int32, device=DEVICE)
whoami_kernel[(triton.cdiv(10, 4),)](owner, 10, BLOCK_SIZE=4)
print("element :", list(range(10)))
print("program :", owner.tolist())
assert owner.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]

# %% [markdown]
# Three programs of 4 lanes cover 10 elements; the last program has two lanes masked off.
#
# The same question for a two-dimensional launch (Exercise 4 writes one): a (5, 100) array in blocks of
# 2 rows x 32 columns needs a grid of 3 x 4 = 12 programs. Below, a few of them: in orange the elements a
# program loads, in red its lanes past the array's edge (the black lines) that the mask switches off. In
# JupyterLab the slider under the strip steps through all 12 programs.

# %%
from course_lib.attention import animate

animate.program_strip((5, 100), (2, 32), n_shots=3)
plt.show()
animate.program_widget((5, 100), (2, 32))  # a slider over the 12 programs (JupyterLab); text under nbval

# %% [markdown]
# ## 3. What goes wrong without a mask
#
# Take the mask away and the last program reads past the end of `x`. Nothing stops it: a GPU load reads
# whatever is at that address (or faults, if the address is not mapped), and the interpreter does not check
# bounds either. To *see* this safely, we make `x` a view of the first 10 elements of a 16-element buffer
# whose tail holds -7, and we give the output room for every lane of every program. The unmasked read stays
# inside memory we own, so the garbage becomes visible without harming anything.
#
# (An unmasked *store* past the end of an allocation is another matter: it overwrites someone else's data
# and can kill the process — or the Jupyter kernel. We do not run one.)


# %%
@triton.jit
def copy_kernel(x_ptr, out_ptr, n, BLOCK_SIZE: tl.constexpr, USE_MASK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    if USE_MASK:
        x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)  # masked lanes read 0.0
    else:
        x = tl.load(x_ptr + offsets)  # reads past the end of x
    tl.store(out_ptr + offsets, x)  # safe only because `out` has room for every lane


buffer = torch.full((16,), -7.0, device=DEVICE)
buffer[:10] = torch.arange(10.0, device=DEVICE)
x10 = buffer[:10]  # our tensor: 10 elements; what follows in memory is not ours
out_unmasked = torch.empty(16, device=DEVICE)  # 2 programs x 8 lanes
out_masked = torch.empty(16, device=DEVICE)
copy_kernel[(2,)](x10, out_unmasked, 10, BLOCK_SIZE=8, USE_MASK=False)
copy_kernel[(2,)](x10, out_masked, 10, BLOCK_SIZE=8, USE_MASK=True)
print("without mask:", out_unmasked.tolist())
print("with mask   :", out_masked.tolist())
assert (out_unmasked[10:] == -7).all(), "the unmasked load read the neighbour's data"
assert (out_masked[10:] == 0).all()

# %% [markdown]
# Lanes 10–15 of the unmasked copy hold the neighbour's -7s: the kernel "worked", no error was raised, and
# the answer is wrong. With a buffer that is not ours, it would have been random memory. **Mask every load
# and every store whose block can run past the end** — and give `other=` a value that is harmless for what
# comes next (0 for a sum, -inf for a max).

# %% [markdown]
# ## 4. Debugging a kernel
#
# Three tools, from cheapest to most powerful:
#
# 1. **Assert against a reference.** Every kernel in this course is checked against a plain PyTorch
#    reference (`torch.testing.assert_close`, or for attention the float64 accuracy rule of
#    `course_lib.testing`), on sizes that are *not* multiples of
#    the block, and on random inputs (never zeros: zeros hide indexing bugs).
# 2. **The interpreter.** With `TRITON_INTERPRET=1` (what `course_lib` sets on a CPU), each program runs in
#    Python on NumPy arrays, one after another. You can print, and even put a `breakpoint()` in a kernel.
#    On a GPU machine, start Python with `COURSE_DEVICE=cpu` to debug a kernel this way. Races never show
#    there (programs run one by one), and timings mean nothing.
# 3. **`tl.device_print`** prints from inside the kernel, compiled or interpreted, prefixed by the program
#    id. On a GPU every thread prints its elements: keep the launch tiny. (`tl.static_print` prints at
#    compile time: on a GPU it shows types and shapes, in the interpreter it shows values.)


# %%
@triton.jit
def print_kernel(x_ptr, n, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
    tl.device_print("x", x)


print_kernel[(2,)](torch.arange(6.0, device=DEVICE), 6, BLOCK_SIZE=4)
if course_lib.ON_GPU:
    torch.cuda.synchronize()  # device prints are flushed when the kernel finishes

# %% [markdown]
# The second program printed `4, 5, 0, 0`: its last two lanes are masked and read `other=0.0`.

# %% [markdown]
# ## 5. A row-wise weighted sum, forward and backward
#
# A step up: $x$ has shape (rows, D), $w$ has shape (D,), and
# $$\text{out}_i = \sum_c x_{ic}\, w_c .$$
# Each program takes `ROWS` rows and walks along D in tiles of `BLOCK_D` columns, keeping a running sum
# per row in registers. A tile is two-dimensional: row offsets `[:, None]` and column offsets `[None, :]`
# broadcast to a (ROWS, BLOCK_D) block of pointers, and the two masks combine with `&`. Strides are passed
# in, so `x` may be any view.


# %%
@triton.jit
def weighted_sum_fwd(
    x_ptr, w_ptr, out_ptr, n_rows, D, stride_r, stride_c, ROWS: tl.constexpr, BLOCK_D: tl.constexpr
):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    row_mask = rows < n_rows
    acc = tl.zeros([ROWS], dtype=tl.float32)  # one running sum per row, in registers
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
        col_mask = cols < D
        tile = tl.load(
            x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c,  # (ROWS, BLOCK_D) pointers
            mask=row_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0)
        acc += tl.sum(tile * w[None, :], axis=1)
    tl.store(out_ptr + rows, acc, mask=row_mask)


# %% [markdown]
# **Backward.** With $g = \partial \mathcal{L} / \partial\,\text{out}$ (shape (rows,)):
# $$\frac{\partial \mathcal{L}}{\partial x_{ic}} = g_i\, w_c, \qquad
#   \frac{\partial \mathcal{L}}{\partial w_c} = \sum_i g_i\, x_{ic}.$$
# The first is local: each program writes its own rows of `grad_x`. The second sums over **all** rows, and
# rows live in different programs. Programs cannot share registers, so each program writes its *partial*
# sum to its own row of a buffer `partial_grad_w` of shape (n_programs, D), and PyTorch adds the rows up
# afterwards. (Alternatives: `tl.atomic_add` into one row — fewer bytes, but the order of the additions, and
# so the rounding, changes from run to run; notebook 07 meets this trade-off again for dQ.)


# %%
@triton.jit
def weighted_sum_bwd(
    x_ptr, w_ptr, g_ptr, grad_x_ptr, partial_ptr, n_rows, D, stride_r, stride_c,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    g = tl.load(g_ptr + rows, mask=row_mask, other=0.0)  # (ROWS,) upstream gradient
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        col_mask = cols < D
        mask = row_mask[:, None] & col_mask[None, :]
        tile = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0)
        tl.store(grad_x_ptr + rows[:, None] * D + cols[None, :], g[:, None] * w[None, :], mask=mask)
        # this program's share of grad_w: a sum over its own ROWS rows only
        tl.store(partial_ptr + pid * D + cols, tl.sum(tile * g[:, None], axis=0), mask=col_mask)


class WeightedSum(torch.autograd.Function):
    ROWS, BLOCK_D = 16, 32

    @staticmethod
    def forward(ctx, x, w):
        n_rows, D = x.shape
        out = torch.empty(n_rows, device=x.device, dtype=x.dtype)
        grid = (triton.cdiv(n_rows, WeightedSum.ROWS),)
        weighted_sum_fwd[grid](
            x, w, out, n_rows, D, x.stride(0), x.stride(1), ROWS=WeightedSum.ROWS, BLOCK_D=WeightedSum.BLOCK_D
        )
        ctx.save_for_backward(x, w)
        return out

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        n_rows, D = x.shape
        grid = (triton.cdiv(n_rows, WeightedSum.ROWS),)
        grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
        partial = torch.empty(grid[0], D, device=x.device, dtype=torch.float32)
        weighted_sum_bwd[grid](
            x, w, g.contiguous(), grad_x, partial, n_rows, D, x.stride(0), x.stride(1),
            ROWS=WeightedSum.ROWS, BLOCK_D=WeightedSum.BLOCK_D,
        )  # fmt: skip
        return grad_x, partial.sum(dim=0)  # the reduction across programs


# %% [markdown]
# Check the forward and both gradients against PyTorch's autograd, on a size that is not a multiple of
# either block, and against `course_lib.primer.weighted_sum` (which also handles half precision, float64
# and any leading dims).

# %%
x = torch.randn(WS_ROWS, WS_COLS, device=DEVICE, requires_grad=True)
w = torch.randn(WS_COLS, device=DEVICE, requires_grad=True)
g = torch.randn(WS_ROWS, device=DEVICE)

out = WeightedSum.apply(x, w)
grad_x, grad_w = torch.autograd.grad(out, (x, w), g)
out_ref = (x * w).sum(dim=1)
grad_x_ref, grad_w_ref = torch.autograd.grad(out_ref, (x, w), g)
torch.testing.assert_close(out, out_ref, rtol=1e-4, atol=1e-4)
torch.testing.assert_close(grad_x, grad_x_ref)
torch.testing.assert_close(grad_w, grad_w_ref, rtol=1e-4, atol=1e-4)

out_lib = primer.weighted_sum(x, w)
torch.testing.assert_close(out, out_lib)
torch.testing.assert_close(torch.autograd.grad(out_lib, (x, w), g), (grad_x, grad_w), rtol=1e-4, atol=1e-4)
print(f"x {tuple(x.shape)}: forward, grad_x and grad_w match PyTorch autograd and course_lib.primer")

# %% [markdown]
# `torch.autograd.gradcheck` compares the backward with finite differences of the forward. It needs float64,
# which `course_lib.primer.weighted_sum` supports (it accumulates in float64 for float64 inputs, float32
# otherwise).

# %%
x64 = torch.randn(20, 40, device=DEVICE, dtype=torch.float64, requires_grad=True)
w64 = torch.randn(40, device=DEVICE, dtype=torch.float64, requires_grad=True)
assert torch.autograd.gradcheck(primer.weighted_sum, (x64, w64), fast_mode=True)
print("gradcheck passed")

# %% [markdown]
# ## 6. A fused row softmax
#
# The softmax of each row of an (M, N) matrix, written the way eager PyTorch would run it. Each line is one
# kernel: it reads its inputs from HBM and writes its result back. Counting elements moved:


# %%
def naive_softmax(x):
    x_max = x.max(dim=1)[0]  # read MN, write M
    z = x - x_max[:, None]  # read MN + M, write MN
    numerator = torch.exp(z)  # read MN, write MN
    denominator = numerator.sum(dim=1)  # read MN, write M
    return numerator / denominator[:, None]  # read MN + M, write MN
    # total: read 5MN + 2M, write 3MN + 2M elements


# %% [markdown]
# About **8MN** elements move. A fused kernel reads each row once into registers, does all five steps
# there, and writes the result once: **2MN**. A softmax does a handful of operations per element, far below
# what an H200 can do per byte, so it is memory-bound and its time should follow the bytes:
# **prediction: the fused kernel is about 4x faster than the naive one.** (The prediction assumes every
# intermediate goes to HBM, and that every kernel, eager or fused, moves its bytes at the same rate; the 60 MiB L2
# cache of an H200 can hold small intermediates, which would shrink the gap. The measurement at the end of this
# section tests both assumptions.)
#
# One row per program: `BLOCK_SIZE` is N rounded up to a power of two, the padding lanes read `-inf` (no
# effect on the max; `exp(-inf) = 0` adds nothing to the sum). The arithmetic is float32 whatever the
# storage dtype.
#
# **Exercise 1 — the fused softmax kernel.** Write the body of `softmax_kernel`: program `row` loads its
# row once (masked, padding lanes `-inf`, converted to float32 with `.to(tl.float32)`), subtracts the
# row's max, exponentiates, divides by the sum, and stores the row once (masked, converted back to the
# output's dtype with `.to(out_ptr.dtype.element_ty)`). Rows may lie further apart in memory than N
# elements: row `row` starts at `x_ptr + row * stride_x`. The launcher below is given.


# %%
@triton.jit
def softmax_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out, BLOCK_SIZE: tl.constexpr):
    """out[row, :n_cols] = softmax(x[row, :n_cols]) for the row of this program; BLOCK_SIZE >= n_cols."""
    row = tl.program_id(0)
    ### BEGIN SOLUTION
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=-float("inf")).to(tl.float32)  # read once
    x = x - tl.max(x, axis=0)  # everything below happens in registers
    numerator = tl.exp(x)
    y = numerator / tl.sum(numerator, axis=0)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)  # write once
    ### END SOLUTION


# %%
def fused_softmax(x, out=None):
    """Softmax over the rows of x (M, N): one program per row. out: where to write (default: a new tensor)."""
    M, N = x.shape
    out = torch.empty_like(x) if out is None else out
    softmax_kernel[(M,)](x, out, N, x.stride(0), out.stride(0), BLOCK_SIZE=triton.next_power_of_2(N))
    return out


# %% [markdown]
# The check runs your kernel over row counts and row lengths that are not powers of two (one element, a
# few, a hundred, a thousand), on rows that lie further apart than their length, with large values
# (where exp overflows float32 unless the max is subtracted first) and in float16, against a float64
# softmax. As in section 3, the output is followed by a guard that catches a store past its end, and the
# kernel's source is read for a load or store without a mask.

# %% tags=["check"]
SOFTMAX_CASES = [
    dict(M=1, N=1),
    dict(M=3, N=7),
    dict(M=SM_ROWS, N=SM_COLS),
    dict(M=5, N=1000),
    dict(M=7, N=100, spread=40.0),
    dict(M=6, N=300, dtype=torch.float16),
]


def softmax_input(M, N, spread=3.0, dtype=torch.float32):
    """Rows of N values lying N + 5 elements apart (a view of a wider matrix), the same for both sides."""
    generator = torch.Generator().manual_seed(100 * M + N)
    return (spread * torch.randn(M, N + 5, generator=generator)).to(DEVICE, dtype)[:, :N]


def your_softmax(M, N, spread=3.0, dtype=torch.float32):
    check_masked_memory_ops(softmax_kernel, "softmax_kernel")
    out, check_guard = guarded_empty((M, N), dtype, DEVICE)
    fused_softmax(softmax_input(M, N, spread, dtype), out)
    check_guard("softmax_kernel")
    return out


def softmax_float64(M, N, spread=3.0, dtype=torch.float32):
    return torch.softmax(softmax_input(M, N, spread, dtype).double(), dim=1)


check_cases("softmax_kernel", SOFTMAX_CASES, your_softmax, softmax_float64, rtol=1e-3, atol=1e-5)

# %% [markdown]
# From here on, course_lib's finished kernel (`course_lib.primer.softmax`, the same kernel with a choice of
# warps per row length) stands in for yours: it is what the measurement below times.

# %%
x = 3 * torch.randn(SM_ROWS, SM_COLS, device=DEVICE)
torch.testing.assert_close(primer.softmax(x), torch.softmax(x, dim=1))
torch.testing.assert_close(primer.softmax(x), naive_softmax(x))
print(f"({SM_ROWS}, {SM_COLS}): primer.softmax matches torch.softmax and the naive version")

# %% [markdown]
# **Exercise 2 — the bytes it moves.** Return the bytes an (M, N) row softmax moves between HBM and the
# chip, for elements of `bytes_per_element` bytes: the naive version (count every read and write in its
# comments, including the M-element vectors) if `fused` is False, the fused kernel if True.


# %%
def softmax_bytes(M, N, bytes_per_element, fused):
    ### BEGIN SOLUTION
    elements = 2 * M * N if fused else (5 * M * N + 2 * M) + (3 * M * N + 2 * M)
    return elements * bytes_per_element
    ### END SOLUTION


# %% tags=["check"]
check(
    "softmax_bytes",
    lambda: [softmax_bytes(4096, 1000, e, fused=f) for e in (4, 2) for f in (False, True)],
    [131_137_536, 32_768_000, 131_137_536 // 2, 32_768_000 // 2],
)

# %% [markdown]
# **Predict before you measure.** The measurement below times the fused kernel on M = 4096 rows of
# float32. How long does it take, in microseconds, for the longest rows of the sweep, N = 12,032? Reason
# from the bytes it must move and the fastest rate an H200 moves bytes at (the copy ceiling, printed
# below from the recorded hardware figures). Type your estimate in place of the value in the cell after.

# %%
hw = records.load_record("hardware")
if hw is not None:
    print(f"copy ceiling: {hw['data']['copy_gbps']:.0f} GB/s ({records.label(hw)})")

# %%
# Your prediction, in microseconds: the fused kernel's time for (M, N) = (4096, 12032), float32.
softmax_guess = predict("fused softmax time at 4096 rows of 12032 floats", 92.0, unit=" us")

# %% [markdown]
# **Measure (GPU only).** We time the naive version, the fused kernel (`course_lib.primer.softmax`) and
# `torch.softmax` (itself a fused CUDA kernel) for M = 4096 rows and a sweep of row lengths N, and report
# each as *effective bandwidth*: the 2MN elements a softmax must move, divided by the time. A kernel at the
# memory ceiling cannot go faster. On a CPU the interpreter's timings would measure Python, so we show the
# recorded run instead.

# %%
NAIVE, FUSED = "naive (eager PyTorch)", "fused Triton (course_lib.primer)"


def plot_softmax_bandwidth(data, source):
    ratio = [n / f for n, f in zip(data["ms"][NAIVE], data["ms"][FUSED])]
    plot_series(
        data["n_cols"],
        {name: data["gbps"][name] for name in (NAIVE, FUSED, "torch.softmax")},
        xlabel=f"row length N (elements), M = {data['n_rows']} rows, float32",
        ylabel="effective bandwidth (GB/s)",
        title=f"Fused softmax: {min(ratio):.1f}-{max(ratio):.1f}x faster than naive (bytes predict 4x)\n{source}",
    )
    plt.show()
    return ratio


def measure_softmax_bandwidth():
    M = SM_ROWS
    data = {"n_rows": M, "n_cols": SWEEP_COLS, "ms": {}, "gbps": {}}
    providers = {NAIVE: naive_softmax, FUSED: primer.softmax, "torch.softmax": lambda t: torch.softmax(t, -1)}
    for name, fn in providers.items():
        data["ms"][name], data["gbps"][name] = [], []
        for n in SWEEP_COLS:
            xs = torch.randn(M, n, device=DEVICE)
            ms = benchmark(lambda fn=fn, xs=xs: fn(xs))
            data["ms"][name].append(ms)
            data["gbps"][name].append(2 * M * n * xs.element_size() / ms * 1e-6)
    return data


# %%
got = records.measured_or_recorded(
    "primer_softmax",
    measure_softmax_bandwidth,
    missing="No recorded GPU run yet (it is written when this notebook runs on a GPU). What to look for\n"
    "in it: the fused kernel near the copy ceiling at long rows, and the naive version's gap to it, which\n"
    "the bytes put at 4x where its intermediates go to HBM.",
)
if got:
    ratio = plot_softmax_bandwidth(*got)
    data = got[0]
    longest = data["n_cols"].index(12032) if 12032 in data["n_cols"] else len(data["n_cols"]) - 1
    _ = softmax_guess.score(1e3 * data["ms"][FUSED][longest])
    long_rows = [i for i, n in enumerate(data["n_cols"]) if n >= 4096] or list(range(len(data["n_cols"])))
    long_median = lambda series: statistics.median_high(series[i] for i in long_rows)  # noqa: E731
    naive_rate = 4 * long_median(data["gbps"][NAIVE])
    fused_rate, torch_rate = long_median(data["gbps"][FUSED]), long_median(data["gbps"]["torch.softmax"])
    shortest = data["n_cols"][0]
    print(
        f"{got[1]}: naive / fused time ratio between {min(ratio):.1f} and {max(ratio):.1f}; "
        f"{long_median(ratio):.1f}x at long rows (N >= 4096).\n"
        f"long rows: the naive kernels move their 8MN elements at about {naive_rate:.0f} GB/s, the fused kernel\n"
        f"its 2MN at about {fused_rate:.0f} GB/s: {fused_rate / naive_rate:.2f}x faster per byte, so "
        f"4 x {fused_rate / naive_rate:.2f} = {4 * fused_rate / naive_rate:.1f}x in time.\n"
        f"shortest rows (N = {shortest}): {ratio[0]:.1f}x; the naive call took {1e3 * data['ms'][NAIVE][0]:.0f} us "
        f"(5 kernels), the fused one {1e3 * data['ms'][FUSED][0]:.0f} us "
        f"({data['gbps'][FUSED][0]:.0f} GB/s, against {fused_rate:.0f} at long rows).\n"
        f"torch.softmax at long rows: about {torch_rate:.0f} GB/s "
        f"({torch_rate / fused_rate:.2f}x the fused kernel's rate)."
    )

# %% [markdown]
# Reading the figure: a kernel near the copy ceiling is as fast as the bytes allow; the lines above give
# the fused kernel's and `torch.softmax`'s rates at long rows, against each other. The byte count predicts
# the naive version 4x slower; what the run shows, and why:
# - *Long rows: the rate, not just the bytes.* The byte count was right, but the second assumption was
#   not: the eager kernels (a reduction, a broadcast subtract, an exp, another reduction, a divide) each
#   move their bytes at well under the copy ceiling, while the fused kernel streams near it. Time is bytes
#   over the rate *each kernel reaches*. `x.max(dim=1)` also computes and writes an int64 index per row
#   that nobody uses: small (8M bytes) but not in the count.
# - *Short rows: more than the bytes.* A row of a few hundred floats is about a kilobyte, and the whole
#   matrix a few megabytes: each kernel has little to move, and fixed costs weigh as much as the bytes —
#   five kernel launches for the naive version against one, and how well a small kernel fills 132 SMs.
#   The ratio there depends on those costs in the run at hand: compare the two times at the shortest N in
#   the lines above, and the fused kernel's rate there against its rate at long rows.
# A prediction that misses by this much is not a confirmation: it points at the assumption to fix.
#
# The same reasoning — count bytes moved between HBM and the chip, then fuse to cut them — is what
# FlashAttention applies to attention.

# %% [markdown]
# ## 7. What did Triton generate? (GPU only)
#
# On a GPU, launching a kernel returns the **compiled kernel** object. Its `.asm` dict holds each stage of the
# compilation: `ttir` (Triton IR), `ttgir` (Triton GPU IR, with the layout of each block over threads), `llir`
# (LLVM IR), `ptx` (NVIDIA's virtual assembly) and `cubin` (the binary; `.asm["sass"]` is its disassembly, made by
# CUDA's `cuobjdump -sass`, so it needs `cuobjdump` on the machine). `.n_regs` is the number of registers per
# thread, `.n_spills` how many spilled to slow local memory, and `.metadata.shared` the bytes of shared memory per
# program.
#
# In the PTX of the softmax kernel (`course_lib.primer.softmax_kernel`, the finished version of yours), look for
# two things:
# 1. **`ex2.approx.f32`.** The GPU's special-function unit computes $2^x$, not $e^x$. `tl.exp(x)` is compiled
#    to a multiplication by $\log_2 e$ and an `ex2`. Notebook 06 writes `exp2` directly and folds
#    $\log_2 e$ into the softmax scale, saving that multiplication on every element of every score tile.
# 2. **`shfl.sync.bfly` and shared memory.** `tl.max` and `tl.sum` over a row become butterfly shuffles
#    between the 32 threads of a warp, then a trip through shared memory (`st.shared` / `ld.shared`, with a
#    `bar.sync` barrier) to combine the warps: that is what `metadata.shared` counts. You did not write any of
#    this; the compiler did, from `axis=0`.
#
# (You may also see `ld.global.v4` / `st.global.v4`: each thread moves 4 consecutive float32 — 16 bytes — per
# instruction, because Triton knows the offsets are contiguous and the row stride a multiple of 16.)

# %%
if course_lib.ON_GPU:
    xs = torch.randn(SM_ROWS, 1024, device=DEVICE)
    ys = torch.empty_like(xs)
    grid = (SM_ROWS,)
    compiled = primer.softmax_kernel[grid](xs, ys, 1024, xs.stride(0), ys.stride(0), BLOCK_SIZE=1024, num_warps=4)
    torch.testing.assert_close(ys, torch.softmax(xs, dim=1))
    print("stages in .asm:", sorted(compiled.asm.keys()))
    print(f"registers per thread: {compiled.n_regs}, spills: {compiled.n_spills}")
    print(f"shared memory / program: {compiled.metadata.shared} bytes; warps: {compiled.metadata.num_warps}")
    ptx = compiled.asm["ptx"].splitlines()
    for pattern in ("ex2.approx", "shfl.sync.bfly", "bar.sync", "st.shared", "ld.global", "st.global"):
        lines = [line.strip() for line in ptx if pattern in line]
        print(f"\n{pattern!r}: {len(lines)} lines, e.g.")
        for line in lines[:2]:
            print("   ", line)
else:
    print(
        "Interpreted on the CPU: nothing is compiled, so there is no PTX to show. On a GPU this cell\n"
        "prints the compilation stages (ttir, ttgir, llir, ptx, cubin), the registers per thread, the\n"
        "shared memory per program (where the warps' partial max and sum are combined), and the PTX lines\n"
        "described above: ex2.approx.f32 for tl.exp, shfl.sync.bfly and bar.sync for the reductions,\n"
        "ld.global for the loads."
    )

# %% [markdown]
# ## 8. Exercises
#
# **Exercise 3 — scaled add.** Write the body of `axpy_kernel` so that `out = alpha * x + y` for a vector of
# any length `n` (not a multiple of the block). Remember the mask.


# %%
@triton.jit
def axpy_kernel(x_ptr, y_ptr, out_ptr, alpha, n, BLOCK_SIZE: tl.constexpr):
    ### BEGIN SOLUTION
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, alpha * x + y, mask=mask)
    ### END SOLUTION



# %% tags=["check"]
# x and y are the first 1000 elements of longer buffers, and out is followed by a guard
# (`exercises.guarded_empty`): a load past n reads memory the check owns, and a store past n is caught
# instead of overwriting memory that is not the tensor's. An unmasked load changes no output when its lanes
# are masked off at the store, so `check_masked_memory_ops` reads the kernel's source for it.
xe, ye = torch.randn(1256, device=DEVICE), torch.randn(1256, device=DEVICE)


def _axpy_guarded():
    out, check_guard = guarded_empty((1000,), torch.float32, DEVICE)
    axpy_kernel[(triton.cdiv(1000, 128),)](xe, ye, out, 2.5, 1000, BLOCK_SIZE=128)
    check_guard("axpy")
    check_masked_memory_ops(axpy_kernel, "axpy")
    return out


check("axpy", _axpy_guarded, 2.5 * xe[:1000] + ye[:1000])

# %% [markdown]
# **Exercise 4 — a two-dimensional grid.** Add a bias vector `b` (shape (N,)) to every row of a matrix `x`
# (shape (M, N), row stride `stride_m`, contiguous rows). Launch a 2-D grid: `tl.program_id(0)` picks a block
# of `BLOCK_M` rows, `tl.program_id(1)` a block of `BLOCK_N` columns. Both edges may be ragged.


# %%
@triton.jit
def add_bias_kernel(x_ptr, b_ptr, out_ptr, M, N, stride_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    ### BEGIN SOLUTION
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :], mask=mask)
    b = tl.load(b_ptr + cols, mask=cols < N)
    tl.store(out_ptr + rows[:, None] * stride_m + cols[None, :], x + b[None, :], mask=mask)
    ### END SOLUTION


def add_bias(x, b, block_m=16, block_n=32):
    M, N = x.shape
    out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)  # x's strides: one stride_m
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    add_bias_kernel[grid](x, b, out, M, N, x.stride(0), BLOCK_M=block_m, BLOCK_N=block_n)
    return out


# %% tags=["check"]
# As in exercise 3, the inputs are the start of longer buffers and the output is followed by a guard: a
# load past the edges reads memory the check owns, a store past them is caught, and an unmasked load is
# found in the source.
def _add_bias_guarded(x, b, name, block_m=16, block_n=32):
    M, N = x.shape
    # the farthest an unmasked store reaches past the last row: a block of rows and one of columns
    buffer, check_guard = guarded_empty((M * x.stride(0),), x.dtype, x.device, guard=block_m * x.stride(0) + block_n)
    out = buffer.as_strided(x.shape, x.stride())  # x's strides, as add_bias allocates it
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    add_bias_kernel[grid](x, b, out, M, N, x.stride(0), BLOCK_M=block_m, BLOCK_N=block_n)
    check_guard(name)
    check_masked_memory_ops(add_bias_kernel, name)
    return out


xb, bb = torch.randn(64, 70, device=DEVICE)[:37], torch.randn(128, device=DEVICE)[:70]
check("add_bias", lambda: _add_bias_guarded(xb, bb, "add_bias"), xb + bb)
xv = torch.randn(64, 96, device=DEVICE)[:37, :70]  # a view whose rows lie 96 apart: stride_m is not N
check("add_bias on rows 96 apart", lambda: _add_bias_guarded(xv, bb, "add_bias on rows 96 apart"), xv + bb)

# %% [markdown]
# (Exercises 1 and 2, the fused softmax and its bytes, are in section 6.)
#
# **Exercise 5 (open).** In `WeightedSum`, try `BLOCK_D` = 16 and 128, and `ROWS` = 4 and 64. Which of these
# change the number of programs, and which the number of loop iterations per program? On a GPU, time the
# forward for a (8192, 1000) input for each choice and explain what you see in terms of parallelism (programs
# per SM) and of work per program.

# %% [markdown]
# ## Summary
#
# - A Triton **program** is one thread block working on blocks of elements; it runs on one SM and keeps its
#   blocks in registers and shared memory. The **grid** says how many programs run; `tl.program_id` says
#   which one this is. Programs cannot talk except through HBM (or atomics).
# - Offsets from `tl.arange`, pointers plus offsets, and **masks** on every load and store that can run past
#   the end. An unmasked read returns garbage silently; an unmasked store corrupts memory.
# - A backward that sums over rows owned by different programs needs a **reduction across programs**:
#   partial sums per program plus a final sum (deterministic), or atomics (fewer bytes, non-deterministic).
# - **Fusion** cuts bytes moved: the row softmax drops from about 8MN to 2MN elements, a predicted 4x for a
#   memory-bound operation. On long rows the measurement gives more (the eager kernels run below the copy
#   ceiling); on short rows fixed costs (launches, a GPU not filled) weigh as much as the bytes, and the
#   ratio depends on them.
# - **SIMT**: a warp's 32 threads share one instruction stream; threads that branch apart make the warp
#   run both paths. Branch per program (loop bounds), mask per element only where needed.
# - Debug with assertions against a reference, the interpreter (print, breakpoints) and `tl.device_print`;
#   read `.asm`, `.n_regs` and `.metadata.shared` to see what the compiler made of your kernel.
#
# Next, notebook 06 writes the FlashAttention-2 forward as one Triton kernel: one program per query block,
# looping over K/V blocks with the online softmax of notebook 03 in registers.
