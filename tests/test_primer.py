"""Tests for course_lib.primer (notebook 05): add, weighted_sum (forward, backward, gradcheck), softmax.

On a CPU the kernels run through the Triton interpreter, so the shapes are tiny; the GPU-marked cases use
real sizes with compiled kernels."""

from __future__ import annotations

import pytest
import torch

import course_lib
from course_lib import primer

DEVICE = course_lib.DEVICE
gpu = pytest.mark.skipif(not course_lib.ON_GPU, reason="needs a CUDA GPU with compiled Triton kernels")
TOL = {
    torch.float16: dict(rtol=1e-2, atol=1e-2),
    torch.bfloat16: dict(rtol=2e-2, atol=3e-2),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
}
# Softmax outputs lie in [0, 1], most of them far below 0.01: a relative bound of about two units in the
# last place of the dtype, and an absolute one only for the probabilities that round to 0 (40 draws of
# each test's inputs passed under the interpreter).
SOFTMAX_TOL = {
    torch.float16: dict(rtol=2e-3, atol=1e-6),
    torch.bfloat16: dict(rtol=1e-2, atol=1e-6),
    torch.float32: dict(rtol=1e-5, atol=1e-6),
}


def case(**kw) -> str:
    return ", ".join(f"{k}={v}" for k, v in kw.items())


# ---------------------------------------------------------------------------------------------- add


@pytest.mark.parametrize("n, block_size", [(1, 16), (1000, 256), (1025, 1024)])
def test_add_matches_torch_on_ragged_sizes(n, block_size):
    x, y = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    torch.testing.assert_close(
        primer.add(x, y, block_size=block_size), x + y, msg=lambda m: f"{case(n=n, block=block_size)}: {m}"
    )


def test_add_keeps_shape_of_non_contiguous_inputs():
    x = torch.randn(33, 20, device=DEVICE).t()
    y = torch.randn(20, 33, device=DEVICE)
    torch.testing.assert_close(primer.add(x, y, block_size=128), x + y)


def test_add_rejects_bad_input():
    x = torch.randn(10, device=DEVICE)
    with pytest.raises(ValueError, match="match in shape"):
        primer.add(x, torch.randn(11, device=DEVICE))
    with pytest.raises(ValueError, match="power of two"):
        primer.add(x, x, block_size=100)
    with pytest.raises(TypeError, match="torch.Tensor"):
        primer.add(x, [1.0] * 10)
    meta = torch.randn(10, device="meta")
    with pytest.raises(ValueError, match="Triton kernels run on"):
        primer.add(meta, meta)


# ------------------------------------------------------------------------------------- weighted_sum


def _weighted_sum_reference(x, w, grad_out):
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    out = (x64 * w64).sum(-1)
    out.backward(grad_out.double())
    return out, x64.grad, w64.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7, 100), (40, 65)])
def test_weighted_sum_forward_and_backward(shape, dtype):
    x = torch.randn(shape, device=DEVICE).to(dtype).requires_grad_()
    w = torch.randn(shape[-1], device=DEVICE).to(dtype).requires_grad_()
    out = primer.weighted_sum(x, w)
    grad_out = torch.randn(out.shape, device=DEVICE).to(dtype)
    out.backward(grad_out)
    ref, gx, gw = _weighted_sum_reference(x, w, grad_out)
    # Sums over D (forward) and over rows (weight gradient) grow with their length;
    # atol scales with sqrt(length).
    tol = TOL[dtype]
    for name, got, want, n in (
        ("out", out, ref, shape[-1]),
        ("grad_x", x.grad, gx, 1),
        ("grad_w", w.grad, gw, x.numel() // shape[-1]),
    ):
        assert got.dtype == dtype and got.shape == want.shape, f"{case(shape=shape, dtype=dtype)}: {name}"
        torch.testing.assert_close(
            got.double(), want, rtol=tol["rtol"], atol=tol["atol"] * n**0.5,
            msg=lambda m, name=name: f"{case(shape=shape, dtype=dtype, tensor=name)}: {m}",
        )  # fmt: skip


def test_weighted_sum_strided_input():
    base = torch.randn(50, 30, device=DEVICE)
    x = base.t()  # (30, 50), column-major: the kernel must honour strides
    w = torch.randn(50, device=DEVICE)
    torch.testing.assert_close(primer.weighted_sum(x, w), (x * w).sum(-1), rtol=1e-5, atol=1e-5)


def test_weighted_sum_gradcheck_float64():
    x = torch.randn(20, 40, device=DEVICE, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, device=DEVICE, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(primer.weighted_sum, (x, w), fast_mode=True)


def test_weighted_sum_rejects_bad_input():
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"weight must have shape \(D,\)"):
        primer.weighted_sum(x, torch.randn(7, device=DEVICE))
    with pytest.raises(ValueError, match=r"weight must have shape \(D,\)"):
        primer.weighted_sum(x, torch.randn(1, 8, device=DEVICE))
    with pytest.raises(TypeError, match="share one dtype"):
        primer.weighted_sum(x, torch.randn(8, device=DEVICE, dtype=torch.float16))
    with pytest.raises(TypeError, match="dtype torch.int64"):
        primer.weighted_sum(torch.ones(4, 8, dtype=torch.int64, device=DEVICE), torch.ones(8, device=DEVICE))
    with pytest.raises(TypeError, match="torch.Tensor"):
        primer.weighted_sum(x, None)
    with pytest.raises(ValueError, match="non-empty last dim"):
        primer.weighted_sum(torch.randn(4, 0, device=DEVICE), torch.randn(0, device=DEVICE))
    with pytest.raises(ValueError, match="Triton kernels run on"):
        primer.weighted_sum(torch.randn(4, 8, device="meta"), torch.randn(8, device="meta"))


# ------------------------------------------------------------------------------------------ softmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (5, 37), (2, 3, 128)])
def test_softmax_matches_torch(shape, dtype):
    x = (3 * torch.randn(shape, device=DEVICE)).to(dtype)
    got = primer.softmax(x)
    want = torch.softmax(x.double(), dim=-1)
    assert got.dtype == dtype and got.shape == x.shape, case(shape=shape, dtype=dtype)
    torch.testing.assert_close(
        got.double(), want, **SOFTMAX_TOL[dtype], msg=lambda m: f"{case(shape=shape, dtype=dtype)}: {m}"
    )


def test_softmax_large_inputs_do_not_overflow():
    x = torch.randn(4, 50, device=DEVICE) * 1000  # exp(1000) overflows without subtracting the max
    got = primer.softmax(x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, torch.softmax(x, dim=-1))


@pytest.mark.parametrize("view", ["rows strided", "columns strided"])
def test_softmax_strided_input(view):
    base = torch.randn(12, 40, device=DEVICE)
    x = base[::3] if view == "rows strided" else base[:, ::2]
    torch.testing.assert_close(primer.softmax(x), torch.softmax(x, dim=-1), msg=lambda m: f"{view}: {m}")


def test_softmax_rejects_bad_input():
    with pytest.raises(TypeError, match="dtype torch.float64"):
        primer.softmax(torch.randn(3, 4, dtype=torch.float64, device=DEVICE))
    with pytest.raises(TypeError, match="dtype torch.int32"):
        primer.softmax(torch.ones(3, 4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="do not fit in one program"):
        primer.softmax(torch.randn(1, primer.MAX_SOFTMAX_COLS + 1, device=DEVICE))
    with pytest.raises(ValueError, match="non-empty last dim"):
        primer.softmax(torch.randn(3, 0, device=DEVICE))
    with pytest.raises(TypeError, match="torch.Tensor"):
        primer.softmax([1.0, 2.0])


# ------------------------------------------------------------------------------------- GPU sizes


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_primer_gpu_sizes(dtype):
    x = torch.randn(4096, 3000, device=DEVICE).to(dtype)
    torch.testing.assert_close(
        primer.softmax(x).double(), torch.softmax(x.double(), -1), **SOFTMAX_TOL[dtype]
    )
    n = 10_000_019
    a, b = torch.randn(n, device=DEVICE).to(dtype), torch.randn(n, device=DEVICE).to(dtype)
    torch.testing.assert_close(primer.add(a, b), a + b)
    w = torch.randn(3000, device=DEVICE).to(dtype)
    want = (x.double() * w.double()).sum(-1)
    tol = TOL[dtype]  # a sum of 3000 products: atol grows with sqrt(length), as on the CPU
    torch.testing.assert_close(
        primer.weighted_sum(x, w).double(), want, rtol=tol["rtol"], atol=tol["atol"] * 3000**0.5
    )
