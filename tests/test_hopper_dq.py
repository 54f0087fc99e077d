"""Tests of course_lib.attention.hopper_dq: a warp-specialised dQ kernel in Gluon (the backward's on Hopper at d = 128).

On any machine: the launch table is well formed (`DqLaunch` entries, keywords of the kernel, tiles that fit
an SM's shared memory), and each entry of `LAUNCHES` compiles for sm_90 (`scripts/hopper_dq_probe.py
--compile-only`, in a fresh process; on a CPU with Gluon's AST source for GPUTarget("cuda", 90, 32)).
On a Hopper GPU: dQ against the float64 reference for ragged lengths, Nq != Nk, both causal alignments
with rows that see no key, grouped- and multi-query attention, bf16 and fp16, d = 64 and 128, an fp32
output, and every variant of `VARIANTS` on one case.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

import course_lib
from course_lib.attention.forward import forward as attention_forward
from course_lib.checks import causal_alignment, causal_offset
from course_lib.kernels.launch import Launch
from course_lib.testing import assert_close_to_reference, random_qkv, reference_outputs

hopper_dq = pytest.importorskip("course_lib.attention.hopper_dq", reason="needs a Triton with Gluon")

ROOT = Path(__file__).resolve().parents[1]
ON_HOPPER = course_lib.ON_GPU and torch.cuda.get_device_capability()[0] == 9
hopper_gpu = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (compute capability 9.x)")
SM_SHARED = 228 * 1024  # shared memory of an H100 / H200 SM; each program reserves 1 KB more


def test_launch_table_is_well_formed():
    """One `DqLaunch` per head dim the Gluon kernels take, listed first among its VARIANTS; every entry a
    frozen Launch whose keywords are the kernel's constants or launch options, with 1 or 2 consumers,
    at least 2 ring slots, and tiles that fit programs_per_sm times in an SM's shared memory."""
    from course_lib.attention import hopper

    constants = {
        p.name
        for p in inspect.signature(hopper_dq.dq_ws_kernel.fn).parameters.values()
        if "constexpr" in str(p.annotation)
    }
    assert set(hopper_dq.LAUNCHES) == set(hopper.HEAD_DIMS) == set(hopper_dq.VARIANTS)
    for d, launches in hopper_dq.VARIANTS.items():
        assert launches[0] == hopper_dq.LAUNCHES[d]
        for launch in launches:
            assert isinstance(launch, Launch) and type(launch).__dataclass_params__.frozen
            assert type(launch)(*launch) == launch
            kwargs = launch.kwargs()
            assert set(kwargs) - constants <= {"num_warps", "maxnreg"}, kwargs
            assert {"BLOCK_N", "NUM_STAGES", "NUM_CONSUMERS", "CONSUMER_REGS"} <= set(kwargs)
            assert launch.num_consumers in (1, 2) and launch.num_stages >= 2 and launch.block_n in (64, 128)
            used = launch.programs_per_sm * (launch.shared_bytes(d) + 1024)
            assert used <= SM_SHARED, f"d={d} {launch}: {used} bytes of shared memory per SM"
            warps = 4 * launch.num_consumers + 4
            assert launch.programs_per_sm * warps * 32 * kwargs["maxnreg"] <= 65536, (d, launch, kwargs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        hopper_dq.LAUNCHES[128].block_n = 128


def _compiler_reachable() -> bool:
    """Whether this Triton offers what the probe's compile for sm_90 without a GPU uses."""
    if course_lib.ON_GPU:
        return True  # there the probe compiles with the kernel's own `warmup`
    try:
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401
        from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: F401
    except ImportError:
        return False
    return hasattr(JITFunction, "_pack_args")


def test_launches_compile_for_sm90():
    """Each entry of LAUNCHES, causal and not, compiles for sm_90 with no local memory (no spills)."""
    if not _compiler_reachable():
        pytest.skip("this Triton lacks the internals the compile for sm_90 without a GPU uses")
    script = ROOT / "scripts" / "hopper_dq_probe.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, str(script), "--compile-only"], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("d=")]
    assert len(lines) == 2 * len(hopper_dq.LAUNCHES), done.stdout
    for line in lines:
        assert "LOCAL:0" in line or "LOCAL" not in line, line


# (name, q shape (B, H, Nq), Nk, K/V heads, causal)
CASES = [
    ("N=1000, Nk=1531", (2, 3, 1000), 1531, 3, False),
    ("N=1000, Nk=1531, causal", (2, 3, 1000), 1531, 3, True),
    ("Nq=77 < Nk=300, bottom-right", (2, 3, 77), 300, 3, "bottom_right"),
    ("Nq=300 > Nk=77, bottom-right (rows that see no key)", (2, 3, 300), 77, 3, "bottom_right"),
    ("Nq=300 > Nk=77, top-left", (1, 2, 300), 77, 2, True),
    ("N=130 ragged", (1, 5, 130), 130, 5, False),
    ("GQA 8 / 2, N=700, causal", (1, 8, 700), 700, 2, True),
    ("MQA 4 / 1, Nq=200, Nk=333", (2, 4, 200), 333, 1, False),
    ("N=1, one query", (3, 2, 1), 1, 2, True),
]


def _check(name, shape, n_k, kv_heads, causal, dtype, d, launch=None, out_dtype=None):
    """dQ of `hopper_dq.dq` (L from the forward, D = rowsum(dO * O) in fp32) against the float64
    reference, within the bound plain PyTorch in `dtype` sets."""
    torch.manual_seed(zlib.crc32(name.encode()) + d)
    q, k, v = random_qkv((*shape, d), n_k, dtype=dtype, device="cuda", kv_heads=kv_heads)
    do = torch.randn_like(q)
    o, lse = attention_forward(q, k, v, causal)
    B, H, n_q, _ = q.shape
    delta = (do.float() * o.float()).sum(-1).view(B * H, n_q).contiguous()
    dq = torch.empty(q.shape, dtype=out_dtype or dtype, device="cuda")
    offset = causal_offset(causal_alignment(causal), n_q, n_k)
    hopper_dq.dq(q, k, v, do, lse, delta, dq, offset, bool(causal), d**-0.5, launch=launch)
    _, (ref, _, _) = reference_outputs(
        *(t.cpu().double() for t in (q, k, v)), causal, None, do.cpu().double()
    )
    _, (base, _, _) = reference_outputs(q, k, v, causal, None, do)
    assert torch.isfinite(dq).all(), f"{name}: not finite"
    assert_close_to_reference(dq.to(dtype), ref, base, what=f"dq, {name}, d={d}, {dtype}, {launch}")


@hopper_gpu
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("name,shape,n_k,kv_heads,causal", CASES, ids=[c[0] for c in CASES])
def test_dq_matches_reference(name, shape, n_k, kv_heads, causal, dtype, d):
    _check(name, shape, n_k, kv_heads, causal, dtype, d)


@hopper_gpu
@pytest.mark.parametrize("d", (64, 128))
def test_fp32_output_and_variants(d):
    """An fp32 dQ output, and each of VARIANTS, on a ragged causal grouped case."""
    case = ("GQA 4 / 1, Nq=333, Nk=517, bottom-right", (2, 4, 333), 517, 1, "bottom_right")
    _check(*case, torch.bfloat16, d, out_dtype=torch.float32)
    for launch in hopper_dq.VARIANTS[d]:
        _check(*case, torch.bfloat16, d, launch=launch)
