"""The serving benchmark (notebook 14): cascade attention against paged decoding over a shared prefix, the time
to first token of a cached prompt, and static against continuous batching on the capstone model.

1. Cascade: B sequences share a prefix of P tokens and own S tokens each; one new token each, Hq = 32, Hkv = 8,
   d = 128, bf16. Paged decoding reads B (P + S) tokens of K and V; cascade reads P + B S once and does the same
   FLOPs. Each is timed as a CUDA-graph replay; the bound is max(bytes / read ceiling, FLOPs / matmul rate), both
   measured in the same run. A grid over B and P shows where cascade starts to win.
2. Prefix caching: a prompt whose first 90 % is cached (full pages of an earlier request) against the same
   prompt uncached: time to first token (the prefill step), median of repeats, on a capstone-shaped model with
   random weights (the time does not depend on what the weights learnt).
3. Batching: one request stream (drawn prompt and output lengths, all waiting at the start) served by the static
   and the continuous batcher at equal KV memory, and continuous with chunked prefill: tokens / s, TTFT and TPOT
   (p50, p90), against the prediction from the step counts (`serving.scheduling.predict_steps`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch

from .. import records, runtime
from ..decode import paged_decode_attention
from ..decode.batching import ContinuousBatcher
from ..perf.ceilings import measure_matmul_tflops, measure_read_bandwidth
from ..perf.timing import describe, graph_ms
from ..serving.cascade import cascade_decode_attention
from ..serving.prefix_cache import PrefixCachingBatcher
from ..serving.scheduling import StaticBatcher, draw_workload, predict_steps, serve_workload
from .report import record_and_report

HQ, HKV, D, S = 32, 8, 128, 1024
MAIN = (64, 32768)  # the cell: batch 64, a shared prefix of 32k tokens
TARGETS = {"cascade_speedup": 8.0, "cascade_of_bound": 0.85, "ttft_speedup": 5.0, "batching_within": 0.2}


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

    def cascade():
        return cascade_decode_attention(q, k, v, prefix, P, own, s_lens)

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
    }  # fmt: skip


def ttft(model, prompt, cached_fraction: float, repeats: int) -> dict:
    """Median time to first token of `prompt` uncached and with its first `cached_fraction` already cached by an
    earlier request (rounded down to full pages)."""
    page = 16
    pages = -(-(2 * len(prompt) + 2) // page) + 4
    n_cached = int(len(prompt) * cached_fraction) // page * page
    other = prompt[:n_cached] + [(t + 1) % model.config.vocab_size for t in prompt[n_cached:]]
    times = {"uncached": [], "cached": []}
    for _ in range(repeats):
        for kind in times:
            batcher = PrefixCachingBatcher(model, pages, page, max_batch=2, max_step_tokens=len(prompt) + 1)
            if kind == "cached":
                batcher.submit(other, 1)
                batcher.run()
            batcher.submit(prompt, 1)
            _sync(model.device)
            t0 = time.perf_counter()
            batcher.step()
            _sync(model.device)
            times[kind].append(time.perf_counter() - t0)
    u, c = statistics.median(times["uncached"]), statistics.median(times["cached"])
    return {"prompt": len(prompt), "cached_tokens": n_cached, "uncached_ms": 1e3 * u, "cached_ms": 1e3 * c,
            "speedup": u / c}  # fmt: skip


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def batching(model, n, max_batch, quick) -> dict:
    vocab = model.config.vocab_size
    work = draw_workload(
        n,
        vocab,
        prompt_lens=(16, 256) if runtime.ON_GPU else (4, 24),
        new_tokens=(8, 128) if not quick else (2, 16),
        seed=1,
    )
    pages = sum(-(-(len(p) + m + 1) // 16) for p, m in zip(work.prompts, work.new_tokens))
    pages = max(pages // 3, max(-(-(len(p) + m + 1) // 16) for p, m in zip(work.prompts, work.new_tokens)))
    runs = {}
    for name, cls, step_tokens in (
        ("static", StaticBatcher, 4096), ("continuous", ContinuousBatcher, 4096),
        ("continuous, chunked prefill 64", ContinuousBatcher, 64),
    ):  # fmt: skip
        batcher = cls(model, pages, 16, max_batch=max_batch, max_step_tokens=step_tokens)
        serve_workload(batcher, draw_workload(2, vocab, (4, 8), (2, 2), seed=9))  # warm-up: compile, caches
        batcher = cls(model, pages, 16, max_batch=max_batch, max_step_tokens=step_tokens)
        runs[name] = serve_workload(batcher, work).summary()
    static_steps, continuous_steps = predict_steps(work.new_tokens, max_batch)
    predicted = static_steps / continuous_steps
    measured = runs["continuous"]["tokens/s"] / runs["static"]["tokens/s"]
    return {"requests": n, "max_batch": max_batch, "pages": pages, "runs": runs,
            "predicted_gain": predicted, "measured_gain": measured}  # fmt: skip


def serving_model(gpu: bool):
    """The capstone-shaped Llama the serving benchmark measures (random weights): 8 layers of width 1024 on a
    GPU in bf16, a tiny one on the CPU. Notebook 14 and scripts/serving_probe.py use it too."""
    from ..models.llama import Llama, LlamaConfig

    if gpu:
        config = LlamaConfig(
            dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, hidden_dim=2816, max_seq_len=8192
        )
    else:
        config = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, max_seq_len=256)
    torch.manual_seed(0)
    model = Llama(config).to(runtime.DEVICE, torch.bfloat16 if gpu else torch.float32).eval()
    return model


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
    model = serving_model(gpu)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, model.config.vocab_size, (4096 if gpu else 96,), generator=g).tolist()
    data["ttft"] = ttft(model, prompt, 0.9, 5 if gpu else 1)
    print(f"serving: TTFT 90 % cached: {data['ttft']['speedup']:.2f}x faster")
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
        "| B | prefix | paged us | cascade us | speed-up | bytes ratio | cascade / bound |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in data["cascade"]:
        lines.append(
            f"| {r['B']} | {r['P']} | {r['paged_ms'] * 1e3:.1f} | {r['cascade_ms'] * 1e3:.1f} | {r['speedup']:.2f}x "
            f"| {r['bytes_ratio']:.1f}x | {r['of_bound']:.0%} |"
        )
    t = data["ttft"]
    lines.append(
        f"TTFT, {t['prompt']} tokens: uncached {t['uncached_ms']:.2f} ms, {t['cached_tokens']} cached "
        f"{t['cached_ms']:.2f} ms: {t['speedup']:.2f}x"
    )
    b = data["batching"]
    for name, r in b["runs"].items():
        lines.append(
            f"{name}: {r['tokens/s']:.0f} tokens/s, TTFT p50/p90 {r['TTFT p50 ms']:.1f}/{r['TTFT p90 ms']:.1f} ms, "
            f"TPOT p50/p90 {r['TPOT p50 ms']:.2f}/{r['TPOT p90 ms']:.2f} ms, {r['steps']} steps"
        )
    lines.append(
        f"continuous / static: measured {b['measured_gain']:.2f}x, predicted {b['predicted_gain']:.2f}x"
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
    if data["ttft"]["speedup"] < TARGETS["ttft_speedup"]:
        misses.append(f"TTFT 90 % cached: {data['ttft']['speedup']:.2f}x (target >= 5x)")
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(records.ASSETS))
    args = parser.parse_args()
    raise SystemExit(main(args.quick, args.out))
