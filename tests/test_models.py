"""course_lib.models: the capstone Llama (notebook 12): backends agree, transformers parity, training
learns, paged serving gives the greedy tokens."""

import copy

import pytest
import torch

import course_lib
from course_lib.models import (
    BACKENDS,
    KVCache,
    Llama,
    LlamaConfig,
    convert,
    count_parameters,
    data,
    generate,
    kv_cache_bytes_per_token,
    train,
)
from course_lib.testing import assert_close_to_reference, assert_grads_close_to_reference, relative_error

DEVICE = course_lib.DEVICE
TINY = dict(dim=64, n_layers=2, n_heads=4, hidden_dim=96, max_seq_len=96)
# fp32 on a GPU: other kernels than the CPU's (SDPA's own, other summation orders); exact IEEE under the
# interpreter. course_lib's own fp32 tile products are IEEE on the GPU too (`inputs.kernel_flags`).
TOL = dict(atol=2e-2, rtol=2e-2) if course_lib.ON_GPU else dict(atol=1e-4, rtol=1e-4)


def tiny_model(n_kv_heads=2, tie=True, std=0.02, seed=0, backend="sdpa", **kw):
    torch.manual_seed(seed)
    model = Llama(LlamaConfig(**{**TINY, **kw}, n_kv_heads=n_kv_heads, tie_embeddings=tie), backend)
    model.reset_parameters(std)
    return model.to(DEVICE)


def close(actual, expected, what: str) -> None:
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def close_grad(actual, expected, what: str) -> None:
    """`close`, and a bound on the relative error of the whole gradient: the attention weights' gradients
    are small next to TOL's atol (2-5e-4 at std 0.02), so atol alone would pass one scaled by 0.6, or on
    a GPU one of zeros. The bound: 1e-2 with TF32 products on a GPU, 1e-5 in float32 on the CPU (measured
    there: 4e-7 between the backends)."""
    close(actual, expected, what)
    err = relative_error(actual, expected)
    bound = 1e-2 if course_lib.ON_GPU else 1e-5
    assert err < bound, f"{what}: relative error {err:.3g} of the whole gradient (bound {bound:g})"


def logits_and_grads(model, tokens, backend):
    model.backend = backend
    model.zero_grad(set_to_none=True)
    logits, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_config_and_counts():
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        LlamaConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="backend"):
        Llama(LlamaConfig(**TINY), "flash")
    for tie in (True, False):
        config = LlamaConfig(**TINY, tie_embeddings=tie)
        assert Llama(config).num_parameters() == count_parameters(config), f"tie_embeddings={tie}"
    config = LlamaConfig(**TINY, n_kv_heads=2)
    assert kv_cache_bytes_per_token(config) == 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 kv heads, d 16, bf16


def test_bad_tokens_are_refused():
    model = tiny_model()
    with pytest.raises(TypeError, match="int64"):
        model(torch.zeros(2, 3, device=DEVICE))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.randint(0, 256, (1, 97), device=DEVICE))


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["MHA", "GQA2", "MQA"])
def test_backends_agree_on_logits_and_gradients(n_kv_heads):
    model = tiny_model(n_kv_heads)
    tokens = torch.randint(0, 256, (2, 41), device=DEVICE)
    ref_logits, ref_grads = logits_and_grads(model, tokens, "sdpa")
    for backend in ("eager", "course_lib"):
        logits, grads = logits_and_grads(model, tokens, backend)
        what = f"backend {backend} vs sdpa, n_kv_heads={n_kv_heads}, fp32, {DEVICE}"
        close(logits, ref_logits, f"logits, {what}")
        for name, g in grads.items():
            close_grad(g, ref_grads[name], f"grad {name}, {what}")


def test_course_lib_backend_under_torch_compile():
    """The capstone on course_lib's kernels (attention, RMSNorm, RoPE) inside torch.compile(fullgraph=True)
    (the aot_eager backend; a graph break raises): every kernel is a custom operator there, so one graph
    holds the training step, and its logits and gradients are the eager step's."""
    model = tiny_model()
    tokens = torch.randint(0, 256, (2, 41), device=DEVICE)
    eager_logits, eager_grads = logits_and_grads(model, tokens, "course_lib")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    model.zero_grad(set_to_none=True)
    logits, loss = compiled(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    close(logits, eager_logits, f"compiled course_lib logits, {DEVICE}")
    for name, p in model.named_parameters():
        close_grad(p.grad, eager_grads[name], f"compiled course_lib grad {name}, {DEVICE}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_cache_forward_equals_full_forward(backend):
    """Prefill a chunk, then a chunk of 5, then 1 token: bottom-right causal attention over the cache."""
    model = tiny_model(backend=backend)
    tokens = torch.randint(0, 256, (2, 30), device=DEVICE)
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(model.config, 2, 30, DEVICE)
        parts = [model(tokens[:, a:b], cache=cache, start_pos=a) for a, b in ((0, 24), (24, 29), (29, 30))]
    torch.testing.assert_close(
        torch.cat(parts, 1), full, **TOL, msg=lambda m: f"cached vs full, {backend}: {m}"
    )


def test_state_dict_names_round_trip():
    config = LlamaConfig(**TINY, n_kv_heads=2)
    names = convert.parameter_names(config)
    assert names == list(Llama(config).state_dict())
    hf = convert.to_hf_state_dict(Llama(config).state_dict())
    assert "model.layers.1.mlp.gate_proj.weight" in hf and "lm_head.weight" in hf
    back = convert.from_hf_state_dict(hf, config)
    assert sorted(back) == sorted(names)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_matches_transformers_llama(tie):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
    model = tiny_model(n_kv_heads=2, tie=tie, std=0.1)
    hf = convert.to_hf(model)
    tokens = torch.randint(0, 256, (2, 33), device=DEVICE)
    hf_out = hf(input_ids=tokens[:, :-1])  # its `labels` would be shifted inside: the loss is ours
    torch.nn.functional.cross_entropy(hf_out.logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    for backend in ("sdpa", "course_lib"):
        logits, grads = logits_and_grads(model, tokens, backend)
        what = f"backend {backend} vs transformers, tie={tie}"
        close(logits, hf_out.logits, f"logits, {what}")
        for name, g in grads.items():
            close_grad(g, hf_grads[convert.hf_name(name)], f"grad {name}, {what}")
    back = convert.from_hf(hf)
    torch.testing.assert_close(back(tokens), model(tokens), msg=lambda m: f"from_hf round trip: {m}")


_HF_SIZES = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=96,
)
_LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=500.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0
)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(rope_parameters={**_LLAMA3_ROPE, "original_max_position_embeddings": 16}), "llama3"),
        (dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0)), "linear"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(head_dim=32), "head_dim"),
    ],
    ids=["rope_llama3", "rope_linear", "gelu", "attention_bias", "mlp_bias", "head_dim"],
)
def test_from_hf_refuses_what_the_model_does_not_implement(overrides, field):
    """A transformers config whose result our Llama cannot reproduce (RoPE scaling, another activation,
    biases, a head_dim other than hidden_size / heads) is refused by name, not converted to other logits."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_HF_SIZES, **overrides)).eval()
    with pytest.raises(ValueError, match=field):
        convert.from_hf(hf)
        pytest.fail(f"from_hf accepted a transformers config with {overrides}")


def test_corpus_is_shipped_and_tokenised():
    text = data.load_corpus()
    assert len(text) > 300_000 and text.isascii()
    tokens = data.encode(text[:1000])
    assert tokens.dtype == torch.int64 and data.decode(tokens) == text[:1000]
    x, y = data.get_batch(tokens, 3, 17, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 17) and torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match="seq_len"):
        data.get_batch(tokens[:10], 1, 10)


def test_get_batch_draws_every_window():
    """Windows of seq_len + 1 tokens start anywhere in 0 .. len - seq_len - 1: the last one too (its target
    is the corpus's last token), and a text of exactly seq_len + 1 tokens gives its one window."""
    tokens = torch.randint(0, 256, (18,))
    x, y = data.get_batch(tokens, 2, 17, torch.Generator().manual_seed(0))
    assert torch.equal(x, tokens[:-1].expand(2, -1)) and torch.equal(y, tokens[1:].expand(2, -1)), (
        "18 tokens, seq_len 17: the one window"
    )
    tokens = torch.arange(20)  # distinct ids: a window's first token is its start
    x, _ = data.get_batch(tokens, 200, 16, torch.Generator().manual_seed(0))
    starts = set(x[:, 0].tolist())
    assert starts == set(range(4)), f"20 tokens, seq_len 16: starts drawn {sorted(starts)}, expected 0..3"


def test_short_training_run_lowers_the_loss():
    tokens = data.encode(data.load_corpus()[:50_000])
    model = tiny_model()
    history = train.train(model, tokens, steps=30, batch_size=8, seq_len=32, lr=1e-2, progress=False)
    first, last = sum(history["loss"][:3]) / 3, sum(history["loss"][-3:]) / 3
    assert last < first - 1.0, f"loss went from {first:.3f} to {last:.3f} in 30 steps"


def test_gradient_accumulation_equals_one_big_batch():
    tokens = data.encode(data.load_corpus()[:20_000])
    x, y = data.get_batch(tokens, 8, 24, torch.Generator().manual_seed(0), DEVICE)
    grads = []
    for chunks in (1, 4):
        model = tiny_model()
        for xs, ys in zip(x.chunk(chunks), y.chunk(chunks)):
            (model(xs, ys)[1] / chunks).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("backend", ["sdpa", "course_lib"])
def test_paged_generation_equals_step_by_step_greedy(backend):
    """Prompts of different lengths served together over the paged cache (page size 4, so sequences
    cross pages) give exactly the tokens of full recomputation, one token at a time."""
    model = tiny_model(n_kv_heads=2, std=0.3, backend=backend)  # large weights: varied greedy tokens
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 7, 12)]
    expected = [generate.greedy_reference(model, p, 6) for p in prompts]
    assert len({t for e in expected for t in e}) > 3, "weights too small: greedy tokens all the same"
    assert generate.greedy_cached(model, prompts, 6) == expected
    assert generate.serve(model, prompts, 6, page_size=4, max_step_tokens=8) == expected
    streamed = list(generate.stream(model, prompts, 6, page_size=4))
    assert sorted(t for i, t in streamed if i == 1) == sorted(expected[1])
    loop = generate.make_batcher(model, prompts, 6, page_size=4)  # one loop, two calls, as a server
    assert generate.serve(model, prompts, 6, batcher=loop) == expected
    assert generate.serve(model, prompts[::-1], 6, batcher=loop) == expected[::-1]
    assert loop.cache.allocator.num_free == loop.cache.allocator.num_pages and not loop.finished
    with pytest.raises(ValueError, match="its own sizes"):
        generate.serve(model, prompts, 6, batcher=loop, page_size=8)
    with pytest.raises(ValueError, match="another model"):
        generate.serve(tiny_model(backend=backend), prompts, 6, batcher=loop)


def test_serving_step_stacks_projections_and_follows_weight_changes():
    """A serving step's Q/K/V and W1/W3 matmuls run on stacked weights (`stacked_weight`), which follow the
    separate weights: an optimiser's step in place, a weight replaced and a dtype change each remake the stack,
    so the step's hidden states stay those of the separate matmuls."""
    from course_lib.models.llama import stacked_weight

    model = tiny_model(std=0.3)
    layer = model.layers[0]
    x = torch.randn(5, TINY["dim"], device=DEVICE)

    def check(what):
        att, mlp = layer.attention, layer.feed_forward
        for module, names in ((att, ("wq", "wk", "wv")), (mlp, ("w1", "w3"))):
            expected = torch.cat([getattr(module, n).weight for n in names])
            assert torch.equal(stacked_weight(module, names), expected), f"{what}: stale stack of {names}"
        with torch.no_grad():
            close(mlp.step(x.to(mlp.w1.weight.dtype)), mlp(x.to(mlp.w1.weight.dtype)), f"{what}: MLP step")

    check("first use")
    first = stacked_weight(layer.attention, ("wq", "wk", "wv"))
    assert stacked_weight(layer.attention, ("wq", "wk", "wv")) is first, "the stack is remade on every call"
    twin = copy.deepcopy(model).layers[0].attention  # a copy has its own weights, so its own stack
    assert stacked_weight(twin, ("wq", "wk", "wv")) is not first and torch.equal(
        stacked_weight(twin, ("wq", "wk", "wv")), first
    )
    loss = model(torch.randint(0, 256, (1, 9), device=DEVICE), torch.randint(0, 256, (1, 9), device=DEVICE))[
        1
    ]
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=10.0).step()
    check("after an optimiser's step")
    layer.feed_forward.w3.weight = torch.nn.Parameter(torch.randn_like(layer.feed_forward.w3.weight))
    check("after a weight replaced")
    model.to(torch.float64)
    check("after a dtype change")
    with torch.inference_mode():  # weights made here count no versions: the step keeps them separate
        made_there = tiny_model(std=0.3)
        assert stacked_weight(made_there.layers[0].attention, ("wq", "wk", "wv")) is None
        h = made_there.layers[0].feed_forward
        close(h.step(x), h(x), "MLP step, weights made under inference_mode")


def test_generation_may_fill_max_seq_len_and_no_more():
    """The last new token is returned, never fed back: a prompt of 3 and 6 new tokens run a model of
    max_seq_len 8 at positions 0..7, on every path; one token more is refused by name before any step
    runs (the batcher once ran into the RoPE table's end mid-step, its cache a token ahead)."""
    from course_lib.decode.batching import ContinuousBatcher

    model = tiny_model(std=0.3, max_seq_len=8)
    prompt = [5, 17, 3]
    expected = generate.greedy_reference(model, prompt, 6)
    assert generate.sample(model, prompt, 6) == expected
    assert generate.serve(model, [prompt], 6, page_size=4) == [expected]
    batcher = ContinuousBatcher(model, num_pages=4, page_size=4)
    for make in (
        lambda: generate.sample(model, prompt, 7),
        lambda: generate.serve(model, [prompt], 7),
        lambda: list(generate.stream(model, [prompt], 7)),
        lambda: batcher.submit(prompt, 7),
    ):
        with pytest.raises(ValueError, match=r"run the model at 9 positions .* max_seq_len = 8"):
            make()
    assert not batcher.waiting and batcher.cache.allocator.num_free == 4


def test_sample_through_the_cache_draws_what_full_recomputation_draws():
    """`generate.sample` (a KV cache) draws, from one seed, the tokens of a sampler that recomputes the
    whole sequence at every step; at temperature 0 it is greedy; too long a request is refused."""
    model = tiny_model(std=0.3)
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    got = generate.sample(model, prompt, 20, temperature=0.8, generator=torch.Generator().manual_seed(5))
    g, tokens = torch.Generator().manual_seed(5), list(prompt)
    with torch.no_grad():
        for _ in range(20):
            logits = model(torch.tensor([tokens], device=DEVICE))[0, -1].float().cpu()
            tokens.append(int(torch.multinomial(torch.softmax(logits / 0.8, -1), 1, generator=g)))
    assert got == tokens[len(prompt) :]
    assert len(set(got)) > 3, "the draws should vary"
    assert generate.sample(model, prompt, 8) == generate.greedy_reference(model, prompt, 8)
    with pytest.raises(ValueError, match="max_seq_len = 96"):
        generate.sample(model, prompt, 90)
    with pytest.raises(ValueError, match="temperature"):
        generate.sample(model, prompt, 3, temperature=-1.0)


def test_greedy_reference_returns_only_new_tokens_for_any_prompt_iterable():
    """The prompt may be any iterable of ids (list, tuple, tensor, a one-pass iterator, which must be read
    only once): the result is the max_new_tokens new tokens, as for a list."""
    model = tiny_model(std=0.3)
    prompt = torch.randint(0, 256, (5,)).tolist()
    expected = generate.greedy_reference(model, prompt, 3)
    assert len(expected) == 3, f"list prompt of 5, 3 new tokens: got {len(expected)} tokens"
    for kind, p in (("tuple", tuple(prompt)), ("tensor", torch.tensor(prompt)), ("iterator", iter(prompt))):
        got = generate.greedy_reference(model, p, 3)
        assert got == expected, (
            f"greedy_reference, {kind} prompt of 5, 3 new tokens: {got}, expected {expected}"
        )


@pytest.mark.gpu
@pytest.mark.skipif(not course_lib.ON_GPU, reason="needs a CUDA GPU")
def test_bf16_backends_agree_on_gpu():
    """bf16 weights, N = 512, d = 64: course_lib's logits and gradients as close to a float64 copy of the
    model as SDPA's are in bf16 (`testing.assert_grads_close_to_reference`)."""
    torch.manual_seed(0)
    config = LlamaConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=704, max_seq_len=512)
    model = Llama(config).to(DEVICE, torch.bfloat16)
    model64 = copy.deepcopy(model).double()
    tokens = torch.randint(0, 256, (2, 513), device=DEVICE)
    logits64, grads64 = logits_and_grads(model64, tokens, "sdpa")
    ref_logits, ref_grads = logits_and_grads(model, tokens, "sdpa")
    logits, grads = logits_and_grads(model, tokens, "course_lib")
    assert_close_to_reference(logits, logits64, ref_logits, "capstone Llama, bf16, N = 512: logits")
    assert_grads_close_to_reference(grads, grads64, ref_grads, "capstone Llama, bf16, N = 512")


@pytest.mark.gpu
@pytest.mark.skipif(not course_lib.ON_GPU, reason="needs a CUDA GPU")
def test_bench_train_quick_runs():
    from course_lib.bench import train as bench_train

    result = bench_train.run(quick=True)
    assert {r["provider"] for r in result["train"]} >= {"course_lib", "sdpa"}
    mains = [r for r in result["train"] if r["provider"] in ("course_lib", "sdpa")]
    assert all(r["status"] == "ok" for r in mains), mains  # quick sizes: nothing may run out of memory
    for r in result["train"]:
        if r["status"] == "ok":  # the profiler saw the step's kernels, and they fit in that step's wall time
            # (the profiled step's own: a parallel test run's other processes can slow one step, not the others)
            assert 0 < r["kernel_ms"] < 1.5 * r["kernel_wall_ms"] and r["kernels_per_step"] > 100, r
    assert result["serve"]["course_lib_paged"]["tokens_per_s"] > 0
    assert result["memory"][0]["bytes_per_param"]["optimizer_states"] >= 8, result["memory"][0]


def test_bad_model_and_generation_arguments_are_named():
    """Checked on the host, by name: token ids outside the vocabulary (an IndexError on the CPU, a
    device-side assert on a GPU), empty or badly typed inputs, targets of another shape (once a silently
    wrong loss), a KV cache of another batch or written with a gap (once attended to zeros), config
    floats that gave NaN, generation and training counts that crashed or did nothing."""
    model = tiny_model(vocab_size=64).eval()
    x = torch.randint(0, 64, (2, 5), device=DEVICE)
    tokens = torch.randint(0, 64, (400,))
    small = dict(batch_size=2, seq_len=8, progress=False)
    cases = [
        (lambda: model(torch.tensor([[1, 64]])), ValueError, r"token ids must lie in \[0, 64\)"),
        (lambda: model(torch.zeros(1, 0, dtype=torch.long)), ValueError, "hold no token"),
        (lambda: model([[1, 2]]), TypeError, "tokens must be an int64 tensor"),
        (lambda: model(x, start_pos=-1), ValueError, "start_pos must be >= 0"),
        (
            lambda: model(x, x.T.contiguous()),
            ValueError,
            "targets must be an int64 tensor of the tokens' shape",
        ),
        (lambda: model(x, cache=KVCache(model.config, 1, 8, DEVICE)), ValueError, "as the cache was made"),
        (
            lambda: model(x, cache=KVCache(model.config, 2, 16, DEVICE, torch.float16)),
            TypeError,
            "the cache was made torch.float16",
        ),
        (lambda: LlamaConfig(**TINY, rope_theta=0.0), ValueError, "rope_theta must be a finite number > 0"),
        (lambda: LlamaConfig(**TINY, norm_eps=float("nan")), ValueError, "norm_eps must be a finite number"),
        (lambda: LlamaConfig(**{**TINY, "dim": 64.0}), TypeError, "dim must be an integer"),
        (lambda: generate.sample(model, [1, 2], -1), ValueError, "max_new_tokens must be >= 0"),
        (
            lambda: generate.sample(model, [1, 99], 2),
            ValueError,
            r"prompt token ids must be ints in \[0, 64\)",
        ),
        (lambda: generate.sample(model, [1, 2], 2, temperature=float("nan")), ValueError, "temperature"),
        (
            lambda: generate.greedy_cached(model, [1, 2, 3], 2),
            TypeError,
            "prompt must be a list of token ids, got int",
        ),
        (lambda: generate.serve(model, [[1, 2]], 2, page_size=0), ValueError, "page_size must be >= 1"),
        (
            lambda: train.train(model, tokens, steps=2, accum_steps=0, **small),
            ValueError,
            "accum_steps must be",
        ),
        (lambda: train.train(model, tokens, steps=2, lr=float("inf"), **small), ValueError, "lr must be"),
        (lambda: train.train(model, tokens[None], steps=2, **small), TypeError, "1-D int64 tensor"),
        (lambda: train.evaluate(model, tokens, 2, 8, batches=0), ValueError, "batches must be >= 1"),
    ]
    for make, error, words in cases:
        with pytest.raises(error, match=words):
            make()
    cache = KVCache(model.config, 2, 16, DEVICE)
    model(x, cache=cache)
    with pytest.raises(ValueError, match="leaves a gap after the 5 positions cached"):
        model(x[:, :1], cache=cache, start_pos=10)
    model(x[:, :1], cache=cache, start_pos=5)  # the next position: fine
    assert generate.sample(model, [1, 2], 0) == [] and generate.serve(model, [[1, 2]], 0) == [[]]
    assert list(generate.stream(model, [[1, 2]], 0)) == []
    assert (
        len(generate.sample(model, [1, 2], 3, temperature=1e-45)) == 3
    )  # a tiny temperature: greedy, no NaN


def test_conversion_and_split_refuse_what_they_would_get_wrong():
    model = tiny_model(vocab_size=64)
    hf = convert.to_hf_state_dict(model.state_dict())
    assert convert.from_hf_state_dict(hf, model.config).keys() == model.state_dict().keys()
    hf["lm_head.weight"] = torch.randn_like(hf["lm_head.weight"])  # untied weights, tied config
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        convert.from_hf_state_dict(hf, model.config)
    del hf["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="no model.embed_tokens.weight"):
        convert.from_hf_state_dict(hf, model.config)
    for fraction in (1.5, -0.5, float("nan")):
        with pytest.raises(ValueError, match=r"val_fraction must be a finite number >= 0 and < 1"):
            data.split(torch.arange(200), fraction)
    with pytest.raises(TypeError, match="val_fraction must be a number, got True"):
        data.split(torch.arange(200), True)
