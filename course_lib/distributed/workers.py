"""What each rank runs in notebook 13's and the tests' gloo runs (`launch.run_ranks(fn, world, args)`).

They live in a module because spawned processes import the function they run. Every rank builds the
same full inputs from one seed, keeps its own shard, and returns plain numbers.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..attention.merge import merge_attention_states
from ..attention.reference import attention
from ..testing import max_error
from .local import block_forward
from .plan import plan_step
from .ring import ring_attention
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
    backend ("torch" or "triton"), seed, and optionally dtype ("float64" default, or "float32",
    "float16", "bfloat16"), device ("cpu" default, or "cuda": this rank's GPU) and subgroups (default 1:
    split the ranks into that many process groups, each running the case on its own). Returns per case
    {"error": {...}, "baseline": {...}}: the largest absolute errors of O, dQ, dK, dV against the
    float64 reference, for the ring and for plain PyTorch attention on the full sequence in the same
    dtype (the accuracy rule of `course_lib.testing`).
    A case with `disagree` (one of `DISAGREEMENTS`) instead has rank 0 call ring_attention (or, for
    "gather", `gather`) differently from the other ranks and returns {"raised": the ValueError's message,
    or None if the call returned}."""
    out = []
    for case in cases:
        if "disagree" in case:
            out.append({"raised": _disagreeing_call(rank, world, case)})
            continue
        dtype = getattr(torch, case.get("dtype", "float64"))
        device = torch.device("cuda", torch.cuda.current_device()) if case.get("device") == "cuda" else None
        full = [t.to(dtype).double() for t in _full_inputs(case, torch.float64)]  # values exact in dtype
        N, causal, scheme = case["N"], case["causal"], case["sharding"]
        groups = full[0].shape[1] // full[1].shape[1]
        want = _reference(*full, causal, groups, torch.float64, device)
        baseline = _reference(*full, causal, groups, dtype, device)
        group, g_rank, g_world = _subgroup(rank, world, case.get("subgroups", 1))
        q, k, v, do = (t.to(device=device, dtype=dtype) for t in full)
        mine = [shard(t, g_rank, g_world, scheme).requires_grad_() for t in (q, k, v)]
        o = ring_attention(
            *mine,
            causal=causal,
            group=group,
            sharding=scheme,
            backend=case.get("backend", "torch"),
            seq_len=N,
        )
        o.backward(shard(do, g_rank, g_world, scheme))
        got = [gather(t, scheme, group=group, seq_len=N) for t in (o.detach(), *(t.grad for t in mine))]
        names = ("O", "dQ", "dK", "dV")
        out.append(
            {
                "error": {n: max_error(a, b) for n, a, b in zip(names, got, want)},
                "baseline": {n: max_error(a, b) for n, a, b in zip(names, baseline, want)},
            }
        )
    return out


DISAGREEMENTS = ("causal", "seq_len", "scale", "sharding", "heads", "length", "gather")


def _disagreeing_call(rank: int, world: int, case: dict) -> str | None:
    """One call in which rank 0 differs from the others in case["disagree"]; the ValueError's message."""
    q, k, v, _ = _full_inputs(case, torch.float64)
    N, kind = case["N"], case["disagree"]
    options = dict(causal=case["causal"], sharding=case["sharding"], seq_len=N, scale=None)
    q, k, v = (shard(t, rank, world, case["sharding"]) for t in (q, k, v))
    odd = rank == 0
    if odd and kind in ("causal", "scale", "seq_len"):
        options[kind] = {"causal": not options["causal"], "scale": 0.5, "seq_len": N + 1}[kind]
    if odd and kind == "sharding":
        options["sharding"] = "contiguous" if options["sharding"] == "zigzag" else "zigzag"
    if odd and kind == "heads":  # the same bytes in another shape: (B, H, n, d) -> (B, 2H, n, d / 2)
        q, k, v = (t.reshape(*t.shape[:-3], 2 * t.shape[-3], t.shape[-2], -1) for t in (q, k, v))
    if odd and kind == "length":
        q, k, v = (t[:, :, :-2] for t in (q, k, v))
    try:
        if kind == "gather":
            gather(q.reshape(*q.shape[:-3], 2 * q.shape[-3], q.shape[-2], -1) if odd else q, case["sharding"])
        else:
            ring_attention(q, k, v, **options)
    except ValueError as e:
        return str(e)
    return None


def _subgroup(rank: int, world: int, n_groups: int):
    """(group, rank in it, its size): the ranks split into n_groups consecutive process groups
    (every rank creates every group, as torch.distributed.new_group requires); (None, rank, world) for 1."""
    if n_groups == 1:
        return None, rank, world
    if world % n_groups:
        raise ValueError(f"subgroups={n_groups} does not divide world={world}")
    per = world // n_groups
    groups = [dist.new_group(list(range(i * per, (i + 1) * per))) for i in range(n_groups)]
    group = groups[rank // per]
    return group, dist.get_rank(group), per


def _reference(q, k, v, do, causal: bool, groups: int, dtype, device):
    """O, dQ, dK, dV of standard attention on the full sequence in `dtype` (K/V repeated for GQA)."""
    leaves = [t.to(device=device, dtype=dtype, copy=True).requires_grad_() for t in (q, k, v)]
    o = attention(leaves[0], *(t.repeat_interleave(groups, dim=1) for t in leaves[1:]), causal=causal)
    o.backward(do.to(device=device, dtype=dtype))
    return [o.detach(), *(t.grad for t in leaves)]


def step_compute_times(rank: int, world: int, case: dict, schemes=("contiguous", "zigzag"), repeats: int = 3):
    """CPU seconds of the blocks this rank computes at each forward ring step, per sharding scheme:
    {scheme: [s0, s1, ...]}, the fastest of `repeats` runs.

    The blocks are those of `plan.plan_step`, computed with `local.block_forward` and merged as in
    `ring_forward`, but the ranks take turns (a barrier between them) and no K/V travel: on a CPU the
    ranks share cores, and timing them all at once would measure who got a core. case: B, H, N, d,
    causal, backend as in `compare_with_reference` (float32 inputs)."""
    out = {}
    for scheme in schemes:
        q, k, v, _ = _full_inputs(case, torch.float32)
        q, k, v = (shard(t, rank, world, scheme) for t in (q, k, v))
        backend, scale = case.get("backend", "torch"), q.shape[-1] ** -0.5
        block_forward(q, k, v, case["causal"], scale, backend)  # warm-up: first-call costs stay out
        times = []
        for s in range(world):
            blocks = plan_step(rank, (rank - s) % world, world, scheme, q.shape[2], case["causal"])
            best = float("inf")
            for turn in range(world):
                dist.barrier()
                if turn != rank:
                    continue
                for _ in range(repeats):
                    o = torch.zeros_like(q)
                    lse = torch.full(q.shape[:-1], float("-inf"))
                    t0 = time.process_time()
                    for b in blocks:
                        rows, keys = slice(b.q_lo, b.q_hi), slice(b.k_lo, b.k_hi)
                        o_b, l_b = block_forward(
                            q[:, :, rows], k[:, :, keys], v[:, :, keys], b.causal, scale, backend
                        )
                        o[:, :, rows], lse[:, :, rows] = merge_attention_states(
                            o[:, :, rows], lse[:, :, rows], o_b, l_b
                        )
                    best = min(best, time.process_time() - t0)
            times.append(best)
        out[scheme] = times
    return out
