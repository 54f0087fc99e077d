"""Tests of course_lib.decode.prefill_split: a cached prompt's prefill attention with its keys split.

On any machine: the head-major gather, and no split off a Hopper GPU. On a Hopper GPU: a prefill
step's sequence after cached tokens takes the split route (`PagedKV`), against float64 attention over its keys and
against the dense FlashAttention-2 route, d = 64 and 128, grouped heads, pages scattered, a length no page
boundary ends.
"""

from __future__ import annotations

import pytest
import torch

import course_lib
from course_lib.attention.reference import attention as reference_attention
from course_lib.decode import gather, paged_kv, prefill_split
from course_lib.decode.cache import PagedKVCache
from course_lib.decode.paged_kv import PagedKV

DEV = course_lib.DEVICE
ON_HOPPER = course_lib.ON_GPU and torch.cuda.get_device_capability()[0] == 9


def test_head_major_gather():
    """`gather.gather_heads` reads a sequence's first tokens, page by page, as (1, Hkv, length, d) each of K and V,
    contiguous: the tokens of its pages, head by head, cut at a length no page boundary ends."""
    g = torch.Generator().manual_seed(3)
    k_pool, v_pool = (
        torch.randn(7, 4, 3, 8, generator=g).to(DEV) for _ in range(2)
    )  # (pages, page_size, Hkv, d)
    pages = torch.tensor([5, 2, 6], dtype=torch.int32, device=DEV)
    k, v = gather.gather_heads(k_pool, v_pool, pages, 10)
    for got, pool in ((k, k_pool), (v, v_pool)):
        assert got.shape == (1, 3, 10, 8) and got.is_contiguous()
        want = torch.cat([pool[5], pool[2], pool[6, :2]]).transpose(0, 1)
        assert torch.equal(got[0], want)


def test_no_split_off_a_hopper_gpu():
    """Where the Gluon kernel cannot run (the CPU, another GPU) the route says so and the dense route runs."""
    if ON_HOPPER:
        pytest.skip("a Hopper GPU splits")
    q = torch.randn(300, 4, 64)
    pool = torch.randn(200, 16, 2, 64)
    assert prefill_split.split_prefill(q, pool, pool, torch.arange(125), 2000) is None


@pytest.mark.parametrize("splits", (0, -1, 2.0, True, "3"))
def test_a_split_count_that_is_not_a_positive_int_is_named(splits):
    """`split_prefill`'s splits: None or an int >= 1, else a ValueError before anything runs (a bad count must not
    reach the kernel, whose failure would turn the Gluon route off for the process)."""
    q, pool = torch.randn(300, 4, 64), torch.randn(200, 16, 2, 64)
    with pytest.raises(ValueError, match="splits must be None or an int >= 1"):
        prefill_split.split_prefill(q, pool, pool, torch.arange(125), 2000, splits=splits)


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (compute capability 9.x)")
@pytest.mark.parametrize("stream", (False, True), ids=("key splits", "stream-K"))
@pytest.mark.parametrize("d", (64, 128))
def test_a_cached_prompts_prefill_splits_its_keys(monkeypatch, request, d, stream):
    """A prefill step of 300 new tokens after 2500 cached ones (16 query, 4 K/V heads, pages of 16 scattered):
    the split route runs (48 tiles on the GPU's SMs: `key_splits` > 1; or, as if the GPU had 16 SMs, stream-K:
    `hopper.stream_work`), twice (the second time from its plan), and matches float64 attention over the
    sequence's keys, and the dense FlashAttention-2 route."""
    for forget in (prefill_split._choice.cache_clear, prefill_split.PLANS.clear):  # choices made for 16 SMs
        forget()
        request.addfinalizer(forget)
    if stream:
        monkeypatch.setattr(prefill_split, "sm_count", lambda index: 16)
    monkeypatch.setattr(paged_kv, "DENSE_PREFILL_MIN_ROWS", 64)
    monkeypatch.setattr(paged_kv, "DENSE_PREFILL_MIN_PAIRS", 1000)
    monkeypatch.setattr(prefill_split, "MIN_PAIRS", 1000)
    calls = []
    real = prefill_split.split_prefill
    monkeypatch.setattr(paged_kv, "split_prefill", lambda *a: calls.append(real(*a)) or calls[-1])
    g = torch.Generator().manual_seed(d)
    hq, hkv, page, cached, n = 16, 4, 16, 2500, 300
    cache = PagedKVCache(1, 200, page, hkv, d, torch.bfloat16, "cuda")
    cache.add_sequence(9)  # holds pages first, so that the sequence's pages are not in order
    cache.append(9, 40)
    cache.add_sequence(0)
    earlier = cache.append(0, cached)
    cache.write(
        0, earlier, *(torch.randn(cached, hkv, d, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    )
    slots = cache.append(0, n)
    kv = PagedKV.for_step(cache, [0], [n], slots)
    assert kv.prefill == [(n, cached + n, -(-(cached + n) // page))]
    q = torch.randn(n, hq, d, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(n, hkv, d, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    got = kv.attend(0, q, k, v)
    assert len(calls) == 1 and calls[0] is not None, "the split route did not run"
    choice = prefill_split._choice(d, hq, hkv, n, cached + n, q.device.index)
    assert (choice[2] is not None) == stream, choice
    again = kv.attend(0, q, k, v)
    assert len(calls) == 2 and torch.equal(again, got), "the call repeated from its plan differs"
    assert any(isinstance(p, prefill_split.SplitPlan) for p in prefill_split.PLANS.values()), "no plan kept"
    monkeypatch.setattr(paged_kv, "split_prefill", lambda *a: None)
    dense = PagedKV.for_step(cache, [0], [n], slots).attend(0, q, k, v)
    length = cached + n
    ids = cache.block_table([0])[0].long()
    pools = (cache.k_pages[0], cache.v_pages[0])
    keys, values = (pool[ids].flatten(0, 1)[:length].double().cpu() for pool in pools)

    def heads(t):  # (tokens, heads, d) -> (1, heads, tokens, d)
        return t.transpose(0, 1).unsqueeze(0)

    ref = reference_attention(heads(q.double().cpu()), heads(keys), heads(values), "bottom_right")[
        0
    ].transpose(0, 1)
    err_dense = (dense.double().cpu() - ref).abs().max().item()
    assert got.shape == (n, hq, d) and got.is_contiguous()
    ids = cache.block_table([0])[0].to("cuda")
    for splits in (None, 1, 2, 3):  # the route's pick, then each count: the token-major output and partials
        out = got if splits is None else prefill_split.split_prefill(q, *pools, ids, length, splits=splits)
        err = (out.double().cpu() - ref).abs().max().item()
        assert err <= max(2 * err_dense, 1e-2), f"{splits} splits: {err:.2e}, dense route {err_dense:.2e}"
