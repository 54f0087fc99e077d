"""The serving benchmark (notebook 14): cascade attention against paged decoding over a shared prefix, the time
to first token of a cached prompt, and static against continuous batching on the capstone model.

1. Cascade: B sequences share a prefix of P tokens and own S tokens each; one new token each, Hq = 32, Hkv = 8,
   d = 128, bf16. Paged decoding reads B (P + S) tokens of K and V; cascade reads P + B S once and does the same
   FLOPs. Each is timed as a CUDA-graph replay; the bound is max(bytes / read ceiling, FLOPs / matmul rate), both
   measured in the same run. A grid over B and P shows where cascade starts to win.
2. Prefix caching: a prompt whose first 90 % is cached (full pages of an earlier request) against the same
   prompt uncached: time to first token on the wall clock (submit to the step that returns the token, after a
   warm-up; median of repeats), for prompts from 1k to 32k tokens on a capstone-shaped model with random weights
   (the time does not depend on what the weights learnt). Beside each: the GPU's busy time in that step (kernels
   and copies, from torch.profiler), so the share of the wall clock the host takes shows, and the FLOPs ratio
   (what a GPU-bound prefill would gain). The first tokens with and without the cache are compared. At 16k and
   32k, the host's time split by part (`ttft_host`: the prompt's checks, hashing, sharing, the batcher's step,
   the model's launches, inserting). On a GPU the batchers replay the work between a step's attention calls
   from CUDA graphs per token count (cuda_graphs=True, `models.piecewise`: captured in the warm-up run, as a
   server captures its sizes at start; steps over 8192 tokens, the uncached 16k and 32k prompts, run as usual).
3. Batching: one request stream (drawn prompt and output lengths, all waiting at the start) served by the static
   and the continuous batcher at equal KV memory, and continuous with chunked prefill: tokens / s, TTFT and TPOT
   (p50, p90), against the prediction from the step counts (`serving.scheduling.predict_steps`). On a GPU in
   BATCHING_ROUNDS rounds (every scheduler once a round): the gain is the median of the rounds', the runs shown
   are the median round's.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch

from .. import records, runtime
from ..decode import paged_decode_attention
from ..decode.batching import ContinuousBatcher
from ..models.llama import count_parameters
from ..perf.ceilings import measure_matmul_tflops, measure_read_bandwidth
from ..perf.timing import benchmark, describe, graph_ms
from ..serving.cascade import (
    cascade_decode_attention,
    dense_prefix_pass,
    dense_prefix_possible,
    gather_prefix,
    prefix_splits,
)
from ..serving.prefix_cache import PrefixCachingBatcher
from ..serving.scheduling import StaticBatcher, draw_workload, predict_steps, serve_workload
from .report import command_line, record_and_report

HQ, HKV, D, S = 32, 8, 128, 1024
MAIN = (64, 32768)  # the cell: batch 64, a shared prefix of 32k tokens
TARGETS = {"cascade_speedup": 8.0, "cascade_of_bound": 0.85, "ttft_speedup": 5.0, "batching_within": 0.2}
# Time-to-first-token prompts on a GPU. A 4096-token prefill of the capstone-shaped model was host-bound on the
# H200 (4.7 ms of GPU work in 13.8 ms of CPU time, notes/serving.md); its FLOPs, 2 x 90M parameters x tokens
# plus causal attention (`prefill_flops`), grow 8x (matmuls) and 64x (attention) to 32k tokens, about 24 TFLOP.
TTFT_LENGTHS = (1024, 4096, 16384, 32768)


def _pool(B, P, S, page_size, dtype, device, gen):
    """Pages for a P-token prefix then B suffixes of S tokens, randomly placed: (k_pages, v_pages, prefix_pages,
    suffix table, full table (prefix pages then the suffix's))."""
    pp, sp = -(-P // page_size), -(-S // page_size)
    perm = torch.randperm(pp + B * sp, generator=gen)
    shape = (pp + B * sp, page_size, HKV, D)
    k = torch.randn(shape, generator=gen).to(device, dtype)
    v = torch.randn(shape, generator=gen).to(device, dtype)
    prefix = perm[:pp].to(torch.int32)
    own = perm[pp:].view(B, sp).to(torch.int32)
    full = torch.cat([prefix.expand(B, pp), own], dim=1)
    return k, v, prefix.to(device), own.to(device), full.to(device)


def cascade_cell(B, P, read_gbps, tflops, dtype, device, gen, page_size=64) -> dict:
    k, v, prefix, own, full = _pool(B, P, S, page_size, dtype, device, gen)
    q = torch.randn(B, 1, HQ, D, generator=gen).to(device, dtype)
    s_lens = torch.full((B,), S, dtype=torch.int32, device=device)
    f_lens = s_lens + P

    def paged():
        return paged_decode_attention(q, k, v, full, f_lens, validate=False)

    # On a Hopper GPU the prefix gathered once, as the batcher's `CascadeChoice` keeps it for a group's steps
    # (its time, once a group and layer, recorded beside the step's), and the prefix pass on the Gluon forward
    splits = prefix_splits(q, k, P)
    prefix_kv = gather_prefix(k, v, prefix, P, splits) if dense_prefix_possible(k) else None
    dense = prefix_kv is not None and dense_prefix_pass(q, prefix_kv, P) is not None
    gather_ms = benchmark(lambda: gather_prefix(k, v, prefix, P, splits)) if dense else None

    def cascade():
        return cascade_decode_attention(
            q, k, v, prefix, P, own, s_lens, prefix_kv=prefix_kv if dense else None
        )

    err = (cascade().float() - paged().float()).abs().max().item()
    token = 2 * HKV * D * torch.empty((), dtype=dtype).element_size()  # K and V bytes of one token
    paged_bytes, cascade_bytes = B * (P + S) * token, (P + B * S) * token
    flops = 4 * B * HQ * (P + S) * D
    bound_ms = max(cascade_bytes / (read_gbps * 1e9), flops / (tflops * 1e12)) * 1e3
    t_paged = graph_ms(paged) or float("nan")
    t_cascade = graph_ms(cascade) or float("nan")
    return {
        "B": B, "P": P, "S": S,
        "paged_ms": t_paged, "cascade_ms": t_cascade, "speedup": t_paged / t_cascade,
        "bytes_ratio": paged_bytes / cascade_bytes, "bound_ms": bound_ms, "of_bound": bound_ms / t_cascade,
        "paged_read_fraction": paged_bytes / (t_paged * 1e-3) / (read_gbps * 1e9), "max_abs_diff": err,
        "dense_prefix": dense, "gather_ms": gather_ms, "prefix_slices": splits if dense else None,
    }  # fmt: skip


def cascade_crossover(cells: list[dict]) -> dict[int, float | None]:
    """For each batch size B of the cascade grid, the prefix re-reads cascade saves, (B - 1) x P tokens, at which
    it takes the time of paged decoding: log-interpolated between the longest prefix where cascade loses and the
    next, where it wins; None where the grid does not cross. What `serving.cascade.CASCADE_MIN_SAVED_BYTES` is
    read from."""
    crossing = {}
    for B in sorted({c["B"] for c in cells}):
        row = sorted((c for c in cells if c["B"] == B), key=lambda c: c["P"])
        crossing[B] = None
        for lose, win in zip(row, row[1:]):
            if lose["speedup"] < 1 <= win["speedup"]:
                x0, x1 = (B - 1) * lose["P"], (B - 1) * win["P"]
                t = math.log(1 / lose["speedup"]) / math.log(win["speedup"] / lose["speedup"])
                crossing[B] = x0 * (x1 / x0) ** t
                break
    return crossing


def prefill_flops(config, new: int, past: int = 0) -> float:
    """FLOPs of a prefill of `new` tokens after `past` cached ones: 2 x parameters x new (each weight once per
    token, `count_parameters`) plus attention, 4 x Hq x d per (query, visible key) pair and layer (S = QK^T and
    PV), causal: new x past + new (new + 1) / 2 pairs."""
    pairs = new * past + new * (new + 1) / 2
    return 2 * count_parameters(config) * new + 4 * config.n_layers * config.n_heads * config.head_dim * pairs


def gpu_busy(fn) -> tuple[float, int]:
    """(ms the GPU spends in kernels and copies during fn(), how many there are), from torch.profiler."""
    from torch.autograd import DeviceType

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    gpu = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sum(e.device_time_total for e in gpu) / 1e3, len(gpu)


def ttft(model, prompt, cached_fraction: float, repeats: int, warmup: bool = True) -> dict:
    """Time to first token of `prompt` uncached and with its first `cached_fraction` already cached by an earlier
    request (rounded down to full pages), on the wall clock: from `submit` to the return of the step that gives
    the token (synchronised), the request asking for 2 tokens (so retiring it is not timed). Median of `repeats`
    after one untimed run of each (`warmup`: kernels compiled for these shapes, the allocator grown). Then, on a
    GPU, one profiled run of each for the GPU's busy time. Returns the times, speed-up, GPU ms and counts of
    kernels and copies, the FLOPs of each prefill, and whether the first tokens agree in every run; and where
    each first token's time goes (medians): `{kind}_before_step_ms`, the host's time from submit to the model's
    step (the prompt's checks, the lookup, admission, the step's arrays: the GPU has nothing to do yet), and on
    a GPU `{kind}_step_gpu_ms`, the GPU's time from the step's first launch to its last kernel's end (CUDA
    events): its busy time plus the waits for the host's launches (the first layer's, before its attention has
    queued enough work to keep the GPU ahead of the host)."""
    page, vocab = 16, model.config.vocab_size
    pages = -(-(2 * len(prompt) + 2) // page) + 4
    n_cached = int(len(prompt) * cached_fraction) // page * page
    other = prompt[:n_cached] + [(t + 1) % vocab for t in prompt[n_cached:]]

    def ready(kind):
        batcher = PrefixCachingBatcher(
            model, pages, page, max_batch=2, max_step_tokens=len(prompt) + 1, cuda_graphs=runtime.ON_GPU
        )
        if kind == "cached":
            batcher.submit(other, 1)
            batcher.run()
        _sync(model.device)
        return batcher

    def first_token(batcher, marks=None):
        own = model.__dict__.get("forward_step")  # a wrapper set on the instance, if any, is put back
        if marks is not None:  # the model's step's start on the host, and on a GPU its start and end there
            model.forward_step = marked_step(model.forward_step, marks)
        try:
            request = batcher.submit(prompt, 2)
            token = batcher.step()[request]
        finally:
            if marks is not None:
                if own is None:
                    del model.forward_step
                else:
                    model.forward_step = own
        _sync(model.device)
        return token

    times, tokens = {"uncached": [], "cached": []}, set()
    before, step_gpu = {"uncached": [], "cached": []}, {"uncached": [], "cached": []}
    for i in range(repeats + warmup):
        for kind in times:
            batcher, marks = ready(kind), {}
            t0 = time.perf_counter()
            tokens.add(first_token(batcher, marks))
            if i >= warmup:
                times[kind].append(time.perf_counter() - t0)
                before[kind].append(marks["host"] - t0)
                if "start" in marks:
                    step_gpu[kind].append(marks["start"].elapsed_time(marks["end"]))
    busy = dict.fromkeys(times, (None, None))  # the CPU: no GPU time to tell apart
    for kind in times if runtime.ON_GPU else ():
        batcher = ready(kind)
        busy[kind] = gpu_busy(lambda batcher=batcher: tokens.add(first_token(batcher)))
    u, c = statistics.median(times["uncached"]), statistics.median(times["cached"])
    split = {}
    for kind in times:
        split[f"{kind}_before_step_ms"] = 1e3 * statistics.median(before[kind])
        split[f"{kind}_step_gpu_ms"] = statistics.median(step_gpu[kind]) if step_gpu[kind] else None
    flops_u = prefill_flops(model.config, len(prompt))
    flops_c = prefill_flops(model.config, len(prompt) - n_cached, n_cached)
    return {
        "prompt": len(prompt), "cached_tokens": n_cached, "uncached_ms": 1e3 * u, "cached_ms": 1e3 * c,
        "speedup": u / c, "uncached_gpu_ms": busy["uncached"][0], "cached_gpu_ms": busy["cached"][0],
        "uncached_kernels": busy["uncached"][1], "cached_kernels": busy["cached"][1],
        "uncached_tflop": flops_u / 1e12, "cached_tflop": flops_c / 1e12, "flops_ratio": flops_u / flops_c,
        "same_first_token": len(tokens) == 1, **split,
    }  # fmt: skip


def marked_step(forward_step, marks: dict):
    """forward_step, noting in `marks` the host's clock as it starts ("host") and as it returns ("host_end"), and on
    a GPU CUDA events as its work starts and ends there ("start", "end"): their elapsed time is the GPU's time of
    the step, its busy time plus any wait for the host's launches (`ttft`; `scripts/serving_probe.py
    --ttft-timeline`)."""

    def call(token_ids, positions, kv):
        marks["host"] = time.perf_counter()
        gpu = torch.device(token_ids.device).type == "cuda"
        if gpu:
            marks["start"] = torch.cuda.Event(enable_timing=True)
            marks["start"].record()
        out = forward_step(token_ids, positions, kv)
        if gpu:
            marks["end"] = torch.cuda.Event(enable_timing=True)
            marks["end"].record()
        marks["host_end"] = time.perf_counter()
        return out

    return call


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


HOST_PARTS = ("submit", "hash (walk)", "share (start)", "batcher step", "model step", "insert")


def ttft_host(model, prompt, cached_fraction: float, repeats: int, page: int = 16) -> dict:
    """Host time of `ttft`'s two requests (uncached, and with the first `cached_fraction` of `prompt` cached), split
    by part, in ms of this process's CPU time (median of `repeats` after one untimed run of each):

        submit         the prompt's checks (`ContinuousBatcher.submit`)
        hash (walk)    `PrefixCache.walk`: the prompt's full pages hashed and looked up
        share (start)  `PrefixCache.start`: the request started on its cached pages (a reference each)
        batcher step   the rest of `step`: admission, the plan, the slots, token ids and positions, the step's
                       view of the cache, the first token read from the logits
        model step     `model.forward_step` (on a GPU its launches, not their work: the GPU is synchronised after
                       it, untimed)
        insert         `PrefixCache.insert`: the pages the step fills registered (once its model step is
                       launched, before its token is read: on a GPU, while the step computes)

    Each part is timed by a wrapper set on the batcher's instances (the batcher passes `walk`'s answer to `start`,
    so no part runs inside another). On a CPU the model's kernels run inside its step: there replace their
    launches by no-ops (`scripts/serving_probe.py --host`), and its tensors' arithmetic remains. Returns
    {"prompt", "cached_tokens", "uncached": {part: ms}, "cached": {part: ms}} with the total under "total"."""
    pages = -(-(2 * len(prompt) + 2) // page) + 4
    vocab = model.config.vocab_size
    n_cached = int(len(prompt) * cached_fraction) // page * page
    other = prompt[:n_cached] + [(t + 1) % vocab for t in prompt[n_cached:]]
    clock = time.process_time
    gpu = torch.device(model.device).type == "cuda"

    def timed(fn, part, spent, after=None):
        def call(*args, **kwargs):
            t0 = clock()
            out = fn(*args, **kwargs)
            spent[part] += clock() - t0
            if after is not None:
                t1 = clock()
                after()
                spent["untimed"] += clock() - t1
            return out

        return call

    def one(kind) -> dict[str, float]:
        batcher = PrefixCachingBatcher(
            model, pages, page, max_batch=2, max_step_tokens=len(prompt) + 1, cuda_graphs=runtime.ON_GPU
        )
        if kind == "cached":
            batcher.submit(other, 1)
            batcher.run()
        _sync(model.device)
        spent = dict.fromkeys((*HOST_PARTS, "untimed"), 0.0)
        prefix = batcher.prefix
        for name, part in (("walk", "hash (walk)"), ("start", "share (start)"), ("insert", "insert")):
            setattr(prefix, name, timed(getattr(prefix, name), part, spent))
        sync = torch.cuda.synchronize if gpu else None
        model.forward_step = timed(model.forward_step, "model step", spent, sync)
        try:
            t0 = clock()
            batcher.submit(prompt, 2)
            spent["submit"] = clock() - t0
            t0 = clock()
            batcher.step()
            inner = sum(spent[p] for p in ("hash (walk)", "share (start)", "model step", "insert", "untimed"))
            spent["batcher step"] = clock() - t0 - inner
        finally:
            del model.forward_step
        del spent["untimed"]
        spent["total"] = sum(spent.values())
        return {part: 1e3 * s for part, s in spent.items()}

    out = {"prompt": len(prompt), "cached_tokens": n_cached}
    for kind in ("uncached", "cached"):
        one(kind)
        runs = [one(kind) for _ in range(repeats)]
        out[kind] = {part: statistics.median(r[part] for r in runs) for part in runs[0]}
    return out


def batching_workload(n: int, vocab: int, gpu: bool, quick: bool = False):
    """(workload, pages): the batching measurement's request stream (`n` requests, seed 1; prompts of 16-256
    tokens on a GPU, 4-24 on a CPU; 8-128 new tokens, 2-16 when quick) and its KV pages of 16 tokens: a third
    of what every request at once would hold (at least one request's), so the schedulers compete for memory."""
    work = draw_workload(
        n, vocab, prompt_lens=(16, 256) if gpu else (4, 24), new_tokens=(8, 128) if not quick else (2, 16), seed=1
    )  # fmt: skip
    need = [-(-(len(p) + m + 1) // 16) for p, m in zip(work.prompts, work.new_tokens)]
    return work, max(sum(need) // 3, max(need))


# Timed rounds of the batching measurement on a GPU: each round serves the stream with every scheduler, one after
# the other, and the gain is the median of the rounds' continuous / static. The steps are bound by the host, whose
# pace moved between runs (the gain read 0.90x to 2.09x in single runs on an H200); a round's two runs are a few
# seconds apart, so a drift in the host's pace moves both.
BATCHING_ROUNDS = 3


def batching(model, n, max_batch, quick) -> dict:
    vocab = model.config.vocab_size
    work, pages = batching_workload(n, vocab, runtime.ON_GPU, quick)
    schedulers = (
        ("static", StaticBatcher, 4096), ("continuous", ContinuousBatcher, 4096),
        ("continuous, chunked prefill 64", ContinuousBatcher, 64),
    )  # fmt: skip
    for _, cls, step_tokens in schedulers:
        # Warm-up: on a GPU the whole stream once, so that every step shape it meets is compiled before the
        # timed runs (a short warm-up left compilations inside it: continuous / static read 1.18x in one run
        # and 1.42-1.78x in others on an H200); on the CPU a short stream.
        warm = work if runtime.ON_GPU else draw_workload(2, vocab, (4, 8), (2, 2), seed=9)
        serve_workload(cls(model, pages, 16, max_batch=max_batch, max_step_tokens=step_tokens), warm)
    rounds = []
    for _ in range(BATCHING_ROUNDS if runtime.ON_GPU and not quick else 1):
        batchers = {
            name: cls(model, pages, 16, max_batch=max_batch, max_step_tokens=tokens)
            for name, cls, tokens in schedulers
        }
        rounds.append({name: serve_workload(batcher, work).summary() for name, batcher in batchers.items()})
    gains = [r["continuous"]["tokens/s"] / r["static"]["tokens/s"] for r in rounds]
    median_round = rounds[sorted(range(len(rounds)), key=gains.__getitem__)[len(rounds) // 2]]
    static_steps, continuous_steps = predict_steps(work.new_tokens, max_batch)
    return {"requests": n, "max_batch": max_batch, "pages": pages, "runs": median_round,
            "predicted_gain": static_steps / continuous_steps, "measured_gain": statistics.median(gains),
            "gains_by_round": gains}  # fmt: skip


def serving_model(gpu: bool):
    """The capstone-shaped Llama the serving benchmark measures (random weights): 8 layers of width 1024 (90M
    parameters) on a GPU in bf16, with positions for a 32k-token prompt and its new tokens; a tiny one on the
    CPU. Notebook 14 and scripts/serving_probe.py use it too."""
    from ..models.llama import Llama, LlamaConfig

    if gpu:
        positions = max(TTFT_LENGTHS) + 1024
        config = LlamaConfig(
            dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, hidden_dim=2816, max_seq_len=positions
        )
    else:
        config = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, max_seq_len=256)
    torch.manual_seed(0)
    # On a GPU the course's kernels (fused RMSNorm and RoPE: about half the launches of a step, whose host time
    # is most of a cached prompt's time to first token); on the CPU PyTorch's (the interpreter would be slow).
    model = Llama(config, "course_lib" if gpu else "sdpa")
    return model.to(runtime.DEVICE, torch.bfloat16 if gpu else torch.float32).eval()


def run(quick: bool = False) -> dict:
    gpu = runtime.ON_GPU
    device = runtime.DEVICE
    dtype = torch.bfloat16 if gpu else torch.float32
    gen = torch.Generator().manual_seed(0)
    read_gbps = measure_read_bandwidth(dtype=torch.bfloat16 if gpu else torch.float32)
    tflops = measure_matmul_tflops(dtype=dtype)
    data = {
        "config": {"hq": HQ, "hkv": HKV, "d": D, "suffix": S, "dtype": str(dtype).replace("torch.", "")},
        "ceilings": {"read_gbps": read_gbps, "matmul_tflops": tflops},
        "timer": describe(),
        "targets": TARGETS,
    }
    if gpu:
        grid = (
            [MAIN]
            if quick
            else [MAIN] + [(b, p) for b in (4, 16, 64) for p in (1024, 4096, 16384) if (b, p) != MAIN]
        )
    else:
        grid = [(2, 64)]
    data["cascade"] = []
    for B, P in grid:
        row = cascade_cell(B, P, read_gbps, tflops, dtype, device, gen, page_size=64 if gpu else 16)
        data["cascade"].append(row)
        print(
            f"serving: cascade B={B} P={P}: {row['speedup']:.2f}x paged, {row['of_bound']:.0%} of its bound"
        )
    data["cascade_crossover"] = cascade_crossover(data["cascade"])
    model = serving_model(gpu)
    g = torch.Generator().manual_seed(2)
    data["ttft"] = []
    for n in TTFT_LENGTHS if gpu else (96,):  # the CPU: one short prompt, a smoke test of the path
        prompt = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
        row = ttft(model, prompt, 0.9, 7 if gpu else 1, warmup=gpu)  # 7: the host's pace varies between runs
        data["ttft"].append(row)
        print(f"serving: TTFT of {n} tokens, 90 % cached: {row['speedup']:.2f}x faster")
        if gpu and n >= 16384:  # where the host's share decides the speed-up: its parts (`ttft_host`)
            data.setdefault("ttft_host", []).append(ttft_host(model, prompt, 0.9, 3))
    data["batching"] = batching(model, 32 if gpu else 4, 8 if gpu else 2, quick or not gpu)
    b = data["batching"]
    print(f"serving: continuous / static {b['measured_gain']:.2f}x (predicted {b['predicted_gain']:.2f}x)")
    return data


def save_plots(data: dict, out: Path, slug: str) -> list[Path]:
    return []


def format_table(data: dict) -> str:
    lines = [
        f"read ceiling {data['ceilings']['read_gbps']:.0f} GB/s, "
        f"matmul {data['ceilings']['matmul_tflops']:.0f} TFLOP/s",
        "| B | prefix | paged us | cascade us | speed-up | bytes ratio | cascade / bound | prefix pass (gather us) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in data["cascade"]:
        gather = r.get("gather_ms")
        slices = f", {r['prefix_slices']} slices" if r.get("prefix_slices") else ""
        how = (
            f"Gluon{slices} ({gather * 1e3:.0f})" if r.get("dense_prefix") and gather is not None else "paged"
        )
        lines.append(
            f"| {r['B']} | {r['P']} | {r['paged_ms'] * 1e3:.1f} | {r['cascade_ms'] * 1e3:.1f} | {r['speedup']:.2f}x "
            f"| {r['bytes_ratio']:.1f}x | {r['of_bound']:.0%} | {how} |"
        )
    crossing = {B: x for B, x in data.get("cascade_crossover", {}).items() if x is not None}
    if crossing:
        lines.append(
            "cascade = paged at (B - 1) x P = "
            + ", ".join(f"{x / 1e3:.0f}k tokens (B = {B})" for B, x in crossing.items())
        )
    lines += [
        "| prompt | cached | uncached ms (GPU busy) | cached ms (GPU busy) | speed-up | FLOPs ratio | same token |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for t in data["ttft"]:

        def busy(kind, t=t):
            gpu = t[f"{kind}_gpu_ms"]
            return f"{t[f'{kind}_ms']:.2f}" + ("" if gpu is None else f" ({gpu:.2f})")

        lines.append(
            f"| {t['prompt']} | {t['cached_tokens']} | {busy('uncached')} | {busy('cached')} | {t['speedup']:.2f}x "
            f"| {t['flops_ratio']:.1f}x | {'yes' if t['same_first_token'] else 'NO'} |"
        )
    for t in data["ttft"]:
        if t.get("cached_step_gpu_ms") is not None:
            lines.append(
                f"{t['prompt']} tokens, ms: host before the model's step {t['uncached_before_step_ms']:.2f} / "
                f"{t['cached_before_step_ms']:.2f}, the step on the GPU {t['uncached_step_gpu_ms']:.2f} / "
                f"{t['cached_step_gpu_ms']:.2f} (uncached / cached)"
            )
    hosts = data.get("ttft_host", [])
    if hosts:
        lines.append("host ms by part | " + " | ".join(f"{h['prompt']} uncached / cached" for h in hosts))
        for part in (*HOST_PARTS, "total"):
            cells = " | ".join(f"{h['uncached'][part]:.2f} / {h['cached'][part]:.2f}" for h in hosts)
            lines.append(f"  {part} | {cells}")
    b = data["batching"]
    for name, r in b["runs"].items():
        lines.append(
            f"{name}: {r['tokens/s']:.0f} tokens/s, TTFT p50/p90 {r['TTFT p50 ms']:.1f}/{r['TTFT p90 ms']:.1f} ms, "
            f"TPOT p50/p90 {r['TPOT p50 ms']:.2f}/{r['TPOT p90 ms']:.2f} ms, {r['steps']} steps"
        )
    rounds = ", ".join(f"{g:.2f}x" for g in b.get("gains_by_round", ()))
    lines.append(
        f"continuous / static: measured {b['measured_gain']:.2f}x (rounds: {rounds}), "
        f"predicted {b['predicted_gain']:.2f}x"
    )
    return "\n".join(lines)


def target_misses(data: dict) -> list[str]:
    misses = []
    main = next((r for r in data["cascade"] if (r["B"], r["P"]) == MAIN), None)
    if main is not None:
        if main["speedup"] < TARGETS["cascade_speedup"]:
            misses.append(f"cascade at B=64, 32k: {main['speedup']:.2f}x paged (target >= 8x)")
        if main["of_bound"] < TARGETS["cascade_of_bound"]:
            misses.append(f"cascade at B=64, 32k: {main['of_bound']:.0%} of its bound (target >= 85 %)")
    longest = max(data["ttft"], key=lambda t: t["prompt"])  # the prompt whose prefill is most GPU-bound
    if longest["speedup"] < TARGETS["ttft_speedup"]:
        misses.append(
            f"TTFT of {longest['prompt']} tokens, 90 % cached: {longest['speedup']:.2f}x (target >= 5x)"
        )
    if not all(t["same_first_token"] for t in data["ttft"]):
        misses.append("TTFT: the first token with the cache differs from the one without it")
    b = data["batching"]
    if not math.isclose(b["measured_gain"], b["predicted_gain"], rel_tol=TARGETS["batching_within"]):
        misses.append(
            f"continuous / static {b['measured_gain']:.2f}x against a prediction of {b['predicted_gain']:.2f}x "
            "(target within 20 %)"
        )
    return misses


def main(quick: bool = False, out: str | Path = records.ASSETS) -> int:
    """Measure (`run`), save the record "serving" in `out`, print the table. Returns 0."""
    return record_and_report("serving", run, save_plots, format_table, target_misses, quick, out)


if __name__ == "__main__":
    raise SystemExit(command_line(main, __doc__))
