"""course_lib.attention.tiled: tiled attention in pure PyTorch, forward and backward (notebook 04)."""

import math

import pytest
import torch

import course_lib
from course_lib.attention.reference import attention
from course_lib.attention.tiled import FlashAttentionTorch, flash_attention_torch, flash_forward
from course_lib.testing import assert_close_to_reference, random_qkv, reference_outputs

# (q shape, Nk, causal, block_m, block_n): odd lengths, Nq != Nk, ragged last tiles, unequal blocks.
CASES = [
    ((2, 37, 16), 53, False, 16, 8),
    ((2, 37, 16), 37, True, 16, 16),
    ((1, 2, 50, 8), 20, True, 16, 24),
    ((1, 2, 20, 8), 50, True, 7, 5),
    ((2, 2, 130, 32), 130, True, 64, 64),
    ((1, 3, 1, 8), 9, False, 64, 64),
]


def _check_against_reference(q, k, v, causal, block_m, block_n, what):
    out = flash_attention_torch(q, k, v, causal, None, block_m, block_n)
    dO = torch.randn_like(out)
    out.backward(dO)
    ref64, grads64 = reference_outputs(q.double(), k.double(), v.double(), causal, grad_out=dO.double())
    base, grads_base = reference_outputs(q, k, v, causal, grad_out=dO)
    assert_close_to_reference(out, ref64, base, f"O, {what}")
    for name, g, r, b in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), grads64, grads_base):
        assert g.shape == r.shape and g.dtype == q.dtype, f"{name}, {what}: {g.shape} {g.dtype}"
        assert_close_to_reference(g, r, b, f"{name}, {what}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("shape_q,n_k,causal,block_m,block_n", CASES)
def test_forward_and_gradients_match_reference(shape_q, n_k, causal, block_m, block_n, dtype):
    q, k, v = random_qkv(shape_q, n_k, dtype=dtype, requires_grad=True)
    what = f"q {shape_q}, Nk {n_k}, causal={causal}, blocks {block_m}x{block_n}, {dtype}"
    _check_against_reference(q, k, v, causal, block_m, block_n, what)


@pytest.mark.parametrize("causal", [False, True])
def test_non_contiguous_inputs(causal):
    q, k, v = random_qkv((2, 2, 45, 16), 61, transposed=True, requires_grad=True)
    assert not q.is_contiguous()
    _check_against_reference(q, k, v, causal, 16, 32, f"transposed views, causal={causal}")


def test_bfloat16_within_the_accuracy_rule():
    q, k, v = random_qkv((1, 2, 70, 32), dtype=torch.bfloat16, requires_grad=True)
    _check_against_reference(q, k, v, True, 32, 32, "bf16, causal")


def test_homework_interface_and_logsumexp():
    """The homework's call, `Cls.apply(q, k, v, is_causal)` on (batch, N, d): O, its gradients and the
    saved L against float64 autograd of the reference."""
    q, k, v = random_qkv((3, 40, 16), 40, requires_grad=True)
    out = FlashAttentionTorch.apply(q, k, v, True)  # the class, .apply(q, k, v, is_causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    out.sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    O_ref, L_ref = attention(q64, k64, v64, True, return_lse=True)
    O_ref.sum().backward()
    torch.testing.assert_close(out.double(), O_ref.detach(), atol=1e-5, rtol=1e-5)
    for name, t, t64 in zip(("dq", "dk", "dv"), (q, k, v), (q64, k64, v64)):
        torch.testing.assert_close(
            t.grad.double(), t64.grad, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
    _, L = flash_forward(q.detach(), k.detach(), v.detach(), causal=True)
    assert L.shape == q.shape[:-1] and L.dtype == torch.float32
    torch.testing.assert_close(L.double(), L_ref.detach(), atol=1e-5, rtol=1e-5)


def test_scale_argument():
    q, k, v = random_qkv((1, 33, 8), 21, dtype=torch.float64)
    out = flash_attention_torch(q, k, v, causal=False, scale=0.3, block_m=8, block_n=8)
    torch.testing.assert_close(out, attention(q, k, v, scale=0.3))


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_float64(causal):
    q, k, v = random_qkv((2, 7, 4), 6, dtype=torch.float64, requires_grad=True)
    fn = lambda a, b, c: FlashAttentionTorch.apply(a, b, c, causal, None, 3, 4)
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_second_derivative_is_refused():
    """The tiled backward saves O and L without a graph, so its gradients have no derivative: a second
    differentiation raises by name, also when the first loss is linear in O (incoming gradients without
    a graph) and the second asks for one input only, where the term was once silently zero."""
    q, k, v = random_qkv((1, 6, 16), 6, dtype=torch.float64, device="cpu", requires_grad=True)
    (g,) = torch.autograd.grad(FlashAttentionTorch.apply(q, k, v, True).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="^FlashAttentionTorch has no second derivative"):
        torch.autograd.grad(g.pow(2).sum() + q.pow(2).sum(), q)
    (g_plain,) = torch.autograd.grad(FlashAttentionTorch.apply(q, k, v, True).sum(), q)
    torch.testing.assert_close(g.detach(), g_plain)


def test_no_saved_tensor_is_nq_by_nk():
    n_q, n_k = 40, 56
    q, k, v = random_qkv((2, 3, n_q, 16), n_k, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = FlashAttentionTorch.apply(q, k, v, True)
    shapes = [tuple(t.shape) for t in saved]
    assert shapes, "nothing was saved for the backward"
    for s in shapes:
        assert s[-2:] != (n_q, n_k) and math.prod(s) <= max(q.numel(), k.numel()), f"saved {s}"
    assert (2, 3, n_q) in shapes, f"the logsumexp L is not saved: {shapes}"
    assert len(out.grad_fn.saved_tensors) == 5  # q, k, v, O, L


BAD = [
    ("int dtype", lambda q, k, v: (q.long(), k, v, False), TypeError, "dtype torch.int64"),
    ("mixed dtypes", lambda q, k, v: (q, k.double(), v, False), TypeError, "share one dtype"),
    ("1-D", lambda q, k, v: (q[0, 0], k, v, False), ValueError, "at least 2 dims"),
    ("head dims", lambda q, k, v: (q, k[..., :4], v[..., :4], False), ValueError, "head dims differ"),
    ("keys vs values", lambda q, k, v: (q, k, v[:, :3], False), ValueError, "same number of keys"),
    ("batch", lambda q, k, v: (q, k[:1], v[:1], False), ValueError, "leading"),
    ("not a tensor", lambda q, k, v: (q.tolist(), k, v, False), TypeError, "must be a torch.Tensor"),
    ("empty", lambda q, k, v: (q[:, :0], k, v, False), ValueError, "empty"),
    ("is_causal str", lambda q, k, v: (q, k, v, "yes"), TypeError, "is_causal must be a bool"),
    ("block 0", lambda q, k, v: (q, k, v, False, None, 0, 16), ValueError, "block_m must be a positive"),
    ("block float", lambda q, k, v: (q, k, v, False, None, 16, 8.0), ValueError, "block_n must be a"),
    ("scale", lambda q, k, v: (q, k, v, False, -1.0), ValueError, "scale must be a positive"),
]


@pytest.mark.parametrize("name,make,error,match", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise_clear_errors(name, make, error, match):
    q, k, v = random_qkv((2, 8, 8), 6)
    with pytest.raises(error, match=match):
        FlashAttentionTorch.apply(*make(q, k, v))


@pytest.mark.gpu
@pytest.mark.skipif(not course_lib.ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_on_gpu(dtype, causal):
    q, k, v = random_qkv((2, 4, 1000, 64), 1000, dtype=dtype, device=course_lib.DEVICE, requires_grad=True)
    _check_against_reference(q, k, v, causal, 64, 64, f"GPU, {dtype}, causal={causal}")


def test_tile_counts_and_traffic_formulas():
    from course_lib.attention import tiles

    assert tiles.paper_block_sizes(116736, 64) == (64, 456)
    counts = tiles.block_counts(1024, 1024, 64, 64, causal=True)
    assert counts == {"skipped": 120, "diagonal": 16, "full": 120}, counts
    assert tiles.block_counts(100, 37, 16, 8) == {"skipped": 0, "diagonal": 0, "full": 7 * 5}
    assert tiles.tile_schedule(64, 64, 32, 32, causal=True, order="fa1") == [(0, 0), (1, 0), (1, 1)]
    n, d = 1024, 64
    assert tiles.hbm_elements("standard", n, n, d) == 4 * n * d + 4 * n * n
    assert tiles.hbm_elements("fa2", n, n, d, 128, 64) == 2 * n * d + n + (n // 128) * 2 * n * d
    fa1 = n * d + 2 * n + 2 * n * d + (n // 128) * n * (3 * d + 4)
    assert tiles.hbm_elements("fa1", n, n, d, 64, 128) == fa1
    with pytest.raises(ValueError, match="block_m"):
        tiles.block_map(64, 64, 0, 16)
    with pytest.raises(ValueError, match="order"):
        tiles.tile_schedule(64, 64, 16, 16, order="fa3")
