"""course_lib.perf.syncs: what a GPU run of a block would wait for, copy to the GPU and launch, found on the CPU;
then the serving step it was made for, which waits once (for its new tokens) and looks its RoPE rows up once."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from course_lib import ON_GPU
from course_lib.decode import paged_decode_attention
from course_lib.decode.batching import ContinuousBatcher
from course_lib.models.llama import Llama, LlamaConfig
from course_lib.perf.syncs import on_gpu_branches, watch
from course_lib.serving.cascade import CascadeChoice
from course_lib.serving.prefix_cache import PrefixCachingBatcher

# `watch` reads a CPU run as a GPU would take it: the tests marked so run course_lib's kernels and model on the CPU,
# which the Triton kernels refuse once they are compiled for a GPU (COURSE_DEVICE=cuda); there, run the block on
# the GPU and profile it.
kernels_on_the_cpu = pytest.mark.skipif(
    ON_GPU, reason="runs course_lib's kernels on the CPU (the interpreter)"
)


def test_values_read_from_gpu_tensors_are_syncs_and_host_reads_are_not():
    x = torch.randn(8)  # made before the block: on the GPU
    with watch() as seen:
        y = x * 2
        y.sum().item()
        bool(y[0] > 0)
        y.tolist()
        y.cpu()
        y.to("cpu")
        host = torch.arange(4)  # no device: the host
        host.tolist()
        int(host[1])
        host.numpy()
        torch.from_numpy(np.arange(3)).tolist()
    assert seen.by("syncs", 0) == Counter(
        {"item()": 1, "__bool__()": 1, "tolist()": 1, "cpu()": 1, ".to() to the host": 1}
    )
    assert "test_syncs.py" in next(iter(seen.syncs))[1]  # where: this file's line


def test_outputs_sized_by_values_are_syncs():
    x = torch.randn(8)
    with watch() as seen:
        x[x > 0]
        torch.nonzero(x)
        torch.unique(x)
        x.repeat_interleave(torch.full((8,), 2))
        x.repeat_interleave(2)  # an int: the size is known
    assert seen.num_syncs == 4
    assert {kind.split()[0] for kind in seen.by("syncs", 0)} == {
        "__getitem__", "nonzero()", "unique()", "repeat_interleave(tensor",
    }  # fmt: skip


def test_copies_to_the_gpu_wait_unless_non_blocking():
    x = torch.randn(8)
    with watch() as seen:
        a = torch.tensor([1, 2], device=x.device)  # a blocking copy
        b = torch.tensor([1, 2]).to(x.device)  # a blocking copy
        c = torch.from_numpy(np.arange(2)).to(x.device, non_blocking=True)  # no wait
        x[torch.arange(2)]  # a host index is copied to the GPU by ATen (blocking)
        x.to(torch.float64)  # a dtype: no copy
        a.tolist(), b.tolist(), c.tolist()  # all three on the GPU now: reads
    assert seen.num_copies == 4 and seen.copy_bytes == 4 * 16
    assert sum(n for kind, n in seen.by("syncs", 0).items() if kind.startswith("blocking copy")) == 3
    assert seen.by("syncs", 0)["tolist()"] == 3


def test_launches_are_counted_views_are_not_and_mixed_tensors_are_named():
    x = torch.randn(4, 4)
    with watch() as seen:
        y = x * 2
        y.view(16), y.t(), y[1:3], y.unsqueeze(0)
        y.sum()
        host = torch.ones(4)
        host + 1  # host work: not a launch
        y + host  # a host tensor beside a GPU one: an error on a GPU
        y + torch.tensor(1.0)  # a 0-dim host scalar is allowed
    assert seen.by("ops", 0) == Counter({"mul": 1, "sum": 1, "add": 2})
    assert seen.host_ops >= 1
    assert seen.by("mixed", 0) == Counter({"add": 1})


@kernels_on_the_cpu
def test_triton_launches_are_counted_and_the_validate_switch_reads_as_on_a_gpu():
    """A paged decoding call: its kernels counted (not run); under `on_gpu_branches` validate=True reads the
    lengths and page ids (syncs on a GPU), validate=False reads nothing."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 4, 16, generator=g)
    pages = torch.randn(8, 4, 2, 16, generator=g)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    lens = torch.tensor([13, 9], dtype=torch.int32)
    for validate in (True, False):
        with on_gpu_branches(), watch(launches=False) as seen:
            paged_decode_attention(q, pages, pages, table, lens, validate=validate)
        assert seen.num_kernels >= 1 and "split_kv_kernel" in seen.kernels
        assert (seen.num_syncs > 0) == validate, seen.table()
    # kernels that run (interpreted here): the interpreter's own tensors are not counted
    with on_gpu_branches(), watch() as seen:
        out = paged_decode_attention(q, pages, pages, table, lens, validate=False)
    assert torch.equal(out, paged_decode_attention(q, pages, pages, table, lens))
    assert seen.num_kernels >= 1 and seen.num_syncs == 0, seen.table()


def _llama(backend: str) -> Llama:
    torch.manual_seed(0)
    config = LlamaConfig(dim=32, n_layers=3, n_heads=2, n_kv_heads=1, hidden_dim=48, max_seq_len=96)
    return Llama(config, backend).eval()


@kernels_on_the_cpu
@pytest.mark.parametrize("backend", ["sdpa", "course_lib"])
def test_a_serving_step_waits_once_for_its_tokens(backend):
    """A prefill step and a decode step of the continuous batcher, as a GPU would run them: one copy of the step's
    host arrays that does not wait, no wait inside the model's step (the fused RoPE checked its positions in
    every layer: a sync each), one read of the new tokens; the RoPE rows looked up once a step."""
    model = _llama(backend)
    batcher = ContinuousBatcher(model, num_pages=16, page_size=4, max_batch=2)
    batcher.submit(list(range(5, 25)), 3)
    batcher.submit(list(range(40, 47)), 3)
    for step in ("prefill", "decode"):
        with on_gpu_branches(), watch(depth=8, launches=False) as seen:
            batcher.step()
        assert seen.by("syncs", 0) == Counter({"tolist()": 1}), (step, seen.table())
        assert seen.num_copies == 1 and not seen.mixed, (step, seen.table())
        inner = seen.within("forward_step")
        assert inner.num_syncs == 0 and inner.num_copies == 0
        if backend == "sdpa":  # cos and sin rows: two gathers a step, none in a layer's `Attention.step`
            gathers = Counter()
            for (op, where), n in inner.ops.items():
                if op == "index" and where.startswith("llama.py"):
                    gathers[where.split(" < ")[0].split()[-1]] += n
            assert gathers == Counter({"forward_step": 2}), (step, seen.table())


@kernels_on_the_cpu
def test_forward_step_refuses_positions_past_the_model_on_the_cpu():
    model = _llama("sdpa")
    batcher = ContinuousBatcher(model, num_pages=8, page_size=4)
    batcher.submit([1, 2, 3], 1)
    batcher.step()
    from course_lib.decode.paged_kv import PagedKV

    cache = batcher.cache
    cache.add_sequence(9)
    kv = PagedKV.for_step(cache, [9], [2], cache.append(9, 2))
    with pytest.raises(ValueError, match=r"positions run from 95 to 96, but the model has positions 0\.\.95"):
        model.forward_step(torch.tensor([1, 2]), torch.tensor([95, 96]), kv)


@kernels_on_the_cpu
def test_a_cascade_step_waits_once_too():
    """A decode step that takes cascade attention over a shared prefix (`serving.cascade.CascadeKV`): its view's
    tensors in one copy that does not wait, the step's token ids in another, one read of the new tokens."""
    model = _llama("sdpa")
    choice = CascadeChoice(min_prefix=8)
    batcher = PrefixCachingBatcher(model, 40, 4, max_batch=4, max_step_tokens=64, kv_view=choice)
    prefix = list(range(3, 16))  # 3 full pages of 4 cached by the first request, shared by the next two
    batcher.submit(prefix + [20, 21], 4)
    batcher.step()
    for prompt in (prefix + [30, 31, 32], prefix + [40], list(range(60, 67))):
        batcher.submit(prompt, 4)
    while choice.steps == 0 and batcher.running:
        with on_gpu_branches(), watch(launches=False) as seen:
            batcher.step()
    assert choice.steps == 1
    assert seen.by("syncs", 0) == Counter({"tolist()": 1}) and seen.num_copies == 2, seen.table()
