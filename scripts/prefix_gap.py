"""The gap between the split kernel alone on a shared prefix and cascade attention's prefix pass (notes/serving.md).

The split-KV kernel alone over a 32k-token prefix, 64 query tokens x 32 heads against 8 K/V heads in 128-row
programs, ran 93.8 us in the probe behind `decode.heuristics.MANY_ROWS` (do_bench); the prefix pass of
`serving.cascade.cascade_passes` at batch 64 ran 121.2 us (graph replays, `serving_probe.py`). Read on the
CPU at the real sizes, the two launches have one grid, (8 K/V heads, 16 splits, 2 row tiles), and the same
constants, strides and lengths read; what differs is how they were timed, PDL (`decode.split_kv.launch`
sets it on Hopper, the prefix pass does not), the partial buffer (16 splits of their own, or the first 16
slots of the cascade's 17, same strides) and the page pool: the probe's holds the prefix's 512 pages alone,
the cascade's holds the 1024 suffix pages too, the prefix's pages spread among them in random order.
Its first run on an H200 (graph replays, us): the probe's launch 121.9 (the 93.8 did not reproduce), the
cascade's 121.7; with the table row in registers 114.5, 8 and 32 splits 175.4 and 136.6, the pages ascending
121.7. Since then the cascade's prefix pass reads its table row (rung 6).

This ladder goes from the probe's launch to the cascade's, one difference a rung, on the same K/V values and
queries (so every rung computes the same attention, checked against a float32 reference after the combine):

  0  the probe's launch (pool of the prefix's pages alone, its own partial buffer, PDL as `launch` sets it),
     timed by `triton.testing.do_bench` (the probe's timer: the L2 flushed by a write)
  1  the same launch, timed as a graph replay (`perf.timing.graph_ms`, the cascade pieces' timer)
  2  PDL off (the prefix pass is launched without it)
  3  the partials in the first S_p slots of one (S_p + 1, B, 1, Hq, d) buffer (the cascade's layout)
  4  the pool grown to the cascade's (prefix pages first, then the suffixes' pages): its size alone
  5  the prefix's pages spread over that pool in random order (the cascade's page ids, looked up block by
     block: the cascade's launch before it read its table row)
  6  the cascade's own launch, `cascade_passes(...)[0]`, on the same tensors: rung 5 with the block-table
     row in registers (`TABLE_ROW`), the candidate below; the run prints what their launches differ in
  7  the cascade's own launch timed by do_bench

then candidate changes to the cascade's launch (rung 5), each alone: half and twice the rule's split count,
the prefix's pages in ascending order, the block-table row in registers (`TABLE_ROW`), and the launch through
Triton's own `kernel[grid]` (the probe ran before `kernels.bound`). Each rung prints its time (median of
interleaved passes, the passes in brackets), the bound (bytes / 4.8 TB/s, FLOPs / 800 TFLOP/s, the larger),
and what its launch differs in from the rung before (arguments recorded at launch). The pass is bound by its
arithmetic, so its time follows the SM clock: the run also prints this GPU's bf16 matmul rate against the
hardware record's and nvidia-smi's SM clock, power and temperature while rungs 1 and 5 replay.

    COURSE_DEVICE=cuda python3 scripts/serving_probe.py --prefix-gap
    COURSE_DEVICE=cpu python3 scripts/serving_probe.py --prefix-gap --quick   (tiny sizes: the rungs run and check)
"""

from __future__ import annotations

import contextlib
import inspect
import statistics
import subprocess
import time

import torch

from course_lib import runtime
from course_lib.decode.combine import combine
from course_lib.decode.paged import paged_plan
from course_lib.decode.split_kv import write_partials
from course_lib.kernels import bound
from course_lib.pdl import enabled as pdl_enabled
from course_lib.perf.ceilings import measure_matmul_tflops
from course_lib.perf.timing import graph_ms, graphed, interleaved
from course_lib.serving import cascade

RECORDED_MATMUL_TFLOPS = 715.0  # bf16 8192^3 on the H200 of assets/benchmarks/hardware-nvidia-h200.json
HBM_BYTES_PER_S = 4.8e12  # an H200's datasheet bandwidth
TENSOR_FLOPS = 800e12  # dense bf16 a tuned attention kernel reaches on an H200 (its datasheet: 989)
# (batch, suffix tokens, prefix tokens, page size, query heads, K/V heads, head dim)
FULL = dict(b=64, s=1024, p=32768, page=64, hq=32, hkv=8, d=128)
# tiny sizes that still take the 128-row programs (256 rows per K/V head: 64 queries x 4 heads a group)
QUICK = dict(b=64, s=16, p=512, page=16, hq=4, hkv=1, d=128)


@contextlib.contextmanager
def recorded_launches(into: list):
    """Within the block, every `kernels.bound.launch` also appends (kernel name, grid, {argument: summary})
    to `into`: tensors by shape, strides and dtype, other arguments by value (pointers are left out)."""
    saved = bound.launch

    def launch(kernel, grid, *args, **kwargs):
        names = list(inspect.signature(kernel.fn).parameters)
        summary = {"grid": tuple(grid)}
        for name, a in [*zip(names, args), *kwargs.items()]:
            summary[name] = _tensor_summary(a) if isinstance(a, torch.Tensor) else a
        into.append((kernel.fn.__name__, summary))
        saved(kernel, grid, *args, **kwargs)

    bound.launch = launch
    try:
        yield
    finally:
        bound.launch = saved


def _tensor_summary(t: torch.Tensor) -> dict:
    """Shape, strides, dtype and the bytes of its storage; for an integer tensor (page ids, lengths) also a
    digest of its values (a table of other page ids is another launch)."""
    summary = {"shape": tuple(t.shape), "strides": t.stride(), "dtype": t.dtype,
               "storage B": t.untyped_storage().nbytes()}  # fmt: skip
    if not t.dtype.is_floating_point:
        summary["values"] = f"#{hash(tuple(t.flatten().tolist())) & 0xFFFF:04x}"
    return summary


def _differences(before: dict | None, after: dict) -> str:
    """What differs between two recorded launches: an argument's value, or the parts of a tensor's summary."""
    if before is None:
        return "-"
    changes = []
    for name, a in after.items():
        b = before.get(name)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += [f"{name} {part} {b.get(part)} -> {a[part]}" for part in a if b.get(part) != a[part]]
        elif a != b:
            changes.append(f"{name} {b} -> {a}")
    return ", ".join(changes) or "none (the same arguments)"


def unbound(fn):
    """fn with `kernels.bound` off while it runs: its launches go through `kernel[grid](...)`, as every launch
    did when the probe of the 128-row programs ran (a graph captures the same kernel either way)."""

    def call():
        saved, bound.ACTIVE = bound.ACTIVE, False
        try:
            fn()
        finally:
            bound.ACTIVE = saved

    return call


CLOCK_FIELDS = ("clocks.sm", "clocks.max.sm", "power.draw", "power.limit", "temperature.gpu")


def clocks_under(fn, seconds: float = 1.5) -> str:
    """nvidia-smi's samples (every 100 ms) of the SM clock, power and temperature while the GPU replays fn's
    graph for about `seconds`: a compute-bound kernel's time follows the SM clock, which another run, or
    another H200, may hold lower. Median (min-max) of each field over the samples."""
    replay = graphed(fn)
    until = time.perf_counter() + 0.5  # busy before the first sample
    while time.perf_counter() < until:
        replay()
    try:
        watch = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={','.join(CLOCK_FIELDS)}", "--format=csv,noheader,nounits", "-lms", "100"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    except OSError as exc:
        torch.cuda.synchronize()
        return f"nvidia-smi: {exc}"
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        replay()
    watch.terminate()
    out, err = watch.communicate(timeout=20)
    torch.cuda.synchronize()
    samples = [
        line.split(", ") for line in out.strip().splitlines() if line.count(",") == len(CLOCK_FIELDS) - 1
    ]
    if not samples:
        return f"nvidia-smi gave no sample: {err.strip()[:200]}"
    parts = []
    for i, field in enumerate(CLOCK_FIELDS):
        try:
            values = sorted(float(row[i]) for row in samples)
        except ValueError:
            parts.append(f"{field} {samples[-1][i]}")
            continue
        parts.append(f"{field} {statistics.median(values):.0f} ({values[0]:.0f}-{values[-1]:.0f})")
    return f"{len(samples)} samples: " + ", ".join(parts)


def _setup(sz: dict, device):
    """The cascade's tensors (as `serving_probe.cascade_pieces`) and the probe's pool holding the same
    prefix pages: logical prefix page i is k_pool[prefix_pages[i]] and k_probe[probe_table[i]]."""
    b, s, p, page, hq, hkv, d = (sz[k] for k in ("b", "s", "p", "page", "hq", "hkv", "d"))
    gen = torch.Generator(device=device).manual_seed(2)
    n_prefix, pages = p // page, (p + b * s) // page
    k_pool = torch.randn(pages, page, hkv, d, generator=gen, device=device).to(torch.bfloat16)
    v_pool = torch.randn(pages, page, hkv, d, generator=gen, device=device).to(torch.bfloat16)
    perm = torch.randperm(pages, generator=gen, device=device).to(torch.int32)
    prefix_pages, suffix_table = perm[:n_prefix], perm[n_prefix:].view(b, -1)
    q = torch.randn(b, 1, hq, d, generator=gen, device=device).to(torch.bfloat16)
    suffix_lens = torch.full((b,), s, dtype=torch.int32, device=device)
    probe_table = torch.randperm(n_prefix, generator=gen, device=device).to(torch.int32)
    k_probe, v_probe = torch.empty_like(k_pool[:n_prefix]), torch.empty_like(v_pool[:n_prefix])
    k_probe[probe_table.long()] = k_pool[prefix_pages.long()]
    v_probe[probe_table.long()] = v_pool[prefix_pages.long()]
    return q, k_pool, v_pool, prefix_pages, suffix_table, suffix_lens, k_probe, v_probe, probe_table


def _reference(q, k_pool, v_pool, prefix_pages, p: int) -> torch.Tensor:
    """Attention of every query over the prefix alone, float32: (1, B, Hq, d)."""
    b, _, hq, d = q.shape
    hkv = k_pool.shape[2]
    k = k_pool[prefix_pages.long()].reshape(-1, hkv, d)[:p].float().repeat_interleave(hq // hkv, dim=1)
    v = v_pool[prefix_pages.long()].reshape(-1, hkv, d)[:p].float().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("bhd,phd->hbp", q[:, 0].float(), k) / d**0.5
    return torch.einsum("hbp,phd->bhd", torch.softmax(s, dim=-1), v).unsqueeze(0)


PROBE, SPREAD = "1 the probe's launch, graph replay", "5 the prefix's pages spread (cascade)"
CASCADE, ROW = "6 cascade_passes' prefix pass itself", "5 with the table row in registers"


def prefix_gap(quick: bool = False, passes: int = 3) -> None:
    """Run the ladder (module docstring) at the full sizes or, quick, the tiny ones; print one line a rung."""
    sz = QUICK if quick else FULL
    device = runtime.DEVICE
    b, p, hq, hkv, d = (sz[k] for k in ("b", "p", "hq", "hkv", "d"))
    q, k_pool, v_pool, prefix_pages, suffix_table, suffix_lens, k_probe, v_probe, probe_table = _setup(
        sz, device
    )
    rows = q.reshape(1, b, hq, d)  # as cascade_passes: every query of the batch, one pass over the prefix
    plen = torch.full((1,), p, dtype=torch.int32, device=device)
    rest = torch.ones(k_pool.shape[0], dtype=torch.bool, device=device)
    rest[prefix_pages.long()] = False
    k_grown = torch.cat([k_probe, k_pool[rest]])  # the cascade's pool size, the prefix's pages first
    v_grown = torch.cat([v_probe, v_pool[rest]])
    ascending = torch.sort(prefix_pages).values
    k_ascending, v_ascending = k_pool.clone(), v_pool.clone()
    k_ascending[ascending.long()] = k_pool[prefix_pages.long()]  # logical page i at the i-th lowest id
    v_ascending[ascending.long()] = v_pool[prefix_pages.long()]

    def plan(k, v, table, num_splits=None, table_row=None):
        return paged_plan(
            rows, k, v, table.view(1, -1), plen, False, num_splits, False, "prefix gap", table_row=table_row
        )  # fmt: skip

    def rung(run, k, v, table, one_buffer=True, pdl=False):
        """(launch, its partial buffers, its plan): run's split kernel into a buffer of its own or into the
        first S slots of a cascade-shaped (S + 1, B, 1, Hq, d) one."""
        s = run.num_splits
        if one_buffer:
            o = torch.empty((s + 1, b, 1, hq, d), dtype=torch.float32, device=device)[:s].view(s, 1, b, hq, d)
            lp = torch.empty((s + 1, b, 1, hq), dtype=torch.float32, device=device)[:s].view(s, 1, b, hq)
        else:
            o = torch.empty((s, 1, b, hq, d), dtype=torch.float32, device=device)
            lp = torch.empty((s, 1, b, hq), dtype=torch.float32, device=device)
        table = table.view(1, -1)
        return lambda: write_partials(run, rows, k, v, table, plen, o, lp, None, pdl=pdl), (o, lp), run

    probe_run, cascade_run = plan(k_probe, v_probe, probe_table), plan(k_pool, v_pool, prefix_pages)
    s_p = cascade_run.num_splits
    ladder = {
        PROBE: rung(probe_run, k_probe, v_probe, probe_table, False, pdl_enabled(device)),
        "2 PDL off": rung(probe_run, k_probe, v_probe, probe_table, False),
        "3 the cascade's one partial buffer": rung(probe_run, k_probe, v_probe, probe_table),
        "4 the cascade's pool size": rung(plan(k_grown, v_grown, probe_table), k_grown, v_grown, probe_table),
        SPREAD: rung(cascade_run, k_pool, v_pool, prefix_pages),
    }
    prefix = cascade.cascade_passes(
        q, k_pool, v_pool, prefix_pages, p, suffix_table, suffix_lens, validate=False
    )[0]
    cascade_own = plan(k_pool, v_pool, prefix_pages, table_row=True)  # as cascade_passes plans its prefix
    ladder[CASCADE] = (prefix, None, cascade_own)
    row_run = cascade_run._replace(plan=cascade_run.plan._replace(table_row=True))
    candidates = {
        f"5 with {n} splits": rung(plan(k_pool, v_pool, prefix_pages, n), k_pool, v_pool, prefix_pages)
        for n in (max(1, s_p // 2), 2 * s_p)
    }
    candidates["5 with the prefix's pages ascending"] = rung(cascade_run, k_ascending, v_ascending, ascending)
    candidates[ROW] = rung(row_run, k_pool, v_pool, prefix_pages)
    fn, buffers, _ = ladder[SPREAD]
    candidates["5 through Triton's own launch (no bound launch)"] = (unbound(fn), buffers, cascade_run)
    every = {**ladder, **candidates}

    # every rung once: its launch recorded, its partials combined and checked against the reference
    expected = _reference(q, k_pool, v_pool, prefix_pages, p)
    launches = {}
    for name, (fn, buffers, _) in every.items():
        seen: list = []
        with recorded_launches(seen):
            fn()
        launches[name] = seen[0][1]
        if buffers is not None:
            out = torch.empty_like(rows)
            combine(*buffers, out, torch.empty(rows.shape[:3], dtype=torch.float32, device=device))
            err = (out.float() - expected).abs().max().item()
            if not err < 2e-2:
                raise AssertionError(f"{name}: max |out - reference| = {err:.3g}")
    print(
        f"prefix gap: B = {b} queries x {hq} heads ({hkv} K/V heads, d = {d}) over {p} prefix tokens in pages of "
        f"{sz['page']}; pool {prefix_pages.numel()} pages (probe) / {k_pool.shape[0]} (cascade); every rung's "
        "combined partials match the float32 reference within 2e-2"
    )
    print(f"rung 6's launch differs from '{ROW}' in: {_differences(launches[ROW], launches[CASCADE])}")

    times, bench = {}, {}
    if runtime.ON_GPU:
        from triton.testing import do_bench

        times = interleaved({name: fn for name, (fn, _, _) in every.items()}, passes, graph_ms)
        for _ in range(passes):
            for key, name in (("0", PROBE), ("7", CASCADE)):
                bench.setdefault(key, []).append(do_bench(every[name][0]))
        tflops = measure_matmul_tflops(dtype=torch.bfloat16)
        print(
            f"this GPU: bf16 matmul 8192^3 {tflops:.0f} TFLOP/s "
            f"(the hardware record's H200: {RECORDED_MATMUL_TFLOPS:.0f})"
        )
        for name in (PROBE, SPREAD):
            print(f"under rung {name[0]}'s replays: {clocks_under(every[name][0])}")

    flops = 4 * b * hq * p * d
    kv_bytes = 2 * p * hkv * d * 2 + rows.numel() * 2

    def line(name, ms_list, run, diff):
        s = run.num_splits
        t_bytes = (kv_bytes + s * b * hq * (d + 1) * 4) / HBM_BYTES_PER_S * 1e6  # K, V and Q read, partials
        t_flops = flops / TENSOR_FLOPS * 1e6
        bound_us = max(t_bytes, t_flops)
        if ms_list:
            us = statistics.median(ms_list) * 1e3
            spread = " / ".join(f"{m * 1e3:.1f}" for m in ms_list)
            head = f"{us:7.1f} us ({spread}), {100 * bound_us / us:3.0f} % of"
        else:
            head = "   (not timed: no GPU),"
        print(
            f"{name:<50} {head} bound {bound_us:5.1f} us (bytes {t_bytes:5.1f}, FLOPs {t_flops:5.1f}); grid "
            f"(B x Hkv, {s} splits, {run.m_tiles} row tiles of {run.block_m}); launch differs from the rung "
            f"before in: {diff}"
        )

    line("0 the probe's launch, do_bench", bench.get("0"), probe_run, "-")
    before = None
    for name, (_, _, run) in ladder.items():
        line(name, times.get(name), run, _differences(before, launches[name]))
        before = launches[name]
    line("7 the cascade's launch, do_bench", bench.get("7"), cascade_own, "-")
    for name, (_, _, run) in candidates.items():
        line(name, times.get(name), run, "(from rung 5) " + _differences(launches[SPREAD], launches[name]))
