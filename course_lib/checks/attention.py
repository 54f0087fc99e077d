"""Checks of an attention call: q, k and v together, the head dim, the softmax scale, the causal mask and
its sliding window, attention sinks (notebooks 02, 06, 08b, 09).

One function per rule: `check_attention_inputs` (shapes, dtypes, devices of q, k, v), `KERNEL_HEAD_DIMS`
and `kernel_support` (what the Triton kernels take), `default_scale`, `causal_alignment` (every spelling of
`causal` a public function or an operator takes, for attention and for decoding), `check_window`,
`check_sinks`.
"""

from __future__ import annotations

import math

import torch

from .tensors import (
    FLOAT_DTYPES,
    KERNEL_DTYPES,
    accumulator_dtype,
    check_dtype,
    check_int,
    check_tensor,
    describe,
    dtype_names,
)

# Head dims the attention and decoding kernels take: multiples of 8 from 16 to 256. The kernels pad the
# head dim to a power of two (BLOCK_D), so 16, 32, 64, 128 and 256 waste nothing; the rest (e.g. 40, 80,
# 96) compute on zero padding.
MAX_HEAD_DIM = 256
KERNEL_HEAD_DIMS = tuple(range(16, MAX_HEAD_DIM + 1, 8))


def kernel_support(dtype: torch.dtype, head_dim: int) -> str | None:
    """What the compiled attention and decoding kernels cannot take about inputs of `dtype` and
    `head_dim` (None: nothing): a dtype outside `KERNEL_DTYPES`, a head dim outside `KERNEL_HEAD_DIMS`."""
    if dtype not in KERNEL_DTYPES:
        return f"dtype {dtype} is unsupported; supported: {dtype_names(KERNEL_DTYPES)}"
    if head_dim not in KERNEL_HEAD_DIMS:
        return f"head dim d={head_dim} is unsupported; supported: multiples of 8 from 16 to {MAX_HEAD_DIM}"
    return None


def check_attention_inputs(
    q,
    k,
    v,
    *,
    where: str,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    head_dims: tuple[int, ...] | None = None,
    same_head_dim_v: bool = True,
    allow_empty: bool = False,
    allow_gqa: bool = False,
) -> None:
    """Validate q (..., Nq, d), k (..., Nk, d), v (..., Nk, d_v) for attention.

    Grouped-query attention (`allow_gqa`): with 4 or more dims (..., heads, N, d), k and v may have
    fewer heads than q, as long as q's heads are a multiple of theirs (query head h uses K/V head
    h // (Hq / Hkv)).
    `where` names the caller in the message. `dtypes` lists accepted dtypes; `head_dims`, if given,
    the accepted d; `allow_empty` accepts Nk = 0 (rows that see no key). Raises TypeError (wrong kind
    or dtype) or ValueError (shapes, devices, d)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(where, name, t)
        if t.dim() < 2:
            raise ValueError(
                f"{where}: {name} must have at least 2 dims (..., seq_len, head_dim); {describe(name, t)}"
            )
        if not t.dtype.is_floating_point:
            raise TypeError(
                f"{where}: {name} has dtype {t.dtype}; attention needs floating-point inputs "
                f"({dtype_names(dtypes)})"
            )
        check_dtype(where, name, t, dtypes)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"{where}: q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"{where}: q, k and v must be on one device; got q on {q.device}, k on {k.device}, v on {v.device}"
        )
    qs, ks, vs = q.shape, k.shape, v.shape
    dims = len(qs)
    if not (dims == len(ks) == len(vs)) or ks[:-2] != vs[:-2]:
        raise ValueError(
            f"{where}: q, k and v must have the same leading (batch, heads) dims; got "
            f"q {tuple(qs)}, k {tuple(ks)}, v {tuple(vs)}"
        )
    if dims >= 4 and 0 in (qs[-3], ks[-3]):
        raise ValueError(
            f"{where}: q, k and v need at least one head (dim -3); got q {tuple(qs)}, k {tuple(ks)}, "
            f"v {tuple(vs)}"
        )
    if qs[:-2] != ks[:-2]:
        grouped = allow_gqa and dims >= 4 and qs[:-3] == ks[:-3] and ks[-3] > 0
        if not grouped:
            raise ValueError(
                f"{where}: q, k and v must have the same leading (batch, heads) dims"
                + (
                    " (k and v may have fewer heads, dim -3 of 4, for grouped-query attention)"
                    if allow_gqa
                    else ""
                )
                + f"; got q {tuple(qs)}, k {tuple(ks)}, "
                f"v {tuple(vs)}"
            )
        if qs[-3] % ks[-3]:
            raise ValueError(
                f"{where}: grouped-query attention needs q's heads to be a multiple of k's and v's; got "
                f"{qs[-3]} query heads and {ks[-3]} key/value heads (q {tuple(qs)}, "
                f"k {tuple(ks)})"
            )
    d = qs[-1]
    if d != ks[-1]:
        raise ValueError(
            f"{where}: head dims differ: q has d={d}, k has d={ks[-1]} (q {tuple(qs)}, k {tuple(ks)})"
        )
    if ks[-2] != vs[-2]:
        raise ValueError(
            f"{where}: k and v must have the same number of keys; got k {tuple(ks)}, v {tuple(vs)}"
        )
    if same_head_dim_v and vs[-1] != d:
        raise ValueError(f"{where}: v must have the head dim of q (d={d}); got v {tuple(vs)}")
    if qs[-2] == 0 or (ks[-2] == 0 and not allow_empty) or d == 0:
        raise ValueError(f"{where}: empty sequence or head dim: q {tuple(qs)}, k {tuple(ks)}, v {tuple(vs)}")
    if head_dims is not None and d not in head_dims:
        raise ValueError(
            f"{where}: head dim d={d} is not supported; supported head dims: {', '.join(map(str, head_dims))}"
        )


def kv_group(q: torch.Tensor, k: torch.Tensor) -> int:
    """Query heads per K/V head (1 unless grouped-query attention; inputs checked already)."""
    return q.shape[-3] // k.shape[-3] if q.dim() >= 4 else 1


def default_scale(head_dim: int, scale: float | None) -> float:
    """The softmax scale: 1/sqrt(d) unless given. Rejects non-positive or non-finite scales."""
    if scale is None:
        return head_dim**-0.5
    if type(scale) is float and 0 < scale < _MAX_SCALE:  # the common case: a plain float, in range
        return scale
    if isinstance(scale, (str, bytes, bool)):
        raise TypeError(f"scale must be a number (or None for 1/sqrt(d)), got {scale!r}")
    if isinstance(scale, torch.Tensor) and scale.requires_grad:
        raise TypeError(
            "scale must be a number: the kernels take it as a constant, so a tensor that requires grad would "
            "silently get no gradient; pass float(scale), or scale q instead (q * s with scale=1.0)"
        )
    try:
        scale = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a number (or None for 1/sqrt(d)), got {scale!r}") from None
    if not (scale > 0 and scale != float("inf")):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    if scale * math.log2(math.e) > torch.finfo(torch.float32).max:
        raise ValueError(
            f"scale must be below {_MAX_SCALE:.3g}: the kernels fold log2(e) into it in float32, where it would "
            f"be inf; got {scale}"
        )
    return scale


# the largest scale whose product with log2(e) is finite in float32 (the kernels' qk_scale)
_MAX_SCALE = torch.finfo(torch.float32).max / math.log2(math.e)

ALIGNMENTS = ("top_left", "bottom_right")

# What the choices are called in an error, per (alignments taken, strings only)
_CAUSAL_CHOICES = {
    (
        ALIGNMENTS,
        False,
    ): "False, True (= 'top_left': query i sees keys j <= i) or 'bottom_right' (query i sees "
    "keys j <= i + Nk - Nq, the KV-cache alignment)",
    (("bottom_right",), False): "True / 'bottom_right' or False (the queries are the last positions of the "
    "keys: 'top_left' has no meaning there)",
    (ALIGNMENTS, True): "one of ('none', 'top_left', 'bottom_right')",
    (("bottom_right",), True): "'none' or 'bottom_right' (the queries are the last positions of the keys: "
    "top-left has no meaning here)",
}


def causal_alignment(
    causal, where: str | None = None, alignments=ALIGNMENTS, strings: bool = False
) -> str | None:
    """Normalise a `causal` argument to None (no mask) or an alignment, "top_left" (query i sees keys
    j <= i) or "bottom_right" (j <= i + Nk - Nq): the one rule of every attention and decoding entry point.

    False, None, "none" (and 0, NumPy's bools, a one-element tensor) -> None; True -> the first of
    `alignments`; an alignment's name -> itself if it is in `alignments`. Attention takes both alignments
    (True = "top_left"); decoding only ("bottom_right",) (True = "bottom_right": the new tokens are the last
    of the cache). `strings`: a custom operator's schema string, "none" or an alignment's name, nothing else.
    Anything else is a ValueError naming the choices (and `where`, when given)."""
    if isinstance(causal, str):
        if causal in alignments:
            return causal
        if causal == "none":
            return None
    elif strings:
        pass  # an operator's string only: the error below
    elif isinstance(causal, torch.Tensor) and causal.numel() != 1:
        pass  # one flag, not one per element: the error below
    elif causal is None or isinstance(causal, bool) or type(causal).__name__ == "bool_" or causal in (0, 1):
        return alignments[0] if causal else None
    prefix = "" if where is None else f"{where}: "
    choices = _CAUSAL_CHOICES.get((tuple(alignments), strings)) or f"one of {('none', *alignments)}"
    raise ValueError(f"{prefix}causal must be {choices}; got {causal!r}")


def causal_offset(alignment: str | None, n_q: int, n_k: int) -> int:
    """The offset in `j <= i + offset`: 0 for top-left (and for no mask), Nk - Nq for bottom-right."""
    return n_k - n_q if alignment == "bottom_right" else 0


def check_window(window, alignment: str | None, where: str = "attention") -> int:
    """Normalise a sliding-window argument: None -> 0 (no window); else an int >= 1, the number of keys a
    query sees at most, its own position included: query i sees keys i + offset - window < j <= i + offset
    (Mistral's `sliding_window`, Gemma's local layers). A window needs a causal alignment."""
    if window is None:
        return 0
    window = check_int(where, "window", window, 1)
    if alignment is None:
        raise ValueError(
            f"{where}: a sliding window (window={window}) needs causal=True, 'top_left' or 'bottom_right': "
            "query i sees the `window` keys ending at its own position"
        )
    return window


def kernel_window(window: int, n_q: int, n_k: int) -> int:
    """The window the kernels receive: `check_window`'s value capped at Nq + Nk, which no pair can exceed
    (so a huge "no limit" window cannot overflow their 32-bit index arithmetic); 0 stays 0 (none)."""
    return min(window, max(1, n_q + n_k)) if window else 0


def check_sinks(sinks, q: torch.Tensor, where: str = "attention") -> torch.Tensor | None:
    """Normalise attention sinks (gpt-oss's `sinks`, one learned logit per query head that joins every row's
    softmax as an extra key whose value is zero): None stays None; else a floating tensor of shape (Hq,)
    (Hq = q.shape[-3] for 4-D q, 1 for 3-D q) on q's device, returned contiguous in the accumulator dtype
    (float32, float64 for float64 q). A sink of -inf is no sink; a sink of +inf or NaN is not a logit (its
    values are not checked here: that would wait for the GPU), and gives NaN."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(
            f"{where}: sinks must be a tensor of shape (query heads,) or None, got {type(sinks).__name__}"
        )
    heads = q.shape[-3] if q.dim() >= 4 else 1
    if sinks.shape != (heads,):
        raise ValueError(
            f"{where}: sinks must have shape ({heads},), one logit per query head of q {tuple(q.shape)}; "
            f"got {tuple(sinks.shape)}"
        )
    if not sinks.is_floating_point():
        raise TypeError(f"{where}: sinks must be a floating-point tensor, got {sinks.dtype}")
    if sinks.device != q.device:
        raise ValueError(f"{where}: sinks are on {sinks.device}, q on {q.device}; move them to q's device")
    return sinks.to(accumulator_dtype(q.dtype)).contiguous()
