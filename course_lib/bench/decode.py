"""The decoding benchmark: one new token against a KV cache, in GB/s of the read ceiling (notebooks 09, 10).

`python -m course_lib.bench.decode [--quick] [--out DIR]` (also `python -m course_lib bench decode`).
On a GPU, bf16, GQA with 32 query heads over 8 kv heads, d = 128, for every (batch, context) cell of
`CELLS` and a ragged batch (`RAGGED`), it measures
- `sdpa`: `scaled_dot_product_attention` with the fastest backend that takes the cell (each backend
  tried with enable_gqa=True and with K/V repeated to 32 heads beforehand; the ragged batch needs a
  mask, so SDPA reads the padded cache there);
- `split_kv`: `course_lib.decode.decode_attention` over a contiguous cache, given the lengths;
- `split_kv_full` (even cells whose plan it changes): the same call without lengths (cache_seqlens=None:
  every sequence holds the whole cache), the information SDPA's dense call has; the ratio to SDPA and
  its target use this call where it is measured, and the table shows both;
- `paged`: `course_lib.decode.paged_decode_attention`, page size 16, pages in shuffled order;
each plainly (one launch per call: shows the launch cost) and as a CUDA-graph replay (how serving
engines run a decode step; the targets apply to these). Every time becomes KV bytes read per second
(the valid K and V rows: 2 x sum(lengths) x Hkv x d x 2 bytes) and a fraction of the read ceiling
(`perf.ceilings.measure_read_bandwidth`, recorded with the copy ceiling). Also: a page-size sweep
(notebook 10) and the split-count curve against the prediction (notebook 09).
Saves the record kind "decode" and its plots in assets/benchmarks/.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import records, runtime
from ..decode import decode_attention, paged_decode_attention
from ..decode.heuristics import num_splits_for, sliced, sm_count, split_grid, wave_efficiency
from ..perf.ceilings import measure_read_time
from ..perf.timing import describe
from ..perf.timing import graphed as _graphed
from .plots import save_figure
from .report import command_line, record_and_report

HQ, HKV, D = 32, 8, 128
CELLS = [(1, 1024), (1, 8192), (1, 32768), (1, 131072), (8, 8192), (16, 32768), (64, 4096), (256, 1024)]
BATCH1_64K = (1, 65536)  # measured too: the target compares it with the time its bytes predict
RAGGED = (16, 64, 32768)  # batch, shortest, longest: lengths drawn uniformly, seed 0
PAGE_SIZES = (1, 8, 16, 64, 256)
SWEEP_CELLS = [(1, 32768), (64, 4096)]  # page-size sweep
SPLIT_CELL = (1, 32768)  # split-count curve
SPLITS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
TARGETS = {"vs_sdpa": 1.0, "read_fraction": 0.85, "read_fraction_min_bytes": 256e6, "paged_vs_split": 0.9}


def kv_bytes(lengths, hkv=HKV, d=D, elem=2) -> int:
    """Bytes of K and V a decoding step must read: 2 x sum(lengths) x Hkv x d x element size."""
    return int(2 * sum(int(n) for n in lengths) * hkv * d * elem)


def _time(fn) -> float:
    from ..perf.timing import benchmark

    return benchmark(fn)


def _pages(k, v, lengths, page_size, gen):
    """A shuffled page pool holding each sequence's first lengths[b] keys, and its block table."""
    B, n_max, hkv, d = k.shape
    max_pages = math.ceil(n_max / page_size)
    used = [math.ceil(int(n) / page_size) for n in lengths]
    perm = torch.randperm(sum(used), generator=gen)
    table = torch.zeros(B, max_pages, dtype=torch.int32)
    pools = [torch.empty(sum(used), page_size, hkv, d, dtype=k.dtype, device=k.device) for _ in range(2)]
    start = 0
    for b, n in enumerate(used):
        ids = perm[start : start + n]
        table[b, :n] = ids.to(torch.int32)
        for pool, src in zip(pools, (k, v)):
            rows = torch.zeros(n * page_size, hkv, d, dtype=k.dtype, device=k.device)
            m = min(n * page_size, n_max)
            rows[:m] = src[b, :m]
            pool[ids.to(k.device)] = rows.view(n, page_size, hkv, d)
        start += n
    return pools[0], pools[1], table.to(k.device)


def _sdpa_fns(q, k, v, lengths):
    """{name: fn} of SDPA variants for q (B, 1, Hq, d) over caches (B, N, Hkv, d)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, n_max = k.shape[:2]
    qt = q.transpose(1, 2)  # (B, Hq, 1, d)
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, N, d): strided views, no copy
    kr = kt.repeat_interleave(HQ // HKV, 1).contiguous()
    vr = vt.repeat_interleave(HQ // HKV, 1).contiguous()
    ragged = any(int(n) != n_max for n in lengths)
    mask = None
    if ragged:
        lens = torch.as_tensor([int(n) for n in lengths], device=q.device)
        mask = (torch.arange(n_max, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
    fns = {}
    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    for name, backend in backends.items():
        for kind, (kk, vv, gqa) in {"gqa": (kt, vt, True), "repeat": (kr, vr, False)}.items():

            def fn(backend=backend, kk=kk, vv=vv, gqa=gqa):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qt, kk, vv, attn_mask=mask, enable_gqa=gqa)

            fns[f"{name}/{kind}"] = fn
    return fns


def _measure(fn, nbytes, read_gbps, graphs: bool) -> dict:
    plain = _time(fn)
    row = {"plain_ms": plain, "plain_gbps": nbytes / plain / 1e6}
    replay = _graphed(fn) if graphs else None
    if replay is not None:
        g = _time(replay)
        row.update(graph_ms=g, graph_gbps=nbytes / g / 1e6, graph_read_fraction=nbytes / g / 1e6 / read_gbps)
    row["plain_read_fraction"] = row["plain_gbps"] / read_gbps
    return row


def measure_cell(B, lengths, n_max, read_gbps, dtype, device, graphs, gen, with_sdpa=True) -> dict:
    """All providers on one batch: lengths (B,) over a cache of capacity n_max."""
    q = torch.randn(B, 1, HQ, D, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(B, n_max, HKV, D, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(B, n_max, HKV, D, generator=gen).to(device=device, dtype=dtype)
    seqlens = torch.as_tensor(lengths, dtype=torch.int32).to(device)
    nbytes = kv_bytes(lengths, elem=k.element_size())
    k_pages, v_pages, table = _pages(k, v, lengths, 16, gen)
    row = {"batch": B, "n_max": n_max, "kv_bytes": nbytes, "lengths_sum": int(sum(int(n) for n in lengths))}
    if graphs:  # the floor for these bytes: a plain read of the same size (graph-replayed)
        row["read_same_size_ms"] = measure_read_time(nbytes, dtype, device)
    row["num_splits"] = split_grid(B, HKV, 1, n_max, D)
    pages = -(-n_max // 16)
    row["paged_num_splits"] = split_grid(B, HKV, 1, pages * 16, D, paged=True, table_width=pages)
    row["sliced"] = sliced(B, n_max)  # short slices, the paged tile, longest first
    row["split_kv"] = _measure(
        lambda: decode_attention(q, k, v, seqlens, validate=False), nbytes, read_gbps, graphs
    )
    full_splits = split_grid(B, HKV, 1, n_max, D, full=True)
    if all(int(n) == n_max for n in lengths) and full_splits != row["num_splits"]:  # even, another plan
        row["full_num_splits"] = full_splits
        row["split_kv_full"] = _measure(
            lambda: decode_attention(q, k, v, None, validate=False), nbytes, read_gbps, graphs
        )
    row["paged"] = _measure(
        lambda: paged_decode_attention(q, k_pages, v_pages, table, seqlens, validate=False),
        nbytes,
        read_gbps,
        graphs,
    )
    if with_sdpa and runtime.ON_GPU:
        best, tried = None, {}
        for name, fn in _sdpa_fns(q, k, v, lengths).items():
            if name.startswith("math"):
                continue  # materialises the scores: never the best, and large at 128k
            try:
                fn()
                torch.cuda.synchronize()
                tried[name] = _measure(fn, nbytes, read_gbps, graphs)
            except (RuntimeError, ValueError, NotImplementedError) as exc:  # backend refuses the cell
                tried[name] = {"error": str(exc).splitlines()[0][:200]}
                continue
            key = "graph_ms" if graphs else "plain_ms"
            if best is None or tried[name][key] < tried[best][key]:
                best = name
        row["sdpa_backends"] = tried
        if best is not None:
            row["sdpa"] = dict(tried[best], backend=best)
    return row


def predicted_split_ms(nbytes: float, batch: int, num_splits: int, read_gbps: float) -> float:
    """A split count's predicted time: the bytes at the read ceiling, slowed by the idle SMs of the last
    wave when the programs (batch x Hkv x splits) do not fill the GPU: t = bytes / (BW x f), f =
    min(1, programs / SMs) x wave efficiency (the heuristic's own model)."""
    programs = batch * HKV * num_splits
    fill = min(1.0, programs / sm_count()) * (
        wave_efficiency(programs, sm_count()) if programs > sm_count() else 1.0
    )
    return nbytes / (read_gbps * 1e9 * fill) * 1e3


def run(quick: bool = False) -> dict:
    """Measure everything (module docstring); returns the record's data. On the CPU (interpreter) only a
    smoke test of tiny cells runs, and its timings mean nothing."""
    from ..perf.ceilings import measure_copy_bandwidth, measure_read_bandwidth

    gpu = runtime.ON_GPU
    device = runtime.DEVICE
    dtype = torch.bfloat16 if gpu else torch.float32
    gen = torch.Generator().manual_seed(0)
    read_gbps = measure_read_bandwidth(dtype=torch.bfloat16 if gpu else torch.float32)
    copy_gbps = measure_copy_bandwidth()
    cells = CELLS + [BATCH1_64K] if gpu else [(1, 256), (2, 128)]
    ragged = RAGGED if gpu else (3, 16, 200)
    if quick and gpu:
        cells = [(1, 8192), (8, 8192), (64, 4096)]
    data = {
        "config": {
            "hq": HQ,
            "hkv": HKV,
            "d": D,
            "dtype": str(dtype).replace("torch.", ""),
            "sm_count": sm_count(),
        },
        "ceilings": {"read_gbps": read_gbps, "copy_gbps": copy_gbps},
        "timer": describe(),
        "targets": TARGETS,
        "cells": [],
    }
    for B, n in cells:
        t0 = time.perf_counter()
        row = measure_cell(B, [n] * B, n, read_gbps, dtype, device, gpu, gen)
        row["name"] = f"B={B} N={n // 1024}k" if n >= 1024 else f"B={B} N={n}"
        data["cells"].append(row)
        print(f"decode: {row['name']:>14} {_summary(row)} ({time.perf_counter() - t0:.0f} s)")
    B, lo, hi = ragged
    lengths = torch.randint(lo, hi + 1, (B,), generator=gen).tolist()
    row = measure_cell(B, lengths, max(lengths), read_gbps, dtype, device, gpu, gen)
    row["name"] = f"ragged B={B}"
    row["lengths"] = lengths
    data["cells"].append(row)
    print(f"decode: {row['name']:>14} {_summary(row)}")
    data["page_sweep"] = _page_sweep(quick, read_gbps, dtype, device, gen) if gpu else []
    data["split_curve"] = _split_curve(quick, read_gbps, dtype, device, gen) if gpu else []
    return data


def _summary(row) -> str:
    key = "graph_ms" if "graph_ms" in row["split_kv"] else "plain_ms"
    parts = [f"split_kv {row['split_kv'][key] * 1e3:.1f} us", f"paged {row['paged'][key] * 1e3:.1f} us"]
    if "sdpa" in row:
        parts.append(f"sdpa {row['sdpa'][key] * 1e3:.1f} us ({row['sdpa']['backend']})")
    return " | ".join(parts)


def _page_sweep(quick, read_gbps, dtype, device, gen) -> list[dict]:
    rows = []
    for B, n in SWEEP_CELLS[:1] if quick else SWEEP_CELLS:
        q = torch.randn(B, 1, HQ, D, generator=gen).to(device=device, dtype=dtype)
        k = torch.randn(B, n, HKV, D, generator=gen).to(device=device, dtype=dtype)
        v = torch.randn(B, n, HKV, D, generator=gen).to(device=device, dtype=dtype)
        seqlens = torch.full((B,), n, dtype=torch.int32, device=device)
        nbytes = kv_bytes([n] * B)
        base = _measure(
            lambda q=q, k=k, v=v, s=seqlens: decode_attention(q, k, v, s, validate=False),
            nbytes,
            read_gbps,
            True,
        )
        for ps in PAGE_SIZES:
            kp, vp, table = _pages(k, v, [n] * B, ps, gen)
            m = _measure(
                lambda q=q, kp=kp, vp=vp, t=table, s=seqlens: paged_decode_attention(
                    q, kp, vp, t, s, validate=False
                ),
                nbytes,
                read_gbps,
                True,
            )
            rows.append(
                {"batch": B, "n": n, "page_size": ps, **m, "vs_contiguous": base["graph_ms"] / m["graph_ms"]}
            )
            print(
                f"decode: page sweep B={B} N={n} page {ps}: {m['graph_ms'] * 1e3:.1f} us, "
                f"{rows[-1]['vs_contiguous']:.2f}x contiguous"
            )
        torch.cuda.empty_cache()
    return rows


def _split_curve(quick, read_gbps, dtype, device, gen) -> list[dict]:
    B, n = SPLIT_CELL
    q = torch.randn(B, 1, HQ, D, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(B, n, HKV, D, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(B, n, HKV, D, generator=gen).to(device=device, dtype=dtype)
    seqlens = torch.full((B,), n, dtype=torch.int32, device=device)
    nbytes = kv_bytes([n] * B)
    chosen = num_splits_for(B, HKV, 1, n, D)
    rows = []
    for s in SPLITS[::2] if quick else SPLITS:
        m = _measure(
            lambda s=s: decode_attention(q, k, v, seqlens, num_splits=s, validate=False),
            nbytes,
            read_gbps,
            True,
        )
        rows.append({"batch": B, "n": n, "num_splits": s, "chosen": s == chosen, **m,
                     "predicted_ms": predicted_split_ms(nbytes, B, s, read_gbps)})  # fmt: skip
    return rows


def save_plots(data: dict, out: Path, slug: str) -> list[Path]:
    """Bar charts of the cells (ratio to SDPA, fraction of the read ceiling), the page-size sweep and the
    split curve, as PNGs next to the record."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    cells = [c for c in data["cells"] if "graph_ms" in c["split_kv"]]
    if cells:
        names = [c["name"] for c in cells]
        fig, ax = plt.subplots(figsize=(10, 4.5))
        x = range(len(cells))
        for i, prov in enumerate(("sdpa", "split_kv", "paged")):
            vals = [c[prov]["graph_read_fraction"] * 100 if prov in c else 0 for c in cells]
            ax.bar([j + (i - 1) * 0.27 for j in x], vals, width=0.27, label=prov)
        ax.axhline(85, color="k", ls="--", lw=1, label="85 % target")
        ax.set_xticks(list(x), names, rotation=20)
        ax.set_ylabel("KV bytes read / s, % of read ceiling")
        ax.set_title(
            "Decoding, bf16, 32 q / 8 kv heads, d=128, CUDA-graph replay "
            f"(read ceiling {data['ceilings']['read_gbps']:.0f} GB/s)"
        )
        ax.legend()
        paths.append(save_figure(fig, out / f"decode-{slug}-cells.png"))
    if data.get("page_sweep"):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for B, n in {(r["batch"], r["n"]) for r in data["page_sweep"]}:
            rows = [r for r in data["page_sweep"] if (r["batch"], r["n"]) == (B, n)]
            ax.plot(
                [r["page_size"] for r in rows],
                [r["vs_contiguous"] for r in rows],
                "o-",
                label=f"B={B}, N={n}",
            )
        ax.set_xscale("log", base=2)
        ax.axhline(0.9, color="k", ls="--", lw=1, label="0.9x target (page 16)")
        ax.set_xlabel("page size (tokens)")
        ax.set_ylabel("speed vs contiguous cache (x)")
        ax.set_title("Paged decoding: the cost of the block-table indirection by page size")
        ax.legend()
        paths.append(save_figure(fig, out / f"decode-{slug}-pages.png"))
    if data.get("split_curve"):
        rows = data["split_curve"]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.plot([r["num_splits"] for r in rows], [r["graph_ms"] * 1e3 for r in rows], "o-", label="measured")
        ax.plot(
            [r["num_splits"] for r in rows], [r["predicted_ms"] * 1e3 for r in rows], "--", label="predicted"
        )
        for r in rows:
            if r["chosen"]:
                ax.axvline(r["num_splits"], color="g", lw=1, label=f"heuristic: {r['num_splits']} splits")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("number of splits")
        ax.set_ylabel("time per step (us)")
        ax.set_title(
            f"Split-KV at batch {rows[0]['batch']}, {rows[0]['n'] // 1024}k context: splits fill the SMs"
        )
        ax.legend()
        paths.append(save_figure(fig, out / f"decode-{slug}-splits.png"))
    return paths


def _splits(cell: dict, prefix: str) -> str:
    """The grid's split count, marked "sliced" for a batch on the sliced plan (`heuristics.sliced`)."""
    return f"{cell.get(prefix + 'num_splits', '-')}{' sliced' if cell.get('sliced') else ''}"


def dense(cell: dict) -> dict:
    """The split-KV figures compared with SDPA: the call without lengths where the cell has one
    (`split_kv_full`), else the call with them."""
    return cell.get("split_kv_full", cell["split_kv"])


def format_table(data: dict) -> str:
    """The decode table: per cell, graph-replayed time, ratio to SDPA, % of the read ceiling, paged/split.
    An even cell measured without lengths too (`dense`) shows that call's time, splits and ratio first,
    the call with lengths in brackets."""
    lines = [
        f"read ceiling {data['ceilings']['read_gbps']:.0f} GB/s, copy ceiling {data['ceilings']['copy_gbps']:.0f} GB/s",
        "| cell | KV MB | splits (split-KV / paged) | split-KV us (plain) | split-KV / SDPA | split-KV % read "
        "| same-size read us (% of ceiling) | split-KV / same-size read | paged / split-KV | SDPA backend |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    key = "graph_ms" if any("graph_ms" in c["split_kv"] for c in data["cells"]) else "plain_ms"
    frac = "graph_read_fraction" if key == "graph_ms" else "plain_read_fraction"
    for c in data["cells"]:
        s, p, d = c["split_kv"], c["paged"], dense(c)
        sdpa = c.get("sdpa")
        vs = f"{sdpa[key] / d[key]:.2f}x" if sdpa else "-"
        splits, time = _splits(c, ""), f"{d[key] * 1e3:.1f} ({d['plain_ms'] * 1e3:.1f})"
        if d is not s:  # without lengths first; with them in brackets
            splits = f"{c['full_num_splits']} no lengths [{splits}]"
            time += f" [{s[key] * 1e3:.1f}]"
            vs += f" [{sdpa[key] / s[key]:.2f}x]" if sdpa else ""
        lines.append(
            f"| {c['name']} | {c['kv_bytes'] / 1e6:.0f} | {splits} / {_splits(c, 'paged_')} | {time} "
            f"| {vs} | {d[frac] * 100:.0f} % | {_same_size(c, key, data['ceilings']['read_gbps'])} "
            f"| {s[key] / p[key]:.2f}x | {sdpa['backend'] if sdpa else '-'} |"
        )
    return "\n".join(lines)


def _same_size(cell: dict, key: str, read_gbps: float) -> str:
    """'read us (% of the read ceiling) | read time / split-KV time' for a cell, or '- | -' where the
    record has no same-size read (older records, plain timings)."""
    read_ms = cell.get("read_same_size_ms")
    if read_ms is None or key != "graph_ms":
        return "- | -"
    fraction = cell["kv_bytes"] / (read_ms * 1e-3) / 1e9 / read_gbps
    return f"{read_ms * 1e3:.1f} ({fraction * 100:.0f} %) | {read_ms / dense(cell)[key]:.2f}x"


def target_misses(data: dict) -> list[str]:
    """The issue's targets, checked on the graph-replayed figures; one line per miss (empty: all met)."""
    misses = []
    read = data["ceilings"]["read_gbps"]
    for c in data["cells"]:
        s, p, sdpa = dense(c), c["paged"], c.get("sdpa")
        if "graph_ms" not in s:
            continue
        with_lengths = c["split_kv"]  # the paged kernel's like: both given the lengths
        if sdpa and "graph_ms" in sdpa and sdpa["graph_ms"] / s["graph_ms"] < TARGETS["vs_sdpa"]:
            misses.append(
                f"{c['name']}: split-KV {sdpa['graph_ms'] / s['graph_ms']:.2f}x SDPA (target >= 1.0x)"
            )
        if (
            c["kv_bytes"] >= TARGETS["read_fraction_min_bytes"]
            and s["graph_read_fraction"] < TARGETS["read_fraction"]
        ):
            misses.append(
                f"{c['name']}: split-KV at {s['graph_read_fraction']:.0%} of the read ceiling (target 85 %)"
            )
        if with_lengths["graph_ms"] / p["graph_ms"] < TARGETS["paged_vs_split"]:
            misses.append(
                f"{c['name']}: paged {with_lengths['graph_ms'] / p['graph_ms']:.2f}x split-KV (target >= 0.9x)"
            )
        if (c["batch"], c["n_max"]) == BATCH1_64K and c["name"].startswith("B="):
            predicted = c["kv_bytes"] / (read * 1e9) * 1e3
            if s["graph_ms"] > 1.3 * predicted:
                misses.append(
                    f"{c['name']}: {s['graph_ms'] / predicted:.2f}x the bytes' time (target <= 1.3x)"
                )
    return misses


def main(quick: bool = False, out: str | Path = records.ASSETS) -> int:
    """Measure (`run`), save the record "decode" and its plots in `out`, print the table. Returns 0."""
    return record_and_report("decode", run, save_plots, format_table, target_misses, quick, out)


if __name__ == "__main__":
    raise SystemExit(command_line(main, __doc__))
