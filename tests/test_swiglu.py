"""Tests of course_lib.fused.swiglu (notebook 11): silu(a) * b in one kernel, forward and backward, against float64,
on strided halves of one fused projection, under torch.compile, with bad inputs refused by name; and the Llama's MLP
on course_lib's kernels against PyTorch's. On the CPU the kernels run in Triton's interpreter (small tensors); the
GPU case at a serving step's size is marked `gpu`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import course_lib
from course_lib.fused import swiglu, swiglu_reference
from course_lib.testing import assert_close_in_ulps, dtype_name, eager_and_compiled
from course_lib.testing import seeded_randn as _randn

DEVICE = course_lib.DEVICE
gpu = pytest.mark.skipif(not course_lib.ON_GPU, reason="needs a CUDA GPU with compiled Triton kernels")


def _grads64(a, b, dy):
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    torch.autograd.backward(swiglu_reference(a64, b64), dy.double())
    return a64.grad, b64.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_name)
@pytest.mark.parametrize(
    "shape", [(5, 40), (2, 3, 1100), (7,)], ids=["rows", "3-d, two column blocks", "1-d"]
)
def test_swiglu_forward_and_backward_match_float64(dtype, shape):
    """Values of both signs and large magnitudes (silu's two tails), every dtype, rows shorter and longer than a
    program's column block: y, da, db within a few units in the last place of float64."""
    a = (4 * _randn(*shape, seed=1)).to(dtype).requires_grad_()
    b = _randn(*shape, dtype=dtype, seed=2).requires_grad_()
    dy = _randn(*shape, dtype=dtype, seed=3)
    y = swiglu(a, b)
    assert y.shape == a.shape and y.dtype == dtype and y.is_contiguous()
    assert_close_in_ulps(y, swiglu_reference(a, b), dtype, f"swiglu {dtype_name(dtype)} y")
    y.backward(dy)
    da, db = _grads64(a, b, dy)
    assert_close_in_ulps(a.grad, da, dtype, f"swiglu {dtype_name(dtype)} da", scale=2)
    assert_close_in_ulps(b.grad, db, dtype, f"swiglu {dtype_name(dtype)} db", scale=2)


def test_swiglu_on_the_halves_of_one_projection_and_without_autograd():
    """a and b as the two column halves of one (T, 2F) matmul output (a serving step's chunk: row stride 2F) give
    the bits of contiguous copies; the gradients reach the one output through chunk. With nothing to
    differentiate the forward runs without autograd's Function."""
    ab = _randn(6, 2 * 24, seed=4).requires_grad_()
    a, b = ab.chunk(2, dim=-1)
    y = swiglu(a, b)
    assert torch.equal(y, swiglu(a.detach().contiguous(), b.detach().contiguous()))
    dy = _randn(6, 24, seed=5)
    y.backward(dy)
    da, db = _grads64(a, b, dy)
    assert_close_in_ulps(ab.grad, torch.cat([da, db], dim=-1), torch.float32, "swiglu through chunk", scale=2)
    with torch.no_grad():
        out = swiglu(a, b)
    assert out.grad_fn is None and torch.equal(out, y.detach())


def test_swiglu_gradcheck_float64_and_no_second_derivative():
    a = _randn(3, 10, dtype=torch.float64, seed=6).requires_grad_()
    b = _randn(3, 10, dtype=torch.float64, seed=7).requires_grad_()
    assert torch.autograd.gradcheck(swiglu, (a, b))
    (ga,) = torch.autograd.grad(swiglu(a, b).sum(), a, create_graph=True)
    with pytest.raises(RuntimeError, match="no second derivative"):
        ga.sum().backward()


def test_swiglu_under_torch_compile():
    """Under torch.compile swiglu is PyTorch's silu(a) * b (the compiler fuses it): values and gradients as eager
    within float32 rounding."""
    a, b = _randn(4, 33, seed=8), _randn(4, 33, seed=9)
    eager, compiled = eager_and_compiled(swiglu, (a, b), (_randn(4, 33, seed=10),))
    for got, want in zip(compiled[0] + compiled[1], eager[0] + eager[1]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda: swiglu([1.0], _randn(1)), TypeError, "a must be a torch.Tensor"),
        (lambda: swiglu(_randn(3, 4), _randn(4, 3)), ValueError, r"same shape, got \(3, 4\) and \(4, 3\)"),
        (lambda: swiglu(_randn(3), _randn(3).half()), ValueError, "same dtype"),
        (lambda: swiglu(_randn(3).long(), _randn(3).long()), TypeError, "a has dtype torch.int64"),
        (
            lambda: swiglu(torch.tensor(1.0, device=DEVICE), torch.tensor(2.0, device=DEVICE)),
            ValueError,
            "0-d",
        ),
        (
            lambda: swiglu(_randn(3, device="meta"), _randn(3, device="meta")),
            (TypeError, ValueError),
            "swiglu: a",
        ),
    ],
    ids=["not a tensor", "shapes", "dtypes", "integer dtype", "0-d", "device"],
)
def test_swiglu_clear_errors(make, error, words):
    with pytest.raises(error, match=words):
        make()


@pytest.mark.parametrize("dim, hidden", [(32, 40)])
def test_llama_mlp_on_course_lib_kernels_matches_pytorch(dim, hidden):
    """The Llama's FeedForward with course_lib's backend (the fused gate), whole and as a serving step's stacked
    W1/W3, against the same module on PyTorch's ops: outputs and weight gradients within float32 rounding."""
    from course_lib.models.llama import FeedForward, LlamaConfig

    config = LlamaConfig(dim=dim, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=hidden, vocab_size=16)
    torch.manual_seed(0)
    mlp = FeedForward(config).to(DEVICE)
    x = _randn(2, 5, dim, seed=11)
    outs, grads = {}, {}
    for backend in ("sdpa", "course_lib"):
        mlp.backend = backend
        mlp.zero_grad()
        outs[backend] = mlp(x)
        outs[backend].square().sum().backward()
        grads[backend] = [p.grad.clone() for p in mlp.parameters()]
        with torch.no_grad():
            torch.testing.assert_close(mlp.step(x[0]), outs[backend][0].detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["course_lib"], outs["sdpa"], rtol=1e-5, atol=1e-5)
    for got, want in zip(grads["course_lib"], grads["sdpa"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@gpu
def test_gpu_swiglu_bf16_serving_size():
    """A serving step's gate on a GPU: the halves of a (3280, 2 x 2816) bf16 projection (the 2-D tiles), against
    float64 and against PyTorch's silu(a) * b (which rounds twice); contiguous copies (the flat kernel) give the
    same bits."""
    ab = torch.randn(3280, 2 * 2816, device="cuda", dtype=torch.bfloat16)
    a, b = ab.chunk(2, dim=-1)
    y = swiglu(a, b)
    assert_close_in_ulps(y, swiglu_reference(a, b), torch.bfloat16, "swiglu bf16 3280 x 2816")
    torch.testing.assert_close(y, F.silu(a) * b, rtol=2e-2, atol=2e-2)
    assert torch.equal(swiglu(a.contiguous(), b.contiguous()), y)  # the flat kernel: the same arithmetic
