"""Registers and spills of the Hopper backward kernels, compiled for sm_90a on any machine (no GPU needed):
Triton compiles the kernel as for an H100/H200 and its own ptxas reports the stack frame and spill bytes, and
whether it serialised the kernel's wgmmas.

    python3 scripts/gluon_spills.py [--d 128] [--chunks 1,2]

Rows: the one-pass backward (`attention.hopper_onepass`, each DQ_CHUNKS) and the two-kernel backward's dK/dV kernel
(`attention.hopper_backward`; at d = 64 with 64 and 128 query rows a step), non-causal and causal. A register
change to the one-pass kernel can be checked here in seconds before a GPU times it (the spills are not the whole
story: hopper_onepass's docstring). The counts come from this machine's Triton and ptxas, which may differ from a
GPU machine's (2026-11-30, the earlier one-pass kernel: 608 / 440 bytes of spill stores at d = 128 for one chunk
here, where the H200's Triton 3.6 reported 54 / 74 values). The kernels are compiled for 1 x 2 heads of 1024
tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver


class _Sm90Driver:
    """Triton's CUDA driver as seen by the compiler only: the target is sm_90a, device 0, stream 0."""

    def __init__(self, real):
        self.real = real

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def __getattr__(self, name):
        return getattr(self.real, name)


def use_sm90_target() -> None:
    """Make Triton compile for sm_90a here (warmup only: nothing can launch)."""
    from triton.backends.nvidia.driver import CudaDriver

    driver.set_active(_Sm90Driver(CudaDriver.__new__(CudaDriver)))


def ptxas_spills(compiled) -> str:
    """ptxas -v's line on the kernel's stack frame and spill stores / loads, for its PTX, and whether ptxas
    serialised its wgmmas (C7515: an accumulator register written by another instruction mid-pipeline)."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        out = subprocess.run(
            [ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", ptx + ".cubin"], capture_output=True, text=True
        )
    lines = [line.strip() for line in out.stderr.splitlines() if "spill" in line]
    serialised = "; wgmmas serialised (ptxas's C7515)" if "C7515" in out.stderr else ""
    return (lines[0] if lines else out.stderr.strip()[-300:]) + serialised


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--chunks", default="1,2")
    a = p.parse_args()
    use_sm90_target()

    from course_lib.attention import hopper_backward as hb
    from course_lib.attention import hopper_onepass as onepass
    from course_lib.attention.hopper import descriptor

    B, H, n, d = 1, 2, 1024, a.d
    q, k, v, do = (torch.randn(B, H, n, d).to(torch.bfloat16) for _ in range(4))
    lse, delta = torch.zeros(B, H, n), torch.zeros(B * H, n)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    descs = (descriptor(q, 64), descriptor(do, 64), descriptor(k, 64), descriptor(v, 64))
    rest = (lse, delta, dk, dv, 0.1, 0.1, *lse.stride(), *dk.stride()[:3], H, 1, 1, n, n, 0, B * H)
    for causal in (False, True):
        for chunks in map(int, a.chunks.split(",")):
            compiled = onepass.warmup(q, k, v, 0, causal, 0.1, dq_chunks=chunks, where="cpu")
            print(f"one pass, d = {d}, causal {causal}, {chunks} chunk(s): {ptxas_spills(compiled)}")
        for rows in (64, 128) if d == 64 else (64,):  # query rows a step (`DkdvLaunch.q_rows`)
            launch = dataclasses.replace(hb.LAUNCHES[d], q_rows=rows)
            compiled = hb.dkdv_ws_kernel.warmup(
                descriptor(q, rows), descriptor(do, rows), *descs[2:], *rest, CAUSAL=causal, HEAD_DIM=d,
                **launch.kwargs(), grid=(1,),
            )  # fmt: skip
            print(
                f"dK/dV kernel, d = {d}, causal {causal}, {rows} query rows a step: {ptxas_spills(compiled)}; "
                f"{compiled.metadata.shared // 1024} KB of shared memory"
            )


if __name__ == "__main__":
    main()
