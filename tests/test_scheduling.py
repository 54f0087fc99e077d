"""Batch management (course_lib.serving.scheduling, notebook 14): static and continuous batching generate the
same greedy tokens; the step counts follow the prediction; the measurement records every request."""

from __future__ import annotations

import pytest

import course_lib
from course_lib.decode.batching import ContinuousBatcher
from course_lib.decode.toy_model import ToyModel
from course_lib.serving.scheduling import StaticBatcher, draw_workload, predict_steps, serve_workload

DEV = course_lib.DEVICE


def test_predict_steps_static_against_continuous():
    # batches [8, 1] and [1, 8] take 8 steps each in static batching; refilled at once, the second slot runs
    # 1 + 1 + 8 steps while the first runs 8
    assert predict_steps([8, 1, 1, 8], 2) == (16, 10)
    assert predict_steps([3, 3, 3], 3) == (3, 3)  # equal lengths: nothing to gain
    with pytest.raises(ValueError, match="max_batch"):
        predict_steps([1], 0)


def test_static_and_continuous_serve_the_same_tokens_and_steps_follow_the_prediction():
    model = ToyModel(DEV)
    work = draw_workload(4, model.vocab, prompt_lens=(3, 9), new_tokens=(1, 6), seed=4)
    results = {}
    for name, cls in (("static", StaticBatcher), ("continuous", ContinuousBatcher)):
        batcher = cls(model, num_pages=40, page_size=4, max_batch=2, max_step_tokens=64)
        served = serve_workload(batcher, work)
        results[name] = (served, batcher)
        assert served.tokens == sum(work.new_tokens) and len(served.ttft) == 4
        assert all(t >= 0 for t in served.ttft) and served.throughput > 0
        for i, p in enumerate(work.prompts):
            assert batcher.finished[i].generated == model.generate_full(p, work.new_tokens[i])
    static_steps, continuous_steps = predict_steps(work.new_tokens, 2)
    assert work.new_tokens == [4, 3, 6, 5], "the draw this test was written for"
    # the prefill step gives a request its first token, so a request takes as many steps as it has new tokens
    assert (results["static"][0].steps, results["continuous"][0].steps) == (static_steps, continuous_steps)
    assert continuous_steps < static_steps


def test_arrivals_are_waited_for_and_measured_from():
    model = ToyModel(DEV)
    work = draw_workload(3, model.vocab, prompt_lens=(2, 4), new_tokens=(2, 3), rate=50.0, seed=1)
    assert work.arrivals[0] == 0.0 and work.arrivals == sorted(work.arrivals)
    served = serve_workload(ContinuousBatcher(model, num_pages=16, page_size=4), work)
    assert served.seconds >= work.arrivals[-1] and set(served.summary()) >= {"tokens/s", "TTFT p90 ms"}
