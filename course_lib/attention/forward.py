"""FlashAttention-2 forward pass in Triton (notebook 06).

One program computes one block of BLOCK_M query rows for one (batch, head). It loads its Q block
once (HBM -> registers), then streams K and V through in blocks of BLOCK_N rows (HBM -> shared
memory, pipelined `num_stages` deep), keeping the running row maximum m, the running row sum l and the
output accumulator acc in registers (online softmax). The Nq x Nk score matrix S and probability
matrix P only ever exist one BLOCK_M x BLOCK_N tile at a time, in registers. At the end it writes
O = acc / l and the logsumexp L = m + log(l) (what the backward pass needs to rebuild P) to HBM.

Bytes moved per (batch, head): Q and O once (2 * Nq * d elements), K and V once per query block
(2 * Nk * d * Nq / BLOCK_M elements, mostly served by the L2 cache), L once (Nq floats).

Everything runs compiled on a GPU and through Triton's interpreter on the CPU (`course_lib.runtime`):
plain pointer arithmetic, a mask on every load and store, block dimensions >= 16.

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
from ..checks import accumulator_dtype, check_attention_inputs, default_scale
from ..runtime import tl, triton

runtime.require_triton()

# Constants the kernels read (Triton kernels may only read globals declared tl.constexpr).
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # ln(2):    log(x) = log2(x) * LN2

MAX_HEAD_DIM = 256
# Head dims the kernels accept: multiples of 8 from 16 to 256. The head dim is padded to a power of
# two inside the kernels (BLOCK_D), so 16, 32, 64, 128 and 256 waste nothing; the rest (e.g. 40, 80,
# 96) compute on zero padding. 16, 32, 64 and 128 are the tuned ones.
SUPPORTED_HEAD_DIMS = tuple(range(16, MAX_HEAD_DIM + 1, 8))

# Keys of the `config` dict that fix the launch (the rest are teaching switches).
LAUNCH_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
SWITCH_KEYS = ("exp2", "skip_masked_blocks", "tma", "hopper")


# --------------------------------------------------------------------------------------------------
# Input handling shared by forward, backward and the autograd Function
# --------------------------------------------------------------------------------------------------
def check_inputs(q, k, v, where: str) -> None:
    """Raise a clear error for anything the kernels cannot take (see `course_lib.checks`).

    Accepted: q (..., Nq, d), k and v (..., Nk, d), same leading dims, dtype and device; float16,
    bfloat16 or float32 (float64 only under the interpreter, for gradcheck); d a multiple of 8 in
    [16, 256]; tensors on the device where the kernels run (`course_lib.DEVICE`)."""
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    if runtime.INTERPRET:
        dtypes = dtypes + (torch.float64,)
    elif isinstance(q, torch.Tensor) and q.dtype == torch.float64:
        raise TypeError(
            f"{where}: float64 runs only under the Triton interpreter (CPU), where it serves gradcheck; "
            "the compiled GPU kernels take float16, bfloat16 or float32. For a float64 result use "
            "course_lib.attention.reference.attention."
        )
    check_attention_inputs(q, k, v, where=where, dtypes=dtypes)
    d = q.shape[-1]
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"{where}: head dim d={d} is not supported by the Triton kernels; supported: multiples of 8 "
            f"from 16 to {MAX_HEAD_DIM} (tuned: 16, 32, 64, 128); q {tuple(q.shape)}"
        )
    if runtime.INTERPRET and q.device.type != "cpu":
        raise ValueError(
            f"{where}: q, k, v are on {q.device}, but the Triton kernels run in the interpreter on the CPU "
            "here (course_lib.INTERPRET is True: no GPU build, or COURSE_DEVICE=cpu). Move the tensors "
            "to the CPU, or start Python on a GPU machine without COURSE_DEVICE=cpu."
        )
    if runtime.ON_GPU and q.device.type != "cuda":
        raise ValueError(
            f"{where}: q, k, v are on {q.device}, but the Triton kernels are compiled for the GPU here "
            "(course_lib.ON_GPU is True). Move the tensors to the GPU with .to(course_lib.DEVICE), or "
            "set COURSE_DEVICE=cpu before importing course_lib to use the interpreter."
        )


def as_4d(t: torch.Tensor) -> torch.Tensor:
    """View t (..., N, d) as (B, H, N, d) without copying when the strides allow it.

    0 or 1 leading dims become (1, 1, ...) or (B, 1, ...); 2 stay; more are merged into the first of
    two by `reshape`, which copies only when the merged dims cannot share one stride."""
    lead = t.shape[:-2]
    if len(lead) == 0:
        return t[None, None]
    if len(lead) == 1:
        return t[:, None]
    if len(lead) == 2:
        return t
    return t.reshape(-1, lead[-1], *t.shape[-2:])


def strides4(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(batch, head, row, column) strides of a 4-D view, in elements (what the kernels index with)."""
    return tuple(t.stride())


def kernel_flags(dtype: torch.dtype) -> dict:
    """Compile-time flags that depend on the input dtype.

    UPCAST: bf16 under the interpreter (its bf16 `tl.dot` is wrong), so tiles go to fp32 after loading.
    DOT_PRECISION: "ieee" for fp32/fp64 inputs (a GPU would otherwise use tf32, ~1e-3 relative error);
    for fp16/bf16 it changes nothing. ACC_DTYPE: fp32 accumulators, fp64 for fp64 inputs (gradcheck)."""
    wide = dtype in (torch.float32, torch.float64)
    return dict(
        UPCAST=bool(runtime.INTERPRET and dtype == torch.bfloat16),
        DOT_PRECISION="ieee" if wide else "tf32",
        ACC_DTYPE=tl.float64 if dtype == torch.float64 else tl.float32,
    )


def n_bucket(n: int) -> int:
    """A coarse size class for autotuning keys: the power of two >= n, capped at 16384, so that the
    tuner runs once per class instead of on every new sequence length."""
    return min(triton.next_power_of_2(max(int(n), 16)), 16384)


def split_config(config: dict | None, defaults: dict) -> tuple[dict | None, dict]:
    """Split a user `config` into (launch parameters or None for autotuning, teaching switches).

    If any of BLOCK_M, BLOCK_N, num_warps, num_stages is given, the launch is fixed (missing ones take
    `defaults`); otherwise the tuned defaults are used. Switches default to the fast choice (True).
    BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2 (backward kernels only) are launch keys too."""
    config = dict(config or {})
    unknown = (
        set(config) - set(LAUNCH_KEYS) - set(SWITCH_KEYS) - {"BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"}
    )
    if unknown:
        known = LAUNCH_KEYS + SWITCH_KEYS + ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2 (backward)")
        raise ValueError(f"unknown config keys {sorted(unknown)}; known: {', '.join(known)}")
    switches = {
        "EXP2": bool(config.pop("exp2", True)),
        "SKIP_MASKED": bool(config.pop("skip_masked_blocks", True)),
        "TMA": bool(config.pop("tma", False)),
        "HOPPER": bool(config.pop("hopper", True)),  # forward only (`hopper_kernels`)
    }
    if not config:
        return None, switches
    launch = dict(defaults)
    launch.update(config)
    for key, value in launch.items():
        if key.startswith("BLOCK") and (value < 16 or value & (value - 1)):
            raise ValueError(f"config {key}={value}: block sizes must be powers of two >= 16")
    return launch, switches


def cuda_device(t: torch.Tensor):
    """Context that makes t's GPU current during a launch (Triton launches on the current device);
    a no-op when it already is (switching costs microseconds that a small call can feel)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NO_DEVICE


_NO_DEVICE = contextlib.nullcontext()  # reusable: it holds no state


# --------------------------------------------------------------------------------------------------
# The tensor memory accelerator (TMA): Hopper's tile copy engine, used by the GPU forward when it can
# --------------------------------------------------------------------------------------------------
@functools.cache
def tma_available() -> bool:
    """True on a GPU of compute capability >= 9.0 (Hopper) with a Triton that has tensor descriptors."""
    return bool(
        runtime.ON_GPU
        and hasattr(tl, "make_tensor_descriptor")
        and hasattr(triton, "set_allocator")
        and torch.cuda.get_device_capability()[0] >= 9
    )


def use_tma(*tensors: torch.Tensor) -> bool:
    """Whether the forward kernel may fetch these (B, H, N, d) tensors with TMA descriptors: a Hopper
    GPU, 16-bit data, contiguous rows (last stride 1), and every other stride and the base address
    multiples of 16 bytes (what a descriptor requires). Anything else takes the pointer path."""
    if not tma_available():
        return False
    for t in tensors:
        size = t.element_size()
        if size != 2 or t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((s * size) % 16 for s in t.stride()[:-1]):
            return False
    return True


def _tma_scratch(size: int, alignment: int, stream):
    """Global memory where the programs write their tensor descriptors (128 bytes each)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


# --------------------------------------------------------------------------------------------------
# FlashAttention-3's warp-specialised forward (`hopper.py`, Gluon): taken on Hopper GPUs where faster
# --------------------------------------------------------------------------------------------------
_HOPPER_FAILED: list[str] = []  # why the Gluon kernel could not be used in this process, if it failed


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


def _try_hopper(q4, k4, v4, o4, l3, causal: bool, scale: float, switches: dict) -> bool:
    """Run the warp-specialised Gluon forward if it applies (fast switches, a Hopper GPU, contiguous
    16-bit inputs, a shape where `hopper.choose` found it faster); True if it ran. A Triton whose Gluon
    cannot compile the kernel gets one warning, and the Triton kernel from then on."""
    hopper = hopper_kernels()
    if hopper is None or _HOPPER_FAILED or not switches["HOPPER"] or switches["TMA"]:
        return False
    if not (switches["EXP2"] and switches["SKIP_MASKED"] and hopper.supports(q4, k4, v4)):
        return False
    variant = hopper.choose(q4.shape[-1], causal, q4.shape[2], k4.shape[2])
    if variant is None:
        return False
    try:
        hopper.forward(q4, k4, v4, o4, l3, causal, scale, variant)
    except Exception as exc:  # a compiler error: the Triton kernel below is always available
        _HOPPER_FAILED.append(f"{type(exc).__name__}: {exc}")
        warnings.warn(
            f"course_lib: the warp-specialised Hopper forward failed ({_HOPPER_FAILED[0][:300]}); "
            "using the Triton forward from now on",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


# --------------------------------------------------------------------------------------------------
# Launching an autotuned kernel
# --------------------------------------------------------------------------------------------------
_CHOSEN: dict = {}


def launch_tuned(tuner, grid, args: tuple, meta: dict, key: tuple) -> None:
    """Launch `tuner` (a `runtime.autotune`d kernel) on `grid`, remembering its choice per `key`.

    The first call for a key goes through the autotuner, which times the candidates (GPU) and picks
    one. Later calls launch the chosen configuration directly: the autotuner's own dispatch rebuilds a
    dict of all 30-50 arguments and its key on every call, tens of microseconds of Python that a
    millisecond-sized forward+backward feels (notes/performance.md). `key` must determine the choice:
    size class, head dim, dtype and every compile-time switch."""
    config = _CHOSEN.get((id(tuner), key))
    if config is None:
        tuner[grid](*args, **meta)
        _CHOSEN[(id(tuner), key)] = tuner.best_config
    else:
        tuner.fn[grid](*args, **meta, **config.all_kwargs())


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------
@triton.jit
def row_mask(rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Mask of a (rows, BLOCK_D) tile: rows past n_rows and padding columns past HEAD_DIM are off."""
    if BLOCK_D == HEAD_DIM:
        mask = (rows < n_rows)[:, None]
    else:
        mask = (rows < n_rows)[:, None] & (offs_d < HEAD_DIM)[None, :]
    return mask


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q,  # running state (registers) and the Q block (registers)
    k_src, v_src, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_n, offs_d, lo, hi, N_K, qk_scale,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, EXP2: tl.constexpr, TMA: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC_DTYPE: tl.constexpr,
):  # fmt: skip
    """Online softmax over the K/V blocks starting at lo, lo + BLOCK_N, ... < hi.

    MASK=False is the fast stage: every key of every block is visible to every query row, so no
    score is masked. MASK=True (causal diagonal blocks, the ragged last block) sets the scores of
    invisible keys (past N_K, or j > i when CAUSAL) to -inf before the softmax.
    k_src, v_src: this head's K and V, as base pointers (TMA=False) or tensor descriptors (TMA=True)."""
    if not TMA:
        k_ptrs = k_src + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd  # K block (BLOCK_N, d)
        v_ptrs = v_src + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd  # V block (BLOCK_N, d)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        # K block: HBM -> shared memory, BLOCK_N * d elements, rows read contiguously (coalesced);
        # the transpose for Q K^T is a change of shared-memory layout, not a second read.
        if TMA:
            k = k_src.load([start_n, 0])  # one bulk copy; rows past N_K arrive as zeros
        else:
            kv_mask = row_mask(cols, N_K, offs_d, HEAD_DIM, BLOCK_D)
            k = tl.load(k_ptrs + start_n * stride_kn, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        # S = Q K^T: a (BLOCK_M, BLOCK_N) tile in registers, fp32
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        if MASK:
            visible = cols[None, :] < N_K
            if CAUSAL:
                visible = visible & (offs_m[:, None] >= cols[None, :])
            s = tl.where(visible, s, float("-inf"))
        if EXP2:
            # base-2 exponentials with the scale folded in: one multiply-add and one ex2 per score
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
        else:
            # the textbook form: scale, then exp (which the hardware computes as ex2(x * log2 e))
            s = s * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]  # rescale the accumulator to the new max: BLOCK_M x d multiplies
        m_i = m_new
        if TMA:
            v = v_src.load([start_n, 0])  # V block: HBM -> shared memory
        else:
            v = tl.load(v_ptrs + start_n * stride_vn, mask=kv_mask, other=0.0)  # V block: HBM -> shared
        if UPCAST:
            v = v.to(tl.float32)
        # acc += P V: P from registers, V from shared memory, fp32 accumulator in registers
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    Q, K, V, O, L, sm_scale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    H, N_Q, N_K, N_BUCKET,
    CAUSAL: tl.constexpr, EXP2: tl.constexpr, SKIP_MASKED: tl.constexpr, TMA: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC_DTYPE: tl.constexpr,
):  # fmt: skip
    """O[b, h, rows] and L[b, h, rows] for one block of BLOCK_M query rows of one (batch, head).

    Grid: (cdiv(N_Q, BLOCK_M) * B * H,). N_BUCKET only keys the autotuner.
    TMA=True (Hopper and newer, rows contiguous and 16-byte aligned: `use_tma`): Q, K and V tiles are
    fetched by the tensor memory accelerator, a copy engine that moves a whole tile HBM -> shared
    memory from a descriptor (base, shape, strides, tile shape), with no per-element addresses or
    masks computed by the program's threads. TMA=False: pointer arithmetic and masked loads."""
    num_m = tl.cdiv(N_Q, BLOCK_M)
    pid = tl.program_id(0)
    off_hz = pid // num_m
    start_m = pid % num_m
    if CAUSAL:
        start_m = num_m - 1 - start_m  # causal: the longest rows (last blocks) start first
    off_b = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    q_base = Q + off_b * stride_qb + off_h * stride_qh
    k_base = K + off_b * stride_kb + off_h * stride_kh
    v_base = V + off_b * stride_vb + off_h * stride_vh

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = row_mask(offs_m, N_Q, offs_d, HEAD_DIM, BLOCK_D)
    # Q block: HBM -> on chip once, BLOCK_M * d elements; it stays there for the whole loop.
    if TMA:
        # Descriptors of this head's (N, d) matrices; tiles past the last row are zero-filled.
        q_desc = tl.make_tensor_descriptor(q_base, [N_Q, HEAD_DIM], [stride_qm, 1], [BLOCK_M, BLOCK_D])
        k_src = tl.make_tensor_descriptor(k_base, [N_K, HEAD_DIM], [stride_kn, 1], [BLOCK_N, BLOCK_D])
        v_src = tl.make_tensor_descriptor(v_base, [N_K, HEAD_DIM], [stride_vn, 1], [BLOCK_N, BLOCK_D])
        q = q_desc.load([start_m * BLOCK_M, 0])
    else:
        k_src = k_base
        v_src = v_base
        q = tl.load(
            q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0
        )
    if UPCAST:
        q = q.to(tl.float32)

    # Running state, registers: row max m, row sum l (of exp(S - m)), unnormalised output acc.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC_DTYPE)
    l_i = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC_DTYPE)
    if EXP2:
        qk_scale = sm_scale * LOG2E  # scores go straight into base 2: exp(x * scale) = exp2(x * qk_scale)
    else:
        qk_scale = sm_scale

    n_k_pad = tl.cdiv(N_K, BLOCK_N) * BLOCK_N
    if SKIP_MASKED:
        # Stage 1, unmasked: K/V blocks that every row of this Q block sees entirely.
        # Stage 2, masked: the causal diagonal blocks and the ragged last block; blocks wholly above
        # the diagonal (j > i for every pair) are never loaded.
        hi_full = (N_K // BLOCK_N) * BLOCK_N
        if CAUSAL:
            hi_full = tl.minimum(hi_full, (start_m * BLOCK_M // BLOCK_N) * BLOCK_N)
            hi_masked = tl.minimum((start_m + 1) * BLOCK_M, N_K)
        else:
            hi_masked = N_K
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, 0, hi_full, N_K, qk_scale,
            False, CAUSAL, EXP2, TMA, HEAD_DIM, BLOCK_D, BLOCK_N, UPCAST, DOT_PRECISION, ACC_DTYPE,
        )  # fmt: skip
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, hi_full, hi_masked, N_K, qk_scale,
            True, CAUSAL, EXP2, TMA, HEAD_DIM, BLOCK_D, BLOCK_N, UPCAST, DOT_PRECISION, ACC_DTYPE,
        )  # fmt: skip
    else:
        # The naive loop: every K/V block, every score masked (causal blocks above the diagonal too).
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, 0, n_k_pad, N_K, qk_scale,
            True, CAUSAL, EXP2, TMA, HEAD_DIM, BLOCK_D, BLOCK_N, UPCAST, DOT_PRECISION, ACC_DTYPE,
        )  # fmt: skip

    # Every query row sees key 0, so l_i > 0. O = acc / l: registers -> HBM, BLOCK_M * d elements.
    acc = acc / l_i[:, None]
    o_base = O + off_b * stride_ob + off_h * stride_oh
    o_ptrs = o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=q_mask)
    # L = logsumexp of the scaled scores, natural-log units: BLOCK_M floats to HBM.
    if EXP2:
        lse = (m_i + tl.math.log2(l_i)) * LN2
    else:
        lse = m_i + tl.log(l_i)
    l_ptrs = L + off_b * stride_lb + off_h * stride_lh + offs_m * stride_lm
    tl.store(l_ptrs, lse.to(L.dtype.element_ty), mask=offs_m < N_Q)


# --------------------------------------------------------------------------------------------------
# Launch configurations
# --------------------------------------------------------------------------------------------------
# On the CPU: one config (the interpreter cannot time several); 32 x 32 keeps the Python loop short.
CPU_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
# Fixed defaults on a GPU when a `config` dict names only some launch keys.
GPU_DEFAULT = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
# Hopper candidates (BLOCK_M, BLOCK_N, num_warps, num_stages), kept from a wider sweep on an H200
# (notes/performance.md): 128 x 64 with 8 warps (one warpgroup per 64 query rows) wins most shapes;
# 64 x 64 with 4 warps wins d = 128 at short sequences (two programs share an SM); 128 x 128 wins
# long causal d = 128. 128 x 64 with only 4 warps spills registers at d = 128 (3.5x slower) but is
# close to the best at d = 64.
GPU_FWD_CANDIDATES = [
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (128, 128, 8, 3),
    (64, 64, 4, 3),
    (64, 64, 4, 2),
    (128, 64, 4, 3),
]


def _as_configs(candidates):
    """triton.Config objects from (BLOCK_M, BLOCK_N, num_warps, num_stages) tuples."""
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in candidates
    ]


def make_prune(small, wide, huge):
    """An autotune pruner: the full candidate list only where speed is measured (fp16/bf16, d <= 128,
    sequences of 1024 or more); elsewhere one config, so the tuner compiles and times only that one.

    small: short sequences (N_BUCKET < 1024); wide: fp32 inputs (exact "ieee" products, no 16-bit
    tensor-core tiles, so small tiles); huge: d > 128 (BLOCK_D = 256: small tiles fit on chip)."""

    def prune(configs, named_args, **kwargs):
        if named_args["Q"].element_size() >= 4:
            return _as_configs([wide])
        if kwargs["BLOCK_D"] > 128:
            return _as_configs([huge])
        if named_args["N_BUCKET"] < 1024:
            return _as_configs([small])
        return configs

    return prune


def _tuner(kernel, candidates, key, small, wide, huge, cpu, **kwargs):
    """`runtime.autotune` over `candidates` on a GPU (pruned by `make_prune`); on the CPU the single
    config `cpu` (the interpreter cannot time configs)."""
    if runtime.INTERPRET:
        return runtime.autotune(_as_configs([cpu]), key=key, **kwargs)(kernel)
    return runtime.autotune(
        _as_configs(candidates),
        key=key,
        prune_configs_by={"early_config_prune": make_prune(small, wide, huge)},
        do_bench=lambda fn, quantiles: triton.testing.do_bench(fn, warmup=10, rep=40, quantiles=quantiles),
        **kwargs,
    )(kernel)


_fwd_tuned = _tuner(
    _fwd_kernel,
    GPU_FWD_CANDIDATES,
    key=["N_BUCKET", "HEAD_DIM", "CAUSAL", "EXP2", "SKIP_MASKED", "TMA"],
    small=(64, 64, 4, 2),
    wide=(64, 32, 4, 2),
    huge=(64, 32, 4, 2),
    cpu=(CPU_CONFIG["BLOCK_M"], CPU_CONFIG["BLOCK_N"], 4, 1),
)


# --------------------------------------------------------------------------------------------------
# Python entry point
# --------------------------------------------------------------------------------------------------
def forward(q, k, v, causal: bool = False, scale: float | None = None, config: dict | None = None):
    """FlashAttention-2 forward: O = softmax(Q K^T * scale [+ causal mask]) V, and L = logsumexp.

    q: (Z, Nq, d), k and v: (Z, Nk, d) — any strides (the kernel reads them), float16, bfloat16 or
    float32 (float64 under the interpreter only); any number of leading dims also works. Returns
    O with q's shape and dtype (contiguous) and L of shape (Z, Nq), natural-log units, float32
    (float64 for float64 inputs). causal: query i sees keys j <= i (top-left aligned, Nq != Nk allowed).

    config (dict, optional; notebook 08's optimisation ladder):
      BLOCK_M, BLOCK_N   query rows per program, key rows per loop step (powers of two >= 16)
      num_warps, num_stages   warps per program, software-pipelining depth of the K/V loads
      exp2 (bool, default True)   False: tl.exp on scores multiplied by the scale separately
      skip_masked_blocks (bool, default True)   False: every K/V block is loaded and masked, as a
          naive kernel would; True: causal blocks above the diagonal are skipped and only the
          diagonal (and ragged last) blocks pay for masking.
      tma (bool, default False)   True: on a Hopper GPU, fetch tiles with TMA descriptors when the
          layout allows it (`use_tma`); False: pointer arithmetic and masked loads. Measured on an
          H200 (notes/performance.md), TMA loads were no faster overall, so they are opt-in.
      hopper (bool, default True)   on a Hopper GPU, with the tuned launch and the other switches at
          their defaults, run FlashAttention-3's warp-specialised Gluon kernel (`hopper.py`) for
          contiguous 16-bit inputs with d in {64, 128} where it is faster; False: always Triton.
    Giving any of the four launch keys fixes the launch (the others take defaults); config=None (or
    only switches) uses the tuned defaults: autotuned on a GPU, one fixed config on the CPU."""
    check_inputs(q, k, v, where="attention.forward")
    scale = default_scale(q.shape[-1], scale)
    launch, switches = split_config(config, CPU_CONFIG if runtime.INTERPRET else GPU_DEFAULT)
    return _forward(q, k, v, bool(causal), scale, launch, switches)


def _forward(q, k, v, causal, scale, launch, switches):
    """Launch the forward kernel on validated inputs (no checks here)."""
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse_dtype = accumulator_dtype(q.dtype)
    lse = torch.empty(q.shape[:-1], dtype=lse_dtype, device=q.device)
    q4, k4, v4, o4 = as_4d(q), as_4d(k), as_4d(v), as_4d(o)
    l3 = lse.view(q4.shape[:-1])
    B, H, n_q, d = q4.shape
    n_k = k4.shape[2]
    args = (
        q4, k4, v4, o4, l3, scale,
        *strides4(q4), *strides4(k4), *strides4(v4), *strides4(o4), *l3.stride(),
        H, n_q, n_k, n_bucket(max(n_q, n_k)),
    )  # fmt: skip
    tma = switches["TMA"] and use_tma(q4, k4, v4)
    meta = dict(
        CAUSAL=causal,
        HEAD_DIM=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        EXP2=switches["EXP2"],
        SKIP_MASKED=switches["SKIP_MASKED"],
        TMA=tma,
        **kernel_flags(q.dtype),
    )
    if tma:
        triton.set_allocator(_tma_scratch)  # descriptors built on the GPU need a little scratch memory
    with cuda_device(q):
        if launch is None and _try_hopper(q4, k4, v4, o4, l3, causal, scale, switches):
            return o, lse
        if launch is None:
            grid = lambda META: (triton.cdiv(n_q, META["BLOCK_M"]) * B * H,)
            key = (args[-1], d, causal, tma, q.dtype, switches["EXP2"], switches["SKIP_MASKED"])
            launch_tuned(_fwd_tuned, grid, args, meta, key)
        else:
            grid = (triton.cdiv(n_q, launch["BLOCK_M"]) * B * H,)
            _fwd_kernel[grid](
                *args, **meta, BLOCK_M=launch["BLOCK_M"], BLOCK_N=launch["BLOCK_N"],
                num_warps=launch["num_warps"], num_stages=launch["num_stages"],
            )  # fmt: skip
    return o, lse
