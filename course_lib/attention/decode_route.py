"""A few query rows over many keys: the FlashAttention-2 forward hands the call to split-KV decoding.

FlashAttention-2's grid has one program per (batch, query head, block of BLOCK_M query rows)
(`forward.py`, notebook 06). A decoding step has one query row per head (a few in speculative
verification or a chunked prefill), so at batch 1 with 32 query heads the grid is 32 programs, each
walking the whole cache alone, on a GPU of 132 SMs; and each of the G query heads that share a K/V
head (grouped-query attention) reads that K/V again. Flash-Decoding (`course_lib.decode`,
notebook 09) splits the keys across programs and packs the G heads into one tile, so the cache is read
once, by every SM. Measured on an H100 (bf16, 32 query / 8 K/V heads, d = 128, one query row,
CUDA-graph replays, FlashAttention-2 forward / `decode_attention`): batch 1 at 8k keys 93 / 13 us,
32k 518 / 51 us, 128k 2037 / 181 us; batch 8 at 8k 140 / 97 us; batch 32 at 2k 149 / 93 us.

Plain launches (no CUDA graph) pay the host's time too, and there the split-KV path costs more: it
launches two kernels (the splits and their merge; then also a fill of a lengths tensor, since dropped:
the whole cache needs none), and a plain call of `flash_attention` took 190-260 us of host time on that
machine, whichever kernel ran (SDPA: 33 us; since cut to 96-175 us without a gradient,
notes/attention.md, "Open"). Plain, batch 1: 8k keys 226 us by the forward / 236 us split-KV,
16k 264 / 253, 32k 520 / 254; but batch 32 at 2k 196 / 250. So `takes` hands over only where the
forward's own GPU time is about as long as that host time: `waves x Nk >= MIN_WORK`, waves being the
forward grid's rounds over the SMs at two programs per SM (batch 1 with 32 heads from 16k keys; batch 8
from 16k; batch 32 from 4k). Under CUDA graphs the split-KV kernel is faster from far fewer keys; a
model replayed as graphs gives up that part.

The result is the forward's contract: O (q's shape, contiguous) and L (q.shape[:-1], float32, natural
log, -inf with O = 0 for a row that sees no key), so the backward is unchanged.

The choice sits here, above both kernels (`routed_forward`), and not in the forward kernel module:
`api.flash_attention`, the custom operator (`op.forward_op`) and `course_lib.attention.attention_forward`
call it; `forward.forward` always runs the FlashAttention-2 kernel, and decoding never imports attention."""

from __future__ import annotations

import torch

from .. import runtime
from ..decode.heuristics import sm_count, tile_for
from ..decode.split_kv import DTYPES
from ..decode.split_kv import launch as split_kv_launch
from .forward import _forward, forward_call
from .inputs import as_4d
from .launch import cuda_device

# keys x waves of the forward's grid from which the split-KV kernel runs instead (docstring)
MIN_WORK = 16384
FORWARD_PROGRAMS_PER_SM = 2  # forward programs an SM runs at once, for the waves above


def fits(q4: torch.Tensor, k4: torch.Tensor, alignment: str | None) -> bool:
    """Whether this forward is a decoding step the split-KV kernel computes: a dtype it takes, no causal
    mask or the bottom-right one (decoding's), and the query rows of a K/V head's group in one decoding
    tile (more rows keep FlashAttention-2's grid busy). q4 (B, Hq, Nq, d), k4 (B, Hkv, Nk, d), checked by
    `inputs.check_inputs`."""
    if q4.dtype not in DTYPES or alignment not in (None, "bottom_right"):
        return False
    group = q4.shape[1] // k4.shape[1]
    return q4.shape[2] * group <= tile_for(q4.shape[3]).block_m_max


def takes(q4: torch.Tensor, k4: torch.Tensor, alignment: str | None) -> bool:
    """Whether `forward.forward` hands this call over: compiled on a GPU (the interpreter keeps the
    kernel notebook 06 teaches), `fits`, and enough work (`MIN_WORK`, docstring)."""
    if runtime.INTERPRET:
        return False
    slots = FORWARD_PROGRAMS_PER_SM * sm_count(q4.device.index)
    waves = -(-q4.shape[0] * q4.shape[1] // slots)
    return waves * k4.shape[2] >= MIN_WORK and fits(q4, k4, alignment)


def forward(q, k, v, alignment: str | None, scale: float):
    """O and L of attention by the split-KV kernel (`decode.split_kv.launch`), as `forward.forward`
    returns them: q (..., Nq, d), k and v (..., Nk, d), any strides, checked by `inputs.check_inputs`."""
    q4, k4, v4 = as_4d(q), as_4d(k), as_4d(v)
    n_k = k4.shape[2]
    out, lse = split_kv_launch(
        q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2), None, None,
        page_size=1, capacity=n_k, causal=alignment is not None, scale=scale, num_splits=None, full=True,
    )  # fmt: skip
    # out (B, Nq, Hq, d) has q4.transpose(1, 2)'s strides: for a contiguous q, transposing back is contiguous
    o = out.transpose(1, 2).contiguous().view(q.shape)
    return o, lse.transpose(1, 2).contiguous().view(q.shape[:-1])


def routed_forward(
    q, k, v, alignment, scale, launch_cfg, switches, window=0, sinks=None, seqs=None, plan_out=None
):
    """`forward._forward` (its checked arguments, its (O, L), its plan_out), with a decoding step that
    `takes` accepts handed to the split-KV kernel: only a call with the default launch, no window, no sinks
    and no packed sequences is ever handed over (and such a call leaves no plan)."""
    plain = launch_cfg is None and not window and sinks is None and seqs is None
    if plain and takes(as_4d(q), as_4d(k), alignment):
        with cuda_device(q):
            return forward(q, k, v, alignment, scale)
    return _forward(q, k, v, alignment, scale, launch_cfg, switches, window, sinks, seqs, plan_out)


def attention_forward(
    q, k, v, causal=False, scale: float | None = None, config: dict | None = None, window=None, sinks=None
):
    """`forward.forward` (the same arguments, checks and results: O and L) with a decoding step handed
    to the split-KV kernel (`routed_forward`). This is `course_lib.attention.attention_forward`."""
    return routed_forward(*forward_call(q, k, v, causal, scale, config, window, sinks))
