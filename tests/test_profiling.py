"""Tests for course_lib.perf.profiling: the labelled standard attention, its cost model, the profiler
breakdown, the out-of-memory-safe sweep, saved-for-backward accounting and the recorder's CPU path."""

from __future__ import annotations

import json

import pytest
import torch

import course_lib
from course_lib.attention.reference import attention as reference_attention
from course_lib.perf import profiling


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q, n_k", [(64, 64), (48, 80), (80, 48)])
def test_standard_attention_matches_reference(causal, n_q, n_k):
    g = torch.Generator().manual_seed(n_q * 1000 + n_k)
    q = torch.randn(2, 3, n_q, 32, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, n_k, 32, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, n_k, 32, generator=g, dtype=torch.float64)
    expected = reference_attention(q, k, v, causal=causal)
    for label_steps in (True, False):
        out = profiling.standard_attention(q, k, v, causal=causal, label_steps=label_steps)
        torch.testing.assert_close(
            out,
            expected,
            msg=lambda m, labels=label_steps: f"Nq={n_q} Nk={n_k} causal={causal} labels={labels}: {m}",
        )


def test_standard_attention_dropout_changes_the_output_and_keeps_it_finite():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    plain = profiling.standard_attention(q, k, v, causal=True)
    dropped = profiling.standard_attention(q, k, v, causal=True, dropout_p=0.5)
    assert torch.isfinite(dropped).all()
    assert not torch.allclose(plain, dropped), "dropout_p=0.5 left the output unchanged"


def test_standard_attention_rejects_bad_input():
    q = torch.randn(1, 2, 16, 8)
    with pytest.raises(ValueError, match="dropout_p"):
        profiling.standard_attention(q, q, q, dropout_p=1.0)
    with pytest.raises(TypeError, match="floating-point"):
        profiling.standard_attention(q.int(), q.int(), q.int())
    with pytest.raises(ValueError, match="head dims differ"):
        profiling.standard_attention(q, torch.randn(1, 2, 16, 4), q)


def test_step_costs_follow_the_formulas():
    bh, n, d, b = 3, 100, 16, 2
    costs = {c["step"]: c for c in profiling.attention_step_costs(bh, n, d, b, causal=True, dropout=True)}
    assert list(costs) == list(profiling.STEPS)
    nn = bh * n * n
    assert costs["S = QK^T"]["flops"] == 2 * nn * d
    assert costs["S = QK^T"]["bytes"] == (2 * bh * n * d + nn) * b
    assert costs["mask"]["bytes"] == 2 * nn * b + n * n
    assert costs["softmax"]["bytes"] == 2 * nn * b
    assert costs["dropout"]["bytes"] == (2 * b + 1) * nn
    assert costs["O = PV"]["bytes"] == (nn + 2 * bh * n * d) * b
    plain = profiling.attention_step_costs(bh, n, d, b, causal=False, dropout=False)
    assert [c["step"] for c in plain] == ["S = QK^T", "softmax", "O = PV"]
    rect = profiling.attention_step_costs(1, 10, 4, 4, causal=False, dropout=False, n_keys=30)
    assert rect[0]["flops"] == 2 * 10 * 30 * 4


@pytest.mark.parametrize("bad", [{"n": 0}, {"d": -1}, {"batch_heads": 1.5}, {"elem_bytes": 0}])
def test_step_costs_reject_bad_sizes(bad):
    args = dict(batch_heads=2, n=8, d=4, elem_bytes=2) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        profiling.attention_step_costs(**args)


def test_predict_step_ms_uses_the_right_ceiling_per_kind():
    costs = [
        {"step": "mm", "kind": "matmul", "flops": 1e12, "bytes": 1.0},
        {"step": "ew", "kind": "element-wise", "flops": 1e12, "bytes": 1.0},
    ]
    mm, ew = profiling.predict_step_ms(costs, matmul_tflops=100.0, other_tflops=10.0, bandwidth_gbps=1000.0)
    assert mm == pytest.approx(10.0) and ew == pytest.approx(100.0)


def test_profile_steps_times_every_labelled_step():
    q, k, v = (torch.randn(1, 2, 128, 32, device=course_lib.DEVICE) for _ in range(3))
    result = profiling.profile_steps(
        lambda: profiling.standard_attention(q, k, v, causal=True, dropout_p=0.1), repeats=2
    )
    assert set(result["steps"]) == set(profiling.STEPS)
    assert all(ms > 0 for ms in result["steps"].values()), result["steps"]
    assert any(name == "aten::bmm" for name, _, _ in result["top_ops"]), result["top_ops"]
    with pytest.raises(ValueError, match="repeats"):
        profiling.profile_steps(lambda: None, repeats=0)


def test_sweep_records_out_of_memory_and_stops():
    called = []

    def make(n):
        called.append(n)
        if n >= 64:
            raise torch.OutOfMemoryError(f"pretend out of memory at N={n}")
        x = torch.randn(n)
        return lambda: x * 2

    rows = profiling.sweep_sequence_length(make, [16, 32, 64, 128])
    assert called == [16, 32, 64], "the sweep must stop at the first out-of-memory"
    assert [r["N"] for r in rows] == [16, 32, 64]
    assert rows[-1] == {"N": 64, "oom": True}
    assert all(r["ms"] > 0 for r in rows[:2])
    if not course_lib.ON_GPU:
        assert rows[0]["peak_bytes"] is None  # no allocator statistics on the CPU


def test_saved_for_backward_grows_as_n_squared():
    per_element = []
    for n in (32, 64):
        q, k, v = (torch.randn(1, 2, n, 16, requires_grad=True) for _ in range(3))
        saved = profiling.saved_for_backward(lambda q=q, k=k, v=v: profiling.standard_attention(q, k, v))
        n_by_n = sum(t["bytes"] for t in saved if t["shape"][-2:] == (n, n))
        assert n_by_n > 0, f"N={n}: no N x N tensor saved: {saved}"
        per_element.append(n_by_n / (2 * n * n))
    assert per_element[0] == per_element[1], per_element


def test_largest_fitting_n():
    assert profiling.largest_fitting_n(32, 80e9, 2) == 16384
    assert profiling.largest_fitting_n(1, 2 * 4 * 256**2, 4) == 256
    assert profiling.n_squared_bytes(2, 8, 2, matrices=2) == 2 * 2 * 64 * 2
    with pytest.raises(ValueError, match="not even N=1"):
        profiling.largest_fitting_n(1, 1, 2)


def test_standard_attention_record_cpu_path():
    rec = profiling.standard_attention_record(
        batch_heads=2,
        head_dim=16,
        ns=(32, 64),
        breakdown_n=64,
        dtype=torch.float32,
        compile_fused=False,
        device="cpu",
    )
    assert [r["N"] for r in rec["sweep"]] == [32, 64]
    assert set(rec["breakdown"]["steps"]) == set(profiling.STEPS)
    assert rec["breakdown"]["total_ms"] > 0
    assert "compiled_ms" not in rec["compiled"]
    json.dumps(rec)  # a record must be plain JSON


@pytest.mark.gpu
@pytest.mark.skipif(not course_lib.ON_GPU, reason="needs a CUDA GPU")
def test_standard_attention_record_on_gpu_small():
    rec = profiling.standard_attention_record(batch_heads=2, head_dim=64, ns=(256, 512), breakdown_n=256)
    assert all(r["peak_bytes"] > 0 for r in rec["sweep"]), rec["sweep"]
    assert rec["breakdown"]["device"] == "cuda"
    assert all(ms > 0 for ms in rec["breakdown"]["steps"].values()), rec["breakdown"]["steps"]
    assert "compiled_ms" in rec["compiled"], rec["compiled"]
    json.dumps(rec)
