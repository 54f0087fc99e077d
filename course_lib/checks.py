"""Input checks shared by every public function in course_lib: one check per rule, here.

Bad input must give an error that names the problem (shape, dtype, device, head dimension), never a
crash inside a kernel, a hang or silent garbage. Every public attention entry point calls
`check_attention_inputs`; every kernel's entry point (attention, decoding, RMSNorm, RoPE) checks its
tensors' device with `check_kernel_device`, and the attention and decoding kernels take the head dims
of `KERNEL_HEAD_DIMS`.
"""

from __future__ import annotations

import math
import numbers
import operator

import torch

from . import runtime

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def shape_and_dtype(x) -> str:
    """'(2, 5) torch.int64' for a tensor, its type's name for anything else: what an error says it got."""
    return f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__


def _describe(name: str, t: torch.Tensor) -> str:
    return f"{name}: shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


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
                f"{where}: {name} must have at least 2 dims (..., seq_len, head_dim); {_describe(name, t)}"
            )
        if not t.dtype.is_floating_point:
            raise TypeError(
                f"{where}: {name} has dtype {t.dtype}; attention needs floating-point inputs "
                f"({', '.join(str(d).replace('torch.', '') for d in dtypes)})"
            )
        if t.dtype not in dtypes:
            raise TypeError(
                f"{where}: {name} has dtype {t.dtype}, which is not supported here; "
                f"supported: {', '.join(str(d).replace('torch.', '') for d in dtypes)}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"{where}: q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"{where}: q, k and v must be on one device; got q on {q.device}, k on {k.device}, v on {v.device}"
        )
    if not (q.dim() == k.dim() == v.dim()) or k.shape[:-2] != v.shape[:-2]:
        raise ValueError(
            f"{where}: q, k and v must have the same leading (batch, heads) dims; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.dim() >= 4 and 0 in (q.shape[-3], k.shape[-3]):
        raise ValueError(
            f"{where}: q, k and v need at least one head (dim -3); got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    if q.shape[:-2] != k.shape[:-2]:
        grouped = allow_gqa and q.dim() >= 4 and q.shape[:-3] == k.shape[:-3] and k.shape[-3] > 0
        if not grouped:
            raise ValueError(
                f"{where}: q, k and v must have the same leading (batch, heads) dims"
                + (
                    " (k and v may have fewer heads, dim -3 of 4, for grouped-query attention)"
                    if allow_gqa
                    else ""
                )
                + f"; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                f"v {tuple(v.shape)}"
            )
        if q.shape[-3] % k.shape[-3]:
            raise ValueError(
                f"{where}: grouped-query attention needs q's heads to be a multiple of k's and v's; got "
                f"{q.shape[-3]} query heads and {k.shape[-3]} key/value heads (q {tuple(q.shape)}, "
                f"k {tuple(k.shape)})"
            )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"{where}: head dims differ: q has d={q.shape[-1]}, k has d={k.shape[-1]} "
            f"(q {tuple(q.shape)}, k {tuple(k.shape)})"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"{where}: k and v must have the same number of keys; got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if same_head_dim_v and v.shape[-1] != q.shape[-1]:
        raise ValueError(f"{where}: v must have the head dim of q (d={q.shape[-1]}); got v {tuple(v.shape)}")
    if q.shape[-2] == 0 or (k.shape[-2] == 0 and not allow_empty) or q.shape[-1] == 0:
        raise ValueError(
            f"{where}: empty sequence or head dim: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if head_dims is not None and q.shape[-1] not in head_dims:
        raise ValueError(
            f"{where}: head dim d={q.shape[-1]} is not supported; supported head dims: "
            f"{', '.join(map(str, head_dims))}"
        )


def kv_group(q: torch.Tensor, k: torch.Tensor) -> int:
    """Query heads per K/V head (1 unless grouped-query attention; inputs checked already)."""
    return q.shape[-3] // k.shape[-3] if q.dim() >= 4 else 1


def as_int(value) -> int | None:
    """value as an int if it is an integer (Python, NumPy, a 0-dim integer tensor: `operator.index`), not a
    bool; else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_tensor(where: str, name: str, value) -> None:
    """A TypeError naming `name` unless `value` is a torch.Tensor."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(value).__name__}")


def check_kernel_device(where: str, **tensors) -> None:
    """Every tensor must be a torch.Tensor on the device where the Triton kernels run (`course_lib.DEVICE`:
    the CPU under the interpreter, a CUDA GPU when they are compiled); else a TypeError or a ValueError
    naming the tensor and saying how to move it."""
    for name, t in tensors.items():
        check_tensor(where, name, t)
        if t.device.type == runtime.DEVICE.type:
            continue
        if runtime.INTERPRET:
            how = (
                "in the interpreter on the CPU (course_lib.INTERPRET is True: no GPU build, or COURSE_DEVICE=cpu). "
                "Move it to the CPU, or start Python on a GPU machine without COURSE_DEVICE=cpu"
            )
        else:
            how = (
                "compiled for the GPU (course_lib.ON_GPU is True). Move it with .to(course_lib.DEVICE), or set "
                "COURSE_DEVICE=cpu before importing course_lib to use the interpreter"
            )
        raise ValueError(
            f"{where}: {name} is on {t.device}, but the Triton kernels run on {runtime.DEVICE} here, {how}"
        )


# Head dims the attention and decoding kernels take: multiples of 8 from 16 to 256. The kernels pad the
# head dim to a power of two (BLOCK_D), so 16, 32, 64, 128 and 256 waste nothing; the rest (e.g. 40, 80,
# 96) compute on zero padding.
MAX_HEAD_DIM = 256
KERNEL_HEAD_DIMS = tuple(range(16, MAX_HEAD_DIM + 1, 8))


def check_int(where: str, name: str, value, minimum: int) -> int:
    """`value` as an int (`as_int`) that is >= minimum; else a TypeError or ValueError naming `name`."""
    index = as_int(value)
    if index is None:
        raise TypeError(f"{where}: {name} must be an integer, got {value!r} ({type(value).__name__})")
    if index < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {index}")
    return index


def check_real(where: str, name: str, value, low=None, high=None, low_open: bool = False) -> float:
    """`value` as a float: a real number (Python or NumPy, not a bool), finite, >= low (> low with
    low_open) and < high where given; else a TypeError or ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: {name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    below = low is not None and (value <= low if low_open else value < low)
    if not math.isfinite(value) or below or (high is not None and value >= high):
        bounds = ("" if low is None else f" {'>' if low_open else '>='} {low:g}") + (
            "" if high is None else f"{' and' if low is not None else ''} < {high:g}"
        )
        raise ValueError(f"{where}: {name} must be a finite number{bounds}, got {value!r}")
    return value


def check_eps(where: str, name: str, eps) -> float:
    """A normalisation's epsilon as a float: finite and > 0, also once rounded to float32, where the kernels
    add it (at 0 an all-zero row would be 0 / 0 = NaN); else a TypeError or ValueError naming `name`."""
    eps = check_real(where, name, eps, low=0, low_open=True)
    if float(torch.tensor(eps, dtype=torch.float32)) == 0:
        raise ValueError(f"{where}: {name}={eps!r} is 0 in float32, where it is added; give a larger one")
    return eps


def vocab_size(model) -> int | None:
    """A model's vocabulary size where it says (`vocab_size`, `vocab` or `config.vocab_size`), else None: what the
    batcher (notebook 10) and speculative decoding (notebook 15) check token ids and drafts against."""
    for value in (getattr(model, "vocab_size", None), getattr(model, "vocab", None)):
        if isinstance(value, int):
            return value
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) else None


def token_ids(where: str, prompt, vocab: int | None = None) -> list[int]:
    """A prompt as a list of ints in [0, vocab) (any iterable of ids, or a 1-D integer tensor); a TypeError
    when it is not one, a ValueError naming the ids that are not such ints (vocab None: any id >= 0)."""
    if isinstance(prompt, torch.Tensor) and prompt.dim() == 1 and not prompt.is_floating_point():
        prompt = prompt.tolist()
    if isinstance(prompt, (str, bytes, torch.Tensor)) or not hasattr(prompt, "__iter__"):
        raise TypeError(f"{where}: prompt must be a list of token ids, got {type(prompt).__name__}")
    prompt = list(prompt)  # any iterable, a one-pass iterator too: read once
    ids = [as_int(t) for t in prompt]
    bad = [t for t, i in zip(prompt, ids) if i is None or i < 0 or (vocab is not None and i >= vocab)]
    if bad:
        raise ValueError(
            f"{where}: prompt token ids must be ints in [0, {vocab or 'vocab size'}); got {bad[:5]}"
        )
    return ids


def check_generation_fits(
    where: str, prompt_length: int, max_new_tokens: int, max_seq_len: int | None
) -> None:
    """A prompt and `max_new_tokens` new tokens within a model's `max_seq_len` positions (its RoPE table;
    None: no limit), else a ValueError. The model runs at the prompt's positions and at every new
    token's but the last, which is returned, never fed back."""
    positions = prompt_length + max(max_new_tokens - 1, 0)
    if max_seq_len is not None and positions > max_seq_len:
        raise ValueError(
            f"{where}: a prompt of {prompt_length} tokens and {max_new_tokens} new ones run the model at "
            f"{positions} positions (the last new token is not fed back); the model has max_seq_len = "
            f"{max_seq_len}"
        )


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where softmax statistics and sums accumulate: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_scale(head_dim: int, scale: float | None) -> float:
    """The softmax scale: 1/sqrt(d) unless given. Rejects non-positive or non-finite scales."""
    if scale is None:
        return head_dim**-0.5
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
            f"scale must be below {torch.finfo(torch.float32).max / math.log2(math.e):.3g}: the kernels fold "
            f"log2(e) into it in float32, where it would be inf; got {scale}"
        )
    return scale


ALIGNMENTS = ("top_left", "bottom_right")


def causal_alignment(causal) -> str | None:
    """Normalise a `causal` argument: False/None/"none" -> None (no mask); True or "top_left" ->
    "top_left"; "bottom_right" -> "bottom_right". Anything else is an error naming the choices."""
    if isinstance(causal, str):
        if causal in ALIGNMENTS:
            return causal
        if causal == "none":
            return None
    elif isinstance(causal, torch.Tensor) and causal.numel() != 1:
        pass  # one flag, not one per element: the error below
    elif causal is None or isinstance(causal, bool) or type(causal).__name__ == "bool_" or causal in (0, 1):
        return "top_left" if causal else None
    raise ValueError(
        f"causal must be False, True (= 'top_left': query i sees keys j <= i) or 'bottom_right' (query i "
        f"sees keys j <= i + Nk - Nq, the KV-cache alignment); got {causal!r}"
    )


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


# Offsets the kernels compute from a program's row, column or head with 32-bit integers stay below this
# (`attention.inputs.within_offsets`, `fused.rope.kernel_input`); batch and sequence offsets are 64-bit.
OFFSET_LIMIT = 2**31


def kernel_window(window: int, n_q: int, n_k: int) -> int:
    """The window the kernels receive: `check_window`'s value capped at Nq + Nk, which no pair can exceed
    (so a huge "no limit" window cannot overflow their 32-bit index arithmetic); 0 stays 0 (none)."""
    return min(window, max(1, n_q + n_k)) if window else 0
