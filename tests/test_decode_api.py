"""course_lib.decode's face and operators (decode/api.py, decode/op.py): errors named, inputs that want a
gradient refused, the custom operators under torch.library.opcheck and torch.compile, CUDA-graph capture
and replay of both calls on a GPU."""

from __future__ import annotations

import pytest
import torch

import course_lib
from course_lib.decode import decode_attention, paged_decode_attention
from course_lib.testing import assert_matches, decode_references, make_cache, to_pages

DEV = course_lib.DEVICE


def test_decode_operator_matches_the_function_and_compiles_whole():
    """course_lib::decode_attention: the function's result from strided views (a model's (B, H, N, d)
    tensors transposed), torch.library.opcheck (schema, fake implementation), one node of a
    torch.compile(fullgraph=True) graph, and a clear error for a backward through it. The fake
    implementation (what meta tensors run) checks cache_seqlens by name too."""
    from course_lib.decode.op import decode_attention_op

    q, k, v = make_cache(2, 40, 4, 2, 16, 1, torch.float32, seed=3)
    qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))  # (B, H, N, d) memory
    seqlens = torch.tensor([7, 40], dtype=torch.int32, device=DEV)
    out = decode_attention_op(qt, kt, vt, seqlens, True, None)
    assert out.stride() == torch.empty_like(qt).stride()
    assert_matches(
        out, decode_attention(q, k, v, seqlens, return_lse=True)[1], decode_references(q, k, v, seqlens), "op"
    )
    torch.library.opcheck(decode_attention_op, (qt, kt, vt, seqlens, True, 0.3))
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda *a: decode_attention_op(*a, True, None) * 2, fullgraph=True, backend="aot_eager"
    )
    torch.testing.assert_close(compiled(qt, kt, vt, seqlens), 2 * out)
    grad_q = q.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="has no backward"):
        decode_attention_op(grad_q, k, v, seqlens, True, None).sum().backward()
    with pytest.raises(TypeError, match="cache_seqlens must be int32"):
        decode_attention_op(q, k, v, seqlens.long(), True, None)
    meta = [t.to("meta") for t in (q, k, v, seqlens)]
    assert decode_attention_op(*meta, True, None).shape == q.shape
    with pytest.raises(TypeError, match="course_lib::decode_attention: cache_seqlens must be int32"):
        decode_attention_op(*meta[:3], meta[3].long(), True, None)
    with pytest.raises(ValueError, match=r"cache_seqlens must have shape \(B,\) = \(2,\)"):
        decode_attention_op(*meta[:3], meta[3][:1], True, None)


def test_errors_name_the_problem():
    q, k, v = make_cache(2, 32, 4, 2, 64, 1, torch.float32)
    lens = torch.tensor([3, 4], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="cache_seqlens\\[1\\] = 40"):
        decode_attention(q, k, v, torch.tensor([3, 40], dtype=torch.int32, device=DEV))
    with pytest.raises(TypeError, match="int32"):
        decode_attention(q, k, v, lens.long())
    with pytest.raises(ValueError, match="multiple of Hkv"):
        decode_attention(q[:, :, :3], k, v, lens)
    with pytest.raises(ValueError, match="B, Tq, Hq, d"):
        decode_attention(q[0], k, v, lens)
    with pytest.raises(TypeError, match="share one dtype"):
        decode_attention(q.half(), k, v, lens)
    k_pages, v_pages, table = to_pages(k, v, 16)
    bad = table.clone()
    bad[1, 0] = k_pages.shape[0]
    with pytest.raises(ValueError, match="block_table\\[1, 0\\]"):
        paged_decode_attention(q, k_pages, v_pages, bad, lens)
    with pytest.raises(ValueError, match="outside \\[0, 32\\]"):
        paged_decode_attention(
            q, k_pages, v_pages, table, torch.tensor([3, 33], dtype=torch.int32, device=DEV)
        )
    with pytest.raises(TypeError, match="block_table must be int32"):
        paged_decode_attention(q, k_pages, v_pages, table.long(), lens)
    for splits, error, words in (
        (2.7, TypeError, r"num_splits must be an integer, got 2\.7"),
        ("2", TypeError, "num_splits must be an integer, got '2'"),
        (True, TypeError, "num_splits must be an integer, got True"),
        (0, ValueError, "num_splits must be >= 1, got 0"),
        (33, ValueError, r"num_splits=33 is more than the cache holds keys \(32 per sequence\)"),
        (10**12, ValueError, "num_splits=1000000000000 is more than"),  # never a buffer of that many splits
    ):
        with pytest.raises(error, match=f"^decode_attention: {words}"):
            decode_attention(q, k, v, lens, num_splits=splits)
        with pytest.raises(error, match=f"^paged_decode_attention: {words}"):
            paged_decode_attention(q, k_pages, v_pages, table, lens, num_splits=splits)


def test_decoding_refuses_inputs_that_want_a_gradient():
    """Decoding has no backward: an input that requires grad (grad mode on) is refused by name, where the
    output once came back without a grad_fn and a loss through it silently lost the attention's term."""
    q, k, v = make_cache(2, 32, 4, 2, 16, 1, torch.float32)
    lens = torch.tensor([3, 32], dtype=torch.int32, device=DEV)
    k_pages, v_pages, table = to_pages(k, v, 8)
    calls = {
        "decode_attention": lambda q, k: decode_attention(q, k, v, lens),
        "paged_decode_attention": lambda q, k: paged_decode_attention(q, k, v_pages, table, lens),
    }
    for where, call in calls.items():
        cache = k if where == "decode_attention" else k_pages
        name = "k_cache" if where == "decode_attention" else "k_pages"
        with pytest.raises(
            RuntimeError, match=f"^{where}: q require\\(s\\) grad, but decoding attention has no"
        ):
            call(q.clone().requires_grad_(), cache)
        with pytest.raises(RuntimeError, match=f"^{where}: {name} require"):
            call(q, cache.clone().requires_grad_())
        with torch.no_grad():  # inference: served as usual
            out = call(q.clone().requires_grad_(), cache)
        torch.testing.assert_close(out, call(q, cache))


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_cuda_graph_capture_and_replay(paged):
    if not course_lib.ON_GPU:
        pytest.skip("needs a GPU")
    # 16 sequences of up to 8192 keys: the contiguous grid has 2 splits, used only for uneven lengths
    B, n_max, hkv, d = 16, 8192, 8, 128
    q, k, v = make_cache(B, n_max, 32, hkv, d, 1, torch.bfloat16)
    k_pages, v_pages, table = to_pages(k, v, 16)
    seqlens = torch.tensor([1, 100, 1500, 2048] * 4, dtype=torch.int32, device=DEV)

    def step():
        if paged:
            return paged_decode_attention(
                q, k_pages, v_pages, table, seqlens, validate=False, return_lse=True
            )
        return decode_attention(q, k, v, seqlens, validate=False, return_lse=True)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for lengths in ([7, 0, 8192, 33] * 4, [8192] * 16, [2048, 2048, 1, 999] * 4):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        refs = decode_references(q, k, v, seqlens)
        assert_matches(out, lse, refs, f"graph replay paged={paged} lengths={lengths}")


def test_decode_functions_under_torch_compile():
    """decode_attention and paged_decode_attention inside torch.compile(fullgraph=True) (a graph break
    raises; reading the lengths once did: a data-dependent guard): each is one operator there, with the
    eager call's bits, lengths given or not, a forced split count too. The lengths and page ids are
    still checked by name (inside the operators, on the CPU always), and return_lse, which the operators
    do not return, is refused by name."""
    from course_lib.decode.op import paged_decode_attention_op

    q, k, v = make_cache(2, 40, 4, 2, 16, 2, torch.float32, seed=5)
    seqlens = torch.tensor([17, 40], dtype=torch.int32, device=DEV)
    k_pages, v_pages, table = to_pages(k, v, 16, seed=5)
    calls = {
        "contiguous": (decode_attention, (q, k, v, seqlens)),
        "contiguous, no lengths": (decode_attention, (q, k, v)),
        "contiguous, 3 splits": (lambda *a: decode_attention(*a, num_splits=3), (q, k, v, seqlens)),
        "paged": (paged_decode_attention, (q, k_pages, v_pages, table, seqlens)),
    }
    for name, (fn, args) in calls.items():
        torch._dynamo.reset()
        got = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
        assert torch.equal(got, fn(*args)), f"{name}: compiled differs from eager"
    torch.library.opcheck(paged_decode_attention_op, (q, k_pages, v_pages, table, seqlens, True, 0.3))
    bad = table.clone()
    bad[1, 2] = k_pages.shape[0] + 4
    torch._dynamo.reset()
    if not course_lib.ON_GPU:  # on a GPU the compiled call checks nothing unless validate=True (a sync)
        with pytest.raises(ValueError, match="paged_decode_attention: .*page"):
            torch.compile(paged_decode_attention, fullgraph=True, backend="aot_eager")(
                q, k_pages, v_pages, bad, seqlens
            )
    torch._dynamo.reset()
    # raised while tracing: with fullgraph, Dynamo hands it on inside its own error, message and all
    refused = (ValueError, torch._dynamo.exc.Unsupported)
    with pytest.raises(
        refused, match=r"decode_attention: return_lse=True is not available under torch.compile"
    ):
        torch.compile(lambda *a: decode_attention(*a, return_lse=True), fullgraph=True, backend="aot_eager")(
            q, k, v, seqlens
        )
