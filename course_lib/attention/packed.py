"""Packed sequences as the kernels read them: their bounds, their checks, and a padded batch as packed rows
(notebook 08b; the entry points are `varlen.flash_attention_varlen` and `varlen.flash_attention_padded`).

`Sequences` holds the bounds the kernels read (`blocks.sequence` looks them up in a program);
`sequences()` checks them; `check_packed` and `check_padded` check the tensors of a packed and of a
padded call; `padded_sequences` and `pack_rows` turn a padded batch into packed rows.
"""

from __future__ import annotations

import dataclasses

import torch

from ..checks import causal_alignment, check_int, check_sinks, check_window
from .inputs import check_inputs


@dataclasses.dataclass(frozen=True)
class Sequences:
    """Packed sequences' bounds as the kernels read them.

    bounds: int32 (2 * (count + 1),) on the inputs' device, [q_0, k_0, q_1, k_1, ...] (cu_seqlens_q and
    cu_seqlens_k interleaved: one sequence's four bounds are adjacent); count: B; max_q, max_k: the
    longest sequence's query and key counts (the grid is sized by them); total_q: q's rows."""

    bounds: torch.Tensor
    count: int
    max_q: int
    max_k: int
    total_q: int

    @staticmethod
    def mode(alignment: str | None) -> int:
        """The kernels' VARLEN switch: 2 when each sequence's causal offset is its own Nk - Nq
        (bottom-right), else 1."""
        return 2 if alignment == "bottom_right" else 1

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """(count, H, max_q) per-row values (the backward's D) -> (H, total_q), in packed row order."""
        cu_q = self.bounds[0::2].long()
        lengths = cu_q[1:] - cu_q[:-1]
        row_seq = torch.repeat_interleave(
            torch.arange(self.count, device=padded.device), lengths, output_size=self.total_q
        )
        row_pos = torch.arange(self.total_q, device=padded.device) - cu_q[row_seq]
        return padded[row_seq, :, row_pos].t()


def sequences(
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k, where: str, validate: bool = True
) -> Sequences:
    """Check packed sequences' bounds against q (total_q, Hq, d) and k (total_k, Hkv, d) and return
    them as `Sequences`. cu_seqlens_*: (B + 1,) int32 or int64 tensors on q's device. max_seqlen_*:
    the longest sequence's length or an upper bound (capped at the row count: no sequence is longer),
    or None to compute it (which waits for the GPU). validate=True also checks the values (start at 0,
    never decrease, end at the row count, no sequence longer than max_seqlen_*; checked as given, before
    the int32 copy the kernels read: one wait for the GPU); skipped while a CUDA graph is being captured."""
    cus = []
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(
                f"{where}: {name} must be a tensor of cumulative lengths, got {type(cu).__name__}"
            )
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(
                f"{where}: {name} must be 1-D with B + 1 >= 2 entries (0, then each sequence's end); "
                f"got shape {tuple(cu.shape)}"
            )
        if cu.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{where}: {name} must be int32 or int64, got {cu.dtype}")
        if cu.device != q.device:
            raise ValueError(f"{where}: {name} is on {cu.device}, q on {q.device}; move it to q's device")
        cus.append(cu)
    if cus[0].numel() != cus[1].numel():
        raise ValueError(
            f"{where}: cu_seqlens_q and cu_seqlens_k must describe the same sequences; got "
            f"{cus[0].numel() - 1} and {cus[1].numel() - 1}"
        )
    total_q, total_k = q.shape[0], k.shape[0]
    if total_q >= 2**31 or total_k >= 2**31:
        raise ValueError(f"{where}: at most 2**31 - 1 rows; got {total_q} queries and {total_k} keys")
    pairs = torch.stack(cus, dim=1)  # (B + 1, 2): cu_seqlens_q and cu_seqlens_k side by side
    bounds = pairs.to(torch.int32).reshape(-1)  # [q_0, k_0, q_1, k_1, ...]
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing and (max_seqlen_q is None or max_seqlen_k is None):
        raise ValueError(
            f"{where}: inside a CUDA graph capture give max_seqlen_q and max_seqlen_k (an upper bound will "
            "do): computing them reads the lengths back from the GPU, which a capture cannot do"
        )
    lengths = None
    if (validate and not capturing) or max_seqlen_q is None or max_seqlen_k is None:
        host = pairs.long().cpu()  # the values given, not their int32 copies (2**32 + 5 would pass as 5)
        lengths = host[1:] - host[:-1]
    if validate and not capturing:
        for i, (name, total) in enumerate((("cu_seqlens_q", total_q), ("cu_seqlens_k", total_k))):
            cu = host[:, i]
            if cu[0] != 0 or cu[-1] != total:
                raise ValueError(
                    f"{where}: {name} must start at 0 and end at the number of rows ({total}); got "
                    f"{cu[0].item()} ... {cu[-1].item()}"
                )
            if (lengths[:, i] < 0).any():
                bad = int(torch.nonzero(lengths[:, i] < 0)[0])
                raise ValueError(
                    f"{where}: {name} decreases at sequence {bad} ({cu[bad].item()} -> {cu[bad + 1].item()})"
                )
    maxima = []
    for i, (name, given, total) in enumerate(
        (("max_seqlen_q", max_seqlen_q, total_q), ("max_seqlen_k", max_seqlen_k, total_k))
    ):
        if given is None:
            maxima.append(int(lengths[:, i].max()))
            continue
        given = check_int(where, name, given, 0)
        if lengths is not None and int(lengths[:, i].max()) > given:
            raise ValueError(
                f"{where}: {name}={given}, but sequence {int(lengths[:, i].argmax())} has "
                f"{int(lengths[:, i].max())} rows: it must be at least the longest sequence's length"
            )
        # an upper bound (a model's context length) is fine, but no sequence is longer than all the
        # rows: the grid and the backward's D, (B, H, longest), are sized by the smaller
        maxima.append(min(given, total))
    return Sequences(bounds, cus[0].numel() - 1, maxima[0], maxima[1], total_q)


def check_packed(q, k, v, where: str) -> None:
    """q (total_q, Hq, d), k and v (total_k, Hkv, d), as the kernels take them (`inputs.check_inputs`
    on the (heads, rows, d) views: dtypes, devices, head dim, grouped-query heads)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{where}: {name} must be (total rows, heads, head dim), packed sequences; got {shape}"
            )
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if k.shape != v.shape:
        raise ValueError(f"{where}: k and v must have one shape (total_k, Hkv, d); got {shapes}")
    if q.shape[0] == 0 or q.shape[1] == 0 or k.shape[1] == 0 or q.shape[2] == 0:
        raise ValueError(
            f"{where}: q needs at least one row, and q, k, v at least one head (dim 1); got {shapes}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"{where}: q and k must have one head dim (dim 2); got {shapes}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"{where}: q's {q.shape[1]} heads must be a multiple of k and v's {k.shape[1]} (grouped-query "
            f"attention); got {shapes}"
        )
    # dtypes, devices and the head dims the kernels take, on the (1, heads, rows, d) views they run on
    check_inputs(*(t.transpose(0, 1)[None] for t in (q, k, v)), where=where)


def check_padded(q, k, v, padding, causal, window, sinks, where: str) -> str | None:
    """`flash_attention_padded`'s checks (its operators' too), each error naming `where`: q, k, v dense
    (B, heads, N, d) tensors, padding (B, Nk) bool or 0/1 integers, Nq <= Nk, causal (False, or True /
    "bottom_right": the queries are the last positions of the keys), the window and the sinks. Returns the
    alignment, None or "bottom_right" (`checks.causal_alignment`)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{where}: {name} must be (batch, heads, rows, head dim); got {shape}")
    # the dense tensors' own checks (batch, heads, head dim, dtypes, devices)
    check_inputs(q, k, v, where=where)
    B, _, n_q, _ = q.shape
    n_k = k.shape[2]
    if not isinstance(padding, torch.Tensor) or padding.shape != (B, n_k):
        shape = tuple(padding.shape) if isinstance(padding, torch.Tensor) else type(padding).__name__
        raise ValueError(f"{where}: padding must be (batch, keys) = ({B}, {n_k}); got {shape}")
    if padding.dtype.is_floating_point or padding.dtype.is_complex:
        raise TypeError(
            f"{where}: padding must be bool or 0/1 integers, True (1) where a key is a real token; got "
            f"{padding.dtype} (an additive mask, 0 for real tokens and -inf for padding, would read inverted: "
            "pass `mask == 0`)"
        )
    if padding.device.type == "meta":
        raise ValueError(
            f"{where}: padding is on the meta device (shapes only, no values); pass it on {q.device}"
        )
    if n_q > n_k:
        raise ValueError(f"{where}: the queries are the last positions of the keys: Nq={n_q} > Nk={n_k}")
    alignment = causal_alignment(causal, where, ("bottom_right",))
    check_window(window, alignment, where)
    check_sinks(sinks, q, where)
    return alignment


def padded_sequences(padding: torch.Tensor, n_q: int):
    """A padded batch as packed sequences: (real_q (B, Nq) bool, real_k (B, Nk) bool, cu_seqlens_q,
    cu_seqlens_k (B + 1,) int32, the longest sequence's query and key counts as ints). padding: (B, Nk),
    True where a key is a real token; the queries are the last Nq positions. Reading the counts waits
    for the GPU once."""
    real_k = padding.to(dtype=torch.bool)
    real_q = real_k[:, real_k.shape[1] - n_q :]
    lens_q, lens_k = real_q.sum(1), real_k.sum(1)
    cu_q = torch.nn.functional.pad(lens_q.cumsum(0), (1, 0)).to(torch.int32)
    cu_k = torch.nn.functional.pad(lens_k.cumsum(0), (1, 0)).to(torch.int32)
    max_q, max_k = torch.stack([lens_q.max(), lens_k.max()]).tolist() if len(lens_q) else (0, 0)
    return real_q, real_k, cu_q, cu_k, max_q, max_k


def pack_rows(real, *tensors):
    """The rows of (B, heads, N, ...) tensors where real (B, N) is True, packed as (total, heads, ...)."""
    return [t.transpose(1, 2)[real] for t in tensors]
