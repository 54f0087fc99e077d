"""Infini-attention: segment-local causal attention plus a compressive memory per head (notebook 16).

Munkhdalai, Faruqui, Gopal, "Leave No Context Behind" (arXiv 2404.07143). The sequence is cut into segments of
`segment` tokens (the last one may be shorter). Inside a segment, ordinary causal attention (A_dot, course_lib's
FlashAttention kernel). Across segments, each head keeps a memory M (d x d_v) and a normaliser z (d), the same
size whatever the context length:

    sigma(x)   = ELU(x) + 1                                  (positive features)
    A_mem      = sigma(Q) M / (sigma(Q) z)                   retrieval, with M, z from before this segment
    M         += sigma(K)^T V                                linear update, after the segment
    M         += sigma(K)^T (V - sigma(K) M / (sigma(K) z))  or the delta rule (only what M does not hold yet)
    z         += sum over the segment's tokens of sigma(K)
    output     = sigmoid(beta) A_mem + (1 - sigmoid(beta)) A_dot,   beta a learned scalar per head

The first segment: M = 0 and z = 0, so A_mem (and the delta rule's retrieval) would be 0 / 0. We define it as
0: every denominator is clamped to at least EPS (1e-6), and the numerator is exactly 0 there. Since
sigma > 0, z > 0 after any token, and sigma(Q) z is far above EPS for any sensible input, the clamp changes
nothing else. The first segment's output is therefore (1 - sigmoid(beta)) A_dot.

The memory is kept in float32 (float64 for float64 inputs, for gradient checks), whatever the inputs' dtype.
A stream continues across calls by passing the returned (M, z) back as `memory`; the result equals one call
over the whole stream when every call but the last covers a whole number of segments.

Unlike ring attention (notebook 13), which computes exactly the attention of one device, Infini-attention is a
different model: it is approximate and needs training to use its memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import checks

__all__ = [
    "EPS",
    "elu_plus_one",
    "infini_attention",
    "infini_memory_reference",
    "infini_reference",
    "kernel_local_attention",
    "memory_step",
    "sdpa_local_attention",
    "segment_attention",
]

EPS = 1e-6  # the guard on every denominator sigma(.) z: makes 0 / 0 (an empty memory) read as 0

LocalAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """sigma(x) = ELU(x) + 1: positive, x + 1 for x > 0 and e^x for x <= 0. The paper's feature map."""
    return F.elu(x) + 1.0


def kernel_local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention (top-left) with course_lib's FlashAttention kernel: q, k, v (..., n, d) -> O."""
    from ..attention import flash_attention  # the kernels load on first use (course_lib.attention)

    return flash_attention(q, k, v, causal=True)


def sdpa_local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same causal attention with PyTorch's scaled_dot_product_attention (fast on a CPU, where the
    kernel runs in Triton's interpreter)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def memory_step(sq, sk, v, M, z, delta: bool = False):
    """One segment of the memory from its features: (A_mem, M_new, z_new) (notebook 16, section 3).

    sq = sigma(Q), sk = sigma(K) (B, H, n, d), v (B, H, n, d_v) of the segment; M (B, H, d, d_v) and z (B, H, d)
    from before it. A_mem (B, H, n, d_v) is read from that memory (an empty one reads as 0: the EPS clamp); the
    update is linear, or with delta=True the delta rule (only what M does not already return for these keys)."""
    a_mem = (sq @ M) / (sq @ z.unsqueeze(-1)).clamp_min(EPS)  # retrieval from the past
    if delta:
        v = v - (sk @ M) / (sk @ z.unsqueeze(-1)).clamp_min(EPS)
    return a_mem, M + sk.transpose(-1, -2) @ v, z + sk.sum(dim=2)


def segment_attention(q, k, v, segment: int, local: LocalAttention | None = None) -> torch.Tensor:
    """A_dot: causal attention inside each segment of `segment` tokens, no token seeing another segment.

    q, k, v: (B, H, N, d). The whole segments go to `local` in one call as (B, H, N // segment, segment, d)
    (the kernel takes any leading dims); a shorter last segment in a second call. `local`: causal attention
    (..., n, d) -> (..., n, d); default course_lib's FlashAttention kernel. Returns (B, H, N, d)."""
    local = local or kernel_local_attention
    B, H, N, d = q.shape
    full = N // segment * segment
    parts = []
    if full:
        cut = [t[:, :, :full].reshape(B, H, full // segment, segment, t.shape[-1]) for t in (q, k, v)]
        parts.append(local(*cut).reshape(B, H, full, v.shape[-1]))
    if full < N:
        parts.append(local(q[:, :, full:], k[:, :, full:], v[:, :, full:]))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _check(q, k, v, segment, memory, delta, gate, local, where: str):
    """Every argument of infini_attention / infini_reference, each refused by name."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(where, name, t)
        if t.dim() != 4:
            raise ValueError(f"{where}: {name} must be (B, H, N, d); got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(
                f"{where}: {name} has dtype {t.dtype}; Infini-attention needs floating-point inputs"
            )
    if not (q.shape == k.shape and q.shape[:-1] == v.shape[:-1]):
        raise ValueError(
            f"{where}: q and k must have one shape (B, H, N, d) and v (B, H, N, d_v); got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{where}: q, k and v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{where}: q, k and v must be on one device; got {q.device}, {k.device}, {v.device}")
    if isinstance(segment, bool) or checks.as_int(segment) is None:
        raise TypeError(f"{where}: segment must be an integer number of tokens, got {segment!r}")
    segment = checks.check_int(where, "segment", segment, 1)
    if q.shape[2] == 0:
        raise ValueError(f"{where}: q has no tokens (N = 0)")
    if local is None and where == "infini_attention":
        if q.shape[-1] not in checks.KERNEL_HEAD_DIMS or v.shape[-1] != q.shape[-1]:
            raise ValueError(
                f"{where}: head dim d = {q.shape[-1]} (d_v = {v.shape[-1]}) is not one the attention kernel "
                f"takes inside a segment: it takes d = d_v, a multiple of 8 from 16 to {checks.MAX_HEAD_DIM}"
            )
    if not isinstance(delta, bool):
        raise TypeError(f"{where}: delta must be True (delta rule) or False (linear update), got {delta!r}")
    B, H, _, d = q.shape
    state = torch.promote_types(q.dtype, torch.float32)
    if where == "infini_reference":
        state = torch.float64
    if memory is not None:
        if not (isinstance(memory, (tuple, list)) and len(memory) == 2):
            raise TypeError(f"{where}: memory must be None or the pair (M, z) a previous call returned")
        M, z = memory
        for name, t, shape in (("memory M", M, (B, H, d, v.shape[-1])), ("memory z", z, (B, H, d))):
            checks.check_tensor(where, name, t)
            if tuple(t.shape) != shape:
                raise ValueError(f"{where}: {name} must have shape {shape}, got {tuple(t.shape)}")
            if t.dtype != state:
                raise TypeError(f"{where}: {name} must be {state} (the memory's dtype), got {t.dtype}")
            if t.device != q.device:
                raise ValueError(f"{where}: {name} is on {t.device}, q on {q.device}")
    if gate is not None:
        if isinstance(gate, torch.Tensor):
            if gate.shape not in ((H,), ()):
                raise ValueError(f"{where}: gate must be a number or a tensor of shape ({H},) (one per head), "
                                 f"got shape {tuple(gate.shape)}")  # fmt: skip
            if not gate.dtype.is_floating_point:
                raise TypeError(f"{where}: gate must be floating point, got {gate.dtype}")
        elif isinstance(gate, bool) or not isinstance(gate, (int, float)):
            raise TypeError(f"{where}: gate must be a number or a ({H},) tensor, got {type(gate).__name__}")
    return segment, state


def _gate(gate, H: int, like: torch.Tensor) -> torch.Tensor:
    """sigmoid(beta) as (1, H, 1, 1) in the state dtype (beta = 0, an even mix, when gate is None)."""
    beta = torch.zeros((), dtype=like.dtype, device=like.device) if gate is None else gate
    beta = torch.as_tensor(beta, device=like.device).to(like.dtype)
    return torch.sigmoid(beta).reshape(-1, 1, 1).expand(H, 1, 1).unsqueeze(0)


def infini_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment: int,
    memory: tuple[torch.Tensor, torch.Tensor] | None = None,
    delta: bool = False,
    gate: torch.Tensor | float | None = None,
    local: LocalAttention | None = None,
):
    """Infini-attention over q, k, v (B, H, N, d), in segments of `segment` tokens (notebook 16).

    memory: None (an empty memory: M = 0, z = 0) or the (M, z) a previous call returned, M (B, H, d, d_v) and
    z (B, H, d) in float32 (float64 for float64 inputs). delta: the delta-rule update instead of the linear one.
    gate: beta, a number or a (H,) tensor (learned, one per head; None means beta = 0); the output is
    sigmoid(beta) A_mem + (1 - sigmoid(beta)) A_dot. local: the causal attention used inside a segment, a
    function (q, k, v) of (..., n, d) tensors; default course_lib's FlashAttention kernel (which then needs
    d = d_v a multiple of 8 from 16 to 256); `sdpa_local_attention` computes the same with PyTorch.
    Returns (O, (M, z)): O (B, H, N, d_v) in q's dtype and the memory after the last token, to continue the
    stream. Differentiable in q, k, v, gate and the memory passed in. The first segment reads an empty memory
    as A_mem = 0 (module docstring)."""
    segment, state = _check(q, k, v, segment, memory, delta, gate, local, "infini_attention")
    B, H, N, d = q.shape
    a_dot = segment_attention(q, k, v, segment, local)  # (B, H, N, d_v), q's dtype
    if memory is None:
        M = torch.zeros(B, H, d, v.shape[-1], dtype=state, device=q.device)
        z = torch.zeros(B, H, d, dtype=state, device=q.device)
    else:
        M, z = memory
    sq, sk, vs = elu_plus_one(q.to(state)), elu_plus_one(k.to(state)), v.to(state)
    a_mem = []
    for start in range(0, N, segment):  # the memory is sequential: one segment after another
        s = slice(start, min(start + segment, N))
        a_s, M, z = memory_step(sq[:, :, s], sk[:, :, s], vs[:, :, s], M, z, delta)
        a_mem.append(a_s)
    g = _gate(gate, H, M)
    out = g * torch.cat(a_mem, dim=2) + (1 - g) * a_dot.to(state)
    return out.to(q.dtype), (M, z)


def infini_memory_reference(q, k, v, M, z, delta: bool = False):
    """One segment's memory in float64, token by token: (A_mem, M_new, z_new).

    q, k, v: (B, H, n, d) one segment; M (B, H, d, d_v), z (B, H, d) the memory before it. Each token's
    retrieval reads the memory from before the segment; the update adds the tokens one at a time (the delta
    rule's correction also uses the memory from before the segment, as the paper defines it). The ground
    truth for the notebook's exercise and for infini_attention."""
    q, k, v, M, z = (t.double() for t in (q, k, v, M, z))
    n = q.shape[2]
    a_mem = torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float64, device=q.device)
    M_new, z_new = M.clone(), z.clone()
    for t in range(n):
        sq = elu_plus_one(q[:, :, t])  # (B, H, d)
        num = torch.einsum("bhi,bhij->bhj", sq, M)
        den = torch.einsum("bhi,bhi->bh", sq, z)
        a_mem[:, :, t] = num / den.clamp_min(EPS).unsqueeze(-1)
    for t in range(n):
        sk, vt = elu_plus_one(k[:, :, t]), v[:, :, t]
        if delta:
            old = (
                torch.einsum("bhi,bhij->bhj", sk, M)
                / torch.einsum("bhi,bhi->bh", sk, z).clamp_min(EPS)[..., None]
            )
            vt = vt - old
        M_new = M_new + torch.einsum("bhi,bhj->bhij", sk, vt)
        z_new = z_new + sk
    return a_mem, M_new, z_new


def infini_reference(q, k, v, segment: int, memory=None, delta: bool = False, gate=None):
    """Infini-attention in float64, token by token, in plain PyTorch: the ground truth (notebook 16, tests).

    Same arguments and results as `infini_attention` (memory in float64); the local attention is a softmax
    per query row over the keys of its own segment up to itself, one row at a time."""
    segment, _ = _check(q, k, v, segment, memory, delta, gate, None, "infini_reference")
    q, k, v = q.double(), k.double(), v.double()
    B, H, N, d = q.shape
    if memory is None:
        M = torch.zeros(B, H, d, v.shape[-1], dtype=torch.float64, device=q.device)
        z = torch.zeros(B, H, d, dtype=torch.float64, device=q.device)
    else:
        M, z = (t.double() for t in memory)
    g = _gate(gate, H, M)[0, :, 0, 0]  # (H,)
    out = torch.zeros(B, H, N, v.shape[-1], dtype=torch.float64, device=q.device)
    for start in range(0, N, segment):
        end = min(start + segment, N)
        a_mem, M_next, z_next = infini_memory_reference(
            q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], M, z, delta
        )
        for t in range(start, end):
            scores = torch.einsum("bhd,bhjd->bhj", q[:, :, t], k[:, :, start : t + 1]) / d**0.5
            a_dot = torch.einsum("bhj,bhjd->bhd", scores.softmax(-1), v[:, :, start : t + 1])
            gt = g.view(1, H, 1)
            out[:, :, t] = gt * a_mem[:, :, t - start] + (1 - gt) * a_dot
        M, z = M_next, z_next
    return out, (M, z)
