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
# # 08c · Appendix (optional): warp specialisation on Hopper, in Gluon
#
# Notebook 08's optimisation ladder ends with a forward that is not written in Triton's usual programming
# model. This appendix explains that last rung: why a Triton kernel in which every warp does everything
# leaves the tensor cores idle, how FlashAttention-3 (Shah et al. 2024, sections 3.1-3.2) gives warps
# different jobs, and how course_lib's version (`course_lib/attention/hopper.py`, written in Gluon, Triton's
# lower-level dialect) compares with the Triton kernel. Nothing later in the course depends on it; the
# kernel itself runs only on Hopper GPUs (H100, H200), but everything here except the live measurement
# runs on a CPU.
#
# **Learning goals**
# 1. Explain why the tensor cores wait while the softmax runs, and how long, from the throughput of the
#    matrix units and of the exponential units.
# 2. Describe FlashAttention-3's warp specialisation: a producer warp issuing tile copies (TMA), consumer
#    warpgroups taking turns on the tensor cores (ping-pong), and a persistent grid; and what Gluon
#    exposes that Triton does not.
# 3. Read `hopper.VARIANTS` and `hopper.choose`: what each field of a variant costs in shared memory and
#    registers, and which variant runs for which shape.
# 4. Predict the Gluon kernel's gain over the Triton kernel at a cell the ladder did not measure, then
#    compare the two from the recorded H200 run (measured live on a Hopper GPU), and explain where one wins.
# 5. Count the registers a dK/dV program needs in two layouts, and explain why course_lib's Gluon
#    backward routes P and dS through shared memory.
# 6. Say what computing dQ in the dK/dV program (one pass) saves and what it costs, predict its gain, and
#    read it from the record.

# %% [markdown]
# ## 0. Sizes
#
# The live comparison (section 4) needs a Hopper GPU. Its cells keep the papers' B·N = 16k tokens and
# H·d = 2048, causal, bf16; on a CPU there is nothing to measure, and the cells list is empty.

# %%
import math

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import course_lib
from course_lib import records
from course_lib.attention import backward, forward, hopper, hopper_backward, hopper_dq, hopper_onepass
from course_lib.exercises import check, predict
from course_lib.perf import timing
from course_lib.perf.plotting import bar_chart

DEVICE = course_lib.DEVICE
# (d, N) of the live comparison, all causal; B = 16384 // N, H = 2048 // d.
CELLS = course_lib.pick(cpu=[], gpu=[(128, 2048), (128, 16384), (64, 2048), (64, 16384)])
# (d, N) of section 7's one pass, where the backward runs it (d = 64 from 4096 causal tokens), causal and not
ONE_PASS_CELLS = course_lib.pick(cpu=[], gpu=[(64, 4096), (64, 16384)])
SM_MATMUL_FLOPS_PER_CLOCK, SM_EX2_PER_CLOCK = 4096, 16  # H100/H200: dense bf16 tensor cores; MUFU ex2
SMEM_PER_PROGRAM = 227 * 1024  # bytes of shared memory one Hopper program (CTA) may use
print(f"{course_lib.RUNTIME.describe()}; live cells (d, N): {CELLS or 'none (no GPU)'}")

# %% [markdown]
# ## 1. Why the tensor cores wait
#
# In the Triton forward of notebook 06, each program runs its inner loop step after step: load a K/V tile,
# S = Q Kᵀ on the tensor cores, the online softmax on the ordinary and special-function units, then
# O += P V on the tensor cores. The compiler can overlap a *load* with work (that is what `num_stages`
# buys), but the softmax needs S and the next P V needs the softmax: within one warp the three happen one
# after the other, and while the softmax runs, the tensor cores have nothing to do.
#
# How long is that? Per score, the two products cost 4d FLOPs on the tensor cores (about 4096 dense bf16
# FLOPs per clock per SM on Hopper), and the softmax one exponential on the special-function units (`ex2`,
# 16 per clock per SM). Measure both in clocks per score, and call the products' time **M** and the
# softmax's **S** (notebook 08 derives the same "third" for the ladder):

# %%
def step_clocks(d: int) -> tuple[float, float]:
    """Clocks per score on one SM: (M, S) = (the two products on the tensor cores, one exp2)."""
    return 4 * d / SM_MATMUL_FLOPS_PER_CLOCK, 1 / SM_EX2_PER_CLOCK


for d_head in (64, 128, 256):
    M, S = step_clocks(d_head)
    print(f"d = {d_head:3}: S / M = {S / M:.2f}; the tensor cores idle {S / (M + S):.0%} of a step")
assert step_clocks(128)[1] / step_clocks(128)[0] == 0.5

# %% [markdown]
# So at d = 128 the tensor cores idle for a third of each step, at d = 64 for half, if nothing overlaps;
# the rescaling multiplies, the running max and the conversions to bf16 add a little more. It is one reason
# why the autotuned Triton forward of notebook 08's recorded ladder stays far below the rate a plain bf16
# matmul reached on the same H200 in the hardware record of notebook 01. That rate is a measurement of one
# run and one shape (8192³), not a ceiling: the same record's 4096³ matmul ran faster, and live runs of the
# 8192³ one on the H200 have measured 12-14 % more (clocks move with power and temperature from run to run;
# notebook 08, section 1.7). Both, from their records:

# %%
ladder_rec, hw_rec = records.load_record("ladder"), records.load_record("hardware")
if ladder_rec is None or hw_rec is None:
    print("No recorded ladder or hardware run in assets/benchmarks/ yet: run `make bench` on a GPU.")
else:
    tuned = next(s for s in ladder_rec["data"]["steps"] if (s["pass_"], s["name"]) == ("fwd", "autotuned (Triton)"))
    matmul = hw_rec["data"]["matmul_tflops"]["bfloat16"]
    print(f"autotuned Triton forward (d = 128, causal, N = 4096): {tuned['tflops']:4.0f} TFLOP/s")
    n_mm = hw_rec["data"]["matmul_n"]
    print(f"{f'plain bf16 matmul, {n_mm}³, one recorded run:':54}{matmul:4.0f} TFLOP/s ({records.label(hw_rec)})")
    assert tuned["tflops"] < 0.75 * matmul, "the words above: far below the matmul"

# %% [markdown]
# ## 2. Warps with different jobs
#
# The fix is to let *another* group of warps use the tensor cores while one group runs its softmax. On
# Hopper the unit of matrix work is a **warpgroup** (4 warps, 128 threads): one `wgmma` instruction
# multiplies a 64-row tile, asynchronously — the warpgroup issues it, carries on, and waits for the result
# only when it needs it. FlashAttention-3 builds the forward from three ideas:
#
# - **A producer.** One warp does nothing but issue copies with TMA (Hopper's tile-copy engine): the
#   program's Q block once, then K_j and V_j into a ring of `NUM_STAGES` shared-memory slots. Each slot
#   has a `ready` barrier (the copy engine signals it when the data has landed) and an `empty` barrier
#   (each consumer signals it when done with the slot). The producer needs few registers: `setmaxnreg`
#   gives it 24 per thread and hands the rest to the consumers.
# - **Consumers taking turns (ping-pong).** Two or three consumer warpgroups each own 64 query rows of the
#   tile and keep their m, l and O accumulator (64 x d, fp32) in registers. A `turn` barrier passed round
#   the consumers makes them issue their products one after the other, so one consumer's softmax runs
#   while another's products keep the tensor cores busy.
# - **Overlap inside a consumer.** Step j issues S_j = Q K_jᵀ *and* the previous step's O += P_{j-1}
#   V_{j-1}, waits only for S_j, and computes S_j's softmax while P_{j-1} V_{j-1} is still running.
#
# A **persistent grid** is optional on top: one program per SM loops over tiles, so one tile's epilogue
# (normalising and storing O) overlaps the next tile's first loads.
#
# Triton's language has no way to say "these warps run this function, those warps that one" (Triton 3.6's
# automatic `warp_specialize=True` failed to compile for this kernel with 4 warps and ran slower with 8,
# `notes/attention.md`). Gluon keeps Triton's Python syntax but exposes the layout of every tensor,
# shared-memory allocation, mbarriers, TMA copies, `warpgroup_mma` with explicit waits and
# `gl.warp_specialize` (a function per role). course_lib's kernel is about 450 lines of it.
#
# A simple model of the schedule shows what ping-pong buys. Each step of a consumer is M on the tensor
# cores followed by S of softmax; the tensor cores run one product at a time. Below, the same amount of
# work (eight tiles of 64 rows) done by one warpgroup that does everything in turn, and by two consumers
# that take turns:

# %%
def schedule(n_tiles: int, m: float, s: float, consumers: int) -> tuple[list, float]:
    """Greedy schedule of n_tiles steps (each: m on the tensor cores, then s of softmax), dealt round-robin
    to `consumers` warpgroups that share the tensor cores. Returns ([(consumer, kind, start, length)],
    end time)."""
    tc_free, ready, bars = 0.0, [0.0] * consumers, []
    for t in range(n_tiles):
        c = t % consumers
        start = max(tc_free, ready[c])  # the tensor cores are free and this consumer's softmax is done
        tc_free = start + m
        ready[c] = tc_free + s
        bars += [(c, "products (tensor cores)", start, m), (c, "softmax", tc_free, s)]
    return bars, max(ready)


M, S = step_clocks(128)
fig, axes = plt.subplots(2, 1, figsize=(9.0, 4.8), sharex=True, layout="constrained")
for ax, consumers in zip(axes, (1, 2)):
    bars, end = schedule(8, M, S, consumers)
    for c, kind, start, length in bars:
        color = "tab:blue" if kind.startswith("products") else "tab:orange"
        ax.barh(c, length, left=start, color=color, edgecolor="white", label=kind)
    ax.set_yticks(range(consumers), [f"warpgroup {c}" for c in range(consumers)])
    ax.set_title(f"{consumers} warpgroup{'s' if consumers > 1 else ''}: the 8 steps end at {end:.2f}")
handles, labels = axes[0].get_legend_handles_labels()
axes[1].legend(handles[:2], labels[:2], loc="lower right")
axes[1].set_xlabel("time (clocks per score of a tile, d = 128)")
plt.show()

# %% [markdown]
# **Exercise 1 — the ping-pong ceiling.** Two consumers, each doing steps of M on the tensor cores then S
# of softmax, the tensor cores shared. In the long run, how many times faster than one warpgroup doing
# everything in turn can they be? Write `pingpong_speedup(m, s)`. (Think of a pair of steps, one from each
# consumer: what must the tensor cores do in it, and what must each consumer do in it?)

# %%
def pingpong_speedup(m: float, s: float) -> float:
    ### BEGIN SOLUTION
    return 2 * (m + s) / max(2 * m, m + s)
    ### END SOLUTION


# %% tags=["check"]
check(
    "ping-pong speed-up",
    lambda: [pingpong_speedup(*step_clocks(d)) for d in (64, 128, 256)],
    [2.0, 1.5, 1.25],
)
check(
    "ping-pong speed-up, softmax longer than the products",
    lambda: pingpong_speedup(1, 2),
    2.0,
)

# %% [markdown]
# At d = 128 the ceiling is 1.5x over a kernel that overlaps nothing. The prediction written next to the
# ladder's rung (before it was measured) was lower, ~1.2x: the Triton kernel already overlaps loads, every
# hand-over costs a barrier, and the tiles on the causal diagonal are short. The first cell of section 4
# shows what was measured.
#
# ## 3. The variants, and which one runs
#
# A variant is a `hopper.Variant`, the kernel's constants `(BLOCK_N, NUM_STAGES, NUM_CONSUMERS, PINGPONG,
# PERSISTENT)` as named fields (`v.block_n`, `v.num_stages`, `v.num_consumers`, `v.pingpong`,
# `v.persistent`; it also unpacks as that tuple). `hopper.VARIANTS` lists the ones the tests check for each
# head dimension; `hopper.choose(d, causal, n_q, n_k)` returns the one to run for a shape, or None where the
# Triton kernel measured faster.

# %%
FIELDS = ("BLOCK_N", "NUM_STAGES", "NUM_CONSUMERS", "PINGPONG", "PERSISTENT")
for d_head, variants in hopper.VARIANTS.items():
    for v in variants:
        opts = v.kwargs()
        warps = 4 * v.num_consumers + 4
        fields = ", ".join(f"{name}={val}" for name, val in zip(FIELDS, v))
        print(f"d = {d_head:3}: {fields}")
        print(f"         {v.num_consumers * hopper.QUERY_ROWS} query rows per program, {warps} warps, "
              f"{opts['CONSUMER_REGS']} registers per consumer thread, {v.programs_per_sm} per SM")  # fmt: skip

# %% [markdown]
# Shared memory limits the variants. A program holds its Q block (64 rows per consumer) and `NUM_STAGES`
# slots of K_j and V_j (BLOCK_N rows each), all d wide, in bf16; one Hopper program may use at most
# 227 KB.
#
# **Exercise 2 — the shared-memory budget.** Write `smem_bytes(variant, d)`: the bytes of shared memory a
# variant's tiles take at head dimension d (2 bytes per element).

# %%
def smem_bytes(variant: tuple, d: int) -> int:
    block_n, stages, consumers, _pingpong, _persistent = variant
    ### BEGIN SOLUTION
    return (hopper.QUERY_ROWS * consumers + 2 * stages * block_n) * d * 2
    ### END SOLUTION


# %% tags=["check"]
check(
    "shared memory of a variant",
    lambda: [smem_bytes(hopper.D128_SHORT, 128), smem_bytes(hopper.D64, 64), smem_bytes((64, 4, 2, True, False), 128)],
    [229376, 122880, 163840],
    parts=["D128_SHORT at d = 128", "D64 at d = 64", "BLOCK_N 64, 4 stages, 2 consumers, d = 128"],
)

# %% [markdown]
# Every variant fits, and the d = 128 ones with two consumers use nearly all of it: a fourth stage would not
# fit, which is why stages, not consumers, were the knob that mattered most in the sweeps (a third stage at
# d = 128 gained more than any change of consumers; the sweeps are in `notes/attention.md`). The variants with
# one consumer take at most half (112 KB with 64-key blocks at d = 128) and half the registers: two of them
# run on an SM at once (`v.programs_per_sm`).

# %%
for d_head, variants in hopper.VARIANTS.items():
    for v in variants:
        used = (hopper.QUERY_ROWS * v.num_consumers + 2 * v.num_stages * v.block_n) * d_head * 2
        assert used * v.programs_per_sm <= SMEM_PER_PROGRAM, (d_head, v, used)
        print(f"d = {d_head:3}, {v}: {used / 1024:5.0f} KB of {SMEM_PER_PROGRAM // 1024} KB")

print("\nhopper.choose for causal attention (None: the Triton kernel runs):")
for d_head in (64, 128):
    for n in (1024, 2048, 4096, 8192, 16384):
        print(f"  d = {d_head:3}, N = {n:5}: {hopper.choose(d_head, True, n, n)}")

# %% [markdown]
# The rule behind `choose` came from sweeps on an H200: at d = 128 the Gluon kernel wins everywhere.
# Without the mask it runs persistent while rows are short (up to 32 K/V blocks), so that one tile's
# epilogue overlaps the next tile's loads. With the mask it runs persistent at every length, its tiles dealt
# longest first a chunk of heads at a time (the end of this section says why the chunk matters): short causal
# rows (N <= 2k) leave each tile only a few K/V blocks, too few to hide its start and its epilogue, and there
# the overlap pays most.
# At d = 64 the exponentials take as long as the products (S = M in section 1), so two consumers overlap
# fully only in perfect alternation: no slack is left to absorb a barrier or a late load. `choose` takes
# the Gluon kernel at d = 64 from 2k keys, with 128-row tiles on causal rows up to 4k, where the sweeps had
# it ahead, and its margin there is small (the record printed in section 4 has the measured cells). The
# sweeps ran grids of many tiles. A grid of a few (one sequence, few heads) gets its tiles in
# rounds of one a program, and a tile of 192 rows (d = 64) or 128 takes as long as one of the Triton kernel's
# smaller tiles would twice: given the batch and heads, `choose` counts the rows an SM gets from each kernel
# and takes the Triton kernel where it gets fewer (its docstring has the timings: one sequence of 8 heads at
# 4k keys, d = 64, 88 us with the Triton kernel, 114 with the Gluon one).
#
# A chunk of a prompt attending to its KV cache is causal **bottom-right**: query row i sees keys up to
# i + (N_k − N_q). The kernel takes that offset as one more run-time integer: it moves the last K/V block a
# tile loads, the first block that needs the mask, and the mask's comparison (`rows + offset >= cols`).
# With an offset at least N_q most of a row's keys lie before the diagonal, so `choose` treats such calls
# as unmasked ones over the keys a row sees on average (the sweep behind it: notes/attention.md).
#
# ### The persistent grid's schedule
#
# With one program per SM (132 on an H200), program `pid` must be given its tiles. The first attempt dealt
# them round-robin in head-major order (tiles pid, pid + 132, pid + 264, ...). With a causal mask, tiles
# differ in length: query block i (rows i·BLOCK_M to (i + 1)·BLOCK_M − 1) visits ⌈(i + 1)·BLOCK_M / BLOCK_N⌉ K/V
# blocks, i + 1 when BLOCK_M = BLOCK_N. Count each tile's work as its K/V blocks plus one (for its epilogue).
#
# **Exercise 3 — round-robin loads.** Write `round_robin_loads(work, programs)`: given the work of each
# tile in launch order, the total work of each program when program p takes tiles p, p + programs,
# p + 2·programs, ... (a list of `programs` numbers).

# %%
def round_robin_loads(work: list[int], programs: int) -> list[int]:
    ### BEGIN SOLUTION
    return [sum(work[p::programs]) for p in range(programs)]
    ### END SOLUTION


# %% tags=["check"]
check(
    "round-robin loads",
    lambda: (round_robin_loads([5, 1, 4, 2, 3], 2), round_robin_loads(list(range(10)), 4)),
    ([12, 3], [12, 15, 8, 10]),
    parts=["5 tiles on 2 programs", "10 tiles on 4 programs"],
)

# %% [markdown]
# Apply it to a cell of the notes' sweeps: d = 64,
# causal, N = 4096, B = 4, H = 32, three consumers (192 query rows per tile), K/V blocks of 128, 132
# programs. Then deal the same tiles longest first, in "snake" order (left to right, then right to left),
# which is what course_lib's persistent kernel does:

# %%
def causal_tile_work(n: int, rows: int, block_n: int, heads: int) -> list[int]:
    """Work of each tile (K/V blocks visited + 1), head-major order, for a causal forward."""
    per_head = [math.ceil(min(n, (i + 1) * rows) / block_n) + 1 for i in range(math.ceil(n / rows))]
    return per_head * heads


def program_loads(work: list[int], programs: int, snake: bool = False) -> list[int]:
    """Total work per program when tile i goes to program i % programs, in reverse on odd rounds if `snake`
    (course_lib's stand-in for Exercise 3, so that this cell runs whatever your answer)."""
    loads = [0] * programs
    for i, w in enumerate(work):
        rnd, k = divmod(i, programs)
        loads[programs - 1 - k if snake and rnd % 2 else k] += w
    return loads


work = causal_tile_work(4096, 3 * hopper.QUERY_ROWS, 128, heads=4 * 32)
schedules = {
    "round-robin": program_loads(work, 132),
    "longest first, snake": program_loads(sorted(work, reverse=True), 132, snake=True),
}
for name, loads in schedules.items():
    mean = sum(loads) / len(loads)
    print(f"{name:22}: busiest program {max(loads)}, mean {mean:.1f}: the grid takes {max(loads) / mean:.2f}x "
          "the balanced time")  # fmt: skip
assert max(schedules["longest first, snake"]) < max(schedules["round-robin"])

# %% [markdown]
# 132 is a multiple of the 22 query blocks per head, so round-robin gives each program the *same* query
# block of every head it visits: the program holding the last (longest) blocks does far more than the
# mean, and the whole grid waits for it. The longest-first snake order is nearly balanced. (On the H200 the
# round-robin schedule measured far slower at this cell than one program per tile; `notes/attention.md`,
# "Tried and rejected".) Balanced on paper is not the same as fast: at d = 128 the snake-dealt persistent grid
# at first still trailed one program per tile on causal rows. Sorting *all* the tiles longest first puts the
# first query block of every head in the first round: the 132 programs read the K and V of up to 132
# heads at once, and at short rows those no longer fit in the L2 (60 MiB on an H200), so many tiles read their
# keys from HBM. One program per tile runs a head's tiles side by side, and they share its keys in the L2.
# course_lib's kernel now sorts a *chunk* of heads at a time: with `programs` a multiple of a head's query
# blocks (`hopper.persistent_grid`), each round is one chunk of programs / blocks heads, longest first, so the
# snake still pairs each long tile with a short one and the keys read at once are the chunk's. The cell below
# counts the K/V bytes the first round reads each way, at d = 128 and 2k keys (B = 8, H = 16, 128-row tiles).

# %%
blocks_per_head = 2048 // 128
heads_per_chunk = 132 // blocks_per_head  # 8: 128 of the 132 programs, whole heads a round
kv_bytes_per_head = 2 * 2048 * 128 * 2  # K and V, bf16
for name, heads_read in (("all tiles longest first", min(132, 8 * 16)), ("a chunk at a time", heads_per_chunk)):
    mib = heads_read * kv_bytes_per_head / 2**20
    print(f"{name:24}: round 1 reads K and V of {heads_read:3} heads, {mib:4.0f} MiB (an H200's L2: 60 MiB)")

# %% [markdown]
# ### Few tiles: key splits and stream-K
#
# Notebook 14's cached prompt leaves the opposite problem: 3280 new query rows over 32k keys at 16 heads are
# 26 tiles of 128 rows a head, 416 tiles in all, each long (232-256 K/V blocks). On 132 SMs that is 3.15
# waves: the fourth holds 20 tiles and 112 SMs wait. `hopper.key_splits` cuts each tile's keys into S runs,
# each a unit of work whose partial (O, L) notebook 09's combine merges: more, shorter units, so the last round
# holds less, at the price of one more tile start, end and partial per run. `hopper.stream_work` (stream-K)
# goes further: each of the 132 programs takes an equal span of all the tiles' key blocks, one after the
# other; a tile cut between two programs writes its two parts into two slots of partials. The cell below
# deals the same tiles each way as the persistent kernel does (132 programs, round k's units dealt in snake
# order, `program_loads` above; a program's cost its K/V blocks plus one per tile part, for its start and end)
# and prints the busiest program's work against perfectly balanced work.

# %%
rows, heads, n_q, n_k, sms = 128, 16, 3280, 32768, 132
offset = n_k - n_q  # bottom-right: the new rows are the last of the keys
num_m = math.ceil(n_q / rows)
# each tile's K/V blocks, in the kernel's order (a head's longest query block first)
tiles = [min(n_k // 128, math.ceil(((num_m - m) * rows + offset) / 128)) for m in range(num_m)] * heads
balanced = (sum(tiles) + len(tiles)) / sms
variant = hopper.D64_ROWS_128
picked = hopper.key_splits(variant, heads, n_q, n_k, True, offset, sms)
for splits in (1, 2, 3, 4):
    # run r of every tile, then run r + 1 (the kernel's order): a run's blocks + 1
    runs = [(r + 1) * t // splits - r * t // splits + 1 for r in range(splits) for t in tiles]
    busiest = max(program_loads(runs, sms, snake=True))
    note = "  <- key_splits' pick" if splits == picked else ""
    print(f"{splits} run(s) a tile: {len(runs):4} units, busiest program {busiest / balanced:.3f}x balanced{note}")
table = hopper.stream_work(variant, heads, n_q, n_k, True, offset, sms).tolist()  # (tile, first block) a program
starts = [0]
for t in tiles:
    starts.append(starts[-1] + t)
stream = [  # a program's key blocks + one per tile part
    starts[t1] + lo1 - starts[t0] - lo0 + (t1 - t0 + (lo1 > 0)) for (t0, lo0), (t1, lo1) in zip(table, table[1:])
]
print(f"stream-K: {len(stream)} programs, busiest {max(stream) / balanced:.3f}x balanced")
assert sum(stream) >= sum(tiles) and max(stream) < max(program_loads([t + 1 for t in tiles], sms, snake=True))

# %% [markdown]
# On paper stream-K is within a percent of balanced, `key_splits`' pick 8 % off, one program a tile a third
# off. On an H200 (`scripts/serving_probe.py --prefill-key-splits`, notes/serving.md) stream-K beat the key
# splits at d = 64, by less than the paper's 8 %, and lost at d = 128: with 8 K/V heads of 32k keys its 132
# programs sweep 134 MB of keys at once, more than the L2 cache holds, while the key splits' programs of one
# head run side by side and share their K/V blocks there. So `decode.prefill_split` takes stream-K only where
# every head's K and V fit in the L2: balanced work is not the only cost that counts.
#
# ## 4. The Gluon kernel against the Triton kernel
#
# Notebook 08's ladder measured the Gluon forward against the autotuned Triton forward at one cell, d = 128,
# causal, N = 4096, as its last two forward rungs:

# %%
ladder_rec = records.load_record("ladder")
if ladder_rec is None:
    print("No recorded ladder in assets/benchmarks/ yet: run `make bench` on a GPU to record one.")
else:
    rungs = {s["name"]: s for s in ladder_rec["data"]["steps"] if s["pass_"] == "fwd" and s.get("status") == "ok"}
    triton_rung = rungs.get("autotuned (Triton)")
    gluon_rung = next((s for name, s in rungs.items() if name.startswith("warp-specialised")), None)
    if triton_rung and gluon_rung:
        print(f"Triton, autotuned:       {triton_rung['tflops']:5.0f} TFLOP/s ({triton_rung['ms']:.3f} ms)")
        print(f"Gluon, warp-specialised: {gluon_rung['tflops']:5.0f} TFLOP/s ({gluon_rung['ms']:.3f} ms)")
        print(f"Gluon over Triton: {triton_rung['ms'] / gluon_rung['ms']:.2f}x ({records.label(ladder_rec)})")

# %% [markdown]
# Before you look further: the same comparison at rows four times longer, d = 128, causal, **N = 16k**
# (B = 1, H = 16), the kernel `hopper.choose` picks against the autotuned Triton forward. How many times
# faster is the Gluon forward there? Reason from section 2: two consumers taking turns can be at most 1.5x
# faster at d = 128; the 4k cell above stayed below that, because every hand-over between consumers costs a
# barrier, the Triton kernel already overlaps its loads, each program has a start and an end (the first
# tiles' loads, the epilogue) that nothing overlaps, and the tiles on the causal diagonal are short. Which
# of these shrink, per unit of work, when each row has four times more keys? Type your estimate in place of
# the value.

# %%
gluon_guess = predict("Gluon forward over the Triton forward (d = 128, causal, N = 16k)", 1.3, unit="x")

# %% [markdown]
# Across shapes: on a Hopper GPU the next cell times the Triton forward, every variant of `hopper.VARIANTS`
# and SDPA's default backend at the cells of section 0, and records them (`hopper_forward`); elsewhere it
# shows the newest record.

# %%
HOPPER_GPU = course_lib.ON_GPU and torch.cuda.get_device_capability(DEVICE)[0] == 9


def variant_name(variant: tuple) -> str:
    """'Gluon: 2 consumers, 3 stages, ping-pong, persistent' for a variant tuple."""
    _block_n, stages, consumers, pingpong, persistent = variant
    name = f"Gluon: {consumers} consumer{'s' * (consumers != 1)}, {stages} stages"
    return name + ", ping-pong" * pingpong + ", persistent" * persistent


def measure_hopper_forward() -> dict:
    """TFLOP/s of the Triton forward, each Gluon variant and SDPA's default, causal bf16, per cell (d, N)."""
    results, chosen = [], {}
    for d_head, n in CELLS:
        b, h = 16384 // n, 2048 // d_head
        q, k, v = (torch.randn(b, h, n, d_head, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
        scale, flop = d_head**-0.5, timing.attention_flops(b, h, n, n, d_head, causal=True)
        o_ref, _ = forward.forward(q, k, v, True, scale, config={"hopper": False})
        o, lse = torch.empty_like(q), torch.empty(b, h, n, device=DEVICE, dtype=torch.float32)
        runs = {"Triton (autotuned)": lambda: forward.forward(q, k, v, True, scale, config={"hopper": False})}
        for variant in hopper.VARIANTS[d_head]:
            runs[variant_name(variant)] = lambda variant=variant: hopper.forward(q, k, v, o, lse, True, scale, variant)
        runs["SDPA default"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        for name, fn in runs.items():
            fn()
            diff = (o - o_ref).abs().max().item() if name.startswith("Gluon") else None
            assert diff is None or diff < 2e-2, f"{name}, d={d_head}, N={n}: max |O - O_triton| = {diff}"
            ms = timing.benchmark(fn, warmup_ms=10, rep_ms=50)
            results.append({"d": d_head, "N": n, "B": b, "H": h, "kernel": name, "ms": ms,
                            "tflops": flop / (ms * 1e-3) / 1e12, "max_abs_diff_vs_triton": diff})  # fmt: skip
        pick = hopper.choose(d_head, True, n, n)
        chosen[f"{d_head},{n}"] = "Triton (autotuned)" if pick is None else variant_name(pick)
    return {"causal": True, "dtype": "bfloat16", "results": results, "chosen": chosen}


def plot_hopper_forward(data: dict, source: str) -> None:
    """One panel per head dimension, stacked: TFLOP/s of each kernel per N; then choose's pick against the
    fastest."""
    heads = sorted({r["d"] for r in data["results"]})
    rows = len(heads)
    fig, axes = plt.subplots(rows, 1, figsize=(9.0, 0.8 + 6.4 * rows), squeeze=False, layout="constrained")
    for ax, d_head in zip(axes[:, 0], heads):
        rows = [r for r in data["results"] if r["d"] == d_head]
        ns = sorted({r["N"] for r in rows})
        kernels = list(dict.fromkeys(r["kernel"] for r in rows))
        tf = {(r["N"], r["kernel"]): r["tflops"] for r in rows}
        series = {kname: [tf.get((n, kname)) for n in ns] for kname in kernels}
        bar_chart([f"N = {n // 1024}k" for n in ns], series, xlabel="sequence length (causal, B·N = 16k)",
                  ylabel="TFLOP/s (higher is better)", title=f"d = {d_head}", ax=ax, fmt="{:.0f}")  # fmt: skip
        ax.legend(fontsize=11, loc="upper center", bbox_to_anchor=(0.5, -0.16))
        for n in ns:
            ours = [kname for kname in kernels if not kname.startswith("SDPA")]
            best = max(ours, key=lambda kname: tf.get((n, kname)) or 0.0)
            pick = data["chosen"][f"{d_head},{n}"]
            share = (tf.get((n, pick)) or 0.0) / tf[(n, best)]
            print(f"d = {d_head:3}, N = {n:5}: choose runs {pick} ({share:.2f}x the TFLOP/s of the "
                  f"fastest of course_lib's here: {best})")  # fmt: skip
    fig.suptitle(f"Causal forward, bf16: the Triton kernel, the Gluon variants, SDPA\n{source}")
    plt.show()


missing = (
    "No recorded `hopper_forward` run in assets/benchmarks/ yet. On a Hopper GPU this cell measures it: per "
    "cell (d, N), the Triton forward, each Gluon variant and SDPA's default in TFLOP/s, with the kernel "
    "`hopper.choose` picks."
)
got = records.measured_or_recorded("hopper_forward", measure_hopper_forward, missing, measure_here=HOPPER_GPU)
if got is not None:
    plot_hopper_forward(*got)
    cell_ms = {r["kernel"]: r["ms"] for r in got[0]["results"] if (r["d"], r["N"]) == (128, 16384)}
    if cell_ms:
        picked = got[0]["chosen"]["128,16384"]
        print(f"d = 128, N = 16k: {picked} over Triton (autotuned), {got[1]}:")
        _ = gluon_guess.score(cell_ms["Triton (autotuned)"] / cell_ms[picked])

# %% [markdown]
# Read the figure against section 3: where `choose` runs the Triton kernel, no Gluon variant should be far
# ahead, and where it runs a variant, that variant should be at or near the top. The printed shares say how
# near. A pick a few per cent behind the fastest is worth a second run: between runs, clocks and temperature
# move figures by a few per cent. One timing per cell cannot settle which way a line should go. The
# sweeps behind `choose` (`notes/attention.md`, "Why it is so") timed every candidate
# several times per cell, each first in turn (`course_lib.perf.timing.interleaved`). An earlier H200
# record had `choose` taking the persistent grid for causal rows of 2k keys, 5 % behind the plain ping-pong
# kernel. Repeated timings showed the same gap in two more runs, so `choose` took the plain kernel there,
# until the persistent grid dealt its tiles a chunk of heads at a time (section 3) and moved ahead at every
# causal length.
#
# ## 5. The backward: dK and dV without spilling
#
# course_lib's Triton dK/dV kernel (notebook 07's kernel with the tuned launch of notebook 08's ladder rung
# "tall resident blocks, 8 warps") gives each program a block of 128 keys and keeps their dK and dV (fp32)
# in registers while it streams the query blocks past them. It computes the *transposed* tiles Sᵀ = K Qᵀ
# and dPᵀ = V dOᵀ (128 keys x 64 queries), so that Pᵀ and dSᵀ come out ready to be the left operand of
# dV += Pᵀ dO and dK += dSᵀ Q. Count what one thread of its 8 warps must hold at once, at d = 128:
#
# - the accumulators: 2 x 128 x 128 fp32 values over 256 threads, 128 registers;
# - the two score tiles Sᵀ and dPᵀ: 2 x 128 x 64 / 256 = 64;
# - L and D, one value per *query*, and the queries are the tiles' columns. A `wgmma` result gives each
#   thread 2 rows but a quarter of the columns, so each thread needs 16 values of L and 16 of D: 32;
# - Pᵀ and dSᵀ converted to 16 bits to feed the next products from registers: 2 x 128 x 64 / 256 / 2
#   (two 16-bit values per register) = 32.
#
# That is 256, one more than a thread may have (255), before a single address or loop counter: the
# compiler spills to local memory (Nsight Compute's counters on an H200 show the spill requests,
# `notes/attention.md`). course_lib's Gluon dK/dV kernel (`course_lib/attention/hopper_backward.py`), with
# FlashAttention-3's warp specialisation, keeps the same 128 keys per program but arranges the work
# differently:
#
# - two consumer warpgroups each own 64 of the keys, so each thread holds the same 128 accumulator
#   registers, but with `setmaxnreg` the consumers get 240 each while the producer warp (TMA copies of Q
#   and dO into a ring of stages, as in the forward) gets 24;
# - the tiles are computed untransposed, S = Q Kᵀ (64 queries x 64 keys): L and D are now per *row*,
#   two values each per thread;
# - P and dS go to shared memory in 16 bits, and the tensor cores read them back transposed for
#   dV += Pᵀ dO and dK += dSᵀ Q (a `wgmma` reads a 16-bit shared-memory tile in either orientation).
#
# FlashAttention-3's own code offers both layouts (its `SdP_swapAB`). At d = 128 on Hopper it takes the
# transposed one and feeds Pᵀ and dSᵀ to dV and dK straight from registers, only dS going through shared
# memory (for dQ): fewer round trips. L and D, per column there, are read from shared memory when needed
# instead of held, and the operands replace the score tiles, which keeps the count under 240. course_lib's
# one-pass backward uses that arrangement (section 7).

# %% [markdown]
# **Exercise 4 — registers of a dK/dV program.** Write `dkdv_registers(keys, d, q_rows, threads,
# transposed, operands_in_registers)`: the registers per thread for the accumulators, the two score
# tiles, L and D, and (if `operands_in_registers`) the two 16-bit operand tiles, for `keys` keys of head
# dim d shared by `threads` threads and query blocks of `q_rows` rows, counted as above.


# %%
def dkdv_registers(keys: int, d: int, q_rows: int, threads: int, transposed: bool, operands_in_registers: bool) -> int:
    ### BEGIN SOLUTION
    accumulators = 2 * keys * d // threads
    tiles = 2 * keys * q_rows // threads
    l_and_d = 2 * (q_rows // 4 if transposed else 2)
    operands = tiles // 2 if operands_in_registers else 0
    return accumulators + tiles + l_and_d + operands
    ### END SOLUTION


# %% tags=["check"]
check(
    "registers per thread of a dK/dV program",
    lambda: [
        dkdv_registers(128, 128, 64, 256, transposed=True, operands_in_registers=True),  # Triton, d = 128
        dkdv_registers(64, 128, 64, 128, transposed=False, operands_in_registers=False),  # Gluon, d = 128
        dkdv_registers(128, 64, 64, 256, transposed=True, operands_in_registers=True),  # Triton, d = 64
        dkdv_registers(64, 64, 64, 128, transposed=False, operands_in_registers=False),  # Gluon, d = 64
        # two made-up programs that pull the terms apart: 128 query rows, transposed without operands in
        # registers; untransposed with them
        dkdv_registers(128, 128, 128, 256, transposed=True, operands_in_registers=False),
        dkdv_registers(128, 128, 64, 256, transposed=False, operands_in_registers=True),
    ],
    [256, 196, 192, 132, 320, 228],
)

# %% [markdown]
# At d = 64 the Triton layout fits (192). The Gluon kernel's small products (K = 64) lost to it there on
# steps of 64 query rows; at d = 64 it takes 128 rows a step, FlashAttention-3's tile, in the registers of
# d = 128's (196 by the count above), and then wins (the kernel alone 9-22 % faster than on 64 rows). course_lib
# runs the Gluon dK/dV kernel where `hopper_backward.choose` measured it faster (d = 128 and d = 64), with a dQ
# kernel before it (section 6). Its causal programs
# start with the first key blocks, which the most query blocks see, of a chunk of 8 (batch, K/V head)
# pairs, then the next chunk: section 3's lesson again, since over every head at once the first wave would
# stream the Q and dO of up to one head a program, more than the L2 holds (the chunks bought 9-15 % for
# this kernel at 1k-4k tokens; `hopper_backward.program_index` has the numbers).
# Its shared memory, at d = 128: the ring of Q and dO blocks, the K and V block, and a P and a dS tile per
# consumer:

# %%
stages, consumers = hopper_backward.LAUNCHES[128].num_stages, hopper_backward.LAUNCHES[128].num_consumers
rows, keys = hopper_backward.QUERY_ROWS, hopper_backward.KEY_ROWS
ring, kv_block, p_ds = stages * 2 * rows * 128, 2 * consumers * keys * 128, consumers * 2 * rows * keys
smem_bwd = (ring + kv_block + p_ds) * 2  # 16-bit elements
print(f"dK/dV program at d = 128: {smem_bwd // 1024} KB of shared memory ({stages} stages); "
      f"one program per SM ({SMEM_PER_PROGRAM // 1024} KB available)")  # fmt: skip
assert smem_bwd <= SMEM_PER_PROGRAM

# %% [markdown]
# On a Hopper GPU the next cell times the backward alone (the dQ kernel and the dK/dV kernel) with the
# Triton dK/dV kernel (`config={"hopper": False}`) and with the one `hopper_backward.choose` picks, at the
# cells of section 0, causal and not, and records them (`hopper_backward`); elsewhere it shows the newest
# record. Both run as two kernels (`hopper_onepass=False`: section 7's one pass would otherwise take the long
# cells).


# %%
def measure_hopper_backward() -> dict:
    """Backward-alone time (dQ + dK/dV), bf16, per cell: with the Triton dK/dV kernel, and with the one
    `hopper_backward.choose` picks (the Gluon kernel where it measured faster)."""
    results = []
    for d_head, n in CELLS:
        b, h = 16384 // n, 2048 // d_head
        for causal in (False, True):
            q, k, v, do = (torch.randn(b, h, n, d_head, device=DEVICE, dtype=torch.bfloat16) for _ in range(4))
            o, lse = forward.forward(q, k, v, causal)
            chosen = "Gluon" if hopper_backward.choose(d_head, causal, n, n, 1) else "Triton"
            grads = {}
            for name, config in (("Triton dK/dV", {"hopper": False}), ("as chosen", {"hopper_onepass": False})):
                fn = lambda config=config: backward.backward(do, q, k, v, o, lse, causal, config=config)
                grads[name] = fn()
                ms = timing.benchmark(fn, warmup_ms=10, rep_ms=50)
                results.append({"d": d_head, "N": n, "causal": causal, "kernel": name, "ms": ms, "chosen": chosen})
            for g_triton, g_chosen in zip(grads["Triton dK/dV"], grads["as chosen"]):
                assert (g_triton - g_chosen).abs().max().item() < 5e-2, f"d={d_head}, N={n}: gradients differ"
    return {"dtype": "bfloat16", "results": results}


def show_hopper_backward(data: dict, source: str) -> None:
    """Per cell: the backward's time with the Triton dK/dV kernel and with the chosen one, and the ratio."""
    rows = {(r["d"], r["N"], r["causal"], r["kernel"]): r for r in data["results"]}
    print(f"backward alone (dQ + dK/dV), bf16 — {source}")
    for d_head, n, causal in sorted({key[:3] for key in rows}):
        tri, cho = rows[(d_head, n, causal, "Triton dK/dV")], rows[(d_head, n, causal, "as chosen")]
        kind = "causal    " if causal else "non-causal"
        print(f"d = {d_head:3}, N = {n:5}, {kind}: Triton dK/dV {tri['ms']:6.3f} ms; "
              f"{cho['chosen']} dK/dV (chosen) {cho['ms']:6.3f} ms: {tri['ms'] / cho['ms']:.2f}x")  # fmt: skip


missing_bwd = (
    "No recorded `hopper_backward` run in assets/benchmarks/ yet. On a Hopper GPU this cell measures it: the "
    "backward's time per cell with the Triton dK/dV kernel and with the one `hopper_backward.choose` picks."
)
got_bwd = records.measured_or_recorded("hopper_backward", measure_hopper_backward, missing_bwd, measure_here=HOPPER_GPU)
if got_bwd is not None:
    show_hopper_backward(*got_bwd)

# %% [markdown]
# At d = 128 the Triton kernel spills, and the gain is largest on rows without the causal mask, where the
# dK/dV kernel is most of the backward. At d = 64 nothing spills; what the Gluon kernel gains there comes from
# its 128 query rows a step. (A record taken before section 6's dQ kernel existed times the Triton dQ kernel in
# both columns, and one before 2026-12-01 ran d = 64 on the Triton kernel in both: its date says which.)
#
# ## 6. The backward: dQ with warps that take jobs
#
# The dQ kernel recomputes S = Q Kᵀ and dP = dO Vᵀ for its block of query rows against every block of keys,
# then dS = P ∘ (dP − D) and dQ += dS K: three products a step and the softmax's exponentials between them,
# the same shape of work as the forward, and in Triton every warp does all of it in turn.
# FlashAttention-3 folds dQ into the dK/dV program with atomic additions (notebook 07, section 7 measured
# what those cost); course_lib keeps two kernels and gives the dQ kernel the forward's layout instead
# (`course_lib/attention/hopper_dq.py`):
#
# - a producer warp loads the program's Q and dO blocks once, then K and V blocks into a ring of stages;
# - each of two consumer warpgroups owns 64 query rows, with their L, D and dQ (64 x d fp32) in registers.
#   Step j issues S_j = Q K_jᵀ, dP_j = dO V_jᵀ and dQ += dS_{j−1} K_{j−1} as asynchronous `wgmma`s, waits
#   for S_j alone and computes P_j while the other two run, then waits for dP_j and computes dS_j while the
#   dQ product still runs. dS_j stays in registers, in 16 bits, as the left operand of the next step's
#   product (K_j as stored is already its right operand: no shared-memory round trip).
#
# The Triton dQ kernel computed D = rowsum(dO ∘ O) on the way (it holds dO); this one reads D, so the
# backward runs a small pass for D first (it reads O and dO once). Its shared memory at d = 128:

# %%
dq_launch = hopper_dq.LAUNCHES[128]
smem_dq = dq_launch.shared_bytes(128)
print(f"dQ program at d = 128: Q and dO for {dq_launch.num_consumers} consumers, a ring of "
      f"{dq_launch.num_stages} K/V blocks of {dq_launch.block_n} keys: {smem_dq // 1024} KB of shared memory "
      f"({SMEM_PER_PROGRAM // 1024} KB available)")  # fmt: skip
assert smem_dq <= SMEM_PER_PROGRAM

# %% [markdown]
# course_lib runs it beside the Gluon dK/dV kernel where `hopper_dq.choose` measured it faster: d = 128.
# At d = 64 the kernel alone ran about as fast as the Triton one, too little to pay for the D pass (the
# probe's figures, `scripts/hopper_dq_probe.py`, are in `notes/attention.md`). Notebook 08's ladder records
# what it gained in the whole backward — less than the kernel alone promised, and its reading says where
# to look.
#
# ## 7. The backward in one pass
#
# Two kernels compute S and dP twice, once for dK and dV, once for dQ: 7 tile products a step where the
# algorithm needs 5. FlashAttention-3 computes dQ in the dK/dV program instead. Each step's dS (its 64
# query rows against the program's 128 keys) times the program's K is that step's part of those rows' dQ;
# every key block adds its part, so the parts go into a float32 accumulator in global memory, and dQ is
# the accumulator cast to 16 bits at the end. course_lib's one pass (`course_lib/attention/hopper_onepass.py`)
# takes FlashAttention-3's transposed layout from section 5:
#
# - each consumer warpgroup computes Sᵀ = K_w Qᵀ and dPᵀ = V_w dOᵀ for its 64 keys, and feeds Pᵀ and dSᵀ to
#   dV += Pᵀ dO and dK += dSᵀ Q from registers, in 16 bits;
# - L and D belong to the queries, the tiles' columns: the producer warp copies each step's 64 values of
#   each into shared memory with Q and dO (the pass for D writes L · log₂ e beside D), and the consumers
#   read them there when they need them instead of holding 32 registers;
# - dSᵀ goes to shared memory once, for dQ = dS K: each warpgroup computes half of dQ's columns from both
#   warpgroups' dS tiles (an mbarrier makes each wait for the other's), then hands them to TMA, whose
#   reduce-add puts them into the accumulator while the warps go on to the next step.
#
# The accumulator costs memory: float32 dQ is twice dQ's bytes, and a model's backward peak (inputs,
# outputs and gradients) would rise by a quarter. The kernel runs in 4 launches over the (batch, K/V head)
# pairs, each with an accumulator for its own rows, so that it holds half dQ's bytes instead (in fewer
# launches where 4 would leave SMs idle: `hopper_onepass.slices`).
#
# **Exercise 5 — what one pass buys.** If the tensor cores' products set the backward's time, how many
# times faster is one pass (5 products a step) than two kernels (7)? The one pass also pays for what two
# kernels never do: the warpgroups wait for each other's dS every step, and 4 bytes per dQ element go
# through TMA's adds for every key block. Predict the one pass's speed-up over the two kernels at d = 64,
# N = 16k, causal, where the two kernels run a Triton dQ kernel and the Gluon dK/dV kernel on 128 query rows a
# step (section 5). Type your estimate in place of the value.

# %%
onepass_guess = predict("one pass over two kernels (d = 64, causal, N = 16k)", 1.4, unit="x")

# %% [markdown]
# On a Hopper GPU the next cell times the backward alone as two kernels (`hopper_onepass=False`) and as one
# pass (`hopper_onepass.backward`) at `ONE_PASS_CELLS` (section 0), causal and not, and records them
# (`hopper_onepass`); elsewhere it shows the newest record, in TFLOP/s of the backward's 2.5 x the
# forward's FLOPs.


# %%
def measure_one_pass() -> dict:
    """Backward-alone TFLOP/s, bf16, per cell: two kernels and the one pass; which `backward` runs there."""
    results = []
    for d_head, n in ONE_PASS_CELLS:
        b, h = 16384 // n, 2048 // d_head
        for causal in (False, True):
            q, k, v, do = (torch.randn(b, h, n, d_head, device=DEVICE, dtype=torch.bfloat16) for _ in range(4))
            o, lse = forward.forward(q, k, v, causal)
            flops = 2.5 * 4 * b * h * n * n * d_head * (0.5 if causal else 1.0)
            two = lambda: backward.backward(do, q, k, v, o, lse, causal, config={"hopper_onepass": False})
            one = lambda: hopper_onepass.backward(q, k, v, o, do, lse, 0, causal, d_head**-0.5)
            for got, want in zip(one()[:3], two()):
                assert (got - want).abs().max().item() < 5e-2, f"d={d_head}, N={n}: gradients differ"
            chosen = "one pass" if hopper_onepass.choose(d_head, causal, n, n, 1) else "two kernels"
            for name, fn in (("two kernels", two), ("one pass", one)):
                tflops = flops / timing.benchmark(fn, warmup_ms=10, rep_ms=50) / 1e9
                row = {"d": d_head, "N": n, "causal": causal, "kernel": name, "tflops": tflops, "chosen": chosen}
                results.append(row)
    return {"dtype": "bfloat16", "results": results}


def show_one_pass(data: dict, source: str) -> None:
    """Per cell: the two kernels' and the one pass's TFLOP/s, the ratio, and which one `backward` runs."""
    rows = {(r["d"], r["N"], r["causal"], r["kernel"]): r for r in data["results"]}
    print(f"backward alone, TFLOP/s, bf16 — {source}")
    for d_head, n, causal in sorted({key[:3] for key in rows}):
        two, one = rows[(d_head, n, causal, "two kernels")], rows[(d_head, n, causal, "one pass")]
        kind = "causal    " if causal else "non-causal"
        runs = "one pass" if hopper_onepass.choose(d_head, causal, n, n, 1) else "two kernels"  # the rule of now
        print(f"d = {d_head:3}, N = {n:5}, {kind}: two kernels {two['tflops']:5.0f}, one pass {one['tflops']:5.0f}: "
              f"{one['tflops'] / two['tflops']:.2f}x (backward runs: {runs})")  # fmt: skip


missing_one_pass = (
    "No recorded `hopper_onepass` run in assets/benchmarks/ yet. On a Hopper GPU this cell measures it: the "
    "backward's TFLOP/s per cell as two kernels and as one pass."
)
got_one_pass = records.measured_or_recorded(
    "hopper_onepass", measure_one_pass, missing_one_pass, measure_here=HOPPER_GPU
)
if got_one_pass is not None:
    show_one_pass(*got_one_pass)
    one_pass_rows = {(r["d"], r["N"], r["causal"], r["kernel"]): r["tflops"] for r in got_one_pass[0]["results"]}
    gains = {key[:3]: one_pass_rows[(*key[:3], "one pass")] / one_pass_rows[(*key[:3], "two kernels")]
             for key in one_pass_rows}  # fmt: skip
    if (64, 16384, True) in gains:
        onepass_guess.score(gains[(64, 16384, True)])
    longest = max(key[1] for key in gains)
    assert all(0.85 < gain < 7 / 5 for gain in gains.values()), f"one pass: never far behind, under 7 / 5: {gains}"
    at_longest = {key[2]: gain for key, gain in gains.items() if key[1] == longest}  # causal: gain
    assert all(gain > (1.0 if causal else 0.95) for causal, gain in at_longest.items()), (
        f"one pass at {longest}: faster on causal rows, level or faster without a mask: {gains}"
    )
    assert max(gains, key=gains.get)[2], "the largest gain is on causal rows"
    print(f"one pass over two kernels: {min(gains.values()):.2f}x to {max(gains.values()):.2f}x")

# %% [markdown]
# On the longest rows faster with a causal mask and level or a little faster without one; the largest gain is on
# causal rows, and under 7 / 5 = 1.4x. At 4096 tokens the two kernels, whose dK/dV kernel takes 128 query rows a
# step at d = 64 (section 5), were level on causal rows and faster without a mask (the range is printed above;
# before the 128-row steps the one pass won there). At d = 128, against two Gluon kernels, course_lib's probe
# measured it faster on causal rows from 2048 tokens, level without a mask up to 4096 and a few per cent faster
# beyond, and slower at 1024; at d = 64 and 2048 tokens level on causal rows and slower with grouped K/V heads, and
# at 1024 slower (`hopper_onepass.choose`'s docstring has the numbers). The products are not the whole step: each
# warpgroup waits for the other's dS before dQ's product, and dQ's products and adds follow dK's in the same warps,
# where the two kernels' dQ kernel has its warps to itself. So `backward` runs one pass at d = 64 from 4096 queries
# and keys with a causal mask (8192 without one), at d = 128 from 2048 with a causal mask (8192 without one, one
# query head per K/V head), two kernels elsewhere — and under `torch.use_deterministic_algorithms(True)`, since the
# order of TMA's adds, and so the last bits of dQ, changes from run to run.
#
# ## Summary
# - In the Triton forward every warp loads, multiplies and exponentiates in turn, so the tensor cores idle
#   during each softmax: from the units' throughputs, S / M = 64 / d, so they idle S / (M + S) = 64 / (d + 64)
#   of a step (a third at d = 128, half at d = 64).
# - FlashAttention-3 gives warps different jobs: a producer warp issues TMA copies into a ring of
#   shared-memory stages, consumer warpgroups (64 query rows each) take turns on the tensor cores
#   (ping-pong) and overlap their own softmax with their previous P V. The ceiling for two consumers is
#   2(M + S) / max(2M, M + S): 1.5x at d = 128.
# - Triton cannot express roles for warps; Gluon, Triton's lower-level dialect, exposes layouts, shared
#   memory, mbarriers, TMA, asynchronous `warpgroup_mma` and `warp_specialize`.
# - Shared memory (227 KB per program) bounds the variants; stages mattered most. A persistent grid needs a
#   balanced schedule: round-robin over causal tiles can leave one program with far more than its share.
#   Dealt longest first over every head, causal tiles still ran faster on a plain grid; dealt longest first a
#   chunk of heads at a time, so that the keys read at once stay in the L2, the persistent grid won.
# - course_lib runs the Gluon kernel where `hopper.choose` says it measured faster (d = 128 everywhere; d = 64
#   from 2k keys) and the Triton kernel elsewhere.
# - The Triton dK/dV kernel needs about 256 registers per thread at d = 128 (transposed tiles, L and D per
#   column, 16-bit operands in registers) and spills; the Gluon kernel's layout (FlashAttention-3's warp
#   specialisation, untransposed tiles, P and dS through shared memory, 240 registers for each consumer)
#   needs about 196, and runs the backward faster there.
# - The dQ kernel takes the forward's layout: a producer warp streams K and V, two consumer warpgroups keep
#   S, dP and dQ's products in flight behind the softmax; it reads D from a pass of its own (d = 128).
# - One pass (FlashAttention-3's transposed layout, dQ added into a float32 accumulator by TMA) does 5
#   products a step instead of 7, but its warpgroups wait for each other's dS: faster at d = 64 on rows of
#   4096 or more (causal or grouped ones from 2048), a tie at d = 128. Its accumulator is run in quarters to
#   keep the memory peak.
#
# ## Exercises
# 6. On a Hopper GPU, time `hopper.forward` with each of `hopper.VARIANTS` at d = 128, causal, N = 2k and
#    16k (section 4 does it for you: change `CELLS`), several times. Which wins where, and by more than the
#    spread between your runs? What should a persistent grid buy short tiles (section 3), and do your
#    timings show it?
# 7. Change `schedule` so that each consumer also overlaps its own softmax with its previous P V (split M
#    into the two products, S = Q Kᵀ first). How much does one consumer gain on its own?
# 8. Three consumers at d = 64: extend Exercise 1's reasoning to k consumers. Why could three beat two at
#    d = 64 on long rows, but not at d = 128? (Exercise 1's model alone gives 2x for two and for three at
#    d = 64: the answer lies in the slack it leaves, and at d = 128 in the shared memory three would need.)
#    Check it against the recorded d = 64 variants of section 4.
