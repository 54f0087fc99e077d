"""course_lib.attention.merge: the logsumexp merge of partial attention results (notebooks 03, 09, 13)."""

from __future__ import annotations

import pytest
import torch

from course_lib.attention.merge import merge_attention_states, merge_many
from course_lib.attention.reference import attention


def partial(q, k, v, keys):
    """(O, L) of attention over the keys selected by the boolean mask `keys` (N,), in float64."""
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~keys, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    return p @ v, lse


def qkv(n=40, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, m, d, generator=g, dtype=torch.float64) for m in (5, n, n)]


def test_two_disjoint_halves_give_full_attention():
    q, k, v = qkv()
    keys = torch.arange(40)
    o_a, l_a = partial(q, k, v, keys < 17)
    o_b, l_b = partial(q, k, v, keys >= 17)
    o, lse = merge_attention_states(o_a, l_a, o_b, l_b)
    ref_o, ref_l = attention(q, k, v, return_lse=True)
    torch.testing.assert_close(o, ref_o)
    torch.testing.assert_close(lse, ref_l)
    o2, lse2 = merge_attention_states(o_b, l_b, o_a, l_a)  # order does not matter
    torch.testing.assert_close(o2, o)
    torch.testing.assert_close(lse2, lse)


def test_empty_part_is_the_identity_and_two_empty_parts_give_zero():
    q, k, v = qkv(seed=1)
    o_a, l_a = partial(q, k, v, torch.ones(40, dtype=torch.bool))
    zero, neg = torch.zeros_like(o_a), torch.full_like(l_a, float("-inf"))
    o, lse = merge_attention_states(o_a, l_a, zero, neg)
    torch.testing.assert_close(o, o_a)
    torch.testing.assert_close(lse, l_a)
    o, lse = merge_attention_states(zero, neg, zero, neg)
    assert not torch.isnan(o).any() and (o == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("dim", [0, 2])
def test_merge_many_equals_full_attention(dim):
    q, k, v = qkv(seed=2)
    bounds = [0, 3, 3, 20, 39, 40]  # one empty part, parts of 1 and 3 keys
    keys = torch.arange(40)
    parts = [partial(q, k, v, (keys >= a) & (keys < b)) for a, b in zip(bounds, bounds[1:])]
    o_parts = torch.stack([p[0] for p in parts], dim=dim)
    l_parts = torch.stack([p[1] for p in parts], dim=dim)
    o, lse = merge_many(o_parts, l_parts, dim=dim)
    ref_o, ref_l = attention(q, k, v, return_lse=True)
    torch.testing.assert_close(o, ref_o)
    torch.testing.assert_close(lse, ref_l)


def test_low_precision_parts_keep_their_dtype():
    q, k, v = qkv(seed=3)
    keys = torch.arange(40)
    (o_a, l_a), (o_b, l_b) = (partial(q, k, v, keys < 9), partial(q, k, v, keys >= 9))
    o, lse = merge_attention_states(o_a.half(), l_a.float(), o_b.half(), l_b.float())
    assert o.dtype == torch.float16 and lse.dtype == torch.float32
    torch.testing.assert_close(o.double(), attention(q, k, v), atol=2e-3, rtol=2e-3)


def test_merge_is_differentiable():
    q, k, v = qkv(seed=4)
    keys = torch.arange(40)
    o_a, l_a = partial(q, k, v, keys < 20)
    o_b, l_b = partial(q, k, v, keys >= 20)
    parts = [t.detach().requires_grad_() for t in (o_a, l_a, o_b, l_b)]
    assert torch.autograd.gradcheck(lambda *a: merge_attention_states(*a), parts)


def test_shape_mismatch_is_a_clear_error():
    o = torch.zeros(2, 4, 8)
    lse = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="merge_attention_states"):
        merge_attention_states(o, lse, o[:, :3], lse[:, :3])
    with pytest.raises(ValueError, match="merge_many"):
        merge_many(o, lse[:, :3])


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda o, lse: merge_many(o, lse, dim=2), ValueError, "dim"),  # past lse's axes (o's d)
        (lambda o, lse: merge_many(o, lse, dim=5), ValueError, "dim"),
        (lambda o, lse: merge_many(o, lse, dim=-1), ValueError, "dim"),
        (lambda o, lse: merge_many(o, lse, dim=1.0), TypeError, "dim"),
        (lambda o, lse: merge_attention_states(o.long(), lse, o.long(), lse), TypeError, "o_a"),
        (lambda o, lse: merge_attention_states(o, lse.long(), o, lse.long()), TypeError, "lse_a"),
        (
            lambda o, lse: merge_attention_states(o, lse.half(), o, lse.half()),
            TypeError,
            "float32 or float64",
        ),
        (lambda o, lse: merge_attention_states(o, lse, o.to("meta"), lse), ValueError, "one device"),
        (
            lambda o, lse: merge_attention_states(o.tolist(), lse, o, lse),
            TypeError,
            "o_a must be a torch.Tensor",
        ),
    ],
)
def test_bad_parts_are_clear_errors(call, error, words):
    o, lse = torch.randn(2, 4, 8), torch.randn(2, 4)
    with pytest.raises(error, match=words):
        call(o, lse)
