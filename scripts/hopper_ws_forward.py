"""Sweep of course_lib's warp-specialised Hopper forward (`course_lib/attention/hopper.py`).

    COURSE_DEVICE=cuda python3 scripts/hopper_ws_forward.py [--ns 1024,4096,16384]

Checks every variant below against a float32 reference (ragged, causal, Nq != Nk, bf16 and fp16,
K/V with as many heads as Q and with one: grouped-query attention), then times each on the standard
shapes next to SDPA's default backend (cuDNN on an H200) and the Triton forward
(`course_lib.attention.attention_forward(..., config={"hopper": False})`), all in the same run; the check and
the timing loop are `scripts/hopper_gluon_forward.py`'s. What it measured, and how `hopper.choose`
follows from it: notes/performance.md, "Fourth round".
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("COURSE_DEVICE", "cuda")

import torch  # noqa: E402
from hopper_gluon_forward import check, sweep  # noqa: E402  (this script's folder)

from course_lib.attention import hopper  # noqa: E402
from course_lib.bench import summarise  # noqa: E402

# (BLOCK_N, NUM_STAGES, NUM_CONSUMERS, PINGPONG, PERSISTENT) per head dim.
# Shared memory: (NUM_CONSUMERS * 64 + 2 * NUM_STAGES * BLOCK_N) * d * 2 bytes, at most ~227 KB.
VARIANTS = {
    128: [
        (128, 3, 2, True, False),
        (128, 3, 2, True, True),
        (128, 3, 2, False, False),
        (128, 3, 2, False, True),
    ],
    64: [
        (128, 3, 3, True, True),
        (128, 3, 3, False, True),
        (128, 3, 3, True, False),
        (128, 4, 2, True, True),
    ],
}


def attention(q, k, v, causal: bool, variant):
    """(O, L) of contiguous q (B, H, Nq, d), k, v (B, Hkv, Nk, d) with one variant of the kernel."""
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    hopper.forward(q, k, v, o, lse, causal, q.shape[-1] ** -0.5, variant)
    return o, lse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="1024,2048,4096,8192,16384")
    args = ap.parse_args()
    t0 = time.time()
    bad = check(VARIANTS, attention, kv_heads=(3, 1))
    print("correctness:", "ok" if not bad else bad[:12], f"({time.time() - t0:.0f} s)", flush=True)
    rows = sweep(VARIANTS, attention, list(map(int, args.ns.split(","))))
    chosen = [r[5].get(hopper.choose(r[0], r[1], r[2], r[2]), r[4]) / r[3] for r in rows]
    print(f"hopper.choose's pick (the Triton kernel where None): {summarise(chosen)[1]:.3f} of SDPA default")
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
