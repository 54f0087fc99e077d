"""Sequence sharding for context parallelism: which tokens each rank holds (notebook 13).

A sequence of N tokens is split along its sequence dimension among `world` ranks.

- "contiguous": rank r holds tokens [r * c, (r + 1) * c), c = N / world. Simple, but under a causal mask
  rank r's queries see r + 1 of the world's key slices: the last rank does most of the work.
- "zigzag": the sequence is cut into 2 * world chunks of c = N / (2 * world) tokens; rank r holds chunk r
  and chunk 2 * world - 1 - r, concatenated in that order. Every rank then holds one early and one late
  chunk, and the causal work per rank is equal.

A length that does not divide evenly is padded at the end of the sequence with zeros (`padded_length`);
`ring_attention(..., seq_len=N)` masks the padded keys, and `unshard` drops the padded rows.
"""

from __future__ import annotations

import torch

SCHEMES = ("contiguous", "zigzag")


def _check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"sharding must be one of {SCHEMES}, got {scheme!r}")


def _check_world(world: int, rank: int | None = None) -> None:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world size must be a positive integer, got {world!r}")
    if rank is not None and not (isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"rank must be an integer in [0, {world}), got {rank!r}")


def n_chunks(world: int, scheme: str) -> int:
    """How many equal chunks the sequence is cut into: world (contiguous) or 2 * world (zigzag)."""
    _check_scheme(scheme)
    _check_world(world)
    return world if scheme == "contiguous" else 2 * world


def padded_length(seq_len: int, world: int, scheme: str) -> int:
    """The smallest length >= seq_len that `n_chunks(world, scheme)` divides."""
    m = n_chunks(world, scheme)
    return -(-seq_len // m) * m


def chunk_ids(rank: int, world: int, scheme: str) -> tuple[int, ...]:
    """The chunks (in sequence order 0 .. n_chunks - 1) that `rank` holds, in its local order.

    contiguous: (rank,); zigzag: (rank, 2 * world - 1 - rank). Taught in notebook 13 (an exercise)."""
    _check_scheme(scheme)
    _check_world(world, rank)
    return (rank,) if scheme == "contiguous" else (rank, 2 * world - 1 - rank)


def local_positions(rank: int, world: int, scheme: str, seq_len: int) -> torch.Tensor:
    """Global token positions (int64, shape (N_local,)) of rank's local rows, for a padded length seq_len."""
    c = seq_len // n_chunks(world, scheme)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_ids(rank, world, scheme)])


def shard(x: torch.Tensor, rank: int, world: int, scheme: str = "zigzag", dim: int = -2) -> torch.Tensor:
    """Rank's slice of the full sequence x along `dim` (default -2, the N of (B, H, N, d)).

    x: any shape and dtype. Pads x with zeros at the end of `dim` to `padded_length` first. Returns a new
    contiguous tensor of length padded_length(N) / world along `dim` (the chunks of `chunk_ids`)."""
    _check_world(world, rank)
    n = x.shape[dim]
    n_pad = padded_length(n, world, scheme)
    if n_pad != n:
        pad_shape = list(x.shape)
        pad_shape[dim] = n_pad - n
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    parts = x.chunk(n_chunks(world, scheme), dim=dim)
    return torch.cat([parts[i] for i in chunk_ids(rank, world, scheme)], dim=dim).contiguous()


def unshard(
    parts: list[torch.Tensor], scheme: str = "zigzag", dim: int = -2, seq_len: int | None = None
) -> torch.Tensor:
    """Undo `shard`: the full sequence from the local slices of ranks 0 .. world - 1 (in rank order).

    parts: world tensors of one shape; returns their chunks put back in sequence order along `dim`,
    cut to the first seq_len rows (the unpadded length) when given. Differentiable."""
    world = len(parts)
    _check_world(world)
    if len({tuple(p.shape) for p in parts}) != 1:
        raise ValueError(
            f"unshard: every rank's slice must have one shape; got {[tuple(p.shape) for p in parts]}"
        )
    chunks: dict[int, torch.Tensor] = {}
    for rank, p in enumerate(parts):
        ids = chunk_ids(rank, world, scheme)
        if p.shape[dim] % len(ids):
            raise ValueError(
                f"unshard: a {scheme} slice of length {p.shape[dim]} does not split into {len(ids)}"
            )
        for i, piece in zip(ids, p.chunk(len(ids), dim=dim)):
            chunks[i] = piece
    full = torch.cat([chunks[i] for i in range(len(chunks))], dim=dim)
    return full if seq_len is None else full.narrow(dim, 0, seq_len)


def gather(
    local: torch.Tensor, scheme: str = "zigzag", group=None, dim: int = -2, seq_len: int | None = None
):
    """All ranks' slices gathered (torch.distributed.all_gather) and put back in order with `unshard`.

    local: this rank's slice (at most 8 dims, one shape on every rank: checked, a ValueError on every
    rank otherwise); returns the full (unpadded when seq_len is given) tensor on every rank.
    Not differentiable (a testing and plotting helper)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    shape = torch.tensor([local.dim(), *local.shape], dtype=torch.int64, device=local.device)
    shape = torch.nn.functional.pad(shape, (0, 9 - shape.numel()), value=-1)  # up to 8 dims
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=group)
    shapes = [s.tolist() for s in shapes]
    if any(s != shapes[0] for s in shapes):
        raise ValueError(
            "gather: the ranks disagree on the slice's shape: "
            f"{[tuple(s[1 : 1 + s[0]]) for s in shapes]} (every rank's slice must have one shape)"
        )
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return unshard(parts, scheme, dim=dim, seq_len=seq_len)
