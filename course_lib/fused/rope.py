"""Rotary position embedding (RoPE) of q and k in one fused Triton kernel (notebook 11).

RoPE (Su et al., 2021) splits a head vector of d elements into d/2 pairs (a, b) and turns pair i of the
token at position p by the angle p * theta_i, theta_i = base ** (-2i / d). As complex numbers,
(a + ib) * e^{i p theta_i}; as real numbers, with c = cos(p theta_i) and s = sin(p theta_i):

    a' = a c - b s,    b' = b c + a s

Two layouts say which elements form a pair:
- "half" (Llama, GPT-NeoX, Hugging Face's `rotate_half`): element j pairs with element j + d/2;
- "interleaved" (GPT-J, the original RoFormer): element 2i pairs with element 2i + 1.

Layout convention (Hugging Face's `apply_rotary_pos_emb`): q (B, Hq, T, d) and k (B, Hk, T, d), any
strides as long as d is contiguous, so a (B, T, H, d) tensor passed as `.transpose(1, 2)` works without
a copy; 3-D (H, T, d) means B = 1. cos and sin are (T_cache, d) or (1 or B, T_cache, d), with one value
per element in the pair layout of q and k (`rope_cache` builds them: for "half", the d/2 frequencies
written twice, `cat(freqs, freqs)` as in Hugging Face; for "interleaved", each frequency twice in a row).
Token t of batch b reads the row `positions[b, t]` of the cache: positions 0..T-1 by default, p..p+T-1
for an integer offset p (new tokens appended to a KV cache), or any (T,) or (B, T) tensor.

The kernel: one program per TOKENS tokens of one batch row (`launch.ROPE`). It loads the tokens'
cos and sin rows once (HBM -> registers, 2 d elements per token) and rotates all Hq heads of q and all Hk
heads of k with them (a tokens x heads x d/2 tile for each half of the pairs, in registers), writing q'
and k' once. Bytes that must move: read q, k, cos, sin;
write q', k'. Arithmetic in float32 (float64 for float64 inputs).

The backward is the same kernel: the rotation matrix [[c, -s], [s, c]] is orthogonal, so its transpose
(what the chain rule asks for) is the rotation by the negative angle: dq = rotate(dq', -angle).

Here: the kernel and its launch (`rotate`), `rope_cache(...)`, the autograd Function `RoPEFunction`, the
checks (`check_rope`, `kernel_positions`) and `rope_reference` (float64, the ground truth). The entry
point `rope(q, k, cos, sin, positions=None, layout="half")` is in `api.py` (`course_lib.fused.rope`).
"""

from __future__ import annotations

import numbers

import torch

from .. import runtime
from ..checks import OFFSET_LIMIT, accumulator_dtype, check_dtype, check_int, check_kernel_device, check_real
from ..kernels import bound
from ..runtime import tl, triton
from ..second_derivative import refuse_second_derivative
from . import launch

runtime.require_triton()

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
LAYOUTS = ("half", "interleaved")


# --------------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------------
@triton.jit
def _rotate_heads(
    x_ptr,
    o_ptr,
    tok_x,
    tok_o,
    stride_xh,
    stride_oh,
    n_heads,
    tok_mask,
    idx_a,
    idx_b,
    pair_mask,
    c_a,
    c_b,
    s_a,
    s_b,
    BLOCK_H: tl.constexpr,
    KEEP: tl.constexpr,
):
    """Rotate every head of the program's tokens: x_ptr / o_ptr point at batch b of x / out, tok_x /
    tok_o (TOKENS,) are the tokens' offsets, c_a ... s_b (TOKENS, BLOCK_PAIRS) their cos and sin.

    A (TOKENS, BLOCK_H, BLOCK_PAIRS) tile of first elements a and one of second elements b: HBM ->
    registers (all loads issued together), a' = a c_a - b s_a and b' = b c_b + a s_b, registers -> HBM.

    KEEP: the cache hint of every load here and of cos and sin (`launch.keep_hint`)."""
    heads = tl.arange(0, BLOCK_H)
    mask = tok_mask[:, None, None] & (heads < n_heads)[None, :, None] & pair_mask[None, None, :]
    rows_x = tok_x[:, None, None] + heads[None, :, None] * stride_xh
    rows_o = tok_o[:, None, None] + heads[None, :, None] * stride_oh
    acc_ty = c_a.dtype
    a = tl.load(x_ptr + rows_x + idx_a[None, None, :], mask=mask, other=0.0, eviction_policy=KEEP).to(acc_ty)
    b = tl.load(x_ptr + rows_x + idx_b[None, None, :], mask=mask, other=0.0, eviction_policy=KEEP).to(acc_ty)
    a_out = a * c_a[:, None, :] - b * s_a[:, None, :]
    b_out = b * c_b[:, None, :] + a * s_b[:, None, :]
    tl.store(o_ptr + rows_o + idx_a[None, None, :], a_out.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + rows_o + idx_b[None, None, :], b_out.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, pos_ptr,
    n_tokens, n_token_tiles, n_q_heads, n_k_heads, n_pairs,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
    stride_qob, stride_qoh, stride_qot, stride_kob, stride_koh, stride_kot,
    stride_cb, stride_ct, stride_pb, pos_start, n_cache,
    HAS_POSITIONS: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, TOKENS: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_PAIRS: tl.constexpr, ACC_64: tl.constexpr,
    KEEP: tl.constexpr,
):  # fmt: skip
    """Program (b, j) = program_id(0) // n_token_tiles, % n_token_tiles: rotate q[b, :, t] and k[b, :, t]
    for the TOKENS tokens t = j * TOKENS, ... by the angles of positions[b, t] (forward), or by their
    negatives (BACKWARD: q, k are then gradients). Without HAS_POSITIONS the positions are
    pos_start + t, computed here (no positions tensor to build or read)."""
    pid = tl.program_id(0)
    b = (pid // n_token_tiles).to(tl.int64)
    t = (pid % n_token_tiles).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    tok_mask = t < n_tokens
    if HAS_POSITIONS:  # checked on the host, except under CUDA-graph capture: clamped into the cache
        pos = tl.load(pos_ptr + b * stride_pb + t, mask=tok_mask, other=0).to(tl.int64)
        pos = tl.minimum(tl.maximum(pos, 0), n_cache - 1)
    else:
        pos = pos_start + t
    i = tl.arange(0, BLOCK_PAIRS)
    pair_mask = i < n_pairs
    if INTERLEAVED:  # pairs (2i, 2i + 1)
        idx_a = 2 * i
        idx_b = 2 * i + 1
    else:  # pairs (i, i + d/2)
        idx_a = i
        idx_b = i + n_pairs
    acc_ty = tl.float64 if ACC_64 else tl.float32
    cache_mask = tok_mask[:, None] & pair_mask[None, :]
    cos_rows = (
        cos_ptr + b * stride_cb + pos[:, None] * stride_ct
    )  # 2 d values per token, shared by every head
    sin_rows = sin_ptr + b * stride_cb + pos[:, None] * stride_ct
    c_a = tl.load(cos_rows + idx_a[None, :], mask=cache_mask, other=0.0, eviction_policy=KEEP).to(acc_ty)
    c_b = tl.load(cos_rows + idx_b[None, :], mask=cache_mask, other=0.0, eviction_policy=KEEP).to(acc_ty)
    if BACKWARD:  # the transposed rotation: sin halves swapped and negated (= angle -> -angle)
        s_a = -tl.load(sin_rows + idx_b[None, :], mask=cache_mask, other=0.0, eviction_policy=KEEP).to(acc_ty)
        s_b = -tl.load(sin_rows + idx_a[None, :], mask=cache_mask, other=0.0, eviction_policy=KEEP).to(acc_ty)
    else:
        s_a = tl.load(sin_rows + idx_a[None, :], mask=cache_mask, other=0.0, eviction_policy=KEEP).to(acc_ty)
        s_b = tl.load(sin_rows + idx_b[None, :], mask=cache_mask, other=0.0, eviction_policy=KEEP).to(acc_ty)
    _rotate_heads(
        q_ptr + b * stride_qb, q_out_ptr + b * stride_qob, t * stride_qt, t * stride_qot,
        stride_qh, stride_qoh, n_q_heads, tok_mask, idx_a, idx_b, pair_mask, c_a, c_b, s_a, s_b, BLOCK_HQ, KEEP,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + b * stride_kb, k_out_ptr + b * stride_kob, t * stride_kt, t * stride_kot,
        stride_kh, stride_koh, n_k_heads, tok_mask, idx_a, idx_b, pair_mask, c_a, c_b, s_a, s_b, BLOCK_HK, KEEP,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------
def as_4d(t: torch.Tensor) -> torch.Tensor:
    """(H, T, d) -> (1, H, T, d); the last dim made contiguous if it is not."""
    t = t.unsqueeze(0) if t.dim() == 3 else t
    return t if t.stride(-1) == 1 else t.contiguous()


def _heads_span(t: torch.Tensor) -> int:
    """How far apart (in elements) the first and last heads of t (B, H, T, d) lie: the kernel offsets a
    head within a token by heads x stride in 32-bit integers (the token and batch offsets are 64-bit)."""
    return max(t.shape[1] - 1, 0) * abs(t.stride(1))


def _token_major(t: torch.Tensor) -> torch.Tensor:
    """A copy of t (B, H, T, d) in (B, T, H, d) storage, seen as (B, H, T, d): heads d elements apart."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def kernel_input(t: torch.Tensor) -> torch.Tensor:
    """t (B, H, T, d) as the kernel reads it: itself when d has unit stride and its heads lie less than
    2**31 elements apart in all (`OFFSET_LIMIT`); else a copy, contiguous, or token-major where a
    contiguous (B, H, T, d) copy would itself pass 2**31 (H x T x d elements: 32 heads of 128 at 524k
    tokens)."""
    if t.stride(-1) == 1 and _heads_span(t) < OFFSET_LIMIT:
        return t
    t = t.contiguous()
    return t if _heads_span(t) < OFFSET_LIMIT else _token_major(t)


def kernel_output(t: torch.Tensor) -> torch.Tensor:
    """An empty output for the kernel input t: t's strides where t is dense (`torch.empty_like`), else
    contiguous; token-major where (B, H, T, d) strides would put its heads 2**31 elements apart or more
    (a token-major slice of a fused QKV projection is not dense: empty_like makes it heads-first)."""
    out = torch.empty_like(t)
    if _heads_span(out) < OFFSET_LIMIT:
        return out
    return torch.empty_like(t.transpose(1, 2), memory_format=torch.contiguous_format).transpose(1, 2)


def cache_3d(t: torch.Tensor) -> torch.Tensor:
    t = t.unsqueeze(0) if t.dim() == 2 else t
    return t if t.stride(-1) == 1 else t.contiguous()


def rotate(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: int | torch.Tensor,
    interleaved: bool,
    backward: bool = False,
    *,
    tokens: int | None = None,
    warps: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel alone, on checked 4-D q, k, 3-D cos, sin and positions: a (1 or B, T) tensor, or an
    int p for the positions p..p+T-1 (computed in the kernel); outputs keep the inputs' strides where
    they are dense (`kernel_input` and `kernel_output` say when a copy or another layout is needed).
    `backward=True` rotates by the negative angles. out: (q_out, k_out) to write instead, 4-D like q and k
    with d contiguous; (q, k) themselves rotate in place (a program loads every head of its tokens before it
    stores any, and no two programs share a token: `api.rope_`).

    Launch settings: `tokens` per program (a power of two) and `warps`, defaults from `launch.rope`;
    pass them to try other settings."""
    q, k = kernel_input(q), kernel_input(k)  # d with unit stride, head offsets within 32 bits
    q_out, k_out = (kernel_output(q), kernel_output(k)) if out is None else out
    n_batch, n_q_heads, n_tokens, d = q.shape
    if q.numel() == 0 and k.numel() == 0:
        return q_out, k_out
    n_pairs = d // 2
    cs = cos.stride()  # each tensor's strides read once (a call's host time)
    if cs != sin.stride() or cs[-1] != 1:  # the kernel reads both with cos's strides
        cos, sin = cos.contiguous(), sin.contiguous()
        cs = cos.stride()
    stride_cb = cs[0] if cos.shape[0] > 1 else 0
    has_positions = isinstance(positions, torch.Tensor)
    if has_positions and positions.shape[-1] > 1 and positions.stride(-1) != 1:  # read with unit stride
        positions = positions.contiguous()
    stride_pb = positions.stride(0) if has_positions and positions.shape[0] > 1 else 0
    block_pairs = runtime.next_power_of_2(n_pairs)
    block_hq, block_hk = (
        runtime.next_power_of_2(max(n_q_heads, 1)),
        runtime.next_power_of_2(max(k.shape[1], 1)),
    )
    setting = launch.rope(block_hq * block_pairs)
    tokens = tokens or setting.tokens
    if tokens < 1 or tokens & (tokens - 1):
        raise ValueError(f"rope: tokens per program must be a power of two >= 1, got {tokens}")
    n_token_tiles = runtime.cdiv(n_tokens, tokens)
    bound.launch(rope_kernel, (n_batch * n_token_tiles,),
        q, k, q_out, k_out, cos, sin, positions if has_positions else cos,
        n_tokens, n_token_tiles, n_q_heads, k.shape[1], n_pairs,
        *q.stride()[:3], *k.stride()[:3], *q_out.stride()[:3], *k_out.stride()[:3],
        stride_cb, cs[1], stride_pb, 0 if has_positions else positions, cos.shape[1],
        HAS_POSITIONS=has_positions, INTERLEAVED=interleaved, BACKWARD=backward, TOKENS=tokens,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_PAIRS=block_pairs,
        ACC_64=accumulator_dtype(q.dtype) == torch.float64,
        KEEP=launch.keep_hint(q.nbytes + k.nbytes, q.device),
        num_warps=warps or setting.warps,
    )  # fmt: skip
    return q_out, k_out


class RoPEFunction(torch.autograd.Function):
    """Differentiable fused RoPE of q and k: `RoPEFunction.apply(q, k, cos, sin, positions, interleaved)`
    with checked 4-D inputs (see `rope`); positions is a (1 or B, T) tensor or an int start (`rotate`);
    cos, sin and positions are constants (no gradient)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, positions, interleaved):
        if isinstance(positions, torch.Tensor):
            ctx.save_for_backward(cos, sin, positions)
        else:
            ctx.save_for_backward(cos, sin)
            ctx.start = positions
        ctx.interleaved = interleaved
        return rotate(q, k, cos, sin, positions, interleaved)

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        cos, sin, *saved = ctx.saved_tensors
        positions = saved[0] if saved else ctx.start
        dq, dk = rotate(as_4d(dq_out), as_4d(dk_out), cos, sin, positions, ctx.interleaved, backward=True)
        dq, dk = refuse_second_derivative(
            (dq, dk), (dq_out, dk_out), "course_lib's rope", "rope_reference (PyTorch ops)"
        )
        return dq, dk, None, None, None, None


def kernel_positions(positions, n_batch: int, n_tokens: int, n_cache: int, device) -> int | torch.Tensor:
    """positions checked to lie in [0, n_cache): None or an int p becomes the int start (0 or p) of
    the positions start..start+T-1; a tensor becomes a (1 or B, T) integer tensor on `device`."""
    where = "rope"
    if isinstance(positions, bool):
        raise TypeError(f"{where}: positions must be None, an int offset or an integer tensor, got a bool")
    # NumPy integers too (bools refused above); a type test, not operator.index, which would read a
    # one-element tensor's value: a GPU sync inside a CUDA graph's capture, and a break in torch.compile
    if positions is None or isinstance(positions, numbers.Integral):
        start = 0 if positions is None else int(positions)
        if start < 0 or start + n_tokens > n_cache:
            raise ValueError(
                f"{where}: positions {start}..{start + n_tokens - 1} need cos/sin rows up to {start + n_tokens - 1}, "
                f"but cos and sin have {n_cache} rows (build the cache for more positions with rope_cache)"
            )
        return start
    if not isinstance(positions, torch.Tensor):
        raise TypeError(
            f"{where}: positions must be None, an int offset or an integer tensor, got {type(positions).__name__}"
        )
    if positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{where}: positions must be int32 or int64, got {positions.dtype}")
    if positions.device != device:
        raise ValueError(f"{where}: positions is on {positions.device}, q and k on {device}")
    pos = positions.unsqueeze(0) if positions.dim() == 1 else positions
    if pos.dim() != 2 or pos.shape[1] != n_tokens or pos.shape[0] not in (1, n_batch):
        raise ValueError(
            f"{where}: positions must have shape (T,) or (B, T) = ({n_batch}, {n_tokens}); got {tuple(positions.shape)}"
        )
    # Under torch.compile the values cannot be read in the graph: the operator checks them (`op.rope_op`).
    if not torch.compiler.is_compiling():
        check_position_range(pos, n_cache)
    return pos.contiguous()


def check_position_range(positions: torch.Tensor, n_cache: int) -> None:
    """Raise ValueError unless every position lies in [0, n_cache). Reads the smallest and largest back
    (one sync): skipped while a CUDA graph is being captured, where a sync is not allowed; the kernel
    clamps positions into the cache instead."""
    capturing = positions.is_cuda and torch.cuda.is_current_stream_capturing()
    if positions.numel() and not capturing:
        lowest, highest = torch.stack(torch.aminmax(positions)).tolist()
        if lowest < 0 or highest >= n_cache:
            raise ValueError(
                f"rope: positions run from {lowest} to {highest}, but cos and sin have rows 0..{n_cache - 1} only"
            )


def check_rope(q, k, cos, sin, layout) -> None:
    where = "rope"
    check_kernel_device(where, q=q, k=k, cos=cos, sin=sin)
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_dtype(where, name, t, DTYPES)
    if q.dtype != k.dtype:
        raise TypeError(f"{where}: q and k must share one dtype; got q {q.dtype}, k {k.dtype}")
    if len({q.device, k.device, cos.device, sin.device}) != 1:
        raise ValueError(
            f"{where}: q, k, cos and sin must be on one device; got {q.device}, {k.device}, {cos.device}, {sin.device}"
        )
    if q.dim() not in (3, 4) or k.dim() != q.dim():
        raise ValueError(
            f"{where}: q and k must both be (B, H, T, d) or both (H, T, d); got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if q.shape[:-3] != k.shape[:-3] or q.shape[-2:] != k.shape[-2:]:
        raise ValueError(
            f"{where}: q and k must agree on batch, tokens and head dim (heads may differ); "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    d = q.shape[-1]
    if d % 2 or d == 0:
        raise ValueError(f"{where}: the head dim must be even (RoPE rotates pairs of elements); got d={d}")
    if cos.shape != sin.shape:
        raise ValueError(
            f"{where}: cos and sin must have one shape; got cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
        )
    if cos.dim() in (2, 3) and 0 < cos.shape[-1] < d:
        raise ValueError(
            f"{where}: cos and sin cover {cos.shape[-1]} of the head dim d={d}: partial rotary (GPT-NeoX's "
            "rotary_pct, Phi's partial_rotary_factor) is not supported; rotate q[..., :r] and k[..., :r] "
            f"(r={cos.shape[-1]}) and concatenate the rest unchanged"
        )
    if cos.dim() not in (2, 3) or cos.shape[-1] != d:
        raise ValueError(
            f"{where}: cos and sin must be (T_cache, d) or (B, T_cache, d) with d={d} (q's head dim); "
            f"got {tuple(cos.shape)}"
        )
    n_batch = q.shape[0] if q.dim() == 4 else 1
    if cos.dim() == 3 and cos.shape[0] not in (1, n_batch):
        raise ValueError(f"{where}: cos and sin have batch {cos.shape[0]}, q and k have batch {n_batch}")
    if layout not in LAYOUTS:
        raise ValueError(f"{where}: layout must be one of {LAYOUTS}, got {layout!r}")


def rope_cache(
    n_positions: int,
    head_dim: int,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device=None,
    layout: str = "half",
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (n_positions, head_dim): row p holds cos(p theta_i), sin(p theta_i) with
    theta_i = base ** (-2i / head_dim), i < head_dim / 2, each written twice in `layout`'s pair order
    ("half": [theta_0..theta_{d/2-1}, theta_0..theta_{d/2-1}] as Hugging Face's LlamaRotaryEmbedding;
    "interleaved": [theta_0, theta_0, theta_1, theta_1, ...]). Angles in float32 as Hugging Face
    computes them, then cast to `dtype`. Taught in notebook 11."""
    n_positions = check_int("rope_cache", "n_positions", n_positions, 0)
    head_dim = check_int("rope_cache", "head_dim", head_dim, 1)
    if head_dim % 2:
        raise ValueError(f"rope_cache: head_dim must be even and positive, got {head_dim}")
    base = check_real("rope_cache", "base", base, low=1, low_open=True)  # 10000 in Llama
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"rope_cache: dtype must be a floating-point torch.dtype (cos and sin), got {dtype!r}"
        )
    if layout not in LAYOUTS:
        raise ValueError(f"rope_cache: layout must be one of {LAYOUTS}, got {layout!r}")
    device = runtime.DEVICE if device is None else torch.device(device)
    inv_freq = 1.0 / (
        base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    )
    angles = torch.outer(torch.arange(n_positions, device=device).float(), inv_freq)  # (P, d/2), float32
    if layout == "half":
        angles = torch.cat((angles, angles), dim=-1)
    else:
        angles = angles.repeat_interleave(2, dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions=None, layout: str = "half"
) -> torch.Tensor:
    """RoPE of one tensor x (B, H, T, d) in float64 on the CPU: the ground truth tests compare with.

    cos, sin: (T_cache, d) or (1 or B, T_cache, d); positions as in `rope`. Returns float64,
    differentiable in x (so reference gradients come from autograd)."""
    x64 = x.double().cpu()
    c64, s64 = cos.detach().double().cpu(), sin.detach().double().cpu()
    n_tokens = x64.shape[-2]
    if positions is None or isinstance(positions, int):
        pos = torch.arange(n_tokens) + (positions or 0)
    else:
        pos = positions.detach().cpu().long()
    if c64.dim() == 2:
        c, s = c64[pos], s64[pos]  # (T, d) or (B, T, d)
    else:
        batch = torch.arange(c64.shape[0])[:, None]
        c, s = c64[batch, pos], s64[batch, pos]
    if c.dim() == 3:  # (B, T, d) -> (B, 1, T, d): the same angles for every head
        c, s = c[:, None], s[:, None]
    if layout == "half":
        h = x64.shape[-1] // 2
        rotated = torch.cat((-x64[..., h:], x64[..., :h]), dim=-1)
    else:
        pairs = x64.unflatten(-1, (-1, 2))
        rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return x64 * c + rotated * s
