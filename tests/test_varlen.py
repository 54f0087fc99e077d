"""Packed sequences of different lengths (`flash_attention_varlen`): each sequence attends to its own keys.

Forward and backward against the float64 reference run one sequence at a time, over ragged lengths (0,
1, odd, longer than a block, Nq != Nk per sequence), both causal alignments, grouped-query attention,
sliding windows and attention sinks, every dtype, non-contiguous inputs; the same call on a padded batch;
the custom operator under torch.compile; bad bounds named. CPU through the interpreter at tiny sizes, GPU
at real ones (`@pytest.mark.gpu`).
"""

from __future__ import annotations

import pytest
import torch

import course_lib
from course_lib import flash_attention
from course_lib.attention.blocks import sequence_py
from course_lib.attention.reference import attention_varlen
from course_lib.attention.varlen import flash_attention_varlen, sequences
from course_lib.testing import FLOOR, assert_close_to_reference

DEVICE = course_lib.DEVICE
ON_GPU = course_lib.ON_GPU
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def _packed(lens_q, lens_k, hq, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), hq, d, generator=g)
    k = torch.randn(sum(lens_k), hkv, d, generator=g)
    v = torch.randn(sum(lens_k), hkv, d, generator=g)
    return (t.to(dtype).to(DEVICE).requires_grad_(True) for t in (q, k, v))


def _check(lens_q, lens_k, hq, hkv, d, dtype, causal, window=None, with_sinks=False, seed=0, what=""):
    """O and every gradient against the float64 reference, within twice plain PyTorch's own error in
    the dtype (the same reference run in that dtype) plus the floor."""
    q, k, v = _packed(lens_q, lens_k, hq, hkv, d, dtype, seed)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    sinks = None
    if with_sinks:
        sinks = (torch.randn(hq, generator=torch.Generator().manual_seed(seed + 1)) * 2).to(DEVICE)
        sinks.requires_grad_(True)
    inputs = [q, k, v] + ([sinks] if with_sinks else [])
    o = flash_attention_varlen(q, k, v, cu_q, cu_k, causal=causal, window=window, sinks=sinks)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, inputs, do)

    def reference(cast):
        ins = [t.detach().to(cast(t)).requires_grad_(True) for t in inputs]
        s = ins[3] if with_sinks else None
        out, _ = attention_varlen(*ins[:3], cu_q, cu_k, causal, window=window, sinks=s)
        return out.detach(), torch.autograd.grad(out, ins, do.to(out.dtype))

    ref_o, ref_g = reference(lambda t: torch.float64)
    base_o, base_g = reference(lambda t: t.dtype)
    what = f"{what} lengths q {lens_q} k {lens_k}, {hq}/{hkv} heads, d={d}, causal={causal}, window={window}, {dtype}"
    assert torch.isfinite(o).all(), f"O has NaN/inf, {what}"
    assert_close_to_reference(o, ref_o, base_o, what=f"O, {what}")
    for name, g, t, r, b in zip(("dq", "dk", "dv", "dsinks"), grads, inputs, ref_g, base_g):
        assert g.shape == t.shape, f"{name}, {what}: gradient shape {g.shape}"
        # dsinks (float32) sums a term per row made from the inputs' dtype (D from O and dO): the floor is
        # that dtype's, scaled by the gradient's size, as in test_attention_sinks
        floor = FLOOR[dtype] * max(1.0, float(r.abs().max())) if name == "dsinks" else None
        assert_close_to_reference(g, r, b, what=f"{name}, {what}", floor=floor)


# (query lengths, key lengths, causal): the interpreter's blocks are 32 x 32; a sequence may have no
# queries, no keys, one of each, or more queries than keys.
CASES = [
    ([5, 40, 1, 0, 33], [5, 40, 1, 4, 33], False),
    ([5, 40, 1, 0, 33], [5, 40, 1, 4, 33], True),
    ([3, 17, 1, 9], [20, 17, 70, 0], "bottom_right"),  # chunked prefill / verification against caches
    ([40, 6, 65], [12, 6, 65], "bottom_right"),  # Nq > Nk: the first rows see no key
    ([1, 1, 1], [37, 1, 64], False),  # one decoding step per sequence
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lens_q,lens_k,causal", CASES)
def test_varlen_matches_reference(lens_q, lens_k, causal, dtype):
    _check(lens_q, lens_k, 4, 2, 32, dtype, causal, seed=len(lens_q) + sum(lens_k))


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_varlen_grouped_query_heads(group):
    _check([9, 50, 2], [30, 50, 2], 8, 8 // group, 16, torch.float32, "bottom_right", seed=group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_window_and_sinks(dtype):
    """Sliding windows and attention sinks per sequence, as a packed gpt-oss batch has them."""
    _check([5, 40, 1, 33], [5, 70, 9, 33], 4, 2, 32, dtype, "bottom_right", window=7, with_sinks=True, seed=3)
    _check([30, 2], [30, 0], 2, 1, 16, dtype, True, with_sinks=True, seed=4, what="a sequence without keys:")


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_equals_the_padded_call_on_equal_lengths(causal):
    """B sequences of one length packed give what the (B, H, N, d) call gives, forward and backward."""
    B, H, N, d = 3, 4, 37, 32
    q, k, v = _packed([N] * B, [N] * B, H, H, d, torch.float32, seed=9)
    o = flash_attention_varlen(q, k, v, _cu([N] * B), _cu([N] * B), N, N, causal=causal)
    as4 = [t.detach().view(B, N, H, d).transpose(1, 2).requires_grad_(True) for t in (q, k, v)]
    o4 = flash_attention(*as4, causal=causal)
    torch.testing.assert_close(o, o4.transpose(1, 2).reshape(B * N, H, d), rtol=1e-5, atol=1e-5)
    do = torch.randn_like(o)
    for a, b in zip(
        torch.autograd.grad(o, (q, k, v), do),
        torch.autograd.grad(o4, as4, do.view(B, N, H, d).transpose(1, 2)),
    ):
        torch.testing.assert_close(a, b.transpose(1, 2).reshape(a.shape), rtol=1e-5, atol=1e-5)


def test_varlen_takes_strided_inputs():
    """q, k, v cut from one packed (total, 3, H, d) projection (strided rows), and a head dim that is
    not a power of two."""
    lens = [7, 33, 1]
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(sum(lens), 3, 2, 40, generator=g).to(DEVICE)
    q, k, v = qkv.unbind(1)
    assert not q.is_contiguous()
    o = flash_attention_varlen(q, k, v, _cu(lens), _cu(lens), causal=True)
    ref, _ = attention_varlen(*(t.double() for t in (q, k, v)), _cu(lens), _cu(lens), True)
    torch.testing.assert_close(o.double(), ref, rtol=2e-5, atol=2e-5)


def test_sequence_twin_and_pack():
    """`blocks.sequence_py` reads a sequence's bounds as the kernels do; `Sequences.pack` returns padded
    per-row values to the packed order."""
    bounds = [0, 0, 3, 5, 3, 9, 7, 9]  # (q, k) bounds of three sequences: (3, 5), (0, 4), (4, 0)
    assert sequence_py(bounds, 0, 9, 9, 0, 1) == (0, 0, 3, 0, 5, 0)
    assert sequence_py(bounds, 1, 9, 9, 0, 2) == (0, 3, 0, 5, 4, 4)
    assert sequence_py(bounds, 2, 9, 9, 0, 2) == (0, 3, 4, 9, 0, -4)
    assert sequence_py(None, 2, 9, 8, -1, 0) == (2, 0, 9, 0, 8, -1)
    q = torch.zeros(7, 2, 16, device=DEVICE)
    k = torch.zeros(9, 2, 16, device=DEVICE)
    seqs = sequences(_cu([3, 0, 4]), _cu([5, 4, 0]), None, None, q, k, "test")
    assert (seqs.count, seqs.max_q, seqs.max_k) == (3, 4, 5)
    assert seqs.bounds.tolist() == bounds
    padded = torch.arange(3 * 2 * 4, device=DEVICE).view(3, 2, 4)
    want = torch.tensor([[0, 1, 2, 16, 17, 18, 19], [4, 5, 6, 20, 21, 22, 23]], device=DEVICE)
    assert torch.equal(seqs.pack(padded), want)


def test_varlen_under_torch_compile():
    """The packed call is one custom-operator node under torch.compile(fullgraph=True), forward and
    backward, with the eager call's values."""
    lens_q, lens_k = [5, 40, 1], [9, 40, 3]
    q, k, v = _packed(lens_q, lens_k, 4, 2, 16, torch.float32, seed=5)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)

    def f(q, k, v):
        return flash_attention_varlen(q, k, v, cu_q, cu_k, 40, 40, causal="bottom_right").square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager" if not ON_GPU else "inductor")
    loss, loss_c = f(q, k, v), compiled(q, k, v)
    torch.testing.assert_close(loss_c, loss)
    for a, b in zip(torch.autograd.grad(loss_c, (q, k, v)), torch.autograd.grad(loss, (q, k, v))):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(cu_seqlens_q=[1, 5, 9]), "start at 0"),
        (dict(cu_seqlens_q=[0, 5, 8]), "end at the number of rows"),
        (dict(cu_seqlens_k=[0, 7, 5, 9]), "same sequences"),
        (dict(cu_seqlens_k=[0, 7, 5]), "decreases at sequence 1"),
        (dict(max_seqlen_q=3), "max_seqlen_q=3"),
        (dict(max_seqlen_k=-1), "max_seqlen_k must be >= 0"),
        (dict(cu_seqlens_q="float"), "int32 or int64"),
        (dict(cu_seqlens_q="2d"), "1-D"),
        (dict(q="4d"), r"\(total rows, heads, head dim\)"),
        (dict(k="heads"), "multiple"),
    ],
)
def test_varlen_bad_arguments_are_named(change, match):
    q = torch.randn(9, 4, 16, device=DEVICE)
    k = v = torch.randn(5, 2, 16, device=DEVICE)
    args = dict(
        q=q, k=k, v=v, cu_seqlens_q=[0, 4, 9], cu_seqlens_k=[0, 2, 5], max_seqlen_q=None, max_seqlen_k=None
    )
    for name, value in change.items():
        args[name] = value
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        if args[name] == "float":
            args[name] = torch.tensor([0.0, 4.0, 9.0], device=DEVICE)
        elif args[name] == "2d":
            args[name] = torch.tensor([[0, 4, 9]], dtype=torch.int32, device=DEVICE)
        else:
            args[name] = torch.tensor(args[name], dtype=torch.int32, device=DEVICE)
    if args["q"] == "4d":
        args["q"] = q[None]
    if args["k"] == "heads":
        args["k"] = args["v"] = torch.randn(5, 3, 16, device=DEVICE)
    with pytest.raises((ValueError, TypeError), match=match):
        flash_attention_varlen(**args)


@pytest.mark.parametrize(
    "cu_q,match",
    [
        ([0, 2**32 + 4, 9], "decreases at sequence 1"),  # 2**32 + 4 is 4 as int32
        ([0, 4, 2**32 + 9], "end at the number of rows"),
        ([2**32, 4, 9], "start at 0"),
    ],
)
def test_varlen_int64_bounds_past_int32_are_named(cu_q, match):
    """int64 cumulative lengths are checked as given, not as the int32 copy the kernels read (where they
    wrap around to valid-looking bounds)."""
    q = torch.randn(9, 2, 16, device=DEVICE)
    k = v = torch.randn(5, 2, 16, device=DEVICE)
    cu_k = torch.tensor([0, 2, 5], dtype=torch.int64, device=DEVICE)
    cu_q = torch.tensor(cu_q, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        o = flash_attention_varlen(q, k, v, cu_q, cu_k)
        raise AssertionError(f"cu_seqlens_q {cu_q.tolist()} (int64, 9 rows) accepted, O {tuple(o.shape)}")


def test_varlen_max_seqlen_as_an_upper_bound():
    """max_seqlen_* above the longest sequence (a model's context length) gives the same result, and the
    grid and the backward's D (sequences, heads, longest) are sized by the rows, not by the bound: 2**40
    would otherwise launch 2**37 programs per head and allocate 2**40 floats per sequence and head."""
    lens_q, lens_k = [5, 40, 1], [9, 40, 3]
    q, k, v = _packed(lens_q, lens_k, 4, 2, 16, torch.float32, seed=6)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    for validate in (True, False):
        seqs = sequences(cu_q, cu_k, 2**40, 2**40, q, k, "test", validate)
        assert (seqs.max_q, seqs.max_k) == (46, 52), (
            f"max_seqlen 2**40, validate={validate}, rows 46 / 52: grid sized for {seqs.max_q} / {seqs.max_k}"
        )
    o = flash_attention_varlen(q, k, v, cu_q, cu_k, 4096, 4096, causal="bottom_right")
    o_exact = flash_attention_varlen(q, k, v, cu_q, cu_k, 40, 40, causal="bottom_right")
    torch.testing.assert_close(o, o_exact, rtol=0, atol=0, msg="max_seqlen 4096 vs 40, bottom_right")
    do = torch.randn_like(o)
    for name, a, b in zip(
        "qkv", torch.autograd.grad(o, (q, k, v), do), torch.autograd.grad(o_exact, (q, k, v), do)
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"d{name}, max_seqlen 4096 vs 40, bottom_right")


def test_varlen_opcheck_forward_and_backward():
    """torch.library.opcheck on the packed operators: schema, fake implementation, autograd registration,
    AOT dispatch; with a sequence without queries, one without keys, a window and sinks."""
    lens_q, lens_k = [3, 0, 17], [5, 4, 0]
    q, k, v = (t.detach() for t in _packed(lens_q, lens_k, 4, 2, 16, torch.float32, seed=8))
    sinks = torch.randn(4, device=DEVICE)
    args = (_cu(lens_q), _cu(lens_k), 17, 5, "bottom_right", 0.25, 3, sinks)
    ops = torch.ops.course_lib
    torch.library.opcheck(ops.flash_attention_varlen_forward, (q.requires_grad_(), k, v, *args))
    o, lse = ops.flash_attention_varlen_forward(q, k, v, *args)
    do = torch.randn_like(o)
    torch.library.opcheck(ops.flash_attention_varlen_backward, (do, q.detach(), k, v, o.detach(), lse, *args))


def test_varlen_errors_quote_the_shapes_given():
    """The packed checks speak of the (total, heads, d) tensors given, not of the (1, heads, total, d)
    views the kernels run on (a message once said "dim -3" and quoted shapes never passed)."""
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device=DEVICE) for c in ([0, 3, 8], [0, 4, 6]))
    for (nq, nk, nv, hq, hkv), words in (
        (
            (8, 6, 5, 2, 2),
            r"k and v must have one shape \(total_k, Hkv, d\); got q \(8, 2, 16\), k \(6, 2, 16\)",
        ),
        (
            (8, 6, 6, 0, 0),
            r"q needs at least one row, and q, k, v at least one head \(dim 1\); got q \(8, 0, 16\)",
        ),
        ((8, 6, 6, 3, 2), r"q's 3 heads must be a multiple of k and v's 2 .* got q \(8, 3, 16\)"),
    ):
        q, k, v = (torch.randn(n, h, 16, device=DEVICE) for n, h in ((nq, hq), (nk, hkv), (nv, hkv)))
        with pytest.raises(ValueError, match=f"^flash_attention_varlen: {words}"):
            flash_attention_varlen(q, k, v, cu_q, cu_k)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(v="short"), r"k and v must have one shape \(total_k, Hkv, d\)"),
        (dict(d=12), "head dim d=12"),
        (dict(scale=-0.25), "positive finite"),
        (dict(window=-3), "window must be >= 1"),
        (dict(do="short"), "do must match q"),
        (dict(lse="float16"), "lse must be"),
    ],
)
def test_varlen_operators_check_their_arguments(change, match):
    """torch.ops.course_lib.flash_attention_varlen_forward / _backward are public: they check q, k, v,
    scale, window (and dO, O, L) as flash_attention_varlen does, as the padded operators do, instead of
    handing the kernels what they cannot take (a short v read past its end, a negative scale, NaN)."""
    d = change.get("d", 16)
    q, k, v = (torch.randn(9, 2, d, device=DEVICE) for _ in range(3))
    if change.get("v") == "short":
        v = v[:6]  # a view: the rows past its end are still memory, which an unchecked forward reads
    cu = _cu([4, 5])
    scale, window = change.get("scale", 0.25), change.get("window", 0)
    ops = torch.ops.course_lib
    with pytest.raises((ValueError, TypeError), match=match):
        o, lse = ops.flash_attention_varlen_forward(q, k, v, cu, cu, 5, 5, "top_left", scale, window)
        if "do" in change or "lse" in change:  # (an unchecked backward of a short v writes past dV's end)
            do = o[:8] if "do" in change else torch.randn_like(o)
            lse = lse.half() if "lse" in change else lse
            ops.flash_attention_varlen_backward(do, q, k, v, o, lse, cu, cu, 5, 5, "top_left", scale, window)
        raise AssertionError(f"{change}: no error, O max |{float(o.abs().max()):.3g}|")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="real sizes need the compiled kernels")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_varlen_real_sizes_gpu(d, causal):
    """bf16 on the GPU, 32 query / 8 K/V heads, lengths from 1 to 1500 (blocks of 64 and 128 rows)."""
    lens_q = [1, 700, 129, 1500, 64, 0, 333]
    lens_k = [n + 100 for n in lens_q] if causal == "bottom_right" else lens_q
    _check(lens_q, lens_k, 32, 8, d, torch.bfloat16, causal, seed=d)


def test_padded_refuses_an_additive_float_mask():
    """An additive mask (0 for real tokens, -inf for padding: SDPA's float convention) read as 0/1 would
    keep the padding and drop the real tokens; refused by name instead."""
    from course_lib.attention.varlen import flash_attention_padded

    q, k, v = (torch.randn(2, 2, 6, 16, device=DEVICE) for _ in "qkv")
    real = torch.ones(2, 6, dtype=torch.bool, device=DEVICE)
    real[1, :2] = False
    additive = torch.zeros(2, 6, device=DEVICE).masked_fill(~real, float("-inf"))
    with pytest.raises(TypeError, match="padding must be bool or 0/1 integers"):
        flash_attention_padded(q, k, v, additive, causal=True)
    # the same mask as bool and as 0/1 integers gives one answer
    a = flash_attention_padded(q, k, v, real, causal=True)
    b = flash_attention_padded(q, k, v, real.long(), causal=True)
    assert torch.equal(a, b), "bool and 0/1 integer padding masks differ"


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda q, k, v, p: (q, k[:1], v[:1], p), "batch"),  # k, v of another batch than q
        (lambda q, k, v, p: (q, k, v[:, :, :4], p), "number of keys"),  # fewer keys in v than in k
        (
            lambda q, k, v, p: (q.int(), k.int(), v.int(), p & False),
            "dtype|float",
        ),  # no real token: still checked
        (lambda q, k, v, p: (q[..., :12], k[..., :12], v[..., :12], p & False), "head dim"),
        (lambda q, k, v, p: (q, k, v, p.to("meta")), "meta"),
    ],
)
def test_padded_checks_its_inputs_first(change, words):
    """The dense inputs are checked as `flash_attention` checks them, before the gather and before the
    shortcut for a batch with no real token."""
    from course_lib.attention.varlen import flash_attention_padded

    q, k, v = (torch.randn(2, 2, 6, 16, device=DEVICE) for _ in "qkv")
    real = torch.ones(2, 6, dtype=torch.bool, device=DEVICE)
    with pytest.raises((ValueError, TypeError), match=words):
        flash_attention_padded(*change(q, k, v, real))


def test_padded_operators_check_what_the_function_checks():
    """`torch.ops.course_lib.flash_attention_padded_forward` / `_backward` are public: called directly they
    check their arguments as `flash_attention_padded` does, where a (B, Nk - 1) mask once failed inside
    indexing and an additive float mask was silently read inverted."""
    import course_lib.attention.op  # noqa: F401  (registers the operators)

    fwd, bwd = (getattr(torch.ops.course_lib, f"flash_attention_padded_{p}") for p in ("forward", "backward"))
    q, k, v = (torch.randn(2, 2, 6, 16, device=DEVICE) for _ in "qkv")
    real = torch.ones(2, 6, dtype=torch.bool, device=DEVICE)
    additive = torch.zeros(2, 6, device=DEVICE)
    for args, error, words in (
        ((q, k, v, real[:, :5], "none", 0.25), ValueError, r"padding must be \(batch, keys\) = \(2, 6\)"),
        ((q, k, v, additive, "none", 0.25), TypeError, "padding must be bool or 0/1 integers"),
        (
            (torch.randn(2, 2, 8, 16, device=DEVICE), k, v, real, "none", 0.25),
            ValueError,
            "the queries are the last positions of the keys: Nq=8 > Nk=6",
        ),
        ((q[:, :, :3], k, v, real, "top_left", 0.25), ValueError, "causal must be 'none' or 'bottom_right'"),
        ((q, k, v, real, "bottom_right", 0.25, -1), ValueError, "window must be >= 1"),
    ):
        with pytest.raises(error, match=f"^course_lib::flash_attention_padded_forward: {words}"):
            fwd(*args)
    o, lse = fwd(q, k, v, real, "bottom_right", 0.25)
    with pytest.raises(TypeError, match="^course_lib::flash_attention_padded_backward: padding must be bool"):
        bwd(torch.randn_like(o), q, k, v, o, lse, additive, "bottom_right", 0.25)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_varlen_in_a_cuda_graph():
    """Captured with the maxima given (an upper bound), a replay gives the eager call's output for new
    inputs; without them the capture is refused by name (computing them reads the GPU)."""
    lens = [5, 0, 130, 64]
    q, k, v = _packed(lens, lens, 4, 2, 64, torch.bfloat16, seed=3)
    cu = _cu(lens)
    q, k, v = (t.detach() for t in (q, k, v))
    eager = flash_attention_varlen(q, k, v, cu, cu, 256, 256, causal=True)
    static = [torch.randn_like(t) for t in (q, k, v)]  # captured on other values than the replay's
    flash_attention_varlen(*static, cu, cu, 256, 256, causal=True)  # compile before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attention_varlen(*static, cu, cu, 256, 256, causal=True)
    for s, t in zip(static, (q, k, v)):
        s.copy_(t)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager), "CUDA-graph replay differs from the eager call"
    with pytest.raises(ValueError, match="inside a CUDA graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            flash_attention_varlen(*static, cu, cu, None, None, causal=True)
