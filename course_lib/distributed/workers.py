"""What each rank runs in notebook 13's and the tests' gloo runs (`launch.run_ranks(fn, world, args)`).

They live in a module because spawned processes import the function they run. Every rank builds the
same full inputs from one seed, keeps its own shard, and returns plain numbers.
"""

from __future__ import annotations

import time

import torch

from ..attention.reference import attention
from .ring import ring_attention, ring_forward
from .sharding import gather, shard


def _full_inputs(case: dict, dtype: torch.dtype):
    """q (B, H, N, d), k, v (B, Hkv, N, d) and dO, random from case["seed"], identical on every rank."""
    g = torch.Generator().manual_seed(case.get("seed", 0))
    B, H, Hkv, N, d = case["B"], case["H"], case.get("Hkv", case["H"]), case["N"], case["d"]
    q = torch.randn(B, H, N, d, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, N, d, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, N, d, generator=g, dtype=dtype)
    do = torch.randn(B, H, N, d, generator=g, dtype=dtype)
    return q, k, v, do


def compare_with_reference(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Ring attention against single-device float64 attention on the gathered sequence.

    Each case: B, H, Hkv (optional), N (total, any length: padded when uneven), d, causal, sharding,
    backend ("torch" or "triton"), seed. Returns per case the largest absolute error of O, dQ, dK, dV."""
    out = []
    for case in cases:
        q, k, v, do = _full_inputs(case, torch.float64)
        N, causal, scheme = case["N"], case["causal"], case["sharding"]
        # reference: GQA as a repeat of K/V over the query heads that share them (autograd sums dK, dV back)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        groups = q.shape[1] // k.shape[1]
        o_ref = attention(ref[0], *(t.repeat_interleave(groups, dim=1) for t in ref[1:]), causal=causal)
        o_ref.backward(do)
        mine = [shard(t, rank, world, scheme).requires_grad_() for t in (q, k, v)]
        o = ring_attention(
            *mine, causal=causal, sharding=scheme, backend=case.get("backend", "torch"), seq_len=N
        )
        o.backward(shard(do, rank, world, scheme))
        errors = {}
        for name, got, want in zip(
            ("O", "dQ", "dK", "dV"), (o.detach(), *(t.grad for t in mine)), (o_ref, *(t.grad for t in ref))
        ):
            full = gather(got, scheme, seq_len=N)
            errors[name] = (full - want.detach()).abs().max().item()
        out.append(errors)
    return out


def step_compute_times(rank: int, world: int, case: dict, repeats: int = 3) -> list[float]:
    """Seconds of compute at each forward ring step on this rank (fastest of `repeats` runs).

    case: B, H, N, d, causal, sharding, backend as in `compare_with_reference` (float32 inputs)."""
    q, k, v, _ = _full_inputs(case, torch.float32)
    q, k, v = (shard(t, rank, world, case["sharding"]) for t in (q, k, v))
    best = None
    for _ in range(repeats):
        times: list[float] = []
        torch.distributed.barrier()
        ring_forward(
            q, k, v, case["causal"], None, case["sharding"], None, case.get("backend", "torch"), None, times
        )
        best = times if best is None else [min(a, b) for a, b in zip(best, times)]
    return best


def wall_time(rank: int, world: int, case: dict, repeats: int = 3) -> float:
    """Seconds for one forward + backward of ring attention over all ranks (fastest of `repeats`)."""
    q, k, v, do = _full_inputs(case, torch.float32)
    q, k, v, do = (shard(t, rank, world, case["sharding"]) for t in (q, k, v, do))
    best = float("inf")
    for _ in range(repeats):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.distributed.barrier()
        t0 = time.perf_counter()
        ring_attention(*leaves, causal=case["causal"], sharding=case["sharding"]).backward(do)
        torch.distributed.barrier()
        best = min(best, time.perf_counter() - t0)
    return best
