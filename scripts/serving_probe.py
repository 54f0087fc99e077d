"""Where the serving benchmark's time goes (notes/serving.md): two probes on a GPU.

1. The pieces of a cascade step at B = 64 over a 32k prefix (S = 1024): the prefix pass alone against the number
   of query rows (row tiles of `block_m_max` rows each), then the three launches of the full step
   (`serving.cascade.cascade_passes`: the prefix pass and the suffix pass, each writing its splits' partials
   into one buffer, and the one combine of them all), and the whole step with the two passes on one stream
   and on two (`serving.cascade.OVERLAP`).
2. The time to first token of a prompt on the capstone-shaped model of `bench/serving.py`, for prompts of
   several lengths, cached and not: where a prefill step's time goes (a profile of the 4096-token step).

    COURSE_DEVICE=cuda python3 scripts/serving_probe.py

With --host, on a CPU instead: the host time of the same two first tokens (`bench.serving.ttft_host`: the prompt's
checks, hashing, sharing pages, the batcher's step, the model's step, inserting) for prompts of 16k and 32k tokens
(and of 160, where the model's step is its Python alone), 90 % cached and not, pages of 16 tokens as the
benchmark's. The model is the capstone's 8 layers at a tiny width (d = 16, one head), so that what remains of its
step is its Python and its launches' setup: the Triton launches are no-ops (`host_time.no_launch`) and no value is
read that a GPU step leaves unread (lengths, page ids, slots).

    COURSE_DEVICE=cpu python3 scripts/serving_probe.py --host [--repeats 5] [--lengths 160 16384 32768]

With --step, on a CPU too: one serving step of the same 8-layer model (the bench's TTFT prefill of a 16k prompt, 90 %
cached and not, and a decode step of 8 sequences) under `course_lib.perf.syncs.watch`: where a GPU run of it would
wait for the GPU (values read, sizes set by values, blocking copies to the GPU), its copies to the GPU, its PyTorch
and Triton launches, in the whole step and in the model's step (`forward_step`), then its CPU time with the
launches as no-ops, median of --repeats (the decode step: of as many consecutive steps). --dtype bfloat16 counts the
launches a bf16 model makes (its dtype casts); --backend course_lib the fused RMSNorm and RoPE kernels.

    COURSE_DEVICE=cpu python3 scripts/serving_probe.py --step [--lengths 16384] [--backend sdpa] [--sites]

With --batching: the benchmark's batching stream (32 requests, at most 8 running, a third of their pages) through
the static and the continuous batcher, each step timed: steps, tokens/s, and each scheduler's decode-only steps
(median CPU ms, median wall ms, mean sequences a step) against the prediction from step counts. On a GPU the
bench's model (the timed run after a warm-up on the whole stream, as the bench's); on a CPU the 8 layers at width
16 with the launches as no-ops (the host's time alone). Where static's steps cost more than continuous ones, the
two clocks say whether the host or the GPU is the cause.

    COURSE_DEVICE=cpu python3 scripts/serving_probe.py --batching

With --prefill: one attention layer of a prefill step of the bench's model (16 query / 4 K/V heads, d = 64, bf16,
pages of 16, scattered), each prompt cached or not: the paged kernel against the dense route
(`decode.paged_kv.PagedKV.prefill_plan`: K/V gathered, the FlashAttention-2 forward), each timed with
`perf.timing.benchmark`, in TFLOP/s; on a CPU the two checked against each other at tiny sizes.

    COURSE_DEVICE=cuda python3 scripts/serving_probe.py --prefill

With --dense-prefix: the cascade step of probe 1 with its prefix gathered once and the prefix pass on the
warp-specialised forward (`serving.cascade.dense_prefix_pass`), by the number of slices of the prefix, at B = 64
and 128, 16k and 32k prefixes (the table in `serving.cascade.prefix_splits`).

    COURSE_DEVICE=cuda python3 scripts/serving_probe.py --dense-prefix
    COURSE_DEVICE=cuda python3 scripts/serving_probe.py --dense-prefix-one-consumer   # B = 64, 32k: the prefix pass
                                                           # on one-consumer variants (two programs an SM)
    COURSE_DEVICE=cuda python3 scripts/serving_probe.py --suffix-sms   # the suffix pass with n SMs held by a blocker

With --prefill-split: the cached prefill's attention (3280 x 32k, 1648 x 16k) with its keys cut in two, the halves on
two streams and merged, against one call. With --ttft-cprofile: a cached 32k first token on the bench's model,
its wall time, then where its host time goes (Python's profiler, PyTorch's profiler on the CPU side).

    COURSE_DEVICE=cuda python3 scripts/serving_probe.py --prefill-split
    COURSE_DEVICE=cuda python3 scripts/serving_probe.py --prefill-tiles   # ... by each of the forward's launches
    COURSE_DEVICE=cuda python3 scripts/serving_probe.py --ttft-cprofile
    COURSE_DEVICE=cuda python3 scripts/serving_probe.py --ttft-syncs    # the host's waits for the GPU in it
    COURSE_DEVICE=cuda python3 scripts/serving_probe.py --ttft-timeline   # host and GPU on one clock
    COURSE_DEVICE=cuda python3 scripts/serving_probe.py --ttft-host-calls   # host us a call, GPU idle or busy
    COURSE_DEVICE=cuda python3 scripts/serving_probe.py --prefill-variants   # the prefill on each Gluon variant
    COURSE_DEVICE=cuda python3 scripts/serving_probe.py --prefill-key-splits   # its keys split in 1-8 runs
    COURSE_DEVICE=cuda python3 scripts/serving_probe.py --ttft-split-ab   # first tokens with the split and without
    COURSE_DEVICE=cuda python3 scripts/serving_probe.py --prefill-split-host   # the host's time of its calls
    COURSE_DEVICE=cuda python3 scripts/serving_probe.py --layer-host   # host us a call of a layer's operations

With --prefix-gap: the ladder of `prefix_gap.py`, from the split kernel alone on the prefix (the probe of
`decode.heuristics.MANY_ROWS`, 93.8 us) to the cascade's prefix pass (121.2 us), one difference a rung, each a
graph replay; --quick at tiny sizes (on a CPU: the rungs run and are checked, not timed).

    COURSE_DEVICE=cuda python3 scripts/serving_probe.py --prefix-gap [--passes 3]
    COURSE_DEVICE=cpu python3 scripts/serving_probe.py --prefix-gap --quick
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time

import numpy as np
import torch

from course_lib.bench.serving import HKV, HOST_PARTS, marked_step, serving_model, ttft_host
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


def cascade_step_args(b: int = 64, p: int = P):
    """The cascade step both probes time: (q, k_pages, v_pages, prefix_pages, P, block_table, suffix_lens) of
    B = 64 sequences (or b) sharing a P-token prefix (or p), S = 1024 of their own, pages scattered."""
    gen = torch.Generator().manual_seed(2)
    s = 1024
    pages = (p + b * s) // PAGE
    k = torch.randn(pages, PAGE, HKV, D, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(pages, PAGE, HKV, D, generator=gen).to("cuda", torch.bfloat16)
    perm = torch.randperm(pages, generator=gen).to(torch.int32).cuda()
    prefix_pages, table = perm[: p // PAGE], perm[p // PAGE :].view(b, -1)
    q = torch.randn(b, 1, HQ, D, generator=gen).to("cuda", torch.bfloat16)
    lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    return q, k, v, prefix_pages, p, table, lens


def cascade_pieces():
    from course_lib.serving import cascade

    q, k, v, prefix_pages, _, table, lens = cascade_step_args()
    prefix, suffix, merge, _ = cascade.cascade_passes(q, k, v, prefix_pages, P, table, lens, validate=False)

    def step():
        return cascade.cascade_decode_attention(q, k, v, prefix_pages, P, table, lens, validate=False)

    prefix(), suffix()  # the partials the combine reads when timed alone
    for name, fn in (("prefix pass", prefix), ("suffix pass", suffix), ("the one combine", merge)):
        print(f"cascade piece, {name}: {graph_ms(fn) * 1e3:7.1f} us")
    for overlap in (False, True):
        cascade.OVERLAP = overlap
        print(f"cascade step, {'two streams' if overlap else 'one stream '}: {graph_ms(step) * 1e3:7.1f} us")


def suffix_sms(blocked=(0, 16, 32, 48, 56, 64, 72, 80, 96, 112), reps: int = 7) -> None:
    """--suffix-sms: the cascade step's suffix pass (B = 64, S = 1024 of their own, 32 / 8 heads, d = 128) timed while
    a blocker holds n SMs: the Gluon forward, one program an SM (64k keys of one K/V head that every program shares,
    so it reads next to nothing from HBM), launched first on a side stream, then a spin, then the suffix pass on the
    rest of the GPU (CUDA events, median of `reps`). Where the step's two passes share the GPU, the suffix pass gets
    what the prefix pass leaves: how its time grows as its SMs fall (its programs come in waves)."""
    from course_lib.attention import hopper
    from course_lib.serving import cascade

    args = cascade_step_args()
    _, suffix, _, _ = cascade.cascade_passes(*args, validate=False)
    suffix()
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()
    suffix_bytes = 2 * args[0].shape[0] * 1024 * HKV * D * 2
    for n in blocked:
        if n:
            qb = torch.randn(1, n, 128, D, device="cuda", dtype=torch.bfloat16)
            kb = torch.randn(1, 1, 262144, D, device="cuda", dtype=torch.bfloat16)
            ob, lb = torch.empty_like(qb), torch.empty(1, n, 128, device="cuda")
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            if n:  # about 3.5 ms a program: longer than the spin and the suffix pass together
                with torch.cuda.stream(side):
                    hopper.forward(qb, kb, kb, ob, lb, False, D**-0.5, hopper.D128_LONG)
            torch.cuda._sleep(
                2_000_000
            )  # the blocker takes its SMs; the suffix pass is queued behind the spin
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(main)
            suffix()
            end.record(main)
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        us = sorted(times)[reps // 2]
        print(
            f"blocker on {n:3d} SMs: suffix pass {us:6.1f} us on {132 - n} SMs, {suffix_bytes / us / 1e6:5.2f} TB/s, "
            f"{suffix_bytes / us / 1e3 / (132 - n):5.1f} GB/s an SM",
            flush=True,
        )


def dense_prefix(splits_tried=(2, 4, 8, 16), cells=((64, P), (64, P // 2), (128, P), (128, P // 2))):
    """--dense-prefix: the cascade step of `cascade_pieces` with its prefix gathered once (`gather_prefix`) and the
    prefix pass on the warp-specialised forward (`dense_prefix_pass`), by the slices of the prefix: the pass alone,
    the step on one stream and two, and the step's largest difference from the paged prefix pass's; at B = 64 and
    128 sequences, 32k and 16k prefixes."""
    for b, p in cells:
        print(f"B = {b}, P = {p}:")
        _dense_prefix(cascade_step_args(b, p), splits_tried)


def dense_prefix_one_consumer(variants=((64, 3), (64, 2), (128, 2)), splits_tried=(4, 8)):
    """--dense-prefix-one-consumer: `--dense-prefix` at B = 64, 32k, with the prefix pass on one-consumer variants of
    the Gluon forward (64 query rows a program, half an SM's registers and at most half its shared memory:
    `hopper.Variant.programs_per_sm`), so that a suffix program can share an SM with a prefix program; variants as
    (keys a block, stages), one program per tile."""
    from course_lib.attention import hopper

    chosen = hopper.choose
    try:
        for block_n, stages in variants:
            variant = hopper.Variant(block_n, stages, 1, False, False)
            hopper.choose = lambda *a, variant=variant, **k: variant
            print(f"one consumer, {block_n}-key blocks, {stages} stages:")
            _dense_prefix(cascade_step_args(64, P), splits_tried)
    finally:
        hopper.choose = chosen


def _dense_prefix(args, splits_tried):
    from course_lib.perf.timing import benchmark
    from course_lib.serving import cascade

    q, k, v, prefix_pages, p = args[:5]
    gather_ms = benchmark(lambda: cascade.gather_prefix(k, v, prefix_pages, p))
    print(f"gather_prefix (once a group): {gather_ms * 1e3:.1f} us")
    want = cascade.cascade_decode_attention(*args, validate=False).float()
    paged_ms = graph_ms(lambda: cascade.cascade_decode_attention(*args, validate=False))
    print(f"paged prefix pass step, two streams: {paged_ms * 1e3:.1f} us")
    for splits in splits_tried:
        prefix_kv = cascade.gather_prefix(k, v, prefix_pages, p, splits)
        if cascade.dense_prefix_pass(q, prefix_kv, p) is None:
            continue
        prefix, suffix, merge, out = cascade.cascade_passes(*args, validate=False, prefix_kv=prefix_kv)
        prefix(), suffix(), merge()
        err = (out.float() - want).abs().max().item()
        line = [f"splits {splits:2d}: prefix pass {graph_ms(prefix) * 1e3:6.1f} us"]
        for overlap in (False, True):
            cascade.OVERLAP = overlap

            def step(prefix_kv=prefix_kv):
                return cascade.cascade_decode_attention(*args, validate=False, prefix_kv=prefix_kv)

            line.append(f"step {'two streams' if overlap else 'one stream'} {graph_ms(step) * 1e3:6.1f} us")
        print(", ".join(line) + f", max diff from the paged pass {err:.1e}")
    cascade.OVERLAP = True  # as it was


def _prefill_inputs(n: int, length: int, g: torch.Generator) -> tuple:
    """The cached prefill's attention inputs on the bench's model (16 query / 4 K/V heads, d = 64, bf16): q (1, 16,
    n, d) and k, v (1, 4, length, d) strided as the dense prefill route reads them, and its FLOPs (bottom-right
    causal: the n queries are the last of `length`)."""
    hq, hkv, d = 16, 4, 64
    q = torch.randn(n, hq, d, generator=g).to("cuda", torch.bfloat16).transpose(0, 1).unsqueeze(0)
    kv = torch.randn(2, length, hkv, d, generator=g).to("cuda", torch.bfloat16)
    k, v = (t.transpose(0, 1).unsqueeze(0) for t in kv)
    return q, k, v, 4 * hq * d * (n * (length - n) + n * (n + 1) / 2)


def _paged_prefill_inputs(n: int, length: int, hq: int, hkv: int, d: int, g: torch.Generator) -> tuple:
    """A cached prefill's attention inputs as a serving step holds them (bf16): q (n, hq, d) token-major, K and V
    pools of pages of 16 tokens (hkv heads) with the sequence's `length` tokens on scattered pages (`pages`, int32),
    and its FLOPs (bottom-right causal: the n queries are the last of `length`)."""
    n_pages = -(-length // 16)
    k_pool, v_pool = (
        torch.randn(n_pages + 8, 16, hkv, d, generator=g).to("cuda", torch.bfloat16) for _ in range(2)
    )
    pages = torch.randperm(n_pages + 8, generator=g)[:n_pages].to("cuda", torch.int32)
    q = torch.randn(n, hq, d, generator=g).to("cuda", torch.bfloat16)
    return q, k_pool, v_pool, pages, 4 * hq * d * (n * (length - n) + n * (n + 1) / 2)


def prefill_tiles(cells=((3280, 32768), (1648, 16384), (416, 4096))):
    """--prefill-tiles: the cached prefill's attention (16 query / 4 K/V heads, d = 64, bf16, K/V strided as the
    dense route reads them, bottom-right causal) with each launch of the forward's candidates (`configs.FORWARD`)
    against the default choice: whether smaller tiles fill the last wave of 416 programs better."""
    from course_lib.attention import attention_forward
    from course_lib.attention.configs import FORWARD, AttentionLaunch
    from course_lib.attention.forward import forward
    from course_lib.perf.timing import benchmark

    g = torch.Generator().manual_seed(5)
    for n, length in cells:
        q, k, v, flops = _prefill_inputs(n, length, g)
        want = attention_forward(q, k, v, causal="bottom_right")[0]
        base = benchmark(lambda q=q, k=k, v=v: attention_forward(q, k, v, causal="bottom_right"))
        print(f"{n} x {length}: default {base:.3f} ms ({flops / base / 1e9:.0f} TFLOP/s)", flush=True)
        for c in FORWARD.candidates + (AttentionLaunch(64, 128, 4, 3), AttentionLaunch(64, 32, 4, 4)):
            config = dict(
                BLOCK_M=c.block_m, BLOCK_N=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages
            )
            try:
                got = forward(q, k, v, causal="bottom_right", config=config)[0]
                t = benchmark(
                    lambda q=q, k=k, v=v, config=config: forward(q, k, v, "bottom_right", config=config)
                )
                err = (got.float() - want.float()).abs().max().item()
                print(f"  {config}: {t:.3f} ms ({base / t:.2f}x the default), max diff {err:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001 (a launch that does not fit is a line)
                print(f"  {config}: {type(e).__name__}: {str(e)[:120]}", flush=True)


def prefill_key_splits(
    cells=((3280, 32768), (1648, 16384)), heads=((16, 4, 64), (32, 8, 128)), profile=(1, 3)
):
    """--prefill-key-splits: a cached prefill's attention as a serving step runs it, K/V in pages of 16 (scattered),
    bf16: the dense route (K/V gathered token-major, the forward through strides, O made token-major for the output
    projection) against `decode.prefill_split` with its keys in 1 ... 8 runs (K/V gathered head-major, the
    warp-specialised forward, the combine writing token-major), each timed eagerly (`perf.timing.benchmark`: the
    host's launches included) and as a CUDA-graph replay (`graph_ms`: the GPU's work alone); `hopper.key_splits`'
    pick, and stream-K (`hopper.stream_work`: the route's own choice where it applies); then the GPU's time by
    kernel (PyTorch's profiler, 5 calls) of the dense route, of `profile`'s runs and of stream-K.
    Heads: (query heads, K/V heads, d): the bench's model, and 32 / 8 at d = 128."""
    from course_lib.attention import flash_attention, hopper
    from course_lib.decode.paged_kv import gather_tokens
    from course_lib.decode.prefill_split import split_prefill
    from course_lib.perf.timing import benchmark
    from course_lib.runtime import sm_count

    g = torch.Generator().manual_seed(6)
    for hq, hkv, d in heads:
        for n, length in cells:
            q, k_pool, v_pool, pages, flops = _paged_prefill_inputs(n, length, hq, hkv, d, g)

            def dense(q=q, k_pool=k_pool, v_pool=v_pool, pages=pages, n=n, length=length):
                k, v = (
                    gather_tokens(p, pages, length).unsqueeze(0).transpose(1, 2) for p in (k_pool, v_pool)
                )
                o = flash_attention(q.unsqueeze(0).transpose(1, 2), k, v, causal="bottom_right")
                return o[0].transpose(0, 1).reshape(n, -1)  # the output projection's input

            def split(splits, q=q, k_pool=k_pool, v_pool=v_pool, pages=pages, length=length):
                return split_prefill(q, k_pool, v_pool, pages, length, splits=splits)

            want = dense()
            t0, g0 = benchmark(dense), graph_ms(dense)
            variant = hopper.choose(d, True, n, length, length - n)
            pick = hopper.key_splits(variant, hq, n, length, True, length - n, sm_count(0))
            print(f"{hq}/{hkv} heads, d = {d}, {n} x {length}: dense route {t0:.3f} ms eager, {g0:.3f} graph "
                  f"({flops / g0 / 1e9:.0f} TFLOP/s); {variant}, key_splits picks {pick}", flush=True)  # fmt: skip
            for splits in range(1, 9):
                got = split(splits)
                err = (got.reshape(n, -1).float() - want.float()).abs().max().item()
                t, gt = (
                    benchmark(lambda splits=splits: split(splits)),
                    graph_ms(lambda splits=splits: split(splits)),
                )
                print(f"  {splits} runs: {t:.3f} ms eager ({t0 / t:.2f}x), {gt:.3f} graph ({g0 / gt:.2f}x, "
                      f"{flops / gt / 1e9:.0f} TFLOP/s), max diff {err:.1e}", flush=True)  # fmt: skip
            got = split(None)  # the route's own pick: stream-K where `hopper.stream_work` applies
            err = (got.reshape(n, -1).float() - want.float()).abs().max().item()
            t, gt = benchmark(lambda: split(None)), graph_ms(lambda: split(None))
            print(f"  stream-K: {t:.3f} ms eager ({t0 / t:.2f}x), {gt:.3f} graph ({g0 / gt:.2f}x, "
                  f"{flops / gt / 1e9:.0f} TFLOP/s), max diff {err:.1e}", flush=True)  # fmt: skip
            runs = [(f"{s} runs", lambda s=s: split(s)) for s in profile] + [
                ("stream-K", lambda: split(None))
            ]
            for name, fn in [("dense", dense)] + runs:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        fn()
                    torch.cuda.synchronize()
                kernels = sorted(
                    (
                        (e.key, e.device_time_total / 5e3)
                        for e in prof.key_averages()
                        if e.device_time_total > 0
                    ),
                    key=lambda kv: -kv[1],
                )
                print(f"    {name}: " + "; ".join(f"{k[:40]} {ms:.3f}" for k, ms in kernels[:6]), flush=True)


def prefill_variants(cells=((3280, 32768), (1648, 16384)), hq: int = 16, hkv: int = 4, d: int = 64) -> None:
    """--prefill-variants: the bench model's cached prefill attention (`decode.prefill_split`, K/V in scattered pages
    of 16, bf16) on each of the Gluon forward's variants at this head dim, its keys in 1 ... 6 runs: graph replays,
    TFLOP/s over the visible (query, key) pairs; the variant `hopper.choose` gives and `key_splits`' pick."""
    from course_lib.attention import hopper
    from course_lib.decode import prefill_split as ps
    from course_lib.runtime import sm_count

    g = torch.Generator().manual_seed(6)
    real = ps._choice
    try:
        for n, length in cells:
            q, k_pool, v_pool, pages, flops = _paged_prefill_inputs(n, length, hq, hkv, d, g)
            want = ps.split_prefill(q, k_pool, v_pool, pages, length, splits=1).float()
            print(
                f"{hq}/{hkv} heads, d = {d}, {n} x {length}: {hopper.choose(d, True, n, length, length - n)!s}"
            )
            for variant in hopper.VARIANTS[d]:
                ps._choice = lambda *a, variant=variant: (variant, 1)
                ps.PLANS.clear()
                pick = hopper.key_splits(variant, hq, n, length, True, length - n, sm_count(0))
                cells_ms = []
                for splits in range(1, 7):
                    fn = functools.partial(ps.split_prefill, q, k_pool, v_pool, pages, length, splits=splits)
                    err = (fn().float() - want).abs().max().item()
                    ms = graph_ms(fn)
                    cells_ms.append(f"{splits}: {ms:.3f} ms {flops / ms / 1e9:.0f} ({err:.0e})")
                print(f"  {variant} (picks {pick}): " + "; ".join(cells_ms), flush=True)
    finally:
        ps._choice = real
        ps.PLANS.clear()


def prefill_split(cells=((3280, 32768), (1648, 16384)), cuts=(0.25, 0.5, 0.75, 0.9)):
    """--prefill-split: the cached prefill's attention (16 query / 4 K/V heads, d = 64, bf16, K/V strided as the
    dense route reads them) with its keys cut in two, the keys before the cut (no mask) on a second stream beside
    the rest (bottom-right causal), the two (O, L) merged: so that one call's programs fill the other's last wave.
    Against the one call of the dense route; eager calls (`benchmark`) and graph replays."""
    from course_lib.attention import attention_forward
    from course_lib.perf.timing import benchmark

    g = torch.Generator().manual_seed(5)
    side = torch.cuda.Stream()
    for n, length in cells:
        q, k, v, flops = _prefill_inputs(n, length, g)

        def whole(q=q, k=k, v=v):
            return attention_forward(q, k, v, causal="bottom_right")[0]

        def split(cut, q=q, k=k, v=v):
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                o_a, l_a = attention_forward(q, k[:, :, :cut], v[:, :, :cut], causal=False)
            o_b, l_b = attention_forward(q, k[:, :, cut:], v[:, :, cut:], causal="bottom_right")
            main.wait_stream(side)
            lse = torch.logaddexp(l_a, l_b)
            return (o_a * (l_a - lse).exp().unsqueeze(-1) + o_b * (l_b - lse).exp().unsqueeze(-1)).to(q.dtype)

        want = whole().float()
        t_whole = (benchmark(whole), graph_ms(whole))
        print(f"{n} x {length}: one call {t_whole[0]:.3f} ms eager ({flops / t_whole[0] / 1e9:.0f} TFLOP/s), "
              f"{t_whole[1]:.3f} graph", flush=True)  # fmt: skip
        for frac in cuts:
            cut = int(length * frac) // 128 * 128
            if cut >= length - n:
                continue
            err = (split(cut).float() - want).abs().max().item()
            t = (benchmark(lambda cut=cut: split(cut)), graph_ms(lambda cut=cut: split(cut)))
            print(f"  cut at {cut}: {t[0]:.3f} ms eager ({t_whole[0] / t[0]:.2f}x), {t[1]:.3f} graph "
                  f"({t_whole[1] / t[1]:.2f}x), max diff {err:.1e}", flush=True)  # fmt: skip


def _cached_prompt(n: int, cached_fraction: float, graphs: bool = True):
    """An n-token prompt for the bench's model, `ready()`: a fresh batcher that has served another prompt sharing
    its first `cached_fraction` (whole pages), so that the prompt's first token starts on cached pages, and
    `first(batcher)`: the prompt submitted and its first token computed (the GPU waited for). graphs: the
    batchers' `cuda_graphs`, as the bench's (False: every layer's calls launched from Python)."""
    model = serving_model(True)
    vocab, page = model.config.vocab_size, 16
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (n,), generator=g).tolist()
    n_cached = int(n * cached_fraction) // page * page
    other = prompt[:n_cached] + [(t + 1) % vocab for t in prompt[n_cached:]]

    def ready():
        b = PrefixCachingBatcher(
            model, -(-(2 * n + 2) // page) + 4, page, max_batch=2, max_step_tokens=n + 1, cuda_graphs=graphs
        )
        b.submit(other, 1)
        b.run()
        torch.cuda.synchronize()
        return b

    def first(b):
        request = b.submit(prompt, 2)
        token = b.step()[request]
        torch.cuda.synchronize()
        return token

    return prompt, ready, first


def ttft_cprofile(n: int = 32768, cached_fraction: float = 0.9) -> None:
    """--ttft-cprofile: where the host's time goes in the bench's first token of an n-token prompt, 90 % cached, on
    the bench's model (`bench.serving.serving_model`): wall ms of five runs, then Python's profiler over one (the
    functions with the most time of their own) and PyTorch's profiler over another (CPU time by operator and
    CUDA call: launches, allocations, copies, waits)."""
    import cProfile
    import pstats

    _, ready, first = _cached_prompt(n, cached_fraction)
    walls = []
    for _ in range(6):
        b = ready()
        t0 = time.perf_counter()
        first(b)
        walls.append((time.perf_counter() - t0) * 1e3)
    print("first token, wall ms:", " ".join(f"{w:.2f}" for w in walls), flush=True)
    b = ready()
    host_stats = getattr(torch.cuda, "host_memory_stats", dict)  # PyTorch >= 2.7
    before, host_before = torch.cuda.memory_stats(), host_stats()
    first(b)
    after, host_after = torch.cuda.memory_stats(), host_stats()
    counts = {
        k: after[k] - before.get(k, 0) for k in after if k.startswith("num_") and after[k] != before.get(k, 0)
    }
    counts |= {
        "host " + k: host_after[k] - host_before.get(k, 0)
        for k in host_after
        if k.startswith("num_") and host_after[k] != host_before.get(k, 0)
    }
    print("the caching allocators' counters over one first token (changed ones):", counts or "none")
    b = ready()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as tprof:
        t0 = time.perf_counter()
        first(b)
        wall = (time.perf_counter() - t0) * 1e3
    print(f"PyTorch's profiler, CPU side and CUDA calls, one first token ({wall:.2f} ms with the profiler):")
    print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=50))
    print("aten::empty and the allocator's CUDA calls by input shape:")
    rows = [
        e for e in tprof.key_averages(group_by_input_shape=True)
        if e.key in ("aten::empty", "aten::empty_strided", "cudaMalloc", "cudaFree", "cudaHostAlloc")
    ]  # fmt: skip
    for e in sorted(rows, key=lambda e: -e.self_cpu_time_total)[:20]:
        print(f"  {e.key:20s} {e.count:4d} calls {e.self_cpu_time_total / 1e3:7.3f} ms  {e.input_shapes}")
    b = ready()
    prof = cProfile.Profile()
    prof.enable()
    first(b)
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)


def ttft_timeline(n: int = 32768, cached_fraction: float = 0.9, runs: int = 5) -> None:
    """--ttft-timeline: where the bench's cached first token of an n-token prompt waits. Without a profiler (median
    of `runs`): the host's ms before the model's step (submit, lookup, admission, the step's arrays), the step's
    launches, and after them; CUDA events at the step's start and end give the GPU's elapsed time of the step
    (its busy time plus any idle gap where the host fell behind). Then PyTorch's profiler over one (its own
    overhead slows the host): the GPU's idle gaps between its first and last work and its time by kernel."""
    import statistics

    from torch.autograd import DeviceType

    _, ready, first = _cached_prompt(n, cached_fraction)
    for _ in range(2):
        first(ready())
    rows = []
    for _ in range(runs):
        b = ready()
        model, marks = b.model, {}
        model.forward_step = marked_step(model.forward_step, marks)
        try:
            t0 = time.perf_counter()
            first(b)
            t1 = time.perf_counter()
        finally:
            del model.forward_step
        rows.append(
            (
                1e3 * (marks["host"] - t0), 1e3 * (marks["host_end"] - marks["host"]),
                marks["start"].elapsed_time(marks["end"]), 1e3 * (t1 - marks["host_end"]), 1e3 * (t1 - t0),
            )
        )  # fmt: skip
    pre, launch, gpu_step, after, wall = (statistics.median(c) for c in zip(*rows))
    marks_host, marks_gpu = _layer_marks(ready, first)
    print(
        f"cached first token, {n} tokens (median of {runs}): wall {wall:.2f} ms = host before the model's step "
        f"{pre:.2f} + the step's launches {launch:.2f} + after them {after:.2f}; the GPU's time of the step "
        f"(events) {gpu_step:.2f}"
    )
    print("  by layer, ms after the step's first launch: the host reaching a point, the GPU reaching it")
    for name in marks_host:
        print(f"    {name:28s} host {marks_host[name]:6.2f}  GPU {marks_gpu[name]:6.2f}")
    b = ready()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        first(b)
    gpu = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    gpu.sort(key=lambda e: e.time_range.start)
    busy = sum(e.time_range.end - e.time_range.start for e in gpu)
    gaps, end = [], gpu[0].time_range.end
    for prev, e in zip(gpu, gpu[1:]):
        if e.time_range.start > end:
            gaps.append((e.time_range.start - end, prev.name, e.name))
        end = max(end, e.time_range.end)
    print(
        f"  under the profiler: GPU busy {busy / 1e3:.2f} ms, idle {sum(g for g, *_ in gaps) / 1e3:.2f} ms in "
        f"{len(gaps)} gaps between its first and last work"
    )
    small = [g for g, *_ in gaps if g < 10]
    print(f"    gaps under 10 us: {len(small)}, {sum(small) / 1e3:.2f} ms in all; the longest:")
    for g, a, c in sorted(gaps, reverse=True)[:12]:
        print(f"    {g:7.1f} us after {a[:45]!r} before {c[:45]!r}")
    by_name = {}
    for e in gpu:
        k = e.name[:60]
        c, t = by_name.get(k, (0, 0.0))
        by_name[k] = (c + 1, t + e.time_range.end - e.time_range.start)
    print("  GPU time by kernel:")
    for k, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"    {t / 1e3:7.3f} ms {c:4d}x {k}")


def _layer_marks(ready, first) -> tuple[dict, dict]:
    """One cached first token with a mark (host clock and CUDA event) where the model's step starts, where each
    layer's attention (`PagedKV.attend`) starts and returns, and where the step returns: ({mark: host ms}, {mark:
    GPU ms}), both from the step's start. Where the GPU reaches a mark as soon as the host does, the GPU had been
    waiting. Marks at the attention calls, outside the model's graphs (`models.piecewise`), so they are taken
    whether the rest of the step is replayed or launched."""
    from course_lib.decode.paged_kv import PagedKV

    b = ready()
    model, marks, attend, step = b.model, [], PagedKV.attend, b.model.forward_step

    def mark(name):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((name, time.perf_counter(), event))

    def marked_attend(kv, layer, q, k, v):
        mark(f"layer {layer} attention")
        o = attend(kv, layer, q, k, v)
        mark(f"layer {layer} after attention")
        return o

    def marked_forward_step(*args):
        mark("step start")
        out = step(*args)
        mark("step end")
        return out

    PagedKV.attend, model.forward_step = marked_attend, marked_forward_step
    try:
        first(b)
    finally:
        PagedKV.attend = attend
        del model.forward_step
    _, h0, e0 = marks[0]
    return (
        {name: 1e3 * (h - h0) for name, h, _ in marks},
        {name: e0.elapsed_time(e) for name, _, e in marks},
    )


def _gpu_cycles_per_ms() -> float:
    """`torch.cuda._sleep`'s cycles per millisecond on this GPU, timed once with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def _call_timer(spent: dict):
    """timer(name, fn): fn wrapped so that each call appends its microseconds to spent[name] (a defaultdict(list))."""

    def timer(name, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[name].append(1e6 * (time.perf_counter() - t0))
            return out

        return call

    return timer


def ttft_host_calls(n: int = 32768, cached_fraction: float = 0.9, runs: int = 5, busy_ms=(0, 30)) -> None:
    """--ttft-host-calls: the host's microseconds in each call a cached first token's model step makes, layer 0
    (while the GPU waits for it: the step's first launches) against the mean of layers 1-7 (median of `runs`
    first tokens). Each function is wrapped with a timer for the run; nested ones count inside their callers.
    Once for each of `busy_ms`: the GPU first given that many ms of a spin (`torch.cuda._sleep`), so that with 30
    it is busy through the whole step's launches: whether layer 0's calls cost more because the GPU is idle.
    Without the bench's piecewise graphs, so that every call is made from Python."""
    for busy in busy_ms:
        _ttft_host_calls(n, cached_fraction, runs, busy)


def _ttft_host_calls(n: int, cached_fraction: float, runs: int, busy_ms: float) -> None:
    import statistics
    from collections import defaultdict

    import course_lib.models.llama as llama
    from course_lib.decode import paged_kv
    from course_lib.decode.cache import PagedKVCache

    _, ready, first = _cached_prompt(n, cached_fraction, graphs=False)
    for _ in range(2):
        first(ready())
    cycles = _gpu_cycles_per_ms() if busy_ms else 0.0
    per_run = []
    for _ in range(runs):
        b = ready()
        model, spent = b.model, defaultdict(list)
        timer = _call_timer(spent)

        saved = {
            "write": (PagedKVCache, "write", PagedKVCache.write),
            "attend": (paged_kv.PagedKV, "attend", paged_kv.PagedKV.attend),
            "split_prefill": (paged_kv, "split_prefill", paged_kv.split_prefill),
            "kernels": (llama, "_course_lib_kernels", llama._course_lib_kernels),
        }
        flash, rms, rope, rope_, swiglu = llama._course_lib_kernels()
        wrapped = (
            flash,
            timer("rms_norm", rms),
            timer("rope", rope),
            timer("rope_", rope_),
            timer("swiglu", swiglu),
        )
        for name, (owner, attr, fn) in saved.items():
            setattr(owner, attr, (lambda w=wrapped: w) if name == "kernels" else timer(name, fn))
        for lay in model.layers:
            for name, target in (
                ("wq", lay.attention.wq),
                ("wo", lay.attention.wo),
                ("mlp", lay.feed_forward),
            ):
                target.forward = timer(name, target.forward)
        try:
            if busy_ms:
                torch.cuda._sleep(int(busy_ms * cycles))
            first(b)
        finally:
            for owner, attr, fn in saved.values():
                setattr(owner, attr, fn)
            for lay in model.layers:
                for target in (lay.attention.wq, lay.attention.wo, lay.feed_forward):
                    del target.forward
        per_run.append(
            {k: (v[0], statistics.mean(v[1:]) if len(v) > 1 else 0.0, len(v)) for k, v in spent.items()}
        )
    print(
        f"cached first token, {n} tokens, the GPU first given {busy_ms} ms of work: host us per call, layer 0 / mean "
        f"of the others (median of {runs})"
    )
    for name in per_run[0]:
        first_us = statistics.median(r[name][0] for r in per_run)
        rest_us = statistics.median(r[name][1] for r in per_run)
        print(f"  {name:14s} {first_us:8.1f} / {rest_us:8.1f}   ({per_run[0][name][2]} calls)")


def layer_host(t: int = 3280, rounds: int = 5, calls: int = 200) -> None:
    """--layer-host: the host's microseconds a call of each operation a layer of the bench's model makes in a cached
    32k first token's step (t new tokens, width 1024, 16 / 4 heads, d = 64, bf16), the GPU kept busy by a spin
    (`torch.cuda._sleep`) so that no call waits for it: `calls` calls in a row, best of `rounds`. The matmuls also
    with cuBLASLt preferred (`torch.backends.cuda.preferred_blas_library`), and against a transposed copy of
    the weight (torch.mm), the norms and RoPE against PyTorch's."""
    import torch.nn.functional as F

    from course_lib.fused import rms_norm, rope
    from course_lib.models.llama import rope_torch

    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(t, 1024, device=dev, dtype=bf)
    w_norm = torch.ones(1024, device=dev, dtype=bf)
    weights = {
        "qkv": torch.randn(1536, 1024, device=dev, dtype=bf), "wo": torch.randn(1024, 1024, device=dev, dtype=bf),
        "w1w3": torch.randn(5632, 1024, device=dev, dtype=bf), "w2": torch.randn(1024, 2816, device=dev, dtype=bf),
    }  # fmt: skip
    h = torch.randn(t, 2816, device=dev, dtype=bf)
    qkv = F.linear(x, weights["qkv"])
    q, k, _ = qkv.split((1024, 256, 256), dim=-1)
    q, k = q.view(t, 16, 64).transpose(0, 1), k.view(t, 4, 64).transpose(0, 1)
    cos, sin = torch.randn(t, 64, device=dev, dtype=bf), torch.randn(t, 64, device=dev, dtype=bf)
    cycles = _gpu_cycles_per_ms()
    ops = {
        "x + x": lambda: x + x,
        "F.silu(h)": lambda: F.silu(h),
        "h * h": lambda: h * h,
        "torch.empty_like(x)": lambda: torch.empty_like(x),
        "course_lib rms_norm": lambda: rms_norm(x, w_norm, 1e-5),
        "F.rms_norm": lambda: F.rms_norm(x, (1024,), w_norm, 1e-5),
        "course_lib rope": lambda: rope(q, k, cos, sin),
        "rope_torch": lambda: rope_torch(q, k, cos, sin),
    }
    for name, w in weights.items():
        inp = h if name == "w2" else x
        wt = w.t().contiguous()
        ops[f"F.linear {name}"] = lambda inp=inp, w=w: F.linear(inp, w)
        ops[f"torch.mm {name} (weight transposed once)"] = lambda inp=inp, wt=wt: torch.mm(inp, wt)
    libraries = ["default"]
    if hasattr(torch.backends.cuda, "preferred_blas_library"):
        libraries += ["cublaslt", "cublas"]
    before = torch.backends.cuda.preferred_blas_library() if len(libraries) > 1 else None
    try:
        for lib in libraries:
            if lib != "default":
                torch.backends.cuda.preferred_blas_library(lib)
            for name, op in ops.items():
                if lib != "default" and "linear" not in name and "mm" not in name:
                    continue
                for _ in range(3):
                    op()
                best = float("inf")
                for _ in range(rounds):
                    torch.cuda.synchronize()
                    torch.cuda._sleep(int(60 * cycles))
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        op()
                    best = min(best, (time.perf_counter() - t0) / calls * 1e6)
                print(f"  {lib:9s} {name:44s} {best:7.1f} us", flush=True)
    finally:
        if before is not None:
            torch.backends.cuda.preferred_blas_library(before)
    torch.cuda.synchronize()


def prefill_split_host(n: int = 416, length: int = 4096, calls: int = 300) -> None:
    """--prefill-split-host: the host's time of one call of the dense prefill route and of `decode.prefill_split`
    (1 and 2 runs) on the bench's model's heads (16 / 4, d = 64, bf16), a shape where the GPU's work is shorter
    than the host's: wall us a call over `calls` calls, then Python's profiler over the 2-run calls."""
    from course_lib.attention import flash_attention
    from course_lib.decode.paged_kv import gather_tokens
    from course_lib.decode.prefill_split import split_prefill
    from course_lib.perf.profiling import print_host_profile

    g = torch.Generator().manual_seed(7)
    q, k_pool, v_pool, pages, _ = _paged_prefill_inputs(n, length, 16, 4, 64, g)

    def dense():
        k, v = (gather_tokens(p, pages, length).unsqueeze(0).transpose(1, 2) for p in (k_pool, v_pool))
        o = flash_attention(q.unsqueeze(0).transpose(1, 2), k, v, causal="bottom_right")
        return o[0].transpose(0, 1).reshape(n, -1)

    runs = {
        "dense route": dense,
        "split, 1 run": lambda: split_prefill(q, k_pool, v_pool, pages, length, splits=1),
        "split, 2 runs": lambda: split_prefill(q, k_pool, v_pool, pages, length, splits=2),
    }
    for name, fn in runs.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        print(
            f"{name}: {(time.perf_counter() - t0) / calls * 1e6:.1f} us a call (wall, {n} x {length})",
            flush=True,
        )
    print_host_profile(
        runs["split, 2 runs"], calls, f"\ncProfile of {calls} calls of the split route, 2 runs:", 18
    )


def ttft_split_ab(lengths=(16384, 32768), cached_fraction: float = 0.9, rounds: int = 8) -> None:
    """--ttft-split-ab: the bench's first token of a prompt 90 % cached, with the prefill's attention on
    `decode.prefill_split` where it applies and with the dense route alone, taken in turn in one process (the host's
    pace drifts between runs): median wall ms of `rounds` each after one of each, and the GPU's busy ms of one."""
    import statistics

    from course_lib.bench.serving import gpu_busy
    from course_lib.decode import paged_kv

    real = paged_kv.split_prefill
    for n in lengths:
        _, ready, first = _cached_prompt(n, cached_fraction)
        walls, busy = {"split": [], "dense": []}, {}
        try:
            for i in range(rounds + 1):
                for name in walls:
                    paged_kv.split_prefill = real if name == "split" else (lambda *a, **k: None)
                    b = ready()
                    t0 = time.perf_counter()
                    first(b)
                    if i:
                        walls[name].append((time.perf_counter() - t0) * 1e3)
            for name in walls:
                paged_kv.split_prefill = real if name == "split" else (lambda *a, **k: None)
                b = ready()
                busy[name] = gpu_busy(lambda b=b, first=first: first(b))[0]
        finally:
            paged_kv.split_prefill = real
        print(
            f"{n}-token prompt, 90 % cached, first token: "
            + "; ".join(
                f"{name} {statistics.median(w):.2f} ms wall ({min(w):.2f}-{max(w):.2f}), GPU busy {busy[name]:.2f}"
                for name, w in walls.items()
            ),
            flush=True,
        )


def ttft_syncs(n: int = 32768, cached_fraction: float = 0.9) -> None:
    """--ttft-syncs: every operation that makes the host wait for the GPU during a cached first token (PyTorch's
    sync debug mode), each with where it was called from, and the step's wall time (sync debug mode on), three
    times."""
    import traceback
    import warnings

    prompt, ready, _ = _cached_prompt(n, cached_fraction)
    for attempt in range(3):
        b = ready()
        request = b.submit(prompt, 2)
        seen = []
        original = warnings.showwarning

        def keep(message, category, filename, lineno, file=None, line=None, seen=seen):
            stack = [
                f
                for f in traceback.extract_stack()[:-1]
                if "course_lib" in f.filename or "scripts" in f.filename
            ]
            where = " < ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in stack[::-1][:5])
            seen.append((str(message)[:60], where))

        with warnings.catch_warnings():
            warnings.simplefilter("always")  # every sync, not the first at each line
            warnings.showwarning = keep
            torch.cuda.set_sync_debug_mode("warn")
            t0 = time.perf_counter()
            try:
                b.step()[request]
            finally:
                torch.cuda.set_sync_debug_mode("default")
                warnings.showwarning = original
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
        print(f"first token {attempt}: {wall:.2f} ms (sync debug mode on), {len(seen)} syncs:")
        for message, where in seen:
            print("   ", message, "|", where)


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


@contextlib.contextmanager
def slots_unread():
    """Within the block, `PagedKVCache.write` reads no slots (a GPU step's slots are on the GPU: never read)."""
    from course_lib.decode.cache import PagedKVCache

    saved = PagedKVCache.check_slots
    PagedKVCache.check_slots = lambda self, slots: None
    try:
        yield
    finally:
        PagedKVCache.check_slots = saved


def host_model(positions: int):
    """The capstone's 8 layers at a tiny width (d = 16, one head, vocab 256): its step's arithmetic is small."""
    from course_lib.models.llama import Llama, LlamaConfig

    config = LlamaConfig(dim=16, n_layers=8, n_heads=1, n_kv_heads=1, hidden_dim=16, max_seq_len=positions)
    torch.manual_seed(0)
    return Llama(config).eval()


def ttft_layer0_cpu(n: int = 32768, runs: int = 7) -> None:
    """--ttft-layer0-cpu: is layer 0 of a cached first token's step slower on the host than the later layers without
    any GPU? On the CPU (`host_model`, launches no-ops), host us of the first RMSNorm, cache write and attention
    call against the mean of the later layers (median of `runs` - 1), three ways: the step once, as the batcher
    runs it; the step run twice at once, the second timed (the Python and data warm); and twice with 64 MB touched
    between (the CPU's caches evicted). (`wo`, a real CPU matmul on the no-op kernels' unwritten outputs, is left
    out: its time follows what memory it reads.)"""
    import statistics
    from collections import defaultdict

    from host_time import no_launch, values_unread

    from course_lib.decode import paged_kv
    from course_lib.decode.cache import PagedKVCache

    torch.set_num_threads(1)
    model = host_model(n + 64)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
    for mode in ("once", "twice", "twice, 64 MB between"):
        rows = []
        with no_launch(), values_unread(), slots_unread(), torch.no_grad():
            for run in range(runs):
                b = _first_token_batcher(model, prompt, cached=True)
                spent = defaultdict(list)
                timer = _call_timer(spent)

                saved = [(PagedKVCache, "write"), (paged_kv.PagedKV, "attend")]
                originals = [getattr(owner, attr) for owner, attr in saved]
                for (owner, attr), fn in zip(saved, originals):
                    setattr(owner, attr, timer(attr, fn))
                for lay in model.layers:
                    lay.attention_norm.forward = timer("rms_norm", lay.attention_norm.forward)
                step = model.forward_step

                def twice(*args, step=step, spent=spent, mode=mode, **kwargs):
                    step(*args, **kwargs)
                    if "64 MB" in mode:
                        torch.ones(16 * 2**20).add_(1.0)
                    spent.clear()
                    return step(*args, **kwargs)

                if mode != "once":
                    model.forward_step = twice
                try:
                    b.step()
                finally:
                    if mode != "once":
                        del model.forward_step
                    for (owner, attr), fn in zip(saved, originals):
                        setattr(owner, attr, fn)
                    for lay in model.layers:
                        del lay.attention_norm.forward
                if run:
                    rows.append({k: (v[0], statistics.mean(v[1:])) for k, v in spent.items()})
        cells = ", ".join(
            f"{k} {statistics.median(r[k][0] for r in rows):.0f} / {statistics.median(r[k][1] for r in rows):.0f}"
            for k in rows[0]
        )
        print(f"{mode}: host us, layer 0 / later layers: {cells}")


def ttft_host_table(lengths, repeats: int) -> None:
    from host_time import no_launch, values_unread

    torch.set_num_threads(1)
    model = host_model(max(lengths) + 64)
    g = torch.Generator().manual_seed(1)
    rows = []
    with no_launch(), values_unread(), slots_unread():
        for n in lengths:
            prompt = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
            rows.append(ttft_host(model, prompt, 0.9, repeats))
    print(
        f"host time of a first token, ms of CPU time (median of {repeats}), pages of 16 tokens, 90 % cached:"
    )
    names = [f"{r['prompt'] // 1024}k" if r["prompt"] % 1024 == 0 else str(r["prompt"]) for r in rows]
    print("| part | " + " | ".join(f"{n} uncached | {n} cached" for n in names) + " |")
    print("| --- |" + " --- | --- |" * len(rows))
    for part in (*HOST_PARTS, "total"):
        cells = " | ".join(f"{r['uncached'][part]:.2f} | {r['cached'][part]:.2f}" for r in rows)
        print(f"| {part} | {cells} |")
    print(
        "(the model step holds the tiny model's arithmetic over the step's tokens too; 160 tokens: its Python)"
    )


def _first_token_batcher(model, prompt, cached: bool, page: int = 16):
    """`bench.serving.ttft`'s batcher, the prompt submitted: cached, an earlier request left its first 90 % cached."""
    n = len(prompt)
    n_cached = int(n * 0.9) // page * page
    gpu = torch.device(model.device).type == "cuda"  # graphs as the bench's batchers replay them
    b = PrefixCachingBatcher(
        model, -(-(2 * n + 2) // page) + 4, page, max_batch=2, max_step_tokens=n + 1, cuda_graphs=gpu
    )
    if cached:
        b.submit(prompt[:n_cached] + [(t + 1) % model.config.vocab_size for t in prompt[n_cached:]], 1)
        b.run()
    b.submit(prompt, 2)
    return b


def _decode_batcher(model, batch: int, gen):
    """A ContinuousBatcher whose `batch` requests (prompts of 200-270 tokens) are all decoding."""
    from course_lib.decode.batching import ContinuousBatcher

    b = ContinuousBatcher(model, batch * 24, 16, max_batch=batch, max_step_tokens=4096)
    for i in range(batch):
        b.submit(torch.randint(0, model.config.vocab_size, (200 + 10 * i,), generator=gen).tolist(), 100)
    while any(r.num_tokens - r.computed > 1 for r in b.running + b.waiting):
        b.step()
    return b


def _timed_step(batcher) -> tuple[float, float]:
    """(CPU ms of `batcher.step()`, of the model's step within it)."""
    model, spent = batcher.model, [0.0]
    forward = model.forward_step

    def timed(*args):
        t0 = time.process_time()
        out = forward(*args)
        spent[0] += time.process_time() - t0
        return out

    model.forward_step = timed
    try:
        t0 = time.process_time()
        batcher.step()
        return 1e3 * (time.process_time() - t0), 1e3 * spent[0]
    finally:
        del model.forward_step


def step_table(lengths, batch: int, repeats: int, backend: str, dtype: str, sites: bool) -> None:
    """The --step table (module docstring)."""
    import statistics

    from host_time import no_launch

    from course_lib.perf.syncs import on_gpu_branches, watch

    torch.set_num_threads(1)
    model = host_model(max(*lengths, 400) + 64).to(getattr(torch, dtype))  # the decode step: 370 positions
    model.backend = backend
    gen = torch.Generator().manual_seed(1)
    cases = {}
    for n in lengths:
        prompt = torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()
        for cached in (False, True):
            cases[f"prefill {n} {'90 % cached' if cached else 'uncached'}"] = (
                lambda prompt=prompt, cached=cached: _first_token_batcher(model, prompt, cached),
                1,
            )
    cases[f"decode B = {batch}"] = (lambda: _decode_batcher(model, batch, gen), repeats)
    print(
        f"one serving step, {model.config.n_layers} layers of width {model.config.dim}, {dtype}, backend {backend}: "
        "syncs and launches a GPU run would make (step / within the model's step), CPU ms with no-op launches "
        f"(median of {repeats})"
    )
    print(
        "| step | syncs | copies to the GPU | PyTorch launches | Triton launches | CPU ms step | CPU ms model |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with no_launch(), on_gpu_branches(), slots_unread():
        for name, (make, steps) in cases.items():
            batcher = make()
            if steps == 1:  # a first step of this shape before (plans kept, as after the bench's warm-up)
                batcher.step()
                batcher = make()
            with watch(depth=10, launches=False) as seen:
                batcher.step()
            inner = seen.within("forward_step")
            times = []
            for _ in range(repeats if steps == 1 else 1):
                b = make() if steps == 1 else batcher
                times += [_timed_step(b) for _ in range(steps)]
            step_ms = statistics.median(t[0] for t in times)
            model_ms = statistics.median(t[1] for t in times)
            print(
                f"| {name} | {seen.num_syncs} / {inner.num_syncs} | {seen.num_copies} / {inner.num_copies} "
                f"| {seen.num_ops} / {inner.num_ops} | {seen.num_kernels} | {step_ms:.2f} | {model_ms:.2f} |"
            )
            if sites:
                print(seen.table(top=40))


def prefill_table() -> None:
    """The --prefill table (module docstring)."""
    from course_lib import runtime
    from course_lib.decode.cache import PagedKVCache
    from course_lib.decode.paged_kv import PagedKV
    from course_lib.perf.timing import benchmark

    gpu = runtime.ON_GPU
    hq, hkv, d, page = (16, 4, 64, 16) if gpu else (4, 2, 16, 4)
    dtype = torch.bfloat16 if gpu else torch.float32
    cells = [(n, n) for n in (256, 512, 1024, 4096, 16384, 32768)] + [
        (128, 1024),
        (416, 4096),
        (1648, 16384),
        (3280, 32768),
    ]
    cells = cells if gpu else [(8, 8), (12, 40)]
    g = torch.Generator().manual_seed(4)
    print(f"prefill attention, one layer: {hq} / {hkv} heads, d = {d}, pages of {page}; ms (TFLOP/s)")
    print("| new tokens | keys | paged kernel | dense route | paged / dense |")
    print("| --- | --- | --- | --- | --- |")
    for n, length in cells:
        pages = -(-length // page) + 1
        cache = PagedKVCache(1, pages + 1, page, hkv, d, dtype, runtime.DEVICE)
        cache.add_sequence(0)
        slots = cache.append(0, length)
        perm = torch.randperm(pages + 1, generator=g)
        cache.k_pages[0].copy_(torch.randn(cache.k_pages[0].shape, generator=g).to(cache.k_pages[0])[perm])
        cache.v_pages[0].copy_(torch.randn(cache.v_pages[0].shape, generator=g).to(cache.v_pages[0])[perm])
        kv = PagedKV.for_step(cache, [0], [n], slots[length - n :])
        plan = PagedKV.prefill_plan([n], np.array([length]), page)
        q = torch.randn(n, hq, d, generator=g).to(runtime.DEVICE, dtype)
        k, v = (torch.randn(n, hkv, d, generator=g).to(runtime.DEVICE, dtype) for _ in range(2))
        times, outs = [], []
        for route in (None, plan):
            kv.prefill = route
            outs.append(kv.attend(0, q, k, v))
            times.append(benchmark(lambda kv=kv, q=q, k=k, v=v: kv.attend(0, q, k, v)))
        err = (outs[0].float() - outs[1].float()).abs().max().item()
        flops = 4 * hq * d * (n * (length - n) + n * (n + 1) / 2)
        cell = [f"{t:.3f} ({flops / t / 1e9:.0f})" for t in times]
        print(f"| {n} | {length} | {cell[0]} | {cell[1]} | {times[0] / times[1]:.2f}x | (max diff {err:.1e})")
        assert err < (0.05 if gpu else 1e-4), err


def batching_table() -> None:
    """The --batching table (module docstring)."""
    import statistics

    from host_time import no_launch, values_unread

    from course_lib import runtime
    from course_lib.bench.serving import batching_workload
    from course_lib.decode.batching import ContinuousBatcher
    from course_lib.serving.scheduling import StaticBatcher, predict_steps, serve_workload

    gpu = runtime.ON_GPU
    model = serving_model(True) if gpu else host_model(512)
    if not gpu:
        torch.set_num_threads(1)  # as --host and --step: the host's time on one core
    work, pages = batching_workload(32, model.config.vocab_size, gpu=True)  # the GPU's stream, on a CPU too
    predicted = predict_steps(work.new_tokens, 8)
    where = "GPU" if gpu else "CPU, no-op launches"
    print(f"batching: 32 requests, at most 8 running, {pages} pages of 16 tokens; {where}")
    print("| scheduler | steps (predicted) | tokens/s | decode steps | CPU ms | wall ms | sequences a step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with contextlib.ExitStack() as stack:
        if not gpu:  # the host's time alone
            for context in (no_launch(), values_unread(), slots_unread()):
                stack.enter_context(context)
        for (name, cls), steps in zip(
            (("static", StaticBatcher), ("continuous", ContinuousBatcher)), predicted
        ):
            if gpu:  # the bench's warm-up: every step shape compiled before the timed run
                serve_workload(cls(model, pages, 16, max_batch=8, max_step_tokens=4096), work)
            batcher, log = cls(model, pages, 16, max_batch=8, max_step_tokens=4096), []
            step = batcher.step

            def timed(step=step, batcher=batcher, log=log):
                c0, w0 = time.process_time(), time.perf_counter()
                out = step()
                if gpu:
                    torch.cuda.synchronize()
                if all(n == 1 for _, n in batcher.last_plan):  # a decode-only step
                    log.append((time.process_time() - c0, time.perf_counter() - w0, len(batcher.last_plan)))
                return out

            batcher.step = timed
            served = serve_workload(batcher, work)
            cpu, wall, rows = zip(*log)
            print(
                f"| {name} | {served.steps} ({steps}) | {served.throughput:.0f} | {len(log)} | "
                f"{1e3 * statistics.median(cpu):.2f} | {1e3 * statistics.median(wall):.2f} | "
                f"{statistics.mean(rows):.1f} |"
            )
    print(
        f"predicted continuous / static from step counts: {predicted[0] / predicted[1]:.2f}x (CPU and wall ms: medians)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--host", action="store_true", help="the host time of a first token by part, on a CPU"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=None,
        help="prompts (--host: 160 16384 32768; --step: 16384)",
    )
    parser.add_argument(
        "--prefix-gap", action="store_true", help="the ladder from the probe's prefix pass to the cascade's"
    )
    parser.add_argument(
        "--quick", action="store_true", help="with --prefix-gap: tiny sizes (a CPU smoke test)"
    )
    parser.add_argument("--passes", type=int, default=3, help="with --prefix-gap: interleaved timing passes")
    parser.add_argument("--step", action="store_true", help="one serving step's syncs, launches and CPU time")
    parser.add_argument("--batch", type=int, default=8, help="with --step: the decode step's sequences")
    parser.add_argument("--backend", default="sdpa", help="with --step: the model's backend")
    parser.add_argument("--dtype", default="bfloat16", help="with --step: the model's dtype")
    parser.add_argument(
        "--sites", action="store_true", help="with --step: every sync, copy and launch by site"
    )
    parser.add_argument(
        "--batching", action="store_true", help="static and continuous batching, step by step"
    )
    parser.add_argument("--prefill", action="store_true", help="a prefill layer: paged kernel against dense")
    parser.add_argument(
        "--dense-prefix", action="store_true", help="cascade's prefix pass on the Gluon forward"
    )
    parser.add_argument(
        "--dense-prefix-one-consumer", action="store_true", help="--dense-prefix on one-consumer variants"
    )
    parser.add_argument(
        "--prefill-split", action="store_true", help="the cached prefill, keys cut, 2 streams"
    )
    parser.add_argument(
        "--ttft-cprofile", action="store_true", help="the host's time in a cached first token"
    )
    parser.add_argument("--ttft-syncs", action="store_true", help="the host's waits in a cached first token")
    parser.add_argument(
        "--prefill-variants", action="store_true", help="the cached prefill by kernel variant"
    )
    parser.add_argument("--ttft-host-calls", action="store_true", help="host us by call in a first token")
    parser.add_argument(
        "--ttft-layer0-cpu", action="store_true", help="layer 0's host time on a CPU, warm and cold"
    )
    parser.add_argument("--ttft-timeline", action="store_true", help="a cached first token on one clock")
    parser.add_argument(
        "--prefill-tiles", action="store_true", help="the cached prefill by the forward's launches"
    )
    parser.add_argument(
        "--prefill-key-splits", action="store_true", help="the cached prefill with its keys split"
    )
    parser.add_argument(
        "--ttft-split-ab", action="store_true", help="first tokens with and without the split prefill"
    )
    parser.add_argument(
        "--prefill-split-host", action="store_true", help="the host's time of a split prefill's call"
    )
    parser.add_argument("--layer-host", action="store_true", help="host us a call of a layer's operations")
    parser.add_argument("--suffix-sms", action="store_true", help="the cascade's suffix pass on fewer SMs")
    args = parser.parse_args()
    if args.suffix_sms:
        suffix_sms()
    elif args.layer_host:
        layer_host()
    elif args.prefill_key_splits:
        prefill_key_splits()
    elif args.ttft_split_ab:
        ttft_split_ab()
    elif args.prefill_split_host:
        prefill_split_host()
    elif args.prefill_tiles:
        prefill_tiles()
    elif args.prefill_variants:
        prefill_variants()
    elif args.ttft_host_calls:
        ttft_host_calls()
    elif args.ttft_layer0_cpu:
        ttft_layer0_cpu()
    elif args.ttft_timeline:
        for n in args.lengths or [32768]:
            ttft_timeline(n)
    elif args.ttft_syncs:
        ttft_syncs()
    elif args.ttft_cprofile:
        ttft_cprofile()
    elif args.prefill_split:
        prefill_split()
    elif args.dense_prefix:
        dense_prefix()
    elif args.dense_prefix_one_consumer:
        dense_prefix_one_consumer()
    elif args.prefill:
        prefill_table()
    elif args.batching:
        batching_table()
    elif args.step:
        step_table(args.lengths or [16384], args.batch, args.repeats, args.backend, args.dtype, args.sites)
    elif args.prefix_gap:
        from prefix_gap import prefix_gap

        prefix_gap(args.quick, args.passes)
    elif args.host:
        ttft_host_table(args.lengths or [160, 16384, 32768], args.repeats)
    else:
        prefix_pass_rows()
        cascade_pieces()
        ttft_profile()
