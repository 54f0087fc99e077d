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
# # 01 · The roofline and the memory hierarchy
#
# FlashAttention is fast because it moves fewer bytes, not because it does fewer FLOPs. Before we can
# see why, we need two tools: the **memory hierarchy** of a GPU (what is small and fast, what is large
# and slow) and the **roofline model** (when is an operation limited by arithmetic, when by memory).
#
# **Learning goals**
# 1. Know the levels of a GPU's memory hierarchy with real sizes and bandwidths, and the ratio between
#    on-chip SRAM and HBM.
# 2. Compute FLOPs, bytes moved and arithmetic intensity of an operation, and the machine balance of a GPU;
#    tell compute-bound from memory-bound.
# 3. Measure the ceilings of your own device and place measured operations on its roofline.
# 4. Count the bytes that training holds per parameter, and check the count against PyTorch.
# 5. Predict the speed-up of kernel fusion, and the time of a memory-bound chain, from bytes; then measure.

# %%
import math

import matplotlib.pyplot as plt
import torch

import course_lib
from course_lib import perf, records
from course_lib.exercises import check
from course_lib.perf.plotting import bar_chart, plot_series, print_table, roofline

DEVICE = course_lib.DEVICE
print("running on:", course_lib.RUNTIME.describe())

# Every size this notebook uses, in one place (small on a CPU, real on a GPU).
COPY_NUMEL = course_lib.pick(cpu=2**24, gpu=2**28)  # 64 MiB / 1 GiB of fp32: far beyond every cache
MATMUL_N = course_lib.pick(cpu=1024, gpu=8192)  # the matmul that measures peak FLOP/s
ROWS, COLS = course_lib.pick(cpu=(4096, 4096), gpu=(16384, 8192))  # tensor for element-wise ops, reductions
MATMUL_SIZES = course_lib.pick(cpu=[32, 128, 512, 1024], gpu=[256, 1024, 4096, 8192])
OP_DTYPE = course_lib.pick(cpu=torch.float32, gpu=torch.bfloat16)
FUSION_NUMEL = course_lib.pick(cpu=2**24, gpu=2**28)
if not course_lib.ON_GPU:
    torch.set_num_threads(1)  # one CPU thread: steadier timings on a shared machine (remove to use all cores)

# %% [markdown]
# ## 1. The memory hierarchy, with real numbers
#
# A GPU has several kinds of memory. From the fastest and smallest to the largest and slowest:
#
# - **registers**: private to each thread; every SM (streaming multiprocessor) has a register file;
# - **SRAM**: each SM's L1 cache, most of which a kernel can use as *shared memory* (this is the "SRAM"
#   of the FlashAttention paper: where a kernel keeps its tiles);
# - **L2 cache**: shared by all SMs, managed by the hardware;
# - **HBM** (high-bandwidth memory; GDDR on consumer cards): the "GPU memory" that `torch.cuda` reports,
#   where every tensor lives between kernels;
# - **host DRAM**: the CPU's memory, reached over PCIe.
#
# The table below comes mostly from the vendor's datasheets, whitepapers and tuning guides (one figure, the
# H200's L2, as the device reports it through `cudaDeviceProp`; `course_lib.perf.hardware.GPUS`); the
# sources are printed under it.
# Throughputs are dense (no sparsity).
# One column is derived rather than quoted: no datasheet gives the SRAM bandwidth, so we estimate it as
# SMs × 128 bytes per clock (32 shared-memory banks of 4 bytes, CUDA C++ Programming Guide) × clock. For
# the A100 that gives 19.5 TB/s, in line with the FlashAttention paper's "around 19 TB/s"
# ([arXiv:2205.14135](https://arxiv.org/abs/2205.14135)).

# %%
print_table(perf.datasheet_rows())
print()
for name in perf.GPUS:
    print(f"Sources, {name}:")
    for doc, figures in perf.sources_by_document(name).items():
        print(f"  {doc}\n      -> {', '.join(figures)}")

# %% [markdown]
# SRAM is tiny and fast; HBM is large and slow. How tiny, how fast? Divide:

# %%
ratio_rows = []
for name, g in perf.GPUS.items():
    ratio_rows.append(
        {
            "GPU": name,
            "SRAM, all SMs (MB)": g.sram_total_mb,
            "HBM (GB)": float(g.hbm_gb),
            "HBM / SRAM capacity": g.hbm_gb * 1e9 / (g.sram_total_mb * 2**20),
            "SRAM / HBM bandwidth": g.sram_gbps / g.hbm_gbps,
        }
    )
print_table(ratio_rows)
assert all(r["HBM / SRAM capacity"] > 1000 and r["SRAM / HBM bandwidth"] > 5 for r in ratio_rows)

# %% [markdown]
# HBM holds thousands of times more than all the SRAM of the chip together, and the SRAM delivers
# several times (up to tens of times) the bandwidth. A kernel that keeps its working set in SRAM and
# touches HBM once per input and once per output is as good as it gets; a chain of kernels that writes
# every intermediate to HBM and reads it back pays the slow path again and again. Here is the hierarchy
# of one GPU on a log scale (L2 and register bandwidths are not published, so those bars are missing):

# %%
levels = perf.hierarchy("H200")
h200_ratios = next(r for r in ratio_rows if r["GPU"] == "H200")
fig, (ax_size, ax_bw) = plt.subplots(2, 1, figsize=(9.0, 8.5), layout="constrained")
short = ["registers", "SRAM", "L2", "HBM", "host link"]
bar_chart(
    short,
    [lv["bytes"] / 2**20 if lv["bytes"] else None for lv in levels],
    ax=ax_size,
    xlabel="level",
    ylabel="capacity (MB, log scale)",
    logy=True,
    fmt="{:,.0f}",
    title=f"H200: HBM holds {h200_ratios['HBM / SRAM capacity']:,.0f}x more than all SRAM",
)
bar_chart(
    short,
    [lv["gbps"] for lv in levels],
    ax=ax_bw,
    xlabel="level",
    ylabel="bandwidth (GB/s, log scale)",
    logy=True,
    fmt="{:,.0f}",
    title=f"...but SRAM is {h200_ratios['SRAM / HBM bandwidth']:.0f}x faster (SRAM: estimate)",
)
plt.show()

# %% [markdown]
# ### Why FLOP/s grew faster than bandwidth
#
# Each GPU generation adds far more arithmetic than memory bandwidth. From the table, for the data-centre
# GPUs in the order they came out:

# %%
generations = [("A100", 2020), ("H100", 2022), ("H200", 2024)]
gen_rows = []
for name, year in generations:
    g = perf.GPUS[name]
    gen_rows.append({"GPU": name, "year": year, "bf16 matmul TFLOP/s": g.matmul16_tflops, "HBM GB/s": g.hbm_gbps,
                 "FLOPs per byte": g.matmul16_tflops * 1e12 / (g.hbm_gbps * 1e9)})  # fmt: skip
print_table(gen_rows)
first, last = perf.GPUS[generations[0][0]], perf.GPUS[generations[-1][0]]
flops_growth = last.matmul16_tflops / first.matmul16_tflops
bw_growth = last.hbm_gbps / first.hbm_gbps
print(f"{generations[0][0]} -> {generations[-1][0]}: matmul FLOP/s x{flops_growth:.1f}, HBM bandwidth x{bw_growth:.1f}")
assert flops_growth > bw_growth

# %% [markdown]
# The reasons are physical. Arithmetic lives *on* the chip: each new process node packs more transistors,
# tensor cores do more multiply-adds per clock, and narrower formats (fp16, bf16, fp8) double the operations
# per unit of silicon each time the bits halve. Bandwidth must cross the chip's *edge*: it is bounded by the
# number of wires to memory and how fast each can signal, and moving a bit off-chip costs far more energy
# than a multiply-add. HBM stacks memory next to the GPU on a shared substrate to get thousands of wires,
# but the edge grows much more slowly than the area. Over two decades of server hardware, peak FLOP/s grew
# about 3x every two years and DRAM bandwidth about 1.6x (Gholami et al., "AI and Memory Wall",
# [arXiv:2403.14123](https://arxiv.org/abs/2403.14123)). The "FLOPs per byte" column is the consequence:
# ever more arithmetic per byte is needed to keep the chip busy, and an algorithm that moves fewer bytes,
# even at the price of more FLOPs, wins more with every generation. FlashAttention is such an algorithm.
# (The H200 is the H100's chip with faster memory: its balance went *down*, a rare exception.)
#
# ## 2. Compute-bound or memory-bound: the roofline model
#
# For any operation count two things:
# - **FLOPs**: floating-point operations it must do (a multiply-add counts 2);
# - **bytes**: what it must move between HBM and the chip: each input read once, each output written once.
#
# Their ratio is the **arithmetic intensity** I = FLOPs / bytes (FLOP/byte). A GPU can do at most P FLOP/s
# (peak compute) and move at most B bytes/s (HBM bandwidth), so an operation takes at least
#
# $$ t \ge \max\left(\frac{\text{FLOPs}}{P}, \frac{\text{bytes}}{B}\right),
# \qquad \text{achieved FLOP/s} \le \min(P,\; B \cdot I). $$
#
# The second form is the **roofline**. Its corner, the **machine balance** P / B, is the intensity at which
# memory time equals compute time: below it an operation is **memory-bound** (faster arithmetic would not
# help), above it **compute-bound**. `course_lib.perf.attainable_tflops` implements the second line and
# `machine_balance` gives the corner; the first line is yours to write.
#
# **Exercise 1: the roofline time.** Write `roofline_time_ms(flops, nbytes, peak_tflops, bandwidth_gbps)`:
# the least time, in milliseconds, that an operation of `flops` FLOPs moving `nbytes` bytes can take on a
# device with a peak of `peak_tflops` TFLOP/s (10¹² FLOP/s) and a bandwidth of `bandwidth_gbps` GB/s
# (10⁹ bytes/s). Mind the units. The check times two operations on an H200's datasheet figures (989
# TFLOP/s, 4800 GB/s): a bf16 softmax over 16384 × 8192 elements and a bf16 matmul of n = 8192, plus a
# made-up device. (`course_lib.perf.roofline_ms` is the finished piece the rest of the course uses.)


# %%
def roofline_time_ms(flops: float, nbytes: float, peak_tflops: float, bandwidth_gbps: float) -> float:
    ### BEGIN SOLUTION
    compute_ms = flops / (peak_tflops * 1e12) * 1e3
    memory_ms = nbytes / (bandwidth_gbps * 1e9) * 1e3
    return max(compute_ms, memory_ms)
    ### END SOLUTION


# %% tags=["check"]
_rows = 16384 * 8192
_cases = [
    (5 * _rows, 2 * 2 * _rows, 989, 4800),  # softmax, bf16: 5 FLOPs, read 2 bytes and write 2 per element
    (2 * 8192**3, 3 * 8192**2 * 2, 989, 4800),  # matmul n = 8192, bf16
    (1e9, 1e9, 0.5, 100),  # a made-up device: 1 GFLOP and 1 GB
]
check(
    "roofline time",
    lambda: [roofline_time_ms(*case) for case in _cases],
    [perf.roofline_ms(*case) for case in _cases],
    rtol=1e-9,
    parts=["softmax on an H200", "matmul 8192 on an H200", "a made-up device"],
)

# %% [markdown]
#
# A GPU has *two* compute peaks that matter here: the tensor cores, which only do matrix multiplication,
# and the ordinary fp32 units that do everything else (max, add, multiply, ...). Exponentials are slower
# still: they run on special-function units with a fraction of the fp32 units' throughput (notebook 08
# counts what that costs attention).

# %%
balance_rows = [
    {
        "GPU": name,
        "16-bit matmul (TFLOP/s)": float(g.matmul16_tflops),
        "fp32 non-matmul (TFLOP/s)": g.fp32_tflops,
        "matmul / non-matmul": g.matmul16_tflops / g.fp32_tflops,
        "balance, matmul (FLOP/B)": g.balance(matmul=True),
        "balance, non-matmul (FLOP/B)": g.balance(matmul=False),
    }
    for name, g in perf.GPUS.items()
]
print_table(balance_rows)
a100 = perf.gpu("A100")
assert a100.matmul16_tflops / a100.fp32_tflops == 16

# %% [markdown]
# **Why non-matmul FLOPs are expensive.** On an A100 a tensor-core matmul runs at 312 TFLOP/s (fp16/bf16)
# while everything else runs at 19.5 TFLOP/s (fp32), both from the A100 datasheet: each non-matmul FLOP
# costs as much time as 16 matmul FLOPs. The FlashAttention-2 paper
# ([arXiv:2307.08691](https://arxiv.org/abs/2307.08691)) makes exactly this point and reorganises the
# algorithm to do fewer of them. The softmax in attention (exp, max, sum, divide) is all non-matmul work.
#
# ## 3. Worked examples: the intensity of common operations
#
# `perf.operation_costs` counts FLOPs and minimum bytes for element-wise operations (ReLU, dropout,
# masking), reductions (sum, softmax, layer norm), and `perf.matmul_cost` for an n × n matmul
# (2n³ FLOPs, 3n² elements moved). Compare each intensity with the H200's balance:

# %%
h200 = perf.gpu("H200")
ELEM = 2  # bf16
rows = []
for name, (flops, nbytes) in perf.operation_costs(16384, 8192, ELEM).items():
    rows.append(
        {
            "operation": name,
            "FLOP/element": flops / (16384 * 8192),
            "intensity (FLOP/B)": perf.arithmetic_intensity(flops, nbytes),
        }
    )
for n in (256, 1024, 4096, 16384):
    flops, nbytes = perf.matmul_cost(n, ELEM)
    rows.append(
        {
            "operation": f"matmul {n}",
            "FLOP/element": None,
            "intensity (FLOP/B)": perf.arithmetic_intensity(flops, nbytes),
        }
    )
for r in rows:
    matmul = r["operation"].startswith("matmul")
    r["H200 verdict"] = "compute-bound" if r["intensity (FLOP/B)"] > h200.balance(matmul) else "memory-bound"
print(f"H200 balance: {h200.balance(True):.0f} FLOP/B for matmul, {h200.balance(False):.1f} FLOP/B otherwise")
print_table(rows)
assert all(r["H200 verdict"] == "memory-bound" for r in rows if not r["operation"].startswith("matmul"))

# %% [markdown]
# Every element-wise operation and every reduction does a handful of FLOPs per element but moves 2 to 5
# bytes per element (bf16: read 2, and write 2 unless it reduces the row away; dropout and masking also
# move a 1-byte mask): an intensity of 0.2 to 2 FLOP/B, roughly 7x to 70x below even the non-matmul
# balance, and far below the matmul one. They are memory-bound on every GPU in the table; their time is
# bytes / bandwidth. A matmul's intensity grows with its size, 2n / (3 × bytes per element), so large
# matmuls are compute-bound:

# %%
ns = [2**i for i in range(5, 15)]
plot_series(
    ns,
    {
        "matmul n x n (bf16)": [
            perf.matmul_cost(n, ELEM)[0] / perf.matmul_cost(n, ELEM)[1] for n in ns
        ],
        "H200 balance (tensor cores)": [h200.balance(True)] * len(ns),
        "softmax (bf16)": [5 / 4] * len(ns),
    },
    xlabel="matrix size n",
    ylabel="arithmetic intensity (FLOP/byte)",
    logx=True,
    logy=True,
    title="A matmul's intensity grows with n; softmax's never does",
)
plt.show()

# %% [markdown]
# ## 4. The ceilings of *your* device
#
# Datasheet peaks are upper bounds. We measure two ceilings here:
# - **bandwidth**: a large copy (`dst = src * 1`, one read and one write per element), counting bytes
#   read plus bytes written;
# - **compute**: a large matmul (2n³ FLOPs), bf16 on a GPU, fp32 on a CPU.
#
# Timing uses `course_lib.perf.timing.benchmark`: on a GPU, the median of CUDA-event timings after warm-up,
# with the L2 cache flushed before each call (notebook 08 says how); on a CPU a wall-clock median. The
# copy is timed as a replay of a CUDA graph, as the benchmarks time the kernels they compare with it
# (notebook 08): no CPU launch cost in the figure.

# %%
copy_gbps = perf.measure_copy_bandwidth(COPY_NUMEL)
peak_dtype = course_lib.pick(cpu=torch.float32, gpu=torch.bfloat16)
peak_tflops = perf.measure_matmul_tflops(MATMUL_N, peak_dtype)
fp32_tflops = (
    peak_tflops if not course_lib.ON_GPU else perf.measure_matmul_tflops(MATMUL_N, torch.float32)
)
print(f"copy bandwidth          : {copy_gbps:8.1f} GB/s   ({COPY_NUMEL * 4 / 2**20:.0f} MB copied)")
print(f"matmul {MATMUL_N} ({str(peak_dtype)[6:]}) : {peak_tflops:8.3f} TFLOP/s")
if course_lib.ON_GPU:
    print(f"matmul {MATMUL_N} (fp32)    : {fp32_tflops:8.3f} TFLOP/s  (no tensor cores unless TF32 is on)")
print(f"machine balance          : {perf.machine_balance(peak_tflops, copy_gbps):8.1f} FLOP/byte")
assert copy_gbps > 0 and peak_tflops > 0

# %% [markdown]
# ## 5. Measured operations on the roofline
#
# Now we time the operations of section 3 on this device and put each one on the roofline: x = its
# intensity (FLOPs over the minimum bytes), y = the FLOP/s it achieved (FLOPs over measured time). A point
# on the slanted line is limited by bandwidth, one on the flat line by compute; a point far below both
# lines wastes time somewhere else (launch overhead, poor use of the hardware, or, on a CPU, the operating
# system handing out fresh memory pages for every new output tensor).

# %%
points = perf.measure_operations(ROWS, COLS, MATMUL_SIZES, dtype=OP_DTYPE)
# A ceiling is the best rate the device showed. On a busy machine one measurement can come out low, so
# raise each ceiling to the best that any operation reached (on a GPU this changes nothing).
peak_tflops = max([peak_tflops] + [perf.achieved_tflops(p) for p in points if p["kind"] == "matmul"])
copy_gbps = max([copy_gbps] + [p["bytes"] / (p["ms"] * 1e6) for p in points if p["kind"] != "matmul"])
if not course_lib.ON_GPU:
    fp32_tflops = peak_tflops
ceilings = [(f"this {DEVICE.type}, {str(peak_dtype)[6:]} matmul (measured)", peak_tflops, copy_gbps)]
if course_lib.ON_GPU:
    ceilings.append(("this GPU, fp32 (measured)", fp32_tflops, copy_gbps))
table = []
for p in points:
    intensity = perf.arithmetic_intensity(p["flops"], p["bytes"])
    roof = perf.attainable_tflops(
        intensity, peak_tflops if p["kind"] == "matmul" else fp32_tflops, copy_gbps
    )
    achieved = perf.achieved_tflops(p)
    table.append(
        {
            "operation": p["name"],
            "ms": p["ms"],
            "intensity": intensity,
            "TFLOP/s": achieved,
            "GB/s": p["bytes"] / (p["ms"] * 1e6),
            "% of roofline": 100 * achieved / roof,
        }
    )
print_table(table)

# %% [markdown]
# The recorded GPU figures (`make bench` on a GPU, `course_lib.perf.ceilings.measure_record`) let a CPU learner
# see the same picture on a real GPU, next to their own. They are labelled with the GPU and the date.

# %%
rec = records.load_record("hardware")
all_points = [dict(p, label=f"this {DEVICE.type}") for p in points]
all_ceilings = list(ceilings)
if rec is None:
    print(
        "No recorded GPU figures yet (assets/benchmarks/hardware-*.json): `make bench` on a GPU makes them."
    )
elif not course_lib.ON_GPU:
    data = rec["data"]
    gpu_name = rec["meta"]["gpu"]
    print("Recorded:", records.label(rec))
    all_ceilings += [
        (f"{gpu_name} bf16 matmul (recorded)", data["matmul_tflops"]["bfloat16"], data["copy_gbps"]),
        (f"{gpu_name} fp32 (recorded)", data["matmul_tflops"]["float32"], data["copy_gbps"]),
    ]
    all_points += [dict(p, label=f"{gpu_name}, recorded") for p in data["operations"]]
ax = roofline(
    all_ceilings,
    all_points,
    title="Element-wise ops and reductions sit far left of the ridge; big matmuls reach the roof",
)
plt.show()

# %% [markdown]
# Read the picture: the element-wise operations and reductions cluster at intensity ≈ 0.1–2 FLOP/byte,
# far left of every ridge. They cannot use more than a few percent of the compute peak, whatever the
# implementation. Small matmuls sit near or left of the ridge and far below both roofs (their time is
# launch and latency, not bytes); only the large ones get close to the flat roof.
#
# ## 6. Memory when training
#
# Training with Adam keeps, for every parameter: the parameter, its gradient, and Adam's two moments
# (running means of the gradient and of its square). With mixed precision (the ZeRO paper's accounting,
# [arXiv:1910.02054](https://arxiv.org/abs/1910.02054)) the parameters and gradients are 16-bit, and the
# optimizer also keeps an fp32 **master copy** of the weights, so that small updates are not rounded away:
#
# | what | fp32 training | mixed precision |
# | --- | --- | --- |
# | parameters | 4 B | 2 B (bf16/fp16) |
# | gradients | 4 B | 2 B |
# | optimizer states | 8 B (two fp32 moments) | 12 B (fp32 master + two fp32 moments) |
# | total | 16 B | 16 B |
#
# The ratio P : G : optimizer states depends on the precision scheme, so always say which one:
# - **fp32 training** (the table's first column): 4 : 4 : 8 = **1 : 1 : 2**;
# - **mixed precision** as ZeRO counts it (16-bit parameters and gradients; fp32 master weights and two fp32
#   moments in the optimizer, the table's second column): 2 : 2 : 12 = **1 : 1 : 6**;
# - mixed precision that also keeps **fp32 master gradients** (some frameworks accumulate gradients in
#   fp32): 2 : 4 : 12 = **1 : 2 : 6**, 18 bytes per parameter.
#
# The first two come to 16 bytes per parameter before a single activation is stored. Let us check both
# against what PyTorch allocates for a small model. We count the bytes of the tensors themselves (this
# works on any device); on a GPU we also compare with `torch.cuda.memory_allocated`.


# %%
def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def adam_state_bytes(optimizer) -> int:
    # exp_avg and exp_avg_sq per parameter; the scalar step counters are left out (4 bytes per tensor)
    return tensor_bytes(v for state in optimizer.state.values() for k, v in state.items() if k != "step")


torch.manual_seed(0)
# Warm-up: cuBLAS allocates a workspace on first use in each thread (backward runs in its own thread).
torch.nn.Linear(8, 8).to(DEVICE)(torch.randn(2, 8, device=DEVICE)).sum().backward()
allocated_before = torch.cuda.memory_allocated() if course_lib.ON_GPU else None
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).to(
    DEVICE
)
optimizer = torch.optim.Adam(model.parameters())
x = torch.randn(32, 1024, device=DEVICE)
model(x).square().mean().backward()
optimizer.step()
n_params = sum(p.numel() for p in model.parameters())
measured = {
    "parameters": tensor_bytes(model.parameters()),
    "gradients": tensor_bytes(p.grad for p in model.parameters()),
    "optimizer states": adam_state_bytes(optimizer),
}
budget = {k: v * n_params for k, v in perf.training_bytes_per_param(mixed_precision=False).items()}
print(f"{n_params:,} parameters, fp32 + Adam")
print_table(
    [{"what": k, "measured (MB)": measured[k] / 1e6, "predicted (MB)": budget[k] / 1e6} for k in budget]
)
assert measured == budget
if course_lib.ON_GPU:
    held = torch.cuda.memory_allocated() - allocated_before
    print(
        f"torch.cuda.memory_allocated grew by {held / 1e6:.2f} MB "
        f"(predicted {sum(budget.values()) / 1e6:.2f} MB "
        "plus the input and the loss)"
    )
    assert abs(held - sum(budget.values())) < 0.1 * sum(budget.values())

# %% [markdown]
# Now mixed precision, written out: a bf16 copy of the model computes forward and backward (bf16
# gradients); the optimizer updates fp32 master weights and copies them back into the bf16 model.

# %%
model16 = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
model16 = model16.to(DEVICE, torch.bfloat16)
master = [p.detach().float().requires_grad_() for p in model16.parameters()]  # fp32 master weights
optimizer16 = torch.optim.Adam(master)
model16(x.bfloat16()).float().square().mean().backward()  # bf16 gradients
for m, p in zip(master, model16.parameters()):
    m.grad = p.grad.float()  # a transient fp32 copy for the update
optimizer16.step()
with torch.no_grad():
    for m, p in zip(master, model16.parameters()):
        p.copy_(m)  # new bf16 weights
        m.grad = None
measured16 = {
    "parameters": tensor_bytes(model16.parameters()),
    "gradients": tensor_bytes(p.grad for p in model16.parameters()),
    "optimizer states": tensor_bytes(master) + adam_state_bytes(optimizer16),
}
budget16 = {k: v * n_params for k, v in perf.training_bytes_per_param(mixed_precision=True).items()}
print_table(
    [{"what": k, "measured (MB)": measured16[k] / 1e6, "predicted (MB)": budget16[k] / 1e6} for k in budget16]
)
print("P : G : states =", " : ".join(f"{v / measured16['parameters']:.0f}" for v in measured16.values()))
assert measured16 == budget16

# %% [markdown]
# Sixteen bytes per parameter adds up fast: a 7-billion-parameter model needs 112 GB for weights,
# gradients and Adam alone, more than an 80 GB H100 holds, before any activation. Activations (what the
# forward pass saves for the backward pass) come on top and grow with batch size and sequence length;
# in notebook 02 we will see that standard attention's activations grow with the *square* of the
# sequence length.
#
# ## 7. Kernel fusion
#
# Eager PyTorch runs one kernel per operation, and every kernel reads its input from HBM and writes its
# output back. `perf.ceilings.elementwise_chain(x) = relu(x * 0.5 + 1) * 2` is four element-wise operations
# on a tensor of N elements:
#
# - **eager**: 4 kernels, one per operation, each reading its input from memory and writing its output back;
# - **fused**: one kernel reads x once, keeps the intermediates in registers, writes y once.
#
# All four operations are memory-bound (section 3).
#
# **Predict first, twice.** (1) How many times faster is the fused version than the eager one? (2) How many
# milliseconds does the *eager* chain take on an H200 for N = 2²⁸ fp32 elements (4 bytes each), at the HBM
# bandwidth of its datasheet (the table of section 1)? Count the element transfers of each version, and
# type your estimates in place of the values in the cell that follows `fuse_by_chunks` below.
#
# On a GPU, `torch.compile` generates that fused kernel (a Triton kernel). On a CPU, compiling would take
# longer than the rest of this notebook, so here we fuse by hand the way a CPU does it well: process the
# tensor in chunks
# small enough to stay in the CPU's cache through all four operations (each chunk makes one trip to
# DRAM). That is the idea of **tiling**, which FlashAttention applies to attention.


# %%
def fuse_by_chunks(f, chunk=2**15):
    """Apply element-wise f chunk by chunk: a 128 KiB chunk stays in cache through all of f's operations."""

    def fused(x):
        out = torch.empty_like(x)
        for xs, outs in zip(x.split(chunk), out.split(chunk)):
            outs.copy_(f(xs))
        return out

    return fused


# %%
from course_lib.exercises import predict

# Your predictions, before the measurement: type each number in place of the value.
# (1) the fused version's speed-up over eager, on any device
fusion_guess = predict("fusion speed-up (4 element-wise ops)", 4.0, unit="x")
# (2) the eager chain's time on an H200, N = 2**28 fp32 elements, at its datasheet bandwidth
h200_eager_guess = predict("eager 4-op chain on an H200 at 2**28 fp32 elements", 1.8, unit=" ms")

# %%
fusion = perf.measure_fusion(FUSION_NUMEL, compile_fn=None if course_lib.ON_GPU else fuse_by_chunks)
assert "error" not in fusion, fusion.get("error")
how = "torch.compile" if course_lib.ON_GPU else "chunks in cache"
print(f"{FUSION_NUMEL * 4 / 2**20:.0f} MB of fp32, on this {DEVICE.type}:")
print(f"  eager (4 kernels)       : {fusion['eager_ms']:8.3f} ms")
print(f"  fused ({how:<16}): {fusion['fused_ms']:8.3f} ms")
print(
    f"  speed-up: measured {fusion['speedup']:.1f}x, predicted from bytes {fusion['predicted_speedup']:.0f}x"
)
_ = fusion_guess.score(fusion["speedup"])

# %% [markdown]
# The count: eager, each of the 4 kernels reads N elements and writes N, 8N element transfers; fused, x is read
# once and y written once, 2N. If the time follows the bytes, fusion is **4×** faster. On an H200, the eager
# chain moves 8 × 2²⁸ × 4 bytes = 8.6 GB; at the datasheet's 4.8 TB/s that takes about 1.8 ms, a lower
# bound (no real kernel reaches the datasheet bandwidth). The second prediction is scored against a GPU's
# measurement: this GPU's at the same size, or on a CPU the recorded H200 run.

# %%
f_rec = None if rec is None else rec["data"]["fusion"]
if course_lib.ON_GPU and FUSION_NUMEL == 2**28:
    print(f"this GPU ({torch.cuda.get_device_name()}): eager chain {fusion['eager_ms']:.3f} ms")
    _ = h200_eager_guess.score(fusion["eager_ms"])
elif f_rec is not None and "error" not in f_rec and f_rec["numel"] == 2**28:
    print(f"Recorded on {rec['meta']['gpu']}: eager chain {f_rec['eager_ms']:.3f} ms; {records.label(rec)}")
    _ = h200_eager_guess.score(f_rec["eager_ms"])
else:
    print("No GPU measurement of the chain at N = 2**28 here (run `make bench` on a GPU to record one).")

# %%
labels, eager_ms, fused_ms = [f"this {DEVICE.type}"], [fusion["eager_ms"]], [fusion["fused_ms"]]
if rec is not None and not course_lib.ON_GPU and "error" not in rec["data"]["fusion"]:
    f_rec = rec["data"]["fusion"]
    print(
        f"Recorded on {rec['meta']['gpu']} (torch.compile, {f_rec['numel'] * 4 / 2**20:.0f} MB): "
        f"eager {f_rec['eager_ms']:.3f} ms, fused {f_rec['fused_ms']:.3f} ms, "
        f"speed-up {f_rec['speedup']:.1f}x "
        f"(predicted {f_rec['predicted_speedup']:.0f}x); {records.label(rec)}"
    )
    labels.append(f"{rec['meta']['gpu']} (recorded)")
    eager_ms.append(f_rec["eager_ms"])
    fused_ms.append(f_rec["fused_ms"])
speedups = [e / f for e, f in zip(eager_ms, fused_ms)]
bar_chart(
    labels,
    {"measured speed-up": speedups, "predicted from bytes": [4.0] * len(labels)},
    xlabel="device",
    ylabel="fused vs eager speed-up (x)",
    title="Fusing 4 element-wise ops: measured "
    + ", ".join(f"{s:.1f}x" for s in speedups)
    + " against 4x predicted from the bytes",
)
plt.show()

# %% [markdown]
# Fusion pays exactly because these operations are memory-bound: removing HBM round trips removes
# time. It would not help a compute-bound matmul. Keep this in mind for notebook 02: the softmax,
# masking and dropout of attention are memory-bound operations on N × N matrices.
#
# ## 8. Exercises
#
# **Exercise 2: SiLU.** `y = x * sigmoid(x)` where `sigmoid(x) = 1 / (1 + exp(-x))`. Count 4 FLOPs per
# element (exp, add, divide, multiply; negation is free). Write `silu_intensity(elem_bytes)`, its
# arithmetic intensity for elements of `elem_bytes` bytes (read x once, write y once).


# %%
def silu_intensity(elem_bytes: int) -> float:
    ### BEGIN SOLUTION
    return 4 / (2 * elem_bytes)
    ### END SOLUTION


# %% tags=["check"]
check("silu_intensity", lambda: [silu_intensity(2), silu_intensity(4)], [1.0, 0.5])

# %% [markdown]
# **Exercise 3: when does a matmul become compute-bound?** Write `compute_bound_n(peak_tflops,
# bandwidth_gbps, elem_bytes)`: the smallest integer n at which an n × n × n matmul's intensity
# (2n³ FLOPs over 3n² elements) reaches the machine balance. The check uses the H200 and A100 datasheet
# figures (bf16).


# %%
def compute_bound_n(peak_tflops: float, bandwidth_gbps: float, elem_bytes: int) -> int:
    ### BEGIN SOLUTION
    balance = perf.machine_balance(peak_tflops, bandwidth_gbps)
    return math.ceil(3 * elem_bytes * balance / 2)
    ### END SOLUTION


# %% tags=["check"]
check("compute_bound_n", lambda: [compute_bound_n(989, 4800, 2), compute_bound_n(312, 2039, 2)], [619, 460])

# %% [markdown]
# **Exercise 4: does it fit?** Write `adam_training_gb(n_params, mixed_precision)`: the GB (10⁹ bytes)
# needed for parameters, gradients and Adam states (no activations), following section 6. Then decide:
# does a 7B model's training state fit on an H200 (141 GB)? On an H100 (80 GB)?


# %%
def adam_training_gb(n_params: int, mixed_precision: bool = True) -> float:
    ### BEGIN SOLUTION
    return n_params * sum(perf.training_bytes_per_param(mixed_precision).values()) / 1e9
    ### END SOLUTION


# %% tags=["check"]
check(
    "adam_training_gb",
    lambda: [adam_training_gb(7_000_000_000), adam_training_gb(1_000_000, False)],
    [112.0, 0.016],
)

# %% [markdown]
# **Exercise 5: fusion with two inputs.** `y = (x + b) * c` with x, b, c three tensors of N elements.
# Eager PyTorch runs two kernels (the add, then the multiply); a fused kernel runs one. Count element
# transfers to and from HBM in both cases and write `two_input_fusion_speedup()`, the predicted speed-up.


# %%
def two_input_fusion_speedup() -> float:
    ### BEGIN SOLUTION
    eager = 3 + 3  # add: read x, b, write t; multiply: read t, c, write y
    fused = 4  # read x, b, c, write y
    return eager / fused
    ### END SOLUTION


# %% tags=["check"]
check("two_input_fusion_speedup", two_input_fusion_speedup, 1.5)

# %% [markdown]
# ## Summary
#
# - GPU memory is a hierarchy: registers and SRAM on the chip (tens of MB in all, the SRAM several times
#   faster than HBM by our estimate), L2, then HBM (tens to a hundred-odd GB), then host DRAM
#   over PCIe. HBM holds thousands of times more than SRAM.
# - Arithmetic intensity (FLOP/byte) against machine balance (peak FLOP/s / bandwidth) says whether an
#   operation is memory-bound or compute-bound. The roofline min(P, B·I) bounds what it can achieve, and
#   max(FLOPs / P, bytes / B) the least time it can take.
# - Element-wise operations and reductions have intensity ≈ 1: always memory-bound. Matmuls become
#   compute-bound as they grow. Non-matmul FLOPs run on much slower units (16× slower on an A100).
# - Training with Adam holds 16 bytes per parameter (P : G : states = 1 : 1 : 6 in mixed precision), and we
#   checked it against PyTorch's tensors.
# - Fusing memory-bound operations saves time in proportion to the HBM traffic it removes.
#
# Next, notebook 02 applies all of this to standard attention and finds where its time goes.
