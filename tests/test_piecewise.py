"""course_lib.models.piecewise: a serving step's work between its attention calls replayed from CUDA graphs
(piecewise), against the same step run as usual; its buckets, the weights it follows, what it refuses."""

from __future__ import annotations

import copy

import pytest
import torch

import course_lib
from course_lib.decode.batching import ContinuousBatcher
from course_lib.decode.cache import PagedKVCache
from course_lib.decode.paged_kv import PagedKV
from course_lib.models import piecewise
from course_lib.models.llama import _PIECEWISE, Llama, LlamaConfig
from course_lib.models.piecewise import Weights, bucket

gpu = pytest.mark.skipif(not course_lib.ON_GPU, reason="CUDA graphs need a GPU")


def test_buckets_pad_little_past_256_tokens():
    tokens = (1, 16, 17, 100, 256, 257, 3280, 8192)
    assert [bucket(t) for t in tokens] == [16, 16, 32, 128, 256, 512, 3328, 8192]
    for t in range(257, 9000, 97):
        assert t <= bucket(t) < t + 256 and bucket(t) % 256 == 0


def test_weights_tell_a_parameter_changed_in_place_replaced_or_moved():
    model = Llama(LlamaConfig(n_layers=2))
    weights = Weights(model)
    assert not weights.changed() and len(weights.params) == len(list(model.parameters())) + 1  # tied output
    with torch.no_grad():
        model.layers[1].feed_forward.w3.weight.mul_(2.0)  # as an optimizer's step
    assert weights.changed()
    weights = Weights(model)
    model.layers[0].attention.wo.weight = torch.nn.Parameter(model.layers[0].attention.wo.weight.clone())
    assert weights.changed()
    weights = Weights(model)
    model.float()  # already float32: nothing moves
    assert not weights.changed()
    model.double()
    assert weights.changed()
    with torch.inference_mode():
        frozen = Llama(LlamaConfig(n_layers=1))
    assert not Weights(frozen).changed()


def test_piecewise_graphs_need_a_cuda_model_and_a_token_limit():
    model = Llama(LlamaConfig(n_layers=1))
    if not course_lib.ON_GPU:
        with pytest.raises(ValueError, match="CUDA graphs need a model on a CUDA device"):
            model.use_piecewise_graphs()
        return
    model = model.cuda()
    with pytest.raises(ValueError, match="max_tokens"):
        model.use_piecewise_graphs(max_tokens=0)
    model.use_piecewise_graphs(max_tokens=64, capture=(5, 40))  # captured ahead, as a server at its start
    graphs = _PIECEWISE[model]
    assert graphs.captures == 2 and sorted(graphs.pieces) == [16, 64]
    with pytest.raises(ValueError, match="100 tokens is more than max_tokens=64"):
        model.use_piecewise_graphs(max_tokens=64, capture=[100])
    with pytest.raises(ValueError, match="token count"):
        graphs.capture([0])
    copy.deepcopy(model)  # the graphs live beside the model: a copy carries none
    model.use_piecewise_graphs(False)
    assert model not in _PIECEWISE


def _model(backend="course_lib"):
    torch.manual_seed(0)
    config = LlamaConfig(dim=256, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=512, max_seq_len=2048)
    return Llama(config, backend).to("cuda", torch.bfloat16).eval()


@pytest.mark.parametrize("backend", ["sdpa", "course_lib"])
def test_the_pieces_cut_a_step_at_its_attention_calls(monkeypatch, backend):
    """The pieces' arithmetic on any machine: each "graph" run as the function it would capture (CPU, float32), a
    mixed step of 5 + 9 + 1 tokens padded to 16 rows, twice over the same buffers, against the step as usual."""
    monkeypatch.setattr(piecewise, "graphed", lambda fn, pool=None: fn)
    torch.manual_seed(0)
    config = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96, max_seq_len=128)
    model = Llama(config, backend).to(course_lib.DEVICE).eval()
    c = model.config
    cache = PagedKVCache(c.n_layers, 16, 8, c.n_kv_heads, c.head_dim, torch.float32, course_lib.DEVICE)
    tokens, positions, kv = _step(model, cache, (5, 9, 1), course_lib.DEVICE)
    want = model.forward_step(tokens, positions, kv)
    with torch.no_grad():  # as forward_step runs them
        pieces = piecewise._Pieces(model, bucket(15), None)
        runs = [pieces.run(model, tokens, positions, kv) for _ in range(2)]
    for got in runs:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert pieces.x.shape == (16, c.dim) and len(pieces.replays) == c.n_layers + 1


def _step(model, cache, lens, device="cuda"):
    """A step over new sequences of `lens` tokens (fresh ids), the last one after 40 tokens already cached."""
    g = torch.Generator().manual_seed(sum(lens))
    seqs = list(range(len(lens)))
    for s in seqs:
        cache.add_sequence(s)
    cache.append(seqs[-1], 40)  # its earlier tokens' pages (their K/V: whatever the pool holds, as for all)
    slots = torch.cat([cache.append(s, n) for s, n in zip(seqs, lens)])
    kv = PagedKV.for_step(cache, seqs, list(lens), slots)
    tokens = torch.randint(0, model.config.vocab_size, (sum(lens),), generator=g).to(device)
    positions = torch.cat([torch.arange(n) + (40 if s == seqs[-1] else 0) for s, n in zip(seqs, lens)]).to(
        device
    )
    return tokens, positions, kv


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("backend", ["course_lib", "sdpa"])
@pytest.mark.parametrize("lens", [(37,), (5, 300, 1), (1300, 1260)])
def test_a_step_replayed_in_pieces_gives_the_step_as_usual(backend, lens):
    """Logits of ragged steps (a prefill, a mixed step of three sequences, a step over two long prompts that takes
    the dense prefill route) with the step's work between attention calls replayed, against the same step run as
    usual on the same cache (a step writes the same K/V each time); the padded rows change nothing."""
    model = _model(backend)
    c = model.config
    cache = PagedKVCache(c.n_layers, 192, 16, c.n_kv_heads, c.head_dim, torch.bfloat16, "cuda")
    tokens, positions, kv = _step(model, cache, lens)
    assert (kv.prefill is not None) == (lens == (1300, 1260))
    want = model.forward_step(tokens, positions, kv).clone()
    model.use_piecewise_graphs()
    try:
        graphs = _PIECEWISE[model]
        for _ in range(2):  # captured, then replayed
            got = model.forward_step(tokens, positions, kv)
            assert got.shape == want.shape and got.dtype == torch.float32
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
        assert graphs.captures == 1 and list(graphs.pieces) == [bucket(sum(lens))]
    finally:
        model.use_piecewise_graphs(False)


@pytest.mark.gpu
@gpu
def test_piecewise_graphs_follow_weight_changes_and_leave_long_steps_as_they_are():
    """A weight changed in place (as an optimizer does) or replaced, or the backend changed: the graphs are captured
    again and the logits follow (the stacked Q/K/V and W1/W3 are copies the old graphs would read); a step of more
    than max_tokens tokens runs as usual."""
    model = _model()
    c = model.config
    cache = PagedKVCache(c.n_layers, 128, 16, c.n_kv_heads, c.head_dim, torch.bfloat16, "cuda")
    tokens, positions, kv = _step(model, cache, (50, 20))
    model.use_piecewise_graphs(max_tokens=64)
    graphs = _PIECEWISE[model]
    try:
        assert model.forward_step(tokens, positions, kv) is not None and graphs.captures == 0  # 70 > 64
        model.use_piecewise_graphs(max_tokens=128)
        graphs = _PIECEWISE[model]
        before = model.forward_step(tokens, positions, kv).clone()
        with torch.no_grad():
            model.layers[1].attention.wk.weight.mul_(-1.5)  # in place: the stacked Q/K/V changes
            model.layers[2].feed_forward.w3.weight.mul_(2.0)
        got = model.forward_step(tokens, positions, kv).clone()
        assert graphs.captures == 2
        model.use_piecewise_graphs(False)
        want = model.forward_step(tokens, positions, kv)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
        assert (got - before).abs().max() > 0.1  # the change is one the logits show
        model.use_piecewise_graphs(max_tokens=128)
        graphs = _PIECEWISE[model]
        model.forward_step(tokens, positions, kv)
        model.layers[0].attention.wo.weight = torch.nn.Parameter(model.layers[0].attention.wo.weight * 0.5)
        got = model.forward_step(tokens, positions, kv).clone()
        assert graphs.captures == 2
        model.backend = "sdpa"  # other kernels: captured again
        got_sdpa = model.forward_step(tokens, positions, kv).clone()
        assert graphs.captures == 3
        model.use_piecewise_graphs(False)
        torch.testing.assert_close(got_sdpa, model.forward_step(tokens, positions, kv), atol=2e-2, rtol=2e-2)
        model.backend = "course_lib"
        torch.testing.assert_close(got, model.forward_step(tokens, positions, kv), atol=2e-2, rtol=2e-2)
    finally:
        model.use_piecewise_graphs(False)


@pytest.mark.gpu
@gpu
def test_a_batcher_with_cuda_graphs_serves_the_same_tokens():
    """ContinuousBatcher(cuda_graphs=True) turns the pieces on: prefill chunks and mixed steps replayed, decode
    steps whole; greedy tokens as without graphs."""
    model = _model()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (90, 17, 300, 5)]

    def serve(graphs):
        batcher = ContinuousBatcher(model, 96, 16, max_batch=3, max_step_tokens=128, cuda_graphs=graphs)
        ids = [batcher.submit(p, 6) for p in prompts]
        out = batcher.run()
        return [out[i] for i in ids]

    try:
        want = serve(False)
        assert serve(True) == want
        assert _PIECEWISE[model].captures >= 2
    finally:
        model.use_piecewise_graphs(False)
