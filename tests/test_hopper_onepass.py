"""Tests of course_lib.attention.hopper_onepass: FlashAttention-3's one-pass backward in Gluon (dK, dV and dQ
from one kernel in the transposed layout, dQ added by TMA's reduce-add), the backward's default at d = 64 on
Hopper GPUs (`choose`).

On a Hopper GPU: dQ, dK, dV against the float64 reference for ragged lengths (the last query tile of a head
adds zeros to the next head's rows, or falls past the tensor), Nq != Nk, both causal alignments with rows
that see no key, grouped- and multi-query attention, bf16 and fp16, d = 64 and 128, dQ in 1 or 2 chunks; the
default backward runs it where `choose` says (and the sinks' gradient with it), not under deterministic
algorithms, and falls back to the two kernels if it fails.
Anywhere: the module imports (the Gluon builder it calls for the reduce is there); `choose`; the D pass's
padded base-2 statistics it reads.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import course_lib
from course_lib.attention import backward as bwd_mod
from course_lib.attention.d_pass import preprocess
from course_lib.attention.forward import forward as attention_forward
from course_lib.checks import causal_alignment, causal_offset
from course_lib.testing import assert_close_to_reference, random_qkv, reference_outputs

onepass = pytest.importorskip("course_lib.attention.hopper_onepass", reason="needs a Triton with Gluon")

ON_HOPPER = course_lib.ON_GPU and torch.cuda.get_device_capability()[0] == 9
hopper_gpu = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (compute capability 9.x)")


def test_the_reduce_is_in_this_triton():
    """The kernel's TMA reduce-add goes through Gluon's builder: this Triton has it."""
    from triton._C.libtriton import gluon_ir, ir

    assert hasattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce")
    assert hasattr(ir.DESCRIPTOR_REDUCE_KIND, "ADD")


# (name, q shape (B, H, Nq), Nk, K/V heads, causal)
CASES = [
    ("N=1000, Nk=1531", (2, 3, 1000), 1531, 3, False),
    ("N=1000, Nk=1531, causal", (2, 3, 1000), 1531, 3, True),
    ("Nq=77 < Nk=300, bottom-right", (2, 3, 77), 300, 3, "bottom_right"),
    ("Nq=300 > Nk=77, bottom-right (rows that see no key)", (2, 3, 300), 77, 3, "bottom_right"),
    ("N=130 ragged", (1, 5, 130), 130, 5, False),
    ("GQA 8 / 2, N=700, causal", (1, 8, 700), 700, 2, True),
    ("MQA 4 / 1, Nq=200, Nk=333", (2, 4, 200), 333, 1, False),
    # causal programs run a chunk of 8 (batch, K/V head) pairs at a time (in each launch's slice of pairs)
    ("2 x 41 heads, causal: slices of 21 pairs, a last chunk of 5", (2, 41, 140), 140, 41, True),
]


@hopper_gpu
@pytest.mark.parametrize("dq_chunks", (1, 2))
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("name,shape,n_k,kv_heads,causal", CASES, ids=[c[0] for c in CASES])
def test_gradients_match_reference(name, shape, n_k, kv_heads, causal, dtype, d, dq_chunks, monkeypatch):
    """dq_chunks: a warpgroup's columns of dQ in one product a step, or two (`DQ_CHUNKS`, `dq_chunks_for`). The
    (batch, K/V head) pairs in as many launches as `slices` gives without its wave rule (2-3 here, each with its
    own rows of the accumulator: the rows past a slice's end dropped); the default-path tests below run one
    launch."""
    monkeypatch.setattr(onepass, "_slices", lambda q4, k4: onepass.slices(q4.shape[0] * k4.shape[1]))
    torch.manual_seed(zlib.crc32(name.encode()) + d)
    q, k, v = random_qkv((*shape, d), n_k, dtype=dtype, device="cuda", kv_heads=kv_heads)
    do = torch.randn_like(q)
    o, lse = attention_forward(q, k, v, causal)
    offset = causal_offset(causal_alignment(causal), q.shape[2], n_k)
    _, ref = reference_outputs(*(t.cpu().double() for t in (q, k, v)), causal, None, do.cpu().double())
    _, base = reference_outputs(q, k, v, causal, None, do)
    grads = onepass.backward(q, k, v, o, do, lse, offset, bool(causal), d**-0.5, dq_chunks=dq_chunks)
    assert grads[3].shape == (q.shape[0] * q.shape[1], q.shape[2])  # D, for the sinks' gradient
    for g, got, r, b in zip("qkv", grads, ref, base):
        assert got.shape == r.shape and got.dtype == dtype
        assert torch.isfinite(got).all(), f"d{g}, {name}: not finite"
        assert_close_to_reference(got, r, b, what=f"d{g}, {name}, d={d}, {dtype}")


def test_choose():
    """d = 64 with 4096 queries and keys or more causal, 8192 not (where it was measured faster); d = 128 causal
    from 2048, non-causal from 8192 with one query head a K/V head."""
    for causal in (False, True, "bottom_right"):
        least = 4096 if causal else 8192
        for group in (1, 4):
            assert onepass.choose(64, causal, least, least, group)
            assert onepass.choose(64, causal, 16384, least, group)
            assert not onepass.choose(64, causal, least - 1, 16384, group)
            assert not onepass.choose(64, causal, 16384, least - 96, group)
            assert not onepass.choose(64, causal, 2048, 2048, group)
        assert onepass.choose(128, causal, 16384, 16384, 1)
        assert onepass.choose(128, causal, 16384, 16384, 4) == bool(causal)
        assert not onepass.choose(128, causal, 1024, 16384, 1)
        assert onepass.choose(128, causal, 2048, 2048, 4) == bool(causal)
    assert not onepass.choose(64, True, 1024, 1024, 1)
    assert not onepass.choose(64, False, 1024, 1024, 4)
    assert onepass.choose(128, True, 4096, 4096, 4) and not onepass.choose(128, False, 4096, 4096, 1)


def test_slices_cover_every_pair_once():
    """The launches' (batch, K/V head) pairs: at most 4 launches of equal count (the last may hold fewer), as many
    as keep the waves as full as the best count does, each launch 1.5 waves or more; together every pair once."""
    assert onepass.slices(1) == [(0, 1)]
    assert onepass.slices(32) == [(0, 8), (8, 8), (16, 8), (24, 8)]
    assert onepass.slices(5) == [(0, 2), (2, 2), (4, 1)]
    assert onepass.slices(8, 32, 132) == [(0, 8)]  # 256 programs: 2 launches would get under 1.5 waves each
    # 1024 programs: 4 launches of 1.94 waves (97 % full), as full as 1 launch of 7.76
    assert onepass.slices(8, 128, 132) == [(0, 2), (2, 2), (4, 2), (6, 2)]
    # 4 query heads per K/V head at 4k (32 pairs of 32 programs): not 3 launches of 2.67 waves (86 % full)
    assert onepass.slices(32, 32, 132) == [(0, 8), (8, 8), (16, 8), (24, 8)]
    # 396 programs: 3 full waves in one launch; 2 launches of 1.5 waves would take 4
    assert onepass.slices(6, 66, 132) == [(0, 6)]
    assert onepass.slices(3, 5, 132) == [(0, 3)]  # under one wave: one launch
    for n in range(1, 40):
        for blocks, sms in ((1, 0), (7, 132), (32, 132), (128, 78)):
            got = onepass.slices(n, blocks, sms)
            assert len(got) <= 4 and len({count for _, count in got[:-1]}) <= 1
            assert [p for first, count in got for p in range(first, first + count)] == list(range(n))


def test_each_slice_adds_into_a_zeroed_accumulator_and_lands_in_its_own_rows():
    """`_by_slices`, the bookkeeping `backward` and its plan (`Replay`) share: before each launch after the first,
    the accumulator's rows that launch adds into are zeroed; after it, they are cast into that slice's rows of dQ.
    Here a stand-in launch checks the zeros and adds its slice's own values."""
    cuts, per, d = onepass.slices(5), 3, 4  # (0, 2), (2, 2), (4, 1): 3 rows a pair
    dq_acc = torch.zeros(2 * per, d)
    dq_rows = torch.full((5 * per, d), float("nan"), dtype=torch.bfloat16)
    launched = []

    def launch(first, count):
        rows = count * per
        assert torch.equal(dq_acc[:rows], torch.zeros(rows, d)), f"slice {first}: accumulator not zeroed"
        dq_acc[:rows] += torch.arange(first * per, first * per + rows, dtype=torch.float32)[:, None]
        dq_acc[rows:] = -1.0  # rows past the slice: never copied
        launched.append((first, count))

    onepass._by_slices(cuts, per, dq_acc, dq_rows, launch)
    assert launched == cuts
    want = torch.arange(5 * per, dtype=torch.float32)[:, None].expand(5 * per, d)
    assert torch.equal(dq_rows.float(), want)


@pytest.mark.parametrize("n_q", (1, 70, 128))
def test_the_d_pass_writes_padded_base2_stats(n_q):
    """`d_pass.preprocess` with l3: D = rowsum(dO * O) and L2 = L log2 e in rows of 64 * k columns: D 0 and
    L2 +inf past N_Q, L2 +inf where L = -inf (a row that saw no key), L read through its strides."""
    torch.manual_seed(n_q)
    device = course_lib.DEVICE
    B, H, d = 2, 3, 64
    o, do = (torch.randn(B, H, n_q, d, device=device).to(torch.bfloat16) for _ in range(2))
    lse = torch.randn(B, n_q, H, device=device).transpose(1, 2)  # strided, as a (B, N, H) forward might give
    lse[0, 1, 0] = float("-inf")
    n_pad = -(-n_q // 64) * 64
    stats = torch.full((2, B * H, n_pad), 7.0, device=device)
    preprocess(o, do, stats[0], o.dtype, lse, stats[1])
    want_d = (o.float() * do.float()).sum(-1).reshape(B * H, n_q)
    torch.testing.assert_close(stats[0, :, :n_q], want_d, rtol=1e-5, atol=1e-5)
    assert (stats[0, :, n_q:] == 0).all()
    want_l2 = torch.where(lse.isneginf(), float("inf"), lse * 1.4426950408889634).reshape(B * H, n_q)
    torch.testing.assert_close(stats[1, :, :n_q], want_l2)
    assert stats[1, 1, 0] == float("inf")
    assert (stats[1, :, n_q:] == float("inf")).all()


@pytest.mark.parametrize("n_q, pairs", ((70, 2), (128, 6)))
def test_the_d_pass_zeroes_the_first_slice_of_the_accumulator(n_q, pairs):
    """`d_pass.preprocess` with acc: the one pass's float32 dQ accumulator of the first slice (its rows = the
    first heads' query rows, in dQ's row order) comes back zeroed, and nothing past its rows is written (here the
    slice's rows are a view of a larger buffer). One launch fewer a call than zeroing it apart."""
    torch.manual_seed(n_q)
    device = course_lib.DEVICE
    B, H, d = 2, 3, 64
    o, do = (torch.randn(B, H, n_q, d, device=device).to(torch.bfloat16) for _ in range(2))
    lse = torch.randn(B, H, n_q, device=device)
    n_pad = -(-n_q // 64) * 64
    stats = torch.empty((2, B * H, n_pad), device=device)
    rows = pairs * n_q  # the first `pairs` heads' rows (of B * H = 6)
    buffer = torch.full((B * H * n_q + 8, d), float("nan"), device=device)
    preprocess(o, do, stats[0], o.dtype, lse, stats[1], buffer[:rows])
    assert (buffer[:rows] == 0).all()
    assert buffer[rows:].isnan().all()
    torch.testing.assert_close(stats[0, :, :n_q], (o.float() * do.float()).sum(-1).reshape(B * H, n_q),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    with pytest.raises(ValueError, match="float32 accumulator"):
        preprocess(o, do, stats[0], o.dtype, lse, stats[1], buffer[:rows].to(torch.bfloat16))


def test_one_slice_casts_the_whole_accumulator():
    """`_by_slices` with one slice (short rows): one launch, then the accumulator cast into every row of dQ."""
    d, per = 4, 3
    dq_acc = torch.zeros(2 * per, d)
    dq_rows = torch.full((2 * per, d), float("nan"), dtype=torch.bfloat16)
    launched = []

    def launch(first, count):
        dq_acc.add_(torch.arange(2 * per, dtype=torch.float32)[:, None])
        launched.append((first, count))

    onepass._by_slices([(0, 2)], per, dq_acc, dq_rows, launch)
    assert launched == [(0, 2)]
    assert torch.equal(
        dq_rows.float(), torch.arange(2 * per, dtype=torch.float32)[:, None].expand(2 * per, d)
    )


def _spy(monkeypatch) -> list:
    """Record each `hopper_onepass.backward` call (its causal flag) while still running it."""
    calls = []
    real = onepass.backward
    monkeypatch.setattr(onepass, "backward", lambda *a, **kw: calls.append(a[7]) or real(*a, **kw))
    return calls


@hopper_gpu
@pytest.mark.parametrize(
    "shape,n_k,kv_heads,causal",
    [((1, 4, 8200), 8200, 4, False), ((1, 4, 4096), 4500, 2, "bottom_right"), ((4, 2, 4500), 4200, 1, True)],
    ids=("ragged", "GQA bottom-right", "MQA top-left Nq > Nk"),
)
def test_default_backward_runs_it_at_d64(shape, n_k, kv_heads, causal, monkeypatch):
    """`backward.backward` at d = 64, 4096 queries and keys or more (8192 without a mask), on half a wave of
    programs or more: the one pass runs (once), and its gradients are within PyTorch's bf16 error of float64."""
    calls = _spy(monkeypatch)
    torch.manual_seed(n_k)
    q, k, v = random_qkv((*shape, 64), n_k, dtype=torch.bfloat16, device="cuda", kv_heads=kv_heads)
    do = torch.randn_like(q)
    o, lse = attention_forward(q, k, v, causal)
    grads = bwd_mod.backward(do, q, k, v, o, lse, causal)
    assert calls == [bool(causal)], calls
    _, ref = reference_outputs(*(t.cpu().double() for t in (q, k, v)), causal, None, do.cpu().double())
    _, base = reference_outputs(q, k, v, causal, None, do)
    for g, got, r, b in zip("qkv", grads, ref, base):
        assert_close_to_reference(got, r, b, what=f"d{g}, {shape}, {causal}")


@hopper_gpu
def test_sinks_gradient_and_the_paths_it_leaves(monkeypatch):
    """With sinks the one pass gives the sinks' gradient (from its D) as the Triton kernels do; deterministic
    algorithms, `hopper=False` and d = 128 without a mask at 4096 tokens keep the two kernels (with one, the one
    pass); a failing one pass warns and falls back."""
    calls = _spy(monkeypatch)
    torch.manual_seed(11)
    q, k, v = random_qkv((1, 4, 4096, 64), 4096, dtype=torch.bfloat16, device="cuda")
    do = torch.randn_like(q)
    sinks = torch.randn(4, device="cuda")
    o, lse = attention_forward(q, k, v, True, sinks=sinks)
    got = bwd_mod.backward(do, q, k, v, o, lse, True, sinks=sinks)
    assert calls == [True]
    want = bwd_mod.backward(do, q, k, v, o, lse, True, sinks=sinks, config={"hopper": False})
    assert calls == [True]
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2, msg=name)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        bwd_mod.backward(do, q, k, v, o, lse, True)
    finally:
        torch.use_deterministic_algorithms(False)
    assert calls == [True], "the one pass ran under deterministic algorithms"
    q128, k128, v128 = (torch.cat([t, t], -1) for t in (q, k, v))
    for causal, runs in ((False, [True]), (True, [True, True])):
        o128, lse128 = attention_forward(q128, k128, v128, causal)
        bwd_mod.backward(torch.cat([do, do], -1), q128, k128, v128, o128, lse128, causal)
        assert calls == runs, f"d = 128, 4096 tokens, causal={causal}: {calls}"
    del calls[1:]

    def broken(*args, **kwargs):
        raise RuntimeError("no Gluon here")

    monkeypatch.setattr(onepass, "backward", broken)
    monkeypatch.setattr(bwd_mod, "HOPPER_ONEPASS_FAILED", [])
    with pytest.warns(RuntimeWarning, match="one-pass backward failed"):
        grads = bwd_mod.backward(do, q, k, v, o, lse, True)
    assert bwd_mod.HOPPER_ONEPASS_FAILED and "no Gluon here" in bwd_mod.HOPPER_ONEPASS_FAILED[0]
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2, msg=name)
