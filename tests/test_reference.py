"""The float64 reference every kernel is judged by, and the input checks of every public function."""

import pytest
import torch
import torch.nn.functional as F

from course_lib.attention.reference import attention, causal_mask
from course_lib.testing import max_error, random_qkv, run_cases


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape_q,n_k", [((2, 7, 16), 7), ((2, 3, 5, 8), 9), ((1, 9, 4), 5), ((1, 1, 8), 1)])
def test_matches_sdpa_float64(shape_q, n_k, causal):
    q, k, v = random_qkv(shape_q, n_k, dtype=torch.float64)
    out, lse = attention(q, k, v, causal=causal, return_lse=True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, expected, msg=lambda m: f"{shape_q} nk={n_k} causal={causal}: {m}")
    s = (q @ k.transpose(-1, -2)) * shape_q[-1] ** -0.5
    if causal:
        s = s.masked_fill(~causal_mask(shape_q[-2], n_k), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))
    assert lse.shape == q.shape[:-1]


def test_causal_mask_is_top_left_aligned():
    m = causal_mask(3, 5)
    assert m.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [True, True, True, False, False],
    ]


def test_scale_and_half_precision():
    q, k, v = random_qkv((2, 16, 32), dtype=torch.float64)
    out = attention(q, k, v, scale=0.5)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=0.5))
    out16, lse16 = attention(q.half(), k.half(), v.half(), return_lse=True)
    assert out16.dtype == torch.float16 and lse16.dtype == torch.float32
    torch.testing.assert_close(out16.double(), attention(q, k, v), atol=5e-3, rtol=5e-3)


def test_gradients_flow_in_float64():
    q, k, v = random_qkv((1, 5, 4), 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: attention(q, k, v, causal=True), (q, k, v))


def test_large_logits_stay_finite():
    """Logits in the thousands: float32 stays finite and near float64. Float32 rounds a logit s by about
    eps * |s|, which moves P by that much relatively and O by that times |v|: the bound is 8 times
    eps * max|logit| * max|v| (the rule of test_attention_forward_backward's test_large_logits)."""
    q, k, v = random_qkv((1, 33, 16), dtype=torch.float32, scale=40.0)
    o = attention(q, k, v, causal=True)
    assert torch.isfinite(o).all()
    logits = (q.double() @ k.double().transpose(-1, -2)).abs().max().item() / 16**0.5
    assert logits > 1e3, f"test set-up: logits reach only {logits:.3g}"
    bound = 8 * torch.finfo(torch.float32).eps * logits * v.double().abs().max().item()
    err = max_error(o, attention(q.double(), k.double(), v.double(), causal=True))
    assert err <= bound, f"logits up to {logits:.3g}: max error {err:.3g} against float64 above {bound:.3g}"


BAD = [
    ("int", lambda q, k, v: (q.long(), k, v), TypeError, "dtype torch.int64"),
    ("mixed dtypes", lambda q, k, v: (q, k.half(), v), TypeError, "share one dtype"),
    ("1-D", lambda q, k, v: (q[0, 0], k, v), ValueError, "at least 2 dims"),
    ("head dims", lambda q, k, v: (q, k[..., :4], v), ValueError, "head dims differ"),
    ("keys vs values", lambda q, k, v: (q, k, v[:, :3]), ValueError, "same number of keys"),
    ("batch", lambda q, k, v: (q, k[:1], v[:1]), ValueError, "leading"),
    ("not a tensor", lambda q, k, v: (q.tolist(), k, v), TypeError, "must be a torch.Tensor"),
    ("empty", lambda q, k, v: (q[:, :0], k, v), ValueError, "empty"),
]


@pytest.mark.parametrize("name,mutate,exc,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_named(name, mutate, exc, words):
    q, k, v = random_qkv((2, 6, 8))
    with pytest.raises(exc, match=words):
        attention(*mutate(q, k, v))


def test_bad_scale():
    q, k, v = random_qkv((1, 4, 8))
    with pytest.raises(ValueError, match="scale"):
        attention(q, k, v, scale=-1.0)


def test_run_cases_keeps_the_order_and_raises_a_failure():
    """run_cases: results in the order of the cases (threads on a GPU, one after another on a CPU), and a
    failing case's error reaches the caller."""
    assert run_cases(lambda n: n * n, range(12)) == [n * n for n in range(12)]

    def check(n):
        assert n != 7, f"case {n} fails"
        return n

    with pytest.raises(AssertionError, match="case 7 fails"):
        run_cases(check, range(12))


@pytest.mark.parametrize("causal", (False, True, "bottom_right"))
def test_reference64_by_heads_matches_one_call(causal):
    """`testing.reference64` (a few heads at a time, for large float64 references) gives what one call of the
    reference gives, with grouped K/V heads split with their query heads and a window passed through."""
    from course_lib.testing import reference64

    torch.manual_seed(3)
    q = torch.randn(2, 6, 33, 16, dtype=torch.float16)
    k, v = torch.randn(2, 3, 41, 16, dtype=torch.float16), torch.randn(2, 3, 41, 16, dtype=torch.float16)
    window = 9 if causal else None
    got_o, got_l = reference64(q, k, v, causal, heads_at_once=4, window=window)
    want_o, want_l = attention(q.double(), k.double(), v.double(), causal, return_lse=True, window=window)
    assert got_o.dtype == torch.float64 and got_o.shape == want_o.shape
    torch.testing.assert_close(got_o, want_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_l, want_l, rtol=1e-12, atol=1e-12)
