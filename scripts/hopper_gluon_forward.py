"""An experiment: FlashAttention-3's intra-warpgroup overlap in Gluon, on a Hopper GPU (H100, H200).

    COURSE_DEVICE=cuda python3 scripts/hopper_gluon_forward.py [--ns 1024,4096,16384]

notes/attention.md ("Tried and rejected") says why it exists and what it measured: the course_lib forward
(`course_lib/attention/forward.py`) runs each K/V step's three stages one after the other
(S = Q K^T on the tensor cores, the softmax on the ordinary cores, O += P V on the tensor cores).
Gluon, Triton's lower-level dialect, lets a kernel schedule them itself:

* K and V tiles arrive by TMA (the tensor memory accelerator) in a ring of NUM_STAGES shared-memory
  slots, each with an mbarrier that the copy engine signals when the tile has landed.
* `warpgroup_mma(..., is_async=True)` starts a product and returns; `warpgroup_mma_wait(n, deps)`
  waits until at most n are still running. Step j starts S_j = Q K_j^T and O += P_{j-1} V_{j-1},
  waits for S_j only, and computes the softmax of S_j while the tensor cores still work on
  P_{j-1} V_{j-1} (FlashAttention-3, Shah et al. 2024, section 3.2).

It is correct (the script checks it against a float32 reference on ragged, causal and Nq != Nk
shapes before timing) but, as measured, no faster overall than the Triton kernel. The step that
made the difference, warp specialisation, is in course_lib (`course_lib/attention/hopper.py`,
which this script borrows its softmax step, its epilogue and its TMA descriptors from:
`hopper.softmax_step`, `hopper.store_o_l`, `hopper.descriptor`).

Inputs: q (B, H, Nq, d), k, v (B, H, Nk, d), contiguous, bf16 or fp16, d in {64, 128}; BLOCK_M
query rows per program, one warpgroup (4 warps) per 64 rows.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("COURSE_DEVICE", "cuda")

import torch  # noqa: E402
import torch.nn.functional as Fn  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from course_lib.attention import attention_forward, reference  # noqa: E402
from course_lib.attention.hopper import LOG2E, descriptor, softmax_step, store_o_l  # noqa: E402
from course_lib.bench import summarise  # noqa: E402
from course_lib.perf.timing import attention_flops  # noqa: E402

# (BLOCK_M, BLOCK_N, NUM_STAGES) tried per head dim; the first is the best measured on an H200.
# Shared memory per program: (BLOCK_M + 2 * NUM_STAGES * BLOCK_N) * d * 2 bytes; at most ~113 KB
# lets two programs share an SM, which is what made BLOCK_M = 64 win.
TILES = {
    128: [(64, 64, 3), (128, 64, 4), (64, 64, 4), (64, 128, 2)],
    64: [(64, 128, 3), (128, 64, 4), (128, 64, 6), (64, 64, 4)],
}


@gluon.jit
def _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, kv_row, block, n_blocks,
              BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):  # fmt: skip
    """Start the TMA copies of K and V block `block` into ring slot block % NUM_STAGES (if the
    block exists); each slot's mbarrier fires when its tile has arrived."""
    slot = block % NUM_STAGES
    pred = block < n_blocks
    row = kv_row + block * BLOCK_N
    mbarrier.expect(k_bar.index(slot), k_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [row, 0], k_bar.index(slot), k_smem.index(slot), pred=pred)
    mbarrier.expect(v_bar.index(slot), v_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(v_desc, [row, 0], v_bar.index(slot), v_smem.index(slot), pred=pred)


@gluon.jit
def _fwd_hopper_kernel(
    q_desc, k_desc, v_desc, O, L, qk_scale,
    stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
    H, N_Q, N_K,
    CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):  # fmt: skip
    """O and L for BLOCK_M query rows of one (batch, head). Grid: (cdiv(N_Q, BLOCK_M) * B * H,).

    q_desc, k_desc, v_desc: TMA descriptors of the (B*H*N, d) matrices, blocks (BLOCK_M, d) and
    (BLOCK_N, d). A K/V block may run past this head's last key into the next head's rows (or
    past the end of the tensor, where TMA fills zeros): those columns are masked to -inf.
    qk_scale = softmax scale * log2(e)."""
    dtype: gl.constexpr = q_desc.dtype
    # Register layouts of the two products' results: wgmma tiles of 16 rows x N columns per
    # warp, warps stacked along the rows (warps 0-3 = first warpgroup = rows 0-63).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[BLOCK_M // 16, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[BLOCK_M // 16, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    num_m = gl.cdiv(N_Q, BLOCK_M)
    pid = gl.program_id(0)
    off_hz = pid // num_m
    start_m = pid % num_m
    if CAUSAL:
        start_m = num_m - 1 - start_m  # the longest rows start first
    q_row = off_hz * N_Q + start_m * BLOCK_M
    kv_row = off_hz * N_K

    # K/V blocks this program visits; blocks from first_masked on need the mask.
    n_blocks = gl.cdiv(N_K, BLOCK_N)
    first_masked = N_K // BLOCK_N
    if CAUSAL:
        n_blocks = gl.minimum(n_blocks, gl.cdiv((start_m + 1) * BLOCK_M, BLOCK_N))
        first_masked = gl.minimum(first_masked, (start_m * BLOCK_M) // BLOCK_N)

    # Shared memory: Q (BLOCK_M, d) once; K and V rings (NUM_STAGES, BLOCK_N, d); mbarriers.
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
    fence_async_shared()

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    for i in gl.static_range(NUM_STAGES):
        _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, kv_row, i, n_blocks, BLOCK_N, NUM_STAGES)

    rows = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=col_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    # Block 0: S_0 = Q K_0^T, its softmax; P_0 waits in registers (as the A operand of the next
    # product, bf16/fp16) for V_0.
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bar.index(0), 0)
    s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s_tok])
    p_op, m_i, l_i, alpha = softmax_step(
        s, m_i, l_i, offs_n, rows, N_K, qk_scale, first_masked == 0, CAUSAL, dtype, p_layout, 0
    )

    for j in range(1, n_blocks):
        slot = j % NUM_STAGES
        prev = (j - 1) % NUM_STAGES
        # Issue S_j = Q K_j^T and O += P_{j-1} V_{j-1}; both run on the tensor cores.
        mbarrier.wait(k_bar.index(slot), (j // NUM_STAGES) & 1)
        s_tok = warpgroup_mma(
            q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True
        )
        mbarrier.wait(v_bar.index(prev), ((j - 1) // NUM_STAGES) & 1)
        acc_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        # Wait for S_j only (the older of the two); the softmax below overlaps P_{j-1} V_{j-1}.
        s = warpgroup_mma_wait(1, deps=[s_tok])
        p_next, m_i, l_i, alpha = softmax_step(
            s, m_i, l_i, j * BLOCK_N + offs_n, rows, N_K, qk_scale, j >= first_masked, CAUSAL, dtype,
            p_layout, 0,
        )  # fmt: skip
        # Passing p_next through the wait makes the softmax finish before it: without that
        # dependency the assembler may schedule the exponentials after the wait, and nothing
        # overlaps. p_op: the registers the running product still reads.
        acc, p_op, p_next = warpgroup_mma_wait(0, deps=[acc_tok, p_op, p_next])
        p_op = p_next
        # Slot prev is free once every warp of the program is past this point: refill it.
        gl.thread_barrier()
        _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, kv_row, j - 1 + NUM_STAGES, n_blocks,
                  BLOCK_N, NUM_STAGES)  # fmt: skip
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)

    # Last block: O += P_last V_last.
    last = n_blocks - 1
    mbarrier.wait(v_bar.index(last % NUM_STAGES), (last // NUM_STAGES) & 1)
    acc_tok = warpgroup_mma(p_op, v_smem.index(last % NUM_STAGES), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc_tok])

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))

    store_o_l(
        acc, m_i, l_i, rows, start_m * BLOCK_M, O, L, off_hz, H, N_Q,
        stride_ob, stride_oh, stride_om, stride_lb, stride_lh, BLOCK_M, HEAD_DIM, dtype, o_layout,
    )  # fmt: skip


def attention(q, k, v, causal: bool, tiles):
    """(O, L) for contiguous q (B, H, Nq, d), k, v (B, H, Nk, d); tiles = (BLOCK_M, BLOCK_N, NUM_STAGES)."""
    B, H, n_q, d = q.shape
    n_k = k.shape[2]
    block_m, block_n, stages = tiles
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(n_q, block_m) * B * H,)
    _fwd_hopper_kernel[grid](
        descriptor(q, block_m), descriptor(k, block_n), descriptor(v, block_n),
        o, lse, d**-0.5 * LOG2E,
        o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
        H, n_q, n_k,
        CAUSAL=causal, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=stages,
        num_warps=block_m // 16,
    )  # fmt: skip
    return o, lse


def check(variants, attention_fn=attention, kv_heads=(3,)) -> list[str]:
    """Every variant of attention_fn(q, k, v, causal, variant) against a float32 reference (O and L)
    on ragged, causal and Nq != Nk shapes, bf16 and fp16, q with 3 heads and k, v with each of
    `kv_heads` heads (1: multi-query attention; this script's kernel needs 3); returns what failed."""
    bad = []
    for d in (64, 128):
        for causal in (False, True):
            for nq, nk in [(1000, 1531), (1024, 1024), (77, 300), (300, 77), (4096, 4096), (130, 130)]:
                for dt, h_kv in ((dt, h_kv) for dt in (torch.bfloat16, torch.float16) for h_kv in kv_heads):
                    q = torch.randn(2, 3, nq, d, device="cuda", dtype=dt)
                    k, v = (torch.randn(2, h_kv, nk, d, device="cuda", dtype=dt) for _ in range(2))
                    ref, ref_l = reference.attention(q.float(), k.float(), v.float(), causal, return_lse=True)
                    for variant in variants[d]:
                        o, lse = attention_fn(q, k, v, causal, variant)
                        eo, el = float((o.float() - ref).abs().max()), float((lse - ref_l).abs().max())
                        if not (eo < 2e-2 and el < 1e-3):
                            bad.append(
                                f"d={d} causal={causal} {nq}x{nk} Hkv={h_kv} {dt} {variant}: "
                                f"O {eo:.3g} L {el:.3g}"
                            )
    return bad


def sweep(variants, attention_fn, ns) -> list[tuple]:
    """Time SDPA's default backend, the Triton forward (`attention_forward` with
    config={"hopper": False}) and every variant of attention_fn on the standard shapes (bf16,
    B*N = 16k, H*d = 2048), all in one run; print each cell and return rows
    (d, causal, N, SDPA TFLOP/s, Triton TFLOP/s, {variant: TFLOP/s})."""
    bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")  # noqa: E731
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            for n in ns:
                b, h = 16384 // n, 2048 // d
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = attention_flops(b, h, n, n, d, causal)
                tf = lambda ms: flops / ms * 1e-9  # noqa: B023,E731
                default = tf(bench(lambda: Fn.scaled_dot_product_attention(q, k, v, is_causal=causal)))  # noqa: B023
                ours = tf(bench(lambda: attention_forward(q, k, v, causal, config={"hopper": False})))  # noqa: B023
                res = {t: tf(bench(lambda t=t: attention_fn(q, k, v, causal, t))) for t in variants[d]}  # noqa: B023
                rows.append((d, causal, n, default, ours, res))
                print(
                    f"d={d:3d} causal={int(causal)} N={n:5d} | SDPA default {default:4.0f} | Triton {ours:4.0f} "
                    f"({ours / default:.2f}x) | Gluon " + " ".join(f"{t}:{x:4.0f}" for t, x in res.items()),
                    flush=True,
                )
    print(f"geomean over SDPA default: Triton {summarise([r[4] / r[3] for r in rows])[1]:.3f}, "
          f"best Gluon variant per cell {summarise([max(r[5].values()) / r[3] for r in rows])[1]:.3f}")  # fmt: skip
    for d in (64, 128):
        for t in variants[d]:
            print(
                f"  d={d} {t}: {summarise([r[5][t] / r[3] for r in rows if r[0] == d])[1]:.3f} of SDPA default"
            )
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="1024,2048,4096,8192,16384")
    args = ap.parse_args()
    t0 = time.time()
    bad = check(TILES)
    print("correctness:", "ok" if not bad else bad, f"({time.time() - t0:.0f} s)", flush=True)
    sweep(TILES, attention, list(map(int, args.ns.split(","))))
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
