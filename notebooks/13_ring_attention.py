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
# # 13 · Ring attention: one attention on several devices
#
# A sequence of a million tokens does not fit one GPU's attention: not its memory, not its hours. Cut the
# sequence into slices, one per device; each device keeps the queries of its slice, and the keys and values
# travel from device to device around a ring. Every device gets partial results over the keys it has seen,
# and notebook 03's merge of partial softmax states puts them together exactly. The idea that made
# FlashAttention possible on one chip (a softmax computed block by block) pays off a second time.
#
# **Learning goals**
# 1. Estimate the memory and time of attention over 1M tokens against one device, and what the options
#    (all-gather, head sharding / Ulysses, ring) send between devices.
# 2. Shard a sequence contiguously and in zigzag order, and say which tokens each rank holds.
# 3. Write ring attention's forward loop yourself (K/V rotate, partial (O, L) merge), then run course_lib's
#    forward and backward (dK/dV travel home, dQ stays), on 3-4 CPU processes with `torch.distributed`
#    (gloo), each checked against one-device attention in float64.
# 4. Predict, then measure, the causal work per rank: contiguous slices overload the last rank, zigzag
#    balances it.
# 5. Read a two-GPU benchmark and a profiler trace (how much of the communication hides behind compute), compare with
#    PyTorch's `context_parallel`, and predict scaling to 8 GPUs and across hosts.
#
# The finished pieces live in `course_lib.distributed`: `shard`, `unshard`, `chunk_ids`, `plan_step`,
# `work_per_rank`, `ring_attention`, `run_ranks`.

# %% [markdown]
# ## 0. Sizes
#
# The ranks here are CPU processes joined by gloo, so the sizes are small on any machine. A run over the
# GPUs of one machine is a script (`torchrun --nproc_per_node 2 scripts/ring_bench.py`), whose record
# this notebook reads in section 8.

# %%
import importlib
import marshal
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

import course_lib
from course_lib import records
from course_lib.attention.merge import merge_attention_states
from course_lib.attention.reference import attention
from course_lib.distributed import (
    chunk_ids,
    figures,
    plan_step,
    run_ranks,
    shard,
    unshard,
    work_per_rank,
)
from course_lib.distributed.workers import compare_with_reference, step_compute_times
from course_lib.exercises import check, check_cases, predict
from course_lib.perf import plotting
from course_lib.testing import check_merge

WORLD = course_lib.pick(cpu=4, gpu=4)  # CPU processes in the gloo runs
CHECK_N = course_lib.pick(cpu=64, gpu=64)  # total tokens of the correctness run
TIMING = course_lib.pick(  # the measured load-balance run (float32, PyTorch blocks)
    cpu=dict(B=1, H=2, N=2048, d=128, causal=True), gpu=dict(B=1, H=2, N=2048, d=128, causal=True)
)
torch.manual_seed(0)
plotting.use_readable_defaults()  # projector-sized fonts for every figure, plt's own included

# %% [markdown]
# ## 1. Why: a million tokens against one device
#
# Take a model with 32 layers, 32 query heads of d = 128 (hidden size 4096) and as many K/V heads (no GQA),
# trained or prefilled on N = 2²⁰ tokens in bf16. Per layer, attention's inputs and output (Q, K, V, O) are
# 4 · N · 4096 · 2 bytes (with GQA, K and V shrink by H / H_kv),
# and FlashAttention keeps nothing of size N × N. Its work does grow as N²: a causal forward is
# 2 · 2 · N² · H · d / 2 FLOPs (two matmuls, half the pairs), forward + backward about 3.5 times that.

# %%
N_1M, LAYERS, HEADS, D_HEAD, BYTES = 2**20, 32, 32, 128, 2
qkvo_gib = 4 * N_1M * HEADS * D_HEAD * BYTES / 2**30
scores_tib = N_1M * N_1M * BYTES / 2**40  # one head's S, if it were materialised
flops_step = 3.5 * 2 * 2 * N_1M**2 * HEADS * D_HEAD / 2 * LAYERS
H200_FLOPS = 989e12  # dense bf16 datasheet peak; assume attention reaches about half of it
print(f"Q, K, V, O per layer:              {qkvo_gib:6.1f} GiB   (x {LAYERS} layers: {qkvo_gib * LAYERS:.0f} GiB)")
print(f"one head's N x N score matrix:     {scores_tib:6.1f} TiB   (never stored by FlashAttention)")
print(f"attention fwd+bwd, all layers:     {flops_step:.2e} FLOPs")
print(f"  at half of an H200's peak:       {flops_step / (H200_FLOPS / 2) / 60:6.0f} minutes per training step")
assert qkvo_gib * LAYERS > 141e9 / 2**30  # more than one H200's 141 GB, for attention's own tensors alone

# %% [markdown]
# One device runs out of memory (the activations of all layers) and of time (tens of minutes per step).
# Split the sequence over P devices and both divide by P, if the devices can exchange what they need
# without waiting. Three ways to share one attention:
#
# - **all-gather K/V**: each device keeps the Q of its slice and gathers **all** of K and V. It sends its
#   K, V slice to every other device, and its memory grows back to N.
# - **head sharding (DeepSpeed-Ulysses)**: an all-to-all turns "N/P tokens of all H heads" into "all N
#   tokens of H/P heads"; attention runs locally per head; a second all-to-all brings O back. Each device
#   sends 2 · N/P · (H + H_kv) · d · (P - 1)/P elements (Q and K, V before, O after; K and V have H_kv
#   heads).
# - **ring**: each device keeps the Q of its slice and holds one K/V slice at a time. It sends its K, V
#   slice to the next device, P - 1 times: 2 · N/P · H_kv · d elements per step.
#
# Ulysses needs its heads divisible by P, the K/V heads too (H_kv ≥ P), or else K/V copied to several devices:
# GQA's few K/V heads make that harder. Its all-to-all is fast inside a machine. The ring sends more in total
# unless the K/V heads are few (it sends less when H_kv · (P - 1) < H), but always to the same neighbour, and
# each transfer can hide behind the attention on the slice in hand. Per device, per layer, at N = 1M and P = 8:


# %%
def bytes_sent_per_device(option: str, n: int, p: int, h: int, h_kv: int, d: int, elem: int = 2) -> float:
    """Forward bytes one device sends for one attention layer (the table above)."""
    if option == "all-gather":
        return 2 * n / p * h_kv * d * elem * (p - 1)
    if option == "ulysses":
        return 2 * n / p * (h + h_kv) * d * elem * (p - 1) / p
    if option == "ring":
        return 2 * n / p * h_kv * d * elem * (p - 1)
    raise ValueError(option)


for h_kv in (32, 8, 4):
    row = {o: bytes_sent_per_device(o, N_1M, 8, HEADS, h_kv, D_HEAD) / 2**30 for o in ("all-gather", "ulysses", "ring")}
    print(f"H_kv = {h_kv:2d}: " + ", ".join(f"{o} {gib:.2f} GiB" for o, gib in row.items()))
    ring_more = h_kv * (8 - 1) > HEADS  # the words above: more, unless the K/V heads are few
    assert (row["ring"] > row["ulysses"]) == ring_more, "the ring sends more exactly when H_kv (P - 1) > H"

# %% [markdown]
# The ring sends as many bytes as the all-gather, but a slice at a time, spread over the P - 1 steps of
# compute, and no rank ever holds the whole K/V: its memory is a small multiple of N/P, not N. A small
# multiple, not one slice: the K/V in hand and the next one arriving (double buffering, so the transfer
# overlaps the compute) beside its own Q and O, and in the backward also the dK/dV accumulators travelling
# with the K/V, in float32 (twice the bytes of a bf16 slice). Whether the transfers are hidden depends on
# compute per step against transfer time per step: section 9 works it out.
#
# ## 2. Sharding: who holds which tokens
#
# **Contiguous**: rank r holds tokens [r · N/P, (r+1) · N/P). **Zigzag**: cut the sequence into 2P chunks;
# rank r holds chunk r and chunk 2P - 1 - r. With P = 4 and 16 tokens:

# %%
tokens = torch.arange(16).view(1, 1, 16, 1)
for scheme in ("contiguous", "zigzag"):
    print(f"{scheme:>10}:", [shard(tokens, r, 4, scheme).flatten().tolist() for r in range(4)])
parts = [shard(tokens, r, 4, "zigzag") for r in range(4)]
assert torch.equal(unshard(parts, "zigzag"), tokens)
assert chunk_ids(1, 4, "zigzag") == (1, 6)

# %% [markdown]
# A length that does not divide into the chunks is padded with zeros at the end (`shard` does it);
# `ring_attention(..., seq_len=N)` then masks the padded keys, and `unshard(..., seq_len=N)` drops the
# padded rows.

# %%
ragged = torch.arange(1, 14).view(1, 1, 13, 1)  # tokens 1 .. 13, so that a 0 is padding
parts = [shard(ragged, r, 4, "zigzag") for r in range(4)]
print("13 tokens, zigzag over 4 ranks (0 = padding):", [p.flatten().tolist() for p in parts])
assert torch.equal(unshard(parts, "zigzag", seq_len=13), ragged)

# %% [markdown]
# ## 3. Ring attention, forward
#
# Here q, k and v are (B, H, N, d), heads before tokens, as in notebooks 02-08 (the decoding notebooks'
# caches put tokens first); `shard` cuts the sequence dimension, -2.
#
# Rank r starts with its own Q_r, K_r, V_r. At step s it holds the K/V of rank (r - s) mod P. It
# computes attention of Q_r against them, a partial result (O_s, L_s): O normalised over these keys only,
# L their logsumexp. Two partial results over disjoint keys merge exactly, as in notebook 03:
#
# $$L = \log(e^{L_a} + e^{L_b}), \qquad O = e^{L_a - L}\, O_a + e^{L_b - L}\, O_b .$$
#
# While it computes, it already sends the K/V it holds to rank r + 1 and receives the next from rank
# r - 1 (`torch.distributed.batch_isend_irecv`); after P steps every key has visited every rank. Two
# partial results of one row, merged, against attention over all keys at once:

# %%
q1 = torch.randn(1, 2, 8, 16, dtype=torch.float64)
k1, v1 = torch.randn(2, 1, 2, 24, 16, dtype=torch.float64)
o_a, l_a = attention(q1, k1[:, :, :10], v1[:, :, :10], return_lse=True)
o_b, l_b = attention(q1, k1[:, :, 10:], v1[:, :, 10:], return_lse=True)
o, l = merge_attention_states(o_a, l_a, o_b, l_b)
o_all, l_all = attention(q1, k1, v1, return_lse=True)
torch.testing.assert_close(o, o_all)
torch.testing.assert_close(l, l_all)

# %% [markdown]
# Under a causal mask, not every block needs work. With chunks of equal size, a (query chunk, key chunk)
# pair is either **full** (all keys before all queries), **diagonal** (the same chunk: top-left causal
# mask) or **empty** (skipped). `plan_step` lists the blocks (local row ranges) a rank computes at each
# step; neighbouring full pairs are joined, so zigzag needs one block per step:

# %%
for scheme in ("contiguous", "zigzag"):
    print(scheme)
    for s in range(4):
        print(f"  rank 2, step {s} (keys of rank {(2 - s) % 4}):", plan_step(2, (2 - s) % 4, 4, scheme, 8, causal=True))

# %% [markdown]
# ## 4. Running it: CPU processes with gloo
#
# `torch.distributed` runs one process per rank. On GPUs that is `torchrun` with the NCCL backend; here
# `run_ranks(fn, world)` starts `world` CPU processes joined by gloo and returns what `fn` returns on each.
# A spawned process imports the function it runs, so it lives in a module:
# `workers.compare_with_reference` builds the same random inputs on every rank from one seed, shards them,
# runs `ring_attention` forward and backward (with the PyTorch block path: the Triton interpreter would be
# slow here), gathers the slices and compares O, dQ, dK, dV with float64 attention on the whole sequence.
# The cases: both shardings, causal or not, GQA (4 query heads sharing 2 K/V heads), and a ragged length.

# %%
cases = [
    dict(B=1, H=2, N=CHECK_N, d=16, causal=True, sharding="zigzag"),
    dict(B=1, H=2, N=CHECK_N, d=16, causal=True, sharding="contiguous"),
    dict(B=1, H=4, Hkv=2, N=CHECK_N - 5, d=16, causal=False, sharding="zigzag"),
]
results = run_ranks(compare_with_reference, WORLD, (cases,), timeout=300)
for case, r in zip(cases, results[0]):
    gqa = case.get("Hkv", case["H"]) < case["H"]
    errors = ", ".join(f"{k} {e:.1e}" for k, e in r["error"].items())
    print(f"{case['sharding']:>10}, causal={case['causal']!s:5}, N={case['N']}, GQA={gqa!s:5}: {errors}")
    assert max(r["error"].values()) < 1e-12

# %% [markdown]
# ### Your ring
#
# **Exercise 1 (the ring's forward loop).** Write the loop each rank runs, for contiguous slices: rank r
# holds tokens [r · n, (r + 1) · n) of q, k and v (n = N / P), all (B, H, n, d) in float64. For P steps:
#
# 1. compute attention of its q against the K/V block it holds, as a partial result (O_s, L_s):
#    `attention(q, k_s, v_s, causal=..., return_lse=True)` (course_lib's reference attention);
# 2. merge it into the running (O, L), which starts as (0, −∞) ("no key yet"), with
#    `merge_attention_states(O, L, O_s, L_s)` (the rule above);
# 3. send the K/V block it holds to rank (r + 1) mod P and receive the next one from rank (r − 1) mod P.
#    `dist.isend(tensor, dst)` and `dist.irecv(tensor, src)` start a transfer and return a request; `.wait()`
#    on it before using what was received. Every rank sends and receives at once: with a blocking
#    `dist.send` first on every rank, the ring can wait on itself (a send may wait for a receive its
#    neighbour has not posted yet). Start the transfer before the step's compute and wait after it, and
#    the two overlap. Stacking k and v into one
#    tensor makes it one message.
#
# Under a causal mask the slices decide each step's block, as `plan_step` does for contiguous slices: at
# step s rank r holds the keys of rank src = (r − s) mod P. Keys of an earlier rank (src < r) are all before
# r's queries: no mask. Its own keys (src = r): the top-left causal mask, `causal=True`. Keys of a later
# rank: every pair is masked, skip the block.
#
# The ranks are processes, and a spawned process imports the function it runs; a function of this
# notebook cannot be imported there. So the check writes your function's compiled code into a small module
# (`ranks_can_import`, given below) after the imports of `RANK_MODULE_IMPORTS`, and the ranks import it:
# your function may use `torch`, `dist`, `attention`, `merge_attention_states` and `math`, and nothing
# else of the notebook. It then runs on three gloo processes (so that the next rank and the previous one
# differ), gathers every rank's (O, L) and compares them with float64 attention over the whole sequence,
# causal and not, including a slice of one token per rank.

# %%
RANK_MODULE_IMPORTS = """\
import marshal, math, types
import torch
import torch.distributed as dist
from course_lib.attention.merge import merge_attention_states
from course_lib.attention.reference import attention
from course_lib.distributed import shard
"""


def ranks_can_import(*functions):
    """A module the spawned ranks can import, holding `functions` (defined in this notebook) as compiled code
    (`marshal`) beside RANK_MODULE_IMPORTS: each may call those names and the other functions given."""
    folder = Path(tempfile.mkdtemp(prefix="nb13_ranks_"))
    lines = [RANK_MODULE_IMPORTS]
    for fn in functions:
        code = marshal.dumps(fn.__code__)
        lines.append(f"{fn.__name__} = types.FunctionType(marshal.loads({code!r}), globals(), "
                     f"{fn.__name__!r}, {fn.__defaults__!r})")  # fmt: skip
    (folder / f"{folder.name}.py").write_text("\n".join(lines) + "\n")
    sys.path.insert(0, str(folder))  # spawned processes start with the parent's sys.path
    return importlib.import_module(folder.name)


def ring_case_inputs(B, H, N, d, causal, seed=0):
    """q, k, v (B, H, N, d) float64 of one case, the same in every process."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, d, generator=g, dtype=torch.float64) for _ in range(3)]


def ring_check_rank(rank, world, cases):
    """What each rank runs for the check: its contiguous slice of every case, your loop, (O, L) back."""
    out = []
    for case in cases:
        q, k, v = (shard(t, rank, world, "contiguous") for t in ring_case_inputs(**case))
        result = ring_forward_loop(q, k, v, case["causal"])
        parts = result if isinstance(result, (tuple, list)) else [result]
        out.append([torch.as_tensor(t).detach().numpy() for t in parts])  # plain arrays travel back
    return out


# %%
def ring_forward_loop(q, k, v, causal):
    """This rank's (O, L) of attention over the whole sequence, sliced contiguously over the default
    process group: q, k, v (B, H, n, d) float64, this rank's tokens. Returns O (B, H, n, d) and L (B, H, n)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ### BEGIN SOLUTION
    O = torch.zeros_like(q)  # the running result: (0, -inf) = no key yet
    L = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    kv = torch.stack([k, v])  # the block in hand, one message
    for s in range(world):
        src = (rank - s) % world  # the rank whose keys this rank holds at step s
        requests = []
        if s < world - 1:  # the next block: send ours on, receive the previous rank's, while computing
            kv_next = torch.empty_like(kv)
            requests = [dist.isend(kv, (rank + 1) % world), dist.irecv(kv_next, (rank - 1) % world)]
        if not causal or src <= rank:  # a later rank's keys are all masked: nothing to compute
            o_s, l_s = attention(q, kv[0], kv[1], causal=causal and src == rank, return_lse=True)
            O, L = merge_attention_states(O, L, o_s, l_s)
        for r in requests:
            r.wait()
        if s < world - 1:
            kv = kv_next
    return O, L
    ### END SOLUTION


# %% tags=["check"]
RING_WORLD = 3  # processes of the check: three, so that the next rank and the previous one differ
ring_cases = [
    dict(B=1, H=2, N=8 * RING_WORLD, d=16, causal=False),
    dict(B=1, H=2, N=8 * RING_WORLD, d=16, causal=True),
    dict(B=2, H=3, N=5 * RING_WORLD, d=8, causal=True, seed=1),
    dict(B=1, H=1, N=RING_WORLD, d=16, causal=True, seed=2),  # one token per rank
]
ring_runs = {}


def ring_learner(**case):  # every case in one run of RING_WORLD processes (they take seconds to start)
    if not ring_runs:
        ranks = ranks_can_import(ring_case_inputs, ring_check_rank, ring_forward_loop)
        per_rank = run_ranks(ranks.ring_check_rank, RING_WORLD, (ring_cases,), timeout=120)
        for i, c in enumerate(ring_cases):  # contiguous slices: the ranks' rows one after another
            parts = [per_rank[r][i] for r in range(RING_WORLD)]  # per rank: [O, L]
            ring_runs[repr(c)] = [
                torch.cat([torch.from_numpy(p[j]) for p in parts], dim=-2 if j == 0 else -1)  # O by rows, L
                for j in range(len(parts[0]))
            ]
    return ring_runs[repr(case)]


check_cases(
    "ring forward loop",
    ring_cases,
    ring_learner,
    lambda **c: attention(*ring_case_inputs(**c), causal=c["causal"], return_lse=True),
    rtol=1e-10,
    atol=1e-10,
    outputs=("O", "L"),
)

# %% [markdown]
# From here on the notebook runs course_lib's `ring_attention`, whatever the check said.

# %% [markdown]
# ## 5. The backward
#
# The same ring again. Rank r's dQ_r needs every key: it accumulates locally, as the K/V pass by. dK_s and
# dV_s need every query: an accumulator **travels with K_s, V_s**; each rank adds the contribution of its
# queries and passes it on, and after the last step the finished dK_s, dV_s arrive at their owner. Each
# block's backward is the single-device backward (`course_lib.attention.attention_backward(dO, Q, K_s, V_s, O,
# L, causal, scale)`), given the **merged** O and L: the probabilities exp(S - L) with the final L are exactly
# the block's share of the whole softmax, and D = rowsum(dO · O) uses the final O. Nothing is recomputed
# differently from one device.
#
# The gradients of the run above were checked too (dQ, dK, dV in the printout). What travels per step
# and rank, backward: the K/V slice (input dtype) and the dK/dV accumulators (float32, for accuracy) —
# three times the forward's bytes for bf16 inputs, against about 2.5 times the forward's compute.
#
# ## 6. Causal imbalance: predicted, then measured
#
# With contiguous slices, rank 0's queries see only its own keys; rank P - 1's see everyone's. Under
# zigzag every rank holds one early and one late chunk.
#
# **Predict first.** With contiguous slices on the notebook's `WORLD` = 4 ranks, the busiest rank does how many
# times the mean rank's causal work? It is scored against the *measured* compute times further down, and the
# CPU code measured there computes a diagonal block whole (masked, not skipped): count the area of the blocks
# each slice of queries computes, a diagonal block as a full one. Type your estimate in place of the value in
# `predict(...)` in the next cell.

# %%
# Your prediction: busiest rank's work / mean rank's work, contiguous slices, causal, WORLD ranks.
imbalance_guess = predict(f"busiest / mean rank, contiguous, {WORLD} ranks", 1.6, unit="x")

# %% [markdown]
# `work_per_rank` counts the (query, key) pairs each rank computes at each step, from the same plan the
# ring follows:

# %%
N_PRED = 1024
predicted = {s: work_per_rank(WORLD, s, N_PRED) for s in ("contiguous", "zigzag")}
fig = figures.work_figure(predicted, "(query, key) pairs", f"Predicted causal work, N={N_PRED}, {WORLD} ranks")
plt.show()
busiest = {s: max(map(sum, w)) / (sum(map(sum, w)) / WORLD) for s, w in predicted.items()}
print("busiest rank / mean, predicted:", {s: round(b, 2) for s, b in busiest.items()})

# %% [markdown]
# Every rank waits for the slowest at each step (the next K/V comes from a neighbour), so a step takes
# as long as its busiest rank. Contiguous slices waste up to half of the machine: the ring then runs at
# the speed of rank P - 1.
#
# Now measured. The PyTorch block path computes the masked scores of a diagonal block too (a kernel skips
# the tiles above the diagonal), so its prediction is the **area** of each block rather than the pairs.
# `workers.step_compute_times` takes the CPU time each rank spends computing at each forward step
# (`time.process_time`, so that ranks waiting for a shared core do not count it as work):

# %%
measured_raw = run_ranks(step_compute_times, WORLD, (TIMING,), timeout=300)
measured = {s: [[t * 1e3 for t in measured_raw[r][s]] for r in range(WORLD)] for s in ("contiguous", "zigzag")}
area = {s: work_per_rank(WORLD, s, TIMING["N"], measure="area") for s in ("contiguous", "zigzag")}
fig = figures.work_figure(measured, "compute time (ms)", f"Measured: forward compute per rank, N={TIMING['N']}, gloo")
plt.show()
for s in ("contiguous", "zigzag"):
    total = [sum(w) for w in measured[s]]
    pred = [sum(w) for w in area[s]]
    print(f"{s:>10}: busiest/mean measured {max(total) / (sum(total) / WORLD):.2f}, "
          f"predicted from areas {max(pred) / (sum(pred) / WORLD):.2f}")  # fmt: skip
contiguous_total = [sum(w) for w in measured["contiguous"]]
_ = imbalance_guess.score(max(contiguous_total) / (sum(contiguous_total) / WORLD))

# %% [markdown]
# Blocks on a CPU carry costs that the area model leaves out (a diagonal block also builds and applies its mask,
# and the merge and a few PyTorch calls cost the same for every block), and other work on this machine adds
# noise: compare the shapes of the pictures rather than single bars.
#
# ## 7. PyTorch's own: `context_parallel`
#
# PyTorch ships context parallelism as a prototype: `torch.distributed.tensor.experimental.context_parallel`
# shards the given buffers along the sequence (with a head-tail load balancer: zigzag by another name) and,
# inside the `with` block, replaces `scaled_dot_product_attention` by a version built on the same merge of
# partial results. By default it collects the other ranks' K/V with an all-gather rather than passing them
# around a ring (`set_rotate_method("alltoall")` exchanges them step by step instead). It dispatches on
# the CUDA attention kernels (flash, memory-efficient, cuDNN), so it runs on GPUs only. On two GPUs, as in
# `scripts/ring_bench.py`:
#
# ```python
# mesh = init_device_mesh("cuda", (world,))
# with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}):
#     # q, k, v now hold this rank's shard; leaves of the autograd graph for the backward
#     q_s, k_s, v_s = (t.detach().requires_grad_() for t in (q, k, v))
#     out = F.scaled_dot_product_attention(q_s, k_s, v_s, is_causal=True)
#     out.backward(torch.randn_like(out))  # the gradient of this rank's shard of O
# ```
#
# The benchmark below times it on the same inputs as course_lib's ring.
#
# ## 8. Two GPUs: the recorded run
#
# `torchrun --nproc_per_node 2 scripts/ring_bench.py` times causal forward + backward in bf16, d = 128,
# 16 heads, for total N of 32k, 128k and 512k: the ring (zigzag and contiguous) on two GPUs, one GPU on the
# whole sequence, and `context_parallel`. It also profiles one zigzag step. Every ratio below is over
# course_lib's kernel on one GPU. `context_parallel` computes its blocks with SDPA's kernels, not course_lib's,
# so its ratio also carries the difference between the two kernels: where SDPA's block kernel is the faster,
# its ratio can pass the 2x that two GPUs give a method over its own one-GPU time. Its record:

# %%
record = records.load_record("ring")
if record is None:
    print(
        "No recorded two-GPU run yet. `torchrun --nproc_per_node 2 scripts/ring_bench.py` on a machine with "
        "two GPUs writes it. It would show, per N, the throughput of each method over one GPU (perfect: 2x) "
        "and a timeline of one step with the NCCL transfers under the attention kernels."
    )
else:
    data = record["data"]
    print(records.label(record))
    for r in data["rows"]:
        one = r["one_gpu_s"]
        cells = [f"N={r['N'] // 1024}k", f"one GPU {one * 1e3:.0f} ms" if one else "one GPU: did not fit"]
        for key, name in (("zigzag_s", "zigzag"), ("contiguous_s", "contiguous"), ("context_parallel_s", "CP")):
            if r.get(key):
                cells.append(f"{name} {r[key] * 1e3:.0f} ms" + (f" ({one / r[key]:.2f}x)" if one else ""))
        print(", ".join(cells))
    figures.record_figures(data, records.label(record))  # the speed-up bars and the profiled step
    plt.show()
    # What one rank sends in the profiled forward + backward (bf16, H_kv = H): its K/V slice P - 1 times
    # forward and P - 1 times backward, and P float32 dK/dV accumulators (the last one going home).
    shape, P, n_trace = data["shape"], data["world"], data["trace"]["N"]
    kv_bytes = 2 * shape["B"] * shape["H"] * (n_trace // P) * shape["d"] * 2
    sent = 2 * (P - 1) * kv_bytes + P * 2 * kv_bytes
    transfer_ms = sent / (data["bandwidth_GBps"] * 1e9) * 1e3
    print(f"N={n_trace // 1024}k: each rank sends {sent / 1e9:.2f} GB in the step; at the measured "
          f"{data['bandwidth_GBps']:.0f} GB/s that is {transfer_ms:.1f} ms of transfer")  # fmt: skip
    comm = [t["comm_ms"] for t in data["trace"]["ranks"]]
    for rank, t in enumerate(data["trace"]["ranks"]):  # the profiled step, per rank
        print(f"rank {rank}: NCCL kernels ran {t['comm_ms']:.1f} ms ({t['comm_ms'] / transfer_ms:.1f}x the "
              f"transfer time), {100 * t['hidden_fraction']:.0f} % of it while compute ran; "
              f"compute {t['compute_ms']:.0f} ms")  # fmt: skip
        assert 0.5 <= t["hidden_fraction"] < 1, "the words below: most of the transfers hide, not all"
    assert min(comm) <= 1.25 * transfer_ms and max(comm) >= 2 * transfer_ms, "the words below: one rank waits"

# %% [markdown]
# **Reading the trace.** Both ranks send the same bytes, and one rank's NCCL kernels took about what the
# bandwidth predicts, while the other's took several times as long. The bytes did not move slower there:
# an NCCL send/receive kernel starts when its own rank launches it and ends when the exchange, which needs
# both ranks, is done. The rank that reaches an exchange first spends the difference waiting for its peer
# inside the kernel, so most of its "transfer" time is waiting, not moving bytes. Most of each rank's NCCL
# time ran while its attention kernels ran, but not all: the last exchange, the dK/dV accumulators going
# home after the last step, has no compute left to hide behind (in the timeline, the NCCL bar after the
# last attention kernel).

# %% [markdown]
# ## 9. Past two GPUs, on paper
#
# With zigzag, every step of every rank does the same work: F / P² FLOPs, F the whole attention's
# forward + backward. Every step also moves one K/V slice forward (2 tensors of 2 bytes per element in
# bf16) and, backward, the slice again plus its float32 dK/dV (2 + 2 + 4 + 4 bytes): 16 · N/P · H_kv · d
# bytes per step for forward + backward together. The transfer hides while it takes less time than the
# compute of the step:
#
# $$\frac{F}{P^2 \cdot R} \;\ge\; \frac{16 \cdot N/P \cdot H_{kv} \cdot d}{B}
# \quad\Longleftrightarrow\quad \frac{N}{P} \;\ge\; \frac{16 \cdot H_{kv} \cdot R}{7 \cdot H \cdot B}
# $$
#
# (F = 3.5 · 2 · N² · H · d for the causal forward + backward), with R the attention FLOP/s one GPU
# reaches and B the bandwidth one GPU sends at. This pools the two passes. Taken one at a time, the
# forward (4 bytes per element against 2 of the 7 units of F) needs N/P ≥ 2 · H_kv · R / (H · B), and the
# backward (12 bytes against 5 units) N/P ≥ 12 · H_kv · R / (5 · H · B): 5 % more than the pooled bound,
# so the backward is the pass that shows a transfer first. The rates come from the record when there is
# one; else from assumptions, printed as such.

# %%
if record is not None:
    row = max((r for r in record["data"]["rows"] if r["one_gpu_s"]), key=lambda r: r["N"])
    R, B_NV = row["flops"] / row["one_gpu_s"], record["data"]["bandwidth_GBps"] * 1e9
    source = records.label(record)
else:
    R, B_NV = 400e12, 150e9
    source = "assumed: 400 TFLOP/s attention, 150 GB/s GPU-to-GPU"
B_IB = 50e9  # across hosts: one 400 Gb/s InfiniBand NIC per GPU (an assumption, not a measurement)
H_Q, H_KV, D = 16, 16, 128


def ring_step_times(n, p, rate, bandwidth):
    compute = 3.5 * 2 * n * n * H_Q * D / p**2 / rate
    comm = 16 * n / p * H_KV * D / bandwidth
    return compute, comm


print(f"rates: {R / 1e12:.0f} TFLOP/s per GPU, {B_NV / 1e9:.0f} GB/s inside a host ({source})")
for where, bw in (("inside a host", B_NV), ("across hosts", B_IB)):
    print(f"transfers hide {where} from N/P >= {16 * H_KV * R / (7 * H_Q * bw):,.0f} tokens per rank")
print(f"{'N':>6} {'P':>2} | {'step compute':>12} {'NVLink comm':>11} {'IB comm':>8} | predicted speed-up over 1 GPU")
for n in (128 * 1024, 512 * 1024, 1024 * 1024):
    for p in (2, 4, 8):
        c, m_nv = ring_step_times(n, p, R, B_NV)
        _, m_ib = ring_step_times(n, p, R, B_IB)
        speed_nv, speed_ib = p * c / max(c, m_nv), p * c / max(c, m_ib)
        print(f"{n // 1024:>5}k {p:>2} | {c * 1e3:>9.1f} ms {m_nv * 1e3:>8.2f} ms {m_ib * 1e3:>5.1f} ms "
              f"| {speed_nv:.1f}x in one host, {speed_ib:.1f}x across hosts")  # fmt: skip

# %% [markdown]
# Read the table column by column: where a step's transfer takes less time than its compute, the ring
# can run at P times one GPU, less what the overlap does not hide (launch gaps, the last step's dK/dV going
# home, the kernels' lower efficiency on shorter blocks). The threshold printed above is in tokens per
# rank, so adding GPUs at a fixed N shrinks the slices towards it. Across hosts the bandwidth per GPU is
# several times lower, and the threshold several times higher. In practice the two are combined: a ring
# (or Ulysses) inside each host, where bandwidth is high, and across hosts either a second ring whose
# steps carry a whole host's slice, or data and pipeline parallelism instead of context parallelism.
#
# ## Exercises
#
# Exercise 1 was the ring's forward loop, in section 4. Each exercise has a cell to fill in and a check cell
# after it; a failed check shows a hint, the next failure the next one, and
# `course_lib.exercises.solution(name)` shows a worked answer.

# %% [markdown]
# **Exercise 2 (bytes per step).** In the forward ring, how many bytes does one rank send at each step?
# Elements of `elem` bytes (2 for bf16), batch B, H_kv key/value heads, total length N over P ranks, head
# dim d. The check tries B = 1, H_kv = 8, N = 131072, P = 4, d = 128 in bf16, and a second case in float32
# (`elem=4`) with B = 2.


# %%
def ring_bytes_per_step(B, h_kv, n, p, d, elem=2):
    ### BEGIN SOLUTION
    return 2 * B * h_kv * (n // p) * d * elem  # its K slice and its V slice
    ### END SOLUTION


# %% tags=["check"]
check(
    "bytes one rank sends per ring step",
    lambda: [ring_bytes_per_step(1, 8, 131072, 4, 128), ring_bytes_per_step(2, 4, 65536, 8, 64, elem=4)],
    [2 * 8 * 32768 * 128 * 2, 2 * 2 * 4 * 8192 * 64 * 4],
)

# %% [markdown]
# **Exercise 3 (the zigzag assignment).** Write `zigzag_tokens(rank, world, n)`: the list of token
# positions (0 .. n - 1) that `rank` holds under zigzag sharding, in its local order. n is a multiple of
# 2 · world.


# %%
def zigzag_tokens(rank, world, n):
    ### BEGIN SOLUTION
    c = n // (2 * world)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * world - 1 - rank) * c, (2 * world - rank) * c))
    ### END SOLUTION


# %% tags=["check"]
check(
    "zigzag assignment",
    lambda: [[int(t) for t in zigzag_tokens(r, 3, 24)] for r in range(3)],  # a list or a tensor of positions
    [shard(torch.arange(24).view(24, 1), r, 3, "zigzag").flatten().tolist() for r in range(3)],
)

# %% [markdown]
# **Exercise 4 (the merge).** Rank r holds partial results over the keys of rank a and of rank b:
# (O_a, L_a), (O_b, L_b) as tensors (..., N, d) and (..., N). Merge them with the logsumexp rule, without
# `merge_attention_states`, and return the merged `(O, L)`. Rows that saw no key in either part have
# L = -inf and O = 0: keep them at (0, -inf), never NaN.


# %%
def merge(o_a, l_a, o_b, l_b):
    ### BEGIN SOLUTION
    l = torch.logaddexp(l_a, l_b)
    safe = torch.where(torch.isneginf(l), torch.zeros_like(l), l)
    w_a = torch.exp(l_a - safe).unsqueeze(-1)
    w_b = torch.exp(l_b - safe).unsqueeze(-1)
    return w_a * o_a + w_b * o_b, l
    ### END SOLUTION


# %% tags=["check"]
# rows: keys in both parts, only in b, in neither, logsumexps of 800 (exp overflows float64), only in a
check_merge("merge of two partial results", merge)

# %% [markdown]
# **Exercise 5 (work per rank).** With contiguous sharding over P ranks and a causal mask, how many
# (query, key) pairs does the busiest rank compute, as a fraction of the whole causal attention? Write
# `busiest_share(n, p)`, exact for any n and p (from the plan's pairs per rank: `work_per_rank`); the check
# calls it with n = 4096, p = 4. Then compare it by hand with your formula for large N.


# %%
def busiest_share(n, p):
    ### BEGIN SOLUTION
    work = [sum(w) for w in work_per_rank(p, "contiguous", n)]
    return max(work) / sum(work)
    ### END SOLUTION


# %% tags=["check"]
check(
    "busiest rank's share, contiguous",
    lambda: busiest_share(4096, 4),
    (1024 * 1024 * 3 + 1024 * 1025 / 2) / (4096 * 4097 / 2),
)

# %% [markdown]
# **More to try.** (a) Run `run_ranks(compare_with_reference, 3, (cases,))`: odd world sizes work too.
# (b) Time the gloo run with 2 and with 4 ranks at a larger N: where does the CPU stop helping?
# (c) In `course_lib/distributed/ring.py`, the backward sends the dK/dV accumulators in float32. Send
# them in the input dtype instead, and measure the error growth on bf16 inputs with 8 ranks.
#
# ## Summary
#
# - Over a long sequence, attention's memory and time exceed one device; sharding the sequence divides
#   both by P if the devices exchange K/V without waiting.
# - **Ring attention**: each rank keeps its queries; K/V slices rotate around the ring, the transfer of
#   the next slice overlapping the attention on the current one; partial (O, L) merge exactly with the
#   logsumexp rule of notebook 03. **Backward**: dQ stays, dK/dV accumulators travel with their K/V back to
#   the owner; every block's backward uses the merged O and L.
# - Under a causal mask, **contiguous** slices overload the last rank (it does about (2P - 1)/P² of the
#   work, against 1/P for each rank under **zigzag**, where rank r holds chunks r and 2P - 1 - r).
# - What each option sends: ring and all-gather 2 · N/P · H_kv · d per step and rank (the ring holds a
#   few slices at a time, never the whole K/V), Ulysses an all-to-all of Q, K, V, O over heads.
# - Inside one host the ring's transfers are small next to its compute at long N; across hosts the
#   bandwidth drops and the slices must be longer (or the ring hierarchical) for them to stay hidden.
