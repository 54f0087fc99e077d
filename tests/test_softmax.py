"""course_lib.softmax: naive, safe and online softmax and the merge of partial states (notebook 03)."""

import warnings

import numpy as np
import pytest

from course_lib import softmax

FUNCS = {
    "naive": softmax.naive_softmax,
    "safe": softmax.safe_softmax,
    "online": softmax.online_softmax,
    "online, block 5": lambda x: softmax.online_softmax(x, block_size=5),
}
TOL = {np.float16: 3e-3, np.float32: 2e-6, np.float64: 1e-13}


def reference(x):
    """Softmax along the last axis in float64, max-subtracted."""
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("shape", [(7,), (3, 33), (2, 3, 64), (1, 1)])
@pytest.mark.parametrize("name", list(FUNCS))
def test_matches_float64_reference(name, shape, dtype):
    rng = np.random.default_rng([len(shape), shape[-1]])
    x = (rng.standard_normal(shape) * 2).astype(dtype)
    y = FUNCS[name](x)
    assert y.shape == x.shape and y.dtype == x.dtype, f"{name} {shape} {dtype.__name__}: {y.shape} {y.dtype}"
    what = f"{name} {shape} {dtype.__name__}"
    np.testing.assert_allclose(y.astype(np.float64), reference(x), atol=TOL[dtype], rtol=0, err_msg=what)


def test_functions_agree_with_each_other():
    x = np.random.default_rng(1).standard_normal((4, 5, 129)) * 3
    base = softmax.safe_softmax(x)
    for name, fn in FUNCS.items():
        np.testing.assert_allclose(fn(x), base, rtol=1e-12, atol=1e-15, err_msg=name)


@pytest.mark.parametrize("dtype,limit", [(np.float16, 11.09375), (np.float32, 88.72283935546875)])
def test_naive_overflows_where_exp_does_and_safe_does_not(dtype, limit):
    just_below = np.nextafter(dtype(limit), dtype(-np.inf))
    x = np.array([[0.0, float(just_below)], [0.0, limit]], dtype=dtype)
    naive = softmax.naive_softmax(x)
    assert np.isfinite(naive[0]).all() and np.isnan(naive[1]).any(), f"{dtype.__name__}: {naive}"
    for fn in (softmax.safe_softmax, softmax.online_softmax):
        y = fn(x).astype(np.float64)
        np.testing.assert_allclose(
            y, reference(x), atol=TOL[dtype], err_msg=f"{fn.__name__} {dtype.__name__}"
        )


def test_state_is_max_and_sum_and_online_state_matches():
    x = np.random.default_rng(2).standard_normal((3, 50)) * 4
    m, l = softmax.softmax_state(x)
    np.testing.assert_array_equal(m, x.max(-1))
    np.testing.assert_allclose(l, np.exp(x - x.max(-1, keepdims=True)).sum(-1), rtol=1e-14)
    for block in (1, 7, 50, 64):
        m_o, l_o = softmax.online_state(x, block_size=block)
        np.testing.assert_array_equal(m_o, m, err_msg=f"block {block}")
        np.testing.assert_allclose(l_o, l, rtol=1e-13, err_msg=f"block {block}")


def test_merge_is_exact_commutative_and_associative():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 90)) * 5
    a, b, c = (softmax.softmax_state(p) for p in np.split(x, [20, 61], axis=-1))
    whole = softmax.softmax_state(x)
    results = {
        "(a b) c": softmax.merge_states(softmax.merge_states(a, b), c),
        "a (b c)": softmax.merge_states(a, softmax.merge_states(b, c)),
        "(c a) b": softmax.merge_states(softmax.merge_states(c, a), b),
    }
    for name, (m, l) in results.items():
        np.testing.assert_array_equal(m, whole[0], err_msg=name)
        np.testing.assert_allclose(l, whole[1], rtol=1e-13, err_msg=name)


def test_edge_cases_minus_inf_huge_tiny_length_one():
    inf = np.inf
    x = np.array([[0.5, -inf, 1.5, -inf], [-inf, -inf, -inf, 2.0], [-inf, -inf, -inf, -inf]])
    for name, fn in FUNCS.items():
        y = fn(x)
        assert (y[0, [1, 3]] == 0).all() and np.isclose(y[0].sum(), 1), name
        assert y[1].tolist() == [0, 0, 0, 1], name
        assert np.isnan(y[2]).all(), f"{name}: a row of -inf has no softmax"
    m, l = softmax.softmax_state(x[2])
    assert m == -inf and l == 0
    merged = softmax.merge_states((m, l), softmax.softmax_state(x[0]))
    np.testing.assert_allclose(merged, softmax.softmax_state(x[0]))

    huge = np.array([[3e38, -3e38, 1e4], [1e4, 1e4 - 1, -1e4]], dtype=np.float32)
    assert np.isnan(softmax.naive_softmax(huge)).any(axis=-1).all()
    tiny = np.random.default_rng(4).standard_normal((2, 40)).astype(np.float32) * 1e-30
    with warnings.catch_warnings():  # the safe and online versions overflow nowhere: no RuntimeWarning
        warnings.simplefilter("error")
        for name in ("safe", "online", "online, block 5"):
            np.testing.assert_allclose(FUNCS[name](huge), reference(huge), atol=1e-7, err_msg=name)
            np.testing.assert_allclose(FUNCS[name](tiny), 1 / 40, rtol=1e-6, err_msg=name)
            single = FUNCS[name](np.array([[5.0], [-3e38], [3e38]], dtype=np.float32))
            assert (single == 1).all(), f"{name}: {single}"


def test_float16_state_is_accumulated_in_float32():
    x = (np.random.default_rng(5).standard_normal((4, 4096))).astype(np.float16)
    m, l = softmax.online_state(x)
    assert l.dtype == np.float32
    np.testing.assert_allclose(l, np.exp(x.astype(np.float64) - m[:, None]).sum(-1), rtol=1e-4)


@pytest.mark.parametrize(
    "bad,error,match",
    [
        (np.arange(4), TypeError, "floating dtype"),
        (np.float64(1.0), ValueError, "scalar"),
        (np.zeros((3, 0)), ValueError, "empty"),
        ([["a", "b"]], TypeError, "floating dtype"),
    ],
    ids=["int", "scalar", "empty", "strings"],
)
@pytest.mark.parametrize("name", ["naive_softmax", "safe_softmax", "online_softmax", "softmax_state"])
def test_bad_inputs_raise_clear_errors(name, bad, error, match):
    with pytest.raises(error, match=match) as info:
        getattr(softmax, name)(bad)
    assert name in str(info.value)


@pytest.mark.parametrize("block", [0, -2, 1.5, True])
def test_bad_block_size(block):
    with pytest.raises(ValueError, match="block_size"):
        softmax.online_softmax(np.ones(4), block_size=block)
