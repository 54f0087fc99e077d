"""Tests of course_lib.fused (notebook 11): fused RMSNorm and RoPE, forward and backward.

Ground truth is float64 (`rms_norm_reference`, `rope_reference`, differentiated by autograd for the
gradients). Hugging Face's LlamaRMSNorm and apply_rotary_pos_emb are compared with when transformers is
installed; the casting rules of LlamaRMSNorm are also checked against the same formula written out here.
On the CPU the kernels run in Triton's interpreter, so rows are few; GPU-sized bf16 cases are marked
`gpu`. Note: the interpreter rounds float32 -> bfloat16 towards zero (a GPU rounds to nearest), so bf16
tolerances here allow 2 units in the last place.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import course_lib
from course_lib.fused import RMSNorm, rms_norm, rms_norm_reference, rope, rope_cache, rope_reference
from course_lib.fused.rms_norm import DW_MODES
from course_lib.testing import seeded_randn as _randn

DEVICE = course_lib.DEVICE
ON_GPU = course_lib.ON_GPU
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU with compiled Triton kernels")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (rtol, atol) against float64: about 2 units in the last place of the dtype, relative and near 1.
TOL = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _close(actual, expected, dtype, what: str, scale: float = 1.0) -> None:
    """actual (any dtype, any device) against a float64 expected, within TOL[dtype] x scale."""
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(
        actual.detach().double().cpu(),
        expected.detach().double().cpu(),
        rtol=rtol * scale,
        atol=atol * scale,
        msg=lambda m: f"{what}: {m}",
    )


def llama_rms_norm_formula(x, weight, eps):
    """Hugging Face's LlamaRMSNorm.forward, written out: float32 statistics, cast, then the weight."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


# ------------------------------------------------------------------------------------------ RMSNorm
RMS_SHAPES = [(3, 5, 64), (3, 100), (2, 4544), (2, 5120)]


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("shape", RMS_SHAPES, ids=str)
def test_rms_norm_forward_matches_float64(shape, dtype):
    x, w = _randn(*shape, dtype=dtype), _randn(shape[-1], dtype=dtype, seed=1)
    y = rms_norm(x, w, eps=1e-6)
    assert y.shape == x.shape and y.dtype == dtype
    _close(y, rms_norm_reference(x, w, 1e-6), dtype, f"rms_norm forward {shape} {_name(dtype)}", scale=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=_name)
@pytest.mark.parametrize("shape", [(3, 5, 64), (2, 4544)], ids=str)
def test_rms_norm_follows_llama_casting_rules(shape, dtype):
    """Same roundings as LlamaRMSNorm: cast to x's dtype before the weight, so the results agree to
    one unit in the last place (the sums of squares are added in a different order)."""
    x, w = _randn(*shape, dtype=dtype), _randn(shape[-1], dtype=dtype, seed=1)
    _close(
        rms_norm(x, w), llama_rms_norm_formula(x, w, 1e-6), dtype, f"vs Llama formula {shape} {_name(dtype)}"
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
    _close(x.grad, x64.grad, dtype, f"{what} dx", scale=2)
    _close(w.grad, w64.grad, dtype, f"{what} dw", scale=10)  # a sum over rows: larger numbers


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_name)
def test_rms_norm_backward_half_precision(dtype):
    shape = (6, 320)
    x = _randn(*shape, dtype=dtype).requires_grad_()
    w = _randn(shape[-1], dtype=dtype, seed=1).requires_grad_()
    dy = _randn(*shape, dtype=dtype, seed=2)
    rms_norm(x, w).backward(dy)
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    rms_norm_reference(x64, w64).backward(dy.double().cpu())
    _close(x.grad, x64.grad, dtype, f"dx {_name(dtype)}", scale=2)
    # dw sums 6 products each rounded by the cast x_hat: allow a few units of the largest term
    _close(w.grad, w64.grad, dtype, f"dw {_name(dtype)}", scale=4)


def test_rms_norm_non_contiguous_input_and_expanded_gradient():
    base = _randn(64, 6, dtype=torch.float32)
    x = base.t().requires_grad_()  # (6, 64), strides (1, 6)
    w = _randn(64, dtype=torch.float32, seed=1).requires_grad_()
    y = rms_norm(x, w)
    _close(y, rms_norm_reference(x, w), torch.float32, "transposed x")
    y.sum().backward()  # dy is a stride-0 expanded tensor of ones
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    rms_norm_reference(x64, w64).sum().backward()
    _close(x.grad, x64.grad, torch.float32, "transposed x, dx", scale=2)
    _close(w.grad, w64.grad, torch.float32, "transposed x, dw", scale=10)


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
        _close(
            rms_norm(x, hf.weight, hf.variance_epsilon),
            hf(x),
            dtype,
            f"vs LlamaRMSNorm {_name(dtype)}",
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
         "eps 0 (0/0 on a zero row)", "eps 0 in float32", "module hidden", "module hidden float", "module eps",
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
    _close(y, rms_norm_reference(x, w), torch.float32, what, scale=2)
    expected_rstd = torch.rsqrt(x.double().cpu().pow(2).mean(-1) + 1e-6).reshape(-1)
    _close(rstd, expected_rstd, torch.float32, f"{what} rstd")


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
        _close(y, rms_norm_reference(x, w), dtype, what, scale=2)
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
    _close(dx, x64.grad, torch.bfloat16, "rms_norm dx after a no-grad call", scale=2)


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
    _close(dx, x64.grad, torch.float32, f"{what} dx", scale=2)
    _close(dw, w64.grad, torch.float32, f"{what} dw", scale=10)
    if dw_mode == "partials":  # again, with the streaming cache hints switched (D = 4544 has them on)
        again = rms_norm_backward(
            dy, x, w, rstd, dw_mode, rows=rows, programs_per_sm=programs, dw_sum=dw_sum, stream=False
        )
        assert torch.equal(again[1], dw), f"{what}: dw differs between runs"
        assert torch.equal(again[0], dx), f"{what}: dx differs with the streaming hints off"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=_name)
@pytest.mark.parametrize("tile", [(16, 32, 1), (32, 64, 4), (64, 16, 2)], ids=str)
def test_column_sum_kernel(tile, dtype):
    """The dW second reduction: the column sums of a (P, D) buffer, P and D not multiples of the tile,
    cast to the output dtype; the same bits every run."""
    from course_lib.fused.launch import ColumnSumTile
    from course_lib.fused.rms_norm import column_sum

    buf = _randn(37, 300, dtype=dtype, seed=4)
    out = column_sum(buf, torch.float16, ColumnSumTile(*tile))
    assert out.dtype == torch.float16 and out.shape == (300,)
    _close(out, buf.double().cpu().sum(0), torch.float16, f"column_sum {tile} {_name(dtype)}")
    assert torch.equal(column_sum(buf, torch.float16, ColumnSumTile(*tile)), out)


def test_launch_tables_and_overrides():
    from course_lib.fused import launch
    from course_lib.fused.rms_norm import rms_norm_forward

    for table in (launch.WARPS, launch.RMS_FORWARD, launch.RMS_BACKWARD, launch.ROPE):
        bounds = [bound for bound, _ in table]
        assert bounds == sorted(bounds) and bounds[-1] == launch.MAX_ROW, table
        values = [v for _, entry in table for v in (entry[:3] if isinstance(entry, tuple) else (entry,))]
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


# --------------------------------------------------------------------------------------------- RoPE
POSITIONS = {
    "none": lambda b, t: None,
    "offset": lambda b, t: 5,
    "per-batch": lambda b, t: torch.randint(0, 20, (b, t), generator=torch.Generator().manual_seed(3)).to(
        DEVICE
    ),
}


@pytest.mark.parametrize("positions", list(POSITIONS))
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_rope_forward_matches_float64(dtype, layout, positions):
    b, t, d = 2, 6, 32
    q, k = _randn(b, 4, t, d, dtype=dtype), _randn(b, 2, t, d, dtype=dtype, seed=1)  # grouped: 4 q heads, 2 k
    cos, sin = rope_cache(24, d, layout=layout, device=DEVICE)
    pos = POSITIONS[positions](b, t)
    q_rot, k_rot = rope(q, k, cos, sin, positions=pos, layout=layout)
    what = f"rope {layout} positions={positions} {_name(dtype)}"
    assert q_rot.dtype == dtype and q_rot.shape == q.shape and k_rot.shape == k.shape
    _close(q_rot, rope_reference(q, cos, sin, pos, layout), dtype, f"{what} q")
    _close(k_rot, rope_reference(k, cos, sin, pos, layout), dtype, f"{what} k")


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_backward_matches_float64_and_is_the_negative_rotation(layout):
    b, t, d = 2, 5, 16
    q = _randn(b, 3, t, d).requires_grad_()
    k = _randn(b, 1, t, d, seed=1).requires_grad_()
    cos, sin = rope_cache(16, d, layout=layout, device=DEVICE)
    dq, dk = _randn(b, 3, t, d, seed=2), _randn(b, 1, t, d, seed=3)
    q_rot, k_rot = rope(q, k, cos, sin, positions=4, layout=layout)
    torch.autograd.backward((q_rot, k_rot), (dq, dk))
    q64, k64 = (t_.detach().double().cpu().requires_grad_() for t_ in (q, k))
    ref = rope_reference(q64, cos, sin, 4, layout), rope_reference(k64, cos, sin, 4, layout)
    torch.autograd.backward(ref, (dq.double().cpu(), dk.double().cpu()))
    _close(q.grad, q64.grad, torch.float32, f"rope {layout} dq")
    _close(k.grad, k64.grad, torch.float32, f"rope {layout} dk")
    # the same as rotating the incoming gradients by the negative angle (sin -> -sin)
    back_q, back_k = rope(dq, dk, cos, -sin, positions=4, layout=layout)
    torch.testing.assert_close(q.grad, back_q)
    torch.testing.assert_close(k.grad, back_k)


@pytest.mark.parametrize("tokens", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dims", [3, 4])
def test_rope_tokens_per_program(dims, layout, tokens, monkeypatch):
    """TOKENS tokens per program (T = 5: TOKENS does not divide it), token-major (non-contiguous) inputs,
    per-batch positions for 4-D and an offset for 3-D, forward and backward (the negative rotation).
    The launch table is swapped for one entry with the tokens under test; the calls are the public ones."""
    from course_lib.fused import launch

    monkeypatch.setattr(launch, "ROPE", ((launch.MAX_ROW, launch.RopeLaunch(tokens=tokens, warps=2)),))
    b, t, d = (2 if dims == 4 else 1), 5, 24
    q = _randn(b, t, 3, d).transpose(1, 2)  # (B, H, T, d) views of (B, T, H, d) storage
    k = _randn(b, t, 1, d, seed=1).transpose(1, 2)
    if dims == 3:
        q, k = q[0], k[0]
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    cos, sin = rope_cache(12, d, layout=layout, device=DEVICE)
    pos = POSITIONS["per-batch" if dims == 4 else "offset"](b, t)
    pos = pos.clamp(max=11) if isinstance(pos, torch.Tensor) else pos
    what = f"rope {dims}-D {layout} tokens={tokens}"
    q_rot, k_rot = rope(q, k, cos, sin, positions=pos, layout=layout)
    _close(q_rot, rope_reference(q, cos, sin, pos, layout), torch.float32, f"{what} q")
    _close(k_rot, rope_reference(k, cos, sin, pos, layout), torch.float32, f"{what} k")
    # the backward rotates by the negative angle: fed the rotated vectors, it gives back the inputs
    dq, dk = torch.autograd.grad((q_rot, k_rot), (q, k), (q_rot.detach(), k_rot.detach()))
    _close(dq, q.double().cpu(), torch.float32, f"{what} backward undoes forward, q")
    _close(dk, k.double().cpu(), torch.float32, f"{what} backward undoes forward, k")


def test_rope_token_major_layout_without_copies_and_3d_inputs():
    """(B, T, H, d) storage passed as .transpose(1, 2): the kernel follows the strides; outputs keep them."""
    t, d = 7, 24
    q = _randn(2, t, 4, d).transpose(1, 2)
    k = _randn(2, t, 2, d, seed=1).transpose(1, 2)
    cos, sin = rope_cache(t, d, device=DEVICE)
    q_rot, k_rot = rope(q, k, cos, sin)
    assert q_rot.stride() == q.stride()
    _close(q_rot, rope_reference(q, cos, sin), torch.float32, "token-major q")
    _close(k_rot, rope_reference(k, cos, sin), torch.float32, "token-major k")
    q3, k3 = rope(q[0], k[0], cos, sin)
    torch.testing.assert_close(q3, q_rot[0])
    torch.testing.assert_close(k3, k_rot[0])


def test_rope_batched_cache_and_positions_vector():
    """A (T,) positions vector and Hugging Face's gathered (B, T, d) cache, forward and backward, each
    against float64; the two give the same rotation."""
    b, t, d = 2, 4, 16
    q, k = _randn(b, 2, t, d), _randn(b, 2, t, d, seed=1)
    dq, dk = _randn(b, 2, t, d, seed=2), _randn(b, 2, t, d, seed=3)
    cos, sin = rope_cache(10, d, device=DEVICE)
    pos = torch.tensor([6, 2, 9, 0], device=DEVICE)
    cos_b, sin_b = cos[pos][None].expand(b, t, d), sin[pos][None].expand(b, t, d)  # HF's gathered (B, T, d)
    rotated = {}
    for what, c, s, p in (("positions vector", cos, sin, pos), ("batched cache", cos_b, sin_b, None)):
        q_, k_ = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        q_rot, k_rot = rope(q_, k_, c, s, positions=p)
        torch.autograd.backward((q_rot, k_rot), (dq, dk))
        q64, k64 = (t_.detach().double().cpu().requires_grad_() for t_ in (q, k))
        ref = rope_reference(q64, c, s, p), rope_reference(k64, c, s, p)
        torch.autograd.backward(ref, (dq.double().cpu(), dk.double().cpu()))
        _close(q_rot, ref[0], torch.float32, f"rope {what} q")
        _close(k_rot, ref[1], torch.float32, f"rope {what} k")
        _close(q_.grad, q64.grad, torch.float32, f"rope {what} dq")
        _close(k_.grad, k64.grad, torch.float32, f"rope {what} dk")
        rotated[what] = q_rot, k_rot
    torch.testing.assert_close(rotated["positions vector"], rotated["batched cache"])


def test_rope_kv_cache_offsets_agree_with_one_long_sequence():
    """Rotating tokens 0..T-1 at once equals rotating 0..4 and then 5..T-1 with positions=5."""
    t, d = 9, 32
    q, k = _randn(1, 2, t, d), _randn(1, 1, t, d, seed=1)
    cos, sin = rope_cache(16, d, device=DEVICE)
    q_all, k_all = rope(q, k, cos, sin)
    q_new, k_new = rope(q[:, :, 5:], k[:, :, 5:], cos, sin, positions=5)
    torch.testing.assert_close(q_new, q_all[:, :, 5:])
    torch.testing.assert_close(k_new, k_all[:, :, 5:])
    q_np, k_np = rope(q[:, :, 5:], k[:, :, 5:], cos, sin, positions=np.int64(5))  # a NumPy offset too
    assert torch.equal(q_np, q_new) and torch.equal(k_np, k_new)


_HEADS_PAST_32_BITS = """
import torch, course_lib
from course_lib.fused import rope, rope_cache, rope_reference
# 5 heads 2**29 elements apart: head 4 starts 2**31 elements in (4 GiB of float16, untouched but 64 elements)
storage = torch.empty(4 * 2**29 + 32, dtype=torch.float16, device=course_lib.DEVICE)
q = storage.as_strided((1, 5, 2, 16), (0, 2**29, 16, 1))
g = torch.Generator().manual_seed(0)
for h in range(5):
    q[0, h].copy_(torch.randn(2, 16, generator=g).half())
k = torch.randn(1, 1, 2, 16, generator=g).half().to(course_lib.DEVICE)
cos, sin = rope_cache(2, 16, device=course_lib.DEVICE)
q_rot, k_rot = rope(q, k, cos, sin)
error = (q_rot.double().cpu() - rope_reference(q, cos, sin)).abs().amax(dim=(0, 2, 3)).tolist()
assert max(error) < 2e-3, f"error per head {error}"
print("ok")
"""


def test_rope_heads_past_32_bit_offsets():
    """q whose heads lie 2**29 elements apart, 5 of them: head 4 starts 2**31 elements in, past the
    kernel's 32-bit head offsets (heads x stride). It wrapped (the interpreter died of a segmentation
    fault reading it; a GPU would read the wrong memory); rope must copy such a tensor to token-major storage
    first. Run in a child process, so that a crash is a failure with a message."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _HEADS_PAST_32_BITS], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0 and "ok" in run.stdout, (
        f"rope, q (1, 5, 2, 16) with heads 2**29 apart: exit code {run.returncode}, {run.stderr[-2000:]}"
    )


def test_rope_chooses_layouts_within_32_bit_offsets():
    """Which layout the kernel gets (meta tensors: shapes and strides only). Heads-first (B, H, T, d)
    tensors whose heads lie 2**31 elements apart or more are read from a token-major copy, and outputs
    are allocated token-major where a heads-first output would pass 2**31: a token-major slice of a
    fused QKV projection (not dense, so empty_like gives (B, H, T, d)) at 32 heads of 128, 600k tokens."""
    from course_lib.fused.rope import kernel_input, kernel_output

    small = torch.empty(1, 32, 1000, 128, device="meta")
    assert kernel_input(small) is small and kernel_output(small).stride() == small.stride()
    long = torch.empty(1, 32, 600_000, 128, device="meta")  # heads 76.8M elements apart: 31 x that > 2**31
    for what, t in (("input", kernel_input(long)), ("output", kernel_output(long))):
        assert t.shape == long.shape and t.stride(1) == 128 and t.stride(2) == 32 * 128, (
            f"rope {what} of (1, 32, 600000, 128) heads-first: strides {t.stride()}"
        )
    qkv = torch.empty(1, 600_000, 3, 32, 128, device="meta")
    q = qkv[:, :, 0].transpose(1, 2)  # (B, H, T, d) view, heads d apart, not dense
    assert kernel_input(q) is q
    out = kernel_output(q)
    assert out.shape == q.shape and out.stride(1) == 128, (
        f"rope output of a fused QKV slice: strides {out.stride()}"
    )
    strided_d = torch.empty(1, 32, 600_000, 256, device="meta")[..., ::2]  # d not contiguous, heads-first
    t = kernel_input(strided_d)
    assert t.stride(-1) == 1 and t.stride(1) == 128, f"rope input with strided d: strides {t.stride()}"


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_gradcheck_float64(layout):
    cos, sin = rope_cache(12, 8, dtype=torch.float64, device=DEVICE, layout=layout)
    q = _randn(1, 2, 4, 8, dtype=torch.float64).requires_grad_()
    k = _randn(1, 1, 4, 8, dtype=torch.float64, seed=1).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: rope(a, b, cos, sin, 3, layout), (q, k), fast_mode=True)


def test_rope_cache_values():
    cos, sin = rope_cache(5, 8, base=100.0, device="cpu")
    theta = 100.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    angles = torch.arange(5, dtype=torch.float64)[:, None] * theta
    torch.testing.assert_close(cos.double(), torch.cat((angles, angles), -1).cos(), rtol=1e-6, atol=1e-6)
    cos_i, sin_i = rope_cache(5, 8, base=100.0, device="cpu", layout="interleaved")
    torch.testing.assert_close(sin_i.double(), angles.repeat_interleave(2, -1).sin(), rtol=1e-6, atol=1e-6)


def test_rope_matches_transformers():
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    config = modeling.LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    rotary = modeling.LlamaRotaryEmbedding(config=config).to(DEVICE)
    b, t, d = 2, 6, 64
    for dtype in DTYPES:
        q, k = _randn(b, 4, t, d, dtype=dtype), _randn(b, 2, t, d, dtype=dtype, seed=1)
        position_ids = torch.arange(3, 3 + t, device=DEVICE)[None].expand(b, t)
        cos_hf, sin_hf = rotary(q, position_ids)  # (B, T, d) in q's dtype
        q_hf, k_hf = modeling.apply_rotary_pos_emb(q, k, cos_hf, sin_hf)
        cos, sin = rope_cache(16, d, device=DEVICE, dtype=dtype)
        torch.testing.assert_close(
            cos[3 : 3 + t], cos_hf[0], msg=lambda m, dtype=dtype: f"cos cache {_name(dtype)}: {m}"
        )
        q_rot, k_rot = rope(q, k, cos, sin, positions=3)
        scale = 1 if dtype == torch.float32 else 2  # Hugging Face rounds three times in 16-bit
        _close(q_rot, q_hf, dtype, f"vs apply_rotary_pos_emb q {_name(dtype)}", scale)
        _close(k_rot, k_hf, dtype, f"vs apply_rotary_pos_emb k {_name(dtype)}", scale)


def _qk(d=16, t=4, dtype=torch.float32):
    return _randn(1, 2, t, d, dtype=dtype), _randn(1, 2, t, d, dtype=dtype, seed=1)


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda: rope(*_qk(d=15), *rope_cache(8, 16, device=DEVICE)), ValueError, "must be even"),
        (lambda: rope(*_qk(), *rope_cache(8, 32, device=DEVICE)), ValueError, "d=16"),
        (lambda: rope(*_qk(), *rope_cache(8, 8, device=DEVICE)), ValueError, "partial rotary"),
        (lambda: rope(*_qk(t=9), *rope_cache(8, 16, device=DEVICE)), ValueError, "rows"),
        (lambda: rope(*_qk(), *rope_cache(8, 16, device=DEVICE), positions=6), ValueError, "positions 6..9"),
        (
            lambda: rope(*_qk(), *rope_cache(8, 16, device=DEVICE), positions=torch.arange(3, device=DEVICE)),
            ValueError,
            "shape",
        ),
        (
            lambda: rope(*_qk(), *rope_cache(8, 16, device=DEVICE), positions=torch.arange(5, 9, device=DEVICE)),
            ValueError,
            r"positions run from 5 to 8, but cos and sin have rows 0\.\.7",
        ),
        (
            lambda: rope(*_qk(), *rope_cache(8, 16, device=DEVICE), positions=torch.arange(-1, 3, device=DEVICE)),
            ValueError,
            "positions run from -1 to 2",
        ),
        (
            lambda: rope(*_qk(), *rope_cache(8, 16, device=DEVICE), positions=torch.arange(4.0, device=DEVICE)),
            TypeError,
            "int32 or int64",
        ),
        (
            lambda: rope(_qk()[0], _qk(dtype=torch.float16)[1], *rope_cache(8, 16, device=DEVICE)),
            TypeError,
            "one dtype",
        ),
        (lambda: rope(*_qk(), *rope_cache(8, 16, device=DEVICE), layout="neox"), ValueError, "layout"),
        (
            lambda: rope(torch.randn(1, 2, 4, 16, device="meta"), _qk()[1], *rope_cache(8, 16, device=DEVICE)),
            ValueError,
            "Triton kernels run on",
        ),
        (lambda: rope(_randn(2, 4, 16), _randn(1, 2, 4, 16), *rope_cache(8, 16, device=DEVICE)), ValueError, "both"),
    ],
    ids=["odd d", "cache d", "partial rotary", "too few rows", "offset", "positions shape", "positions past the cache",
         "negative positions", "float positions", "dtypes", "layout", "device", "dims"],
)  # fmt: skip
def test_rope_clear_errors(make, error, words):
    with pytest.raises(error, match=words):
        make()


def test_cache_and_module_arguments():
    """rope_cache and RMSNorm refuse a dtype that cannot hold cos, sin or a learned weight, by name; a NumPy
    base is a number like any other."""
    import numpy as np

    with pytest.raises(TypeError, match="rope_cache: dtype must be a floating-point"):
        rope_cache(8, 16, dtype=torch.int32)
    with pytest.raises(TypeError, match="rope_cache: dtype must be a floating-point"):
        rope_cache(8, 16, dtype="float16")
    with pytest.raises(ValueError, match="rope_cache: base"):
        rope_cache(8, 16, base=1.0)
    torch.testing.assert_close(rope_cache(8, 16, base=np.float32(500)), rope_cache(8, 16, base=500))
    with pytest.raises(TypeError, match="RMSNorm: dtype must be a floating-point"):
        RMSNorm(8, dtype=torch.int64)


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
    _close(y, rms_norm_reference(x, w), torch.bfloat16, f"GPU forward D={hidden}")
    y.backward(dy)
    x64 = x.detach().double().cpu().requires_grad_()
    w64 = w.detach().double().cpu().requires_grad_()
    rms_norm_reference(x64, w64).backward(dy.double().cpu())
    _close(x.grad, x64.grad, torch.bfloat16, f"GPU dx D={hidden}", scale=2)
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
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_gpu_rope_bf16_real_sizes(layout):
    t, d = 4096, 128
    q = _randn(1, t, 32, d, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k = _randn(1, t, 8, d, dtype=torch.bfloat16, seed=1).transpose(1, 2).requires_grad_()
    cos, sin = rope_cache(2 * t, d, device=DEVICE, layout=layout)
    q_rot, k_rot = rope(q, k, cos, sin, positions=t, layout=layout)
    _close(q_rot, rope_reference(q, cos, sin, t, layout), torch.bfloat16, f"GPU rope {layout} q")
    _close(k_rot, rope_reference(k, cos, sin, t, layout), torch.bfloat16, f"GPU rope {layout} k")
    dq, dk = torch.randn_like(q_rot), torch.randn_like(k_rot)
    torch.autograd.backward((q_rot, k_rot), (dq, dk))
    back_q, back_k = rope(dq, dk, cos, -sin, positions=t, layout=layout)
    torch.testing.assert_close(q.grad, back_q)
    torch.testing.assert_close(k.grad, back_k)


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
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_gpu_rope_cache_hint_gives_the_same_bits(layout, monkeypatch):
    """The same rotation, forward and backward, with the evict_last hint (forced on small tensors) and
    without it: a cache hint must not change a bit."""
    from course_lib.fused import launch

    t, d = 1000, 128
    q = _randn(2, t, 32, d, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k = _randn(2, t, 8, d, dtype=torch.bfloat16, seed=1).transpose(1, 2).requires_grad_()
    cos, sin = rope_cache(2 * t, d, device=DEVICE, layout=layout)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    results = []
    for multiple in (1 << 30, 0):  # hint off, then on
        monkeypatch.setattr(launch, "KEEP_L2_MULTIPLE", multiple)
        q.grad = k.grad = None
        q_rot, k_rot = rope(q, k, cos, sin, positions=7, layout=layout)
        torch.autograd.backward((q_rot, k_rot), (dq, dk))
        results.append((q_rot, k_rot, q.grad, k.grad))
    for off, on in zip(*results):
        assert torch.equal(off, on)


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


# ------------------------------------------------------------------------------------------ benchmark
def test_bench_tables_and_targets_read_a_record(tmp_path):
    """format_table, target_misses and save_plots on a made-up record (the measuring needs a GPU)."""
    from course_lib.bench import fused as bench

    def row(kernel, provider, mode, gbps, **cell):
        return {"kernel": kernel, "provider": provider, "mode": mode, "status": "ok", "ms": 1.0, "gbps": gbps,
                "copy_fraction": gbps / 4000, "timing": "graph", "graph_gbps": gbps, "plain_gbps": gbps / 2,
                **cell}  # fmt: skip

    data = {"dtype": "bfloat16", "copy_gbps": 4000.0, "targets": bench.TARGETS, "quick": True, "dw_modes": []}
    data["rms_norm"] = [
        row("rms_norm", p, m, g, T=16384, D=4096)
        for m in ("fwd", "bwd")
        for p, g in zip(bench.RMS_PROVIDERS, (500, 2000, 3000, 3600 if m == "fwd" else 2900))
    ]
    data["rope"] = [
        row("rope", p, m, g, T=16384)
        for m in ("fwd", "bwd")
        for p, g in zip(bench.ROPE_PROVIDERS, (900, 3000, 3300))
    ]
    table = bench.format_table(data)
    assert (
        "| fwd | 16384 | 4096 | 500 (250) | 2000 (1000) | 3000 (1500) | 3600 (1800) | 1.20x | 90 % |" in table
    )
    assert "CUDA-graph replay" in table.splitlines()[0], table
    misses = bench.target_misses(data)
    assert misses == [
        "rms_norm mode=bwd T=16384 D=4096: 0.97x torch.compile (target >= 1.0x; CUDA-graph replay)",
        "rms_norm mode=bwd T=16384 D=4096: 72% of the copy ceiling (target 85 %; CUDA-graph replay)",
    ], misses
    for r in data["rms_norm"] + data["rope"]:  # a record without graph figures: plain numbers, said so
        r.pop("timing"), r.pop("plain_gbps")
    assert "| fwd | 16384 | 4096 | 500 | 2000 | 3000 | 3600 | 1.20x | 90 % |" in bench.format_table(data)
    assert bench.target_misses(data)[0].endswith("(target >= 1.0x; plain launches)")
    paths = bench.save_plots(data, tmp_path, "test")
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)
    assert bench.rms_norm_bytes(4, 8, "fwd") == (2 * 32 + 8) * 2 + 16
    assert bench.rope_bytes(1) == (2 * 40 * 128 + 2 * 128) * 2


def test_bench_backward_figure_subtracts_the_training_forward(monkeypatch):
    """The backward's graph time is (forward + backward) - the forward with grad enabled (what a training
    step runs; torch.compile compiles it apart from the no_grad forward), not - the no_grad forward.
    The timers are stand-ins that say which forward they were given (the real ones need a GPU)."""
    from course_lib.bench import fused as bench

    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append("train")
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append("backward")
            return g * 2

    def fn(x):
        if torch.is_grad_enabled():
            return Probe.apply(x)
        seen.append("no_grad")
        return x * 2

    def fake_graph_ms(f):
        seen.clear()
        f()
        return {("no_grad",): 1.0, ("train",): 2.0, ("train", "backward"): 5.0}[tuple(seen)]

    monkeypatch.setattr(bench, "graph_ms", fake_graph_ms)
    monkeypatch.setattr(bench, "benchmark", lambda f: (f(), 1.0)[1])
    x, dy = torch.randn(8, requires_grad=True), torch.randn(8)
    fwd, bwd = bench._measure_fwd_bwd(fn, (x,), (dy,), {"fwd": 10**6, "bwd": 10**6}, 1.0)
    assert fwd["graph_ms"] == 1.0, fwd
    assert (bwd["graph_fwd_bwd_ms"], bwd["graph_train_fwd_ms"], bwd["graph_ms"]) == (5.0, 2.0, 3.0), bwd


# --------------------------------------------------------------------------------------------------
# torch.compile: the custom operators (course_lib/fused/op.py)
# --------------------------------------------------------------------------------------------------
def _eager_and_compiled(fn, inputs, grad_out):
    """(outputs, input gradients) of fn eagerly, then under torch.compile(fullgraph=True) (the aot_eager
    backend: on the CPU the kernels are interpreted; a graph break raises)."""
    results = []
    torch._dynamo.reset()
    for run in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        outs = run(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(outs, grad_out)
        results.append((tuple(o.detach() for o in outs), tuple(t.grad for t in leaves)))
    return results


@pytest.mark.parametrize("dw_mode", DW_MODES)
def test_rms_norm_under_torch_compile(dw_mode):
    """rms_norm inside torch.compile(fullgraph=True), forward and backward: the same bits as eagerly (the
    same kernels run inside the operators; dW to rounding where atomics or locks set the order of its
    sums), for x with leading dims and a non-contiguous view. Traced
    into, the autograd Function's Triton launch made torch.compile fail, with or without fullgraph."""
    x = _randn(3, 5, 40, dtype=torch.float32)[:, :, :36]  # rows 40 apart
    w = _randn(36, dtype=torch.float32, seed=1)
    dy = _randn(3, 5, 36, dtype=torch.float32, seed=2)
    eager, compiled = _eager_and_compiled(lambda x, w: rms_norm(x, w, 1e-5, dw_mode), (x, w), (dy,))
    for name, got, want in zip(("y", "dx", "dw"), compiled[0] + compiled[1], eager[0] + eager[1]):
        if name == "dw" and dw_mode != "partials":  # atomics and locks add in whatever order they run
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(got, want), f"rms_norm ({dw_mode}) under torch.compile: {name} differs"


@pytest.mark.parametrize("positions", ["none", "offset", "tensor"])
def test_rope_under_torch_compile(positions):
    """rope inside torch.compile(fullgraph=True), forward and backward, with each kind of positions: the
    same bits as eagerly. Positions past the cache are still refused by name (checked inside the
    operator, where the values can be read)."""
    q = _randn(2, 4, 7, 16, dtype=torch.float32)
    k = _randn(2, 2, 7, 16, dtype=torch.float32, seed=1)
    cos, sin = rope_cache(32, 16, device=DEVICE)
    pos = {"none": None, "offset": 5, "tensor": torch.tensor([[3, 1, 4, 1, 5, 9, 2]] * 2, device=DEVICE)}[
        positions
    ]
    grads = (
        _randn(2, 4, 7, 16, dtype=torch.float32, seed=2),
        _randn(2, 2, 7, 16, dtype=torch.float32, seed=3),
    )
    eager, compiled = _eager_and_compiled(lambda q, k: rope(q, k, cos, sin, pos), (q, k), grads)
    for name, got, want in zip(("q'", "k'", "dq", "dk"), compiled[0] + compiled[1], eager[0] + eager[1]):
        assert torch.equal(got, want), f"rope (positions {positions}) under torch.compile: {name} differs"
    far = torch.tensor([0, 1, 2, 3, 4, 5, 40], device=DEVICE)
    torch._dynamo.reset()
    with pytest.raises(
        ValueError, match=r"rope: positions run from 0 to 40, but cos and sin have rows 0\.\.31"
    ):
        torch.compile(lambda q, k: rope(q, k, cos, sin, far), fullgraph=True, backend="aot_eager")(q, k)
