"""Tests for course_lib.perf's hardware, roofline, ceilings and training_memory: the datasheet table, the
roofline arithmetic, the measurements (tiny sizes on the CPU) and the GPU recorder's CPU-safe path."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

import course_lib
from course_lib import perf, records

NUMERIC_FIELDS = [
    f.name
    for f in dataclasses.fields(perf.GPUSpec)
    if f.name not in ("name", "hbm_kind", "host_link", "sources")
]


@pytest.mark.parametrize("name", list(perf.GPUS))
def test_every_datasheet_figure_has_a_source(name):
    g = perf.GPUS[name]
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
    g = perf.gpu(name)
    assert g.clock_ghz == pytest.approx(clock_ghz, rel=0.01), f"{name} clock {g.clock_ghz}"
    assert g.sram_gbps / 1e3 == pytest.approx(sram_tbps, rel=0.01), f"{name} SRAM {g.sram_gbps} GB/s"
    assert g.sram_gbps > g.hbm_gbps, f"{name}: SRAM must be faster than HBM"


def test_balance_and_the_a100_non_matmul_ratio():
    a100 = perf.gpu("A100")
    assert a100.matmul16_tflops / a100.fp32_tflops == 16
    assert a100.balance(True) == pytest.approx(312e12 / 2039e9)
    assert a100.balance(False) == pytest.approx(19.5e12 / 2039e9)


def test_unknown_gpu_names_the_known_ones():
    with pytest.raises(KeyError, match="A100"):
        perf.gpu("V100")


def test_hierarchy_is_ordered_and_sourced():
    levels = perf.hierarchy("H200")
    assert [lv["level"].split()[0] for lv in levels] == ["registers", "SRAM", "L2", "HBM", "host"]
    sizes = [lv["bytes"] for lv in levels if lv["bytes"] is not None]
    assert sizes == sorted(sizes), f"capacities not increasing: {sizes}"
    assert all(lv["source"].startswith("https://") for lv in levels)
    assert len(perf.datasheet_rows()) == len(perf.GPUS)
    docs = perf.sources_by_document("A100")
    assert sorted(f for figs in docs.values() for f in figs) == sorted(perf.gpu("A100").sources)


def test_roofline_arithmetic():
    assert perf.machine_balance(100, 1000) == pytest.approx(100.0)
    assert perf.attainable_tflops(10, 100, 1000) == pytest.approx(10.0)  # memory-bound: 1000 GB/s x 10
    assert perf.attainable_tflops(1000, 100, 1000) == 100  # compute-bound: the peak
    # 1 GFLOP at 1 TFLOP/s = 1 ms; 1 GB at 100 GB/s = 10 ms: the memory time wins
    assert perf.roofline_ms(1e9, 1e9, 1.0, 100.0) == pytest.approx(10.0)
    assert perf.arithmetic_intensity(8.0, 4.0) == 2.0
    # NumPy and 0-d tensor numbers are numbers (once refused); bools and negative or infinite costs are not
    assert perf.machine_balance(np.float32(100), torch.tensor(1000.0)) == pytest.approx(100.0)
    for call, name in (
        (lambda: perf.machine_balance(True, 1000), "peak_tflops"),
        (lambda: perf.attainable_tflops(10, 100, 0), "bandwidth_gbps"),
        (lambda: perf.attainable_tflops(float("nan"), 100, 1000), "intensity"),
        (lambda: perf.arithmetic_intensity(-10, 5), "flops"),
        (lambda: perf.roofline_ms(1e9, float("inf"), 1.0, 100.0), "nbytes"),
        (lambda: perf.achieved_tflops({"flops": 1e9, "ms": 0}), "ms"),
    ):
        with pytest.raises(ValueError, match=f"^{name} must be a (positive|non-negative) finite number"):
            call()


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "fast"])
def test_roofline_rejects_bad_ceilings(bad):
    with pytest.raises(ValueError, match="peak_tflops"):
        perf.machine_balance(bad, 100)
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        perf.roofline_ms(1.0, 1.0, 1.0, bad)
    with pytest.raises(ValueError, match="nbytes"):
        perf.arithmetic_intensity(1.0, 0)


def test_operation_costs_and_matmul_cost():
    costs = perf.operation_costs(rows=4, cols=8, elem_bytes=2)
    n = 32
    assert costs["ReLU"] == (n, 2 * n * 2)
    assert costs["softmax"] == (5 * n, 2 * n * 2)
    assert costs["dropout"][1] == 2 * n * 2 + n  # output plus a 1-byte keep-mask
    flops, nbytes = perf.matmul_cost(64, 4)
    assert (flops, nbytes) == (2 * 64**3, 3 * 64 * 64 * 4)
    assert flops / nbytes == pytest.approx(2 * 64 / (3 * 4))


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: perf.operation_costs(-4, 8, 2), "operation_costs: rows must be >= 1, got -4"),
        (lambda: perf.operation_costs(4, 0, 2), "operation_costs: cols must be >= 1, got 0"),
        (lambda: perf.operation_costs(4, 8, 0), "elem_bytes must be >= 1"),
        (lambda: perf.matmul_cost(-64, 4), "matmul_cost: n must be >= 1, got -64"),
        (lambda: perf.matmul_cost(64, 4.5), "matmul_cost: elem_bytes must be an integer"),
    ],
)
def test_costs_refuse_sizes_that_are_not_counts(call, words):
    """Negative sizes once gave negative (or, squared, positive) FLOPs and bytes without a word."""
    with pytest.raises((TypeError, ValueError), match=words):
        call()


def test_training_bytes_per_param():
    mixed = perf.training_bytes_per_param(mixed_precision=True)
    fp32 = perf.training_bytes_per_param(mixed_precision=False)
    assert sum(mixed.values()) == sum(fp32.values()) == 16
    p = mixed["parameters"]
    assert (mixed["parameters"] / p, mixed["gradients"] / p, mixed["optimizer states"] / p) == (1, 1, 6)


def test_measurements_on_tiny_sizes():
    gbps = perf.measure_copy_bandwidth(4096, device="cpu")
    tflops = perf.measure_matmul_tflops(32, torch.float32, device="cpu")
    assert math.isfinite(gbps) and gbps > 0, gbps
    assert math.isfinite(tflops) and tflops > 0, tflops


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("numel, block", [(1000, 256), (4096, 1024), (17, 16)])
def test_block_sums_matches_float64_sums(dtype, numel, block):
    x = torch.randn(numel, device=course_lib.DEVICE, dtype=dtype)
    got = perf.block_sums(x, block=block)
    padded = torch.nn.functional.pad(x.double().cpu(), (0, -numel % block))
    want = padded.view(-1, block).sum(dim=1)
    assert got.dtype == torch.float32 and got.shape == want.shape, (dtype, numel, block, got.shape)
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-4 * block**0.5)


def test_block_sums_rejects_bad_input():
    with pytest.raises(TypeError, match="int32"):
        perf.block_sums(torch.arange(64, dtype=torch.int32, device=course_lib.DEVICE))
    with pytest.raises(ValueError, match=r"shape \(4, 16\)"):
        perf.block_sums(torch.randn(4, 16, device=course_lib.DEVICE))
    with pytest.raises(ValueError, match="power of two"):
        perf.block_sums(torch.randn(64, device=course_lib.DEVICE), block=24)


@pytest.mark.parametrize("reader", ["torch", "triton"])
def test_read_bandwidth_on_tiny_sizes(reader):
    gbps = perf.measure_read_bandwidth(4096, device=course_lib.DEVICE, reader=reader)
    assert math.isfinite(gbps) and gbps > 0, (reader, gbps)
    with pytest.raises(ValueError, match="reader"):
        perf.measure_read_bandwidth(4096, reader="numpy")
    with pytest.raises(ValueError, match="numel must be positive"):
        perf.measure_read_bandwidth(0, reader=reader)


def test_copy_time_of_a_size():
    ms = perf.measure_copy_time(1 << 16, torch.float32, device=course_lib.DEVICE)
    assert math.isfinite(ms) and ms > 0
    with pytest.raises(ValueError, match="at least two elements"):
        perf.measure_copy_time(4, torch.float32)


def test_read_time_of_a_size():
    ms = perf.measure_read_time(1 << 16, torch.float32, device=course_lib.DEVICE)
    assert math.isfinite(ms) and ms > 0
    with pytest.raises(ValueError, match="at least one element"):
        perf.measure_read_time(1, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not course_lib.ON_GPU, reason="needs a CUDA GPU")
def test_read_bandwidth_on_gpu_is_near_the_copy_bandwidth():
    # 2 GiB read, 1 GiB copied (2 GiB moved): both far beyond the L2. A read-only kernel should move bytes
    # at least about as fast as a copy does; a much lower figure means the kernel, not HBM, is the limit.
    read = perf.measure_read_bandwidth()
    triton_read = perf.measure_read_bandwidth(reader="triton")
    torch_read = perf.measure_read_bandwidth(reader="torch")
    copy = perf.measure_copy_bandwidth()
    print(
        f"read (triton) {triton_read:.0f} GB/s, read (torch sum) {torch_read:.0f} GB/s, copy {copy:.0f} GB/s"
    )
    for name, gbps in (("default", read), ("triton", triton_read), ("torch sum", torch_read)):
        assert gbps > 0.8 * copy, f"read ({name}) {gbps:.0f} GB/s, copy {copy:.0f} GB/s"


@pytest.mark.gpu
@pytest.mark.skipif(not course_lib.ON_GPU, reason="needs a CUDA GPU")
def test_benchmark_flushes_the_l2_with_a_read():
    """benchmark flushes (a small read is slower flushed than hot) and its flush leaves no dirty lines
    behind: a 128 MiB read times several microseconds less than under do_bench's write-flush."""
    from course_lib.runtime import triton

    small = torch.randn(2**22, device="cuda")  # 16 MiB: fits the L2 of an A100 or H100 / H200
    read_small = lambda: perf.block_sums(small)  # noqa: E731
    reads = perf.timing.graphed(lambda: [read_small() for _ in range(20)])  # GPU time, no launch cost
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    pairs = []
    for _ in range(3):  # make test-gpu shares the GPU among its workers: the best of three pairs decides
        start.record()
        reads()  # back to back: every read after the first finds the tensor in the L2
        end.record()
        torch.cuda.synchronize()
        hot = start.elapsed_time(end) / 20
        pairs.append((perf.benchmark(perf.timing.graphed(read_small)), hot))
        if pairs[-1][0] > 1.3 * hot:
            break
    assert any(flushed > 1.3 * hot for flushed, hot in pairs), pairs
    big = torch.randn(2**25, device="cuda")  # 128 MiB
    read_big = lambda: perf.block_sums(big)  # noqa: E731
    replay = perf.timing.graphed(read_big)
    clean = perf.benchmark(replay)
    dirty = triton.testing.do_bench(replay, return_mode="median")
    assert clean < dirty - 0.003, (clean, dirty)


def test_measurements_reject_bad_arguments():
    with pytest.raises(TypeError, match="floating-point"):
        perf.measure_copy_bandwidth(16, dtype=torch.int32, device="cpu")
    with pytest.raises(ValueError, match="n must be positive"):
        perf.measure_matmul_tflops(0, device="cpu")
    with pytest.raises(ValueError, match="rows and cols"):
        perf.measure_operations(0, 8, device="cpu")


def test_measure_operations_returns_points():
    points = perf.measure_operations(8, 64, matmul_sizes=(16,), device="cpu")
    names = [p["name"] for p in points]
    assert names == list(perf.operation_costs(8, 64, 4)) + ["matmul 16"]
    for p in points:
        assert p["ms"] > 0 and p["flops"] > 0 and p["bytes"] > 0, p
        assert perf.achieved_tflops(p) > 0
    assert {p["kind"] for p in points} == {"element-wise", "reduction", "matmul"}


def test_measure_fusion_with_a_given_fuser_and_with_a_failing_one():
    ok = perf.measure_fusion(1024, device="cpu", compile_fn=lambda f: f)
    assert ok["predicted_speedup"] == 4.0 and ok["eager_ms"] > 0 and ok["fused_ms"] > 0, ok

    def broken(f):
        raise RuntimeError("no compiler here")

    failed = perf.measure_fusion(1024, device="cpu", compile_fn=broken)
    assert "no compiler here" in failed["error"], failed


def test_measure_record_cpu_path_round_trips_through_records(tmp_path, monkeypatch):
    # the real recorder compiles with torch.compile; a quick stand-in keeps the test fast on the CPU
    monkeypatch.setattr(torch, "compile", lambda f: f)
    data = perf.measure_record(
        copy_numel=4096,
        read_numel=4096,
        matmul_n=32,
        rows=8,
        cols=64,
        matmul_sizes=(16,),
        fusion_numel=1024,
        device="cpu",
    )
    assert set(data) >= {"copy_gbps", "read_gbps", "matmul_tflops", "operations", "fusion", "matmul_n"}
    assert data["matmul_tflops"]["float32"] > 0
    json.dumps(data)  # a record must be plain JSON
    records.save_record("hardware", data, folder=tmp_path)
    assert records.load_record("hardware", folder=tmp_path)["data"] == json.loads(json.dumps(data))


@pytest.mark.gpu
@pytest.mark.skipif(not course_lib.ON_GPU, reason="needs a CUDA GPU")
def test_measure_record_on_gpu_small():
    data = perf.measure_record(
        copy_numel=2**20,
        read_numel=2**20,
        matmul_n=512,
        rows=256,
        cols=256,
        matmul_sizes=(256,),
        fusion_numel=2**20,
    )
    assert set(data["matmul_tflops"]) == {"bfloat16", "float16", "float32", "tf32"}
    known = [name for name in perf.GPUS if name in torch.cuda.get_device_name()]
    peak = perf.gpu(known[0]).matmul16_tflops if known else float("inf")  # a FLOP count 1000x off fails
    for dtype in ("bfloat16", "float16"):
        assert 0 < data["matmul_tflops"][dtype] <= 1.1 * peak, (dtype, data["matmul_tflops"], peak)
    assert 0 < data["copy_gbps"] < math.inf and 0 < data["read_gbps"] < math.inf, data
    assert data["operations_dtype"] == "bfloat16"
    assert "error" not in data["fusion"], data["fusion"]
    json.dumps(data)
