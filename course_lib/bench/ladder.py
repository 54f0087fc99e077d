"""The optimisation ladder: from notebook 06/07's straightforward kernels to course_lib's tuned ones, one
change per rung, each with the gain predicted from bytes and FLOPs before it is measured.

Taught in notebook 08 (measured by `make bench`). Every rung runs course_lib's production kernels
through `config=`; the first rungs' `exp2=False` and `skip_masked_blocks=False` swap in the teaching
variants of `course_lib/attention/teaching.py` (natural exponentials; every block visited and masked),
which the kernels take as function arguments, so a rung differs from the next by that piece alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from .. import runtime
from ..perf import timing
from .measure import make_timer, timer_name
from .shapes import MODEL_DIM, TOKENS


@dataclass(frozen=True)
class Step:
    """One rung: the kernel configuration it measures, and the gain over the rung below predicted from
    bytes and FLOPs before measuring (at the ladder's shape: d = 128, N = 4096, causal, bf16)."""

    name: str
    pass_: str  # "fwd" (forward.forward) or "bwd" (backward.backward)
    config: dict | None  # None = course_lib's tuned default (autotuned on a GPU)
    predicted: float
    reason: str
    dq_mode: str = "two_kernel"


FWD0 = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1, exp2=False, skip_masked_blocks=False)
FWD1 = dict(FWD0, exp2=True)
FWD2 = dict(FWD1, skip_masked_blocks=True)
FWD3 = dict(FWD2, BLOCK_M=128, num_warps=8)
FWD4 = dict(FWD3, num_stages=3)
# The backward's BLOCK_M, BLOCK_N apply to both kernels; BLOCK_M1/BLOCK_N1 (dK/dV kernel: BLOCK_N1 key
# rows stay on chip) and BLOCK_M2/BLOCK_N2 (dQ kernel: BLOCK_M2 query rows stay on chip) override them.
BWD0 = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1, exp2=False, skip_masked_blocks=False)
BWD1 = dict(BWD0, exp2=True)
BWD2 = dict(BWD1, skip_masked_blocks=True)
BWD3 = dict(BWD2, BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64, num_warps=8)
BWD4 = dict(BWD3, num_stages=3)

# Each rung: (name, pass, config, predicted gain over the rung below, why, from bytes and FLOPs).
# The shape: d = 128, N = 4096, causal, bf16, B*H = 64; with 64 x 64 tiles, 64 x 64 = 4096 tiles per head.
# fmt: off
LADDER = (
    Step("straightforward forward (nb 06)", "fwd", FWD0, 1.0,
         "the start: natural exp, every tile computed and masked, 64x64 tiles, no software pipelining"),
    Step("base-2 exponentials", "fwd", FWD1, 1.06,
         "exp(x) = ex2(x log2 e): log2 e folds into the scale, 1 of ~6 FP32 ops per score (~1/3 of time)"),
    Step("skip fully masked tiles", "fwd", FWD2, 1.9,
         "causal: only 2080 of 4096 tiles reach the diagonal: 1.97x fewer, less the diagonal's masking"),
    Step("BLOCK_M 128 on 8 warps", "fwd", FWD3, 1.3,
         "a K/V tile serves 128 queries: 128 FLOP per K/V byte instead of 64 (under the H200's measured ridge, "
         "~160); 8 warps keep the 128 x d fp32 accumulator in registers (4 warps would spill it)"),
    Step("3 pipeline stages", "fwd", FWD4, 1.25,
         "the next K/V tile loads while the tensor cores work on this one: hides ~20% of load waits"),
    Step("autotuned (Triton)", "fwd", {"hopper": False}, 1.05,
         "the best of several configs for this shape; the hand-picked one is already close"),
    Step("warp-specialised (Gluon, Hopper; course_lib)", "fwd", None, 1.2,
         "a producer warp loads, two consumer warpgroups take turns on the tensor cores: the softmax "
         "(~1/3 of a step at d = 128) overlaps products instead of following them; less barriers, short tiles"),
    Step("straightforward backward (nb 07)", "bwd", BWD0, 1.0,
         "the start: two kernels (dQ with D, then dK, dV), natural exp, every tile, 64x64, no pipelining"),
    Step("base-2 exponentials", "bwd", BWD1, 1.03,
         "P = exp(S - L) once per tile against 2.5x the forward's matmuls: a smaller share than there"),
    Step("skip fully masked tiles", "bwd", BWD2, 1.9,
         "causal: about half of the tiles are fully masked, in both kernels"),
    Step("tall resident blocks, 8 warps", "bwd", BWD3, 1.3,
         "128 resident rows (K, V in dK/dV; Q, dO in dQ) halve the re-reads of the streamed operands; "
         "8 warps hold their fp32 accumulators without spilling"),
    Step("3 pipeline stages", "bwd", BWD4, 1.2,
         "the next streamed tile loads during this one's 4 (dK/dV) or 3 (dQ) matmuls"),
    Step("autotuned (Triton)", "bwd", {"hopper": False}, 1.05,
         "the best of several configs for this shape"),
    Step("dK/dV without spills (Gluon, Hopper)", "bwd", {"hopper_dq": False, "hopper_onepass": False}, 1.1,
         "the Triton dK/dV kernel needs ~256 registers per thread (transposed tiles, L and D per column, "
         "16-bit operands in registers) and spills; the Gluon kernel's layout needs ~196 (untransposed "
         "tiles, P and dS through shared memory): dK/dV ~1.2x, about 60 % of the backward (dQ unchanged)"),
    Step("warp-specialised dQ (Gluon, Hopper)", "bwd", {"hopper_onepass": False}, 1.1,
         "dQ is ~40 % of the backward now; a producer warp streams K, V while two warpgroups keep S, dP "
         "and dQ's products in flight behind the softmax: dQ ~1.3x (the probe's 1.2-1.4x), less a pass "
         "for D over O and dO (~2 %): ~1.1x"),
    Step("one pass (Gluon, Hopper; course_lib)", "bwd", None, 1.2,
         "5 tile products, not 7 (S and dP made once, for dK, dV and dQ alike): 1.4x where the products set "
         "the pace, less dQ's float32 adds by TMA (a 64 x 128 tile per step and program) and each warpgroup "
         "waiting for the other's dS before dQ's product: ~1.2x"),
    Step("one pass, atomic dQ", "bwd", {"hopper": False}, 0.9,
         "over the Triton two-kernel backward: 5 tile matmuls, not 7 (S, dP not recomputed for dQ): 1.4x, "
         "less fp32 atomic adds to dQ, ~1.2x; the Gluon one pass below is ~1.3x faster than that one: ~0.9x",
         dq_mode="atomic"),
)
# fmt: on


def ladder(quick: bool = False, N: int = 4096, d: int = 128, causal: bool = True, steps=LADDER) -> dict:
    """Measure each step of the optimisation ladder (forward steps through `forward.forward`, backward
    steps through `backward.backward`, with their `config=` switches) on one shape: B·N = 16384
    tokens, H·d = 2048, bf16 on a GPU (tiny fp32 on the CPU, where the timings mean nothing).

    Returns the ladder record's data: the shape, and per step its configuration, predicted gain,
    measured time, TFLOP/s (backward: 2.5x the forward FLOPs), measured gain over the previous step
    of the same pass, and the largest difference of its output from the tuned kernel's."""
    from ..attention import backward, forward

    if runtime.ON_GPU:
        B, H, dtype = TOKENS // N, MODEL_DIM // d, torch.bfloat16
    else:
        B, H, N, d, dtype = 1, 2, 64, 32, torch.float32
    Z, scale, timer = B * H, d**-0.5, make_timer(quick)
    q3, k3, v3, do3 = (torch.randn(Z, N, d, device=runtime.DEVICE, dtype=dtype) for _ in range(4))
    o3, L3 = forward.forward(q3, k3, v3, causal, scale)
    tuned_grads = backward.backward(do3, q3, k3, v3, o3, L3, causal, scale)
    out, previous = [], {}
    for step in tqdm(steps, desc="ladder", unit="step"):
        entry = dict(
            name=step.name,
            pass_=step.pass_,
            config=step.config,
            dq_mode=step.dq_mode,
            predicted_gain=step.predicted,
            reason=step.reason,
        )
        if step.pass_ == "fwd":
            fn = lambda s=step: forward.forward(q3, k3, v3, causal, scale, config=s.config)
            want = (o3,)
        else:
            fn = lambda s=step: backward.backward(
                do3, q3, k3, v3, o3, L3, causal, scale, config=s.config, dq_mode=s.dq_mode
            )
            want = tuned_grads
        try:
            got = fn()  # warm-up (compilation) and the output to compare
            got = got[:1] if step.pass_ == "fwd" else got
            entry["max_abs_diff_vs_tuned"] = max(
                float((a.float() - b.float()).abs().max()) for a, b in zip(got, want)
            )
            entry["ms"] = timer(fn)
        except Exception as exc:
            entry.update(status="error", reason_failed=f"{type(exc).__name__}: {str(exc)[:200]}")
            out.append(entry)
            continue
        flops = timing.attention_flops(B, H, N, N, d, causal=causal, mode=step.pass_)
        entry.update(status="ok", tflops=flops / (entry["ms"] * 1e-3) / 1e12)
        prev = previous.get(step.pass_)
        entry["measured_gain"] = None if prev is None else prev / entry["ms"]
        previous[step.pass_] = entry["ms"]
        out.append(entry)
    return dict(
        B=B,
        H=H,
        N=N,
        d=d,
        causal=causal,
        dtype=str(dtype).replace("torch.", ""),
        timer=timer_name(quick),
        steps=out,
    )
