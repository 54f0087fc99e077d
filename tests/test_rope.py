"""Tests of course_lib.fused.rope (notebook 11): fused rotary position embedding, forward and backward,
both layouts, every kind of positions, and `rope_cache`.

Ground truth is float64 (`rope_reference`, differentiated by autograd for the gradients). Hugging Face's
apply_rotary_pos_emb is compared with when transformers is installed. On the CPU the kernels run in
Triton's interpreter, so rows are few; GPU-sized bf16 cases are marked `gpu`. Note: the interpreter
rounds float32 -> bfloat16 towards zero (a GPU rounds to nearest), so bf16 tolerances here allow 2 units
in the last place (`testing.ULP_TOL`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import course_lib
from course_lib.fused import RMSNorm, rope, rope_, rope_cache, rope_reference
from course_lib.testing import assert_close_in_ulps, dtype_name, eager_and_compiled
from course_lib.testing import seeded_randn as _randn

DEVICE = course_lib.DEVICE
ON_GPU = course_lib.ON_GPU
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU with compiled Triton kernels")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


POSITIONS = {
    "none": lambda b, t: None,
    "offset": lambda b, t: 5,
    "per-batch": lambda b, t: torch.randint(0, 20, (b, t), generator=torch.Generator().manual_seed(3)).to(
        DEVICE
    ),
}


@pytest.mark.parametrize("positions", list(POSITIONS))
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_rope_forward_matches_float64(dtype, layout, positions):
    b, t, d = 2, 6, 32
    q, k = _randn(b, 4, t, d, dtype=dtype), _randn(b, 2, t, d, dtype=dtype, seed=1)  # grouped: 4 q heads, 2 k
    cos, sin = rope_cache(24, d, layout=layout, device=DEVICE)
    pos = POSITIONS[positions](b, t)
    q_rot, k_rot = rope(q, k, cos, sin, positions=pos, layout=layout)
    what = f"rope {layout} positions={positions} {dtype_name(dtype)}"
    assert q_rot.dtype == dtype and q_rot.shape == q.shape and k_rot.shape == k.shape
    assert_close_in_ulps(q_rot, rope_reference(q, cos, sin, pos, layout), dtype, f"{what} q")
    assert_close_in_ulps(k_rot, rope_reference(k, cos, sin, pos, layout), dtype, f"{what} k")


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
    assert_close_in_ulps(q.grad, q64.grad, torch.float32, f"rope {layout} dq")
    assert_close_in_ulps(k.grad, k64.grad, torch.float32, f"rope {layout} dk")
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
    assert_close_in_ulps(q_rot, rope_reference(q, cos, sin, pos, layout), torch.float32, f"{what} q")
    assert_close_in_ulps(k_rot, rope_reference(k, cos, sin, pos, layout), torch.float32, f"{what} k")
    # the backward rotates by the negative angle: fed the rotated vectors, it gives back the inputs
    dq, dk = torch.autograd.grad((q_rot, k_rot), (q, k), (q_rot.detach(), k_rot.detach()))
    assert_close_in_ulps(dq, q.double().cpu(), torch.float32, f"{what} backward undoes forward, q")
    assert_close_in_ulps(dk, k.double().cpu(), torch.float32, f"{what} backward undoes forward, k")


def test_rope_token_major_layout_without_copies_and_3d_inputs():
    """(B, T, H, d) storage passed as .transpose(1, 2): the kernel follows the strides; outputs keep them."""
    t, d = 7, 24
    q = _randn(2, t, 4, d).transpose(1, 2)
    k = _randn(2, t, 2, d, seed=1).transpose(1, 2)
    cos, sin = rope_cache(t, d, device=DEVICE)
    q_rot, k_rot = rope(q, k, cos, sin)
    assert q_rot.stride() == q.stride()
    assert_close_in_ulps(q_rot, rope_reference(q, cos, sin), torch.float32, "token-major q")
    assert_close_in_ulps(k_rot, rope_reference(k, cos, sin), torch.float32, "token-major k")
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
        assert_close_in_ulps(q_rot, ref[0], torch.float32, f"rope {what} q")
        assert_close_in_ulps(k_rot, ref[1], torch.float32, f"rope {what} k")
        assert_close_in_ulps(q_.grad, q64.grad, torch.float32, f"rope {what} dq")
        assert_close_in_ulps(k_.grad, k64.grad, torch.float32, f"rope {what} dk")
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
            cos[3 : 3 + t], cos_hf[0], msg=lambda m, dtype=dtype: f"cos cache {dtype_name(dtype)}: {m}"
        )
        q_rot, k_rot = rope(q, k, cos, sin, positions=3)
        scale = 1 if dtype == torch.float32 else 2  # Hugging Face rounds three times in 16-bit
        assert_close_in_ulps(q_rot, q_hf, dtype, f"vs apply_rotary_pos_emb q {dtype_name(dtype)}", scale)
        assert_close_in_ulps(k_rot, k_hf, dtype, f"vs apply_rotary_pos_emb k {dtype_name(dtype)}", scale)


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


def test_rope_repeat_kinds_and_the_path_without_autograd():
    """A call of a kind checked before skips the check (`fused.api._ROPE_CALLS`), but any argument the check reads
    makes a new kind: the same tensors with another layout, or cos of another length, are checked again. With
    nothing to differentiate (no_grad, or inputs that need no gradient) the kernel runs without autograd's
    Function: the same values, no graph."""
    q, k = _qk()
    q.requires_grad_(True)
    cos, sin = rope_cache(8, 16, device=DEVICE)
    with_grad = rope(q, k, cos, sin)
    assert with_grad[0].grad_fn is not None
    with torch.no_grad():
        for _ in range(2):
            without = rope(q, k, cos, sin)
            assert without[0].grad_fn is None and not without[0].requires_grad
            for got, want in zip(without, with_grad):
                torch.testing.assert_close(got, want.detach(), rtol=0, atol=0)
        with pytest.raises(ValueError, match="layout"):
            rope(q, k, cos, sin, layout="neox")
        with pytest.raises(ValueError, match="d=16"):
            rope(q, k, cos[:, :8], sin[:, :8])


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


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_gpu_rope_bf16_real_sizes(layout):
    t, d = 4096, 128
    q = _randn(1, t, 32, d, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k = _randn(1, t, 8, d, dtype=torch.bfloat16, seed=1).transpose(1, 2).requires_grad_()
    cos, sin = rope_cache(2 * t, d, device=DEVICE, layout=layout)
    q_rot, k_rot = rope(q, k, cos, sin, positions=t, layout=layout)
    assert_close_in_ulps(
        q_rot, rope_reference(q, cos, sin, t, layout), torch.bfloat16, f"GPU rope {layout} q"
    )
    assert_close_in_ulps(
        k_rot, rope_reference(k, cos, sin, t, layout), torch.bfloat16, f"GPU rope {layout} k"
    )
    dq, dk = torch.randn_like(q_rot), torch.randn_like(k_rot)
    torch.autograd.backward((q_rot, k_rot), (dq, dk))
    back_q, back_k = rope(dq, dk, cos, -sin, positions=t, layout=layout)
    torch.testing.assert_close(q.grad, back_q)
    torch.testing.assert_close(k.grad, back_k)


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
    eager, compiled = eager_and_compiled(lambda q, k: rope(q, k, cos, sin, pos), (q, k), grads)
    for name, got, want in zip(("q'", "k'", "dq", "dk"), compiled[0] + compiled[1], eager[0] + eager[1]):
        assert torch.equal(got, want), f"rope (positions {positions}) under torch.compile: {name} differs"
    far = torch.tensor([0, 1, 2, 3, 4, 5, 40], device=DEVICE)
    torch._dynamo.reset()
    with pytest.raises(
        ValueError, match=r"rope: positions run from 0 to 40, but cos and sin have rows 0\.\.31"
    ):
        torch.compile(lambda q, k: rope(q, k, cos, sin, far), fullgraph=True, backend="aot_eager")(q, k)


@pytest.mark.parametrize("positions", ["none", "offset", "tensor"])
def test_rope_in_place_on_slices_of_a_fused_projection(positions):
    """`rope_` rotates the Q and K column slices of one (T, Hq + 2 Hkv, d) projection output where they lie (what a
    serving step's `Attention.project_into` does): the same bits as `rope`, V untouched, float64 behind both; it
    refuses tensors that need gradients and a d that is not contiguous, by name; under torch.compile it is rope
    and a copy back."""
    t, hq, hkv, d = 9, 4, 2, 16
    qkv = _randn(t, hq + 2 * hkv, d)
    cos, sin = rope_cache(24, d, device=DEVICE)
    pos = {"none": None, "offset": 3, "tensor": torch.tensor([5, 0, 7, 1, 2, 9, 3, 3, 8], device=DEVICE)}[
        positions
    ]
    q, k, v = qkv[:, :hq].transpose(0, 1), qkv[:, hq : hq + hkv].transpose(0, 1), qkv[:, hq + hkv :].clone()
    want = rope(q, k, cos, sin, pos)
    q_ref, k_ref = rope_reference(q, cos, sin, pos), rope_reference(k, cos, sin, pos)
    got = rope_(q, k, cos, sin, pos)
    assert got[0].data_ptr() == qkv.data_ptr() and torch.equal(qkv[:, hq + hkv :], v)
    for g, w, ref, name in zip(got, want, (q_ref, k_ref), "qk"):
        assert torch.equal(g, w), f"rope_ {name} differs from rope"
        assert_close_in_ulps(g, ref, torch.float32, f"rope_ {name}")
    torch._dynamo.reset()
    qkv2 = _randn(t, hq + 2 * hkv, d)
    q2, k2 = qkv2[:, :hq].transpose(0, 1), qkv2[:, hq : hq + hkv].transpose(0, 1)
    want2 = rope(q2, k2, cos, sin, pos)
    torch.compile(lambda q, k: rope_(q, k, cos, sin, pos), fullgraph=True, backend="aot_eager")(q2, k2)
    assert torch.equal(q2, want2[0]) and torch.equal(k2, want2[1])
    leaf = _randn(1, 2, t, d).requires_grad_()
    with pytest.raises(ValueError, match="rope_: q and k require gradients"):
        rope_(leaf, _randn(1, 1, t, d), cos, sin)
    with pytest.raises(ValueError, match="d contiguous"):
        rope_(_randn(1, 2, d, t).transpose(-1, -2), _randn(1, 1, t, d), cos, sin)
