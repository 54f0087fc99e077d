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
# # 10 · PagedAttention and serving memory
#
# Notebook 09 made one decoding step fast. A server runs many sequences at once, each growing by a token per
# step, arriving and finishing at different times. Where their KV caches live decides how many fit on the
# GPU, and so the throughput. This notebook stores the cache in **pages**, as vLLM's PagedAttention does.
#
# **Learning goals**
# 1. Measure, by simulation, how much memory contiguous per-request caches waste (reserved for the maximum
#    length, and fragmented as requests come and go).
# 2. Store the cache in fixed-size pages with a **block table** per sequence, and manage pages with an
#    allocator: a free list, reference counts for shared prefixes, copy-on-write (you write fork and the
#    copy-on-write append of a small paged cache).
# 3. Run the split-KV kernel of notebook 09 **through the block table**, and read the cost of the
#    indirection by page size from a GPU record.
# 4. Drive the paged kernel from a **continuous-batching** loop: requests join and leave between steps,
#    and prefill and decode share a step.
#
# The finished pieces: `course_lib.decode.paged_decode_attention`, `course_lib.decode.cache` (`PageAllocator`,
# `PagedKVCache`) and `course_lib.decode.batching` (`ContinuousBatcher` and the model interface it serves).

# %% [markdown]
# ## 0. Sizes
#
# The simulation of section 1 is plain Python at the same size everywhere. The kernel runs in Triton's
# interpreter on the CPU, so its caches are small there.

# %%
import math
import traceback

import matplotlib.pyplot as plt
import numpy as np
import torch

import course_lib
from course_lib import records
from course_lib.decode import decode_reference, paged_decode_attention
from course_lib.decode.batching import ContinuousBatcher
from course_lib.decode.cache import PageAllocator, PagedKVCache
from course_lib.decode.reference import gather_pages
from course_lib.decode.toy_model import ToyModel
from course_lib.exercises import check, predict
from course_lib.perf import plotting

N_REQUESTS, MAX_LEN = 1000, 4096  # simulated requests and the longest a request may grow
B, N, HQ, HKV, D = course_lib.pick(cpu=(3, 200, 8, 2, 64), gpu=(16, 8192, 32, 8, 128))
PAGE_SIZE = 16
DTYPE = course_lib.pick(cpu=torch.float32, gpu=torch.bfloat16)
DEV = course_lib.DEVICE
rng = np.random.default_rng(0)
torch.manual_seed(0)
plotting.use_readable_defaults()  # projector-sized fonts for every figure, plt's own included

# %% [markdown]
# ## 1. What contiguous caches waste
#
# A simple server gives each request a contiguous slab of KV cache when it starts. It does not know how many
# tokens the request will generate, so it reserves room for the maximum, `MAX_LEN`. Simulate requests whose
# prompts and outputs have a spread of lengths (log-normal, as chat traffic roughly has) and compare the
# tokens actually stored with the tokens reserved.
#
# **Predict first.** The prompts have a median of about e^5.5 ≈ 245 tokens, the outputs about e^5 ≈ 150,
# both with a long tail, and each slab reserves `MAX_LEN` = 4096 tokens. What percentage of the reserved
# memory never holds a token? (A long tail pulls the mean above the median.) Type your estimate in place of
# the value in the next cell; the simulation after it scores it.

# %%
# Your prediction: % of the contiguous reservations (MAX_LEN tokens each) that never hold a token.
waste_guess = predict("memory wasted by reserving MAX_LEN", 84.0, unit=" %")

# %%
prompt_len = np.clip(rng.lognormal(5.5, 1.0, N_REQUESTS), 8, MAX_LEN // 2).astype(int)
output_len = np.clip(rng.lognormal(5.0, 1.0, N_REQUESTS), 1, MAX_LEN // 2).astype(int)
final_len = np.minimum(prompt_len + output_len, MAX_LEN)
used = final_len.sum()
reserved_max = N_REQUESTS * MAX_LEN
pages = np.ceil(final_len / PAGE_SIZE) * PAGE_SIZE
print(f"mean final length {final_len.mean():.0f} tokens of {MAX_LEN} reserved")
print(f"contiguous, reserved for MAX_LEN: {1 - used / reserved_max:.1%} of the reserved memory never holds a token")
print(f"pages of {PAGE_SIZE} tokens:        {1 - used / pages.sum():.1%} of the pages' slots stay empty")
assert used / pages.sum() > used / reserved_max
_ = waste_guess.score(100 * (1 - used / reserved_max))

# %% [markdown]
# Even a server that knew each final length in advance would waste memory over time: requests leave holes
# of different sizes between the ones still running, and a new request needs one hole big enough for its
# whole slab (**external fragmentation**). Simulate it with a first-fit allocator over one arena that can
# hold 48 average requests, about 40 of which are running at any time (each lives 20-59 steps): a server
# kept busy, as it should be. Pages have no such problem, since any free page will do.


# %%
def first_fit_simulation(lengths, arena_tokens, steps=400, seed=1):
    """Requests arrive one per step and live 20-59 steps; each needs a contiguous slab of its final length.
    Returns the fraction of arrivals refused while enough memory was free in total."""
    r = np.random.default_rng(seed)
    slabs = []  # (start, length, end_step)
    refused_with_room = arrivals = 0
    for step in range(steps):
        slabs = [s for s in slabs if s[2] > step]
        need = int(lengths[step % len(lengths)])
        arrivals += 1
        slabs.sort()
        start, placed = 0, False
        for s0, n, _ in slabs + [(arena_tokens, 0, 0)]:
            if s0 - start >= need:
                placed = True
                break
            start = s0 + n
        if placed:
            slabs.append((start, need, step + int(r.integers(20, 60))))
        elif arena_tokens - sum(n for _, n, _ in slabs) >= need:
            refused_with_room += 1
    return refused_with_room / arrivals


arena = int(48 * final_len.mean())
frag = first_fit_simulation(final_len, arena)
print(f"first fit, exact lengths: {frag:.1%} of the requests were refused although enough memory was free")
assert frag > 0, "the words above: holes between slabs turn requests away"

# %% [markdown]
# ## 2. Pages, block tables and an allocator
#
# A **page** holds the K (or V) rows of `page_size` consecutive tokens of one sequence. All pages of a layer
# live in one pool, `(num_pages, page_size, Hkv, d)`. A sequence owns a list of page ids, its row of the
# **block table**; token i of sequence b lives in page `block_table[b, i // page_size]` at slot
# `i % page_size`. Pages are handed out one at a time as sequences grow (`PagedKVCache`, on top of
# `PageAllocator`: a free list and a reference count per page).

# %%
cache = PagedKVCache(
    num_layers=1, num_pages=12, page_size=4, num_kv_heads=1, head_dim=16, dtype=torch.float32, device="cpu"
)
for seq, n in ((0, 6), (1, 9), (2, 3)):
    cache.add_sequence(seq)
    cache.append(seq, n)
print("block table (one row per sequence; the lengths say how many entries are pages, the 0s after them")
print("are padding, never read, and page 0 is a real page):")
print(cache.block_table([0, 1, 2]))
print("lengths:", cache.seqlens([0, 1, 2]).tolist(), "| free pages:", cache.allocator.num_free)
cache.append(0, 3)  # sequence 0 grows by 3 tokens: its second page fills, a third page is taken
print("after 3 more tokens of sequence 0:", cache.seqs[0].pages)
assert len(cache.seqs[0].pages) == math.ceil(9 / 4)

# %% [markdown]
# ### Shared prefixes and copy-on-write
#
# Sampling several answers to one prompt (or many requests with one system prompt) stores the prompt's
# K and V once: `fork` gives the new sequence the same page ids and raises their reference counts. Full
# pages are never written again, so they stay shared. The last page, partly filled, is copied the first
# time either sequence writes into it (**copy-on-write**). That is the behaviour of the vLLM paper (Kwon et
# al., 2023), and course_lib's. vLLM's current engine (v1) shares only **full** blocks, found by a hash of
# their tokens (prefix caching): a partly filled last page is never shared, so it never needs a copy, at
# the price of storing up to a page of the prefix twice.
#
# ### Exercise: a paged cache with fork and copy-on-write
#
# Below is a small paged cache of token values (one number per slot, standing in for a token's K and V
# rows): a pool of pages, a free list, a reference count per page, and each sequence's block-table row
# (`tables[seq]`, a list of page ids) and length. Allocating, releasing, adding and freeing a sequence, and
# reading a sequence's tokens through its table are given. You write the two methods that share and write:
#
# 1. `fork(parent, child)`: the child gets a copy of the parent's table and length; no page is copied,
#    every shared page gains an owner.
# 2. `append(seq, values)`: store the values after the sequence's last token. If its last page is partly
#    filled **and** shared (more than one owner), first copy it to a new page (the pool's row), give the old
#    page one owner fewer, and put the copy in the sequence's table: the other owners keep the old one.
#    Then write each value at slot `length % page_size` of page `length // page_size`, allocating a page
#    whenever the sequence has none there yet. An empty `values` changes nothing.
#
# The check replays a list of operations (printed below it) on your cache and on course_lib's
# `PagedKVCache`, and after each compares what a user of the cache can see: every sequence's tokens, the
# reference counts of its pages, and the number of free pages (not the page ids: another allocation order
# is as good). It names the first operation whose result differs.


# %%
class MyPagedCache:
    """Token values of several sequences in pages of `page_size` slots: a pool, a free list, a reference
    count per page, and each sequence's block-table row (a list of page ids) and length."""

    def __init__(self, num_pages, page_size):
        self.page_size = page_size
        self.pool = torch.zeros(num_pages, page_size, dtype=torch.int64)  # one value per token slot
        self.refs = [0] * num_pages  # owners (sequences whose table holds the page)
        self.free = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self.tables = {}  # sequence id -> its block-table row, a list of page ids
        self.lengths = {}  # sequence id -> tokens stored

    def allocate(self):
        """A free page, now with one owner."""
        if not self.free:
            raise MemoryError("no free page left")
        page = self.free.pop()
        self.refs[page] = 1
        return page

    def release(self, page):
        """One owner fewer; the page is free again when none is left."""
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free.append(page)

    def add_sequence(self, seq):
        self.tables[seq], self.lengths[seq] = [], 0

    def free_sequence(self, seq):
        for page in self.tables.pop(seq):
            self.release(page)
        del self.lengths[seq]

    def tokens(self, seq):
        """The sequence's values, read through its block table."""
        table, p = self.tables[seq], self.page_size
        return [int(self.pool[table[i // p], i % p]) for i in range(self.lengths[seq])]

    def fork(self, parent, child):
        """`child` starts as `parent`, sharing every page of it."""
        ### BEGIN SOLUTION
        self.tables[child] = list(self.tables[parent])
        self.lengths[child] = self.lengths[parent]
        for page in self.tables[child]:
            self.refs[page] += 1
        ### END SOLUTION

    def append(self, seq, values):
        """Store `values` (ints) after the sequence's last token, copying a shared, partly filled last page
        first."""
        ### BEGIN SOLUTION
        table, n = self.tables[seq], self.lengths[seq]
        if values and n % self.page_size and self.refs[table[-1]] > 1:
            copy = self.allocate()
            self.pool[copy] = self.pool[table[-1]]
            self.release(table[-1])
            table[-1] = copy
        for value in values:
            if n // self.page_size == len(table):
                table.append(self.allocate())
            self.pool[table[n // self.page_size], n % self.page_size] = value
            n += 1
        self.lengths[seq] = n
        ### END SOLUTION


# %% [markdown]
# The operations, and course_lib's `PagedKVCache` (pools of K and V with one head of one number here)
# behind the same small interface, the reference:

# %%
OPS = [
    ("add_sequence", 0), ("append", 0, [10, 11, 12, 13, 14, 15]),  # 6 tokens: a full page and half of one
    ("fork", 0, 1),  # 1 shares both pages
    ("append", 1, [20]),  # into the shared, partly filled page: copied first
    ("append", 0, [16, 17]),  # 0's last page has one owner again: written in place
    ("fork", 0, 2), ("append", 2, [30, 31, 32, 33, 34]),  # 8 tokens: full pages, nothing to copy
    ("fork", 1, 3), ("append", 3, [40, 41]), ("append", 1, [21]),
    ("free_sequence", 0), ("append", 2, [35]), ("free_sequence", 1),
    ("fork", 3, 4), ("append", 4, []), ("append", 4, [50]),  # an empty append copies nothing
    ("free_sequence", 2), ("free_sequence", 3), ("free_sequence", 4),
]  # fmt: skip


class CourseLibCache:
    """course_lib's PagedKVCache behind MyPagedCache's interface: each value stored as a K (and V) row."""

    def __init__(self, num_pages, page_size):
        self.cache = PagedKVCache(1, num_pages, page_size, 1, 1, torch.float64, "cpu")
        self.add_sequence, self.fork = self.cache.add_sequence, self.cache.fork
        self.free_sequence = self.cache.free
        self.refs, self.free = self.cache.allocator.refs, self.cache.allocator.free_list  # lists, updated in place

    tables = property(lambda self: {seq: s.pages for seq, s in self.cache.seqs.items()})

    def append(self, seq, values):
        rows = torch.tensor(values, dtype=torch.float64).reshape(-1, 1, 1)
        self.cache.write(0, self.cache.append(seq, len(values)), rows, rows)

    def tokens(self, seq):
        s, p = self.cache.seqs[seq], self.cache.page_size
        return [int(self.cache.k_pages[0][s.pages[i // p], i % p]) for i in range(s.length)]


def replay(cache, ops):
    """What a user of `cache` sees after each operation: tokens and page owners per sequence, free pages."""
    seen = []
    for i, (op, *args) in enumerate(ops):
        try:
            getattr(cache, op)(*args)
        except NotImplementedError:
            raise
        except Exception as exc:  # name the operation, and the line of the cache's code that raised
            where = traceback.extract_tb(exc.__traceback__)[-1]
            raise RuntimeError(
                f"operation {i + 1}, {op}{tuple(args)}: {type(exc).__name__}: {exc} "
                f"(line {where.lineno} of {where.name}: `{where.line}`)"
            ) from exc
        seqs = sorted(cache.tables)
        seen.append({
            "tokens": {s: cache.tokens(s) for s in seqs},
            "owners of each page": {s: [cache.refs[p] for p in cache.tables[s]] for s in seqs},
            "free pages": len(cache.free),
        })  # fmt: skip
    return seen


expected_states = replay(CourseLibCache(12, 4), OPS)
for i, ((op, *args), state) in enumerate(zip(OPS[:4], expected_states)):
    print(f"operation {i + 1}, {op}{tuple(args)}: {state}")
print(f"... {len(OPS)} operations in all; after the last, {expected_states[-1]['free pages']} free pages")

# %% tags=["check"]
check(
    "paged cache: fork and copy-on-write",
    lambda: replay(MyPagedCache(12, 4), OPS),
    expected_states,
    parts=[f"operation {i + 1}, {op}{tuple(args)}" for i, (op, *args) in enumerate(OPS)],
)

# %% [markdown]
# From here on course_lib's `PagedKVCache` stands in (the same rules, on K/V pools of every layer). In the
# block-table example of this section (`cache`), sequence 1 holds 9 tokens, two full pages and one
# partial; fork it, and write into the copy:

# %%
cache.fork(1, 3)  # sequence 3 = a second answer to sequence 1's prompt (9 tokens: pages 2 full, 1 partial)
shared = cache.seqs[1].pages
print("pages of 1:", shared, "| of 3:", cache.seqs[3].pages, "| refcounts:",
      [cache.allocator.refs[p] for p in shared])  # fmt: skip
cache.append(3, 1)  # sequence 3 writes token 9 into the shared, partly filled last page: copied first
print("after sequence 3 appends a token:", cache.seqs[3].pages, "| refcounts of 1's pages:",
      [cache.allocator.refs[p] for p in shared])  # fmt: skip
assert cache.seqs[3].pages[:2] == shared[:2] and cache.seqs[3].pages[2] != shared[2]


# %%
def draw_pool(ax, cache, title):
    colors = plt.cm.tab10(np.arange(10))
    owners = {}
    for seq, s in cache.seqs.items():
        for p in s.pages:
            owners.setdefault(p, []).append(seq)
    for p in range(cache.allocator.num_pages):
        seqs = owners.get(p, [])
        color = colors[seqs[0] % 10] if seqs else (0.9, 0.9, 0.9)
        ax.add_patch(plt.Rectangle((p, 0), 0.92, 0.92, color=color, hatch="//" if len(seqs) > 1 else None))
        ax.text(p + 0.46, 0.46, ",".join(map(str, seqs)) or "free", ha="center", va="center", fontsize=9)
    ax.set_xlim(0, cache.allocator.num_pages)
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_xlabel("physical page id")
    ax.set_title(title)


fig, ax = plt.subplots(figsize=(10, 1.8))
draw_pool(ax, cache, "The page pool: each page labelled with the sequences that own it (hatched: shared)")
plt.show()

# %% [markdown]
# ## 3. The paged decode kernel
#
# `paged_decode_attention` is notebook 09's split-KV kernel with one change: before loading a block of
# BLOCK_N keys it looks up, for each key j, the page `block_table[b, j // page_size]`, and reads row
# `j % page_size` of it. That gather works for any page size (a block may span many small pages or a part
# of one large page). Below, a ragged batch stored in shuffled pages, against the float64 reference on the
# same cache laid out contiguously:

# %%
lengths = torch.tensor([1, N // 2 + 3, N][:B] + [N - 7] * max(0, B - 3), dtype=torch.int32, device=DEV)
max_pages = math.ceil(N / PAGE_SIZE)
num_pages = B * max_pages + 5
k_pages = torch.randn(num_pages, PAGE_SIZE, HKV, D, device=DEV, dtype=DTYPE)
v_pages = torch.randn_like(k_pages)
block_table = torch.randperm(num_pages)[: B * max_pages].reshape(B, max_pages).to(torch.int32).to(DEV)
q = torch.randn(B, 1, HQ, D, device=DEV, dtype=DTYPE)
out = paged_decode_attention(q, k_pages, v_pages, block_table, lengths)
k_flat = gather_pages(k_pages, block_table, max_pages * PAGE_SIZE)  # (B, capacity, Hkv, d)
v_flat = gather_pages(v_pages, block_table, max_pages * PAGE_SIZE)
ref, _ = decode_reference(q, k_flat, v_flat, lengths)
err = (out.double().cpu() - ref).abs().max().item()
print(f"paged kernel vs float64 reference: max error {err:.1e}")
assert err < course_lib.pick(cpu=1e-4, gpu=3e-2)

# %% [markdown]
# A bad block table is caught before the kernel runs (on a GPU that check reads the table, a sync; pass
# `validate=False` inside a CUDA graph):

# %%
bad = block_table.clone()
bad[0, 0] = num_pages + 10
try:
    paged_decode_attention(q, k_pages, v_pages, bad, lengths)
except ValueError as exc:
    print("ValueError:", exc)

# %% [markdown]
# ### What the indirection costs, by page size
#
# Each block of keys now needs its page ids first (BLOCK_N int32 reads, mostly from cache), and with small
# pages a block's rows are scattered over many places in memory. The decode benchmark measures the paged
# kernel against the contiguous one for page sizes 1 to 256 (CUDA-graph replay, bf16, 32/8 heads, d = 128).
#
# The lookup also changes how the kernel is best launched. A contiguous program knows where its next K/V
# blocks are, so its software pipeline loads several blocks ahead. A paged program must first read the page
# ids, and only then can it issue the K/V loads that depend on them. Latency it cannot hide inside one
# program it hides across programs: the paged tiles (`heuristics.PAGED_TILES`) use a shorter pipeline and
# ask for 4 programs per SM, and the split rule of notebook 09 fills those slots: four times the
# contiguous kernel's slots. A short grid does better: when all its programs run at once and the
# sequence's row of the block table is not too long (at most `heuristics.TABLE_ROW_MAX` entries), each
# program loads the whole row at its start, beside the sequence's length, and picks each block's page ids
# out of it in registers. Its first K/V load then waits for one round trip to memory instead of two, and
# its pipeline can run ahead as the contiguous kernel's does, so it takes a deeper pipeline and 2 programs
# per SM (`heuristics.table_row_plan`, on the tiles `heuristics.ROW_TILES`). The counts each kernel
# launches (`heuristics.split_grid`), on the H200:
#
# - batch 1 (8k and 32k keys): the table-row plan, **2x** the contiguous kernel's splits (32 against 16);
# - batch 8 at 8k: a batch of two sequences or more with a long cache is cut in slices (notebook 09,
#   appendix A.2), 8 for the contiguous kernel; its grid fits in one wave of the row tile, so the paged
#   kernel takes the table-row plan instead, with its own count: 4 splits, **0.5x**;
# - batch 16 at 32k: sliced too, but too many programs for one wave, so both kernels run the same plan
#   (slices on the paged tile, longest sequence first) and differ only in how they find a key: **1x**;
# - batch 64 at 4k: 512 programs fill the SMs unsplit, in both.
#
# On a GPU the cell computes the counts for the GPU it runs on; elsewhere it prints the H200's recorded
# counts (the interpreter's stand-in of 16 SMs would give other ones).

# %%
from course_lib.decode.heuristics import sliced, sm_count, split_grid

rec = records.load_record("decode")
recorded = {(c["batch"], c["n_max"]): c for c in rec["data"]["cells"]} if rec else {}
shapes = ((1, 8192), (1, 32768), (8, 8192), (16, 32768), (64, 4096))
if course_lib.ON_GPU or not all(shape in recorded for shape in shapes):
    source = f"computed for this device's {sm_count()} SMs"
    if not course_lib.ON_GPU:
        source += " (the interpreter's stand-in: no recorded run to show)"
    counts = {
        (b, n): (split_grid(b, 8, 1, n, 128), split_grid(b, 8, 1, n, 128, paged=True, table_width=n // 16))
        for b, n in shapes
    }  # pages of 16 tokens
else:
    source = records.label(rec)
    counts = {shape: (recorded[shape]["num_splits"], recorded[shape]["paged_num_splits"]) for shape in shapes}
print(f"splits per (sequence, kv head), 8 kv heads, d = 128, pages of 16; {source}:")
for (batch, n_ctx), (contiguous, paged) in counts.items():
    plan = " (sliced)" if sliced(batch, n_ctx) else ""
    print(f"batch {batch:>2}, {n_ctx:>5} tokens: {contiguous:>2} contiguous{plan}, {paged:>2} paged: "
          f"{paged / contiguous:g}x")  # fmt: skip

# %%
if rec and rec["data"].get("page_sweep"):
    sweep = rec["data"]["page_sweep"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for cell in sorted({(r["batch"], r["n"]) for r in sweep}):
        rows = [r for r in sweep if (r["batch"], r["n"]) == cell]
        speed = [r["vs_contiguous"] for r in rows]
        ax.plot([r["page_size"] for r in rows], speed, "o-", label=f"batch {cell[0]}, {cell[1]} tokens")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("page size (tokens)")
    ax.set_ylabel("speed relative to a contiguous cache")
    ax.set_title(f"Paged decoding by page size\n{records.label(rec)}", fontsize=10)
    ax.legend()
    plt.show()
else:
    print("No recorded GPU run of the decode benchmark yet (python -m course_lib.bench.decode on a GPU): it "
          "plots the paged kernel's speed relative to the contiguous one for page sizes 1 to 256.")  # fmt: skip

# %% [markdown]
# ## 4. Continuous batching
#
# A server's loop: at every step, admit waiting requests while there is room (batch slots and free pages
# for their prompt); give each running request its next tokens — one for a request that is decoding, a
# chunk of its prompt for one still in prefill — and run the model **once** over all of them; append each
# request's next token; retire finished requests and free their pages at once, so a waiting request can
# join at the next step instead of waiting for the whole batch to finish.
#
# The loop in `course_lib.decode.batching` serves any model with a small interface (written at the top of
# that module): `num_layers`, `num_kv_heads`, `head_dim`, `dtype`, `device` and
# `forward_step(token_ids, positions, kv) -> logits`, where each attention layer calls
# `kv.attend(layer, q, k, v)`. The model never sees a page. Here it serves `ToyModel`, two attention layers
# with random weights:

# %%
model = ToyModel(DEV)
prompts = [rng.integers(0, model.vocab, n).tolist() for n in (6, 13, 3, 9, 4)]
wanted = [3, 2, 5, 2, 3]
batcher = ContinuousBatcher(model, num_pages=10, page_size=4, max_batch=3, max_step_tokens=8)
ids = [batcher.submit(p, n) for p, n in zip(prompts, wanted)]
trace = []
while batcher.waiting or batcher.running:
    new = batcher.step()
    trace.append((dict(batcher.last_plan), new))
for step, (plan, new) in enumerate(trace):
    fed = ", ".join(f"r{i}:{n}" for i, n in plan.items())
    print(f"step {step:>2}: tokens fed {{{fed}}} -> new tokens from {sorted(new)}")

# %% [markdown]
# Prefill chunks (several tokens) and decode steps (one token) share steps, and requests 3 and 4 join as
# soon as earlier ones leave. Whatever the schedule, every request must get exactly the tokens that plain
# greedy generation gives, recomputing full attention over its whole sequence at every step:

# %%
for i, p, n in zip(ids, prompts, wanted):
    assert batcher.finished[i].generated == model.generate_full(p, n), f"request {i}"
print("every request's tokens equal the step-by-step reference:", [batcher.finished[i].generated for i in ids])
assert batcher.cache.allocator.num_free == 10  # every page came back

# %% [markdown]
# **Decode steps as CUDA graphs.** A real model's decode step is hundreds of small kernels; launched one by
# one from Python, the CPU time per step can exceed the GPU's. Serving engines record a decode step once
# as a CUDA graph and replay it with one call. `ContinuousBatcher(..., cuda_graphs=True)` does so for every
# step in which all sequences decode (`course_lib.decode.graphs`): one graph per batch size and block-table
# width (padded to a power of two pages), its inputs copied into fixed tensors before each replay. The
# tokens must not change. (CUDA graphs need a GPU; on a CPU this cell only says so.) With the capstone's
# model (notebooks 12 and 14) the other steps, prefills among them, replay their work between attention calls.

# %%
if course_lib.ON_GPU:
    replayed = ContinuousBatcher(model, num_pages=10, page_size=4, max_batch=3, max_step_tokens=8, cuda_graphs=True)
    graph_ids = [replayed.submit(p, n) for p, n in zip(prompts, wanted)]
    got = replayed.run()
    assert [got[i] for i in graph_ids] == [batcher.finished[i].generated for i in ids]
    print(f"same tokens; {replayed.graphs.replays} steps replayed from {len(replayed.graphs.graphs)} graphs")
else:
    print("CUDA graphs need a GPU: skipped here.")

# %%
fig, ax = plt.subplots(figsize=(9, 2.8))
for step, (plan, _) in enumerate(trace):
    for i, n in plan.items():
        ax.bar(step, 1, bottom=i, color="tab:orange" if n > 1 else "tab:blue", edgecolor="white")
ax.set_xlabel("step")
ax.set_ylabel("request")
ax.set_title("Continuous batching: orange = prefill chunk, blue = one decode token")
plt.show()

# %% [markdown]
# ## Exercises
#
# Each exercise has a cell to fill in and a check cell after it. Later cells never use your answers.
#
# **Exercise 1 (pages).** How many pages does a sequence of n tokens occupy with pages of `page_size`
# tokens, and how many token slots of its pages stay empty? Return `(pages, empty_slots)`.


# %%
def pages_and_empty_slots(n, page_size):
    ### BEGIN SOLUTION
    pages = -(-n // page_size)
    return pages, pages * page_size - n
    ### END SOLUTION


# %% tags=["check"]
check(
    "pages of a sequence",
    lambda: [pages_and_empty_slots(n, 16) for n in (1, 16, 17, 1000)],
    [(1, 15), (1, 0), (2, 15), (63, 8)],
)

# %% [markdown]
# **Exercise 2 (the block table).** Write `slot_of(block_table, b, j, page_size)`: the index of token j of
# sequence b in the pool viewed as `(num_pages * page_size, Hkv, d)` rows.


# %%
def slot_of(block_table, b, j, page_size):
    ### BEGIN SOLUTION
    return int(block_table[b, j // page_size]) * page_size + j % page_size
    ### END SOLUTION


# %% tags=["check"]
_table = torch.tensor([[7, 2, 5], [0, 3, 1]], dtype=torch.int32)
_pairs = ((0, 0), (0, 5), (1, 11), (1, 4))
check(
    "slot of a token",
    lambda: [slot_of(_table, b, j, 4) for b, j in _pairs],
    [28, 9, 7, 12],
)

# %% [markdown]
# **Exercise 3 (reference counts).** A `PageAllocator(8)` hands out pages for a 3-page prompt; then 4 answers
# are forked from it (each shares the 3 pages); then the original sequence is freed. Return the reference
# counts of the 3 prompt pages and the number of free pages, as `(refs, num_free)`, using the allocator
# (`allocate`, `share`, `release`, `refs`, `num_free`).


# %%
def refcount_story():
    ### BEGIN SOLUTION
    alloc = PageAllocator(8)
    prompt_pages = [alloc.allocate() for _ in range(3)]
    for _ in range(4):
        for p in prompt_pages:
            alloc.share(p)
    for p in prompt_pages:
        alloc.release(p)
    return [alloc.refs[p] for p in prompt_pages], alloc.num_free
    ### END SOLUTION


# %% tags=["check"]
check(
    "reference counts",
    refcount_story,
    ([4, 4, 4], 5),
)

# %% [markdown]
# ## Summary
#
# - Contiguous caches reserved for the maximum length leave most of the reserved memory empty, and even
#   exact reservations fragment as requests come and go. Pages of `page_size` tokens waste at most one
#   partial page per sequence.
# - A paged cache is a pool `(num_pages, page_size, Hkv, d)` per layer, a block table `(B, max_pages)` int32
#   per batch (logical page → physical page) and the lengths. An allocator keeps a free list and reference
#   counts; forked sequences share their prefix's pages, and a shared partial page is copied on first write
#   (the vLLM paper's rule; vLLM v1 shares only full pages, through prefix caching).
# - The paged kernel is the split-KV kernel with one page-id lookup per key; the benchmark record measures
#   what that costs for each page size.
# - Continuous batching admits and retires requests between steps and mixes prefill chunks with decode
#   tokens in one model call; the model sees only `kv.attend`, and the tokens equal plain greedy generation.
