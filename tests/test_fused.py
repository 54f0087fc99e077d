"""Tests of course_lib.fused (notebook 11) that concern both kernels: the launch tables (fused/launch.py)
and the L2 hint rule, second derivatives refused by name, and on a GPU the forward and backward of
rms_norm and rope captured in one CUDA graph. Each kernel's own tests: test_rms_norm.py, test_rope.py.
"""

from __future__ import annotations

import pytest
import torch

import course_lib
from course_lib.fused import rms_norm, rope, rope_cache
from course_lib.testing import seeded_randn as _randn

DEVICE = course_lib.DEVICE
ON_GPU = course_lib.ON_GPU
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU with compiled Triton kernels")


def test_second_derivatives_are_refused_by_name():
    """The kernels' gradients have no derivative of their own: a second differentiation raises, naming
    the function and a PyTorch counterpart, whether the second call asks for every leaf's gradient or for
    one input's (`torch.autograd.grad(..., inputs)`, where an error node hung off detached copies would be
    pruned and the term silently lost). create_graph=True alone still gives the first derivative."""
    cos, sin = rope_cache(8, 8, dtype=torch.float64, device=DEVICE)
    k = _randn(1, 1, 4, 8, dtype=torch.float64, seed=1)
    w = _randn(8, dtype=torch.float64, seed=2)
    calls = {
        "rms_norm": lambda a: rms_norm(a, w),
        "rope": lambda a: rope(a[:, None].expand(1, 2, 4, 8), k, cos, sin)[0],
    }
    for name, call in calls.items():
        x = _randn(1, 4, 8, dtype=torch.float64, seed=3).requires_grad_()
        (g,) = torch.autograd.grad(call(x).pow(3).sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match=f"^course_lib's {name} has no second derivative"):
            torch.autograd.grad(g.pow(2).sum() + x.pow(2).sum(), x)
        (g,) = torch.autograd.grad(call(x).pow(3).sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match=f"^course_lib's {name} has no second derivative"):
            g.pow(2).sum().backward()
        (g_plain,) = torch.autograd.grad(call(x).pow(3).sum(), x)
        torch.testing.assert_close(g.detach(), g_plain)


def test_launch_tables_and_overrides():
    from course_lib.fused import launch
    from course_lib.fused.rms_norm import rms_norm_forward

    for table in (launch.WARPS, launch.RMS_FORWARD, launch.RMS_BACKWARD, launch.ROPE):
        bounds = [bound for bound, _ in table]
        assert bounds == sorted(bounds) and bounds[-1] == launch.MAX_ROW, table
        values = [
            v for _, entry in table for v in (tuple(entry)[:3] if not isinstance(entry, int) else (entry,))
        ]
        chunks = [entry.chunk for _, entry in table if isinstance(entry, launch.RowLaunch)]
        values = [v for v in values if v not in chunks] + [c for c in chunks if c]  # chunk 0: no chunking
        assert all(v >= 1 and v & (v - 1) == 0 for v in values), table
    assert launch.rms_forward(2048) == launch.RowLaunch(rows=1, warps=4)
    assert launch.rms_backward(3000).programs_per_sm == 2  # rows of 3000 elements: BLOCK_D 4096's entry
    assert launch.rms_backward(4544).stream and not launch.rms_backward(4096).stream
    assert launch.persistent_programs(100, 1024, torch.device("cpu"), per_sm=3) == 3
    assert launch.persistent_programs(2, 1024, torch.device("cpu")) == 2
    # the fewest programs that keep the longest share of rows: 16384 rows over 528 wanted -> 512 x 32
    assert launch.persistent_programs(16384, 2048, torch.device("cpu"), per_sm=528) == 512
    assert launch.persistent_programs(65536, 2048, torch.device("cpu"), per_sm=528) == 525  # longest: 125
    assert launch.persistent_programs(9, 1024, torch.device("cpu"), per_sm=4) == 3  # 3 x 3, not 3, 2, 2, 2
    assert launch.persistent_programs(4, 1024, torch.device("cpu"), per_sm=3) == 3  # below the line: not cut
    with pytest.raises(ValueError, match="power of two"):
        rms_norm_forward(_randn(4, 8), _randn(8), 1e-6, rows=3)


def test_keep_hint_rule():
    """The evict_last hint only for inputs larger than KEEP_L2_MULTIPLE x the L2, never off a GPU."""
    from course_lib.fused import launch

    assert launch.keep_hint(1 << 40, torch.device("cpu")) == ""
    if DEVICE.type == "cuda":
        l2 = torch.cuda.get_device_properties(DEVICE).L2_cache_size
        assert launch.keep_hint(launch.KEEP_L2_MULTIPLE * l2 + 1, DEVICE) == "evict_last"
        assert launch.keep_hint(launch.KEEP_L2_MULTIPLE * l2, DEVICE) == ""


@pytest.mark.gpu
@gpu
def test_gpu_forward_and_backward_capture_in_one_cuda_graph():
    """What the benchmark's graph timing does: forward + backward of rms_norm and rope (positions implicit
    and as a tensor) captured together, replayed, and equal to the plain call (the dW reduction is
    deterministic, so bit for bit)."""
    from course_lib.perf.timing import graphed

    x = _randn(4096, 4544, dtype=torch.bfloat16).requires_grad_()
    w = _randn(4544, dtype=torch.bfloat16, seed=1).requires_grad_()
    dy = _randn(4096, 4544, dtype=torch.bfloat16, seed=2)
    q = _randn(1024, 32, 128, dtype=torch.bfloat16, seed=3).requires_grad_()
    k = _randn(1024, 8, 128, dtype=torch.bfloat16, seed=4).requires_grad_()
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    cos, sin = rope_cache(1024, 128, dtype=torch.bfloat16, device=DEVICE)
    positions = torch.randperm(1024, generator=torch.Generator().manual_seed(5)).to(DEVICE)  # a tensor
    out = {}

    def step():
        out["rms"] = torch.autograd.grad(rms_norm(x, w), (x, w), dy)
        qr, kr = rope(q.transpose(0, 1), k.transpose(0, 1), cos, sin)
        out["rope"] = torch.autograd.grad((qr, kr), (q, k), (dq.transpose(0, 1), dk.transpose(0, 1)))
        qr, kr = rope(q.transpose(0, 1), k.transpose(0, 1), cos, sin, positions=positions)  # no sync inside
        out["rope_positions"] = torch.autograd.grad(
            (qr, kr), (q, k), (dq.transpose(0, 1), dk.transpose(0, 1))
        )

    replay = graphed(step)
    replay()
    torch.cuda.synchronize()
    got = {key: [t.clone() for t in val] for key, val in out.items()}
    step()
    for key in got:
        for a, b in zip(got[key], out[key]):
            assert torch.equal(a, b), f"{key}: the graph replay differs from the plain call"
