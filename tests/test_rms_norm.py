"""Tests of course_lib.fused.rms_norm (notebook 11): fused RMSNorm, forward and backward, its launch
settings and the dW column sum.

Ground truth is float64 (`rms_norm_reference`, differentiated by autograd for the gradients). Hugging
Face's LlamaRMSNorm is compared with when transformers is installed; its casting rules are also checked
against the same formula written out here. On the CPU the kernels run in Triton's interpreter, so rows
are few; GPU-sized bf16 cases are marked `gpu`. Note: the interpreter rounds float32 -> bfloat16 towards
zero (a GPU rounds to nearest), so bf16 tolerances here allow 2 units in the last place
(`testing.ULP_TOL`).
"""

from __future__ import annotations

import pytest
import torch

import course_lib
from course_lib.fused import RMSNorm, rms_norm, rms_norm_reference
from course_lib.fused.rms_norm import DW_MODES
from course_lib.testing import assert_close_in_ulps, dtype_name, eager_and_compiled
from course_lib.testing import seeded_randn as _randn

DEVICE = course_lib.DEVICE
ON_GPU = course_lib.ON_GPU
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU with compiled Triton kernels")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def llama_rms_norm_formula(x, weight, eps):
    """Hugging Face's LlamaRMSNorm.forward, written out: float32 statistics, cast, then the weight."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


RMS_SHAPES = [(3, 5, 64), (3, 100), (2, 4544), (2, 5120)]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("shape", RMS_SHAPES, ids=str)
def test_rms_norm_forward_matches_float64(shape, dtype):
    x, w = _randn(*shape, dtype=dtype), _randn(shape[-1], dtype=dtype, seed=1)
    y = rms_norm(x, w, eps=1e-6)
    assert y.shape == x.shape and y.dtype == dtype
    assert_close_in_ulps(
        y, rms_norm_reference(x, w, 1e-6), dtype, f"rms_norm forward {shape} {dtype_name(dtype)}", scale=2
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_name)
@pytest.mark.parametrize("shape", [(3, 5, 64), (2, 4544)], ids=str)
def test_rms_norm_follows_llama_casting_rules(shape, dtype):
    """Same roundings as LlamaRMSNorm: cast to x's dtype before the weight, so the results agree to
    one unit in the last place (the sums of squares are added in a different order)."""
    x, w = _randn(*shape, dtype=dtype), _randn(shape[-1], dtype=dtype, seed=1)
    assert_close_in_ulps(
        rms_norm(x, w),
        llama_rms_norm_formula(x, w, 1e-6),
        dtype,
        f"vs Llama formula {shape} {dtype_name(dtype)}",
    )


def test_rms_norm_weight_of_another_dtype_promotes_like_pytorch():
    x, w = _randn(4, 48, dtype=torch.float16), _randn(48, dtype=torch.float32, seed=1)
    y = rms_norm(x, w)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, llama_rms_norm_formula(x, w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dw_mode", DW_MODES)
@pytest.mark.parametrize("shape", [(3, 5, 64), (9, 4544)], ids=str)
def test_rms_norm_backward_matches_float64(shape, dw_mode):
    dtype = torch.float32
    x = _randn(*shape, dtype=dtype).requires_grad_()
    w = _randn(shape[-1], dtype=dtype, seed=1).requires_grad_()
    dy = _randn(*shape, dtype=dtype, seed=2)
    rms_norm(x, w, dw_mode=dw_mode).backward(dy)
    x64 = x.detach().double().cpu().requires_grad_()
    w64 = w.detach().double().cpu().requires_grad_()
    rms_norm_reference(x64, w64).backward(dy.double().cpu())
    what = f"rms_norm backward {shape} dw_mode={dw_mode}"
    assert_close_in_ulps(x.grad, x64.grad, dtype, f"{what} dx", scale=2)
    assert_close_in_ulps(w.grad, w64.grad, dtype, f"{what} dw", scale=10)  # a sum over rows: larger numbers


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_name)
def test_rms_norm_backward_half_precision(dtype):
    shape = (6, 320)
    x = _randn(*shape, dtype=dtype).requires_grad_()
    w = _randn(shape[-1], dtype=dtype, seed=1).requires_grad_()
    dy = _randn(*shape, dtype=dtype, seed=2)
    rms_norm(x, w).backward(dy)
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    rms_norm_reference(x64, w64).backward(dy.double().cpu())
    assert_close_in_ulps(x.grad, x64.grad, dtype, f"dx {dtype_name(dtype)}", scale=2)
    # dw sums 6 products each rounded by the cast x_hat: allow a few units of the largest term
    assert_close_in_ulps(w.grad, w64.grad, dtype, f"dw {dtype_name(dtype)}", scale=4)


def test_rms_norm_non_contiguous_input_and_expanded_gradient():
    base = _randn(64, 6, dtype=torch.float32)
    x = base.t().requires_grad_()  # (6, 64), strides (1, 6)
    w = _randn(64, dtype=torch.float32, seed=1).requires_grad_()
    y = rms_norm(x, w)
    assert_close_in_ulps(y, rms_norm_reference(x, w), torch.float32, "transposed x")
    y.sum().backward()  # dy is a stride-0 expanded tensor of ones
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    rms_norm_reference(x64, w64).sum().backward()
    assert_close_in_ulps(x.grad, x64.grad, torch.float32, "transposed x, dx", scale=2)
    assert_close_in_ulps(w.grad, w64.grad, torch.float32, "transposed x, dw", scale=10)


def test_rms_norm_dw_modes_agree_and_partials_is_deterministic():
    shape = (13, 96)
    x, w, dy = _randn(*shape), _randn(shape[-1], seed=1), _randn(*shape, seed=2)
    grads = {}
    for mode in DW_MODES:
        for run in range(2):
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            rms_norm(xi, wi, dw_mode=mode).backward(dy)
            grads[mode, run] = (xi.grad, wi.grad)
    assert torch.equal(grads["partials", 0][1], grads["partials", 1][1]), "partials: dw differs between runs"
    for mode in DW_MODES:
        torch.testing.assert_close(
            grads[mode, 0][1], grads["partials", 0][1], msg=lambda m, mode=mode: f"dw {mode}: {m}"
        )
        assert torch.equal(grads[mode, 0][0], grads["partials", 0][0]), f"dx of {mode} differs"


def test_rms_norm_gradcheck_float64():
    x = _randn(3, 2, 24, dtype=torch.float64).requires_grad_()
    w = _randn(24, dtype=torch.float64, seed=1).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-6), (x, w), fast_mode=True)


def test_rms_norm_takes_numpy_eps():
    import numpy as np

    x, w = _randn(2, 8), _randn(8, seed=1)
    torch.testing.assert_close(rms_norm(x, w, np.float32(1e-6)), rms_norm(x, w, 1e-6))


def test_rms_norm_module_and_empty_input():
    layer = RMSNorm(40, eps=1e-5).to(DEVICE)
    x = _randn(2, 3, 40)
    torch.testing.assert_close(layer(x), llama_rms_norm_formula(x, layer.weight, 1e-5))
    assert "eps=1e-05" in repr(layer)
    empty = torch.empty(0, 40, device=DEVICE, requires_grad=True)
    out = rms_norm(empty, layer.weight)
    out.sum().backward()
    assert out.shape == (0, 40) and torch.equal(layer.weight.grad, torch.zeros(40, device=DEVICE))


def test_rms_norm_matches_transformers_llama_rms_norm():
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    for dtype in DTYPES:
        hf = modeling.LlamaRMSNorm(4544, eps=1e-6).to(device=DEVICE, dtype=dtype)
        with torch.no_grad():
            hf.weight.copy_(_randn(4544, dtype=dtype, seed=1))
        x = _randn(3, 4544, dtype=dtype)
        scale = 2 if dtype == torch.bfloat16 else 1
        assert_close_in_ulps(
            rms_norm(x, hf.weight, hf.variance_epsilon),
            hf(x),
            dtype,
            f"vs LlamaRMSNorm {dtype_name(dtype)}",
            scale,
        )


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda: rms_norm(_randn(2, 8), _randn(7)), ValueError, "weight must have shape"),
        (lambda: rms_norm(_randn(2, 8).int(), _randn(8)), TypeError, "dtype"),
        (lambda: rms_norm(torch.randn(2, 8, device="meta"), _randn(8)), ValueError, "Triton kernels run on"),
        (lambda: rms_norm(_randn(2, 8), _randn(8), dw_mode="fast"), ValueError, "dw_mode"),
        (lambda: rms_norm(_randn(2, 8), _randn(8), eps=-1.0), ValueError, "eps"),
        (lambda: rms_norm(_randn(2, 8), _randn(8), eps=float("inf")), ValueError, "eps must be a finite number"),
        (lambda: rms_norm(_randn(2, 8), _randn(8), eps=float("nan")), ValueError, "eps must be a finite number"),
        (lambda: rms_norm(_randn(2, 8), _randn(8), eps=True), TypeError, "eps must be a number, got True"),
        (lambda: rms_norm(_randn(2, 8), _randn(8), eps="1e-6"), TypeError, "eps must be a number"),
        (lambda: rms_norm(_randn(2, 8), _randn(8), eps=0.0), ValueError, "eps must be a finite number > 0"),
        (lambda: rms_norm(_randn(2, 8), _randn(8), eps=1e-50), ValueError, "eps=1e-50 is 0 in float32"),
        (lambda: rms_norm(_randn(2, 8), _randn(8), eps=2.0**-150), ValueError, "is 0 in float32"),
        (lambda: RMSNorm(-1), ValueError, "^RMSNorm: hidden must be >= 1, got -1"),
        (lambda: RMSNorm(8.0), TypeError, "^RMSNorm: hidden must be an integer"),
        (lambda: RMSNorm(8, eps=-1e-6), ValueError, "^RMSNorm: eps must be a finite number > 0"),
        (lambda: rms_norm(_randn(2, 0), _randn(0)), ValueError, "D >= 1"),
        (lambda: rms_norm([1.0, 2.0], _randn(2)), TypeError, "torch.Tensor"),
        (lambda: rms_norm(_randn(2, 8), _randn(8, dtype=torch.float64)), TypeError, "float64 weight"),
        (
            lambda: rms_norm(_randn(2, 8, dtype=torch.bfloat16), _randn(8, dtype=torch.float64)),
            TypeError,
            "float64 weight",
        ),
    ],
    ids=["weight shape", "int dtype", "device", "dw_mode", "eps", "eps inf", "eps nan", "eps bool", "eps str",
         "eps 0 (0/0 on a zero row)", "eps 0 in float32", "eps half the least subnormal",
         "module hidden", "module hidden float", "module eps",
         "empty D", "not a tensor", "float64 weight",
         "float64 weight, bf16 x"],
)  # fmt: skip
def test_rms_norm_clear_errors(make, error, words):
    with pytest.raises(error, match=words):
        make()


# Launch settings (course_lib/fused/launch.py tables, overridden by keyword): every value on small sizes.
ROWS = [1, 2, 4, 8]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", [(5, 4544), (3, 3, 5120), (7, 40)], ids=str)
def test_rms_norm_forward_rows_per_program(shape, rows):
    """ROWS rows per program, including ROWS that do not divide the rows and D not a power of two."""
    from course_lib.fused.rms_norm import rms_norm_forward

    x, w = _randn(*shape, dtype=torch.float32), _randn(shape[-1], seed=1)
    y, rstd = rms_norm_forward(x, w, 1e-6, rows=rows, warps=4, chunk=0)
    what = f"rms_norm forward {shape} rows={rows}"
    assert_close_in_ulps(y, rms_norm_reference(x, w), torch.float32, what, scale=2)
    expected_rstd = torch.rsqrt(x.double().cpu().pow(2).mean(-1) + 1e-6).reshape(-1)
    assert_close_in_ulps(rstd, expected_rstd, torch.float32, f"{what} rstd")


@pytest.mark.parametrize("chunk", [16, 256, 4096])
@pytest.mark.parametrize("shape", [(5, 4544), (3, 2, 8192), (7, 40)], ids=str)
def test_rms_norm_forward_chunked(shape, chunk):
    """The chunked kernel (one row per program, read in pieces): pieces that divide D, that do not, and
    one larger than the row; LlamaRMSNorm's casts in bf16 too."""
    from course_lib.fused.rms_norm import rms_norm_forward

    for dtype in (torch.float32, torch.bfloat16):
        x, w = _randn(*shape, dtype=dtype), _randn(shape[-1], seed=1, dtype=dtype)
        y, rstd = rms_norm_forward(x, w, 1e-6, warps=4, chunk=chunk)
        y_rows, rstd_rows = rms_norm_forward(x, w, 1e-6, rows=1, warps=4, chunk=0)
        what = f"rms_norm chunked forward {shape} {dtype} chunk={chunk}"
        assert_close_in_ulps(y, rms_norm_reference(x, w), dtype, what, scale=2)
        assert torch.equal(rstd, rstd_rows) or torch.allclose(rstd, rstd_rows, rtol=1e-6), what
        if dtype == torch.float32:
            assert torch.allclose(y, y_rows, rtol=1e-5, atol=1e-6), what


@pytest.mark.parametrize("chunk", [0, 4096], ids=["rows kernel", "chunked kernel"])
def test_rms_norm_without_gradient_skips_rstd(chunk):
    """Under no_grad, or with inputs that need no gradient, rms_norm runs the forward alone without
    storing rstd (store_rstd=False returns None for it) and gives the same y, bit for bit, as the
    differentiable path; the differentiable path still stores rstd and its backward is unchanged."""
    from course_lib.fused.rms_norm import rms_norm_forward

    x, w = _randn(3, 5, 4544, dtype=torch.bfloat16), _randn(4544, seed=1, dtype=torch.bfloat16)
    y_store, rstd = rms_norm_forward(x, w, 1e-6, warps=4, chunk=chunk)
    y_skip, none = rms_norm_forward(x, w, 1e-6, warps=4, chunk=chunk, store_rstd=False)
    assert none is None and rstd.shape == (15,)
    assert torch.equal(y_skip, y_store)
    with torch.no_grad():
        y_nograd = rms_norm(x.requires_grad_(), w)
    assert not y_nograd.requires_grad and torch.equal(y_nograd, rms_norm(x.detach(), w))
    y_grad = rms_norm(x, w)
    assert y_grad.requires_grad and torch.equal(y_grad.detach(), y_nograd)
    x64 = x.detach().double().cpu().requires_grad_()
    rms_norm_reference(x64, w.double().cpu()).backward(torch.ones_like(x64))
    (dx,) = torch.autograd.grad(y_grad, x, torch.ones_like(y_grad))
    assert_close_in_ulps(dx, x64.grad, torch.bfloat16, "rms_norm dx after a no-grad call", scale=2)


@pytest.mark.parametrize("dw_sum", ["triton", "torch"])
@pytest.mark.parametrize("dw_mode", DW_MODES)
@pytest.mark.parametrize("rows, programs", [(1, 1), (2, 3), (4, 2), (8, 1), (2, 8)], ids=str)
def test_rms_norm_backward_launch_settings(rows, programs, dw_mode, dw_sum):
    """The backward with ROWS rows per loop step (7 rows: ROWS does not divide them), any number of
    programs (under the interpreter `programs_per_sm` is the program count), each dW mode and both second
    reductions, on a non-contiguous input with D not a power of two."""
    from course_lib.fused.rms_norm import rms_norm_backward, rms_norm_forward

    hidden = 4544
    x = _randn(hidden, 7).t()  # (7, D), strides (1, 7): made contiguous by the host code
    w, dy = _randn(hidden, seed=1), _randn(7, hidden, seed=2)
    _, rstd = rms_norm_forward(x, w, 1e-6)
    dx, dw = rms_norm_backward(dy, x, w, rstd, dw_mode, rows=rows, programs_per_sm=programs, dw_sum=dw_sum)
    x64, w64 = x.double().cpu().requires_grad_(), w.double().cpu().requires_grad_()
    rms_norm_reference(x64, w64).backward(dy.double().cpu())
    what = f"rms_norm backward rows={rows} programs={programs} {dw_mode} dw_sum={dw_sum}"
    assert_close_in_ulps(dx, x64.grad, torch.float32, f"{what} dx", scale=2)
    assert_close_in_ulps(dw, w64.grad, torch.float32, f"{what} dw", scale=10)
    if dw_mode == "partials":  # again, with the streaming cache hints switched (D = 4544 has them on)
        again = rms_norm_backward(
            dy, x, w, rstd, dw_mode, rows=rows, programs_per_sm=programs, dw_sum=dw_sum, stream=False
        )
        assert torch.equal(again[1], dw), f"{what}: dw differs between runs"
        assert torch.equal(again[0], dx), f"{what}: dx differs with the streaming hints off"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=dtype_name)
@pytest.mark.parametrize("tile", [(16, 32, 1), (32, 64, 4), (64, 16, 2)], ids=str)
def test_column_sum_kernel(tile, dtype):
    """The dW second reduction: the column sums of a (P, D) buffer, P and D not multiples of the tile,
    cast to the output dtype; the same bits every run."""
    from course_lib.fused.launch import ColumnSumTile
    from course_lib.fused.rms_norm import column_sum

    buf = _randn(37, 300, dtype=dtype, seed=4)
    out = column_sum(buf, torch.float16, ColumnSumTile(*tile))
    assert out.dtype == torch.float16 and out.shape == (300,)
    assert_close_in_ulps(
        out, buf.double().cpu().sum(0), torch.float16, f"column_sum {tile} {dtype_name(dtype)}"
    )
    assert torch.equal(column_sum(buf, torch.float16, ColumnSumTile(*tile)), out)


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("hidden", [2048, 4544, 5120, 8192])
def test_gpu_rms_norm_bf16_real_sizes(hidden):
    rows = 4096
    x = _randn(rows, hidden, dtype=torch.bfloat16).requires_grad_()
    w = _randn(hidden, dtype=torch.bfloat16, seed=1).requires_grad_()
    dy = _randn(rows, hidden, dtype=torch.bfloat16, seed=2)
    y = rms_norm(x, w)
    torch.testing.assert_close(y, llama_rms_norm_formula(x, w, 1e-6), rtol=8e-3, atol=8e-3)
    assert_close_in_ulps(y, rms_norm_reference(x, w), torch.bfloat16, f"GPU forward D={hidden}")
    y.backward(dy)
    x64 = x.detach().double().cpu().requires_grad_()
    w64 = w.detach().double().cpu().requires_grad_()
    rms_norm_reference(x64, w64).backward(dy.double().cpu())
    assert_close_in_ulps(x.grad, x64.grad, torch.bfloat16, f"GPU dx D={hidden}", scale=2)
    # dw sums 4096 rows: compare relative to its size
    err = (w.grad.double().cpu() - w64.grad).abs().max() / w64.grad.abs().max()
    assert err < 2e-2, f"GPU dw D={hidden}: relative error {err:.3g}"
    dws = {}
    for mode in DW_MODES:
        for run in range(2):
            xi, wi = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
            rms_norm(xi, wi, dw_mode=mode).backward(dy)
            dws[mode, run] = wi.grad
    assert torch.equal(dws["partials", 0], dws["partials", 1]), f"partials not deterministic at D={hidden}"
    for mode in DW_MODES:
        torch.testing.assert_close(dws[mode, 0], dws["partials", 0], rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.gpu
@gpu
def test_gpu_rms_norm_keep_hint_gives_the_same_bits(monkeypatch):
    """The chunked forward (D = 8192) with and without the evict_last hint on its first pass: same bits."""
    from course_lib.fused import launch
    from course_lib.fused.rms_norm import rms_norm_forward

    x = _randn(3, 100, 8192, dtype=torch.bfloat16)
    w = _randn(8192, dtype=torch.bfloat16, seed=1)
    assert launch.rms_forward(8192).chunk > 0
    results = []
    for multiple in (1 << 30, 0):  # hint off, then on
        monkeypatch.setattr(launch, "KEEP_L2_MULTIPLE", multiple)
        results.append(rms_norm_forward(x, w, 1e-6))
    for off, on in zip(*results):
        assert torch.equal(off, on)


@pytest.mark.parametrize("dw_mode", DW_MODES)
def test_rms_norm_under_torch_compile(dw_mode):
    """rms_norm inside torch.compile(fullgraph=True), forward and backward: the same bits as eagerly (the
    same kernels run inside the operators; dW to rounding where atomics or locks set the order of its
    sums), for x with leading dims and a non-contiguous view. Traced
    into, the autograd Function's Triton launch made torch.compile fail, with or without fullgraph."""
    x = _randn(3, 5, 40, dtype=torch.float32)[:, :, :36]  # rows 40 apart
    w = _randn(36, dtype=torch.float32, seed=1)
    dy = _randn(3, 5, 36, dtype=torch.float32, seed=2)
    eager, compiled = eager_and_compiled(lambda x, w: rms_norm(x, w, 1e-5, dw_mode), (x, w), (dy,))
    for name, got, want in zip(("y", "dx", "dw"), compiled[0] + compiled[1], eager[0] + eager[1]):
        if name == "dw" and dw_mode != "partials":  # atomics and locks add in whatever order they run
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(got, want), f"rms_norm ({dw_mode}) under torch.compile: {name} differs"
