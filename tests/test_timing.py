"""course_lib.perf.timing: the benchmark timer's unit, attention FLOP counts, and interleaved timings that
put each call first in turn."""

import time

import pytest
import torch

import course_lib
from course_lib.perf import timing


def test_timing_and_flops():
    assert timing.benchmark(lambda: torch.randn(64, 64) @ torch.randn(64, 64)) > 0
    if not course_lib.ON_GPU:  # the CPU timer's unit: a 2 ms sleep reads as 2 ms, not 2e-3 or 2000
        slept = timing.benchmark(lambda: time.sleep(0.002), cpu_reps=3)
        assert 2.0 <= slept < 50.0, slept
    assert timing.attention_flops(1, 1, 128, 128, 64) == 4 * 128 * 128 * 64
    assert (
        timing.attention_flops(2, 4, 128, 128, 64, causal=True, mode="fwd_bwd")
        == 3.5 * 0.5 * 4 * 8 * 128**2 * 64
    )
    with pytest.raises(ValueError, match="mode"):
        timing.attention_flops(1, 1, 8, 8, 8, mode="sideways")
    with pytest.raises(ValueError, match="Nq = Nk only"):  # top-left 1 x 1024 sees 1 key, bottom-right all
        timing.attention_flops(1, 1, 1, 1024, 64, causal=True)


def test_interleaved_timings_put_each_call_first_in_turn():
    order = []

    def timer(fn):
        order.append(fn())
        return float(len(order))

    calls = {name: (lambda name=name: name) for name in "abc"}
    times = timing.interleaved(calls, 4, timer)
    assert "".join(order) == "abc" + "bca" + "cab" + "abc", order  # each pass starts one call later
    assert times == {"a": [1.0, 6.0, 8.0, 10.0], "b": [2.0, 4.0, 9.0, 11.0], "c": [3.0, 5.0, 7.0, 12.0]}
    real = timing.interleaved({"matmul": lambda: torch.randn(8, 8) @ torch.randn(8, 8)}, 2)  # benchmark
    assert len(real["matmul"]) == 2 and min(real["matmul"]) > 0, real
    with pytest.raises(ValueError, match="passes"):
        timing.interleaved(calls, 0, timer)
    for bad in ({}, {"a": 1}):
        with pytest.raises(TypeError, match="functions"):
            timing.interleaved(bad, 1, timer)
