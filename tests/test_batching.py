"""course_lib.decode.batching and decode.graphs: the continuous-batching loop with a toy model against a
reference that recomputes full attention each step, what it refuses before a step, and decode steps
replayed as CUDA graphs on a GPU."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import course_lib
from course_lib.checks import token_ids, token_ids_array
from course_lib.decode.batching import ContinuousBatcher, Request
from course_lib.decode.cache import PagedKVCache
from course_lib.decode.graphs import table_width
from course_lib.decode.paged_kv import PagedKV, to_device
from course_lib.decode.toy_model import ToyModel

DEV = course_lib.DEVICE


# --------------------------------------------------------------------------------------------------
# Continuous batching with a toy model, against a reference that recomputes full attention each step
# --------------------------------------------------------------------------------------------------
def test_continuous_batching_equals_step_by_step_reference():
    model = ToyModel(DEV)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, model.vocab, (n,), generator=g).tolist() for n in (5, 9, 3, 14)]
    new = [3, 2, 4, 2]
    # 9 pages of 4 tokens and at most 3 sequences: requests wait, join and leave; a budget of 8 tokens
    # per step chunks the 14-token prompt's prefill, which then shares steps with decoding requests.
    batcher = ContinuousBatcher(model, num_pages=9, page_size=4, max_batch=3, max_step_tokens=8)
    ids = [batcher.submit(p, n) for p, n in zip(prompts, new)]
    got = batcher.run()
    for i, p, n in zip(ids, prompts, new):
        assert got[i] == model.generate_full(p, n), f"request {i} (prompt {len(p)} tokens)"
    assert batcher.cache.allocator.num_free == 9


def test_graph_table_width_is_the_next_power_of_two():
    assert [table_width(p) for p in (0, 1, 2, 3, 4, 5, 129, 256)] == [1, 1, 2, 4, 4, 8, 256, 256]


def test_cuda_graphs_need_a_cuda_model():
    with pytest.raises(ValueError, match="CUDA"):
        ContinuousBatcher(ToyModel("cpu"), num_pages=4, page_size=4, cuda_graphs=True)


def test_the_batcher_refuses_what_it_could_not_serve_before_a_step():
    """A model the kernel cannot serve (float64, a head dim of 12) is refused when the loop is made, where
    it once failed at the first step with its pages already appended; a bad eos_id at submit."""
    with pytest.raises(ValueError, match="cannot serve this model: dtype torch.float64 is unsupported"):
        ContinuousBatcher(ToyModel("cpu", torch.float64), num_pages=4, page_size=4)
    odd = ToyModel("cpu")
    odd.head_dim = 12
    with pytest.raises(ValueError, match="cannot serve this model: head dim d=12 is unsupported"):
        ContinuousBatcher(odd, num_pages=4, page_size=4)
    batcher = ContinuousBatcher(ToyModel("cpu"), num_pages=4, page_size=4)
    for eos in ("2", -1, ToyModel.vocab, 1.0, True):
        with pytest.raises(ValueError, match="eos_id must be None or a token id of the vocabulary"):
            batcher.submit([1, 2], 3, eos_id=eos)
    assert not batcher.waiting
    batcher.submit([1, 2], 3, eos_id=np.int64(5))  # any integer type


@pytest.mark.parametrize(
    "prompt",
    [
        [1, 2, 3],
        [np.int64(3), 4],
        (5, 6),
        torch.tensor([7, 8]),
        torch.tensor([7, 0, 255], dtype=torch.int32),
        torch.tensor([9, 3], dtype=torch.uint8),
        torch.arange(10, 250, 3)[::2],  # strided
        np.array([4, 200], dtype=np.int16),
        np.array([255, 0], dtype=np.uint64),
        [0, 255],
        [1, torch.tensor(0)],
        list(range(256)),
    ],
)
def test_token_ids_array_is_token_ids_as_int64(prompt):
    ids, array = token_ids_array("where", prompt, 256)
    assert ids == token_ids("where", prompt, 256) and all(type(t) is int for t in ids)
    assert array.dtype == np.int64 and array.tolist() == ids


@pytest.mark.parametrize(
    "prompt",
    [
        [1, True],
        [7, 0, False],
        [5] * 8 + [True],
        [1, 2.0],
        [-1, 2],
        [1, 256],
        [2**70],
        [1, None],
        "ab",
        5,
        [],
        torch.tensor([1, 0], dtype=torch.bool),
        torch.tensor([1.0, 2.0]),
        torch.tensor([[1, 2]]),
        torch.tensor([3, 256]),
        torch.tensor([-1, 3], dtype=torch.int8),
        torch.tensor(7),
        np.array([1.0, 2.0]),
        np.array([1, 256], dtype=np.uint16),
        np.array([2**63 + 1], dtype=np.uint64),
        np.array([True, False]),
    ],
)
def test_token_ids_array_refuses_what_token_ids_refuses(prompt):
    try:
        token_ids("where", prompt, 256)
    except (TypeError, ValueError) as error:
        with pytest.raises(type(error), match=f"^{re.escape(str(error))}$"):
            token_ids_array("where", prompt, 256)
    else:
        assert prompt == []  # an empty list is the batcher's to refuse (submit names it)
    with pytest.raises(ValueError, match=f"^where: prompt token ids must fit in int64; got {2**70}$"):
        token_ids_array("where", [1, 2**70])  # no vocabulary: any id >= 0, but not past int64


@pytest.mark.parametrize("as_array", [torch.tensor, np.array])
def test_a_tensor_prompt_is_read_whole_and_copied(monkeypatch, as_array):
    """A 1-D integer tensor or NumPy array (a tokenizer's return_tensors) is checked and converted whole, not id by
    id (`token_ids`, 4.6-6.1 ms at 32k ids), and the request keeps a copy: the caller may reuse its buffer."""
    from course_lib.checks import tokens

    prompt = as_array([5, 9, 3, 14])
    monkeypatch.setattr(tokens, "token_ids", lambda *a: pytest.fail("id by id"))
    batcher = ContinuousBatcher(ToyModel("cpu"), num_pages=8, page_size=4)
    rid = batcher.submit(prompt, 2)
    prompt[0] = 7
    assert batcher.waiting[0].id == rid and batcher.waiting[0].prompt == [5, 9, 3, 14]


def test_a_requests_ids_are_its_tokens():
    req = Request(0, [5, 6, 7], 4)
    req.generated += [8, 9]
    assert req.num_tokens == 5 and [req.token_at(i) for i in range(5)] == req.tokens
    for start in range(6):
        for stop in range(start, 6):
            got = req.ids(start, stop)
            assert got.dtype == np.int64 and got.tolist() == req.tokens[start:stop], (start, stop)
    assert np.shares_memory(req.ids(1, 3), req.prompt_ids)  # within the prompt: a view, converted once


def test_a_request_given_its_ids_makes_its_list_only_when_read():
    """`submit` hands a request its prompt as int64 ids alone: the steps read those, and the list is made on the
    first read of `prompt`, equal to what was submitted."""
    ids = np.array([300, 5, 70000], dtype=np.int64)
    req = Request(0, None, 4, prompt_ids=ids)
    req.generated.append(9)
    assert req.num_tokens == 4 and req.token_at(2) == 70000 and type(req.token_at(0)) is int
    assert req.ids(0, 4).tolist() == [300, 5, 70000, 9] and req._prompt is None  # nothing read the list yet
    assert req.prompt == [300, 5, 70000] and req.tokens == [300, 5, 70000, 9]
    assert "<3 tokens>" in repr(req) and req != Request(0, None, 4, prompt_ids=ids)  # equal only to itself
    with pytest.raises(ValueError, match="give the prompt as a list, or its ids as prompt_ids"):
        Request(1, None, 4)


@pytest.mark.parametrize("transposed", [False, True])
def test_a_step_without_padding_rows_attends_as_the_padded_layout(transposed):
    """Where every sequence brings Tq tokens, `PagedKV.attend` hands q to the kernel as it is (no zeros, scatter
    or gather): the same output as through the padded layout, for q contiguous or a transposed view."""
    g = torch.Generator().manual_seed(3)
    cache = PagedKVCache(1, 8, 4, 1, 16, torch.float32, DEV)
    for seq in (0, 1):
        cache.add_sequence(seq)
    slots = torch.cat([cache.append(0, 5), cache.append(1, 5)])
    kv = PagedKV.for_step(cache, [0, 1], [5, 5], slots)
    assert not kv.padded and PagedKV.for_step(cache, [0, 1], [5, 2], slots[:7]).padded
    q = torch.randn(2, 10, 16, generator=g).to(DEV)
    q = q.transpose(0, 1) if transposed else q.transpose(0, 1).contiguous()  # (T, Hq, d)
    k, v = (torch.randn(10, 1, 16, generator=g).to(DEV) for _ in range(2))
    got = kv.attend(0, q, k, v)
    kv.padded = True
    assert torch.equal(got, kv.attend(0, q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_prefill_step_attends_densely_as_the_paged_kernel_and_float64(monkeypatch, dtype):
    """A step whose every sequence brings enough new tokens and (new token, key) pairs (`DENSE_PREFILL_MIN_*`)
    attends each with the dense forward over its gathered K/V (`PagedKV.prefill_plan`): against float64
    attention over each sequence's keys and against the paged kernel, for a sequence whose earlier tokens are
    cached (bottom-right) and one wholly new (top-left), ragged lengths, pages scattered, grouped heads (Hq = 4,
    Hkv = 2); a step with a short sequence keeps the paged kernel."""
    from course_lib.decode import paged_kv

    monkeypatch.setattr(paged_kv, "DENSE_PREFILL_MIN_ROWS", 6)
    monkeypatch.setattr(paged_kv, "DENSE_PREFILL_MIN_PAIRS", 30)
    g = torch.Generator().manual_seed(5)
    hq, hkv, d = 4, 2, 16
    cache = PagedKVCache(1, 16, 4, hkv, d, dtype, DEV)
    cache.add_sequence(9)  # holds pages first, so that the others' pages are not in order
    cache.append(9, 6)
    for seq in (0, 1):
        cache.add_sequence(seq)
    earlier = cache.append(0, 7)  # sequence 0: 7 tokens cached before the step
    cache.write(0, earlier, *(torch.randn(7, hkv, d, generator=g).to(DEV, dtype) for _ in range(2)))
    new_lens = [9, 6]
    slots = torch.cat([cache.append(0, 9), cache.append(1, 6)])
    dense = PagedKV.for_step(cache, [0, 1], new_lens, slots)
    assert dense.prefill == [(9, 16, 4), (6, 6, 2)]
    assert PagedKV.for_step(cache, [0, 1], [9, 5], slots[:14]).prefill is None  # 5 < 6: the paged kernel
    assert PagedKV.prefill_plan([9, 6], np.array([16, 4]), 4) is None  # 6 x 4 < 30 pairs
    paged = PagedKV.for_step(cache, [0, 1], new_lens, slots)
    paged.prefill = None
    q = torch.randn(15, hq, d, generator=g).to(DEV, dtype)
    k, v = (torch.randn(15, hkv, d, generator=g).to(DEV, dtype) for _ in range(2))
    got = dense.attend(0, q, k, v)
    want_paged = paged.attend(0, q, k, v)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    start = 0
    for b, (n, length) in enumerate([(9, 16), (6, 6)]):
        ids = cache.block_table([0, 1])[b].long()
        keys = cache.k_pages[0][ids].flatten(0, 1)[:length].double().repeat_interleave(hq // hkv, 1)
        values = cache.v_pages[0][ids].flatten(0, 1)[:length].double().repeat_interleave(hq // hkv, 1)
        rows = q[start : start + n].double()
        s = torch.einsum("nhd,khd->hnk", rows, keys) / d**0.5
        visible = (
            torch.arange(length, device=s.device)[None, :]
            <= torch.arange(n, device=s.device)[:, None] + length - n
        )
        ref = torch.einsum("hnk,khd->nhd", s.masked_fill(~visible, float("-inf")).softmax(-1), values)
        assert (got[start : start + n].double() - ref).abs().max() < tol, b
        start += n
    assert (got.double() - want_paged.double()).abs().max() < 2 * tol


@pytest.mark.parametrize("max_batch, budget", [(2, 20), (1, 8)])
def test_prefill_steps_through_the_dense_route_generate_the_same_tokens(monkeypatch, max_batch, budget):
    """The batcher with the dense prefill route on from 6 new tokens: the toy model's tokens equal full
    attention's. (2, 20): two prompts prefilled in one dense step; (1, 8): a prompt in chunks of 8, the later
    chunks over the cached earlier ones (bottom-right)."""
    from course_lib.decode import paged_kv

    monkeypatch.setattr(paged_kv, "DENSE_PREFILL_MIN_ROWS", 6)
    monkeypatch.setattr(paged_kv, "DENSE_PREFILL_MIN_PAIRS", 30)
    plans = []
    dense = paged_kv.PagedKV._attend_dense
    monkeypatch.setattr(
        paged_kv.PagedKV, "_attend_dense", lambda self, *a: plans.append(self.prefill) or dense(self, *a)
    )
    model = ToyModel(DEV)
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, model.vocab, (n,), generator=g).tolist() for n in (13, 7, 21)]
    batcher = ContinuousBatcher(model, num_pages=20, page_size=4, max_batch=max_batch, max_step_tokens=budget)
    ids = [batcher.submit(p, 3) for p in prompts]
    got = batcher.run()
    for i, p in zip(ids, prompts):
        assert got[i] == model.generate_full(p, 3)
    seen = {tuple(plan) for plan in plans}
    if max_batch == 2:
        assert ((13, 13, 4), (7, 7, 2)) in seen
    else:
        assert ((8, 8, 2),) in seen and ((8, 16, 4),) in seen


def test_a_steps_host_arrays_reach_the_device_in_one_buffer():
    """`to_device`: each array's values, dtype and shape, read-only and empty ones too, every tensor a view of one
    buffer at a 16-byte boundary; `PagedKV.for_step` through it builds what the cache's own tensors hold."""
    prompt = np.arange(7, dtype=np.int64)
    prompt.flags.writeable = False
    arrays = [
        prompt[2:5],
        np.arange(6, dtype=np.int32).reshape(2, 3),
        np.zeros(0, np.int64),
        np.array([-1, 2**40]),
    ]
    got = to_device(arrays, DEV)
    for a, t in zip(arrays, got):
        assert t.device.type == torch.device(DEV).type and t.shape == a.shape
        assert t.cpu().numpy().dtype == a.dtype and t.cpu().tolist() == a.tolist()
    storage = {t.untyped_storage().data_ptr() for t in got}
    assert len(storage) == 1 and all(t.data_ptr() % 16 == 0 for t in got)
    cache = PagedKVCache(1, 8, 4, 1, 16, torch.float32, DEV)
    for seq in (0, 1):
        cache.add_sequence(seq)
    slots = torch.cat([cache.append(0, 5), cache.append(1, 2)])
    kv = PagedKV.for_step(cache, [0, 1], [5, 2], slots)
    assert torch.equal(kv.block_table, cache.block_table([0, 1])) and torch.equal(
        kv.cache_seqlens, cache.seqlens([0, 1])
    )
    assert kv.slots.cpu().tolist() == slots.tolist() and kv.rows.cpu().tolist() == [0, 1, 2, 3, 4, 8, 9]


@pytest.mark.gpu
@pytest.mark.skipif(not course_lib.ON_GPU, reason="CUDA graphs need a GPU")
def test_continuous_batching_replays_decode_steps_as_cuda_graphs():
    """Decode-only steps replayed as CUDA graphs give the reference's tokens: batches that shrink as
    requests leave (one graph per batch size) and block tables that outgrow a power of two (page size
    4: 9-24 tokens cross 4 and 8 pages), prefill steps run as they are in between."""
    model = ToyModel(DEV)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, model.vocab, (n,), generator=g).tolist() for n in (5, 9, 3, 14, 2)]
    new = [12, 6, 9, 10, 4]
    batcher = ContinuousBatcher(
        model, num_pages=40, page_size=4, max_batch=3, max_step_tokens=8, cuda_graphs=True
    )
    ids = [batcher.submit(p, n) for p, n in zip(prompts, new)]
    got = batcher.run()
    for i, p, n in zip(ids, prompts, new):
        assert got[i] == model.generate_full(p, n), f"request {i} (prompt {len(p)} tokens)"
    graphs = batcher.graphs
    assert graphs.replays > 10 and len(graphs.graphs) >= 3, (graphs.replays, sorted(graphs.graphs))
    assert {b for b, _ in graphs.graphs} >= {2, 3} and len({w for _, w in graphs.graphs}) >= 2
    assert batcher.cache.allocator.num_free == 40
    # the same loop serves the same requests again: each step shape replays a graph captured above
    captured, replays = dict(graphs.graphs), graphs.replays
    ids = [batcher.submit(p, n) for p, n in zip(prompts, new)]
    got = batcher.run()
    for i, p, n in zip(ids, prompts, new):
        assert got[i] == model.generate_full(p, n), f"request {i} (prompt {len(p)} tokens), second run"
    assert graphs.graphs == captured and graphs.replays > replays, sorted(graphs.graphs)
