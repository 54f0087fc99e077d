"""Ring attention (course_lib.distributed, notebook 13): 2 and 4 CPU processes joined by gloo, against
float64 attention on the gathered sequence; sharding helpers and the block plan in one process; a
2-GPU run with NCCL (marked gpu)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import course_lib
from course_lib.attention.reference import attention
from course_lib.distributed import (
    chunk_ids,
    padded_length,
    plan_step,
    ring_attention,
    run_ranks,
    shard,
    unshard,
    work_per_rank,
)
from course_lib.distributed.workers import DISAGREEMENTS, compare_with_reference

# One launch per world size runs every case of that size: starting processes is the slow part.
CASES = {
    2: [
        dict(B=1, H=2, N=64, d=16, causal=True, sharding="zigzag"),
        dict(B=2, H=2, N=64, d=16, causal=False, sharding="contiguous"),
        dict(B=1, H=4, Hkv=2, N=61, d=16, causal=True, sharding="zigzag"),  # GQA, ragged
        dict(B=1, H=2, Hkv=1, N=64, d=16, causal=True, sharding="zigzag", backend="triton"),  # MQA
        *(dict(B=1, H=2, N=61, d=8, causal=True, sharding="zigzag", disagree=x) for x in DISAGREEMENTS),
    ],
    4: [
        dict(B=1, H=2, N=64, d=16, causal=True, sharding="zigzag"),
        dict(B=1, H=2, N=64, d=16, causal=True, sharding="contiguous"),
        dict(B=1, H=2, N=64, d=16, causal=False, sharding="zigzag"),
        dict(B=1, H=4, Hkv=1, N=50, d=16, causal=False, sharding="contiguous"),  # MQA, ragged
        dict(B=1, H=2, N=3, d=16, causal=True, sharding="zigzag"),  # ranks 1-3 hold padding only
        dict(B=1, H=2, N=40, d=16, causal=True, sharding="zigzag", subgroups=2),  # two rings of 2
    ],
}
# The Triton-kernel case runs the kernels through the interpreter on CPU tensors: only where course_lib
# interprets (a GPU run compiles them for CUDA tensors: the two-GPU test below covers that).
if not course_lib.INTERPRET:
    CASES = {w: [c for c in cases if c.get("backend") != "triton"] for w, cases in CASES.items()}
TOL = {"torch": 1e-12, "triton": 1e-6}  # float64; the interpreted kernels use float32 constants


def _name(case: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in case.items())


@pytest.fixture(scope="module")
def ring_results():
    """{world: [[errors per case] per rank]} from one gloo run per world size: every rank gathers its
    own ring's result (with subgroups, each ring is checked by its own ranks)."""
    return {
        world: run_ranks(compare_with_reference, world, (cases,), timeout=180)
        for world, cases in CASES.items()
    }


@pytest.mark.parametrize(
    "world,index", [(w, i) for w, cases in CASES.items() for i in range(len(cases))], ids=lambda x: str(x)
)
def test_ring_matches_reference(ring_results, world, index):
    case = CASES[world][index]
    per_rank = ring_results[world]
    assert len(per_rank) == world and all(len(r) == len(CASES[world]) for r in per_rank)
    if "disagree" in case:  # rank 0 differs: every rank must raise, not compute a wrong answer
        raised = [r[index]["raised"] for r in per_rank]
        assert all(
            m is not None and ("disagree" in m or "refused" in m or "seq_len =" in m) for m in raised
        ), f"world={world}, {_name(case)}: expected a ValueError on every rank, got {raised}"
        return
    tol = TOL[case.get("backend", "torch")]
    bad = {}
    for rank, results in enumerate(per_rank):
        errors = results[index]["error"]
        assert set(errors) == {"O", "dQ", "dK", "dV"}, f"rank {rank}: {sorted(errors)}"
        bad.update({f"rank {rank} {k}": e for k, e in errors.items() if not e <= tol})
    assert not bad, f"world={world}, {_name(case)}: max abs error against float64 above {tol}: {bad}"


@pytest.mark.parametrize("scheme", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world,n", [(1, 5), (2, 8), (3, 13), (4, 16)])
def test_shard_unshard_round_trip(scheme, world, n):
    x = torch.randn(2, 3, n, 4)
    parts = [shard(x, r, world, scheme) for r in range(world)]
    assert all(p.shape[-2] == padded_length(n, world, scheme) // world for p in parts)
    torch.testing.assert_close(unshard(parts, scheme, seq_len=n), x, rtol=0, atol=0)


def test_zigzag_assignment():
    assert [chunk_ids(r, 4, "zigzag") for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [chunk_ids(r, 4, "contiguous") for r in range(4)] == [(0,), (1,), (2,), (3,)]
    x = torch.arange(16).view(1, 16, 1)
    assert shard(x, 1, 2, "zigzag").flatten().tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert shard(x, 0, 2, "zigzag").flatten().tolist() == [0, 1, 2, 3, 12, 13, 14, 15]


def test_causal_work_balance():
    n = 1024
    total = n * (n + 1) // 2
    zig = [sum(steps) for steps in work_per_rank(4, "zigzag", n)]
    con = [sum(steps) for steps in work_per_rank(4, "contiguous", n)]
    assert sum(zig) == sum(con) == total
    assert max(zig) == min(zig), f"zigzag work per rank should be equal, got {zig}"
    assert con == sorted(con) and con[-1] > 6 * con[0], f"contiguous work should grow with rank, got {con}"
    with pytest.raises(ValueError, match="does not split"):  # 10 tokens over 4 ranks: refused, not miscounted
        work_per_rank(4, "contiguous", 10)


def test_plan_one_block_per_zigzag_step():
    for world in (2, 3, 4, 8):
        for rank in range(world):
            for s in range(world):
                blocks = plan_step(rank, (rank - s) % world, world, "zigzag", 32, causal=True)
                assert len(blocks) == 1, f"world={world} rank={rank} step={s}: {blocks}"


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo group of this process alone (world size 1)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_one_rank_is_plain_attention(one_rank_group):
    """A ring of one rank: O and dQ, dK, dV of plain attention (float64 autograd of the reference)."""
    q, k, v = (torch.randn(1, 2, 24, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    o = ring_attention(q, k, v, causal=True)
    do = torch.randn_like(o)
    o.backward(do)
    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ref = attention(q2, k2, v2, causal=True)
    ref.backward(do)
    torch.testing.assert_close(o, ref)
    for name, t, r in zip(("dq", "dk", "dv"), (q, k, v), (q2, k2, v2)):
        torch.testing.assert_close(t.grad, r.grad, msg=lambda m, n=name: f"{n}: {m}")


def test_clear_errors(one_rank_group):
    q = torch.randn(1, 4, 8, 16)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        ring_attention(q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16))
    with pytest.raises(ValueError, match="sharding must be one of"):
        ring_attention(q, q, q, sharding="striped")
    with pytest.raises(ValueError, match="seq_len = 5"):
        ring_attention(q, q, q, seq_len=5)
    with pytest.raises(ValueError, match="positive multiple of 2"):
        ring_attention(q[:, :, :7], q[:, :, :7], q[:, :, :7], sharding="zigzag")
    with pytest.raises(TypeError, match="share dtype"):
        ring_attention(q, q.double(), q)
    with pytest.raises(ValueError, match=r"\(B, H, N_local, d\)"):
        ring_attention(q[0], q[0], q[0])


@pytest.mark.gpu
def test_ring_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    cases = [
        dict(
            B=1,
            H=4,
            Hkv=2,
            N=2048,
            d=128,
            causal=c,
            sharding=s,
            dtype="bfloat16",
            backend="triton",
            device="cuda",
        )
        for c in (True, False)
        for s in ("zigzag", "contiguous")
    ]
    cases.append(
        dict(
            B=2,
            H=4,
            N=1001,
            d=64,
            causal=True,
            sharding="zigzag",
            dtype="float16",
            backend="triton",
            device="cuda",
        )  # ragged
    )
    per_rank = run_ranks(compare_with_reference, 2, (cases,), timeout=300, backend="nccl")
    assert len(per_rank) == 2
    for rank, results in enumerate(per_rank):
        assert len(results) == len(cases), f"rank {rank}: {len(results)} results for {len(cases)} cases"
        for case, r in zip(cases, results):
            assert set(r["error"]) == {"O", "dQ", "dK", "dV"}, f"rank {rank}: {sorted(r['error'])}"
            for name, err in r["error"].items():
                floor = 1e-3 if case["dtype"] == "float16" else 8e-3
                bound = 2 * r["baseline"][name] + floor
                assert err <= bound, (
                    f"2 GPUs, rank {rank}, {_name(case)}: {name} max error {err:.3g} above 2 x plain PyTorch "
                    f"({r['baseline'][name]:.3g}) + {floor}"
                )


def test_overlap_summary_of_a_small_trace():
    from course_lib.distributed.trace import overlap_summary

    def kernel(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    trace = {
        "traceEvents": [
            kernel("attn_fwd", 0, 1000),
            kernel("attn_fwd", 1500, 1000),
            kernel("ncclDevKernel_SendRecv", 200, 600),  # fully under compute
            kernel("ncclDevKernel_SendRecv", 2300, 400),  # half under compute
        ]
    }
    s = overlap_summary(trace)
    got = [s[k] for k in ("compute_ms", "comm_ms", "overlapped_ms", "span_ms", "hidden_fraction")]
    assert got == pytest.approx([2.0, 1.0, 0.8, 2.7, 0.8]), s


def test_run_ranks_retries_a_port_taken_after_it_was_found(monkeypatch):
    """`free_port` can hand out a port that another process binds before rank 0 listens on it: run_ranks
    then starts again on a new port instead of failing (seen on a busy 2-core CI machine). One rank is
    enough: rank 0 is the one that listens on the port (two processes fewer to start than a ring of 2)."""
    import socket

    from course_lib.distributed import launch

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real = launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda: ports.pop() if ports else real())
    try:
        assert run_ranks(compare_with_reference, 1, ([],), timeout=120) == [[]]
    finally:
        taken.close()
    assert ports == []  # the taken port was tried first
