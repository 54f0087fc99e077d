"""Ablations of the one-pass Gluon backward (`course_lib/attention/hopper_onepass.py`): which part of adding dQ
costs the time. Each ablation is the module's source with lines taken out (its gradients are then wrong: only
its time is read), written beside the module, imported, timed and deleted.

    python3 scripts/hopper_onepass_ablate.py [--ns 16384] [--ds 128]

Rows, TFLOP/s of the backward's 2.5 x forward FLOPs (bf16, B * N = 16k tokens, H * d = 2048), each the kernel
alone with the D pass, zeroed accumulator and cast as `hopper_onepass.backward` runs them:
split (FlashAttention-3's, as in the module), split without TMA's reduce (dQ still stored to shared memory),
split without the dQ product, store or reduce (the two warpgroups still wait for each other's dS), the same
without those waits; one loop for every program (the key mask always
on, where the module compiles a second loop without it for the programs whose keys all exist), alone and with
nothing of dQ, and then with a tiny dQ tile in shared memory; and, in the same units, the two-kernel backward's
dK/dV kernel with its D pass (the same 4 products as the rows without dQ); dQ in 2 chunks of columns a
warpgroup (`backward(dq_chunks=2)`), with one loop or two. Then each binary's registers, spills, shared memory.
Check a stripped build with `gluon_spills.py`'s compiler first: the non-causal builds without the dQ product had
their wgmmas serialised by ptxas (C7515), so their times measure that, not the loop left.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import torch

from course_lib.attention import backward as bwd
from course_lib.attention import forward as fwd
from course_lib.attention import hopper_backward as hb
from course_lib.perf.timing import benchmark

SOURCE = Path(__file__).resolve().parents[1] / "course_lib" / "attention" / "hopper_onepass.py"
TOKENS, WIDTH = 16384, 2048

NO_REDUCE = [("    _tma_reduce_add(dq_desc, [row, col], dq_c)\n", "")]
NO_DQ = [
    (
        "        for c in gl.static_range(DQ_CHUNKS):\n"
        "            dq_tok = _dq_product(ds_smem, k_smem, dq_zero, (WG * DQ_CHUNKS + c) * C, NUM_CONSUMERS)\n"
        "            dq = warpgroup_mma_wait(0, deps=[dq_tok])\n"
        "            row = head * N_Q + m_blk * QROWS\n"
        "            add_dq(dq, dq_w.index(WG * DQ_CHUNKS + c), dq_desc, row, (WG * DQ_CHUNKS + c) * C, "
        "DQ_CHUNKS - 1)\n",
        "",
    )
]
NO_SYNC = [
    (
        "        if step > 0:  # both warpgroups' dQ products of the previous step, which read this tile, are done\n"
        "            mbarrier.wait(dq_full, (step - 1) & 1)\n",
        "",
    ),
    ("        mbarrier.arrive(ds_bar, count=1)\n", ""),
    ("        mbarrier.wait(ds_bar, step & 1)  # both dS tiles of the step are in shared memory\n", ""),
    ("        mbarrier.arrive(dq_full, count=1)  # counts the warpgroups done with the step\n", ""),
]
ONE_LOOP = [  # non-causal programs too (causal ones have one loop already)
    (
        "    elif n_start + CTA_N > N_K:\n"
        "        dk, dv = _steps(loop, dk, dv, CAUSAL, NUM_STAGES, NUM_CONSUMERS, WG, True, DQ_CHUNKS)\n"
        "    else:\n"
        "        dk, dv = _steps(loop, dk, dv, CAUSAL, NUM_STAGES, NUM_CONSUMERS, WG, False, DQ_CHUNKS)\n",
        "    else:\n        dk, dv = _steps(loop, dk, dv, CAUSAL, NUM_STAGES, NUM_CONSUMERS, WG, True, DQ_CHUNKS)\n",
    )
]
SMALL_DQ_SMEM = [
    (
        "gl.allocate_shared_memory(gl.float32, [NUM_CONSUMERS * DQ_CHUNKS, QROWS, C], dq_desc.layout)",
        "gl.allocate_shared_memory(gl.float32, [NUM_CONSUMERS * DQ_CHUNKS, 8, 32], dq_desc.layout)",
    )
]
# name: (the source's edits, backward's dq_chunks)
ABLATIONS = {
    "split": ([], 1),
    "split, no reduce": (NO_REDUCE, 1),
    "split, no dQ product/store/reduce": (NO_DQ, 1),
    "split, none of dQ, no waits": (NO_DQ + NO_SYNC, 1),
    "split, one loop": (ONE_LOOP, 1),
    "split, none of dQ, no waits, one loop": (NO_DQ + NO_SYNC + ONE_LOOP, 1),
    "split, none of dQ, no waits, one loop, small dQ tiles": (NO_DQ + NO_SYNC + ONE_LOOP + SMALL_DQ_SMEM, 1),
    "split, 2 chunks": ([], 2),
    "split, 2 chunks, one loop": (ONE_LOOP, 2),
}


def ablated(name: str, edits) -> object:
    text = SOURCE.read_text()
    for old, new in edits:
        if old not in text:
            raise SystemExit(f"{name}: the line {old!r} is no longer in {SOURCE.name}")
        text = text.replace(old, new)
    stem = "_onepass_ablation_" + str(abs(hash(name)) % 10**8)
    path = SOURCE.with_name(stem + ".py")
    path.write_text(text)
    try:
        return importlib.import_module("course_lib.attention." + stem)
    finally:
        path.unlink()


def cell(modules: dict, d: int, n: int, causal: bool) -> dict:
    B, H = TOKENS // n, WIDTH // d
    q, k, v, do = (torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    o, L = fwd.forward(q, k, v, causal=causal)
    flops = 2.5 * 4 * B * H * n * n * d * (0.5 if causal else 1.0)
    row = dict(d=d, n=n, causal=causal)
    for name, (mod, chunks) in modules.items():

        def call(mod=mod, chunks=chunks):
            return mod.backward(q, k, v, o, do, L, 0, causal, d**-0.5, dq_chunks=chunks)

        row[name] = round(flops / benchmark(call) / 1e9, 1)
    delta = torch.empty(B * H, n, dtype=torch.float32, device="cuda")
    dk, dv = torch.empty_like(k), torch.empty_like(v)

    def dkdv():  # the two-kernel backward's dK/dV kernel with its D pass: the same 4 products
        bwd.preprocess(o, do, delta, q.dtype)
        hb.dkdv(q, k, v, do, L, delta, dk, dv, 0, causal, d**-0.5)

    row["dK/dV kernel and D"] = round(flops / benchmark(dkdv) / 1e9, 1)
    return row


def compiled(kernel) -> list[str]:
    """Registers, spills (ptxas's count of spilled values) and shared memory of each binary `kernel` compiled."""
    out = []
    for cache in kernel.device_caches.values():
        for binary in cache[0].values():
            binary._init_handles()
            out.append(f"regs {binary.n_regs}, spills {binary.n_spills}, shared {binary.metadata.shared}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ns", default="16384")
    p.add_argument("--ds", default="128")
    p.add_argument("--only", default="", help="the rows to time, their names joined by ';' (default: all)")
    a = p.parse_args()
    names = a.only.split(";") if a.only else list(ABLATIONS)
    modules = {name: (ablated(name, ABLATIONS[name][0]), ABLATIONS[name][1]) for name in names}
    for d in map(int, a.ds.split(",")):
        for n in map(int, a.ns.split(",")):
            for causal in (False, True):
                print(json.dumps(cell(modules, d, n, causal)), flush=True)
    for name, (mod, _) in modules.items():
        print(f"{name}: {compiled(mod.bwd_ws_kernel)}")
    print(f"dK/dV kernel: {compiled(hb.dkdv_ws_kernel)}")


if __name__ == "__main__":
    main()
