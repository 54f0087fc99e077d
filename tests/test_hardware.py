"""Tests for course_lib.hardware: the datasheet table, the roofline arithmetic, the measurements
(tiny sizes on the CPU) and the GPU recorder's CPU-safe path."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import course_lib
from course_lib import hardware, records

NUMERIC_FIELDS = [
    f.name
    for f in dataclasses.fields(hardware.GPUSpec)
    if f.name not in ("name", "hbm_kind", "host_link", "sources")
]


@pytest.mark.parametrize("name", list(hardware.GPUS))
def test_every_datasheet_figure_has_a_source(name):
    g = hardware.GPUS[name]
    for field in NUMERIC_FIELDS:
        value = getattr(g, field)
        assert isinstance(value, (int, float)) and value > 0, f"{name}.{field} = {value!r}"
        src = g.sources.get(field)
        assert src and src.startswith("https://"), f"{name}.{field} has no source address: {src!r}"


@pytest.mark.parametrize(
    "name, clock_ghz, sram_tbps",
    [("A100", 1.41, 19.5), ("H100", 1.98, 33.5), ("H200", 1.98, 33.5), ("RTX 4090", 2.52, 41.3)],
)
def test_derived_clock_and_sram_bandwidth(name, clock_ghz, sram_tbps):
    g = hardware.gpu(name)
    assert g.clock_ghz == pytest.approx(clock_ghz, rel=0.01), f"{name} clock {g.clock_ghz}"
    assert g.sram_gbps / 1e3 == pytest.approx(sram_tbps, rel=0.01), f"{name} SRAM {g.sram_gbps} GB/s"
    assert g.sram_gbps > g.hbm_gbps, f"{name}: SRAM must be faster than HBM"


def test_balance_and_the_a100_non_matmul_ratio():
    a100 = hardware.gpu("A100")
    assert a100.matmul16_tflops / a100.fp32_tflops == 16
    assert a100.balance(True) == pytest.approx(312e12 / 2039e9)
    assert a100.balance(False) == pytest.approx(19.5e12 / 2039e9)


def test_unknown_gpu_names_the_known_ones():
    with pytest.raises(KeyError, match="A100"):
        hardware.gpu("V100")


def test_hierarchy_is_ordered_and_sourced():
    levels = hardware.hierarchy("H200")
    assert [lv["level"].split()[0] for lv in levels] == ["registers", "SRAM", "L2", "HBM", "host"]
    sizes = [lv["bytes"] for lv in levels if lv["bytes"] is not None]
    assert sizes == sorted(sizes), f"capacities not increasing: {sizes}"
    assert all(lv["source"].startswith("https://") for lv in levels)
    assert len(hardware.datasheet_rows()) == len(hardware.GPUS)
    docs = hardware.sources_by_document("A100")
    assert sorted(f for figs in docs.values() for f in figs) == sorted(hardware.gpu("A100").sources)


def test_roofline_arithmetic():
    assert hardware.machine_balance(100, 1000) == pytest.approx(100.0)
    assert hardware.attainable_tflops(10, 100, 1000) == pytest.approx(10.0)  # memory-bound: 1000 GB/s x 10
    assert hardware.attainable_tflops(1000, 100, 1000) == 100  # compute-bound: the peak
    # 1 GFLOP at 1 TFLOP/s = 1 ms; 1 GB at 100 GB/s = 10 ms: the memory time wins
    assert hardware.roofline_ms(1e9, 1e9, 1.0, 100.0) == pytest.approx(10.0)
    assert hardware.arithmetic_intensity(8.0, 4.0) == 2.0


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "fast"])
def test_roofline_rejects_bad_ceilings(bad):
    with pytest.raises(ValueError, match="peak_tflops"):
        hardware.machine_balance(bad, 100)
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        hardware.roofline_ms(1.0, 1.0, 1.0, bad)
    with pytest.raises(ValueError, match="nbytes"):
        hardware.arithmetic_intensity(1.0, 0)


def test_operation_costs_and_matmul_cost():
    costs = hardware.operation_costs(rows=4, cols=8, elem_bytes=2)
    n = 32
    assert costs["ReLU"] == (n, 2 * n * 2)
    assert costs["softmax"] == (5 * n, 2 * n * 2)
    assert costs["dropout"][1] == 2 * n * 2 + n  # output plus a 1-byte keep-mask
    flops, nbytes = hardware.matmul_cost(64, 4)
    assert (flops, nbytes) == (2 * 64**3, 3 * 64 * 64 * 4)
    assert flops / nbytes == pytest.approx(2 * 64 / (3 * 4))


def test_training_bytes_per_param():
    mixed = hardware.training_bytes_per_param(mixed_precision=True)
    fp32 = hardware.training_bytes_per_param(mixed_precision=False)
    assert sum(mixed.values()) == sum(fp32.values()) == 16
    p = mixed["parameters"]
    assert (mixed["parameters"] / p, mixed["gradients"] / p, mixed["optimizer states"] / p) == (1, 1, 6)


def test_measurements_on_tiny_sizes():
    gbps = hardware.measure_copy_bandwidth(4096, device="cpu")
    tflops = hardware.measure_matmul_tflops(32, torch.float32, device="cpu")
    assert math.isfinite(gbps) and gbps > 0, gbps
    assert math.isfinite(tflops) and tflops > 0, tflops


def test_measurements_reject_bad_arguments():
    with pytest.raises(TypeError, match="floating-point"):
        hardware.measure_copy_bandwidth(16, dtype=torch.int32, device="cpu")
    with pytest.raises(ValueError, match="n must be positive"):
        hardware.measure_matmul_tflops(0, device="cpu")
    with pytest.raises(ValueError, match="rows and cols"):
        hardware.measure_operations(0, 8, device="cpu")


def test_measure_operations_returns_points():
    points = hardware.measure_operations(8, 64, matmul_sizes=(16,), device="cpu")
    names = [p["name"] for p in points]
    assert names == list(hardware.operation_costs(8, 64, 4)) + ["matmul 16"]
    for p in points:
        assert p["ms"] > 0 and p["flops"] > 0 and p["bytes"] > 0, p
        assert hardware.achieved_tflops(p) > 0
    assert {p["kind"] for p in points} == {"element-wise", "reduction", "matmul"}


def test_measure_fusion_with_a_given_fuser_and_with_a_failing_one():
    ok = hardware.measure_fusion(1024, device="cpu", compile_fn=lambda f: f)
    assert ok["predicted_speedup"] == 4.0 and ok["eager_ms"] > 0 and ok["fused_ms"] > 0, ok

    def broken(f):
        raise RuntimeError("no compiler here")

    failed = hardware.measure_fusion(1024, device="cpu", compile_fn=broken)
    assert "no compiler here" in failed["error"], failed


def test_measure_record_cpu_path_round_trips_through_records(tmp_path, monkeypatch):
    # the real recorder compiles with torch.compile; a quick stand-in keeps the test fast on the CPU
    monkeypatch.setattr(torch, "compile", lambda f: f)
    data = hardware.measure_record(
        copy_numel=4096, matmul_n=32, rows=8, cols=64, matmul_sizes=(16,), fusion_numel=1024, device="cpu"
    )
    assert set(data) >= {"copy_gbps", "matmul_tflops", "operations", "fusion", "matmul_n"}
    assert data["matmul_tflops"]["float32"] > 0
    json.dumps(data)  # a record must be plain JSON
    records.save_record("hardware", data, folder=tmp_path)
    assert records.load_record("hardware", folder=tmp_path)["data"] == json.loads(json.dumps(data))


@pytest.mark.gpu
@pytest.mark.skipif(not course_lib.ON_GPU, reason="needs a CUDA GPU")
def test_measure_record_on_gpu_small():
    data = hardware.measure_record(
        copy_numel=2**20, matmul_n=512, rows=256, cols=256, matmul_sizes=(256,), fusion_numel=2**20
    )
    assert set(data["matmul_tflops"]) == {"bfloat16", "float16", "float32", "tf32"}
    assert data["operations_dtype"] == "bfloat16"
    assert "error" not in data["fusion"], data["fusion"]
    json.dumps(data)
