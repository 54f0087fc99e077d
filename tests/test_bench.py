"""Tests of course_lib.bench: the smoke run of `make bench --quick` (tiny on the CPU) and the
ratio / target logic on synthetic records."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

import course_lib
from course_lib import bench, records
from course_lib.bench import attention as attention_bench
from course_lib.bench import measure, registry
from course_lib.perf import timing


def _synthetic(ours: dict, flash: dict, default: dict, peak_ratio: float = 1.02) -> dict:
    """A record's data with course_lib / SDPA TFLOP/s given per (mode, N) at d = 64, not causal."""
    cells = [dict(B=16384 // n, H=32, N=n, d=64, causal=False) for n in (1024, 2048)]
    results = []
    for c in cells:
        for provider, table in (("course_lib", ours), ("sdpa_flash", flash), ("sdpa_default", default)):
            for mode in bench.MODES:
                value = table.get((mode, c["N"]))
                if value is None:
                    results.append(dict(provider=provider, mode=mode, status="unsupported", reason="x", **c))
                    continue
                ideal = (4 if mode == "fwd" else 8) * c["B"] * c["H"] * c["N"] * c["d"] * 2
                results.append(
                    dict(provider=provider, mode=mode, status="ok", tflops=value, ms=1.0,
                         peak_bytes=ideal * peak_ratio, ideal_bytes=ideal, **c)
                )  # fmt: skip
    return dict(cells=cells, results=results, providers=list(bench.PROVIDERS), labels=bench.LABELS)


def test_summarise_min_and_geomean():
    lo, geo = bench.summarise([2.0, None, 0.5, 1.0])
    assert lo == 0.5
    assert math.isclose(geo, 1.0), f"geomean of 2, 0.5, 1 should be 1, got {geo}"
    assert bench.summarise([None, None]) == (None, None)


def test_ratios_and_targets_met():
    ours = {("fwd", 1024): 300.0, ("fwd", 2048): 330.0, ("fwd_bwd", 1024): 250.0, ("fwd_bwd", 2048): 280.0}
    flash = {("fwd", 1024): 290.0, ("fwd", 2048): 300.0, ("fwd_bwd", 1024): 230.0, ("fwd_bwd", 2048): 260.0}
    default = {("fwd", 1024): 320.0, ("fwd", 2048): 340.0, ("fwd_bwd", 1024): 380.0, ("fwd_bwd", 2048): 400.0}
    data = _synthetic(ours, flash, default)
    rows = bench.ratio_rows(data)
    assert [r["N"] for r in rows] == [1024, 2048]
    assert math.isclose(rows[0]["fwd/sdpa_flash"], 300 / 290)
    assert math.isclose(rows[1]["fwd_bwd/sdpa_default"], 280 / 400)
    targets = {t["target"]: t for t in bench.check_targets(data)}
    assert len(targets) == 4, list(targets)
    assert all(t["met"] for t in targets.values()), [(t["target"], t["detail"]) for t in targets.values()]
    geo = targets["forward >= 0.9x SDPA default on the geometric mean"]["value"]
    assert math.isclose(geo, math.sqrt(300 / 320 * 330 / 340))


def test_targets_missed_and_missing():
    ours = {("fwd", 1024): 280.0, ("fwd", 2048): 330.0, ("fwd_bwd", 1024): 250.0}
    flash = {("fwd", 1024): 290.0, ("fwd", 2048): 300.0, ("fwd_bwd", 1024): 230.0, ("fwd_bwd", 2048): 260.0}
    default = {("fwd", 1024): 400.0, ("fwd", 2048): 400.0}
    data = _synthetic(ours, flash, default, peak_ratio=1.25)
    t = bench.check_targets(data)
    fwd_flash, fwd_default, fb_flash, memory = t
    assert fwd_flash["met"] is False and math.isclose(fwd_flash["value"], 280 / 290), fwd_flash
    assert fwd_default["met"] is False, fwd_default
    # fwd+bwd at N=2048 is missing for course_lib while FLASH ran: that fails "every cell"
    assert fb_flash["met"] is False and "no figure in 1 cell" in fb_flash["detail"], fb_flash
    assert memory["met"] is None, f"no fwd+bwd figure at the largest N, yet: {memory}"
    report = bench.format_report(data)
    assert "MISSED" in report and "geomean" in report and "min" in report, report


def test_memory_target():
    full = {(m, n): 100.0 for m in bench.MODES for n in (1024, 2048)}
    for ratio, met in ((1.05, True), (1.25, False)):
        memory = bench.check_targets(_synthetic(full, full, full, peak_ratio=ratio))[-1]
        assert memory["met"] is met and math.isclose(memory["value"], ratio), (ratio, memory)


def test_a_missing_baseline_does_not_fail_a_target():
    ours = {(m, n): 300.0 for m in bench.MODES for n in (1024, 2048)}
    flash = {("fwd", 1024): 290.0, ("fwd_bwd", 1024): 250.0}  # FLASH refused N=2048
    fwd_flash = bench.check_targets(_synthetic(ours, flash, ours))[0]
    assert fwd_flash["met"] is True and "1 of 2 cells without a baseline" in fwd_flash["detail"], fwd_flash


def test_targets_without_any_figure_are_not_applicable():
    data = _synthetic({}, {}, {})
    assert all(t["met"] is None for t in bench.check_targets(data))


class _NoBackward(torch.autograd.Function):
    """Forward works, backward refuses: as an SDPA backend that has no backward for a shape."""

    @staticmethod
    def forward(ctx, q, k, v):
        return q + k + v

    @staticmethod
    def backward(ctx, do):
        raise RuntimeError("No available kernel for this backward")


def test_a_refused_backward_keeps_the_forward():
    q, k, v, do = (torch.randn(1, 2, 16, 8) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    timer = lambda fn: timing.benchmark(fn, cpu_reps=1)
    out = bench.measure_provider(lambda q, k, v, causal: _NoBackward.apply(q, k, v), q, k, v, do, False,
                                 timer, "sdpa_flash")  # fmt: skip
    assert out["fwd"]["status"] == "ok" and out["fwd"]["ms"] > 0, out["fwd"]
    for mode in ("bwd", "fwd_bwd"):
        assert out[mode]["status"] == "unsupported" and "No available kernel" in out[mode]["reason"], out


def test_standard_cells_keep_the_token_count():
    cells = bench.standard_cells(quick=False, on_gpu=True)
    assert len(cells) == 5 * 2 * 2
    for c in cells:
        assert c["B"] * c["N"] == bench.TOKENS and c["H"] * c["d"] == bench.MODEL_DIM, c


def test_eager_is_capped_at_large_n():
    fns = {p: None for p in bench.PROVIDERS}
    big = dict(B=1, H=16, N=16384, d=128, causal=False)
    small = dict(B=16, H=16, N=1024, d=128, causal=False)
    assert bench.skip_reason("eager", big, fns) is not None
    assert bench.skip_reason("compiled", big, fns) is not None
    assert bench.skip_reason("eager", small, fns) is None
    assert bench.skip_reason("course_lib", big, fns) is None


def test_ladder_steps_carry_predictions():
    for pass_ in ("fwd", "bwd"):
        steps = [s for s in bench.LADDER if s.pass_ == pass_]
        assert steps[0].predicted == 1.0 and steps[0].config is not None, f"{pass_}: the ladder starts fixed"
        assert any(s.config is None for s in steps), f"{pass_}: the ladder ends at course_lib's tuned kernel"
        for s in steps:
            assert s.predicted > 0 and s.reason, s


@pytest.mark.skipif(course_lib.ON_GPU, reason="the GPU smoke test is `make bench` itself")
def test_main_quick_writes_records(tmp_path, capsys, monkeypatch):
    # The hardware recorder's fusion measurement compiles with inductor (~7 s of C++ on a CPU); this
    # test is about the benchmark's plumbing, so the "compiled" chain runs eagerly here.
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    rc = attention_bench.main(quick=True, out=tmp_path)
    printed = capsys.readouterr().out
    assert rc == 0, printed
    rec = records.load_record("attention", folder=tmp_path)
    assert rec is not None and rec["meta"]["date"], list(tmp_path.iterdir())
    data = rec["data"]
    for key in ("cells", "results", "ratios", "summary", "targets", "providers", "timer"):
        assert key in data, key
    assert len(data["results"]) == len(data["cells"]) * len(bench.PROVIDERS) * len(bench.MODES)
    statuses = {(r["provider"], r["status"]) for r in data["results"]}
    assert ("course_lib", "ok") in statuses and ("sdpa_default", "ok") in statuses, statuses
    assert ("compiled", "skipped") in statuses, statuses
    for r in data["results"]:
        if r["status"] == "ok":
            flops = timing.attention_flops(
                r["B"], r["H"], r["N"], r["N"], r["d"], causal=r["causal"], mode=r["mode"]
            )
            assert r["ms"] > 0 and r["tflops"] == pytest.approx(flops / (r["ms"] * 1e-3) / 1e12, rel=1e-9), r
            assert r["max_abs_diff_vs_sdpa"] < 1e-5, r  # fp32 on the CPU: about 1e-6
        else:
            assert r["reason"], r
        if r["provider"] in measure.PAIRED and r["status"] == "ok":  # timed in turn: the median of the passes
            passes = r["ms_passes"]
            assert len(passes) == data["paired"]["passes"] and r["first_ms"] > 0, r
            assert r["ms"] == pytest.approx(statistics.median(passes), rel=1e-12), r
    lad = records.load_record("ladder", folder=tmp_path)["data"]
    assert [s["name"] for s in lad["steps"]] == [s.name for s in bench.LADDER]
    assert all(s["status"] == "ok" and s["max_abs_diff_vs_tuned"] < 1e-5 for s in lad["steps"]), lad["steps"]
    for kind in ("hardware", "standard_attention"):
        assert (tmp_path / f"{kind}-cpu.json").exists(), f"{kind} record missing"
    assert "targets:" in printed and "geomean" in printed, printed
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == sorted(
        ["attention-cpu-fwd.png", "attention-cpu-bwd.png", "attention-cpu-fwd_bwd.png",
         "attention-cpu-memory.png", "ladder-cpu.png"]
    ), pngs  # fmt: skip
    json.loads((tmp_path / "attention-cpu.json").read_text())


def test_main_refuses_cpu_figures_in_assets(capsys):
    if course_lib.ON_GPU:
        pytest.skip("on a GPU, assets/benchmarks/ is where the record belongs")
    assert bench.main(quick=True, out=records.ASSETS) == 2
    assert "--out" in capsys.readouterr().out
    assert attention_bench.main(quick=True, out=records.ASSETS) == 2
    assert "--out" in capsys.readouterr().out


def test_a_failing_recorder_does_not_stop_the_rest(tmp_path, monkeypatch, capsys):
    from course_lib.perf import ceilings, profiling

    def boom(**sizes):
        raise RuntimeError("no ceiling today")

    monkeypatch.setattr(ceilings, "measure_record", boom)
    monkeypatch.setattr(attention_bench, "run_attention", lambda quick: _synthetic({}, {}, {}))
    monkeypatch.setattr(attention_bench, "ladder", lambda quick: {"steps": []})
    monkeypatch.setattr(profiling, "standard_attention_record", lambda **sizes: {"ok": True})
    monkeypatch.setattr(attention_bench, "save_plots", lambda *paths: [])
    rc = attention_bench.main(quick=True, out=tmp_path)
    printed = capsys.readouterr().out
    assert rc == 1 and "hardware FAILED" in printed and "no ceiling today" in printed, printed
    kinds = sorted(p.name.split("-")[0] for p in tmp_path.glob("*.json"))
    assert kinds == ["attention", "ladder", "standard_attention"], kinds  # host_time: a benchmark of its own


def test_registry_finds_the_attention_benchmark_and_refuses_unknown_names(capsys):
    assert registry.available()[0] == "attention", registry.available()
    assert set(registry.available()) <= set(registry.BENCHMARKS)
    with pytest.raises(ValueError, match="known: attention"):
        registry.load("sideways")
    if not course_lib.ON_GPU:
        assert registry.main(["sideways"], quick=True, out="/tmp/unused-bench-out") == 2
        assert "unknown benchmark 'sideways'" in capsys.readouterr().out


def test_registry_runs_the_named_benchmarks_and_survives_a_failure(tmp_path, monkeypatch, capsys):
    calls = []

    class Fake:
        def __init__(self, name, rc):
            self.name, self.rc = name, rc

        def run(self, quick):
            return {}

        def main(self, quick=False, out=None):
            calls.append((self.name, quick, out))
            if self.rc == "raise":
                raise RuntimeError(f"{self.name} broke")
            return self.rc

    fakes = {"attention": Fake("attention", "raise"), "decode": Fake("decode", 0)}
    monkeypatch.setattr(registry, "available", lambda: list(fakes))
    monkeypatch.setattr(registry, "load", lambda name: fakes[name])
    assert registry.main(["decode"], quick=True, out=tmp_path) == 0
    assert calls == [("decode", True, tmp_path)], calls
    calls.clear()
    rc = registry.main(None, quick=True, out=tmp_path)
    printed = capsys.readouterr().out
    assert rc == 1 and [c[0] for c in calls] == ["attention", "decode"], (rc, calls)
    assert "attention FAILED" in printed and "attention broke" in printed, printed


def test_command_line_passes_the_names(monkeypatch):
    from course_lib import __main__ as cli

    seen = {}
    monkeypatch.setattr(
        registry, "main", lambda names, quick, out: seen.update(names=names, quick=quick) or 0
    )
    assert cli.main(["bench", "decode", "fused", "--quick", "--out", "/tmp/x"]) == 0
    assert seen == {"names": ["decode", "fused"], "quick": True}, seen


def test_bench_report_and_plots_on_a_synthetic_record(tmp_path):
    from course_lib.bench import decode as bench

    def timing(ms, nbytes):
        return {"plain_ms": ms * 2, "graph_ms": ms, "graph_read_fraction": nbytes / ms / 1e6 / 4000,
                "plain_read_fraction": nbytes / ms / 2e6 / 4000}  # fmt: skip

    cells = []
    for (B, n), (split_ms, paged_ms, sdpa_ms) in zip(
        [(1, 65536), (16, 32768)], [(0.075, 0.08, 0.1), (0.6, 0.9, 0.55)]
    ):
        nbytes = bench.kv_bytes([n] * B)
        cells.append({
            "name": f"B={B} N={n // 1024}k", "batch": B, "n_max": n, "kv_bytes": nbytes, "num_splits": 1,
            "split_kv": timing(split_ms, nbytes), "paged": timing(paged_ms, nbytes),
            "sdpa": dict(timing(sdpa_ms, nbytes), backend="flash/gqa"),
        })  # fmt: skip
    data = {
        "ceilings": {"read_gbps": 4000.0, "copy_gbps": 3900.0},
        "cells": cells,
        "page_sweep": [
            {"batch": 1, "n": 32768, "page_size": p, "vs_contiguous": 1 - 0.01 * i}
            for i, p in enumerate((1, 16))
        ],
        "split_curve": [
            {
                "batch": 1,
                "n": 32768,
                "num_splits": s,
                "graph_ms": 0.1 / s,
                "predicted_ms": 0.09 / s,
                "chosen": s == 2,
            }
            for s in (1, 2)
        ],  # fmt: skip
    }
    table = bench.format_table(data)
    assert "B=1 N=64k" in table and "1.33x" in table, table
    misses = bench.target_misses(data)
    assert any("B=16 N=32k: split-KV 0.92x SDPA" in m for m in misses), misses
    assert any("B=16 N=32k: paged 0.67x" in m for m in misses), misses
    assert not any(m.startswith("B=1 N=64k") for m in misses), misses
    # the even cell measured without lengths too: that call against SDPA, the paged one against the call
    # with lengths
    cells[1].update(full_num_splits=1, split_kv_full=timing(0.5, cells[1]["kv_bytes"]))
    table = bench.format_table(data)
    assert "| 1 no lengths [1] / " in table and "| 1.10x [0.92x] |" in table, table
    misses = bench.target_misses(data)
    assert not any("B=16 N=32k: split-KV" in m for m in misses), misses
    assert any("B=16 N=32k: paged 0.67x" in m for m in misses), misses
    paths = bench.save_plots(data, tmp_path, "test")
    assert len(paths) == 3 and all(p.exists() for p in paths)


def test_bench_tables_and_targets_read_a_record(tmp_path):
    """format_table, target_misses and save_plots on a made-up record (the measuring needs a GPU)."""
    from course_lib.bench import fused as bench

    def row(kernel, provider, mode, gbps, **cell):
        return {"kernel": kernel, "provider": provider, "mode": mode, "status": "ok", "ms": 1.0, "gbps": gbps,
                "copy_fraction": gbps / 4000, "timing": "graph", "graph_gbps": gbps, "plain_gbps": gbps / 2,
                **cell}  # fmt: skip

    data = {"dtype": "bfloat16", "copy_gbps": 4000.0, "targets": bench.TARGETS, "quick": True, "dw_modes": []}
    data["rms_norm"] = [
        row("rms_norm", p, m, g, T=16384, D=4096)
        for m in ("fwd", "bwd")
        for p, g in zip(bench.RMS_PROVIDERS, (500, 2000, 3000, 3600 if m == "fwd" else 2900))
    ]
    data["rope"] = [
        row("rope", p, m, g, T=16384)
        for m in ("fwd", "bwd")
        for p, g in zip(bench.ROPE_PROVIDERS, (900, 3000, 3300))
    ]
    table = bench.format_table(data)
    assert (
        "| fwd | 16384 | 4096 | 500 (250) | 2000 (1000) | 3000 (1500) | 3600 (1800) | 1.20x | 90 % |" in table
    )
    assert "SwiGLU gate" not in table  # a record from before the gate was measured
    data["swiglu"] = [
        row("swiglu", p, m, g, T=4096, F=14336)
        for m in ("fwd", "bwd")
        for p, g in zip(bench.SWIGLU_PROVIDERS, (1200, 3200, 3400))
    ]
    assert (
        "| bwd | 4096 | 14336 | 1200 (600) | 3200 (1600) | 3400 (1700) | 1.06x | 85 % |"
        in bench.format_table(data)
    )
    assert bench.swiglu_bytes(2, 3, "fwd") == 36 and bench.swiglu_bytes(2, 3, "bwd") == 60
    assert "CUDA-graph replay" in table.splitlines()[0], table
    misses = bench.target_misses(data)
    assert misses == [
        "rms_norm mode=bwd T=16384 D=4096: 0.97x torch.compile (target >= 1.0x; CUDA-graph replay)",
        "rms_norm mode=bwd T=16384 D=4096: 72% of the copy ceiling (target 85 %; CUDA-graph replay)",
    ], misses
    for r in data["rms_norm"] + data["rope"]:  # a record without graph figures: plain numbers, said so
        r.pop("timing"), r.pop("plain_gbps")
    assert "| fwd | 16384 | 4096 | 500 | 2000 | 3000 | 3600 | 1.20x | 90 % |" in bench.format_table(data)
    assert bench.target_misses(data)[0].endswith("(target >= 1.0x; plain launches)")
    paths = bench.save_plots(data, tmp_path, "test")
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)
    assert bench.rms_norm_bytes(4, 8, "fwd") == (2 * 32 + 8) * 2 + 16
    assert bench.rope_bytes(1) == (2 * 40 * 128 + 2 * 128) * 2


def test_bench_backward_figure_subtracts_the_training_forward(monkeypatch):
    """The backward's graph time is (forward + backward) - the forward with grad enabled (what a training
    step runs; torch.compile compiles it apart from the no_grad forward), not - the no_grad forward.
    The timers are stand-ins that say which forward they were given (the real ones need a GPU)."""
    from course_lib.bench import fused as bench

    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append("train")
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append("backward")
            return g * 2

    def fn(x):
        if torch.is_grad_enabled():
            return Probe.apply(x)
        seen.append("no_grad")
        return x * 2

    def fake_graph_ms(f):
        seen.clear()
        f()
        return {("no_grad",): 1.0, ("train",): 2.0, ("train", "backward"): 5.0}[tuple(seen)]

    monkeypatch.setattr(bench, "graph_ms", fake_graph_ms)
    monkeypatch.setattr(bench, "benchmark", lambda f: (f(), 1.0)[1])
    x, dy = torch.randn(8, requires_grad=True), torch.randn(8)
    fwd, bwd = bench.measure_fwd_bwd(fn, (x,), (dy,), {"fwd": 10**6, "bwd": 10**6}, 1.0)
    assert fwd["graph_ms"] == 1.0, fwd
    assert (bwd["graph_fwd_bwd_ms"], bwd["graph_train_fwd_ms"], bwd["graph_ms"]) == (5.0, 2.0, 3.0), bwd


@pytest.mark.skipif(course_lib.ON_GPU, reason="on a GPU `make bench BENCH=host_time` measures")
def test_host_time_bench_skips_on_a_cpu(tmp_path, capsys):
    from course_lib.bench import host_time

    assert host_time.main(quick=True, out=tmp_path) == 0
    assert "skipped" in capsys.readouterr().out and not list(tmp_path.iterdir())
