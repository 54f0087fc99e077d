"""Tests of course_lib.attention's Triton FlashAttention-2 forward and backward (attention/forward.py,
attention/backward.py; notebooks 06-08), each test checking both, through `flash_attention`,
`FlashAttentionTriton` and notebook 08's configurations.

Every result is held to the course's accuracy rule (`course_lib.testing.assert_close_to_reference`):
error against the float64 reference at most 2x plain PyTorch's error in the same dtype, plus a floor.
On the CPU the kernels run in Triton's interpreter, so shapes are tiny (blocks of 32, a few blocks per
sequence); GPU-sized cases run only where `course_lib.ON_GPU` (`@pytest.mark.gpu`).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import course_lib
from course_lib import FlashAttentionTriton, flash_attention
from course_lib.attention import backward as bwd_mod
from course_lib.attention import forward as fwd_mod
from course_lib.attention.inputs import as_4d
from course_lib.attention.reference import attention as reference_attention
from course_lib.testing import assert_close_to_reference, random_qkv, reference_outputs

DEVICE = course_lib.DEVICE
ON_GPU = course_lib.ON_GPU
# bf16 under the interpreter too: its casts round as on a GPU (`runtime.BF16_ROUNDS_TO_NEAREST`)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU with compiled Triton kernels")


def _name(dtype):
    return str(dtype).replace("torch.", "")


def _check_fwd_bwd(q, k, v, causal, what, do=None, scale=None, fn=None, grad_floors=None):
    """Run fn (default flash_attention) forward and backward; compare O, dq, dk, dv with the float64
    reference, the bound being set by plain PyTorch in the inputs' dtype (grad_floors: a gradient's
    floor by name, "dq", "dk" or "dv", where not the dtype's default)."""
    fn = fn or (lambda q, k, v: flash_attention(q, k, v, causal=causal, scale=scale))
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    o = fn(q, k, v)
    assert o.shape == q.shape and o.dtype == q.dtype, f"{what}: O has shape {o.shape}, dtype {o.dtype}"
    if do is None:
        do = torch.randn(o.shape, dtype=o.dtype, device=o.device)
    o.backward(do)
    ref_o, ref_g = reference_outputs(
        *(t.detach().cpu().double() for t in (q, k, v)), causal, scale, do.detach().cpu().double()
    )
    base_o, base_g = reference_outputs(q, k, v, causal, scale, do)
    assert_close_to_reference(o, ref_o, base_o, what=f"O, {what}")
    for name, t, r, b in zip(("dq", "dk", "dv"), (q, k, v), ref_g, base_g):
        assert t.grad is not None and t.grad.shape == t.shape, (
            f"{name}, {what}: no gradient of the right shape"
        )
        floor = (grad_floors or {}).get(name)
        assert_close_to_reference(t.grad, r, b, what=f"{name}, {what}", floor=floor)


# (name, q shape (..., Nq, d), Nk, causal). Blocks are 32 x 32 under the interpreter (64-128 on a GPU):
# N = 1, a small odd N, N not a multiple of any block, Nq != Nk both ways, 3-D / 4-D / 5-D layouts.
CASES = [
    ("N=1, 3-D", (2, 1, 16), 1, False),
    ("N=1, causal", (1, 2, 1, 32), 1, True),
    ("N=7 odd, causal", (1, 2, 7, 32), 7, True),
    ("N=45, 3-D homework layout, causal", (2, 45, 64), 45, True),
    ("Nq=33 < Nk=70, causal", (1, 2, 33, 16), 70, True),
    ("Nq=70 > Nk=33, causal", (1, 2, 70, 16), 33, True),
    ("Nq=45, Nk=80", (1, 2, 45, 32), 80, False),
    ("d=128, N=50, causal", (1, 1, 50, 128), 50, True),
    ("d=40 (padded to 64), causal", (2, 1, 37, 40), 37, True),
    ("N=128 larger, causal", (1, 2, 128, 64), 128, True),
    ("N=100 larger", (1, 1, 100, 32), 100, False),
    ("5-D leading dims", (1, 2, 2, 20, 16), 20, True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("name,shape_q,n_k,causal", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(name, shape_q, n_k, causal, dtype):
    torch.manual_seed(zlib.crc32(name.encode()))
    q, k, v = random_qkv(shape_q, n_k, dtype=dtype, device=DEVICE)
    _check_fwd_bwd(q, k, v, causal, f"{name}, {_name(dtype)}, {DEVICE.type}")


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("d", [16, 32, 64, 128])
def test_head_dims(d, dtype):
    torch.manual_seed(d)
    q, k, v = random_qkv((1, 1, 40, d), 40, dtype=dtype, device=DEVICE)
    _check_fwd_bwd(q, k, v, d % 32 == 0, f"d={d}, {_name(dtype)}")


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_non_contiguous_views(dtype):
    """Transposed storage, the (batch, N, heads, d) layout viewed as (batch, heads, N, d), and a
    stride-0 dO: the kernels read the strides; no copy where the layout allows."""
    torch.manual_seed(1)
    q, k, v = random_qkv((1, 2, 48, 32), 40, dtype=dtype, device=DEVICE, transposed=True)
    assert not q.is_contiguous()
    _check_fwd_bwd(q, k, v, True, f"transposed storage, {_name(dtype)}")

    bnhd = [torch.randn(2, n, 3, 16, device=DEVICE).to(dtype) for n in (37, 29, 29)]
    q, k, v = (t.transpose(1, 2) for t in bnhd)  # (2, 3, N, 16), heads interleaved in memory
    assert as_4d(q).data_ptr() == q.data_ptr()
    do = torch.randn(1, 1, 1, 1, device=DEVICE).to(dtype).expand(2, 3, 37, 16)  # stride 0 everywhere
    _check_fwd_bwd(q, k, v, False, f"(B, N, H, d) viewed as (B, H, N, d), stride-0 dO, {_name(dtype)}", do=do)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("causal", [False, True])
def test_large_logits(causal, dtype):
    """Inputs scaled so that the logits reach ~1e3-1e4: the online softmax must stay finite and O
    accurate. There the softmax is one-hot and every exact gradient is ~0; plain PyTorch gets ~0
    exactly (its P is exactly 0 or 1), while FlashAttention-2 rebuilds P = exp(S - L) from L = logsumexp
    stored in float32 (rounded at the logits' magnitude, ulp(1e4) ~ 1e-3) and forms dS = P (dP - D) from
    D = rowsum(dO * O), a difference of two float32 sums. So the gradients' floor is that rounding carried
    by dO: 8 * eps * max|logit| * max|dO| (measured under the interpreter over 8 seeds: dQ and dK at most
    0.28 of the bound it sets with plain PyTorch's error). dV = P^T dO needs the same floor: the backward
    recomputes S as K Q^T with its own tiles, and nothing makes that product round as the forward's Q K^T
    did, so the rebuilt P is off by as much. On an H200 (float32) dV's error was 1.2e-3; under the
    interpreter both are NumPy products, whose rounding depends on the BLAS kernel that runs them: with
    OpenBLAS's SkylakeX kernels dV stayed within the dtype's usual floor (1e-5), with its Haswell kernels
    (a 2-core AMD EPYC, or OPENBLAS_CORETYPE=Haswell) it reached 3e-3. A wrong dV is off by about |dO|
    (~1), far above this floor (~5e-2 here)."""
    torch.manual_seed(2)
    scale_in = 30.0 if dtype == torch.float16 else 60.0
    d = 16
    q, k, v = random_qkv((1, 2, 45, d), 45, dtype=dtype, device=DEVICE)
    q, k = q * scale_in, k * scale_in  # large logits; V (and so O) stays of order 1
    logits = (q.double() @ k.double().transpose(-1, -2)).abs().max().item() / math.sqrt(d)
    assert logits > 1e3, f"test set-up: logits reach only {logits:.3g}"
    do = torch.randn(q.shape, device=DEVICE).to(dtype)
    floor = 8 * torch.finfo(torch.float32).eps * logits * do.double().abs().max().item()
    floors = {"dq": floor, "dk": floor, "dv": floor}
    _check_fwd_bwd(q, k, v, causal, f"logits up to {logits:.3g}, causal={causal}, {_name(dtype)}", do=do,
                   grad_floors=floors)  # fmt: skip


def test_custom_scale_and_lse():
    torch.manual_seed(3)
    q, k, v = random_qkv((2, 3, 50, 32), 61, device=DEVICE)
    _check_fwd_bwd(q, k, v, True, "scale=0.3", scale=0.3)
    o, lse = fwd_mod.forward(q, k, v, True, 0.3)
    ref_o, ref_lse = reference_attention(*(t.cpu().double() for t in (q, k, v)), True, 0.3, return_lse=True)
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    torch.testing.assert_close(lse.cpu().double(), ref_lse, rtol=1e-5, atol=1e-5, msg="L = logsumexp")


def test_homework_interface():
    """Cls.apply(q, k, v, is_causal) on (batch, N, d) float32, as homework tests call it (then
    `.sum().backward()`): O and the gradients against float64, as every other call here."""
    torch.manual_seed(4)
    for is_causal in (False, True):
        q, k, v = random_qkv((4, 38, 64), 38, device=DEVICE)
        apply = lambda q, k, v, c=is_causal: FlashAttentionTriton.apply(q, k, v, c)  # noqa: E731
        ones = torch.ones(q.shape, device=DEVICE)  # the gradient .sum().backward() gives O
        _check_fwd_bwd(q, k, v, is_causal, f".apply, is_causal={is_causal}", do=ones, fn=apply)


# The switches of notebook 08's ladder and the atomic dQ variant must compute the same function.
CONFIGS = [
    ({"exp2": False}, "two_kernel"),
    ({"skip_masked_blocks": False}, "two_kernel"),
    ({"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}, "two_kernel"),
    ({"BLOCK_M": 64, "BLOCK_N": 16}, "two_kernel"),
    (None, "atomic"),
    ({"BLOCK_M": 32, "BLOCK_N": 16, "exp2": False, "skip_masked_blocks": False}, "atomic"),
]


@pytest.mark.parametrize("config,dq_mode", CONFIGS, ids=[f"{c}-{m}" for c, m in CONFIGS])
def test_config_switches_and_dq_modes(config, dq_mode):
    torch.manual_seed(5)
    dtype = torch.float16
    for causal, (n_q, n_k) in ((True, (45, 61)), (False, (37, 37))):
        q, k, v = random_qkv((1, 2, n_q, 32), n_k, dtype=dtype, device=DEVICE)

        def fn(q, k, v, causal=causal):
            return _ConfigAttention.apply(q, k, v, causal, config, dq_mode)

        _check_fwd_bwd(q, k, v, causal, f"config={config}, dq_mode={dq_mode}, causal={causal}", fn=fn)


class _ConfigAttention(torch.autograd.Function):
    """forward.forward + backward.backward with a given config, as notebook 08 calls them."""

    @staticmethod
    def forward(ctx, q, k, v, causal, config, dq_mode):
        o, lse = fwd_mod.forward(q, k, v, causal, None, config=config)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (causal, config, dq_mode)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        causal, config, dq_mode = ctx.args
        dq, dk, dv = bwd_mod.backward(do, q, k, v, o, lse, causal, None, config=config, dq_mode=dq_mode)
        return dq, dk, dv, None, None, None


def test_saves_only_linear_size_tensors():
    """The autograd graph holds Q, K, V, O and L: nothing of size Nq x Nk."""
    n_q, n_k, d = 64, 48, 16
    q, k, v = random_qkv((2, n_q, d), n_k, device=DEVICE, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        o = flash_attention(q, k, v, causal=True)
    shapes = sorted(tuple(t.shape) for t in saved)
    assert len(saved) == 5, f"expected Q, K, V, O, L saved; got shapes {shapes}"
    assert (2, n_q) in shapes, f"L of shape (2, {n_q}) not saved; got {shapes}"
    assert max(t.numel() for t in saved) < n_q * n_k, f"a saved tensor is as large as Nq x Nk: {shapes}"
    o.sum().backward()


def test_saved_tensors_found_by_shape_and_second_derivative_refused():
    """The homework's way to find L: the one tensor of shape (batch, n_queries) among the autograd node's
    `grad_fn.saved_tensors` (None there made that lookup fail). Differentiating the gradient again must
    raise (the kernels have no derivative), not give a silent zero second-order term, also when only
    some inputs' gradients are asked for (`torch.autograd.grad(..., k)`, as a gradient penalty does)."""
    from course_lib.attention.varlen import flash_attention_varlen

    n_q, n_k, d = 33, 21, 16
    q, k, v = random_qkv((2, n_q, d), n_k, device=DEVICE, requires_grad=True)
    calls = {
        "FlashAttentionTriton": lambda: FlashAttentionTriton.apply(q, k, v, True),
        "flash_attention": lambda: flash_attention(q, k, v, causal=True),
    }
    for name, call in calls.items():
        o = call()
        saved = o.grad_fn.saved_tensors
        found = [t for t in saved if t.shape == (2, n_q)]
        assert len(found) == 1, f"{name}: saved {[None if t is None else tuple(t.shape) for t in saved]}"
        (g,) = torch.autograd.grad(o.pow(2).sum(), q, create_graph=True)
        with pytest.raises(RuntimeError, match="no second derivative"):
            g.pow(2).sum().backward()
        o = call()  # a gradient penalty asking for one input's gradient only: no path may skip the refusal
        (g,) = torch.autograd.grad(o.pow(2).sum(), q, create_graph=True)
        with pytest.raises(RuntimeError, match="no second derivative"):
            torch.autograd.grad(o.sum() + g.pow(2).sum(), k)
        o = call()  # create_graph=True alone (no second differentiation) still gives the right gradient
        (g,) = torch.autograd.grad(o.pow(2).sum(), q, create_graph=True)
        (g_plain,) = torch.autograd.grad(call().pow(2).sum(), q)
        torch.testing.assert_close(g.detach(), g_plain)
    rows = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEVICE)
    qp, kp, vp = (torch.randn(12, 2, d, device=DEVICE, requires_grad=True) for _ in range(3))
    o = flash_attention_varlen(qp, kp, vp, rows, rows, causal=True)
    assert all(t is not None for t in o.grad_fn.saved_tensors)
    (g,) = torch.autograd.grad(o.pow(2).sum(), qp, create_graph=True)
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(o.sum() + g.pow(2).sum(), kp)


@pytest.mark.skipif(ON_GPU, reason="float64 kernels run only under the interpreter")
def test_gradcheck_float64():
    torch.manual_seed(6)
    q, k, v = random_qkv((1, 2, 9, 16), 13, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attention(q, k, v, causal=True), (q, k, v), fast_mode=True
    )
    q, k, v = random_qkv((1, 3, 16), 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: FlashAttentionTriton.apply(q, k, v, False), (q, k, v))


# ---------------------------------------------------------------------------------------------------
# GPU-sized cases
# ---------------------------------------------------------------------------------------------------
GPU_CASES = [
    ((2, 4, 1000, 64), 1000, True, torch.bfloat16),
    ((1, 4, 2048, 128), 2048, False, torch.bfloat16),
    ((1, 2, 1024, 128), 1536, True, torch.float16),
    ((2, 2, 700, 256), 700, True, torch.bfloat16),
    ((1, 2, 300, 96), 300, False, torch.float16),
    ((1, 2, 256, 256), 256, True, torch.float32),
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape_q,n_k,causal,dtype", GPU_CASES, ids=[str(c[:3]) for c in GPU_CASES])
def test_gpu_sizes(shape_q, n_k, causal, dtype):
    torch.manual_seed(7)
    q, k, v = random_qkv(shape_q, n_k, dtype=dtype, device=DEVICE)
    _check_fwd_bwd(q, k, v, causal, f"GPU {shape_q}, Nk={n_k}, causal={causal}, {_name(dtype)}")


@pytest.mark.gpu
@gpu
def test_gpu_peak_memory_linear_in_n():
    """Forward + backward allocate only O(N) beyond their inputs: peak memory stays within 10% of inputs +
    outputs + gradients, and, where the one-pass backward runs (`hopper_onepass.choose`, on a Hopper GPU), its
    float32 dQ accumulator (`hopper_onepass.slices`: a quarter of dQ's rows at a
    time where there are enough programs, half dQ's bytes; all of them for these few heads): a budget linear in
    N."""
    from course_lib.attention.configs import DEFAULT_SWITCHES

    peaks, budgets = [], []
    for n in (2048, 4096, 8192):
        q, k, v = random_qkv((1, 4, n, 64), n, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
        do = torch.randn_like(q)
        flash_attention(q, k, v, causal=True).backward(do)  # autotune and compile outside the measurement
        for t in (q, k, v):
            t.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        flash_attention(q, k, v, causal=True).backward(do)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
        budget = 4 * q.numel() * q.element_size()  # O, dq, dk, dv
        one_pass = bwd_mod.hopper_onepass(q, k, v, do, True, n, n, DEFAULT_SWITCHES)
        if one_pass is not None:  # its float32 dQ accumulator, for the largest slice of (batch, head) pairs
            _, pairs = one_pass.slices(4, -(-n // 128), course_lib.runtime.sm_count())[0]
            budget += pairs * n * 64 * 4
        budgets.append(budget)
    for n, p, b in zip((2048, 4096, 8192), peaks, budgets):
        assert p <= 1.1 * b, (
            f"N={n}: peak {p / 2**20:.1f} MiB above inputs, budget O+grads {b / 2**20:.1f} MiB"
        )
