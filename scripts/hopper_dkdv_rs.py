"""Prototype: the Gluon dK/dV kernel in FlashAttention-3's own d = 128 layout, transposed tiles with P^T and dS^T fed
to the products from registers (`course_lib/attention/hopper_backward.py` stores P and dS to shared memory and reads
them back; notes/attention.md, "Open").

    python3 scripts/hopper_dkdv_rs.py --compile-only        # any machine: ptxas's spills for sm_90a, no GPU
    python3 scripts/hopper_dkdv_rs.py [--stages 2]          # a Hopper GPU: against hopper_backward.dkdv

Per consumer warpgroup (64 keys of the program's 128) and query block of 64 rows:

    S^T  = K_w Q^T,  dP^T = V_w dO^T        (64 keys x 64 queries, fp32; A from shared memory)
    P^T  = exp2(S^T scale log2 e - L2[q]),  masked on the causal diagonal
    dV  += P^T dO                            (A = P^T in registers, 16 bits)
    dS^T = P^T (dP^T - D[q])
    dK  += dS^T Q                            (A = dS^T in registers)

L and D are per query, the tiles' columns: loaded for each step where they are used (16 values a thread, not
held across the loop). Nothing of P or dS goes through shared memory, which holds only the Q / dO ring and K, V
(128 KB at d = 128 with 2 stages, against `hopper_backward`'s 160). The producer, the program's block and its
steps (GQA, both causal alignments) are `hopper_backward`'s.

Status (2026-11-30): written and compiled for sm_90a on a machine without a GPU (`--compile-only`, Triton 3.7);
not yet run on one. ptxas there: d = 128 non-causal 140 bytes of spill stores, and its wgmmas serialised (C7515:
an accumulator register written by another instruction mid-pipeline), causal 76 bytes; d = 64 no spills,
non-causal serialised too (`hopper_backward`'s kernel: 8 / 20 bytes, never serialised). The serialisation is the
spills': in the SASS a spilled value is reloaded (LDL) into R152, dP^T's accumulator, between two of its wgmmas.
What crowds the registers is the per-column vectors: the step's query indices (16 values a thread), L's and D's
64-bit addresses (32) and their masks, beside L and D (16 each). Moving the loads after the wait for S^T, or giving
dP^T a zero tile of its own, changed nothing. FlashAttention-3 has its producer bring L and D into shared memory
for each query block; here the D pass could write L (prescaled, +inf past N_Q, rows padded to 64) beside D, for
the producer's TMA to load with Q and dO. Then the first GPU run, whose check against `hopper_backward.dkdv` comes
before its times.
"""

from __future__ import annotations

import argparse

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from course_lib.attention.hopper import LOG2E, descriptor, launch_options
from course_lib.attention.hopper_backward import (
    KEY_ROWS,
    KROWS,
    QROWS,
    QUERY_ROWS,
    _block,
    _producer,
    _row_stats,
    _step,
    _store_dkdv,
)
from course_lib.runtime import cdiv

NUM_CONSUMERS = 2


@gluon.jit
def _consumer(args, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
              NUM_CONSUMERS: gl.constexpr, WG: gl.constexpr):  # fmt: skip
    """Warpgroup WG: dK, dV of keys n_start + 64 WG ... + 63, from transposed tiles (module docstring)."""
    (q_smem, do_smem, k_smem, v_smem, kv_bar, ready_bar, empty_bar,
     L, Dlt, DK, DV, qk_scale, sm_scale, stride_lb, stride_lh, stride_lm,
     stride_kb, stride_kh, stride_kn, H, GROUP, N_Q, N_K, OFFSET, num_n, BHKV) = args  # fmt: skip
    dtype: gl.constexpr = q_smem.dtype
    CTA_N: gl.constexpr = KROWS * NUM_CONSUMERS
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, QROWS, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    bhk, n_start, lo, mid, n_m, first_head = _block(num_n, BHKV, H, GROUP, N_Q, OFFSET, CAUSAL, CTA_N)
    k_w = k_smem.index(WG)
    v_w = v_smem.index(WG)
    st_zero = gl.zeros([KROWS, QROWS], gl.float32, layout=st_layout)
    dk = gl.zeros([KROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([KROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    keys = n_start + WG * KROWS + gl.arange(0, KROWS, layout=gl.SliceLayout(1, st_layout))  # the tiles' rows
    offs_q = gl.arange(0, QROWS, layout=gl.SliceLayout(0, st_layout))  # their columns, from the block's first
    mbarrier.wait(kv_bar, 0)
    dk_tok = warpgroup_mma_init(dk)
    dv_tok = warpgroup_mma_init(dv)
    for step in range(GROUP * n_m):
        g, m_blk = _step(step, lo, n_m, GROUP, CAUSAL)
        head = first_head + g
        slot = step % NUM_STAGES
        mbarrier.wait(ready_bar.index(slot), (step // NUM_STAGES) & 1)
        q = q_smem.index(slot)
        do = do_smem.index(slot)
        st_tok = warpgroup_mma(k_w, q.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        dpt_tok = warpgroup_mma(v_w, do.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        rows = m_blk * QROWS + offs_q  # the step's queries
        lse2, delta = _row_stats(L, Dlt, head, rows, H, N_Q, stride_lb, stride_lh, stride_lm)
        # S^T done means the previous step's dV and dK are too (in issue order): its ring slot is free
        st, dk, dv = warpgroup_mma_wait(1, deps=[st_tok, dk_tok, dv_tok])
        if step > 0:
            mbarrier.arrive(empty_bar.index((step - 1) % NUM_STAGES), count=1)
        if CAUSAL:
            if m_blk < mid:  # key j (a row) is visible to query i (a column) when i + OFFSET >= j
                visible = gl.expand_dims(rows + OFFSET, 0) >= gl.expand_dims(keys, 1)
                st = gl.where(visible, st, float("-inf"))
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
        dv_tok = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), do, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=[dpt_tok])
        dst = pt * (dpt - gl.expand_dims(delta, 0))
        dk_tok = warpgroup_mma(gl.convert_layout(dst.to(dtype), op_layout), q, dk, is_async=True)
    dk, dv = warpgroup_mma_wait(0, deps=[dk_tok, dv_tok])
    _store_dkdv(
        dk, dv, DK, DV, sm_scale, n_start + WG * KROWS, bhk, H // GROUP, N_K, stride_kb, stride_kh, stride_kn
    )


@gluon.jit
def dkdv_rs_kernel(
    q_desc, do_desc, k_desc, v_desc, L, Dlt, DK, DV, qk_scale, sm_scale,
    stride_lb, stride_lh, stride_lm, stride_kb, stride_kh, stride_kn,
    H, GROUP, SHARE, N_Q, N_K, OFFSET, BHKV,
    CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):  # fmt: skip
    """`hopper_backward.dkdv_ws_kernel`'s arguments and grid; shared memory without P and dS tiles."""
    CTA_N: gl.constexpr = KROWS * NUM_CONSUMERS
    num_n = gl.cdiv(N_K, CTA_N)
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, QROWS, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, QROWS, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, KROWS, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, KROWS, HEAD_DIM], v_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready_bar = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty_bar = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready_bar.index(i), count=1)
        mbarrier.init(empty_bar.index(i), count=NUM_CONSUMERS)
    fence_async_shared()
    shared = (q_smem, do_smem, k_smem, v_smem, kv_bar, ready_bar, empty_bar,
              L, Dlt, DK, DV, qk_scale, sm_scale, stride_lb, stride_lh, stride_lm,
              stride_kb, stride_kh, stride_kn, H, GROUP, N_Q, N_K, OFFSET, num_n, BHKV)  # fmt: skip
    loads = (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, ready_bar, empty_bar,
             H, GROUP, SHARE, N_Q, N_K, OFFSET, num_n, BHKV)  # fmt: skip
    gl.warp_specialize(
        [
            (_consumer, (shared, CAUSAL, HEAD_DIM, NUM_STAGES, NUM_CONSUMERS, 0)),
            (_consumer, (shared, CAUSAL, HEAD_DIM, NUM_STAGES, NUM_CONSUMERS, 1)),
            (_producer, (loads, CAUSAL, NUM_STAGES, NUM_CONSUMERS)),
        ],
        [4, 1], [CONSUMER_REGS, 24],
    )  # fmt: skip


def dkdv_rs(
    q4, k4, v4, do4, l3, delta, dk4, dv4, offset: int, causal: bool, scale: float, stages: int = 2, grid=None
):
    """`hopper_backward.dkdv`'s contract (dk4, dv4 in K's dtype, one slice per K/V head), with this kernel.
    grid=(1,) compiles without launching (`--compile-only`); returns the kernel's compiled binary then."""
    B, H, n_q, d = q4.shape
    h_kv, n_k = k4.shape[1], k4.shape[2]
    args = (
        descriptor(q4, QUERY_ROWS), descriptor(do4, QUERY_ROWS), descriptor(k4, KEY_ROWS), descriptor(v4, KEY_ROWS),
        l3, delta, dk4, dv4, scale * LOG2E, scale,
        l3.stride(0), l3.stride(1), l3.stride(2), dk4.stride(0), dk4.stride(1), dk4.stride(2),
        H, H // h_kv, 1, n_q, n_k, offset, B * h_kv,
    )  # fmt: skip
    meta = dict(CAUSAL=causal, HEAD_DIM=d, NUM_STAGES=stages, NUM_CONSUMERS=NUM_CONSUMERS,
                **launch_options(NUM_CONSUMERS))  # fmt: skip
    if grid is not None:
        return dkdv_rs_kernel.warmup(*args, grid=grid, **meta)
    dkdv_rs_kernel[(cdiv(n_k, KEY_ROWS * NUM_CONSUMERS) * B * h_kv,)](*args, **meta)
    return None


def rs_call(stages: int):
    """`dkdv_rs` with `hopper_backward.dkdv`'s arguments."""
    return lambda *args: dkdv_rs(*args, stages=stages)


def compile_only(stages: int) -> None:
    import gluon_spills  # scripts/: the sm_90a target on any machine

    gluon_spills.use_sm90_target()
    for d in (128, 64):
        B, H, n = 1, 2, 1024
        q, k, v, do = (torch.randn(B, H, n, d).to(torch.bfloat16) for _ in range(4))
        lse, delta = torch.zeros(B, H, n), torch.zeros(B * H, n)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        for causal in (False, True):
            binary = dkdv_rs(q, k, v, do, lse, delta, dk, dv, 0, causal, d**-0.5, stages, grid=(1,))
            print(f"d = {d}, causal {causal}, {stages} stages: {gluon_spills.ptxas_spills(binary)}")


def check_and_time(stages: int) -> None:
    from course_lib.attention import backward as bwd
    from course_lib.attention import forward as fwd
    from course_lib.attention import hopper_backward as hb
    from course_lib.kernels import bound
    from course_lib.perf.timing import benchmark

    for d in (128, 64):
        for n, causal in (
            (1000, False),
            (1000, True),
            (4096, False),
            (4096, True),
            (16384, False),
            (16384, True),
        ):
            B, H = max(16384 // n, 1), 2048 // d
            q, k, v, do = (torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            o, lse = fwd.forward(q, k, v, causal=causal)
            delta = torch.empty(B * H, n, dtype=torch.float32, device="cuda")
            grid, args, meta = bwd.preprocess_launch(o, do, delta, B, H, n, d, q.dtype)
            bound.launch(bwd._preprocess_kernel, grid, *args, **meta)
            ref_k, ref_v, dk, dv = (torch.empty_like(k) for _ in range(4))
            hb.dkdv(q, k, v, do, lse, delta, ref_k, ref_v, 0, causal, d**-0.5)
            dkdv_rs(q, k, v, do, lse, delta, dk, dv, 0, causal, d**-0.5, stages)
            diff = max(
                (dk.float() - ref_k.float()).abs().max().item(),
                (dv.float() - ref_v.float()).abs().max().item(),
            )
            flops = 2 * 4 * B * H * n * n * d * (0.5 if causal else 1.0)  # the kernel's 4 products
            t_ref, t_rs = (
                benchmark(lambda f=f, out=out: f(q, k, v, do, lse, delta, *out, 0, causal, d**-0.5))  # noqa: B023
                for f, out in ((hb.dkdv, (ref_k, ref_v)), (rs_call(stages), (dk, dv)))
            )
            print(
                f"d = {d}, N = {n}, causal {causal}: max diff from hopper_backward {diff:.2e}; TFLOP/s "
                f"{flops / t_ref / 1e9:.0f} (hopper_backward) / {flops / t_rs / 1e9:.0f} (this)",
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--stages", type=int, default=2)
    a = p.parse_args()
    if a.compile_only:
        compile_only(a.stages)
    else:
        check_and_time(a.stages)


if __name__ == "__main__":
    main()
