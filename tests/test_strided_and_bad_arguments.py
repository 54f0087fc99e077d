"""Arguments a kernel reads through a raw pointer, given with unusual strides (they must work, against
float64), and arguments that must be refused with a message naming them. CPU (interpreter) and GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import course_lib
from course_lib import flash_attention
from course_lib.attention import attention_backward, attention_forward
from course_lib.decode import decode_attention, decode_reference, paged_decode_attention
from course_lib.fused import rms_norm, rms_norm_reference, rope, rope_cache, rope_reference
from course_lib.testing import max_error
from course_lib.testing import seeded_randn as _randn

DEVICE = course_lib.DEVICE


def _decode_inputs(B=2, n_max=48, hq=4, hkv=2, d=32):
    q = _randn(B, 1, hq, d)
    k, v = _randn(B, n_max, hkv, d, seed=1), _randn(B, n_max, hkv, d, seed=2)
    return q, k, v


@pytest.mark.parametrize(
    "lengths",
    [
        lambda: torch.tensor([40, 0, 17, 0], dtype=torch.int32, device=DEVICE)[::2],  # stride 2: [40, 17]
        lambda: torch.tensor([0, 40, 0, 17], dtype=torch.int32, device=DEVICE)[1::2],  # offset and stride 2
        lambda: torch.tensor([17], dtype=torch.int32, device=DEVICE).expand(2),  # stride 0: [17, 17]
    ],
    ids=["stride 2", "offset view", "expanded"],
)
def test_decode_reads_strided_lengths(lengths):
    """cache_seqlens given as a view with strides: the kernel must read the lengths the tensor holds
    (it once read raw memory at SEQLENS + b, so [40, 17] given with stride 2 read [40, 0])."""
    q, k, v = _decode_inputs()
    seqlens = lengths()
    out = decode_attention(q, k, v, seqlens)
    ref, _ = decode_reference(q.double(), k.double(), v.double(), seqlens.contiguous())
    assert max_error(out, ref) < 1e-4, max_error(out, ref)

    page_size, n_max = 8, k.shape[1]
    pages_per_seq = n_max // page_size
    k_pages = k.reshape(-1, page_size, *k.shape[2:])  # sequence b's pages are b * pages_per_seq + i
    v_pages = v.reshape(-1, page_size, *v.shape[2:])
    table = torch.arange(2 * pages_per_seq, dtype=torch.int32, device=DEVICE).reshape(2, pages_per_seq)
    paged = paged_decode_attention(q, k_pages, v_pages, table, seqlens)
    assert max_error(paged, ref) < 1e-4, max_error(paged, ref)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -1.0, "abc", 2.4e38])
def test_decode_refuses_a_bad_scale(scale):
    q, k, v = _decode_inputs()
    seqlens = torch.tensor([40, 17], dtype=torch.int32, device=DEVICE)
    error = TypeError if isinstance(scale, str) else ValueError
    with pytest.raises(error, match="scale must be"):
        decode_attention(q, k, v, seqlens, scale=scale)


@pytest.mark.parametrize(
    "weight",
    [
        lambda: _randn(2 * 40, seed=3)[::2],  # stride 2
        lambda: torch.tensor(2.0, device=DEVICE).expand(40),  # stride 0
        lambda: _randn(48, seed=3)[8:],  # an offset view (unit stride)
    ],
    ids=["stride 2", "expanded", "offset view"],
)
def test_rms_norm_reads_a_strided_weight(weight):
    """The weight goes to the kernels as a pointer: a strided or expanded weight must give the result
    its values give, forward and backward (a stride-2 weight once gave errors of 8)."""
    x = _randn(6, 40).requires_grad_()
    w = weight().requires_grad_()
    y = rms_norm(x, w)
    dy = _randn(6, 40, seed=4)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    x64, w64 = x.detach().double().cpu().requires_grad_(), w.detach().double().cpu().requires_grad_()
    y64 = rms_norm_reference(x64, w64)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double().cpu())
    assert max_error(y, y64) < 1e-5 * y64.abs().max().item()
    assert max_error(dx, dx64) < 1e-5 * dx64.abs().max().item()
    assert max_error(dw, dw64) < 1e-4 * dw64.abs().max().item()


def test_rope_reads_sin_with_its_own_strides():
    """cos and sin with different strides (a column slice, a row expanded): both are read as what they
    hold (sin was once read with cos's strides: errors of 24)."""
    q, k = _randn(1, 2, 6, 16), _randn(1, 2, 6, 16, seed=1)
    cos, sin = rope_cache(8, 16, device=DEVICE)
    wide_sin = torch.cat([sin, torch.full_like(sin, 7.0)], dim=-1)[:, :16]  # stride (32, 1)
    wide_cos = torch.cat([cos, torch.full_like(cos, 7.0)], dim=-1)[:, :16]
    cases = {
        "sin strided": (cos, wide_sin),
        "cos strided": (wide_cos, sin),
        "sin expanded": (cos[:1].expand(8, 16), sin[:1].expand(8, 16)),
        "cos expanded only": (cos[:1].expand(8, 16), sin),
    }
    for name, (c, s) in cases.items():
        q_rot, k_rot = rope(q, k, c, s)
        c64, s64 = c.double().cpu(), s.double().cpu()
        q64, k64 = rope_reference(q.double().cpu(), c64, s64), rope_reference(k.double().cpu(), c64, s64)
        assert max_error(q_rot, q64) < 1e-5 and max_error(k_rot, k64) < 1e-5, name


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda: rope_cache(8, 16, base=0.0, device=DEVICE), ValueError, "base must be a finite number > 1"),
        (lambda: rope_cache(8, 16, base=-1.0, device=DEVICE), ValueError, "base must be"),
        (lambda: rope_cache(4.5, 16, device=DEVICE), TypeError, "n_positions must be an integer, got 4.5"),
        (
            lambda: rope(
                _randn(1, 2, 4, 16), _randn(1, 2, 4, 16), *rope_cache(8, 16, device=DEVICE), positions=True
            ),
            TypeError,
            "got a bool",
        ),
    ],
    ids=["base 0", "base negative", "fractional length", "bool positions"],
)
def test_rope_arguments_named(make, error, words):
    with pytest.raises(error, match=words):
        make()


@pytest.mark.parametrize(
    "make, error, words",
    [
        (
            lambda: flash_attention(_randn(1, 0, 16, 16), _randn(1, 0, 16, 16), _randn(1, 0, 16, 16)),
            ValueError,
            "head",
        ),
        (
            lambda: flash_attention(_randn(1, 2, 16, 16), _randn(1, 0, 16, 16), _randn(1, 0, 16, 16)),
            ValueError,
            "head",
        ),
        (
            lambda: flash_attention(*(_randn(1, 2, 16, 16) for _ in range(3)), causal=2),
            ValueError,
            "causal must be",
        ),
        (
            lambda: flash_attention(*(_randn(1, 2, 16, 16) for _ in range(3)), scale="abc"),
            TypeError,
            "scale must be",
        ),
        (  # times log2(e), inf in float32: the interpreter's assertion, or a compile error, without the check
            lambda: flash_attention(*(_randn(1, 2, 16, 16) for _ in range(3)), scale=2.4e38),
            ValueError,
            "scale must be below 2.36e",
        ),
        (
            lambda: flash_attention(*(_randn(1, 2, 16, 16) for _ in range(3)), causal=torch.tensor([1, 0])),
            ValueError,
            "causal must be",
        ),
        (
            lambda: flash_attention(
                *(_randn(1, 2, 16, 16) for _ in range(3)), scale=torch.tensor(0.3, requires_grad=True)
            ),
            TypeError,
            "a tensor that requires grad would silently get no gradient",
        ),
        (
            lambda: flash_attention([[1.0] * 16] * 16, _randn(1, 2, 16, 16), _randn(1, 2, 16, 16)),
            TypeError,
            "^flash_attention: q must be a torch.Tensor, got list",
        ),
        (
            lambda: flash_attention(*(_randn(1, 2, 16, 16).requires_grad_() for _ in range(3)), sinks=[0.0, 1.0]),
            TypeError,
            "^flash_attention: sinks must be a tensor",
        ),
    ],
    ids=[
        "no heads", "no kv heads", "causal=2", "scale text", "scale past float32", "causal tensor",
        "scale wanting a gradient", "q a list",
        "sinks a list",
    ],
)  # fmt: skip
def test_attention_arguments_named(make, error, words):
    with pytest.raises(error, match=words):
        make()


def test_attention_backward_checks_L():
    """The public backward reads L through a pointer: a wrong dtype (once: dQ off by 1.27 with no error)
    or another device is refused by name."""
    q, k, v = (_randn(1, 2, 16, 16, seed=s) for s in range(3))
    o, L = attention_forward(q, k, v)
    do = _randn(1, 2, 16, 16, seed=5)
    for bad in (L.int(), L.half(), L.double()):
        with pytest.raises(TypeError, match="L must be torch.float32"):
            attention_backward(do, q, k, v, o, bad)
    for name, args in (("L", (do, q, k, v, o, L.to("meta"))), ("do", (do.to("meta"), q, k, v, o, L))):
        with pytest.raises(ValueError, match=f"{name} is on meta"):
            attention_backward(*args)


def test_continuous_batcher_arguments_named():
    """A batcher that could never run a step, or a prompt with ids the model has no embedding for, is
    refused when it is made or submitted, not at the first step (or as a device-side assert on a GPU)."""
    from course_lib.decode.batching import ContinuousBatcher
    from course_lib.decode.toy_model import ToyModel

    model = ToyModel(DEVICE)
    for kwargs, error, words in (
        ({"max_batch": 0}, ValueError, "max_batch must be >= 1, got 0"),
        ({"max_step_tokens": 0}, ValueError, "max_step_tokens must be >= 1, got 0"),
        ({"max_batch": 2.5}, TypeError, r"max_batch must be an integer, got 2\.5"),
    ):
        with pytest.raises(error, match=f"^ContinuousBatcher: {words}"):
            ContinuousBatcher(model, num_pages=8, page_size=4, **kwargs)
    batcher = ContinuousBatcher(model, num_pages=8, page_size=4)
    for prompt in ([1, -2, 3], [1, model.vocab], [1, 2.0]):
        with pytest.raises(ValueError, match=r"prompt token ids must be ints in \[0, 37\)"):
            batcher.submit(prompt, 2)
    assert batcher.submit([1, torch.tensor(2), model.vocab - 1], 2) == 0 and len(batcher.waiting) == 1
    for prompt, new, error, words in (
        ([1, 2], "3", TypeError, r"max_new_tokens must be an integer, got '3'"),
        ([1, 2], 2.5, TypeError, r"max_new_tokens must be an integer, got 2\.5"),
        ([1, 2], 0, ValueError, "max_new_tokens must be >= 1, got 0"),
        (None, 2, TypeError, "prompt must be a list of token ids, got NoneType"),
        ("ab", 2, TypeError, "prompt must be a list of token ids, got str"),
        (
            torch.tensor([[1, 2]]),  # a tokenizer's return_tensors for one text
            2,
            TypeError,
            r"prompt must be a list of token ids or a 1-D integer tensor, got a tensor of shape \(1, 2\) and dtype "
            r"torch.int64 \(one sequence: pass prompt\[0\]\)",
        ),
        (
            np.array([1.0, 2.0]),
            2,
            TypeError,
            r"prompt must be a list of token ids or a 1-D integer tensor, got a tensor of shape \(2,\) and dtype "
            r"float64",
        ),
        ([], 2, ValueError, "a request needs a non-empty prompt"),
        # 8 pages of 4 tokens: a request that could never fit, even alone, once jammed every later step
        (
            list(range(20)),
            13,
            ValueError,
            r"a prompt of 20 tokens and 13 new ones need room for 33 tokens, more than the whole page pool",
        ),
    ):
        with pytest.raises(error, match=f"^ContinuousBatcher.submit: {words}"):
            batcher.submit(prompt, new)
    assert len(batcher.waiting) == 1
    batcher.submit(list(range(20)), 12)  # exactly the pool: served
    assert len(batcher.run()[1]) == 12 and batcher.cache.allocator.num_free == 8


@pytest.mark.parametrize("backend", ["sdpa", "course_lib"])
def test_serving_past_max_seq_len_is_refused_by_name(backend):
    """`generate.stream` / `serve` (the paged cache) refuse a prompt whose new tokens would run past the
    model's max_seq_len, as `sample` does, before any step: the RoPE table lookup once failed mid-run with
    "IndexError: index 16 is out of bounds" (sdpa; a device-side assert on a GPU). What fits is served."""
    from course_lib.models import Llama, LlamaConfig, generate

    torch.manual_seed(0)
    config = LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=96, max_seq_len=16)
    model = Llama(config, backend).to(DEVICE)
    g = torch.Generator().manual_seed(3)
    fits, too_long = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (12, 14))
    words = (
        r"a prompt of 14 tokens and 5 new ones run the model at 18 positions \(the last new token is not fed "
        r"back\); the model has max_seq_len = 16"
    )
    loop = generate.make_batcher(model, [fits], 5, page_size=4)
    for name, call in (
        ("serve", lambda: generate.serve(model, [fits, too_long], 5, page_size=4)),
        ("stream", lambda: list(generate.stream(model, [too_long], 5))),
        ("serve(batcher=...)", lambda: generate.serve(model, [too_long], 5, batcher=loop)),
    ):
        with pytest.raises(ValueError, match=f"^{name.split('(')[0]}: {words}"):
            call()
        assert not (loop.waiting or loop.running), f"{backend} {name}: a request was queued"
    assert generate.serve(model, [fits], 5, batcher=loop) == generate.greedy_cached(model, [fits], 5), (
        f"{backend}: a prompt of 12 tokens and 5 new ones (16 positions: the last token is not fed) served"
    )


def test_lower_level_entry_points_take_any_strides():
    """The autograd Functions and helpers under the public wrappers, called directly with views: each must
    read what the tensor holds (each once read a strided argument as if it were contiguous)."""
    from course_lib.fused.rms_norm import column_sum, rms_norm_backward, rms_norm_forward
    from course_lib.fused.rope import RoPEFunction
    from course_lib.primer import WeightedSum

    x, w = _randn(7, 40)[:, ::2], _randn(40, seed=1)[::2]  # (7, 20) and (20,), both strided
    got = WeightedSum.apply(x, w)
    assert max_error(got, (x.double() * w.double()).sum(-1)) < 1e-5

    q, k = _randn(2, 3, 5, 32, seed=2)[..., ::2], _randn(2, 1, 5, 16, seed=3)  # q's head dim strided
    cos, sin = rope_cache(20, 16, device=DEVICE)
    q_rot, k_rot = RoPEFunction.apply(q, k, cos[None], sin[None], 0, False)
    c64, s64 = cos.double().cpu(), sin.double().cpu()
    assert max_error(q_rot, rope_reference(q.double().cpu(), c64[:5], s64[:5])) < 1e-5
    assert max_error(k_rot, rope_reference(k.double().cpu(), c64[:5], s64[:5])) < 1e-5

    x, w, dy = _randn(6, 40, seed=4), _randn(40, seed=5), _randn(6, 40, seed=6)
    _, rstd = rms_norm_forward(x, w, 1e-6)
    strided_rstd = torch.stack([rstd, 0 * rstd], dim=1)[:, 0]
    for got, want in zip(rms_norm_backward(dy, x, w, strided_rstd), rms_norm_backward(dy, x, w, rstd)):
        assert torch.equal(got, want)

    buffer = _randn(32, 5, seed=7)
    assert max_error(column_sum(buffer.t(), torch.float32), buffer.t().double().sum(0)) < 1e-5


def test_slices_past_32_bit_offsets_are_copied_or_named():
    """The kernels' offsets inside one (batch, head) slice are 32-bit. Shapes and strides only (meta
    tensors, no memory): transformers' (batch, rows, heads, d) layout at 600k rows of 32 x 128 spans
    2.5e9 elements per slice and is copied to (batch, heads, rows, d), which spans 7.7e7; the same
    rows contiguous, or a packed sequence read over its own rows only, are left as they are; an
    output, which is written where it is, and a slice too long even when contiguous are named."""
    from course_lib.attention.inputs import OFFSET_LIMIT, slice_span, within_offsets

    bnhd = torch.empty(1, 600_000, 32, 128, device="meta").transpose(1, 2)
    assert slice_span(bnhd, 600_000) >= OFFSET_LIMIT
    copied = within_offsets(bnhd, 600_000, "k", "test")
    assert copied.shape == bnhd.shape and copied.is_contiguous(), copied.stride()
    contiguous = torch.empty(1, 32, 600_000, 128, device="meta")
    assert within_offsets(contiguous, 600_000, "k", "test") is contiguous
    packed = torch.empty(600_000, 32, 128, device="meta").transpose(0, 1)[None]  # rows H * d apart
    assert within_offsets(packed, 4096, "k", "test") is packed, "a packed sequence's own rows fit"
    with pytest.raises(ValueError, match=r"O \(1, 32, 600000, 128\).*32-bit offsets"):
        within_offsets(bnhd, 600_000, "O", "test", copy=False)
    too_long = torch.empty(1, 1, 2**24 + 1, 128, device="meta")
    with pytest.raises(ValueError, match="split the sequence"):
        within_offsets(too_long, 2**24 + 1, "q", "test")


@pytest.mark.gpu
@pytest.mark.skipif(not course_lib.ON_GPU, reason="needs 4.3 GB of keys on a GPU")
def test_keys_spanning_more_than_2_to_the_31_elements():
    """k a (1, 1, 2**20 + 100, 64) slice of a (..., 2048)-wide buffer: rows 2048 elements apart, one
    slice spanning 2.1e9 elements, past int32. Forward and backward against float64."""
    from course_lib.testing import assert_close_to_reference, reference_outputs

    n_k, d = 2**20 + 100, 64
    g = torch.Generator(device=DEVICE).manual_seed(5)
    wide = torch.randn(1, 1, n_k, 2048, device=DEVICE, dtype=torch.bfloat16, generator=g)
    k = wide[..., :d].requires_grad_(True)
    q = (4 * torch.randn(1, 1, 128, d, device=DEVICE, generator=g)).bfloat16().requires_grad_(True)
    v = torch.randn(1, 1, n_k, d, device=DEVICE, dtype=torch.bfloat16, generator=g, requires_grad=True)
    o = flash_attention(q, k, v)
    do = torch.randn_like(o)
    o.backward(do)
    grads = [t.grad for t in (q, k, v)]
    k = k.detach().contiguous()
    del wide
    torch.cuda.empty_cache()
    ref_o, ref_g = reference_outputs(*(t.double() for t in (q, k, v)), False, None, do.double())
    base_o, base_g = reference_outputs(q, k, v, False, None, do)
    assert_close_to_reference(o, ref_o, base_o, what="O, keys spanning > 2**31 elements")
    for name, grad, r, b in zip(("dq", "dk", "dv"), grads, ref_g, base_g):
        assert_close_to_reference(grad, r, b, what=f"{name}, keys spanning > 2**31 elements")
