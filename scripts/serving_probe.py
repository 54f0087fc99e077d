"""Where the serving benchmark's time goes (notes/serving.md): two probes on a GPU.

1. The pieces of a cascade step at B = 64 over a 32k prefix (S = 1024): the prefix pass alone against the number
   of query rows (row tiles of `block_m_max` rows each), then the three launches of the full step
   (`serving.cascade.cascade_passes`: the prefix pass and the suffix pass, each writing its splits' partials
   into one buffer, and the one combine of them all), and the whole step with the two passes on one stream
   and on two (`serving.cascade.OVERLAP`).
2. The time to first token of a prompt on the capstone-shaped model of `bench/serving.py`, for prompts of
   several lengths, cached and not: where a prefill step's time goes (a profile of the 4096-token step).

    COURSE_DEVICE=cuda python3 scripts/serving_probe.py
"""

from __future__ import annotations

import time

import torch

from course_lib.bench.serving import HKV, serving_model
from course_lib.decode import paged_decode_attention
from course_lib.perf.timing import graph_ms
from course_lib.serving.prefix_cache import PrefixCachingBatcher

D, HQ, P, PAGE = 128, 32, 32768, 64


def prefix_pass_rows():
    gen = torch.Generator().manual_seed(0)
    pages = P // PAGE
    k = torch.randn(pages, PAGE, HKV, D, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(pages, PAGE, HKV, D, generator=gen).to("cuda", torch.bfloat16)
    table = torch.randperm(pages, generator=gen).to(torch.int32).view(1, -1).cuda()
    lens = torch.full((1,), P, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * P * HKV * D * 2
    for rows in (4, 8, 16, 32, 64):  # query tokens; x Hq / Hkv = 4 rows per K/V head each
        q = torch.randn(1, rows, HQ, D, generator=gen).to("cuda", torch.bfloat16)
        ms = graph_ms(lambda q=q: paged_decode_attention(q, k, v, table, lens, causal=False, validate=False))
        tiles = -(-rows * HQ // HKV // 64)
        print(f"prefix pass, {rows:3d} query tokens ({rows * HQ // HKV} rows per K/V head, {tiles} row tiles): "
              f"{ms * 1e3:7.1f} us, {kv_bytes / (ms * 1e-3) / 1e9:6.0f} GB/s of distinct K/V")  # fmt: skip


def cascade_pieces():
    from course_lib.serving import cascade

    gen = torch.Generator().manual_seed(2)
    b, s = 64, 1024
    pages = (P + b * s) // PAGE
    k = torch.randn(pages, PAGE, HKV, D, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(pages, PAGE, HKV, D, generator=gen).to("cuda", torch.bfloat16)
    perm = torch.randperm(pages, generator=gen).to(torch.int32).cuda()
    prefix_pages, table = perm[: P // PAGE], perm[P // PAGE :].view(b, -1)
    q = torch.randn(b, 1, HQ, D, generator=gen).to("cuda", torch.bfloat16)
    lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    prefix, suffix, merge, _ = cascade.cascade_passes(q, k, v, prefix_pages, P, table, lens, validate=False)

    def step():
        return cascade.cascade_decode_attention(q, k, v, prefix_pages, P, table, lens, validate=False)

    prefix(), suffix()  # the partials the combine reads when timed alone
    for name, fn in (("prefix pass", prefix), ("suffix pass", suffix), ("the one combine", merge)):
        print(f"cascade piece, {name}: {graph_ms(fn) * 1e3:7.1f} us")
    for overlap in (False, True):
        cascade.OVERLAP = overlap
        print(f"cascade step, {'two streams' if overlap else 'one stream '}: {graph_ms(step) * 1e3:7.1f} us")


def ttft_profile():
    model = serving_model(True)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    for n in (256, 1024, 4096):
        prompt = torch.randint(0, vocab, (n,), generator=g).tolist()
        for cached in (False, True):
            times = []
            for _ in range(4):
                b = PrefixCachingBatcher(model, 2 * n // 16 + 8, 16, max_batch=2, max_step_tokens=n + 1)
                if cached:
                    b.submit(prompt[: int(0.9 * n)] + [0] * (n - int(0.9 * n)), 1)
                    b.run()
                b.submit(prompt, 1)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                b.step()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            print(
                f"TTFT prompt {n:5d} {'90 % cached' if cached else 'uncached   '}: {sorted(times)[1] * 1e3:7.2f} ms"
            )
    b = PrefixCachingBatcher(model, 2 * 4096 // 16 + 8, 16, max_batch=2, max_step_tokens=4097)
    b.submit(torch.randint(0, vocab, (4096,), generator=g).tolist(), 1)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        b.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=8, max_name_column_width=60))


if __name__ == "__main__":
    prefix_pass_rows()
    cascade_pieces()
    ttft_profile()
