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
# # 14 · Serving many requests
#
# Notebook 10 stored the cache in pages and served requests with a continuous batcher; notebook 12 served the
# capstone model that way. Real traffic has two more features that a server can exploit:
#
# - **Requests share prefixes.** A chat service puts the same system prompt in front of every conversation; a
#   few-shot prompt repeats its examples; a document is asked many questions. Without sharing, every request
#   recomputes the prefix's K and V (prefill) and every decoding step reads them again, once per request.
# - **Requests differ in length.** Some want 5 tokens, some 500. How the batcher admits them decides the
#   throughput and the latency each user sees.
#
# **Learning goals**
# 1. Name a full page of the KV cache by the tokens it holds (a hash chained over the previous page's), find a
#    new prompt's cached pages, and keep idle pages until memory is needed (LRU): **prefix caching**.
# 2. Build **cascade attention** from notebook 03's merge: all the batch's queries read the shared prefix once,
#    each sequence reads its own suffix, the two partial states are merged; predict its speed-up from bytes.
# 3. Measure **static against continuous batching** (and chunked prefill) on one request stream: throughput,
#    time to first token, time per output token, after predicting the gain from the output lengths alone.
#
# The finished pieces: `course_lib.serving` (`PrefixCache`, `PrefixCachingBatcher`, `cascade_decode_attention`,
# `StaticBatcher`, `serve_workload`).

# %% [markdown]
# ## 0. Sizes
#
# On a CPU the kernels run in Triton's interpreter, so the caches and the toy model are tiny; on a GPU the
# cascade cell is the one a real server meets (64 requests sharing a 32k-token prompt).

# %%
import math

import matplotlib.pyplot as plt
import numpy as np
import torch

import course_lib
from course_lib import records
from course_lib.decode import paged_decode_attention
from course_lib.decode.batching import ContinuousBatcher
from course_lib.decode.toy_model import ToyModel
from course_lib.exercises import check, check_cases, predict
from course_lib.perf import plotting
from course_lib.serving import (
    PrefixCachingBatcher,
    StaticBatcher,
    block_hash,
    cascade_decode_attention,
    cascade_reference,
    draw_workload,
    predict_steps,
    serve_workload,
)

PAGE = 4  # tokens per page in the small examples
B, P, S, HQ, HKV, D = course_lib.pick(cpu=(3, 40, 6, 4, 2, 16), gpu=(64, 32768, 1024, 32, 8, 128))
DTYPE = course_lib.pick(cpu=torch.float32, gpu=torch.bfloat16)
DEV = course_lib.DEVICE
torch.manual_seed(0)
plotting.use_readable_defaults()

# %% [markdown]
# ## 1. What a shared prefix costs
#
# Take 64 requests that share a 32k-token system prompt and each add 1k tokens of their own, on a model with
# 8 K/V heads of dimension 128 in bf16 (one layer). One decoding step of paged attention reads, for each
# request, its whole cache: the prefix 64 times over.

# %%
token_bytes = 2 * 8 * 128 * 2  # K and V of one token, one layer: 2 x Hkv x d x 2 bytes
paged_gb = 64 * (32768 + 1024) * token_bytes / 1e9
shared_gb = (32768 + 64 * 1024) * token_bytes / 1e9
print(f"paged decoding reads {paged_gb:.2f} GB per layer per step; the distinct K/V: {shared_gb:.2f} GB")
print("and each new request recomputes 32768 prefix tokens of prefill that another request already computed")

# %% [markdown]
# Both costs disappear if the server notices that the prefix is the same: store it once (prefix caching,
# sections 2-3) and read it once per step for the whole batch (cascade attention, section 4).
#
# ## 2. Naming a page by its tokens
#
# A page holds `page_size` tokens, and once full it never changes: a sequence writes only into its last,
# partial page. So a full page can be named by **what it holds and what came before it**: its block hash is a
# hash of the previous page's hash and its own token ids (vLLM v1 and nano-vllm do exactly this). Two prompts
# that start with the same 2 000 tokens produce the same first 2000 / page_size hashes, in the same order.
#
# Why chain the hash instead of hashing each page's tokens alone? Because a page's K and V depend on every
# token before it (attention mixes them in, and RoPE adds the position): the same 16 tokens after a different
# prefix are different keys.

# %%
h1 = block_hash(b"", [5, 6, 7, 8])
h2 = block_hash(h1, [9, 10, 11, 12])
print(h1.hex()[:16], h2.hex()[:16])
print("same tokens, other prefix:", block_hash(b"other", [9, 10, 11, 12]).hex()[:16])

# %% [markdown]
# **Exercise 1 (the lookup).** `table` maps a block hash to `(page, parent_hash, tokens)` for every cached
# page. Write `match_prefix(table, tokens, page_size)`: walk the prompt's **full** pages from the first, and
# return the list of cached pages that hold them, stopping at the first page that is not cached. A hash hit is
# not trusted on its own: the entry's parent hash and tokens must equal the page's (two different pages could
# in principle hash alike, and the wrong page would hand a request someone else's keys).

# %%
def match_prefix(table, tokens, page_size):
    """table: {hash: (page, parent_hash, tokens_tuple)}; tokens: the prompt (list of ints). Returns [page, ...]."""
    ### BEGIN SOLUTION
    pages, parent = [], b""
    for i in range(len(tokens) // page_size):
        block = tuple(tokens[i * page_size : (i + 1) * page_size])
        h = block_hash(parent, block)
        entry = table.get(h)
        if entry is None or entry[1:] != (parent, block):
            break
        pages.append(entry[0])
        parent = h
    return pages
    ### END SOLUTION


# %% tags=["check"]
def _table(prompts, page_size, poison=None):
    """A table holding the full pages of `prompts` (page ids handed out in order); `poison`: a hash whose
    entry is replaced by other tokens, as a collision would look."""
    table, next_page = {}, 0
    for prompt in prompts:
        parent = b""
        for i in range(len(prompt) // page_size):
            block = tuple(prompt[i * page_size : (i + 1) * page_size])
            h = block_hash(parent, block)
            if h not in table:
                table[h] = (next_page, parent, block)
                next_page += 1
            parent = h
    if poison is not None:
        page, parent, block = table[poison]
        table[poison] = (page, parent, tuple(t + 1 for t in block))
    return table


def _truth(prompts, tokens, page_size, poison=None):
    table = _table(prompts, page_size, poison)
    got, parent = [], b""
    for i in range(len(tokens) // page_size):
        block = tuple(tokens[i * page_size : (i + 1) * page_size])
        h = block_hash(parent, block)
        if h not in table or table[h][1:] != (parent, block):
            break
        got.append(table[h][0])
        parent = h
    return got


_base = list(range(100, 113))  # 13 tokens: 3 full pages of 4 and a partial one
_cases = [
    {"prompts": [_base], "tokens": _base + [1, 2], "poison": None},  # the whole cached prefix
    {"prompts": [_base], "tokens": _base[:6] + [0] * 9, "poison": None},  # diverges inside page 2
    {"prompts": [_base], "tokens": [0] + _base, "poison": None},  # shifted by one: nothing matches
    {"prompts": [_base], "tokens": _base[:3], "poison": None},  # shorter than a page
    {"prompts": [_base, _base[:8] + [7] * 8], "tokens": _base[:8] + [7] * 9, "poison": None},  # a branch
    {"prompts": [_base], "tokens": _base, "poison": block_hash(b"", tuple(_base[:4]))},  # a collision
]
check_cases(
    "prefix lookup",
    _cases,
    lambda prompts, tokens, poison: torch.tensor(match_prefix(_table(prompts, PAGE, poison), tokens, PAGE)),
    lambda prompts, tokens, poison: torch.tensor(_truth(prompts, tokens, PAGE, poison)),
)

# %% [markdown]
# ## 3. Keeping pages after their request: reference counts and LRU
#
# `course_lib.serving.PrefixCache` keeps that table for a paged cache. A cached page holds **one reference of
# its own**: when its last request ends, the page is not freed but becomes *idle*, joins a least-recently-used
# list, and is evicted (given back to the free list) only when the allocator runs out of free pages. A page
# that some sequence still reads has a reference count above one and is never evicted.
#
# `PrefixCachingBatcher` is notebook 10's batcher with that cache: at admission it starts a request on the
# cached pages of its prompt and marks those tokens computed, so its prefill runs only over the rest. Serve
# four requests that share a 13-token prefix, one at a time, with and without the cache: the tokens must be
# the same, and the cached run computes far fewer prompt tokens.

# %%
toy = ToyModel(DEV)
g = torch.Generator().manual_seed(1)
shared = torch.randint(0, toy.vocab, (13,), generator=g).tolist()
prompts = [shared + torch.randint(0, toy.vocab, (n,), generator=g).tolist() for n in (3, 5, 2, 4)]
plain = ContinuousBatcher(toy, num_pages=24, page_size=PAGE, max_batch=1)
cached = PrefixCachingBatcher(toy, num_pages=24, page_size=PAGE, max_batch=1)
for prompt in prompts:
    plain.submit(prompt, 2)
    cached.submit(prompt, 2)
same = plain.run() == cached.run()
prompt_tokens = sum(len(p) for p in prompts)
print(f"same tokens with and without the cache: {same}")
print(f"prompt tokens found in the cache: {cached.prefix.hits} of {prompt_tokens}")
assert same and cached.prefix.hits == 3 * 3 * PAGE  # requests 2-4 each found the 3 shared full pages

# %% [markdown]
# Time to first token is the prefill's time. A prompt 90 % cached computes a tenth of its tokens, but each of
# them still attends to every key before it, cached or not, so its FLOPs fall less than 10x: about 6x at 32k
# tokens, where attention is most of the work (`bench.serving.prefill_flops`). On a GPU the time falls less
# still: the host's work before the model's step does not shrink with the cache, and every layer launches its
# kernels whatever their size, which for a small model is a large part of a short prefill. The record's batchers
# replay each layer's work between its attention calls (norms, projections, RoPE, the MLP) from CUDA graphs
# captured per token count (`cuda_graphs=True`: piecewise graphs, as vLLM and SGLang capture them), so what the
# host still launches is the attention. The serving record (`make bench BENCH=serving`) measures both first tokens.
# A ratio also moves the other way: a kernel that makes each token's work cheaper (the MLP's fused gate, notebook 11)
# saves ten times as much on the uncached prompt, which has ten times the tokens, so both first tokens get faster
# while the speed-up falls. Only what the cached path pays beyond its share of the FLOPs (the host's fixed work, the
# gather and merge around its attention) moves the ratio up.
#
# **Predict first.** A 32k-token prompt, 90 % of it cached: how many times faster is its first token than the
# same prompt's uncached? The FLOPs ratio (6x) is the most it could be; the host's work takes some of it
# back. Type your estimate.

# %%
ttft_guess = predict("speed-up of a 32k prompt's first token when 90 % of it is cached", 6.0, unit="x")

# %%
serving_record = records.load_record("serving")
if serving_record is None:
    print("No recorded GPU run yet. What to look for in it: the speed-up of a 90 % cached first token against "
          "its FLOPs ratio, and the GPU's busy time against the wall clock.")  # fmt: skip
else:
    print(f"{records.label(serving_record)}: time to first token, prompt 90 % cached or not")
    for row in serving_record["data"]["ttft"]:
        print(
            f"  {row['prompt']:6d} tokens: {row['uncached_ms']:6.2f} ms uncached, {row['cached_ms']:6.2f} ms cached: "
            f"{row['speedup']:.2f}x (FLOPs {row['flops_ratio']:.1f}x)", end=""
        )  # fmt: skip
        if row.get("cached_gpu_ms") is not None:
            print(f"; the GPU busy {row['uncached_gpu_ms']:.2f} / {row['cached_gpu_ms']:.2f} ms", end="")
        print()
    longest = max(serving_record["data"]["ttft"], key=lambda row: row["prompt"])
    ttft_guess.score(longest["speedup"])
    if longest.get("cached_step_gpu_ms") is not None:  # where the cached first token's time went
        print(
            f"  {longest['prompt']} tokens, cached: {longest['cached_before_step_ms']:.2f} ms of host work before the "
            f"model's first kernel, then the model's step {longest['cached_step_gpu_ms']:.2f} ms on the GPU, "
            f"{longest['cached_gpu_ms']:.2f} ms of it busy"
        )  # fmt: skip

# %% [markdown]
# The wall clock holds more than the GPU's work. Before the model's first kernel the host checks the prompt, walks
# its pages through the hash table, admits it and builds the step's arrays; nothing runs on the GPU meanwhile.
# Then the first layer's replayed piece finishes long before the host has launched its attention (the cache
# write, the cached keys gathered, the kernel), so the GPU waits again until that kernel is queued; only after it
# does the host run ahead. A record with these parts prints them above: the host's time before the step, and the
# step's time on the GPU against the GPU's busy time within it.

# %% [markdown]
# ## 4. Cascade attention from the merge
#
# Prefix caching stores the prefix once; a paged decoding step still **reads** it once per request. Cascade
# attention (FlashInfer's cascade inference; vLLM v1 uses it when the common prefix is at least 256 tokens)
# splits every sequence's keys into two disjoint sets, the shared prefix and its own suffix:
#
# 1. all B queries of the batch attend to the prefix in **one** pass: one K/V stream, B query rows against it
#    (like a prefill: many rows per key, compute-friendly), no mask (the prefix lies before every query);
# 2. each sequence attends to its own suffix with the paged kernel, causal as before;
# 3. the two partial results (O, L) are merged with notebook 03's rule.
#
# **Exercise 2 (the merge of prefix and suffix).** `o_p, lse_p` come from the prefix pass and `o_s, lse_s` from
# the suffix pass: O normalised over its own keys, L the logsumexp of its scores (natural log, float32), of
# shapes (B, Tq, Hq, d) and (B, Tq, Hq). Return the attention over both key sets, O in `o_s`'s dtype. (Every
# row here sees at least one key in each part.)

# %%
def merge_prefix_suffix(o_p, lse_p, o_s, lse_s):
    ### BEGIN SOLUTION
    lse = torch.logaddexp(lse_p, lse_s)
    w_p = torch.exp(lse_p - lse).unsqueeze(-1)
    w_s = torch.exp(lse_s - lse).unsqueeze(-1)
    return (w_p * o_p.float() + w_s * o_s.float()).to(o_s.dtype)
    ### END SOLUTION


# %% tags=["check"]
def _pages(Bc, Tq, hq, hkv, prefix_len, suffix_lens, seed):
    """A paged cache holding a prefix and B suffixes, scattered over the pool (as tests/test_cascade.py)."""
    gen = torch.Generator().manual_seed(seed)
    pp, per = -(-prefix_len // PAGE), [-(-n // PAGE) for n in suffix_lens]
    perm = torch.randperm(pp + sum(per), generator=gen)
    k = torch.randn(len(perm), PAGE, hkv, 16, generator=gen)
    v = torch.randn(len(perm), PAGE, hkv, 16, generator=gen)
    table = torch.zeros(Bc, max(per), dtype=torch.int32)
    start = pp
    for b, n in enumerate(per):
        table[b, :n], start = perm[start : start + n], start + n
    q = torch.randn(Bc, Tq, hq, 16, generator=gen)
    return q, k, v, perm[:pp].to(torch.int32), prefix_len, table, torch.tensor(suffix_lens, dtype=torch.int32)


def _learner(Bc, Tq, hq, hkv, prefix_len, suffix_lens, seed):
    parts = _pages(Bc, Tq, hq, hkv, prefix_len, suffix_lens, seed)
    q, k, v, pp, plen, table, lens = (x.to(DEV) if torch.is_tensor(x) else x for x in parts)
    rows = q.reshape(1, Bc * Tq, hq, 16)  # every query row of the batch, over the prefix's pages
    plen_t = torch.tensor([plen], dtype=torch.int32, device=DEV)
    o_p, lse_p = paged_decode_attention(rows, k, v, pp.view(1, -1), plen_t, causal=False, return_lse=True)
    o_s, lse_s = paged_decode_attention(q, k, v, table, lens, causal=True, return_lse=True)
    return merge_prefix_suffix(o_p.view(Bc, Tq, hq, 16), lse_p.view(Bc, Tq, hq), o_s, lse_s)


check_cases(
    "cascade merge",
    [
        {"Bc": 2, "Tq": 1, "hq": 2, "hkv": 2, "prefix_len": 8, "suffix_lens": [3, 5], "seed": 0},
        {"Bc": 3, "Tq": 1, "hq": 4, "hkv": 2, "prefix_len": 13, "suffix_lens": [1, 6, 9], "seed": 1},  # GQA
        {"Bc": 2, "Tq": 2, "hq": 2, "hkv": 1, "prefix_len": 7, "suffix_lens": [2, 5], "seed": 2},  # 2 queries each
    ],
    _learner,
    lambda **case: cascade_reference(*_pages(**case)),
    rtol=1e-4,
    atol=1e-5,
    outputs=("O",),
)

# %% [markdown]
# course_lib's `cascade_decode_attention` is those three steps. Check it at this notebook's sizes against
# float64 attention over each full sequence (prefix then suffix):

# %%
gen = torch.Generator().manual_seed(3)
page = course_lib.pick(cpu=PAGE, gpu=64)
n_prefix_pages, n_own = -(-P // page), -(-S // page)
perm = torch.randperm(n_prefix_pages + B * n_own, generator=gen)
k_pages = torch.randn(len(perm), page, HKV, D, generator=gen).to(DEV, DTYPE)
v_pages = torch.randn(len(perm), page, HKV, D, generator=gen).to(DEV, DTYPE)
prefix_pages = perm[:n_prefix_pages].to(torch.int32).to(DEV)
own = perm[n_prefix_pages:].view(B, n_own).to(torch.int32).to(DEV)
q = torch.randn(B, 1, HQ, D, generator=gen).to(DEV, DTYPE)
suffix_lens = torch.full((B,), S, dtype=torch.int32, device=DEV)
out = cascade_decode_attention(q, k_pages, v_pages, prefix_pages, P, own, suffix_lens)
if DEV.type == "cpu":
    ref = cascade_reference(q, k_pages, v_pages, prefix_pages, P, own, suffix_lens)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    print("cascade_decode_attention matches float64 attention over the full sequences")
else:  # the float64 reference of 64 x 33k keys is slow on the host: compare with paged decoding instead
    full = torch.cat([prefix_pages.expand(B, -1), own], dim=1)
    paged = paged_decode_attention(q, k_pages, v_pages, full, suffix_lens + P)
    print(f"cascade vs paged decoding: max |difference| {(out.float() - paged.float()).abs().max().item():.2e}")

# %% [markdown]
# ## 5. Predict, then measure: cascade against paged decoding
#
# At the GPU cell (B = 64 requests, a 32k-token prefix, 1k own tokens each, 32 query and 8 K/V heads, d = 128,
# bf16), both computations do the same FLOPs, 4 · B · Hq · (P + S) · d. Paged decoding reads B (P + S) tokens
# of K and V; cascade reads P + B·S. A decoding step is memory-bound (notebook 09) as long as its arithmetic
# intensity stays below the GPU's ridge point.
#
# **Predict first.** How many times faster should cascade be than paged decoding at that cell? Work out the
# bytes of each, then ask whether cascade's prefix pass is still memory-bound: its B · Hq / Hkv = 256 query
# rows per K/V head do 2 FLOPs per byte per row... Type your estimate in place of the value.

# %%
cascade_guess = predict("cascade over paged decoding, B = 64, 32k shared", 20.0, unit="x")

# %%
bytes_ratio = 64 * (32768 + 1024) / (32768 + 64 * 1024)
flops = 4 * 64 * 32 * (32768 + 1024) * 128
cascade_bytes = (32768 + 64 * 1024) * token_bytes
print(f"bytes: paged / cascade = {bytes_ratio:.1f}x")
print(f"cascade's intensity: {flops / cascade_bytes:.0f} FLOP/byte (an H200's ridge: about 790e12 / 4.8e12 = 165)")


def measure_cascade():
    from course_lib.bench.serving import cascade_cell
    from course_lib.perf.ceilings import measure_matmul_tflops, measure_read_bandwidth

    read, tflops = measure_read_bandwidth(dtype=torch.bfloat16), measure_matmul_tflops(dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    return {"cells": [cascade_cell(64, 32768, read, tflops, torch.bfloat16, DEV, gen)], "read_gbps": read}


got = records.measured_or_recorded(
    "serving_cascade",
    measure_cascade,
    missing="No recorded GPU run yet. What to look for in it: the speed-up against the bytes ratio above, and "
    "how close cascade comes to max(bytes / read ceiling, FLOPs / matmul rate).",
)
if got:
    data, source = got
    cell = data["cells"][0]
    print(
        f"{source}: paged {cell['paged_ms'] * 1e3:.0f} us, cascade {cell['cascade_ms'] * 1e3:.0f} us: "
        f"{cell['speedup']:.1f}x, {cell['of_bound']:.0%} of cascade's bound"
    )
    cascade_guess.score(cell["speedup"])

# %% [markdown]
# Where the measured speed-up falls short of the bytes ratio, look at the three pieces: the prefix pass, the
# suffix pass, and the merge: both passes write their splits' partials into one buffer, and one combine merges
# them all (`serving.cascade.cascade_passes`). The prefix pass is prefill-like work (256 query rows per K/V
# head at B = 64): on a Hopper GPU it runs notebook 08c's warp-specialised forward over the prefix gathered
# once for the group's steps, its keys cut into slices (`serving.cascade.dense_prefix_pass`); elsewhere the
# paged decoding kernel with 128-row programs (`decode.heuristics.many_rows_tile`). The two passes run on two
# CUDA streams. The bound assumes the prefix's arithmetic and the suffixes' reads run at once; they can only
# if neither pass fills the GPU by itself, so the prefix is cut into just enough slices for its tiles to take
# half the SMs (`serving.cascade.prefix_splits`), and the suffix pass takes the other half at the same time.
# Even so each pass takes longer on its half than alone on the whole GPU (the suffix pass's programs run in
# waves, and fewer SMs hold fewer of them at once), and the merge comes after both (notes/serving.md has the
# time of each piece). The serving record
# (`make bench BENCH=serving`) also sweeps B and P to show where cascade starts to win: at small B the prefix
# is read only a few times over, and the second pass and the merge cost more than they save.
# `PrefixCachingBatcher` takes cascade by itself for the decode steps past that crossover
# (`serving.cascade.CascadeChoice`).
#
# ## 6. Static against continuous batching
#
# **Static batching** admits a batch, runs it until its **longest** request ends, then admits the next: a slot
# whose request ended sits idle. **Continuous batching** (notebook 10; Orca) refills a slot at the next step.
# A decoding step of a small model costs about the same with 2 or 8 sequences in it (it reads the weights either
# way: notebook 09), so the gain is the ratio of the **steps** each schedule takes for the same tokens, which
# the output lengths alone decide. `predict_steps` counts them: static sums each batch's longest request;
# continuous hands each request to the slot that frees first.
#
# **Predict first.** 8 requests wait; their output lengths are drawn uniformly between 2 and 40; 2 slots.
# Before running the next cell: how many times more steps does static batching take? (Think of a batch of two:
# the expected maximum of two uniform draws against their mean.) Type your estimate.

# %%
steps_guess = predict("static over continuous batching, steps", 1.3, unit="x")

# %%
N_REQ, SLOTS = course_lib.pick(cpu=(4, 2), gpu=(32, 8))
lengths = draw_workload(8, 10, new_tokens=(2, 40), seed=5).new_tokens
static_steps, continuous_steps = predict_steps(lengths, 2)
print(f"output lengths {lengths}: static {static_steps} steps, continuous {continuous_steps}")
steps_guess.score(static_steps / continuous_steps)

# %% [markdown]
# **Exercise 3 (counting the steps).** Write `count_steps(new_tokens, max_batch)`, what `predict_steps` just
# computed: requests all waiting at the start, in order, with `new_tokens[i]` decoding steps each, at most
# `max_batch` running at once. Return `(static, continuous)`: static batching takes the requests `max_batch` at
# a time and each batch lasts as long as its longest request; continuous batching gives each request, in order,
# to the slot that frees up first (ties: the lowest slot), and ends when the last slot does.
#
# The check compares with `predict_steps` on one slot, more slots than requests, equal lengths, a long request
# last and a drawn workload.

# %%
def count_steps(new_tokens, max_batch):
    """(static, continuous): decoding steps of the two schedules for requests needing new_tokens[i] steps each."""
    ### BEGIN SOLUTION
    static = sum(max(new_tokens[i : i + max_batch]) for i in range(0, len(new_tokens), max_batch))
    slots = [0] * max_batch
    for need in new_tokens:
        k = slots.index(min(slots))
        slots[k] += need
    return static, max(slots)
    ### END SOLUTION


# %% tags=["check"]
steps_cases = [
    dict(new_tokens=[5, 1, 1, 1], max_batch=2),
    dict(new_tokens=[3, 7, 2], max_batch=1),  # one slot: both schedules are the sum
    dict(new_tokens=[4, 9, 2], max_batch=8),  # more slots than requests: both are the longest
    dict(new_tokens=[6, 6, 6, 6, 6], max_batch=2),
    dict(new_tokens=[1, 1, 1, 1, 1, 1, 30], max_batch=3),  # a long request last
    dict(new_tokens=draw_workload(24, 10, new_tokens=(2, 40), seed=11).new_tokens, max_batch=4),
]
check_cases(
    "batching steps",
    steps_cases,
    count_steps,
    predict_steps,
    rtol=0,
    atol=0,
    outputs=("static", "continuous"),
)

# %% [markdown]
# Now serve a request stream for real and measure throughput (generated tokens per second), **time to first
# token** (TTFT: arrival to first token) and **time per output token** (TPOT) for three batchers at the same
# page pool: static, continuous, and continuous with **chunked prefill** (a long prompt's prefill split over
# several steps, so that decoding requests are not stalled behind it: Sarathi-Serve).

# %%
model = toy if DEV.type == "cpu" else None
if model is None:
    from course_lib.bench.serving import serving_model

    model = serving_model(True)
vocab = model.vocab if hasattr(model, "vocab") else model.config.vocab_size
work = draw_workload(
    N_REQ, vocab, prompt_lens=course_lib.pick(cpu=(3, 10), gpu=(16, 256)),
    new_tokens=course_lib.pick(cpu=(1, 6), gpu=(8, 128)), seed=1,
)  # fmt: skip
pages = course_lib.pick(cpu=40, gpu=4096)
runs = {}
for name, cls, step_tokens in (
    ("static", StaticBatcher, 4096), ("continuous", ContinuousBatcher, 4096),
    ("continuous, chunked prefill", ContinuousBatcher, course_lib.pick(cpu=4, gpu=64)),
):  # fmt: skip
    if DEV.type == "cuda":  # warm-up: compile the kernels, fill the caches
        serve_workload(cls(model, pages, 16, max_batch=SLOTS), draw_workload(2, vocab, (4, 8), (2, 2), seed=9))
    runs[name] = serve_workload(cls(model, pages, course_lib.pick(cpu=PAGE, gpu=16), max_batch=SLOTS,
                                    max_step_tokens=step_tokens), work)  # fmt: skip
    print(name, {k: round(v, 2) for k, v in runs[name].summary().items()})
s_steps, c_steps = predict_steps(work.new_tokens, SLOTS)
measured_gain = runs["continuous"].throughput / runs["static"].throughput
print(f"continuous / static throughput: measured {measured_gain:.2f}x, predicted {s_steps / c_steps:.2f}x")

# %%
fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
for ax, name in zip(axes, ("static", "continuous")):
    r = runs[name]
    for i in range(len(r.first)):
        ax.barh(i, r.first[i] - r.arrival[i], left=r.arrival[i], color="0.8")
        ax.barh(i, r.last[i] - r.first[i], left=r.first[i], color="tab:blue")
    ax.set_ylabel("request")
    ax.set_title(f"{name}: waiting and prefill (grey), generating (blue)")
axes[-1].set_xlabel("seconds from the start")
fig.tight_layout()
plt.show()

# %% [markdown]
# Read the chart: in static batching a whole batch waits for its longest request, and the requests of the
# next batch wait with it (long grey bars); continuous batching starts each request as soon as a slot frees.
# The throughput gain follows the step counts where a step's cost does not depend on how many sequences run
# in it. Where it does not follow them, look at what a step costs: on a CPU the interpreter's time grows with
# the rows of a step, so a fuller batch is no longer free.
#
# **Preemption.** When the page pool runs out in the middle of a step, the batcher **preempts** the most
# recently admitted request: its pages are freed and it goes back to the front of the queue, to be
# recomputed from its prompt and the tokens it had generated (vLLM's "recompute" mode). With
# `preemption="swap"` the batcher copies its pages to host memory instead (pinned, so the copy is queued without
# waiting) and back into free pages when it is admitted again: no token is computed twice, for two copies over
# PCIe. With prefix caching, the recomputation starts on the pages it just gave back, which stay cached until
# another request needs them (tests/test_prefix_cache.py and tests/test_scheduling.py check that the tokens are
# still exactly the greedy ones in both modes).
#
# ## 7. Summary
#
# - A full page never changes, so it can be named by a hash chained over its tokens and its prefix; a hit is
#   checked against the stored tokens. Cached pages hold a reference of their own and are evicted LRU, only
#   when the pool needs them. A request whose prompt is cached skips that prefill.
# - Cascade attention reads a shared prefix once for the whole batch and merges with the suffix pass by the
#   logsumexp rule of notebook 03: bytes fall from B (P + S) to P + B S.
# - Continuous batching beats static batching by the ratio of their step counts while steps cost the same:
#   the spread of the output lengths decides it. Chunked prefill trades a little throughput for smoother
#   time per output token.
