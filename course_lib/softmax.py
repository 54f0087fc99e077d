"""Softmax three ways, in NumPy: naive, safe (max-subtracted) and online (one pass for m and l).

Taught in notebook 03. Every function works along the last axis of an array of any rank and returns
the array's dtype (float16, float32 or float64). The naive and safe softmax also compute in that dtype,
so that what a dtype can and cannot hold is visible: `naive_softmax` overflows in float16 once an input
passes log(65504) ~ 11.09. The online state (m, l) is kept in at least float32, as a GPU kernel keeps
it in float32 registers: a running sum of thousands of terms in float16 would lose about 1 %.

The online softmax (Milakov & Gimelshein, 2018) keeps, per row, a *state* (m, l):
    m = the largest input seen so far,   l = sum over the inputs seen so far of exp(x - m).
Two states of disjoint parts of a row merge exactly (`merge_states`), in any order: that is what lets
FlashAttention process keys block by block (notebook 04) and split-KV decoding process them in parallel.

Conventions for rows that hold -inf (masked entries): exp(-inf) = 0, so a masked entry gets
probability 0; a row that is -inf everywhere has no softmax, and all three functions return NaN for
it (as the textbook formula and `torch.softmax` do). Its state is (m, l) = (-inf, 0).
"""

from __future__ import annotations

import numpy as np


def _as_float_array(x, where: str) -> np.ndarray:
    """x as a NumPy floating array with at least one dimension and a non-empty last axis."""
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(
            f"{where}: x has dtype {x.dtype}; softmax needs a floating dtype (float16, float32 or float64)"
        )
    if x.ndim == 0:
        raise ValueError(f"{where}: x is a scalar; softmax works along the last axis of an array (..., N)")
    if x.shape[-1] == 0:
        raise ValueError(f"{where}: the last axis of x is empty (shape {x.shape}); softmax needs N >= 1")
    return x


def _state_dtype(dtype) -> np.dtype:
    """float32 for float16 inputs, else the input's dtype: the precision the state (m, l) is kept in."""
    return np.promote_types(dtype, np.float32)


def _exp_minus(x: np.ndarray, m: np.ndarray) -> np.ndarray:
    """exp(x - m) with the convention exp(-inf - (-inf)) = 0: a row with nothing seen yet adds nothing."""
    m_safe = np.where(np.isneginf(m), np.zeros_like(m), m)
    with np.errstate(over="ignore"):  # x - m may round to -inf when m >> x: exp gives the right 0
        return np.exp(x - m_safe)


def naive_softmax(x) -> np.ndarray:
    """exp(x) / sum(exp(x)) along the last axis, exactly as written in a textbook.

    x: (..., N) float array; returns (..., N) in x's dtype. It overflows (inf, then NaN) as soon as one
    exp(x) exceeds the dtype's largest value: x > 11.09 in float16, x > 88.72 in float32; and it
    divides 0 by 0 (NaN) when every exp(x) underflows to 0."""
    x = _as_float_array(x, "naive_softmax")
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(x)  # pass 1: read x, write e
        return e / e.sum(axis=-1, keepdims=True)  # pass 2: read e (sum); pass 3: read e, write y


def safe_softmax(x) -> np.ndarray:
    """Softmax with the row maximum subtracted first: exp(x - m) / sum(exp(x - m)), m = max(x).

    x: (..., N) float array; returns (..., N) in x's dtype. The result is mathematically the naive
    softmax's, but every exponent is <= 0, so nothing overflows. Three passes over x:
    max, then sum, then normalise."""
    x = _as_float_array(x, "safe_softmax")
    with np.errstate(over="ignore", invalid="ignore"):
        m = x.max(axis=-1, keepdims=True)  # pass 1: read x -> m
        l = np.exp(x - m).sum(axis=-1, keepdims=True)  # pass 2: read x -> l
        return np.exp(x - m) / l  # pass 3: read x, write y


def softmax_state(x) -> tuple[np.ndarray, np.ndarray]:
    """The online-softmax state (m, l) of one block: m = max(x), l = sum(exp(x - m)) along the last axis.

    x: (..., B) float array; returns m and l, each of shape (...), float32 for float16 input, else
    x's dtype. A block that is -inf everywhere has the empty state (-inf, 0)."""
    x = _as_float_array(x, "softmax_state")
    x = x.astype(_state_dtype(x.dtype), copy=False)
    m = x.max(axis=-1)
    l = _exp_minus(x, m[..., None]).sum(axis=-1)
    return m, l


def merge_states(state_a, state_b) -> tuple[np.ndarray, np.ndarray]:
    """Merge the states (m, l) of two disjoint parts of the same rows into the state of their union.

        m = max(m_a, m_b),   l = l_a * exp(m_a - m) + l_b * exp(m_b - m)

    Exact (up to rounding), commutative and associative: blocks may be merged in any order or as a
    tree, which is what tiled and split-KV attention rely on. States are pairs of arrays of the same
    shape (...); the result has that shape."""
    (m_a, l_a), (m_b, l_b) = state_a, state_b
    m = np.maximum(m_a, m_b)
    return m, l_a * _exp_minus(m_a, m) + l_b * _exp_minus(m_b, m)


def online_state(x, block_size: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """One pass over x, left to right, `block_size` entries at a time: the running state (m, l).

    With block_size=1 this is Milakov & Gimelshein's update for each new entry x_j:
        m_new = max(m, x_j),   l = l * exp(m - m_new) + exp(x_j - m_new)
    (the old sum is rescaled whenever the maximum grows). Larger blocks do the same with
    `softmax_state` of the block and `merge_states`, as FlashAttention does with a block of keys.
    x: (..., N) float array; returns m, l of shape (...), float32 for float16 input, else x's dtype."""
    x = _as_float_array(x, "online_state")
    if isinstance(block_size, bool) or not (isinstance(block_size, (int, np.integer)) and block_size >= 1):
        raise ValueError(f"online_state: block_size must be a positive integer, got {block_size!r}")
    acc = _state_dtype(x.dtype)
    state = (np.full(x.shape[:-1], -np.inf, dtype=acc), np.zeros(x.shape[:-1], dtype=acc))
    for start in range(0, x.shape[-1], block_size):
        state = merge_states(state, softmax_state(x[..., start : start + block_size]))
    return state


def online_softmax(x, block_size: int = 1) -> np.ndarray:
    """Softmax in two passes: `online_state` finds (m, l) in one pass, a second pass normalises.

    x: (..., N) float array; returns (..., N) in x's dtype, equal to `safe_softmax(x)` up to rounding.
    Two reads of x instead of the safe softmax's three; inside attention (notebook 04) even the second
    pass disappears, because the normalisation is applied to the output O once at the end."""
    x = _as_float_array(x, "online_softmax")
    m, l = online_state(x, block_size)  # pass 1: read x -> (m, l)
    with np.errstate(invalid="ignore", divide="ignore"):
        y = _exp_minus(x.astype(m.dtype, copy=False), m[..., None]) / l[..., None]  # pass 2: read x, write y
    return y.astype(x.dtype, copy=False)
