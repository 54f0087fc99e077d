"""Which blocks of the attention matrix a rank computes at each ring step (notebook 13).

At step s of the ring, rank r holds its own queries and the keys/values of rank src = (r - s) mod world.
Both are made of chunks of c tokens (`sharding.chunk_ids`), so every (query chunk, key chunk) pair is one
of three kinds under a causal mask:
    full      every key comes before every query (key chunk < query chunk): no mask;
    diagonal  the same chunk: top-left causal mask on a c x c square;
    empty     every key comes after every query: skipped, no work.
Without a mask every pair is full. Neighbouring full pairs are joined into one larger block, so that
zigzag sharding needs one kernel call per step: at step 0 the local causal attention over the rank's own
(increasing) positions, after that either all queries against the early key chunk (src < r) or the late
query chunk against all keys (src > r).

Padded keys (beyond the true length seq_len, see `sharding.padded_length`) lie at the end of a chunk and
are cut from the block's key range.
"""

from __future__ import annotations

from dataclasses import dataclass

from .sharding import chunk_ids, n_chunks


@dataclass(frozen=True)
class Block:
    """Local query rows [q_lo, q_hi) against local key rows [k_lo, k_hi); causal: top-left mask."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    causal: bool

    @property
    def pairs(self) -> int:
        """(query, key) pairs computed: the block's share of the attention FLOPs."""
        n_q, n_k = self.q_hi - self.q_lo, self.k_hi - self.k_lo
        if not self.causal:
            return n_q * n_k
        return sum(min(i + 1, n_k) for i in range(n_q))

    @property
    def area(self) -> int:
        """Scores computed by code that does not skip masked entries (the PyTorch path): n_q * n_k."""
        return (self.q_hi - self.q_lo) * (self.k_hi - self.k_lo)


def _join(blocks: list[Block]) -> list[Block]:
    """Join unmasked blocks that share a query range and touch in keys, or share keys and touch in queries."""
    blocks = list(blocks)
    joined = True
    while joined:
        joined = False
        for i, a in enumerate(blocks):
            for j, b in enumerate(blocks):
                if i == j or a.causal or b.causal:
                    continue
                if (a.q_lo, a.q_hi) == (b.q_lo, b.q_hi) and a.k_hi == b.k_lo:
                    new = Block(a.q_lo, a.q_hi, a.k_lo, b.k_hi, False)
                elif (a.k_lo, a.k_hi) == (b.k_lo, b.k_hi) and a.q_hi == b.q_lo:
                    new = Block(a.q_lo, b.q_hi, a.k_lo, a.k_hi, False)
                else:
                    continue
                blocks = [x for n, x in enumerate(blocks) if n not in (i, j)] + [new]
                joined = True
                break
            if joined:
                break
    return sorted(blocks, key=lambda x: (x.q_lo, x.k_lo))


def plan_step(
    rank: int, src: int, world: int, scheme: str, n_local: int, causal: bool, seq_len: int | None = None
) -> list[Block]:
    """The blocks rank computes against the keys of rank src (local row indices, shapes above).

    n_local: tokens per rank (a multiple of the number of chunks per rank); seq_len: the true total
    length if the sequence was padded (None: no padding). Taught in notebook 13."""
    q_ids, k_ids = chunk_ids(rank, world, scheme), chunk_ids(src, world, scheme)
    if n_local % len(q_ids):
        raise ValueError(f"plan_step: {n_local} local tokens do not split into {len(q_ids)} {scheme} chunks")
    c = n_local // len(q_ids)
    valid = [c if seq_len is None else max(0, min(c, seq_len - kc * c)) for kc in k_ids]
    if causal and src == rank and all(n == c for n in valid):
        return [Block(0, n_local, 0, n_local, True)]  # local order is increasing position order
    blocks = []
    for a, qc in enumerate(q_ids):
        for b, kc in enumerate(k_ids):
            if valid[b] == 0 or (causal and kc > qc):
                continue  # empty pair
            blocks.append(Block(a * c, (a + 1) * c, b * c, b * c + valid[b], causal and kc == qc))
    return _join(blocks)


def work_per_rank(
    world: int, scheme: str, seq_len: int, causal: bool = True, measure: str = "pairs"
) -> list[list[int]]:
    """Work of each rank at each step, result[rank][step], for a total length seq_len that the chunks
    divide. measure: "pairs" (query-key pairs that count, what a kernel that skips masked tiles does)
    or "area" (scores computed when masked ones are computed too). Notebook 13's load-balance picture."""
    if measure not in ("pairs", "area"):
        raise ValueError(f"work_per_rank: measure must be 'pairs' or 'area', got {measure!r}")
    if seq_len % n_chunks(world, scheme):
        raise ValueError(
            f"work_per_rank: seq_len = {seq_len} does not split into {n_chunks(world, scheme)} {scheme} chunks"
        )
    n_local = seq_len // world
    return [
        [
            sum(getattr(b, measure) for b in plan_step(r, (r - s) % world, world, scheme, n_local, causal))
            for s in range(world)
        ]
        for r in range(world)
    ]
