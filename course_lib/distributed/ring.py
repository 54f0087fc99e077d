"""Ring attention: one attention shared by the ranks of a process group (notebook 13).

Every rank holds a slice of the sequence (`sharding`): its queries Q_r and its keys and values K_r, V_r,
layout (B, H, N_local, d). Attention over the whole sequence needs every Q_r against every K_s, V_s. The
ranks form a ring: at step s rank r holds the K/V of rank (r - s) mod world, computes the blocks of its
queries against them (`plan.plan_step`) and merges the partial (O, L) into its running result with the
logsumexp rule (`course_lib.attention.merge.merge_attention_states`, notebook 03). Meanwhile the K/V it
holds travel on to rank r + 1 (`torch.distributed.batch_isend_irecv`): the transfer of step s + 1's K/V
overlaps the compute of step s. After world steps each rank has its exact output rows.

Backward (the same ring again): each rank keeps its dQ. dK and dV of rank src's keys are summed along the
ring: every rank adds its contribution to the accumulator that travels with those keys, and after the
last step the finished dK, dV arrive at their owner. Each block's backward uses the merged O and L
(P = exp(S - L) is the block's share of the full softmax), so no step is recomputed in a different way.

Bytes a rank sends per step, forward: 2 * B * Hkv * N_local * d * bytes(dtype) (its K and V);
backward: the same K/V plus dK/dV accumulators in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..attention.merge import merge_attention_states
from ..checks import FLOAT_DTYPES, accumulator_dtype, check_dtype, check_tensor, default_scale
from ..second_derivative import refuse_second_derivative
from .local import block_backward, block_forward, resolve_backend
from .plan import plan_step
from .sharding import SCHEMES, padded_length

_KV, _DKV = 0, 1  # message tags: K/V buffers and dK/dV accumulators never match each other's receives


class _Ring:
    """This rank's place in the ring of `group`: its rank, the world size, and its two neighbours."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.next = self._global((self.rank + 1) % self.world)
        self.prev = self._global((self.rank - 1) % self.world)

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def pass_on(self, pairs: list[tuple[torch.Tensor, torch.Tensor, int]]):
        """Send each `send` buffer to the next rank and receive `recv` from the previous one, started
        together and not waited for: returns the requests (call .wait() on each before using recv)."""
        ops = []
        for send, recv, tag in pairs:
            ops.append(dist.P2POp(dist.isend, send, self.next, self.group, tag))
            ops.append(dist.P2POp(dist.irecv, recv, self.prev, self.group, tag))
        return dist.batch_isend_irecv(ops) if ops else []


def _check(q, k, v, causal, sharding, world, seq_len) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor("ring_attention", name, t)
        if t.dim() != 4:
            raise ValueError(f"ring_attention: {name} must be (B, H, N_local, d); got shape {tuple(t.shape)}")
        check_dtype("ring_attention", name, t, FLOAT_DTYPES)
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise TypeError(
            f"ring_attention: q, k, v must share dtype and device; got {q.dtype}/{q.device}, "
            f"{k.dtype}/{k.device}, {v.dtype}/{v.device}"
        )
    B, H, n, d = q.shape
    if (
        k.shape != v.shape
        or k.shape[0] != B
        or k.shape[2:] != (n, d)
        or 0 in (H, k.shape[1])
        or H % k.shape[1]
    ):
        raise ValueError(
            "ring_attention: expected q (B, H, N_local, d) and k, v (B, Hkv, N_local, d) with H a multiple "
            f"of Hkv >= 1; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"ring_attention: causal must be a bool, got {causal!r}")
    if sharding not in SCHEMES:
        raise ValueError(f"ring_attention: sharding must be one of {SCHEMES}, got {sharding!r}")
    per_rank = 1 if sharding == "contiguous" else 2
    if n == 0 or n % per_rank:
        raise ValueError(
            f"ring_attention: {sharding} sharding needs a local length that is a positive multiple of "
            f"{per_rank}; got N_local = {n} (shard with course_lib.distributed.shard)"
        )
    if seq_len is not None and padded_length(seq_len, world, sharding) != n * world:
        raise ValueError(
            f"ring_attention: seq_len = {seq_len} pads to {padded_length(seq_len, world, sharding)} tokens "
            f"with {sharding} sharding over {world} ranks, but the ranks hold {world} x {n} = {n * world}"
        )


_AGREED = ("B", "H", "Hkv", "N_local", "d", "dtype", "causal", "sharding", "seq_len", "scale", "backend")


def _check_agreement(ring: _Ring, q, k, v, causal, sharding, scale, backend, seq_len) -> tuple[float, str]:
    """Check this rank's call (`_check`) and that every rank of the ring made the same one: returns
    (scale, backend) resolved, or raises on every rank (this rank's own error where it has one).

    Every rank shares its call as one small int64 tensor (one all_gather, 1 + `len(_AGREED)` numbers):
    ranks that disagree would otherwise exchange K/V of different sizes (a crash or a hang) or of one size
    but different meaning (a wrong answer, silently), and a rank that refused its call alone would leave
    the others waiting. Reading the gathered numbers costs one device synchronisation per call."""
    error, call = None, [0] * len(_AGREED)
    try:
        _check(q, k, v, causal, sharding, ring.world, seq_len)
        scale = default_scale(q.shape[-1], scale)
        backend = resolve_backend(backend, q.device)
        scale_bits = torch.tensor([scale], dtype=torch.float64).view(torch.int64).item()
        B, H, n, d = q.shape
        call = [B, H, k.shape[1], n, d, FLOAT_DTYPES.index(q.dtype), int(causal), SCHEMES.index(sharding)]
        call += [-1 if seq_len is None else int(seq_len), scale_bits, ("torch", "triton").index(backend)]
    except (TypeError, ValueError) as e:
        error = e
    if ring.world == 1 or not isinstance(q, torch.Tensor):
        if error is not None:
            raise error
        return scale, backend
    local = torch.tensor([int(error is not None), *call], dtype=torch.int64, device=q.device)
    every = [torch.empty_like(local) for _ in range(ring.world)]
    dist.all_gather(every, local, group=ring.group)
    if error is not None:
        raise error
    calls = [t.tolist() for t in every]
    refused = [r for r, c in enumerate(calls) if c[0]]
    if refused:
        raise ValueError(
            f"ring_attention: ranks {refused} of the group refused their inputs (see their error)"
        )
    differ = [name for i, name in enumerate(_AGREED, 1) if len({c[i] for c in calls}) > 1]
    if differ:
        ranks = [r for r, c in enumerate(calls) if c != calls[0]]
        raise ValueError(
            f"ring_attention: the ranks disagree on {', '.join(differ)} (ranks {ranks} differ from rank 0); "
            "every rank of the group must pass the same shapes and options"
        )
    return scale, backend


def ring_forward(
    q,
    k,
    v,
    causal=False,
    group=None,
    sharding="zigzag",
    scale=None,
    backend="auto",
    seq_len=None,
):
    """Forward ring: (O, L) for this rank's queries against the whole sequence.

    q: (B, H, N_local, d), k, v: (B, Hkv, N_local, d), sharded with `sharding.shard`; O like q, L
    (B, H, N_local) float32 (float64 for float64 inputs). Notebook 13."""
    ring = _Ring(group)
    scale, backend = _check_agreement(ring, q, k, v, causal, sharding, scale, backend, seq_len)
    acc = accumulator_dtype(q.dtype)
    kv = torch.stack([k, v])  # one buffer to send: (2, B, Hkv, N_local, d)
    O = torch.zeros(q.shape, dtype=acc, device=q.device)  # running result: (0, -inf) = no key yet
    L = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    for s in range(ring.world):
        src = (ring.rank - s) % ring.world
        last = s == ring.world - 1
        kv_next = None if last else torch.empty_like(kv)
        requests = [] if last else ring.pass_on([(kv, kv_next, _KV)])  # step s + 1's K/V, in flight
        for b in plan_step(ring.rank, src, ring.world, sharding, q.shape[2], causal, seq_len):
            rows = slice(b.q_lo, b.q_hi)
            o_b, l_b = block_forward(
                q[:, :, rows],
                kv[0, :, :, b.k_lo : b.k_hi],
                kv[1, :, :, b.k_lo : b.k_hi],
                b.causal,
                scale,
                backend,
            )
            O[:, :, rows], L[:, :, rows] = merge_attention_states(
                O[:, :, rows], L[:, :, rows], o_b, l_b.to(acc)
            )
        for r in requests:
            r.wait()
        if not last:
            kv = kv_next
    return O.to(q.dtype), L


def ring_backward(
    do, q, k, v, o, lse, causal=False, group=None, sharding="zigzag", scale=None, backend="auto", seq_len=None
):
    """Backward ring: (dQ, dK, dV) for this rank's slice, from dO and the forward's O and L.

    Shapes as in `ring_forward`; dQ like q, dK and dV like k and v. Notebook 13."""
    ring = _Ring(group)
    scale, backend = _check_agreement(ring, q, k, v, causal, sharding, scale, backend, seq_len)
    acc = accumulator_dtype(q.dtype)
    kv = torch.stack([k, v])
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv_done = None  # the accumulator this rank finished at the previous step, to pass on
    for s in range(ring.world):
        src = (ring.rank - s) % ring.world
        transfers = []
        if s < ring.world - 1:
            kv_next = torch.empty_like(kv)
            transfers.append((kv, kv_next, _KV))
        if s > 0:
            dkv_in = torch.empty(kv.shape, dtype=acc, device=q.device)  # src's dK/dV, summed so far
            transfers.append((dkv_done, dkv_in, _DKV))
        requests = ring.pass_on(transfers)
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)  # this rank's share for src's keys
        for b in plan_step(ring.rank, src, ring.world, sharding, q.shape[2], causal, seq_len):
            rows, keys = slice(b.q_lo, b.q_hi), slice(b.k_lo, b.k_hi)
            dq_b, dk_b, dv_b = block_backward(
                do[:, :, rows], q[:, :, rows], kv[0, :, :, keys], kv[1, :, :, keys],
                o[:, :, rows], lse[:, :, rows], b.causal, scale, backend,
            )  # fmt: skip
            dq[:, :, rows] += dq_b
            dkv[0, :, :, keys] += dk_b
            dkv[1, :, :, keys] += dv_b
        for r in requests:
            r.wait()
        if s > 0:
            dkv += dkv_in
        dkv_done = dkv
        if s < ring.world - 1:
            kv = kv_next
    if ring.world > 1:  # the last accumulator belongs to the next rank; ours comes from the previous one
        mine = torch.empty_like(dkv_done)
        for r in ring.pass_on([(dkv_done, mine, _DKV)]):
            r.wait()
        dkv_done = mine
    return dq.to(q.dtype), dkv_done[0].to(k.dtype), dkv_done[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Differentiable ring attention: `RingAttention.apply(q, k, v, causal, group, sharding, scale,
    backend, seq_len)`; see `ring_attention`. Saves q, k, v, O and L (all O(N_local))."""

    @staticmethod
    def forward(ctx, q, k, v, causal, group, sharding, scale, backend, seq_len):
        o, lse = ring_forward(q, k, v, causal, group, sharding, scale, backend, seq_len)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.options = (causal, group, sharding, scale, backend, seq_len)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(do.contiguous(), q, k, v, o, lse, *ctx.options)
        dq, dk, dv = refuse_second_derivative((dq, dk, dv), (do, q, k, v), "ring_attention")
        return dq, dk, dv, None, None, None, None, None, None


def ring_attention(
    q,
    k,
    v,
    causal: bool = False,
    group=None,
    sharding: str = "zigzag",
    scale=None,
    backend="auto",
    seq_len=None,
):
    """Attention over a sequence sharded across the ranks of `group` (default: the whole world).

    q: (B, H, N_local, d); k, v: (B, Hkv, N_local, d) with H a multiple of Hkv (GQA/MQA); every rank's
    slice made by `course_lib.distributed.shard(x, rank, world, sharding)` ("zigzag" or "contiguous").
    float16, bfloat16, float32 or float64 (float64: backend "torch", or "triton" under the interpreter).
    causal: query at position i sees keys at positions j <= i of the whole sequence.
    scale: default 1/sqrt(d). backend: "auto" (Triton kernels on a GPU, PyTorch on the CPU), "torch" or
    "triton". seq_len: the true total length when it was padded to shard evenly (padded keys are
    masked; drop the padded output rows with `unshard(..., seq_len=seq_len)`).
    Returns this rank's O (B, H, N_local, d), differentiable in q, k and v. Taught in notebook 13."""
    return RingAttention.apply(q, k, v, causal, group, sharding, scale, backend, seq_len)
