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
# # 02 · Standard attention is memory-bound
#
# Attention is two matrix multiplications with a softmax between them. Its FLOPs are almost all in the
# matmuls, yet on a GPU most of its *time* goes elsewhere: to moving N × N matrices between the chip and
# HBM. This notebook counts those bytes, bounds the time from below with the roofline of notebook 01,
# measures it, and finds where it goes with `torch.profiler`.
#
# **Learning goals**
# 1. Write standard attention step by step (your first attention, checked against a float64 reference)
#    and count, for each step, the FLOPs and the HBM bytes as a function of N, d and B·H.
# 2. Bound its time from below with the roofline; measure time and peak memory as N grows (N² memory, out
#    of memory on a GPU), and explain why the measured time sits well above the bound.
# 3. Break the time down per operation with `torch.profiler` and NVTX ranges: the cheap-in-FLOPs
#    operations take most of it.
# 4. Say what kernel fusion can and cannot fix, and what the N × N matrices cost in training.

# %%
import matplotlib.pyplot as plt
import torch

import course_lib
from course_lib import perf, records
from course_lib.attention.reference import attention as reference_attention
from course_lib.exercises import check
from course_lib.perf import profiling
from course_lib.perf.plotting import bar_chart, plot_series, print_table
from course_lib.perf.timing import benchmark
from course_lib.testing import assert_close_to_reference

DEVICE = course_lib.DEVICE
print("running on:", course_lib.RUNTIME.describe())

# Every size this notebook runs, in one place (small on a CPU, real on a GPU).
BH, D = course_lib.pick(cpu=(2, 64), gpu=(16, 128))  # batch x heads, head dimension d
DTYPE = course_lib.pick(cpu=torch.float32, gpu=torch.bfloat16)
NS = course_lib.pick(cpu=[128, 256, 512, 1024, 2048], gpu=[512, 1024, 2048, 4096, 8192, 16384, 32768, 65536])
N_PROFILE = course_lib.pick(cpu=1024, gpu=4096)  # the size of the per-operation breakdown
N_SAVED = course_lib.pick(cpu=[128, 256, 512], gpu=[1024, 2048, 4096])  # sizes for the training-memory check
DROPOUT_P = 0.1
ELEM = torch.finfo(DTYPE).bits // 8  # bytes per element
if not course_lib.ON_GPU:
    torch.set_num_threads(1)  # one CPU thread: steadier timings on a shared machine (remove to use all cores)

# The GPU shape the byte counts of section 2 are worked out for (a typical layer, bf16):
GPU_BH, GPU_N, GPU_D, GPU_ELEM = 16, 4096, 128, 2

# %% [markdown]
# ## 1. Standard attention, step by step
#
# For one batch element and one head, with Q, K, V of shape (N, d) and scale 1/√d, the FlashAttention
# paper ([arXiv:2205.14135](https://arxiv.org/abs/2205.14135), Algorithm 0) writes standard attention as
#
# $$ S = QK^\top \in \mathbb{R}^{N\times N}, \qquad P = \mathrm{softmax}(S) \in \mathbb{R}^{N\times N},
# \qquad O = PV \in \mathbb{R}^{N\times d}, $$
#
# (the paper leaves the scale out; the code applies it, S = QKᵀ/√d), where each line loads its inputs from
# HBM and writes its result back to HBM. A real model adds a causal
# mask before the softmax and dropout after it.
#
# **Exercise 1: standard attention.** Write `my_attention(q, k, v, causal)` in PyTorch, one operation per
# step, for q of shape (..., Nq, d) and k, v of shape (..., Nk, d) (Nq and Nk may differ):
# 1. S = Q Kᵀ · scale with scale = 1/√d (`k.transpose(-2, -1)` swaps K's last two dimensions);
# 2. if `causal`, hide the future: query i may see key j only if j ≤ i (query i aligned with key i, as
#    `scaled_dot_product_attention(is_causal=True)` does); set the hidden scores to −∞, so that the
#    softmax gives them a weight of exactly 0;
# 3. P = softmax(S) along the keys (the last dimension);
# 4. O = P V.
#
# The check runs it in float32 against `course_lib.attention.reference.attention` in float64, over square
# and rectangular shapes, causal or not, and names the first case that fails.


# %%
def my_attention(q, k, v, causal=False):
    ### BEGIN SOLUTION
    S = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # (..., Nq, Nk): written to HBM
    if causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        future = torch.arange(n_k, device=q.device)[None, :] > torch.arange(n_q, device=q.device)[:, None]
        S = S.masked_fill(future, float("-inf"))  # read S, write S
    P = torch.softmax(S, dim=-1)  # read S, write P
    return P @ v  # read P and V, write O
    ### END SOLUTION


# %% tags=["check"]
from course_lib.exercises import check_cases

_g = torch.Generator().manual_seed(2)
_q, _k, _v = (torch.randn(BH, 96, 32, generator=_g) for _ in range(3))
check_cases(
    "my_attention",
    [
        dict(Nq=64, Nk=64, causal=False),
        dict(Nq=64, Nk=64, causal=True),
        dict(Nq=40, Nk=96, causal=False),
        dict(Nq=40, Nk=96, causal=True),
        dict(Nq=96, Nk=33, causal=True),
    ],
    lambda Nq, Nk, causal: my_attention(_q[:, :Nq], _k[:, :Nk], _v[:, :Nk], causal),
    lambda Nq, Nk, causal: reference_attention(
        _q[:, :Nq].double(), _k[:, :Nk].double(), _v[:, :Nk].double(), causal=causal
    ),
    rtol=1e-4,
    atol=1e-5,
    outputs=("O",),
)

# %% [markdown]
# From here on, the notebook uses course_lib's piece, `course_lib.perf.profiling.standard_attention(q, k, v,
# causal, dropout_p)`: the same computation, with dropout, and with each step labelled (`profiling.step`) so
# that the profilers can tell the steps apart. It matches the float64 reference too:

# %%
q, k, v = (torch.randn(BH, 256, D, device=DEVICE, dtype=DTYPE) for _ in range(3))
for causal in (False, True):
    reference64 = reference_attention(q.double(), k.double(), v.double(), causal=causal)
    baseline = reference_attention(q, k, v, causal=causal)
    assert_close_to_reference(
        profiling.standard_attention(q, k, v, causal=causal),
        reference64,
        baseline,
        f"profiling.standard_attention causal={causal}",
    )
print("course_lib.perf.profiling.standard_attention matches the float64 reference")

# %% [markdown]
# ## 2. Count the bytes, bound the time
#
# With B·H heads, sequence length N, head dimension d and b bytes per element, each step reads its inputs
# once and writes its output once (`profiling.attention_step_costs`):
#
# | step | FLOPs | HBM bytes |
# | --- | --- | --- |
# | S = QKᵀ | 2·BH·N²·d | b·BH·(2Nd + N²) |
# | mask | BH·N² | 2b·BH·N² + N² (a boolean mask, shared by all heads) |
# | softmax | 5·BH·N² | 2b·BH·N² |
# | dropout | 2·BH·N² | (2b + 1)·BH·N² (it also writes a 1-byte keep-mask) |
# | O = PV | 2·BH·N²·d | b·BH·(N² + 2Nd) |
#
# The matmuls hold the FLOPs (4·BH·N²·d against 8·BH·N²); the N × N matrices hold the bytes: the middle
# three steps move (6b + 1)·BH·N² + N² bytes and do only 8 FLOPs per element. Here is the count for a typical
# layer on a GPU, and the roofline's time for an H200 (the recorded ceilings if an H200 record exists, else
# the datasheet). It is a **lower bound**: it assumes that each step moves exactly the bytes of the table, in
# one pass, at the copy bandwidth. Section 4 measures how far above it the real kernels land, and why.

# %%
hw = records.load_record("hardware", gpu="H200")
if hw is not None:
    h200_ceilings = (
        hw["data"]["matmul_tflops"]["bfloat16"],
        hw["data"]["matmul_tflops"]["float32"],
        hw["data"]["copy_gbps"],
    )
    ceiling_source = f"measured ceilings, {records.label(hw)}"
else:
    g = perf.gpu("H200")
    h200_ceilings = (g.matmul16_tflops, g.fp32_tflops, g.hbm_gbps)
    ceiling_source = "H200 datasheet ceilings (no H200 record yet)"
costs = profiling.attention_step_costs(GPU_BH, GPU_N, GPU_D, GPU_ELEM, causal=True, dropout=True)
predicted = profiling.predict_step_ms(costs, *h200_ceilings)
print(f"B*H={GPU_BH}, N={GPU_N}, d={GPU_D}, bf16; prediction from {ceiling_source}")
balance = {
    "matmul": perf.machine_balance(h200_ceilings[0], h200_ceilings[2]),
    "element-wise": perf.machine_balance(h200_ceilings[1], h200_ceilings[2]),
}
print_table(
    [
        {
            "step": c["step"],
            "GFLOP": c["flops"] / 1e9,
            "MB moved": c["bytes"] / 1e6,
            "FLOP/B": c["flops"] / c["bytes"],
            "balance": balance[c["kind"]],
            "bound": "memory" if c["flops"] / c["bytes"] < balance[c["kind"]] else "compute",
            "predicted ms": t,
        }
        for c, t in zip(costs, predicted)
    ]
)
total_flops, total_bytes = sum(c["flops"] for c in costs), sum(c["bytes"] for c in costs)
print(f"total: {total_flops / 1e9:.0f} GFLOP, {total_bytes / 1e9:.2f} GB, predicted {sum(predicted):.3f} ms")
assert all(c["flops"] / c["bytes"] < balance[c["kind"]] for c in costs), "every step is memory-bound here"

# %% [markdown]
# Even the two matmuls are memory-bound at this shape: S = QKᵀ does 2N²d FLOPs but writes N² elements,
# an intensity of at most 2d / b = 128 FLOP/byte for d = 128 in bf16, below the H200's balance. Share of
# FLOPs against share of predicted time:

# %%
steps = [c["step"] for c in costs]
flop_share = [100 * c["flops"] / total_flops for c in costs]
time_share = [100 * t / sum(predicted) for t in predicted]
elementwise = [i for i, c in enumerate(costs) if c["kind"] == "element-wise"]
ew_flops, ew_time = sum(flop_share[i] for i in elementwise), sum(time_share[i] for i in elementwise)
bar_chart(
    steps,
    {"% of FLOPs": flop_share, "% of predicted time (H200)": time_share},
    fmt="{:.0f}",
    xlabel="step",
    ylabel="share (%)",
    title=f"Mask, softmax and dropout: {ew_flops:.1f}% of the FLOPs, {ew_time:.0f}% of the predicted time",
)
plt.show()
assert ew_time > 50 > ew_flops

# %% [markdown]
# ## 3. Measure: time and memory as N grows
#
# Now the real thing on this device, at the sizes chosen at the top (B·H, d, the list of N). We also
# bound each time from below with *this device's* roofline, measured as in notebook 01 (a large copy, a large
# matmul; the non-matmul ceiling is stood in for by the fp32 matmul rate, on the CPU by the same matmul).
# On a GPU we also record the peak memory above the inputs (`course_lib.perf.timing.peak_memory`); the
# sweep stops at the first N that runs out of memory.

# %%
copy_gbps = perf.measure_copy_bandwidth()
matmul_tflops = perf.measure_matmul_tflops(dtype=DTYPE)
other_tflops = matmul_tflops if not course_lib.ON_GPU else perf.measure_matmul_tflops(dtype=torch.float32)
print(f"this {DEVICE.type}: copy {copy_gbps:.1f} GB/s, {str(DTYPE)[6:]} matmul {matmul_tflops:.3f} TFLOP/s")


def make_attention(n):
    q, k, v = (torch.randn(1, BH, n, D, device=DEVICE, dtype=DTYPE) for _ in range(3))
    return lambda: profiling.standard_attention(q, k, v, causal=True, dropout_p=DROPOUT_P)


with torch.no_grad():
    sweep = profiling.sweep_sequence_length(make_attention, NS)
for row in sweep:
    row["predicted ms"] = sum(
        profiling.predict_step_ms(
            profiling.attention_step_costs(BH, row["N"], D, ELEM), matmul_tflops, other_tflops, copy_gbps
        )
    )
    if row.get("peak_bytes") is not None:
        row["peak MB"] = row["peak_bytes"] / 1e6
        row["S alone (MB)"] = profiling.n_squared_bytes(BH, row["N"], ELEM) / 1e6
print_table(
    sweep,
    columns=[
        c for c in ("N", "ms", "predicted ms", "peak MB", "S alone (MB)", "oom") if any(c in r for r in sweep)
    ],
)

# %%
done = [r for r in sweep if not r.get("oom")]
ns_done = [r["N"] for r in done]
fig, axes = plt.subplots(
    2 if course_lib.ON_GPU else 1,
    1,
    figsize=(9.0, 9.5 if course_lib.ON_GPU else 5.5),
    layout="constrained",
    squeeze=False,
)
plot_series(
    ns_done,
    {"measured": [r["ms"] for r in done], "roofline prediction": [r["predicted ms"] for r in done]},
    xlabel="sequence length N",
    ylabel="time per forward (ms)",
    logx=True,
    logy=True,
    ax=axes[0][0],
    title=f"Standard attention on this {DEVICE.type}: time grows as N²",
)
if course_lib.ON_GPU:
    plot_series(
        ns_done,
        {
            "peak memory above inputs": [r["peak MB"] for r in done],
            "one N x N matrix (B*H*N²*b)": [r["S alone (MB)"] for r in done],
        },
        xlabel="sequence length N",
        ylabel="memory (MB)",
        logx=True,
        logy=True,
        ax=axes[1][0],
        title="Memory grows as N²"
        + (f"; out of memory at N={sweep[-1]['N']}" if sweep[-1].get("oom") else ""),
    )
plt.show()
assert done[-1]["ms"] > done[0]["ms"]

# %% [markdown]
# The recorded GPU run (`make bench`, `course_lib.perf.profiling.standard_attention_record`) shows the same
# sweep at a realistic shape, up to the size where the GPU runs out of memory:

# %%
rec = records.load_record("standard_attention")
if rec is None:
    print(
        "No recorded GPU figures yet (assets/benchmarks/standard_attention-*.json): `make bench` on a GPU "
        "makes them."
    )
else:
    shape = rec["data"]["shape"]
    r_done = [r for r in rec["data"]["sweep"] if not r.get("oom")]
    r_oom = [r["N"] for r in rec["data"]["sweep"] if r.get("oom")]
    print("Recorded:", records.label(rec))
    print(
        f"shape B*H={shape['batch_heads']}, d={shape['head_dim']}, {shape['dtype']}, causal, "
        f"dropout {shape['dropout_p']}" + (f"; out of memory at N={r_oom[0]}" if r_oom else "")
    )
    fig, (ax_t, ax_m) = plt.subplots(2, 1, figsize=(9.0, 9.5), layout="constrained")
    elem_bytes = torch.finfo(getattr(torch, shape["dtype"])).bits // 8  # bytes per element of the recorded run
    ns_rec = [r["N"] for r in r_done]
    ms_rec = [r["ms"] for r in r_done]
    doublings = [b / a for a, b in zip(ms_rec, ms_rec[1:])]  # time ratio per doubling of N (N²: 4x)
    plot_series(
        ns_rec,
        {"measured": ms_rec, "N² through the longest N": [ms_rec[-1] * (n / ns_rec[-1]) ** 2 for n in ns_rec]},
        ax=ax_t,
        logx=True,
        logy=True,
        xlabel="sequence length N",
        ylabel="time per forward (ms)",
        title=f"{rec['meta']['gpu']} (recorded): each doubling of N costs\n"
        f"{', '.join(f'{r:.1f}x' for r in doublings)} (N²: 4x)",
    )
    plot_series(
        ns_rec,
        {
            "peak memory above inputs": [r["peak_bytes"] / 1e9 for r in r_done],
            "one N x N matrix": [
                profiling.n_squared_bytes(shape["batch_heads"], n, elem_bytes) / 1e9 for n in ns_rec
            ],
        },
        ax=ax_m,
        logx=True,
        logy=True,
        xlabel="sequence length N",
        ylabel="memory (GB)",
        title="Memory grows as N²" + (f"; out of memory at N={r_oom[0]}" if r_oom else ""),
    )
    plt.show()

# %% [markdown]
# ## 4. Where the time goes: `torch.profiler`
#
# The steps of `profiling.standard_attention` are labelled with `torch.profiler.record_function`, so the
# profiler can add up the time spent inside each label (`profiling.profile_steps`). On a GPU it counts the
# GPU time of the kernels each step launched; on a CPU, the CPU time inside each step.

# %%
with torch.no_grad():
    fn = make_attention(N_PROFILE)
    breakdown = profiling.profile_steps(fn)
    total_ms = benchmark(fn)
print(f"N={N_PROFILE}, B*H={BH}, d={D}, {str(DTYPE)[6:]}: {total_ms:.3f} ms per forward")
print_table(
    [
        {"step": s, "ms": ms, "% of time": 100 * ms / sum(breakdown["steps"].values())}
        for s, ms in breakdown["steps"].items()
    ]
)
print("\nbusiest PyTorch operators (self time):")
print_table(
    [{"operator": name, "ms per forward": ms, "calls": calls} for name, ms, calls in breakdown["top_ops"][:6]]
)
assert all(ms > 0 for ms in breakdown["steps"].values())


# %%
def breakdown_chart(step_ms, costs, title, ax):
    total_t, total_f = sum(step_ms.values()), sum(c["flops"] for c in costs)
    flops = {c["step"]: c["flops"] for c in costs}
    names = list(step_ms)
    return bar_chart(
        names,
        {
            "% of time (measured)": [100 * step_ms[s] / total_t for s in names],
            "% of FLOPs": [100 * flops[s] / total_f for s in names],
        },
        fmt="{:.0f}",
        xlabel="step",
        ylabel="share (%)",
        title=title,
        ax=ax,
    )


panels = 1 if rec is None or course_lib.ON_GPU else 2
fig, axes = plt.subplots(panels, 1, figsize=(9.0, 5.0 * panels), layout="constrained", squeeze=False)
profile_costs = profiling.attention_step_costs(BH, N_PROFILE, D, ELEM)
breakdown_chart(
    breakdown["steps"], profile_costs, f"This {DEVICE.type}, N={N_PROFILE}: where the time goes", axes[0][0]
)
if panels == 2:
    b = rec["data"]["breakdown"]
    breakdown_chart(b["steps"], b["costs"], f"{rec['meta']['gpu']} (recorded), N={b['N']}", axes[1][0])
plt.show()
middle_time = sum(ms for s, ms in breakdown["steps"].items() if s in ("mask", "softmax", "dropout"))
middle_flops = sum(c["flops"] for c in profile_costs if c["kind"] == "element-wise")
assert middle_time / sum(breakdown["steps"].values()) > 3 * middle_flops / sum(
    c["flops"] for c in profile_costs
)

# %% [markdown]
# This is the picture that motivated FlashAttention (Figure 1, right, of the FlashAttention paper breaks
# down PyTorch attention in GPT-2 into the same steps): on a GPU the matmuls hold almost all the FLOPs,
# while masking, softmax and dropout, a rounding error in FLOPs, take a large share of the time (the
# prediction of section 2 says most of it), because each one reads and writes a B·H × N × N tensor in
# HBM. Compare the measured GPU bars (yours, or the recorded run) with that prediction. On a CPU the
# shares differ (no tensor cores, and PyTorch's CPU dropout draws a full float random tensor), but there
# too the element-wise steps take far more than their share of the FLOPs.
#
# ### The roofline is a lower bound: count the real passes
#
# Put each measured step next to its roofline time (one pass over the table's bytes at the copy bandwidth).
# On a GPU these are this GPU's own figures; on a CPU, the recorded GPU run with the ceilings of section 2.
# The last column is the bandwidth each step reached, its table bytes over its measured time:

# %%
if course_lib.ON_GPU:  # this GPU's breakdown (section 4) and ceilings (section 3)
    lb_source, lb_run, lb_costs = f"this GPU, N={N_PROFILE}", breakdown, profile_costs
    lb_ceilings, lb_n, lb_bh, lb_elem = (matmul_tflops, other_tflops, copy_gbps), N_PROFILE, BH, ELEM
elif rec is not None:  # the recorded run, with section 2's H200 ceilings
    lb_run, lb_shape = rec["data"]["breakdown"], rec["data"]["shape"]
    lb_source = f"{rec['meta']['gpu']} (recorded), N={lb_run['N']}"
    lb_costs, lb_ceilings, lb_n, lb_bh = lb_run["costs"], h200_ceilings, lb_run["N"], lb_shape["batch_heads"]
    lb_elem = torch.finfo(getattr(torch, lb_shape["dtype"])).bits // 8
else:
    lb_source = None
    print("No GPU figures here: `make bench` on a GPU records them.")
if lb_source is not None:
    lb_ms = lb_run["steps"]
    lb_pred = dict(zip([c["step"] for c in lb_costs], profiling.predict_step_ms(lb_costs, *lb_ceilings)))
    lb_bytes = {c["step"]: c["bytes"] for c in lb_costs}
    print(f"{lb_source}; copy ceiling {lb_ceilings[2]:.0f} GB/s")
    print_table(
        [
            {
                "step": s,
                "roofline ms": lb_pred[s],
                "measured ms": lb_ms[s],
                "measured / roofline": lb_ms[s] / lb_pred[s],
                "GB/s reached": lb_bytes[s] / (lb_ms[s] * 1e6),
            }
            for s in lb_ms
        ]
    )
    lb_total = sum(lb_ms.values()) / sum(lb_pred.values())
    print(
        f"whole forward: {sum(lb_ms.values()):.3f} ms measured, {lb_total:.1f}x the roofline's "
        f"{sum(lb_pred.values()):.3f} ms"
    )
    assert lb_total > 1, "the roofline is a lower bound"

# %% [markdown]
# The steps land above their roofline times, and the whole forward at a few times its bound. Two things the table of
# section 2 did not count explain most of it. First, **passes**: `S.masked_fill(future, -inf)` is
# *out of place*, so PyTorch copies S into a new tensor (`aten::copy_`: read S, write it) and then fills the
# copy in place (`aten::masked_fill_`: read it and the broadcast (N, N) boolean mask, write it): two passes
# over S where the table counted one. (The in-place `S.masked_fill_(...)` would save the copy.) Second,
# **speed per pass**: a kernel does not reach the copy bandwidth just because it is memory-bound. The fill
# with a mask broadcast over B·H, and the softmax (a max, a sum of exponentials and a division per row, in
# fp32 from 16-bit inputs), run well below it. The profiler's operators, with the bytes each really moves:

# %%
if lb_source is not None:
    nn_bytes = lb_elem * lb_bh * lb_n * lb_n  # one N x N tensor of all heads
    op_bytes = {
        "aten::copy_": 2 * nn_bytes,  # the out-of-place mask's copy: read S, write S'
        "aten::masked_fill_": 2 * nn_bytes + lb_n * lb_n,  # read and write S', read the (N, N) bool mask
        "aten::_softmax": 2 * nn_bytes,  # read S, write P
        "aten::native_dropout": 2 * nn_bytes + lb_bh * lb_n * lb_n,  # read P, write P and a 1-byte keep-mask
        "aten::bmm": lb_bytes["S = QK^T"] + lb_bytes["O = PV"],  # both matmuls
    }
    op_ms = {name: ms for name, ms, _ in lb_run["top_ops"] if name in op_bytes}
    print_table(
        [
            {
                "operator": name,
                "ms": op_ms[name],
                "GB moved": op_bytes[name] / 1e9,
                "GB/s reached": op_bytes[name] / (op_ms[name] * 1e6),
                "% of copy ceiling": 100 * op_bytes[name] / (op_ms[name] * 1e6) / lb_ceilings[2],
            }
            for name in op_bytes
            if name in op_ms
        ]
    )
    real_bytes = sum(lb_bytes.values()) + op_bytes["aten::copy_"]
    print(
        f"bytes with the mask's copy counted: {real_bytes / 1e9:.2f} GB, not {sum(lb_bytes.values()) / 1e9:.2f}: "
        f"the roofline of the real passes is {real_bytes / (lb_ceilings[2] * 1e6):.3f} ms; the rest of the gap "
        "is kernels running below the copy bandwidth"
    )
#
# **NVTX ranges.** On a CUDA GPU, `profiling.step` also opens an NVTX range with the same name, so the
# steps show up as named bars on the timeline of NVIDIA Nsight Systems:
#
# ```
# nsys profile -t cuda,nvtx -o standard_attention python 02_standard_attention.py
# nsys stats --report nvtx_sum standard_attention.nsys-rep
# ```
#
# ## 5. What fusion can fix, and what it cannot
#
# Mask, softmax and dropout are element-wise or row-wise: one kernel can do all three, reading S once
# and writing P (and the keep-mask) once, instead of three round trips; the causal mask can be computed
# from the indices instead of being read. `torch.compile` writes that kernel for us on a GPU.


# %%
def fused_middle_bytes(bh, n, elem_bytes):
    """One kernel for mask + softmax + dropout: read S, write P and the 1-byte keep-mask."""
    return bh * n * n * (2 * elem_bytes + 1)


middle = [c for c in costs if c["kind"] == "element-wise"]
unfused_bytes = sum(c["bytes"] for c in middle)
fused_bytes = fused_middle_bytes(GPU_BH, GPU_N, GPU_ELEM)
fused_costs = [c for c in costs if c["kind"] == "matmul"]
fused_costs.insert(
    1,
    {
        "step": "fused",
        "kind": "element-wise",
        "flops": sum(c["flops"] for c in middle),
        "bytes": float(fused_bytes),
    },
)
predicted_fused = sum(profiling.predict_step_ms(fused_costs, *h200_ceilings))
print(f"mask + softmax + dropout: {unfused_bytes / 1e9:.2f} GB unfused, {fused_bytes / 1e9:.2f} GB fused")

# %% [markdown]
# **Predict first.** How much faster will `torch.compile`'s fused version of the *whole* forward be than the
# eager one, at B·H = 16, N = 4096, d = 128, bf16, on an H200? Fusion shrinks only the middle (the line
# above); the two matmuls move the same bytes as before (the table of section 2), and the lower-bound
# discussion of section 4 says how far eager kernels sit from their bytes. Work it out and type your
# estimate in place of the value in the next cell.

# %%
from course_lib.exercises import predict

# Your prediction (a speed-up, eager time over compiled time): type your number in place of the value.
fusion_guess = predict("torch.compile speed-up of standard attention", 1.9, unit="x")

# %%
fusion_measured = None
if course_lib.ON_GPU:
    q, k, v = (torch.randn(1, BH, N_PROFILE, D, device=DEVICE, dtype=DTYPE) for _ in range(3))
    compiled = torch.compile(profiling.standard_attention)
    with torch.no_grad():
        eager_ms = benchmark(lambda: profiling.standard_attention(q, k, v, causal=True, dropout_p=DROPOUT_P))
        compiled_ms = benchmark(
            lambda: compiled(q, k, v, causal=True, dropout_p=DROPOUT_P, label_steps=False)
        )
    print(
        f"this GPU, N={N_PROFILE}: eager {eager_ms:.3f} ms, torch.compile {compiled_ms:.3f} ms "
        f"({eager_ms / compiled_ms:.1f}x)"
    )
    fusion_measured = eager_ms / compiled_ms
elif rec is not None and "compiled_ms" in rec["data"]["compiled"]:
    c = rec["data"]["compiled"]
    fusion_measured = c["eager_ms"] / c["compiled_ms"]
    print(
        f"{rec['meta']['gpu']}, N={c['N']} (recorded): eager {c['eager_ms']:.3f} ms, torch.compile "
        f"{c['compiled_ms']:.3f} ms ({c['eager_ms'] / c['compiled_ms']:.1f}x); {records.label(rec)}"
    )
else:
    print(
        "torch.compile is measured on a GPU only (compiling on a CPU takes too long); no recorded figure yet."
    )
if fusion_measured is not None:
    _ = fusion_guess.score(fusion_measured)
print(
    f"from the bytes alone (section 2's ceilings): {sum(predicted):.3f} ms unfused, {predicted_fused:.3f} ms "
    f"fused, {sum(predicted) / predicted_fused:.1f}x"
)

# %% [markdown]
# The bytes alone predict the speed-up of the roofline times. The measured one differs because neither side
# runs at its roofline: the eager kernels lose time to extra passes and slow kernels (section 4), and the
# compiled kernel, which does a row's max, sum and division in one pass, is not at the copy bandwidth either.

# %% [markdown]
# **Materialisation.** Writing an intermediate result in full to memory, so that the next operation can
# read it back, is called *materialising* it. Standard attention materialises S and P (and, with dropout,
# the keep-mask and the dropped-out P): each is an N × N tensor that exists only to be read once by the
# next step. Fusion removes the materialisations *between* element-wise steps; the question of this
# course is how to remove the last ones.
#
# What fusion **cannot** fix: the two matmuls are separate library calls, so S still has to be written to
# HBM after the first and P read back for the second. The N × N matrices still exist in HBM, so memory
# still grows as N², and at least 4·b·BH·N² bytes still move (S written and read back, P written and read
# back). To get rid of them we must never form S
# and P in full: compute attention **tile by tile** in SRAM (notebooks 03–04), which needs a softmax that
# can be computed a block at a time (the online softmax of notebook 03).
#
# ## 6. What the N × N matrices cost in training
#
# For the backward pass, autograd keeps the tensors that each operation needs (`profiling.saved_for_backward`
# lists them with `torch.autograd.graph.saved_tensors_hooks`). For standard attention they include N × N
# tensors:

# %%
saved_rows = []
for n in N_SAVED:
    qkv = [torch.randn(1, BH, n, D, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(3)]
    saved = profiling.saved_for_backward(
        lambda qkv=qkv: profiling.standard_attention(*qkv, causal=True, dropout_p=DROPOUT_P)
    )
    n_by_n = sum(t["bytes"] for t in saved if t["shape"][-2:] == (n, n))
    saved_rows.append(
        {
            "N": n,
            "tensors saved": len(saved),
            "MB saved": sum(t["bytes"] for t in saved) / 1e6,
            "MB in N x N tensors": n_by_n / 1e6,
            "bytes per B*H*N²": n_by_n / (BH * n * n),
        }
    )
print("saved for backward at N =", N_SAVED[-1], ":", [(t["shape"], t["dtype"]) for t in saved])
print_table(saved_rows)
per_element = saved_rows[-1]["bytes per B*H*N²"]
assert all(abs(r["bytes per B*H*N²"] - per_element) < 0.1 for r in saved_rows), "N x N bytes grow as N²"

# %% [markdown]
# The softmax output P, the dropped-out P and dropout's keep-mask are saved, plus the boolean (N, N) causal
# mask, one copy shared by every head. On a GPU the keep-mask is 1 byte per element, so the last column is
# (2b + 1) + 1/(B·H): 2b + 1 bytes per element for each head, and 1/(B·H) for the shared causal mask
# (5.0625 in bf16 with B·H = 16). On a CPU, dropout is not one fused kernel and keeps its mask as a float
# tensor: 3b + 1/(B·H) (12.5 in fp32 with B·H = 2). At a GPU shape this is large (the estimate below counts
# the 2b + 1 bytes per head and leaves out the causal mask's N² bytes, under 2% of the total):

# %%
per_layer = (2 * GPU_ELEM + 1) * GPU_BH * 8192**2
print(
    f"B*H={GPU_BH}, N=8192, bf16: {per_layer / 1e9:.1f} GB saved per attention layer; "
    f"{32 * per_layer / 1e9:.0f} GB for 32 layers"
)
flash_saved = GPU_BH * 8192 * (GPU_D * GPU_ELEM + 4)  # O (N x d) and the logsumexp L (N, fp32)
print(
    "FlashAttention saves O and the logsumexp L instead (Q, K, V are kept by both): "
    f"{flash_saved / 1e6:.0f} MB "
    "per layer "
    f"({per_layer / flash_saved:.0f}x less)"
)
no_dropout = GPU_ELEM * GPU_BH * 8192**2  # P alone: standard attention without dropout
print(
    f"Without dropout, standard attention would save P alone: {no_dropout / 1e9:.1f} GB, "
    f"still {no_dropout / flash_saved:.0f}x more than O and L"
)

# %% [markdown]
# The first comparison is not like for like: the standard figure includes dropout (its keep-mask and the
# dropped-out P), and the FlashAttention kernels of this course have no dropout. The second line compares
# like with like; the conclusion does not change. (FlashAttention with dropout regenerates the keep-mask
# from the random seed in the backward pass instead of saving it.)
#
# FlashAttention's answer has two parts. **Tiling**: compute O block by block in SRAM, never writing S or
# P to HBM. **Recomputation**: in the backward pass, recompute the blocks of S and P from Q, K and the
# saved logsumexp L instead of storing them: more FLOPs, far fewer bytes, and memory that grows as N
# instead of N². On a memory-bound problem that trade wins.
#
# ## 7. Exercises
#
# **Exercise 2: total bytes.** Write `attention_hbm_bytes(bh, n, d, elem_bytes)`: the HBM bytes of the
# three steps S = QKᵀ, P = softmax(S), O = PV (no mask, no dropout), each reading its inputs once and
# writing its output once.


# %%
def attention_hbm_bytes(bh: int, n: int, d: int, elem_bytes: int) -> float:
    ### BEGIN SOLUTION
    s = (2 * n * d + n * n) * bh * elem_bytes  # read Q, K; write S
    softmax = 2 * n * n * bh * elem_bytes  # read S; write P
    o = (n * n + 2 * n * d) * bh * elem_bytes  # read P, V; write O
    return float(s + softmax + o)
    ### END SOLUTION


# %% tags=["check"]
check(
    "attention_hbm_bytes",
    lambda: [attention_hbm_bytes(16, 4096, 128, 2), attention_hbm_bytes(2, 100, 64, 4)],
    [
        sum(
            c["bytes"] for c in profiling.attention_step_costs(16, 4096, 128, 2, causal=False, dropout=False)
        ),
        sum(c["bytes"] for c in profiling.attention_step_costs(2, 100, 64, 4, causal=False, dropout=False)),
    ],
)

# %% [markdown]
# **Exercise 3: when does it stop fitting?** Write `largest_n(bh, memory_gb, elem_bytes)`: the largest power
# of two N for which S and P (two N × N matrices per head) fit in `memory_gb` GB (10⁹ bytes). Try B·H = 32
# in bf16 on an 80 GB GPU.


# %%
def largest_n(bh: int, memory_gb: float, elem_bytes: int) -> int:
    ### BEGIN SOLUTION
    n = 1
    while 2 * bh * (2 * n) ** 2 * elem_bytes <= memory_gb * 1e9:
        n *= 2
    return n
    ### END SOLUTION


# %% tags=["check"]
check(
    "largest_n",
    lambda: [largest_n(32, 80, 2), largest_n(16, 141, 2), largest_n(1, 0.001, 4), largest_n(1, 17, 2)],
    [
        profiling.largest_fitting_n(32, 80e9, 2),
        profiling.largest_fitting_n(16, 141e9, 2),
        profiling.largest_fitting_n(1, 1e6, 4),
        profiling.largest_fitting_n(1, 17e9, 2),  # where GB = 1e9 and GiB = 2**30 give different answers
    ],
)

# %% [markdown]
# **Exercise 4: the intensity of S = QKᵀ.** Write `qk_intensity(n, d, elem_bytes)` (FLOPs over bytes of the
# first step, as in the table of section 2). What does it tend to for large N? Is S = QKᵀ memory-bound on an
# H200 at d = 64? At d = 256? Take the H200's datasheet balance, 989 TFLOP/s of dense bf16 over 4.8 TB/s
# ≈ 206 FLOP/byte. (The table of section 2 used the *measured* ceilings of the H200's hardware record when
# there is one: a lower balance, in the table's `balance` column, because the measured matmul peak falls further
# below the datasheet than the measured copy bandwidth does. A ridge from a datasheet says what the chip
# could do; a measured one says what a real kernel reached. Notebook 08 uses the measured one.)


# %%
def qk_intensity(n: int, d: int, elem_bytes: int) -> float:
    ### BEGIN SOLUTION
    return 2 * n * n * d / ((2 * n * d + n * n) * elem_bytes)
    ### END SOLUTION


# %% tags=["check"]
check(
    "qk_intensity",
    lambda: [qk_intensity(4096, 128, 2), qk_intensity(65536, 64, 2)],
    [
        c["flops"] / c["bytes"]
        for c in (
            profiling.attention_step_costs(1, 4096, 128, 2)[0],
            profiling.attention_step_costs(1, 65536, 64, 2)[0],
        )
    ],
)

# %% [markdown]
# **Exercise 5: fusing the middle.** Using `profiling.attention_step_costs` for B·H = 16, N = 4096, d = 128,
# bf16, causal, with dropout, write `middle_fusion_byte_ratio()`: the bytes of the unfused mask, softmax and
# dropout steps divided by the bytes of one fused kernel that reads S once and writes P and the 1-byte
# keep-mask once (the causal mask computed from indices, not read).


# %%
def middle_fusion_byte_ratio() -> float:
    ### BEGIN SOLUTION
    steps = profiling.attention_step_costs(16, 4096, 128, 2, causal=True, dropout=True)
    unfused = sum(c["bytes"] for c in steps if c["kind"] == "element-wise")
    fused = 16 * 4096 * 4096 * (2 * 2 + 1)
    return unfused / fused
    ### END SOLUTION


# %% tags=["check"]
check("middle_fusion_byte_ratio", middle_fusion_byte_ratio, unfused_bytes / fused_bytes)

# %% [markdown]
# ## Summary
#
# - Standard attention writes S and P, two N × N matrices per head, to HBM and reads them back; mask and
#   dropout add more round trips. Bytes grow as B·H·N², FLOPs as B·H·N²·d.
# - Standard attention **materialises** S and P: it writes them in full to HBM only to read them back.
# - Every step is memory-bound at typical shapes, even S = QKᵀ (intensity at most 2d / b). The roofline
#   bounds the time from below (one pass over each step's bytes at the copy bandwidth); the measured eager
#   time is a few times that bound, because the eager kernels make more passes (the out-of-place mask copies
#   S first) and run below the copy bandwidth (the broadcast-mask fill, the softmax). It grows as N².
# - `torch.profiler` (with labelled steps, and NVTX ranges for Nsight Systems) shows mask, softmax and
#   dropout taking a share of the time far above their share of the FLOPs.
# - Fusing the element-wise steps removes some round trips, but S and P still live in HBM: memory O(N²).
#   In training they are saved for the backward pass, (2b + 1)·B·H·N² bytes per layer.
# - The way out is tiling (never form S and P in HBM) and recomputation (rebuild them in the backward pass
#   from a per-row logsumexp): FlashAttention. Notebook 03 starts with the softmax that makes tiling possible.
