"""Ablations of the one-pass Gluon backward (`course_lib/attention/hopper_onepass.py`): which part of adding dQ
costs the time. Each ablation is the module's source with lines taken out (its gradients are then wrong: only
its time is read), written beside the module, imported, timed and deleted.

    python3 scripts/hopper_onepass_ablate.py [--ns 16384] [--ds 128]

Rows, TFLOP/s of the backward's 2.5 x forward FLOPs (bf16, B * N = 16k tokens, H * d = 2048), each the kernel
alone with the D pass, zeroed accumulator and cast as `hopper_onepass.backward` runs them:
split (FlashAttention-3's, as in the module), split without TMA's reduce (dQ still stored to shared memory),
split without the dQ product, store or reduce (the two warpgroups still wait for each other's dS), the same
without those waits; own keys, and own keys without the reduce.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import torch

from course_lib.attention import forward as fwd
from course_lib.perf.timing import benchmark

SOURCE = Path(__file__).resolve().parents[1] / "course_lib" / "attention" / "hopper_onepass.py"
TOKENS, WIDTH = 16384, 2048

NO_REDUCE = [("    _tma_reduce_add(dq_desc, [row, col], dq_w)\n", "")]
NO_DQ = [
    ("            dq_tok = _dq_product(ds_smem, k_smem, dq_zero, WG, NUM_CONSUMERS)\n", ""),
    ("            dq = warpgroup_mma_wait(0, deps=[dq_tok])\n", ""),
    ("            _add_dq(dq, dq_w, dq_desc, head * N_Q + m_blk * QROWS, WG * HALF)\n", ""),
]
NO_SYNC = [
    (
        "            if step > 0:  # both warpgroups' dQ products of the previous step, which read this tile, "
        "are done\n                mbarrier.wait(dq_full, (step - 1) & 1)\n",
        "",
    ),
    ("            mbarrier.arrive(ds_bar, count=1)\n", ""),
    ("            mbarrier.wait(ds_bar, step & 1)  # both dS tiles of the step are in shared memory\n", ""),
    ("            mbarrier.arrive(dq_full, count=1)  # counts the warpgroups done with the step\n", ""),
]
ABLATIONS = {
    "split": ([], False),
    "split, no reduce": (NO_REDUCE, False),
    "split, no dQ product/store/reduce": (NO_DQ, False),
    "split, none of dQ, no waits": (NO_DQ + NO_SYNC, False),
    "own keys": ([], True),
    "own keys, no reduce": (NO_REDUCE, True),
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
    for name, (mod, own) in modules.items():

        def call(mod=mod, own=own):
            return mod.backward(q, k, v, o, do, L, 0, causal, d**-0.5, own_keys=own)

        row[name] = round(flops / benchmark(call) / 1e9, 1)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ns", default="16384")
    p.add_argument("--ds", default="128")
    a = p.parse_args()
    modules = {name: (ablated(name, edits), own) for name, (edits, own) in ABLATIONS.items()}
    for d in map(int, a.ds.split(",")):
        for n in map(int, a.ns.split(",")):
            for causal in (False, True):
                print(json.dumps(cell(modules, d, n, causal)), flush=True)


if __name__ == "__main__":
    main()
