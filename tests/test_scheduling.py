"""Batch management (course_lib.serving.scheduling, notebook 14): static and continuous batching generate the
same greedy tokens; the step counts follow the prediction; the measurement records every request. Preemption
(course_lib.decode.batching): recompute and swap both give the tokens of an unpreempted run, and no page leaks."""

from __future__ import annotations

import pytest
import torch

import course_lib
from course_lib.decode.batching import ContinuousBatcher
from course_lib.decode.cache import OutOfPages, PagedKVCache
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


# --------------------------------------------------------------------------------------------------
# Preemption: recompute or swap
# --------------------------------------------------------------------------------------------------
def _held_pages_balance(batcher):
    """Every page's reference count is the number of sequences that hold it, and the free list holds exactly
    the pages nobody holds: no page leaked, none handed out twice."""
    alloc = batcher.cache.allocator
    held = [0] * alloc.num_pages
    for seq in batcher.cache.seqs.values():
        for page in seq.pages:
            held[page] += 1
    assert alloc.refs == held
    assert sorted(alloc.free_list) == [p for p in range(alloc.num_pages) if held[p] == 0]


def _serve(batcher, prompts, new_tokens):
    """Run the prompts step by step, checking the page counts after each step; (tokens, prompt tokens fed)."""
    ids = [batcher.submit(p, new_tokens) for p in prompts]
    fed = 0
    while batcher.waiting or batcher.running:
        batcher.step()
        fed += sum(n for _, n in batcher.last_plan)
        _held_pages_balance(batcher)
        assert all(r.id not in batcher.cache.seqs for r in batcher.waiting)
    return [batcher.finished[i].generated for i in ids], fed


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_generate_the_unpreempted_tokens(mode):
    """Three requests in a pool too small for all: the last admitted is preempted while it decodes. Either mode
    gives the tokens of a run with room for all; swap feeds the model no token twice, recompute does."""
    model = ToyModel(DEV)
    prompts = [draw_workload(1, model.vocab, (15, 15), seed=s).prompts[0] for s in (1, 2, 3)]
    roomy = ContinuousBatcher(model, num_pages=64, page_size=4, max_batch=3, max_step_tokens=64)
    want, fed_once = _serve(roomy, prompts, 6)
    assert roomy.preemptions == 0
    tight = ContinuousBatcher(
        model, num_pages=9, page_size=4, max_batch=3, max_step_tokens=64, preemption=mode
    )
    got, fed = _serve(tight, prompts, 6)
    assert got == want
    assert tight.preemptions > 0, "the set-up must preempt"
    assert (fed == fed_once) if mode == "swap" else (fed > fed_once)
    assert not tight.swapped and tight.cache.allocator.num_free == 9


def test_swap_out_and_in_bring_the_keys_and_values_back_bit_for_bit():
    cache = PagedKVCache(2, 8, 4, 1, 8, torch.float32, "cpu")
    cache.add_sequence(0)
    cache.add_sequence(1)
    slots = cache.append(0, 6)
    for layer in range(2):
        cache.write(layer, slots, torch.randn(6, 1, 8), torch.randn(6, 1, 8))
    cache.append(1, 3)
    before = [pool[cache.seqs[0].pages].clone() for pool in cache.k_pages + cache.v_pages]
    swapped = cache.swap_out(0)
    assert 0 not in cache.seqs and cache.allocator.num_free == 7 and swapped.length == 6
    assert swapped.num_pages == 2 and swapped.nbytes == 2 * 2 * 2 * 4 * 8 * 4
    cache.append(1, 5)  # sequence 1 takes the freed pages meanwhile
    cache.swap_in(0, swapped)
    assert cache.seqs[0].length == 6 and len(cache.seqs[0].pages) == 2
    after = [pool[cache.seqs[0].pages] for pool in cache.k_pages + cache.v_pages]
    for a, b in zip(before, after):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="already exists"):
        cache.swap_in(0, swapped)
    with pytest.raises(TypeError, match="what swap_out returned"):
        cache.swap_in(5, "pages")
    big = cache.swap_out(0)
    cache.append(1, 20)  # 7 of the 8 pages held now
    state = (list(cache.allocator.refs), list(cache.allocator.free_list))
    with pytest.raises(OutOfPages, match="needs 2 pages to swap in"):
        cache.swap_in(0, big)
    assert (cache.allocator.refs, cache.allocator.free_list) == state and 0 not in cache.seqs


@pytest.mark.parametrize("mode", ["spill", None, "Swap"])
def test_an_unknown_preemption_mode_is_refused(mode):
    with pytest.raises(ValueError, match=r"preemption must be one of \('recompute', 'swap'\)"):
        ContinuousBatcher(ToyModel(DEV), num_pages=8, page_size=4, preemption=mode)
