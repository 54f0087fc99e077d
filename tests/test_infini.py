"""Infini-attention (course_lib.longctx, notebook 16) against its float64 token-by-token reference.

Runs on the CPU (the kernel in Triton's interpreter, small sizes) and on a GPU (compiled). Each case names its
shape, segment, update rule and device in the failure message.
"""

from __future__ import annotations

import pytest
import torch

import course_lib
from course_lib.longctx import (
    PasskeyModel,
    PasskeyTask,
    infini_attention,
    infini_memory_bytes,
    infini_memory_reference,
    infini_reference,
    kv_cache_bytes,
    passkey_accuracy,
    passkey_batch,
    ring_share_bytes,
    sdpa_local_attention,
    segment_attention,
    train_passkey,
)

DEVICE = course_lib.DEVICE
TOL = dict(rtol=2e-3, atol=2e-3) if course_lib.ON_GPU else dict(rtol=1e-5, atol=1e-5)  # tf32 dots on a GPU


def inputs(B, H, N, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, d, generator=g, dtype=dtype).to(DEVICE) for _ in range(3)]


def assert_near(got, want, what, **tol):
    try:
        torch.testing.assert_close(got.double().cpu(), want.double().cpu(), **(tol or TOL))
    except AssertionError as exc:
        raise AssertionError(f"{what} on {DEVICE}: {exc}") from None


CASES = [  # (B, H, N, d, segment, delta): ragged N, one short segment, several heads, both updates
    (1, 2, 37, 16, 16, False),
    (1, 2, 37, 16, 16, True),
    (2, 3, 21, 16, 8, True),
    (1, 1, 5, 32, 16, False),  # shorter than one segment: the memory is empty throughout
    (1, 2, 16, 16, 16, False),  # exactly one segment
]


@pytest.mark.parametrize("B, H, N, d, segment, delta", CASES)
def test_matches_float64_reference(B, H, N, d, segment, delta):
    q, k, v = inputs(B, H, N, d)
    gate = torch.linspace(-1.0, 1.5, H, device=DEVICE)
    o, (M, z) = infini_attention(q, k, v, segment, delta=delta, gate=gate)
    ro, (rM, rz) = infini_reference(q.cpu(), k.cpu(), v.cpu(), segment, delta=delta, gate=gate.cpu())
    case = f"B={B}, H={H}, N={N}, d={d}, segment={segment}, delta={delta}"
    assert o.dtype == q.dtype and M.dtype == z.dtype == torch.float32
    assert_near(o, ro, f"{case}: O")
    assert_near(M, rM, f"{case}: M", rtol=1e-4, atol=1e-4)
    assert_near(z, rz, f"{case}: z", rtol=1e-4, atol=1e-4)


def test_first_segment_reads_an_empty_memory_as_zero():
    """M = 0, z = 0: A_mem is defined as 0 (not 0/0 = NaN), so the output is (1 - sigmoid(beta)) A_dot."""
    q, k, v = inputs(1, 2, 16, 16, seed=3)
    o, _ = infini_attention(q, k, v, 16, gate=0.7)
    a_dot = segment_attention(q, k, v, 16)
    assert torch.isfinite(o).all()
    assert_near(o, (1 - torch.sigmoid(torch.tensor(0.7))) * a_dot, "first segment")
    a_mem, M, z = infini_memory_reference(
        q.cpu(), k.cpu(), v.cpu(), torch.zeros(1, 2, 16, 16), torch.zeros(1, 2, 16)
    )
    assert torch.equal(a_mem, torch.zeros_like(a_mem))


def test_a_stream_in_two_calls_equals_one_call():
    q, k, v = inputs(1, 2, 40, 16, seed=1)
    for delta in (False, True):
        whole, (M, z) = infini_attention(q, k, v, 8, delta=delta, gate=0.3)
        first, mem = infini_attention(q[:, :, :24], k[:, :, :24], v[:, :, :24], 8, delta=delta, gate=0.3)
        second, (M2, z2) = infini_attention(q[:, :, 24:], k[:, :, 24:], v[:, :, 24:], 8, memory=mem, delta=delta,
                                            gate=0.3)  # fmt: skip
        assert_near(
            torch.cat([first, second], 2), whole, f"two calls (delta={delta}): O", rtol=1e-6, atol=1e-6
        )
        assert_near(M2, M, f"two calls (delta={delta}): M", rtol=1e-6, atol=1e-6)
        assert_near(z2, z, f"two calls (delta={delta}): z", rtol=1e-6, atol=1e-6)


def test_the_kernel_and_pytorch_inside_a_segment_agree():
    q, k, v = inputs(1, 2, 29, 16, seed=2)
    a, _ = infini_attention(q, k, v, 8, gate=-0.5)
    b, _ = infini_attention(q, k, v, 8, gate=-0.5, local=sdpa_local_attention)
    assert_near(a, b, "kernel against SDPA inside segments")


def test_gradients_match_float64():
    """Gradients of q, k, v and the gate through the kernel (float64 under the interpreter, float32 on a GPU)
    against autograd through the float64 reference."""
    dtype = torch.float32 if course_lib.ON_GPU else torch.float64
    q, k, v = (t.requires_grad_() for t in inputs(1, 2, 11, 16, seed=4, dtype=dtype))
    gate = torch.tensor([0.2, -0.4], dtype=dtype, device=DEVICE, requires_grad=True)
    o, (M, z) = infini_attention(q, k, v, 4, delta=True, gate=gate)
    w = torch.randn_like(o)
    got = torch.autograd.grad((o * w).sum() + M.sum() + z.sum(), (q, k, v, gate))
    ref = [t.detach().cpu().double().requires_grad_() for t in (q, k, v, gate)]
    ro, (rM, rz) = infini_reference(*ref[:3], 4, delta=True, gate=ref[3])
    want = torch.autograd.grad((ro * w.cpu().double()).sum() + rM.sum() + rz.sum(), ref)
    tol = TOL if course_lib.ON_GPU else dict(rtol=1e-5, atol=1e-6)  # the kernel keeps L in float32
    for name, g1, g2 in zip(("dq", "dk", "dv", "dgate"), got, want):
        assert_near(g1, g2, f"gradient {name}", **tol)


BAD = [  # (what, call, error, words the message must contain)
    ("segment 0", lambda q: infini_attention(q, q, q, 0), ValueError, "segment"),
    ("segment -3", lambda q: infini_attention(q, q, q, -3), ValueError, "segment"),
    ("segment 4.5", lambda q: infini_attention(q, q, q, 4.5), TypeError, "segment"),
    ("segment True", lambda q: infini_attention(q, q, q, True), TypeError, "segment"),
    (
        "head dim 12",
        lambda q: infini_attention(*(torch.zeros(1, 1, 8, 12, device=DEVICE),) * 3, 4),
        ValueError,
        "head dim",
    ),  # fmt: skip
    ("3-dim q", lambda q: infini_attention(q[0], q[0], q[0], 4), ValueError, "(B, H, N, d)"),
    ("k of another length", lambda q: infini_attention(q, q[:, :, :5], q, 4), ValueError, "shape"),
    ("integer inputs", lambda q: infini_attention(*(q.long(),) * 3, 4), TypeError, "dtype"),
    ("mixed dtypes", lambda q: infini_attention(q, q.double(), q, 4), TypeError, "dtype"),
    (
        "memory M of the wrong shape",
        lambda q: infini_attention(
            q, q, q, 4, memory=(torch.zeros(1, 2, 16, 8, device=DEVICE), torch.zeros(1, 2, 16, device=DEVICE))
        ),
        ValueError,
        "memory M",
    ),  # fmt: skip
    (
        "memory in float16",
        lambda q: infini_attention(
            q,
            q,
            q,
            4,
            memory=(
                torch.zeros(1, 2, 16, 16, device=DEVICE, dtype=torch.float16),
                torch.zeros(1, 2, 16, device=DEVICE),
            ),
        ),
        TypeError,
        "memory M",
    ),  # fmt: skip
    ("memory not a pair", lambda q: infini_attention(q, q, q, 4, memory=torch.zeros(3)), TypeError, "memory"),
    (
        "gate of 3 heads",
        lambda q: infini_attention(q, q, q, 4, gate=torch.zeros(3, device=DEVICE)),
        ValueError,
        "gate",
    ),  # fmt: skip
    ("gate a string", lambda q: infini_attention(q, q, q, 4, gate="open"), TypeError, "gate"),
    ("delta 1", lambda q: infini_attention(q, q, q, 4, delta=1), TypeError, "delta"),
    ("no tokens", lambda q: infini_attention(*(q[:, :, :0],) * 3, 4), ValueError, "no tokens"),
]


@pytest.mark.parametrize("what, call, error, words", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_are_refused_by_name(what, call, error, words):
    q = torch.zeros(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(error, match=None) as info:
        call(q)
    assert words in str(info.value), f"{what}: the message does not name {words!r}: {info.value}"
    assert "infini_attention" in str(info.value)


def test_memory_bytes():
    assert infini_memory_bytes(heads=8, d=128) == 8 * (128 * 128 + 128) * 4
    assert kv_cache_bytes(65536, heads_kv=8, d=128) == 2 * 65536 * 8 * 128 * 2
    assert ring_share_bytes(65536, 4, heads_kv=8, d=128) == 2 * kv_cache_bytes(65536 // 4, 8, 128)
    assert infini_memory_bytes(8, 128) == infini_memory_bytes(8, 128)  # no N anywhere


def test_passkey_batch_puts_the_key_in_the_first_segment():
    task = PasskeyTask(n_values=8, n_filler=10, segment=16)
    tokens, answers = passkey_batch(task, 50, 40, torch.Generator().manual_seed(0))
    where = (tokens == task.key).nonzero()[:, 1]
    assert where.numel() == 50 and (where < task.segment - 1).all()
    assert torch.equal(tokens[torch.arange(50), where + 1], task.n_filler + answers)
    assert (tokens[:, -1] == task.query).all()
    with pytest.raises(ValueError, match="exceed one segment"):
        passkey_batch(task, 2, 16)


def test_a_local_model_cannot_see_the_key_and_an_infini_model_learns_it():
    """The task's point, in a few seconds on a CPU (PyTorch's attention inside segments; one thread, since
    these small matrices gain nothing from more and lose much to a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        learn_and_compare()
    finally:
        torch.set_num_threads(threads)


def learn_and_compare():
    torch.manual_seed(0)
    task = PasskeyTask(n_values=16, n_filler=32, segment=16)
    infini = PasskeyModel(task, "infini", local=sdpa_local_attention)
    train_passkey(infini, steps=150, length=64, batch=32, lr=1e-2)
    assert passkey_accuracy(infini, 128) > 0.9  # eight segments, twice the four it trained on
    local = PasskeyModel(task, "local", local=sdpa_local_attention)
    train_passkey(local, steps=30, length=64, batch=32, lr=1e-2)
    assert passkey_accuracy(local, 128) < 0.25  # chance is 1/16
