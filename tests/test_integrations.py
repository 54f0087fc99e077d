"""course_lib's attention inside Hugging Face transformers (course_lib.integrations).

A tiny random-weight LlamaForCausalLM built from a config (no download) runs with SDPA and with
"course_lib"; logits, gradients and greedy tokens must agree. Grouped-query attention throughout
(4 query heads, 2 K/V heads; one case with a single K/V head). On the CPU the kernels run in Triton's
interpreter: two layers, head dim 16, sequences of at most 24 tokens.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch

import course_lib

transformers = pytest.importorskip("transformers")

from course_lib.integrations import transformers as hf  # noqa: E402
from course_lib.integrations import use_in_transformers  # noqa: E402
from course_lib.testing import (  # noqa: E402
    assert_close_to_reference,
    assert_grads_close_to_reference,
    relative_error,
)

DEVICE = course_lib.DEVICE
gpu = pytest.mark.skipif(not course_lib.ON_GPU, reason="needs a CUDA GPU with compiled Triton kernels")


def tiny_llama(kv_heads=2, dtype=torch.float32, seed=0, layers=2, hidden=64, heads=4):
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(DEVICE, dtype).eval()


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls that reach course_lib's kernels (and not the SDPA fallback)."""
    calls = []
    real = hf.flash_attention

    def counting(q, k, v, causal, scale, window=None, sinks=None):
        calls.append((tuple(q.shape), tuple(k.shape), causal) + ((window,) if window is not None else ()))
        return real(q, k, v, causal, scale, window, sinks)

    def counting_padded(q, k, v, padding, causal, scale, window=None, sinks=None):
        calls.append(("padded", tuple(q.shape), tuple(k.shape), int(padding.sum())))
        return real_padded(q, k, v, padding, causal, scale, window, sinks)

    real_padded = hf.flash_attention_padded
    monkeypatch.setattr(hf, "flash_attention", counting)
    monkeypatch.setattr(hf, "flash_attention_padded", counting_padded)
    return calls


def _greedy_tokens(model, impls, prompt, new_tokens):
    """Greedy tokens of `model` with each attention implementation, `new_tokens` of them, failing on any
    SDPA fallback on the way (a UserWarning)."""
    tokens = {}
    for impl in impls:
        model.set_attn_implementation(impl)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            # min_new_tokens: a random-weight model may pick the end-of-sequence token and stop early
            tokens[impl] = model.generate(
                prompt,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                attention_mask=None,
            )
    return tokens


def _logits(model, impl, ids, no_fallback=False, **kwargs):
    """Logits of `model` with attention `impl`; no_fallback: fail on any SDPA fallback (a UserWarning)."""
    model.set_attn_implementation(impl)
    with torch.no_grad(), warnings.catch_warnings():
        if no_fallback:
            warnings.simplefilter("error", UserWarning)
        return model(ids, **kwargs).logits


def test_import_course_lib_does_not_import_transformers():
    code = "import sys, course_lib, course_lib.integrations; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["False"], out.stderr


def test_register_and_names():
    assert use_in_transformers() == "course_lib"
    assert "course_lib" in transformers.AttentionInterface()
    model = tiny_llama()
    model.set_attn_implementation("course_lib")
    assert model.config._attn_implementation == "course_lib"
    for name in (123, "", " ", None):
        with pytest.raises(TypeError, match="name must be a non-empty string"):
            use_in_transformers(name)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["GQA 4/2", "MQA 4/1"])
def test_prefill_logits_match_sdpa(kv_heads, kernel_calls):
    use_in_transformers()
    model = tiny_llama(kv_heads=kv_heads)
    ids = torch.randint(0, 97, (2, 24), device=DEVICE)
    ref = _logits(model, "sdpa", ids)
    got = _logits(model, "course_lib", ids)
    assert len(kernel_calls) == 2, kernel_calls  # one per layer: no fallback
    assert kernel_calls[0] == ((2, 4, 24, 16), (2, kv_heads, 24, 16), "bottom_right")
    err = (got - ref).abs().max().item()
    assert err < 1e-4, f"tiny Llama fp32, 4/{kv_heads} heads, N=24: logits differ from SDPA by {err:.3g}"


def test_decode_with_cache_is_bottom_right(kernel_calls):
    """Chunked prefill: 16 tokens, then 8 more against a 24-key cache (Nq < Nk), then one token."""
    use_in_transformers()
    model = tiny_llama()
    ids = torch.randint(0, 97, (2, 25), device=DEVICE)
    ref = _logits(model, "sdpa", ids)
    model.set_attn_implementation("course_lib")
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        first = model(ids[:, :16], past_key_values=cache, use_cache=True).logits
        second = model(ids[:, 16:24], past_key_values=cache, use_cache=True).logits
        third = model(ids[:, 24:], past_key_values=cache, use_cache=True).logits
    got = torch.cat([first, second, third], dim=1)
    assert [c[0][2] for c in kernel_calls] == [16, 16, 8, 8, 1, 1]
    assert [c[1][2] for c in kernel_calls] == [16, 16, 24, 24, 25, 25]
    err = (got - ref).abs().max().item()
    assert err < 1e-4, f"tiny Llama fp32, cache 16+8+1 tokens: logits differ from one SDPA pass by {err:.3g}"


def test_gradients_match_sdpa(kernel_calls):
    use_in_transformers()
    model = tiny_llama()
    model.train()  # attention_dropout is 0: training mode is allowed
    ids = torch.randint(0, 97, (2, 20), device=DEVICE)
    grads = {impl: _loss_and_grads(model, impl, ids)[2] for impl in ("sdpa", "course_lib")}
    assert len(kernel_calls) == 2
    assert grads["sdpa"].keys() == grads["course_lib"].keys()
    bound = 1e-4 if course_lib.ON_GPU else 1e-5  # measured on the CPU: 4e-7
    for name, g in grads["sdpa"].items():
        err = relative_error(grads["course_lib"][name], g)  # q_proj's and k_proj's entries are ~1e-3
        assert err <= bound, f"tiny Llama fp32: grad of {name}: relative error {err:.3g} (bound {bound:g})"


def test_greedy_generation_same_tokens(kernel_calls):
    use_in_transformers()
    model = tiny_llama()
    prompt = torch.randint(0, 97, (1, 8), device=DEVICE)
    tokens = _greedy_tokens(model, ("sdpa", "course_lib"), prompt, 6)
    assert len(kernel_calls) == 2 * 6  # prefill + 5 decoding steps, two layers
    assert torch.equal(tokens["sdpa"], tokens["course_lib"]), f"{tokens['sdpa']} != {tokens['course_lib']}"


def test_static_cache_generation_runs_on_the_kernels(kernel_calls):
    """A static cache (transformers' `cache_implementation="static"`, the cache it compiles generation
    with) has slots past the tokens so far: eagerly, the mask hook answers the count of keys in use and
    the layers run the kernels on those alone, bottom-right causal; greedy tokens as SDPA's, with no
    fallback (a warning would fail the test). Compiled (transformers does so by itself on a GPU):
    `test_compiled_static_cache_generation_runs_the_decoding_operator`."""
    use_in_transformers()
    model = tiny_llama()
    prompt = torch.randint(0, 97, (1, 8), device=DEVICE)
    tokens = {}
    for impl in ("sdpa", "course_lib"):
        model.set_attn_implementation(impl)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            tokens[impl] = model.generate(  # eagerly: on a GPU, transformers would compile the forward
                prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False, cache_implementation="static",
                disable_compile=True,
            )  # fmt: skip
    assert torch.equal(tokens["sdpa"], tokens["course_lib"]), f"{tokens['sdpa']} != {tokens['course_lib']}"
    assert len(kernel_calls) == 2 * 6  # prefill + 5 decoding steps, two layers
    keys = [k_shape[2] for _, k_shape, _ in kernel_calls[::2]]
    assert keys == [8, 9, 10, 11, 12, 13], keys  # the keys in use, not the cache's slots
    assert all(causal == "bottom_right" for *_, causal in kernel_calls)


def test_keys_in_use_only_where_the_kernels_apply(monkeypatch):
    """The mask hook's static-cache answer [n]: only for transformers' causal mask, no sliding window, no
    padding among the n keys, keys from position 0; otherwise transformers' 4-D mask. Handed back as the
    attention mask (as `generate` does), it reads as no padding. Under torch.compile [n] is computed from
    the query offset, a tensor of the graph, and a padding mask (whose values cannot be read there) gets
    transformers' mask."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    args = dict(batch_size=1, q_length=1, kv_length=16, q_offset=torch.tensor(5), kv_offset=0)

    def hook(**kw):
        return hf.attention_mask(**dict(args, **kw), allow_is_causal_skip=False, dtype=torch.float32)

    assert hook().tolist() == [6]
    assert hook(q_offset=0, q_length=7).tolist() == [7]  # a static cache's prefill
    assert hook(attention_mask=torch.ones(1, 6, dtype=torch.bool)).tolist() == [6]
    assert hook(attention_mask=hook()).tolist() == [6]  # its own answer, handed back
    padded = torch.ones(1, 6, dtype=torch.bool)
    padded[0, 0] = False
    assert hook(attention_mask=padded).dim() == 4
    assert hook(kv_offset=3).dim() == 4
    assert hook(mask_function=lambda b, h, q, k: k <= q).dim() == 4  # not transformers' causal function
    assert hook(q_offset=20).dim() == 4  # past the cache's end
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced = hook(attention_mask=torch.tensor([6]))  # under torch.compile: from the offset, not read
    assert traced.dtype == torch.int64 and traced.tolist() == [6]
    assert hook(q_offset=torch.tensor(2), q_length=3).tolist() == [5]
    traced = hook(attention_mask=torch.ones(1, 6, dtype=torch.bool))  # padding: transformers' mask
    want = sdpa_mask(**args, mask_function=causal_mask_function, allow_is_causal_skip=False)
    assert traced.dim() == 4 and torch.equal(traced, want)


def test_compiled_static_cache_generation_runs_the_decoding_operator(monkeypatch):
    """A static cache's generation compiled as transformers compiles it (on the CPU with the aot_eager
    backend, fullgraph: a graph break raises; on a GPU transformers' own default, inductor with CUDA
    graphs): the decoding steps run course_lib's decoding operator, which takes the count of keys in use
    as a tensor; greedy tokens as SDPA's, no fallback warning."""
    from transformers import CompileConfig

    use_in_transformers()
    calls = []
    real = hf.decode_attention_op

    def counting(q, k, v, lengths, causal, scale):
        calls.append(tuple(q.shape))
        return real(q, k, v, lengths, causal, scale)

    monkeypatch.setattr(hf, "decode_attention_op", counting)
    model = tiny_llama()
    prompt = torch.randint(0, 97, (2, 8), device=DEVICE)  # two sequences: the count serves both
    config = CompileConfig() if course_lib.ON_GPU else CompileConfig(backend="aot_eager", fullgraph=True)
    config._compile_all_devices = True  # compile on the CPU too
    tokens = {}
    for impl in ("sdpa", "course_lib"):
        model.set_attn_implementation(impl)
        torch._dynamo.reset()
        with warnings.catch_warnings():  # a fallback to SDPA warns; PyTorch's own warnings do not count
            warnings.filterwarnings("error", message="course_lib attention")
            tokens[impl] = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, min_new_tokens=6,
                do_sample=False, cache_implementation="static", compile_config=config,
            )  # fmt: skip
    assert torch.equal(tokens["sdpa"], tokens["course_lib"]), f"{tokens['sdpa']} != {tokens['course_lib']}"
    assert calls and all(shape[:2] == (2, 1) for shape in calls), calls  # (B, 1 new token, Hq, d), traced


def test_keys_in_use_as_a_tensor_where_the_operator_does_not_apply(monkeypatch):
    """[n] as a tensor of a compiled graph: without a gradient to compute, the decoding operator; with
    one (the operator has no backward), transformers' SDPA on the same mask, with a warning. Both against
    SDPA on the first n keys, bottom-right causal."""
    use_in_transformers()
    layer = tiny_llama().model.layers[0].self_attn
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 2, 16, generator=g).to(DEVICE)
    k, v = (torch.randn(1, 2, 12, 16, generator=g).to(DEVICE) for _ in range(2))
    seen = torch.ones(2, 9, dtype=torch.bool, device=DEVICE).tril(7)  # 2 queries, the last 2 of 9 keys
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k[:, :, :9], v[:, :, :9], attn_mask=seen, scale=0.25, enable_gqa=True
    ).transpose(1, 2)
    n = torch.tensor([9], device=DEVICE)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        out, _ = hf.attention_forward(layer, q, k, v, n, scaling=0.25)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    with pytest.warns(UserWarning, match="explicit mask"):
        out, _ = hf.attention_forward(layer, q.clone().requires_grad_(), k, v, n, scaling=0.25)
    assert out.requires_grad
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


def test_hook_refuses_other_layouts_and_key_counts_by_name():
    """transformers passes (B, heads, N, d): a 3-D or 5-D call once came back transposed with no error,
    and a count of keys in use outside [0, Nk] once sliced from the end (key[:, :, :-3])."""
    use_in_transformers()
    layer = tiny_llama().model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 16, device=DEVICE)
    k = v = torch.randn(1, 2, 12, 16, device=DEVICE)
    for args, words in (
        (
            (q[:, 0], k, v),
            r"query must be a 4-D \(B, heads, N, d\) tensor, as transformers passes it; got \(1, 3, 16\)",
        ),
        ((q, k[None], v), r"key must be a 4-D .* got \(1, 1, 2, 12, 16\)"),
    ):
        with pytest.raises(ValueError, match=f"^course_lib attention: {words}"):
            hf.attention_forward(layer, *args, None)
    for n in (-3, 13):
        with pytest.raises(
            ValueError, match=rf"the mask \[n\] says n = {n} keys are in use, outside \[0, 12\]"
        ):
            hf.attention_forward(layer, q, k, v, torch.tensor([n]))


def _padded_batch(n=12, pad=4, side="left", seed=0):
    """Token ids (2, n) and a 2-D mask whose second row has `pad` padding tokens on `side`."""
    ids = torch.randint(0, 97, (2, n), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(seed))
    mask = torch.ones_like(ids)
    if side == "left":
        mask[1, :pad] = 0
    else:
        mask[1, n - pad :] = 0
    return ids, mask


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("make,reference", [(lambda: tiny_llama(), "sdpa"), (lambda: tiny_gpt_oss(), "eager")],
                         ids=["Llama", "gpt-oss"])  # fmt: skip
def test_padding_runs_on_the_kernels(kernel_calls, make, reference, side):
    """A padded batch (prompts of different lengths) runs on the kernels as packed sequences: the logits
    of the real tokens match the reference's (SDPA; for gpt-oss, with sinks and a sliding window, its
    eager attention), with no fallback; padded positions are never computed."""
    use_in_transformers()
    model = make()
    ids, mask = _padded_batch(side=side)
    ref = _logits(model, reference, ids, attention_mask=mask)
    got = _logits(model, "course_lib", ids, no_fallback=True, attention_mask=mask)
    assert kernel_calls == [("padded", (2, 4, 12, 16), (2, 2, 12, 16), 20)] * 2, kernel_calls
    real = mask.bool()
    err = (got[real] - ref[real]).abs().max().item()
    assert err < 1e-4, f"{type(model).__name__} fp32, {side} padding: real tokens' logits differ by {err:.3g}"


def test_padded_training_gradients_match_sdpa(kernel_calls):
    """Right-padded training batch (labels -100 on the padding): every gradient as SDPA's."""
    use_in_transformers()
    model = tiny_llama()
    model.train()
    ids, mask = _padded_batch(n=20, pad=7, side="right", seed=3)
    labels = ids.masked_fill(mask == 0, -100)
    grads = {}
    for impl in ("sdpa", "course_lib"):
        model.set_attn_implementation(impl)
        model.zero_grad(set_to_none=True)
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        grads[impl] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert [c[0] for c in kernel_calls] == ["padded", "padded"]
    bound = 1e-4 if course_lib.ON_GPU else 1e-5
    for name, g in grads["sdpa"].items():
        err = relative_error(grads["course_lib"][name], g)
        assert err <= bound, f"tiny Llama fp32, right padding: grad of {name}: relative error {err:.3g}"


def test_padded_batch_generation_same_tokens(kernel_calls):
    """Greedy generation of a left-padded batch: prefill and every decoding step on the kernels (the
    padding mask grows with the cache), the same tokens as SDPA."""
    use_in_transformers()
    model = tiny_llama()
    ids, mask = _padded_batch(n=10, pad=3, side="left", seed=5)
    tokens = {}
    for impl in ("sdpa", "course_lib"):
        model.set_attn_implementation(impl)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            tokens[impl] = model.generate(
                ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False
            )
    assert len(kernel_calls) == 2 * 6 and all(c[0] == "padded" for c in kernel_calls), kernel_calls
    assert torch.equal(tokens["sdpa"], tokens["course_lib"]), f"{tokens['sdpa']} != {tokens['course_lib']}"


@pytest.mark.parametrize(
    "make,reference,fallback",
    [
        (lambda: tiny_llama(), "sdpa", "runs transformers' SDPA attention instead"),
        # a layer with sinks: not SDPA, which would drop them, but the model's own eager attention
        (lambda: tiny_gpt_oss(), "eager", "runs the model's eager attention instead"),
    ],
    ids=["Llama: SDPA", "gpt-oss: eager"],
)
def test_a_4d_mask_falls_back_with_a_warning(kernel_calls, make, reference, fallback):
    """A 4-D mask given by the caller (here causal with a hole: key 2 hidden from every query) is not one
    the kernels compute: SDPA runs it (a layer with sinks: the model's eager attention), with a warning."""
    use_in_transformers()
    model = make()
    ids = torch.randint(0, 97, (2, 12), device=DEVICE)
    seen = torch.ones(12, 12, dtype=torch.bool, device=DEVICE).tril()
    seen[3:, 2] = False
    mask = torch.zeros(2, 1, 12, 12, device=DEVICE).masked_fill(~seen, torch.finfo(torch.float32).min)
    ref = _logits(model, reference, ids, attention_mask=mask)
    with pytest.warns(UserWarning, match=fallback):
        got = _logits(model, "course_lib", ids, attention_mask=mask)
    assert kernel_calls == []
    assert torch.allclose(got, ref, atol=1e-6)


def test_dropout_is_refused_clearly():
    use_in_transformers()
    model = tiny_llama()
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    model.set_attn_implementation("course_lib")
    with pytest.raises(ValueError, match="no dropout"):
        model(torch.randint(0, 97, (1, 8), device=DEVICE))


def test_padding_mask_stays_causal_when_the_layer_says_is_causal_false(kernel_calls):
    """Moonshine's decoder passes is_causal=False whenever it has a mask (SDPA's rule: the mask carries the
    causality). The 2-D padding mask the hook answers stands for a causal mask, so its layers must still run
    causal: the real tokens' logits of a left-padded decoder batch as SDPA's."""
    use_in_transformers()
    config = transformers.MoonshineConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, encoder_num_hidden_layers=1,
        decoder_num_hidden_layers=2, encoder_num_attention_heads=4, decoder_num_attention_heads=4,
        encoder_num_key_value_heads=4, decoder_num_key_value_heads=2, attention_dropout=0.0,
        decoder_start_token_id=1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MoonshineForConditionalGeneration(config).to(DEVICE).eval()
    audio = torch.randn(2, 2000, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
    ids = torch.randint(2, 97, (2, 8), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in the second decoder sequence
    logits = {}
    for impl in ("sdpa", "course_lib"):
        model.set_attn_implementation(impl)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            out = model(input_values=audio, decoder_input_ids=ids, decoder_attention_mask=mask)
        logits[impl] = out.logits
    assert [c[0] for c in kernel_calls].count("padded") == 2, kernel_calls  # the decoder's self-attention
    real = mask.bool()
    err = (logits["course_lib"][real] - logits["sdpa"][real]).abs().max().item()
    assert err < 1e-4, f"tiny Moonshine fp32, left-padded decoder: real tokens' logits differ by {err:.3g}"


def test_position_bias_is_refused_clearly():
    """T5's relative position bias comes to the attention function as `position_bias`, an additive mask the
    kernels have no place for: refused by name, not dropped."""
    use_in_transformers()
    config = transformers.T5Config(
        vocab_size=97, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_decoder_layers=1, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, attn_implementation="course_lib",
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config).to(DEVICE).eval()
    ids = torch.randint(1, 97, (2, 10), device=DEVICE)
    with pytest.raises(ValueError, match="position_bias"):
        model(input_ids=ids, decoder_input_ids=ids[:, :6])


def tiny_mistral(window=8, seed=0):
    """A tiny random-weight MistralForCausalLM whose layers attend within a sliding window of `window` keys."""
    config = transformers.MistralConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=window,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    return transformers.MistralForCausalLM(config).to(DEVICE, torch.float32).eval()


def test_sliding_window_logits_and_gradients_match_sdpa(kernel_calls):
    """Mistral's sliding window (8 keys, 24 tokens): the mask hook answers None, the kernels get
    window=8, and logits and gradients match transformers' SDPA with its banded mask."""
    use_in_transformers()
    model = tiny_mistral()
    ids = torch.randint(0, 97, (2, 24), device=DEVICE)
    ref = _logits(model, "sdpa", ids)
    got = _logits(model, "course_lib", ids, no_fallback=True)
    assert kernel_calls == [((2, 4, 24, 16), (2, 2, 24, 16), "bottom_right", 8)] * 2
    full = _logits(tiny_mistral(window=None), "sdpa", ids)
    assert (full - ref).abs().max() > 1e-2  # the window changes the logits: the check below can fail
    err = (got - ref).abs().max().item()
    assert err < 1e-4, f"tiny Mistral fp32, window 8, N=24: logits differ from SDPA by {err:.3g}"
    model.train()
    grads = {impl: _loss_and_grads(model, impl, ids)[2] for impl in ("sdpa", "course_lib")}
    for name, g in grads["sdpa"].items():
        err = relative_error(grads["course_lib"][name], g)
        assert err <= 1e-5, f"tiny Mistral fp32, window 8: grad of {name}: relative error {err:.3g}"


def test_sliding_window_generation_same_tokens(kernel_calls):
    """Greedy generation past the window (a 12-token prompt, 12 new tokens, window 8): the same tokens as
    SDPA, every step on the kernels. transformers' sliding-window cache keeps only the last keys a query
    can see (kv_offset > 0); they end where the queries end, so the alignment is still bottom-right.
    The prompt is longer than the window, so its prefill masks keys and the test fails if the window is
    ignored."""
    use_in_transformers()
    model = tiny_mistral()
    prompt = torch.randint(0, 97, (1, 12), device=DEVICE)
    tokens = _greedy_tokens(model, ("sdpa", "course_lib"), prompt, 12)
    assert len(kernel_calls) == 2 * 12 and all(c[3] == 8 for c in kernel_calls)
    assert kernel_calls[0][:2] == ((1, 4, 12, 16), (1, 2, 12, 16))  # the prefill: 12 queries, window 8
    assert max(c[1][2] for c in kernel_calls[2:]) <= 8  # then the cache never held more than the window
    assert torch.equal(tokens["sdpa"], tokens["course_lib"]), f"{tokens['sdpa']} != {tokens['course_lib']}"


def test_padding_inside_a_row_with_a_sliding_window_falls_back(kernel_calls):
    """Padding inside a row (two tokens in the middle) under Mistral's window of 4: packed, the window would
    count real tokens instead of positions (logits off by 0.29 when tried), so the mask hook builds SDPA's
    mask instead and the real tokens' logits are SDPA's, with the fallback's warning."""
    use_in_transformers()
    model = tiny_mistral(window=4)
    ids, mask = _padded_batch(n=12, pad=0, seed=4)
    mask[1, 5:7] = 0
    ref = _logits(model, "sdpa", ids, attention_mask=mask)
    with pytest.warns(UserWarning, match="runs transformers' SDPA attention instead"):
        got = _logits(model, "course_lib", ids, attention_mask=mask)
    assert kernel_calls == [], kernel_calls
    real = mask.bool()
    err = (got[real] - ref[real]).abs().max().item()
    assert err < 1e-6, f"tiny Mistral fp32, window 4, padding at 5-6: real tokens' logits differ by {err:.3g}"


def tiny_gpt_oss(seed=0):
    """A tiny random-weight GptOssForCausalLM: a sliding-window layer (8 keys) and a full one, both with
    attention sinks (drawn large enough to matter), 4 query heads over 2 K/V heads, 4 small experts."""
    config = transformers.GptOssConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=131072,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).to(DEVICE, torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


def test_gpt_oss_sinks_and_windows_match_eager(kernel_calls):
    """gpt-oss's attention (sinks in every layer, a sliding window in every other one) on the kernels:
    logits, every gradient (the sinks' included) and greedy tokens as transformers' eager attention,
    which is the implementation gpt-oss defines its sinks with."""
    use_in_transformers()
    model = tiny_gpt_oss()
    ids = torch.randint(0, 97, (2, 24), device=DEVICE)
    ref = _logits(model, "eager", ids)
    got = _logits(model, "course_lib", ids, no_fallback=True)
    assert [c[3] if len(c) > 3 else None for c in kernel_calls] == [8, None]
    err = (got - ref).abs().max().item()
    assert err < 1e-4, f"tiny gpt-oss fp32, N=24: logits differ from eager attention by {err:.3g}"
    with torch.no_grad():
        sinks = [layer.self_attn.sinks.clone() for layer in model.model.layers]
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
        assert (_logits(model, "eager", ids) - ref).abs().max() > 1e-2  # the sinks matter here
        for layer, s in zip(model.model.layers, sinks):
            layer.self_attn.sinks.copy_(s)
    model.train()
    grads = {impl: _loss_and_grads(model, impl, ids)[2] for impl in ("eager", "course_lib")}
    assert any("sinks" in n for n in grads["eager"])
    for name, g in grads["eager"].items():
        err = relative_error(grads["course_lib"][name], g)
        assert err <= 1e-4, f"tiny gpt-oss fp32: grad of {name}: relative error {err:.3g}"
    model.eval()
    tokens = _greedy_tokens(model, ("eager", "course_lib"), ids[:1, :12], 10)  # prompt longer than the window
    assert torch.equal(tokens["eager"], tokens["course_lib"]), f"{tokens['eager']} != {tokens['course_lib']}"


def _loss_and_grads(model, impl, ids):
    """Logits, loss and every parameter's gradient of one training step with attention `impl`."""
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.item(), grads


# Other model families, each with something Llama has not: Qwen3 normalises q and k per head and sets its
# head dim apart from hidden / heads; Gemma 3 scales the scores by query_pre_attn_scalar, not the head dim,
# and alternates sliding-window and full layers; GPT-NeoX has as many K/V heads as query heads and rotates
# part of each head; Phi-3 projects q, k and v in one matrix. (Gemma 2's logit soft-capping is refused.)
OTHER_FAMILIES = {
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "Gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 8,
            "query_pre_attn_scalar": 24,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "GPTNeoX": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"num_key_value_heads": None, "rotary_pct": 0.5}),
    "Phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
}


def tiny_family(family):
    """A tiny random-weight model of one of OTHER_FAMILIES (2 layers, 4 query heads over 2 K/V heads unless
    the family says otherwise), fp32, in eval mode; skips where this transformers lacks the family."""
    config_name, model_name, extra = OTHER_FAMILIES[family]
    if not hasattr(transformers, config_name):
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    kwargs = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(extra)
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).to(DEVICE, torch.float32).eval()


@pytest.mark.parametrize("family", list(OTHER_FAMILIES))
def test_other_model_families_match_sdpa(family, kernel_calls):
    """Logits over 19 tokens (two sequences), six greedy tokens, and the gradients of a training step on a
    padded batch, as with SDPA, every layer on the kernels."""
    model = tiny_family(family)
    use_in_transformers()
    ids = torch.randint(0, 97, (2, 19), device=DEVICE)
    ref = _logits(model, "sdpa", ids)
    got = _logits(model, "course_lib", ids, no_fallback=True)
    assert len(kernel_calls) == 2, kernel_calls  # one per layer
    windows = [call[3] if len(call) == 4 else None for call in kernel_calls]
    assert windows == ([8, None] if family == "Gemma3" else [None, None]), kernel_calls
    err = (got - ref).abs().max().item()  # as for Llama above (a few 1e-7 on the CPU)
    assert err < 1e-4, f"tiny {family} fp32: logits differ from SDPA's by {err:.3g}"
    prompt = torch.randint(0, 97, (1, 7), device=DEVICE)
    tokens = _greedy_tokens(model, ("sdpa", "course_lib"), prompt, 6)
    assert torch.equal(tokens["sdpa"], tokens["course_lib"]), (
        f"{family}: {tokens['sdpa']} != {tokens['course_lib']}"
    )
    # a training step on a left-padded batch: the real tokens run packed
    model.train()
    padding = torch.ones(2, 19, dtype=torch.long, device=DEVICE)
    padding[1, :5] = 0
    grads = {}
    for impl in ("sdpa", "course_lib"):
        model.set_attn_implementation(impl)
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no fallback
            model(ids, labels=ids, attention_mask=padding).loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert sum(call[0] == "padded" for call in kernel_calls) == 2, kernel_calls  # one per layer
    bound = 1e-4 if course_lib.ON_GPU else 1e-5  # measured on the CPU: 9e-7 at most
    for name, g in grads["sdpa"].items():
        err = relative_error(grads["course_lib"][name], g)
        assert err <= bound, f"tiny {family} fp32, padded: grad of {name}: relative error {err:.3g}"


@pytest.mark.gpu
@gpu
def test_gpu_bf16_llama_logits_gradients_and_generation():
    """bf16 Llama (head dim 128, 4/2 heads, 512 tokens) against a float64 copy of it: course_lib's logits and
    gradients as close as SDPA's in bf16 (measured on an H200: logits 0.0137 against SDPA's 0.0132, every
    gradient's relative error within 1.04x SDPA's, 0.6-1.2 %)."""
    use_in_transformers()
    model = tiny_llama(dtype=torch.bfloat16, layers=2, hidden=512, heads=4).train()
    model64 = copy.deepcopy(model).double()
    ids = torch.randint(0, 97, (2, 512), device=DEVICE)
    logits64, loss64, grads64 = _loss_and_grads(model64, "sdpa", ids)
    logits_sdpa, _, grads_sdpa = _loss_and_grads(model, "sdpa", ids)
    logits, loss, grads = _loss_and_grads(model, "course_lib", ids)
    assert_close_to_reference(logits, logits64, logits_sdpa, "bf16 Llama N=512: logits")
    assert abs(loss - loss64) < 1e-2 * abs(loss64), (loss, loss64)
    assert_grads_close_to_reference(grads, grads64, grads_sdpa, "bf16 Llama N=512")
    model.eval()
    model.float()
    tokens = {}
    for impl in ("sdpa", "course_lib"):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(ids[:1, :32], max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert tokens["sdpa"].shape[-1] == 32 + 16 and torch.equal(tokens["sdpa"], tokens["course_lib"])


@pytest.mark.gpu
@gpu
def test_gpu_compiled_llama_forward_and_backward():
    """torch.compile(fullgraph=True) of a whole bf16 model with course_lib attention: the custom operator
    keeps it one graph, and the compiled step's gradients are as close to a float64 copy's as SDPA's
    eager bf16 step's (measured on an H200: compiled 1.11 % at worst, course_lib eager 1.23 %)."""
    use_in_transformers()
    model = tiny_llama(dtype=torch.bfloat16, hidden=512, heads=4).train()
    model64 = copy.deepcopy(model).double()
    ids = torch.randint(0, 97, (2, 256), device=DEVICE)
    _, loss64, grads64 = _loss_and_grads(model64, "sdpa", ids)
    _, _, grads_sdpa = _loss_and_grads(model, "sdpa", ids)
    _, loss_eager, grads_eager = _loss_and_grads(model, "course_lib", ids)
    assert_grads_close_to_reference(grads_eager, grads64, grads_sdpa, "eager, bf16 Llama N=256")
    model.set_attn_implementation("course_lib")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)  # a graph break raises here
    model.zero_grad(set_to_none=True)
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert abs(loss.item() - loss64) < 1e-2 * abs(loss64), (loss.item(), loss_eager, loss64)
    assert_grads_close_to_reference(
        grads, grads64, grads_sdpa, "torch.compile(fullgraph=True), bf16 Llama N=256"
    )


def test_compiled_llama_calls_the_operator(kernel_calls):
    """torch.compile(fullgraph=True) of a model with course_lib attention (CPU: the aot_eager backend, the
    kernels interpreted): the hook's `flash_attention` is the custom operator there, one graph, forward
    and backward, and the logits and gradients are the eager call's."""
    use_in_transformers()
    model = tiny_llama(layers=1).train()
    model.set_attn_implementation("course_lib")
    ids = torch.randint(0, 97, (1, 24), device=DEVICE)
    eager, _, grads = _loss_and_grads(model, "course_lib", ids)
    calls = len(kernel_calls)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # a graph break raises here
    model.zero_grad(set_to_none=True)
    out = compiled(ids, labels=ids)
    out.loss.backward()
    assert len(kernel_calls) > calls  # traced through the hook
    torch.testing.assert_close(out.logits, eager, rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-5, msg=f"{name}")


def test_compiled_sliding_window_layers_run_on_the_kernels(kernel_calls):
    """Under torch.compile the hook cannot compare a mask function's values, nor read its closure: a
    sliding-window layer is recognised by the model's config (its `sliding_window`). Gemma 3, one sliding
    (8 keys) and one full layer, compiled with fullgraph (a graph break raises): both layers traced through
    the kernels, the window on the first, logits as SDPA's, no fallback."""
    use_in_transformers()
    model = tiny_family("Gemma3")
    ids = torch.randint(0, 97, (2, 19), device=DEVICE)
    ref = _logits(model, "sdpa", ids)
    model.set_attn_implementation("course_lib")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="course_lib attention")
        got = compiled(ids).logits
    assert [call[3] if len(call) == 4 else None for call in kernel_calls] == [8, None], kernel_calls
    err = (got - ref).abs().max().item()
    assert err < 1e-4, f"compiled tiny Gemma 3 fp32: logits differ from SDPA's by {err:.3g}"


def test_compiled_model_with_padding_runs_the_padded_operator(kernel_calls):
    """A tokenizer's attention mask under torch.compile(fullgraph=True) (which once raised: the fallback's
    warnings.warn cannot be traced): the real tokens' count decides the packed shapes, which a graph
    cannot hold, so the padded batch is one opaque operator (`course_lib::flash_attention_padded_forward`
    and its backward). A left-padded batch, forward and backward: logits at the real tokens and every
    gradient as the eager call's, both layers through the kernels, no fallback."""
    use_in_transformers()
    model = tiny_llama().train()
    ids = torch.randint(0, 97, (2, 19), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    labels = ids.masked_fill(mask == 0, -100)
    model.set_attn_implementation("course_lib")

    def step(run):
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="course_lib attention")  # no fallback
            out = run(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        return out.logits.detach(), {
            n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
        }

    eager_logits, eager_grads = step(model)
    calls = len(kernel_calls)
    torch._dynamo.reset()
    logits, grads = step(torch.compile(model, fullgraph=True, backend="aot_eager"))
    assert [call[0] for call in kernel_calls[calls:]] == ["padded", "padded"], kernel_calls
    real = mask.bool()
    torch.testing.assert_close(logits[real], eager_logits[real], rtol=1e-5, atol=1e-5)
    for name, g in eager_grads.items():
        err = relative_error(grads[name], g)
        assert err <= 1e-5, f"compiled tiny Llama, left padding: grad of {name}: relative error {err:.3g}"


@pytest.mark.parametrize("with_sinks", [False, True], ids=["no sinks", "sinks"])
def test_compiled_padded_operator_matches_the_eager_call(with_sinks):
    """The padded operator itself, against `flash_attention_padded` eagerly: GQA, causal, a row with
    padding on both sides and a row of padding only, with and without attention sinks, forward and
    backward (its gradients zero at the padding)."""
    from course_lib.attention.varlen import flash_attention_padded

    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 6, 16, generator=g).to(DEVICE)
    k, v = (torch.randn(3, 2, 9, 16, generator=g).to(DEVICE) for _ in range(2))
    sinks = torch.randn(4, generator=g).to(DEVICE)
    padding = torch.ones(3, 9, dtype=torch.bool, device=DEVICE)
    padding[0, :2] = False
    padding[1, [0, 8]] = False
    padding[2] = False
    do = torch.randn(3, 4, 6, 16, generator=g).to(DEVICE)
    results = []
    for run in (
        flash_attention_padded,
        torch.compile(flash_attention_padded, fullgraph=True, backend="aot_eager"),
    ):
        leaves = [t.clone().requires_grad_() for t in ((q, k, v, sinks) if with_sinks else (q, k, v))]
        o = run(*leaves[:3], padding, True, 0.3, None, leaves[3] if with_sinks else None)
        o.backward(do)
        results.append((o.detach(), *(t.grad for t in leaves)))
    for name, got, want in zip(("O", "dQ", "dK", "dV", "dsinks"), results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"padded operator: {name}")
    assert results[1][0][2].abs().max() == 0 and results[1][2][2].abs().max() == 0  # all padding: zeros


def test_compiled_model_with_padding_and_a_window_falls_back_once_with_a_warning(kernel_calls):
    """Padding with a sliding window under torch.compile: whether each row's real tokens are one run (so
    that the window counted in real tokens is the one counted in positions) is a question of values,
    which the graph cannot ask, so the layers run transformers' SDPA on the mask. The warning is given
    once, while the graph is traced (Dynamo cannot trace `warnings.warn`: with fullgraph that once
    raised), and the logits are SDPA's."""
    use_in_transformers()
    model = tiny_mistral(window=8)
    ids = torch.randint(0, 97, (2, 19), device=DEVICE)
    mask = torch.ones_like(ids)
    ref = _logits(model, "sdpa", ids, attention_mask=mask)
    model.set_attn_implementation("course_lib")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with (
        torch.no_grad(),
        pytest.warns(UserWarning, match="course_lib attention: transformers passed an explicit"),
    ):
        got = compiled(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="course_lib attention")  # traced once: no warning again
        compiled(ids, attention_mask=mask)
    assert not kernel_calls
