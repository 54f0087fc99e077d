"""The FlashAttention-2 forward hands a few query rows over a long K/V to the split-KV kernel
(`course_lib.attention.decode_route`): which calls go, and that they still match the float64 reference,
forward and backward (the backward reads the split-KV kernel's O and L).

On the CPU the hand-over is forced (the interpreter keeps the forward kernel of notebook 06); on a GPU
real decoding shapes take it by the rule."""

from __future__ import annotations

import pytest
import torch

import course_lib
from course_lib import flash_attention, runtime
from course_lib.attention import decode_route
from course_lib.testing import check_forward_backward, gqa_qkv

ON_GPU = course_lib.ON_GPU


def _check(q, k, v, causal, what):
    check_forward_backward(flash_attention, q, k, v, causal, what)


@pytest.fixture
def forced(monkeypatch):
    """Every call that `fits` goes to the split-KV kernel (interpreter included); counts the calls."""
    calls = []
    run = decode_route.forward

    def counted(*args):
        calls.append(args[0].shape)
        return run(*args)

    monkeypatch.setattr(decode_route, "takes", decode_route.fits)
    monkeypatch.setattr(decode_route, "forward", counted)
    return calls


# (batch, query heads, kv heads, Nq, Nk, causal): one decoding step, a few tokens (speculative
# verification), every GQA ratio, no mask, more queries than keys (rows that see no key), ragged lengths
ROUTED = [
    (2, 4, 1, 1, 70, "bottom_right"),
    (1, 8, 2, 3, 45, "bottom_right"),
    (2, 8, 8, 2, 33, False),
    (1, 16, 2, 1, 129, False),
    (1, 4, 2, 5, 3, "bottom_right"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("b,hq,hkv,n_q,n_k,causal", ROUTED)
def test_routed_forward_and_backward_match_reference(forced, b, hq, hkv, n_q, n_k, causal, dtype):
    q, k, v = gqa_qkv(b, hq, hkv, n_q, n_k, 32, dtype, seed=n_k + n_q)
    _check(q, k, v, causal, f"split-KV route, B={b}, {hq}/{hkv} heads, Nq={n_q}, Nk={n_k}, {causal}, {dtype}")
    assert len(forced) == 1, "the forward did not take the split-KV kernel"


def test_routed_layouts(forced):
    """3-D inputs, and transformers' layout (B, N, H, d) viewed as (B, H, N, d): any strides in, O and L
    out contiguous with q's shape, as the forward returns them."""
    from course_lib.attention import attention_forward

    q, k, v = gqa_qkv(2, 1, 1, 2, 50, 16, torch.float32, seed=4)
    _check(q[:, 0], k[:, 0], v[:, 0], "bottom_right", "3-D (B, N, d)")
    q, k, v = gqa_qkv(2, 8, 2, 2, 60, 32, torch.float32, seed=5)
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not qt.is_contiguous() and not kt.is_contiguous()
    _check(qt, kt, vt, "bottom_right", "transposed (B, N, H, d) layout")
    o, lse = attention_forward(qt, kt, vt, "bottom_right")
    assert o.is_contiguous() and o.shape == q.shape
    assert lse.is_contiguous() and lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    assert len(forced) == 3


def test_rows_that_see_no_key_through_the_route(forced):
    """Bottom-right with Nq > Nk: the first rows see no key and give O = 0, L = -inf, as the forward's."""
    from course_lib.attention import attention_forward

    q, k, v = gqa_qkv(1, 4, 2, 6, 2, 16, torch.float32, seed=6)
    o, lse = attention_forward(q, k, v, "bottom_right")
    assert len(forced) == 1
    assert torch.equal(o[:, :, :4], torch.zeros_like(o[:, :, :4]))
    assert torch.isneginf(lse[:, :, :4]).all() and torch.isfinite(lse[:, :, 4:]).all()


def test_which_calls_are_handed_over(monkeypatch):
    """The rule on a GPU of 132 SMs (`MIN_WORK` keys x waves of the forward's grid): batch 1 with 32
    heads from 16k keys, batch 8 from 16k, batch 32 from 4k; never top-left causal, float64, or more
    query rows per K/V head than one decoding tile holds; never under the interpreter."""
    monkeypatch.setattr(runtime, "INTERPRET", False)
    monkeypatch.setattr(decode_route, "sm_count", lambda index=None: 132)

    def takes(b, hq, hkv, n_q, n_k, alignment="bottom_right", dtype=torch.bfloat16, d=128):
        q4 = torch.empty(b, hq, n_q, d, dtype=dtype, device="meta")
        k4 = torch.empty(b, hkv, n_k, d, dtype=dtype, device="meta")
        return decode_route.takes(q4, k4, alignment)

    assert takes(1, 32, 8, 1, 16384) and takes(1, 32, 8, 1, 131072, None)
    assert not takes(1, 32, 8, 1, 16383)
    assert takes(8, 32, 8, 1, 16384) and not takes(8, 32, 8, 1, 8192)
    assert takes(32, 32, 8, 1, 4096) and not takes(32, 32, 8, 1, 2048)
    assert takes(1, 32, 8, 16, 16384) and not takes(1, 32, 8, 17, 16384)  # 16 x 4 rows fill one tile
    assert not takes(1, 32, 8, 1, 65536, "top_left")
    assert not takes(1, 32, 8, 1, 65536, dtype=torch.float64)
    monkeypatch.setattr(runtime, "INTERPRET", True)
    assert not takes(1, 32, 8, 1, 65536)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "b,n_q,n_k,causal,d",
    [(1, 1, 20011, "bottom_right", 128), (2, 4, 16500, False, 64), (1, 2, 33000, "bottom_right", 256)],
)
def test_gpu_decoding_steps_take_the_route(b, n_q, n_k, causal, d, dtype):
    """Real decoding shapes (32 query heads, 8 K/V heads) go to the split-KV kernel by the rule and match
    the reference, forward and backward; the transformers layout (B, N, H, d) too."""
    q, k, v = gqa_qkv(b, 32, 8, n_q, n_k, d, dtype, seed=n_k)
    assert decode_route.takes(q, k, causal or None), "the rule did not hand this decoding step over"
    _check(q, k, v, causal, f"GPU split-KV route, B={b}, Nq={n_q}, Nk={n_k}, {causal}, d={d}, {dtype}")
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    torch.testing.assert_close(
        flash_attention(qt, kt, vt, causal=causal), flash_attention(q, k, v, causal=causal)
    )


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_gpu_routed_step_replays_as_a_cuda_graph():
    """A routed decoding step has a fixed grid: captured once, replayed on new values of q."""
    q, k, v = gqa_qkv(1, 32, 8, 1, 32768, 128, torch.bfloat16, seed=9)
    static_q = q.clone()
    flash_attention(static_q, k, v, causal="bottom_right")  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_o = flash_attention(static_q, k, v, causal="bottom_right")
    new_q = torch.randn_like(q)
    static_q.copy_(new_q)
    graph.replay()
    torch.testing.assert_close(static_o, flash_attention(new_q, k, v, causal="bottom_right"), rtol=0, atol=0)
