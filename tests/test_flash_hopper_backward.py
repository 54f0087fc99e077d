"""Tests of course_lib.attention.hopper_backward: FlashAttention-3's dK/dV kernel in Gluon.

The kernel runs only on a Hopper GPU (Gluon has no interpreter): there `backward.backward` is made to
take it for every case (ragged lengths, Nq != Nk, both causal alignments with rows that see no key,
grouped- and multi-query attention, bf16 and fp16, d = 64 and 128) and dQ, dK, dV are compared with
the float64 reference; `backward.backward` is checked to take it where `choose` says and to leave it
otherwise, and to fall back to the Triton kernel if it fails. On any machine: the CPU never takes it.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

import course_lib
from course_lib.attention import backward as bwd_mod
from course_lib.attention.forward import forward as attention_forward
from course_lib.testing import assert_close_to_reference, random_qkv, reference_outputs

hopper_backward = pytest.importorskip(
    "course_lib.attention.hopper_backward", reason="needs a Triton with Gluon"
)

ON_HOPPER = course_lib.ON_GPU and torch.cuda.get_device_capability()[0] == 9
hopper_gpu = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (compute capability 9.x)")


def test_choose():
    """d = 128 and d = 64 always; other head dims never."""
    for causal in (False, True):
        for n in (1, 1024, 16384):
            for group in (1, 4):
                assert hopper_backward.choose(128, causal, n, n, group)
                assert hopper_backward.choose(64, causal, n, n, group)
                assert not hopper_backward.choose(32, causal, n, n, group)


def test_heads_per_program():
    """A whole group per program, except long non-causal rows: one query head each (partial sums)."""
    assert hopper_backward.heads_per_program(4, False, 4096) == 1
    assert hopper_backward.heads_per_program(8, False, 16384) == 1
    assert hopper_backward.heads_per_program(4, False, 2048) == 4
    assert hopper_backward.heads_per_program(4, True, 16384) == 4
    assert hopper_backward.heads_per_program(1, False, 16384) == 1


def test_cpu_never_takes_it():
    """Under the interpreter the backward has no Gluon path to take."""
    if course_lib.ON_GPU:
        pytest.skip("a GPU run")
    q, k, v = random_qkv((1, 2, 16, 64), 16)
    switches = {"HOPPER": True}
    assert bwd_mod.hopper_dkdv(q, k, v, torch.randn_like(q), False, 16, 16, switches) is None


# (name, q shape (B, H, Nq, d), Nk, K/V heads, causal): key blocks of 128, query blocks of 64.
CASES = [
    ("N=1000, Nk=1531", (2, 3, 1000, None), 1531, 3, False),
    ("N=1000, Nk=1531, causal", (2, 3, 1000, None), 1531, 3, True),
    ("Nq=77 < Nk=300, bottom-right", (2, 3, 77, None), 300, 3, "bottom_right"),
    ("Nq=300 > Nk=77, bottom-right (rows that see no key)", (2, 3, 300, None), 77, 3, "bottom_right"),
    ("Nq=300 > Nk=77, top-left", (1, 2, 300, None), 77, 2, True),
    ("N=130 ragged", (1, 5, 130, None), 130, 5, False),
    ("GQA 8 / 2, N=700, causal", (1, 8, 700, None), 700, 2, True),
    ("MQA 4 / 1, Nq=200, Nk=333", (2, 4, 200, None), 333, 1, False),
    ("N=1, one query", (3, 2, 1, None), 1, 2, True),
    # causal programs run a chunk of 8 (batch, K/V head) pairs at a time: 2 full chunks and one of 3 pairs
    ("19 heads, causal: a last chunk of 3 pairs", (1, 19, 260, None), 260, 19, True),
    ("GQA 2 x 24 / 6, bottom-right: a last chunk of 4 pairs", (2, 24, 190, None), 250, 6, "bottom_right"),
]


def _spy(monkeypatch) -> list:
    """Record each `hopper_backward.dkdv` call (its causal flag) while still running it."""
    calls = []
    real = hopper_backward.dkdv
    monkeypatch.setattr(hopper_backward, "dkdv", lambda *a: calls.append(a[-2]) or real(*a))
    return calls


def _check_gluon_gradients(monkeypatch, name, shape, n_k, kv_heads, causal, dtype, d, seed, what):
    """dQ, dK, dV of `backward.backward` with the Gluon dK/dV kernel forced on (it must run once)
    against the float64 reference, within the bound plain PyTorch in `dtype` sets."""
    monkeypatch.setattr(hopper_backward, "choose", lambda *a: True)
    calls = _spy(monkeypatch)
    torch.manual_seed(zlib.crc32(name.encode()) + seed)
    q, k, v = random_qkv(shape[:3] + (d,), n_k, dtype=dtype, device="cuda", kv_heads=kv_heads)
    do = torch.randn_like(q)
    o, lse = attention_forward(q, k, v, causal)
    grads = bwd_mod.backward(do, q, k, v, o, lse, causal)
    assert len(calls) == 1, f"{name}: the Gluon dK/dV kernel did not run"
    q64, k64, v64, do64 = (t.cpu().double() for t in (q, k, v, do))
    _, ref = reference_outputs(q64, k64, v64, causal, None, do64)
    _, base = reference_outputs(q, k, v, causal, None, do)
    for grad, g, r, b in zip(("dq", "dk", "dv"), grads, ref, base):
        assert torch.isfinite(g).all(), f"{grad}, {name}: not finite"
        assert_close_to_reference(g, r, b, what=f"{grad}, {name}, {what}")
    assert not bwd_mod.HOPPER_FAILED, bwd_mod.HOPPER_FAILED


@hopper_gpu
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("name,shape,n_k,kv_heads,causal", CASES, ids=[c[0] for c in CASES])
def test_gradients_match_reference(name, shape, n_k, kv_heads, causal, dtype, d, monkeypatch):
    _check_gluon_gradients(monkeypatch, name, shape, n_k, kv_heads, causal, dtype, d, d, f"d={d}, {dtype}")


@hopper_gpu
@pytest.mark.parametrize("name,shape,n_k,kv_heads,causal", CASES, ids=[c[0] for c in CASES])
def test_64_query_rows_a_step_at_d64(name, shape, n_k, kv_heads, causal, monkeypatch):
    """d = 64 on 64 query rows a step (`DkdvLaunch.q_rows`; d = 128's launch, and d = 64's before 128 rows
    became its default, which `test_gradients_match_reference` checks): the query blocks, the causal
    diagonal and the rows past N_Q in blocks of 64; bf16 against the float64 reference."""
    assert hopper_backward.LAUNCHES[64].q_rows == 128 and hopper_backward.LAUNCHES[128].q_rows == 64
    launch = dataclasses.replace(hopper_backward.LAUNCHES[64], q_rows=64)
    monkeypatch.setitem(hopper_backward.LAUNCHES, 64, launch)
    _check_gluon_gradients(
        monkeypatch, name, shape, n_k, kv_heads, causal, torch.bfloat16, 64, 64, "64 query rows a step"
    )


GROUPED = [c for c in CASES if c[3] < c[1][1]]  # the grouped- and multi-query cases


@hopper_gpu
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("on_chip", (1, 2))
@pytest.mark.parametrize("name,shape,n_k,kv_heads,causal", GROUPED, ids=[c[0] for c in GROUPED])
def test_partial_sums_match_reference(name, shape, n_k, kv_heads, causal, on_chip, d, monkeypatch):
    """Grouped-query attention with `on_chip` query heads per program (`heads_per_program`): each
    program writes a partial dK, dV, added up afterwards; bf16, d = 64 (128 query rows a step) and 128,
    against the float64 reference."""
    monkeypatch.setattr(hopper_backward, "heads_per_program", lambda group, causal, n_k: on_chip)
    what = f"{on_chip} heads per program, d = {d}"
    _check_gluon_gradients(monkeypatch, name, shape, n_k, kv_heads, causal, torch.bfloat16, d, on_chip, what)


@hopper_gpu
def test_backward_takes_it_where_chosen(monkeypatch):
    """`backward.backward` runs the Gluon dK/dV kernel for contiguous 16-bit inputs where `choose`
    picks it, and the Triton kernel for strided inputs, `hopper=False`, fixed launches, the atomic dQ
    mode and shapes `choose` leaves to Triton; each gives gradients as close to float64 as PyTorch's."""
    calls = _spy(monkeypatch)
    torch.manual_seed(3)
    q, k, v = random_qkv((2, 4, 700, 128), 1500, dtype=torch.bfloat16, device="cuda", kv_heads=2)
    do = torch.randn_like(q)
    o, lse = attention_forward(q, k, v, True)
    assert hopper_backward.choose(128, True, 700, 1500, 2)
    _, ref = reference_outputs(*(t.cpu().double() for t in (q, k, v)), True, None, do.cpu().double())
    _, base = reference_outputs(q, k, v, True, None, do)

    def check(grads, what):  # every path against float64, within plain PyTorch's bf16 error
        for name, g, r, b in zip(("dq", "dk", "dv"), grads, ref, base):
            assert_close_to_reference(g, r, b, f"{name}, {what}")

    check(bwd_mod.backward(do, q, k, v, o, lse, True), "the Gluon dK/dV kernel")
    assert calls == [True], f"Gluon dK/dV calls: {calls}"
    check(bwd_mod.backward(do, q, k, v, o, lse, True, config={"hopper": False}), "hopper=False")
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    check(bwd_mod.backward(do, strided, k, v, o, lse, True), "strided q")
    check(
        bwd_mod.backward(do, q, k, v, o, lse, True, config={"BLOCK_M": 64, "BLOCK_N": 64}), "a fixed launch"
    )
    check(bwd_mod.backward(do, q, k, v, o, lse, True, dq_mode="atomic"), "atomic dQ")
    q32, k32, v32 = (t[..., :32].contiguous() for t in (q, k, v))
    o32, lse32 = attention_forward(q32, k32, v32, False)
    bwd_mod.backward(do[..., :32].contiguous(), q32, k32, v32, o32, lse32, False)  # d = 32: Triton
    assert calls == [True], f"the Gluon dK/dV kernel ran where it should not: {calls}"


@hopper_gpu
def test_a_failing_kernel_falls_back_to_triton(monkeypatch):
    """If the Gluon kernel raises (a Triton whose Gluon cannot compile it), the backward warns once and
    the Triton kernel gives the gradients, then and in later calls."""
    monkeypatch.setattr(bwd_mod, "HOPPER_FAILED", [])

    def broken(*args):
        raise RuntimeError("no Gluon here")

    monkeypatch.setattr(hopper_backward, "dkdv", broken)
    torch.manual_seed(5)
    q, k, v = random_qkv((1, 2, 300, 128), 300, dtype=torch.bfloat16, device="cuda")
    do = torch.randn_like(q)
    o, lse = attention_forward(q, k, v, False)
    with pytest.warns(RuntimeWarning, match="Hopper dK/dV kernel failed"):
        grads = bwd_mod.backward(do, q, k, v, o, lse, False)
    assert bwd_mod.HOPPER_FAILED and "no Gluon here" in bwd_mod.HOPPER_FAILED[0]
    expected = bwd_mod.backward(do, q, k, v, o, lse, False, config={"hopper": False})
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
