"""course_lib's attention as an attention implementation of Hugging Face transformers (notebook 08b).

transformers asks two questions of an attention implementation, each through its own registry:

1. *Which mask?* (`AttentionMaskInterface`): before the layers run, the model turns its inputs (a 2-D
   padding mask, the cache's length) into a mask for all layers. `attention_mask` below answers
   `None` whenever the mask is plain causal with the queries at the end of the keys, which is
   exactly what the kernels compute without any mask tensor: prefill (Nq = Nk), decoding and
   chunked prefill with a growing cache (Nq < Nk, bottom-right), with or without a sliding window
   (Mistral's `sliding_window`, Gemma's local layers: the kernels take the window as an argument).
   The same with padding (a batch of prompts of different lengths) answers the 2-D padding mask
   (B, Nk), True for real tokens: the layers then run the real tokens as packed sequences
   (`attention.varlen.flash_attention_padded`), never computing the padding. A cache with more slots
   than keys in use (a static cache), causal and unpadded, answers the count of keys in use as a 1-D
   tensor [n]: the layers run the kernels on those n keys alone; under torch.compile (transformers
   compiles a static cache's decoding steps by itself on a GPU) n is a tensor of the graph, and the
   layers run the split-KV decoding operator (`course_lib.decode.op`), which takes the count as a
   tensor. Anything else (chunked attention, a 4-D mask given by the caller, padding with a sliding
   window under torch.compile, padding inside a row with a sliding window) gets transformers' own
   boolean mask.
2. *Attention itself* (`AttentionInterface`): each layer calls `attention_forward(module, q, k, v,
   mask, dropout=, scaling=, ...)` with q (B, Hq, Nq, d), k, v (B, Hkv, Nk, d) and expects
   (O as (B, Nq, Hq, d), weights or None). With no mask, the kernels run through
   `course_lib.flash_attention` (under `torch.compile` the custom operator of `course_lib.attention.op`,
   eagerly without the operator's dispatch; a decoding step on the split-KV kernel), K/V heads not
   repeated (GQA), the causal mask bottom-right aligned, and the layer's `sliding_window` (if any)
   passed on as `window`.
   With a 2-D padding mask, the same kernels on the packed real tokens. With a 4-D mask, the call
   falls back to transformers' SDPA implementation, with a warning saying why (under torch.compile,
   once, while the graph is traced): the kernels take no arbitrary masks. Under torch.compile a
   sliding-window layer is recognised by the model's config, since the mask function's values cannot
   be looked at there (`_is_sliding_causal`).

Dropout is not implemented by the kernels: a layer in training mode with attention dropout > 0
raises a ValueError (set `config.attention_dropout = 0`). So do logit soft-capping and an additive
position bias (T5's relative positions, `position_bias`). Attention sinks (gpt-oss's `s_aux`, one
learned logit per query head) go to the kernels as `sinks`.
"""

from __future__ import annotations

import importlib
import warnings

import torch

try:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "course_lib.integrations.transformers needs Hugging Face transformers "
        f"({exc}); install it with `pip install transformers` or the course extra `pip install -e .[course]`."
    ) from exc

from ..attention.api import flash_attention
from ..attention.reference import causal_mask_tile
from ..attention.varlen import flash_attention_padded
from ..decode.op import decode_attention_op
from ..decode.split_kv import DTYPES as DECODE_DTYPES

NAME = "course_lib"


def _no_padding(padding_mask: torch.Tensor | None) -> bool:
    if padding_mask is None:
        return True
    if torch.compiler.is_compiling():  # looking at the values would break the graph: keep the mask
        return False
    return bool(padding_mask.all())


def _warn_fallback(message: str) -> None:
    """Warn that a call leaves the kernels. Eagerly, each time; under torch.compile, once, while the graph
    is traced (Dynamo cannot put `warnings.warn` in a graph: called there, it breaks the graph, which
    `fullgraph=True` turns into an error)."""
    if _dynamo_compiling():
        from torch._dynamo.comptime import comptime

        comptime(
            lambda ctx: warnings.warn(
                ctx.get_local("message").as_python_constant(), UserWarning, stacklevel=2
            )
        )
    else:
        warnings.warn(message, UserWarning, stacklevel=3)


def _dynamo_compiling() -> bool:
    return getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)()


def _is_sliding_causal(mask_function, window: int, config=None) -> bool:
    """Whether transformers' `mask_function` is the causal mask with a sliding window of `window` keys
    (kv_idx <= q_idx and kv_idx > q_idx - window), checked on a sample of positions around the window's
    edges (mask functions take index tensors); False for anything else (chunked attention, say).

    Under torch.compile the values cannot be compared (a graph break) nor the function's closure read
    (Dynamo does not trace `__closure__`). There the model's `config` answers: transformers' sliding-window
    mask passes the config's `sliding_window` as `window`, and only its plain sliding causal mask lets
    the hook skip the mask (`allow_is_causal_skip`: any overlay, packing or custom mask function turns
    it off). A chunked-attention config (`attention_chunk_size`) is never taken for one."""
    if torch.compiler.is_compiling():
        return (
            config is not None
            and getattr(config, "sliding_window", None) == window
            and getattr(config, "attention_chunk_size", None) is None
        )
    q_idx = torch.tensor([0, 1, window - 1, window, window + 1, 2 * window + 3])[:, None]
    kv_idx = torch.arange(0, 2 * window + 5)[None, :]
    want = (kv_idx <= q_idx) & (kv_idx > q_idx - window)
    zero = torch.tensor(0)
    try:
        got = torch.as_tensor(mask_function(zero, zero, q_idx, kv_idx))
    except Exception:  # a mask function that does not take index tensors: not one we recognise
        return False
    return got.dtype == torch.bool and torch.equal(got.expand_as(want), want)


def _packable_padding(attention_mask: torch.Tensor | None, kv_length: int, window: int | None):
    """The keys' padding mask (B, kv_length), True for real tokens, when the kernels can run the call as
    packed sequences (`flash_attention_padded`, under torch.compile its operator); else None. With a
    sliding window, only if each row's real tokens are one run (left or right padding), so that the
    window counted in real tokens is the window counted in positions: a check of the values, which
    torch.compile cannot make (there a sliding window with padding gets a built mask)."""
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    padding = attention_mask[:, -kv_length:].bool()  # a sliding cache keeps the last kv_length keys
    if padding.shape[1] != kv_length:
        return None
    if window is not None:
        if torch.compiler.is_compiling():
            return None
        pos = torch.arange(kv_length, device=padding.device)
        first = torch.where(padding, pos, kv_length).amin(1)
        last = torch.where(padding, pos, -1).amax(1)
        count = padding.sum(1)
        if not bool(((last - first + 1 == count) | (count == 0)).all()):
            return None
    return padding


def _is_keys_in_use(mask) -> bool:
    """Whether `mask` is the hook's answer for a static cache, [n] (`_keys_in_use`)."""
    return isinstance(mask, torch.Tensor) and mask.shape == (1,) and mask.dtype == torch.int64


def _keys_in_use(q_length, kv_length, q_offset, kv_offset, kernels_mask, local_size, padding_mask):
    """[n], the count of keys in use as a 1-D int64 tensor, when only the first n of the cache's
    kv_length keys are (a static cache's unused slots follow) and the kernels compute the call on those
    n alone; else None.

    The queries are positions q_offset ... q_offset + q_length - 1, the keys 0 ... kv_length - 1
    (kv_offset = 0). Under the causal mask no query sees a key at or past n = q_offset + q_length, so
    with those keys dropped the call is bottom-right causal over the rest. Not with a sliding window or
    padding among the n keys. Eagerly [n] is on the CPU: a static cache gives q_offset as a tensor, and
    reading it syncs with the GPU, once per forward (the hook runs once for all layers). Under
    torch.compile nothing may be read: [n] is then q_offset + q_length computed in the graph, on
    q_offset's device, and only where no padding mask came with the call."""
    if not kernels_mask or local_size is not None or kv_offset != 0:
        return None
    if torch.compiler.is_compiling():
        if padding_mask is not None:  # its values cannot be looked at here
            return None
        return (torch.as_tensor(q_offset).reshape(1) + q_length).to(torch.int64)
    if isinstance(q_offset, torch.Tensor):
        if q_offset.numel() != 1 or q_offset.dtype.is_floating_point:
            return None
        q_offset = int(q_offset)
    if not isinstance(q_offset, int) or q_offset < 0 or q_offset + q_length > kv_length:
        return None
    n = q_offset + q_length
    if padding_mask is not None and (
        padding_mask.dim() != 2 or padding_mask.shape[1] < n or not bool(padding_mask[:, :n].all())
    ):
        return None
    return torch.tensor([n], dtype=torch.int64)


def attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset=0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs,
):
    """transformers' mask hook for "course_lib": None when the kernels' causal mask is the right one,
    the 2-D padding mask (batch_size, kv_length) when it is the right one for the real tokens packed,
    else transformers' SDPA boolean mask (batch_size, 1, q_length, kv_length) (True = attend).

    None means: causal (with the layer's sliding window, if `local_size` is one), no padding, and the
    q_length queries end where the keys end (q_offset + q_length == kv_offset + kv_length: the keys are
    positions kv_offset ... kv_offset + kv_length - 1, all of them since kv_offset = 0 in a growing
    cache, the last ones in a sliding-window cache that drops what no query can see) — the bottom-right
    alignment. The padding mask: the same, with padding (`_packable_padding`). [n], a 1-D tensor:
    causal and unpadded, with only the first n of the kv_length keys in use (`_keys_in_use`).

    transformers' `generate` asks this hook once more for a static cache, before the model's forward,
    and hands the answer to the forward as its attention mask, which comes back here: [n] is then read
    as no padding."""
    if _is_keys_in_use(attention_mask):
        attention_mask = None
    if local_size is None:
        kernels_mask = mask_function is causal_mask_function
    else:  # (probed only where the answer could be None)
        kernels_mask = allow_is_causal_skip and _is_sliding_causal(
            mask_function, local_size, kwargs.get("config")
        )
    aligned = (
        allow_is_causal_skip
        and kernels_mask
        and isinstance(q_offset, int)
        and isinstance(kv_offset, int)
        and q_offset + q_length == kv_offset + kv_length
    )
    if aligned and _no_padding(attention_mask):
        return None
    padding = _packable_padding(attention_mask, kv_length, local_size) if aligned else None
    if padding is not None:
        return padding
    in_use = _keys_in_use(q_length, kv_length, q_offset, kv_offset, kernels_mask, local_size, attention_mask)
    if in_use is not None:
        return in_use
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=False,  # a None from SDPA's rules would mean top-left: always a real mask
        **kwargs,
    )


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention hook for "course_lib".

    query: (B, Hq, Nq, d); key, value: (B, Hkv, Nk, d) with Hq a multiple of Hkv (grouped-query
    attention, K/V not repeated); the model's dtype (float16/bfloat16/float32). attention_mask: None
    (causal, bottom-right: query i sees keys j <= i + Nk - Nq; see `attention_mask`), [n] from that
    hook (a static cache: the same on the first n keys, causal whatever is_causal says; under
    torch.compile [n] is a tensor of the graph and the split-KV decoding operator computes the call,
    `course_lib.decode.op`, or, where it cannot, SDPA on the same mask with a warning), a 2-D padding
    mask (B, Nk) from that hook (causal whatever is_causal says; the real tokens then run as packed
    sequences, padded query rows give 0), or a 4-D mask tensor (then SDPA runs, with a warning; for a layer with
    attention sinks, which SDPA would ignore, the model's own eager attention). sliding_window (keyword,
    from the layer): query i then sees only the keys i + Nk - Nq - sliding_window < j <= i + Nk - Nq.
    s_aux (keyword): gpt-oss's attention sinks. scaling: the softmax scale (default 1/sqrt(d)). Returns
    (O of shape (B, Nq, Hq, d), None): no attention weights are ever formed."""
    if dropout:
        raise ValueError(
            f"course_lib attention has no dropout (got dropout={dropout} in {type(module).__name__}); set "
            "config.attention_dropout = 0.0, or call model.eval() for inference"
        )
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(
                f"course_lib attention: {name} must be a 4-D (B, heads, N, d) tensor, as transformers passes "
                f"it; got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
            )
    for unsupported in ("softcap", "position_bias"):  # T5's relative positions: an additive mask
        if kwargs.get(unsupported) is not None:
            raise ValueError(
                f"course_lib attention does not implement {unsupported!r} ({type(module).__name__}); "
                "use attn_implementation='sdpa' or 'eager' for this model"
            )
    if _is_keys_in_use(attention_mask):  # the first n keys are in use (`attention_mask` answered it)
        if attention_mask.device.type == "cpu" and not torch.compiler.is_compiling():
            n = int(attention_mask[0])  # a CPU tensor: no sync
            if not 0 <= n <= key.shape[2]:
                raise ValueError(
                    f"course_lib attention: the mask [n] says n = {n} keys are in use, outside [0, "
                    f"{key.shape[2]}] (the keys passed)"
                )
            key, value, attention_mask, is_causal = key[:, :, :n], value[:, :, :n], None, True
        elif _decodes(query, kwargs):  # n is a tensor of a compiled graph: the decoding operator takes it
            lengths = attention_mask.to(device=query.device, dtype=torch.int32).expand(query.shape[0])
            o = decode_attention_op(
                query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), lengths.contiguous(),
                True, scaling,
            )  # fmt: skip
            return o.contiguous(), None
        else:  # the same mask as a tensor (bottom-right over the first n keys), for the fallback below
            q_length, kv_length = query.shape[2], key.shape[2]
            offset = attention_mask.to(query.device) - q_length
            visible = causal_mask_tile(0, q_length, 0, kv_length, query.device, offset)
            attention_mask = visible[None, None].expand(query.shape[0], 1, q_length, kv_length)
    if attention_mask is not None and attention_mask.dim() == 2:  # padding (`attention_mask` answered it)
        # causal whatever is_causal says: the hook answers this mask for causal masks only, and with a mask
        # a model may pass is_causal=False (SDPA's rule, the mask carries the causality: Moonshine)
        window, sinks = kwargs.get("sliding_window"), kwargs.get("s_aux")
        o = flash_attention_padded(query, key, value, attention_mask, True, scaling, window, sinks)
        return o.transpose(1, 2).contiguous(), None
    if attention_mask is not None:
        if kwargs.get("s_aux") is not None:  # SDPA knows no sinks: the model's own eager attention does
            eager = getattr(importlib.import_module(type(module).__module__), "eager_attention_forward", None)
            if eager is None:
                raise ValueError(
                    f"course_lib attention: {type(module).__name__} has attention sinks and transformers passed "
                    "an explicit mask, which the kernels cannot apply and SDPA would compute without the "
                    "sinks; use attn_implementation='eager' for this model"
                )
            _warn_fallback(
                "course_lib attention: transformers passed an explicit mask (padding, a static cache, ...) "
                "to a layer with attention sinks; the kernels compute causal masks (with or without a "
                "sliding window) only, so this call runs the model's eager attention instead"
            )
            if attention_mask.dtype == torch.bool:  # eager attention adds its mask: 0 where seen, else min
                hidden = torch.finfo(query.dtype).min
                attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill(
                    ~attention_mask, hidden
                )
            return eager(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        _warn_fallback(
            "course_lib attention: transformers passed an explicit mask (padding, a static cache, chunked "
            "attention or a custom 4-D mask); course_lib's kernels compute "
            "causal masks (with or without a sliding window) only, so this call runs transformers' SDPA "
            "attention instead"
        )
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    window = kwargs.get("sliding_window")
    if window is not None and not causal:
        raise ValueError(
            f"course_lib attention: a sliding window (sliding_window={window}) without a causal mask "
            f"({type(module).__name__}) is not implemented; use attn_implementation='sdpa' for this model"
        )
    sinks = kwargs.get("s_aux")  # gpt-oss's attention sinks: (Hq,) logits
    o = flash_attention(query, key, value, "bottom_right" if causal else "none", scaling, window, sinks)
    return o.transpose(1, 2).contiguous(), None


def _decodes(query: torch.Tensor, kwargs: dict) -> bool:
    """Whether the decoding operator computes this layer's call: a dtype it takes, no attention sinks
    or sliding window (it has neither), and no gradient to compute (it has no backward)."""
    needs_grad = torch.is_grad_enabled() and query.requires_grad
    extras = kwargs.get("s_aux") is not None or kwargs.get("sliding_window") is not None
    return query.dtype in DECODE_DTYPES and not (needs_grad or extras)


def register(name: str = NAME) -> str:
    """Register `attention_forward` and `attention_mask` with transformers under `name`; return it.

    Afterwards: `model.set_attn_implementation(name)`, or `config._attn_implementation = name` before
    building the model. Registering twice is harmless."""
    if not isinstance(name, str) or not name.strip():
        raise TypeError(
            f"use_in_transformers: name must be a non-empty string (the attn_implementation); got {name!r}"
        )
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    return name
