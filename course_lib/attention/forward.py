"""FlashAttention-2 forward pass in Triton (notebook 06).

One program computes one block of BLOCK_M query rows for one (batch, head). It loads its Q block
once (HBM -> registers), then streams K and V through in blocks of BLOCK_N rows (HBM -> shared
memory, pipelined `num_stages` deep), keeping the running row maximum m, the running row sum l and the
output accumulator acc in registers (online softmax). The Nq x Nk score matrix S and probability
matrix P only ever exist one BLOCK_M x BLOCK_N tile at a time, in registers. At the end it writes
O = acc / l and the logsumexp L = m + log(l) (what the backward pass needs to rebuild P) to HBM.

Bytes moved per (batch, head): Q and O once (2 * Nq * d elements), K and V once per query block
(2 * Nk * d * Nq / BLOCK_M elements, mostly served by the L2 cache), L once (Nq floats).

Grouped-query attention: query head h reads K/V head h // GROUP, so K/V are never repeated. Which K/V
blocks a query block visits (causal, top-left or bottom-right aligned) is `blocks.kv_block_range`.
Everything runs compiled on a GPU and through Triton's interpreter on the CPU (`course_lib.runtime`):
plain pointer arithmetic, a mask on every load and store, block dimensions >= 16.

The online-softmax step (`softmax_step`), the logsumexp that finishes it (`logsumexp`) and the block
range (`blocks.kv_block_range`) are `tl.constexpr` function arguments of the kernel, defaulting to
these production helpers of the shared kernel layer (`course_lib.kernels.softmax`, `.blocks`);
notebook 08's optimisation ladder swaps in its first rungs' variants (natural exponentials, every block
masked) from `teaching.py` through `config=`.

A few query rows over a long K/V (a decoding step: Nq = 1 at batch 1 gives a grid of B x H programs)
run better in Flash-Decoding's split-KV kernel: that choice is made above this module, in
`decode_route.py` (notebook 09), which `flash_attention`, its operator and `attention_forward` call;
`forward` here always runs this kernel.

On a Hopper GPU the tuned forward hands contiguous 16-bit inputs to `hopper.py` (a warp-specialised
Gluon kernel) where that measured faster; `config={"hopper": False}` keeps this one.

Public entry point for notebooks: `forward(q, k, v, causal, scale, config=None) -> (O, L)`.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch

from .. import runtime
from ..checks import (
    accumulator_dtype,
    causal_offset,
    kernel_window,
    kv_group,
)
from ..kernels import bound
from ..kernels.blocks import (
    kv_block_range,
    load_rows,
    program_block,
    row_mask,
    sequence,
    visible_keys,
    window_kv_range,
)
from ..kernels.plans import on_current_device
from ..kernels.softmax import LOG2E, logsumexp, softmax_step
from ..runtime import tl, triton
from . import plans
from .configs import FORWARD, split_config, teaching_hooks
from .inputs import SUPPORTED_HEAD_DIMS, as_4d, check_call, kernel_flags, strides4, within_offsets
from .launch import cuda_device, launch, make_tuner, n_bucket

runtime.require_triton()

__all__ = ["SUPPORTED_HEAD_DIMS", "forward"]

# Constants the kernels read (Triton kernels may only read globals declared tl.constexpr).


# --------------------------------------------------------------------------------------------------
# FlashAttention-3's warp-specialised forward (`hopper.py`, Gluon): taken on Hopper GPUs where faster
# --------------------------------------------------------------------------------------------------
HOPPER_FAILED: list[str] = []  # why the Gluon kernel could not be used in this process, if it failed


@functools.cache
def hopper_kernels():
    """The `hopper` module when this process can use it (a GPU run, not the interpreter, and a Triton
    with Gluon), else None. Which tensors it takes is `hopper.supports`; which shapes, `hopper.choose`."""
    if not runtime.ON_GPU or runtime.INTERPRET:
        return None
    try:
        from . import hopper
    except ImportError:
        return None
    return hopper


def _try_hopper(
    q4, k4, v4, o4, l3, causal: bool, offset: int, scale: float, switches: dict, hooks: dict
) -> bool:
    """Run the warp-specialised Gluon forward if it applies (the production hooks, hopper switch on, a
    Hopper GPU, contiguous 16-bit inputs, a shape where `hopper.choose` found it faster); True if it ran.
    A Triton whose Gluon cannot compile the kernel gets one warning, and the Triton kernel from then on."""
    hopper = hopper_kernels()
    if hopper is None or HOPPER_FAILED or not switches["HOPPER"]:
        return False
    if hooks or not hopper.supports(q4, k4, v4):  # a teaching variant runs in the Triton kernel only
        return False
    if causal and offset < 0:  # bottom-right with Nq > Nk: rows that see no key stay with the Triton kernel
        return False
    heads, sms = q4.shape[0] * q4.shape[1], runtime.sm_count(q4.device.index)
    variant = hopper.choose(
        q4.shape[-1], causal, q4.shape[2], k4.shape[2], offset if causal else 0, heads, sms
    )
    if variant is None:
        return False
    return run_gluon(
        "forward", HOPPER_FAILED, hopper.forward, q4, k4, v4, o4, l3, causal, scale, variant, offset
    )


def run_gluon(what: str, failed: list[str], kernel, *args) -> bool:
    """Run a Gluon kernel launch `kernel(*args)`; True if it ran. If it raises (a Triton whose Gluon
    cannot compile it), record why in `failed`, which makes the caller stop trying (the Triton kernel
    runs from then on), warn once, and return False."""
    try:
        kernel(*args)
    except Exception as exc:  # a compiler error: the Triton kernel is always available
        failed.append(f"{type(exc).__name__}: {exc}")
        warnings.warn(
            f"course_lib: the warp-specialised Hopper {what} failed ({failed[0][:300]}); "
            f"using the Triton {what} from now on",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    return True


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------
@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q,  # running state (registers) and the Q block (registers)
    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_n, offs_d, lo, hi, N_K, offset, window, sm_scale,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, LOCAL: tl.constexpr, SOFTMAX_STEP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC_DTYPE: tl.constexpr,
):  # fmt: skip
    """Online softmax over the K/V blocks starting at lo, lo + BLOCK_N, ... < hi.

    MASK=False is the fast stage: every key of every block is visible to every query row, so no
    score is masked. MASK=True (causal diagonal blocks, the ragged last block, a sliding window's
    edge) sets the scores of invisible keys (`blocks.visible_keys`: past N_K, j > i + offset when CAUSAL,
    j <= i + offset - window when LOCAL) to -inf before the softmax step."""
    k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd  # K block (BLOCK_N, d)
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd  # V block (BLOCK_N, d)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        # K block: HBM -> shared memory, BLOCK_N * d elements, rows read contiguously (coalesced);
        # the transpose for Q K^T is a change of shared-memory layout, not a second read.
        k = load_rows(k_ptrs + start_n * stride_kn, cols, N_K, offs_d, HEAD_DIM, BLOCK_D, UPCAST)
        # S = Q K^T: a (BLOCK_M, BLOCK_N) tile in registers, fp32
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        if MASK:
            visible = visible_keys(offs_m[:, None], cols[None, :], N_K, offset, window, CAUSAL, LOCAL)
            s = tl.where(visible, s, float("-inf"))
        p, alpha, l_i, m_i = SOFTMAX_STEP(s, m_i, l_i, sm_scale, MASK)  # P: registers, fp32
        acc = acc * alpha[:, None]  # rescale the accumulator to the new max: BLOCK_M x d multiplies
        v = load_rows(
            v_ptrs + start_n * stride_vn, cols, N_K, offs_d, HEAD_DIM, BLOCK_D, UPCAST
        )  # V block: HBM -> shared
        # acc += P V: P from registers, V from shared memory, fp32 accumulator in registers
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    Q, K, V, O, L, SINKS, SEQ, sm_scale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    H, GROUP, N_Q, N_K, OFFSET, WINDOW, N_BUCKET,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC_DTYPE: tl.constexpr,
    SOFTMAX_STEP: tl.constexpr = softmax_step, LOGSUMEXP: tl.constexpr = logsumexp,
    KV_RANGE: tl.constexpr = kv_block_range, LOCAL: tl.constexpr = False, HAS_SINKS: tl.constexpr = False,
    VARLEN: tl.constexpr = 0,
):  # fmt: skip
    """O[b, h, rows] and L[b, h, rows] for one block of BLOCK_M query rows of one (batch, head).

    Grid: (cdiv(N_Q, BLOCK_M) * B * H,). Query head h reads K/V head h // GROUP (grouped-query
    attention: GROUP query heads share one K/V head; GROUP = 1 is multi-head attention). Causal:
    row i sees keys j <= i + OFFSET (`blocks.py`); LOCAL (a sliding window): only the WINDOW keys
    j > i + OFFSET - WINDOW of those. HAS_SINKS: SINKS[h] is one more logit in every row's softmax
    (an attention sink: a key with a zero value). VARLEN: packed sequences, SEQ their bounds
    (`blocks.sequence`; N_Q, N_K the longest's lengths). N_BUCKET only keys the autotuner.
    SOFTMAX_STEP, LOGSUMEXP, KV_RANGE: the online-softmax step, its finish and the block range;
    notebook 08's ladder passes the variants of `teaching.py`."""
    off_b, off_h, m_start = program_block(N_Q, H, BLOCK_M, CAUSAL, False)  # causal: longest rows first
    off_b, q_start, n_q, k_start, n_k, offset = sequence(SEQ, off_b, N_Q, N_K, OFFSET, VARLEN)
    off_kh = off_h // GROUP
    q_base = Q + off_b * stride_qb + off_h * stride_qh + q_start * stride_qm
    k_base = K + off_b * stride_kb + off_kh * stride_kh + k_start * stride_kn
    v_base = V + off_b * stride_vb + off_kh * stride_vh + k_start * stride_vn

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = row_mask(offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D)
    # Q block: HBM -> on chip once, BLOCK_M * d elements; it stays there for the whole loop.
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Running state, registers: row max m, row sum l (of exp(S - m)), unnormalised output acc.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC_DTYPE)
    l_i = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)
    if HAS_SINKS:  # the sink is the first "key" every row sees: m = its logit (base 2), l = exp(0) = 1
        m_i = tl.zeros([BLOCK_M], dtype=ACC_DTYPE) + tl.load(SINKS + off_h).to(ACC_DTYPE) * LOG2E
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)  # a sink of -inf is no sink
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC_DTYPE)

    # Stage 1, unmasked: K/V blocks that every row of this Q block sees entirely.
    # Stage 2, masked: the causal diagonal blocks and the ragged last block; blocks wholly above
    # the diagonal (j > i + OFFSET for every pair) are never loaded.
    lo, mid, hi = KV_RANGE(m_start, n_q, n_k, offset, 0, 1, CAUSAL, BLOCK_M, BLOCK_N)
    if VARLEN:  # a block of rows past its sequence's end (a shorter sequence than the longest): no key
        hi = tl.where(m_start < n_q, hi, 0)
        mid = tl.minimum(mid, hi)
    if LOCAL:  # a sliding window: first the blocks its lower edge crosses (masked), from the first it reaches
        w_lo, lo, mid = window_kv_range(m_start, n_q, offset, WINDOW, lo, mid, hi, BLOCK_M, BLOCK_N)
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, w_lo, lo, n_k, offset, WINDOW, sm_scale,
            True, CAUSAL, LOCAL, SOFTMAX_STEP, HEAD_DIM, BLOCK_D, BLOCK_N, UPCAST, DOT_PRECISION, ACC_DTYPE,
        )  # fmt: skip
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_n, offs_d, lo, mid, n_k, offset, WINDOW, sm_scale,
        False, CAUSAL, LOCAL, SOFTMAX_STEP, HEAD_DIM, BLOCK_D, BLOCK_N, UPCAST, DOT_PRECISION, ACC_DTYPE,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_n, offs_d, mid, hi, n_k, offset, WINDOW, sm_scale,
        True, CAUSAL, LOCAL, SOFTMAX_STEP, HEAD_DIM, BLOCK_D, BLOCK_N, UPCAST, DOT_PRECISION, ACC_DTYPE,
    )  # fmt: skip

    # O = acc / l: registers -> HBM, BLOCK_M * d elements. A row that saw no key (l = 0: possible with
    # bottom-right causal when Nq > Nk, with a window whose keys all lie past Nk, or Nk = 0) gets O = 0 and
    # L = -inf; with a sink it saw the sink (l = 1): O = 0 and L = the sink.
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    acc = acc / l_safe[:, None]
    o_base = O + off_b * stride_ob + off_h * stride_oh + q_start * stride_om
    o_ptrs = o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=q_mask)
    # L = logsumexp of the scaled scores, natural-log units: BLOCK_M floats to HBM.
    lse = tl.where(seen, LOGSUMEXP(m_i, l_safe), float("-inf"))
    l_ptrs = L + off_b * stride_lb + off_h * stride_lh + (q_start + offs_m) * stride_lm
    tl.store(l_ptrs, lse.to(L.dtype.element_ty), mask=offs_m < n_q)


_fwd_tuned = make_tuner(_fwd_kernel, FORWARD, key=["N_BUCKET", "HEAD_DIM", "CAUSAL"])
HOOKS = ("SOFTMAX_STEP", "LOGSUMEXP", "KV_RANGE")  # the kernel's function arguments (teaching variants)


# --------------------------------------------------------------------------------------------------
# Python entry point
# --------------------------------------------------------------------------------------------------
def forward(
    q, k, v, causal=False, scale: float | None = None, config: dict | None = None, window=None, sinks=None
):
    """FlashAttention-2 forward: O = softmax(Q K^T * scale [+ causal mask]) V, and L = logsumexp.

    q: (..., Nq, d), k and v: (..., Nk, d) with the same leading dims, or fewer heads (dim -3) for
    grouped-query attention; any strides (the kernel reads them); float16, bfloat16 or float32
    (float64 under the interpreter only). Returns O with q's shape and dtype (contiguous) and L of
    shape q.shape[:-1], natural-log units, float32 (float64 for float64 inputs).
    causal: False; True or "top_left" (query i sees keys j <= i); "bottom_right" (query i sees keys
    j <= i + Nk - Nq: the queries are the last Nq positions, as with a KV cache). A row that sees no
    key gets O = 0 and L = -inf. window: None, or a sliding window of that many keys (causal only):
    query i sees keys i + offset - window < j <= i + offset (`checks.check_window`). sinks: None, or
    (Hq,) logits, one per query head (`checks.check_sinks`): each joins its head's softmax as a key with a
    zero value, and L includes it.

    config (dict, optional; notebook 08's optimisation ladder):
      BLOCK_M, BLOCK_N   query rows per program, key rows per loop step (powers of two >= 16)
      num_warps, num_stages   warps per program, software-pipelining depth of the K/V loads
      exp2 (bool, default True)   False: tl.exp on scores multiplied by the scale separately
          (`teaching.softmax_step_natural` in place of `softmax_step`)
      skip_masked_blocks (bool, default True)   False: every K/V block is loaded and masked, as a
          naive kernel would (`teaching.every_kv_block`); True: causal blocks above the diagonal
          are skipped and only the diagonal (and ragged last) blocks pay for masking.
      hopper (bool, default True)   on a Hopper GPU, with the default launch and the other switches
          at their defaults, run FlashAttention-3's warp-specialised Gluon kernel (`hopper.py`) for
          contiguous 16-bit inputs with d in {64, 128} where it is faster; False: always Triton.
    Giving any of the four launch keys, or exp2=False or skip_masked_blocks=False, fixes the launch
    (the other launch keys take defaults); config=None (or only hopper) uses the default choice
    (`launch.py`)."""
    return _forward(*forward_call(q, k, v, causal, scale, config, window, sinks))


def forward_call(q, k, v, causal, scale, config, window, sinks) -> tuple:
    """`forward`'s arguments checked, as `_forward` takes them: (q, k, v, alignment, scale, launch,
    switches, window, sinks)."""
    alignment, window, sinks, scale = check_call(q, k, v, causal, scale, window, sinks, "attention.forward")
    launch_cfg, switches = split_config(config, FORWARD.cpu if runtime.INTERPRET else FORWARD.fixed)
    return q, k, v, alignment, scale, launch_cfg, switches, window, sinks


def _forward(q, k, v, alignment, scale, launch_cfg, switches, window=0, sinks=None, seqs=None, plan_out=None):
    """Launch the forward kernel on validated inputs (no checks here); alignment from
    `checks.causal_alignment`, window from `checks.check_window` (0: none), sinks from
    `checks.check_sinks`. seqs: None, or packed sequences (`packed.Sequences`): q, k, v are then
    (total rows, heads, d) and O, L come back as (total_q, Hq, d) and (total_q, Hq).
    plan_out: None, or a list to which a `ForwardPlan` of this call is appended where it can be repeated so
    (`plans.py`: the default launch, no window, sinks or packing, no copy of an input)."""
    # the Gluon kernel (and, above this module, the split-KV route) take only these calls
    plain = launch_cfg is None and not window and sinks is None and seqs is None
    # Host time per call on a 2-core CPU: torch.empty(q.shape, ...) 2.9 us against empty_like's 1.2; a view
    # of L to the shape it has 3.2 us, skipped for a 4-D q
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(q.shape[:-1], dtype=accumulator_dtype(q.dtype), device=q.device)
    if seqs is None:
        q4, k4, v4, o4 = as_4d(q), as_4d(k), as_4d(v), as_4d(o)
        l3 = lse if q4 is q else lse.view(q4.shape[:-1])
        B, H, n_q, d = q4.shape
        n_k = k4.shape[2]
    else:  # packed rows viewed as one batch of (heads, rows): the kernels read every stride
        q4, k4, v4, o4 = (t.transpose(0, 1)[None] for t in (q, k, v, o))
        l3 = lse.t()[None]
        B, H, d, n_q, n_k = seqs.count, q.shape[1], q.shape[2], seqs.max_q, seqs.max_k
    viewed = (q4, k4, v4)
    q4, k4, v4 = (
        within_offsets(t, rows, name, "attention.forward")
        for t, rows, name in ((q4, n_q, "q"), (k4, n_k, "k"), (v4, n_k, "v"))
    )
    plannable = (
        plan_out is not None
        and plain
        and seqs is None
        and on_current_device(q)
        and all(a is b for a, b in zip(viewed, (q4, k4, v4)))  # nothing copied (`within_offsets`)
    )
    within_offsets(o4, n_q, "O", "attention.forward", copy=False)  # written where it is: checked only
    causal = alignment is not None
    offset = causal_offset(alignment, n_q, n_k) if seqs is None else 0
    window = kernel_window(window, n_q, n_k)
    bucket = n_bucket(max(n_q, n_k))
    args = (
        q4, k4, v4, o4, l3, l3 if sinks is None else sinks, l3 if seqs is None else seqs.bounds, scale,
        *strides4(q4), *strides4(k4), *strides4(v4), *strides4(o4), *l3.stride(),
        H, kv_group(q4, k4), n_q, n_k, offset, window, bucket,
    )  # fmt: skip
    meta = dict(
        CAUSAL=causal, HEAD_DIM=d, BLOCK_D=max(16, runtime.next_power_of_2(d)), **kernel_flags(q.dtype)
    )
    if window:  # the sliding-window variant; without one the kernel compiles exactly as before
        meta["LOCAL"] = True
    if sinks is not None:
        meta["HAS_SINKS"] = True
    if seqs is not None:
        meta["VARLEN"] = seqs.mode(alignment)
    hooks = teaching_hooks(switches, HOOKS)  # {} unless a ladder rung asks for a teaching variant
    tensors = dict(q4=q4, k4=k4, v4=v4, o4=o4, l3=l3) if plannable else None
    with cuda_device(q), bound.recording(tensors) if plannable else contextlib.nullcontext() as recorded:
        if plain and _try_hopper(q4, k4, v4, o4, l3, causal, offset, scale, switches, hooks):
            pass
        elif launch_cfg is None:  # the production kernel (teaching variants always come with a fixed launch)
            grid = lambda c: (runtime.cdiv(n_q, c.block_m) * B * H,)
            launch(_fwd_kernel, _fwd_tuned, FORWARD, grid, args, meta, (bucket, d, causal, q.dtype))
        else:
            grid = (runtime.cdiv(n_q, launch_cfg["BLOCK_M"]) * B * H,)
            bound.launch(_fwd_kernel, grid, *args, **meta, **hooks, **launch_cfg)
    launches = recorded.prepared() if recorded is not None else None
    if launches:
        plan_out.append(ForwardPlan(launches, q, q4, lse, l3))
    return o, lse


class ForwardPlan:
    """A forward call to repeat (`plans.py`): its launches (the Triton kernel's, or the Gluon kernel's with
    its TMA descriptors made again over the new tensors) with every non-tensor argument fixed, and how to
    allocate O and L and view q, k, v, O, L as the kernels take them. `run(q, k, v)` gives (O, L) as
    `_forward` does, for a call with the same key. `backward` holds the backward plans of the calls
    it made ({dO's key: `backward.BackwardPlan`}); `grad_ready`, whether the backward's kernels were started
    compiling (`api.FlashAttentionTriton`)."""

    __slots__ = (
        "launches", "four_d", "lse_shape", "lse_dtype", "l3_shape", "generation", "backward", "grad_ready", "call"
    )  # fmt: skip

    def __init__(self, launches: tuple, q, q4, lse, l3):
        self.launches = launches
        self.four_d = q4 is q and l3 is lse
        self.lse_shape, self.lse_dtype, self.l3_shape = tuple(lse.shape), lse.dtype, tuple(l3.shape)
        self.generation = plans.generation()
        self.backward: dict = {}
        self.grad_ready = False
        self.call = (
            None  # the checked (alignment, scale, window): what the autograd Function keeps for backward
        )

    def run(self, q, k, v):
        o = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = q.new_empty(self.lse_shape, dtype=self.lse_dtype)  # 1.4 us less than torch.empty(device=)
        if self.four_d:
            tensors = {"q4": q, "k4": k, "v4": v, "o4": o, "l3": lse}
        else:
            l3 = lse.view(self.l3_shape)
            tensors = {"q4": as_4d(q), "k4": as_4d(k), "v4": as_4d(v), "o4": as_4d(o), "l3": l3}
        for launch_ in self.launches:
            launch_(tensors)
        return o, lse
