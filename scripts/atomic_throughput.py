"""Throughput of float32 atomic adds into a buffer in the L2 cache, by memory order (notebook 07, section 7).

    COURSE_DEVICE=cuda python3 scripts/atomic_throughput.py [--mb 8,32,128]

The one-pass backward (`attention.backward(..., dq_mode="atomic")`) adds a BLOCK_M x d float32 tile of dQ at
every step of every dK/dV program. This script does only that: 2 programs per SM each add a 64 x 128 float32
tile into a buffer of --mb MiB, 64 times, at tiles spread over the buffer, with `tl.atomic_add` relaxed and
acquire-release (its default), and, for scale, plain stores of the same tiles. It prints GB/s of float32
added and the atomic instructions the relaxed kernel compiled to. What it measured: notes/attention.md.
"""

from __future__ import annotations

import argparse
import re

import torch
import triton
import triton.language as tl

ROWS, D = 64, 128  # one dQ tile of the dK/dV kernel's step (BLOCK_M x d)
REPS = 64  # tiles each program adds


@triton.jit
def add_tiles(DQ, X, n_tiles, reps, ROWS: tl.constexpr, D: tl.constexpr, MODE: tl.constexpr):
    """Program p adds the tile X (ROWS x D float32) at tile (7 p + 13 i) mod n_tiles of DQ, for i < reps.
    MODE 0: atomic add, relaxed; 1: atomic add, acq_rel; 2: a plain store."""
    pid = tl.program_id(0)
    offs = tl.arange(0, ROWS)[:, None] * D + tl.arange(0, D)[None, :]
    x = tl.load(X + offs)
    for i in range(reps):
        ptrs = DQ + ((pid * 7 + i * 13) % n_tiles) * ROWS * D + offs
        if MODE == 0:
            tl.atomic_add(ptrs, x, sem="relaxed")
        elif MODE == 1:
            tl.atomic_add(ptrs, x, sem="acq_rel")
        else:
            tl.store(ptrs, x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", default="8,32,128", help="buffer sizes, MiB")
    args = parser.parse_args()
    grid = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(ROWS * D, device="cuda")
    print(f"{torch.cuda.get_device_name()}: {grid} programs x {REPS} tiles of {ROWS} x {D} float32")
    print("| buffer MiB | relaxed GB/s | acq_rel GB/s | plain store GB/s |")
    print("| --- | --- | --- | --- |")
    kernel = None
    for mb in map(int, args.mb.split(",")):
        n_tiles = mb * 2**20 // (ROWS * D * 4)
        dq = torch.zeros(n_tiles * ROWS * D, device="cuda")
        cells = []
        for mode in (0, 1, 2):

            def run(mode=mode, dq=dq, n_tiles=n_tiles):
                return add_tiles[(grid,)](dq, x, n_tiles, REPS, ROWS=ROWS, D=D, MODE=mode, num_warps=8)

            compiled = run()
            kernel = kernel or compiled
            ms = triton.testing.do_bench(run)
            cells.append(f"{grid * REPS * ROWS * D * 4 / ms / 1e6:.0f}")
        print(f"| {mb} | " + " | ".join(cells) + " |")
    found = sorted(set(re.findall(r"\b(?:red|atom)\.global[.a-z0-9_]*", kernel.asm["ptx"])))
    print("relaxed kernel's atomic instructions:", ", ".join(found))


if __name__ == "__main__":
    main()
