"""Running a model over the paged cache several tokens at a time, and rolling the cache back (notebook 15).

Everything beyond one token per step needs two things from the serving stack of notebook 10:

- `forward_tokens(model, cache, feeds)`: ONE `model.forward_step` over several sequences, each fed any
  number of new tokens (a verification step: the pending token plus gamma drafts). `PagedKV.attend`
  already does causal attention of every new token over its own sequence's cache, bottom-right aligned.
- `truncate(cache, seq_id, length)`: the rollback of rejected tokens. The sequence's length shrinks and
  the pages past the new end are released (`PageAllocator.release` drops one reference: a page shared
  with another sequence stays alive for it). A kept, partly filled last page that another sequence
  shares is copied before the next write into it by `PagedKVCache.append` (copy-on-write), so a
  rollback never disturbs a neighbour. This lives here, by composition over `cache.seqs` and
  `cache.allocator`, not as a method of `PagedKVCache`.

attention="kernel" runs course_lib's paged split-KV decode kernel (`PagedKV`); attention="torch" reads
the very same pages through `TorchPagedKV`, with `decode_reference` (float64 PyTorch) doing the
arithmetic: on a CPU the Triton interpreter runs the kernel one program at a time, about a second per
step on this course's 2-core machine, too slow for a notebook that takes hundreds of steps.
"""

from __future__ import annotations

import torch

from ..checks import check_int
from ..decode import decode_reference
from ..decode.cache import PagedKVCache
from ..decode.paged_kv import PagedKV

ATTENTION = ("kernel", "torch")


class TorchPagedKV(PagedKV):
    """`PagedKV` whose `attend` gathers each sequence's pages and attends in float64 PyTorch
    (`decode_reference`) instead of launching the Triton kernel: the same cache, writes and masking."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer, self.slots, k, v)
        padded = q.new_zeros(self.batch * self.tq, *q.shape[1:])
        padded[self.rows] = q
        table = self.block_table.long()  # (B, max_pages) -> (B, max_pages * page_size, Hkv, d)
        k_seq = self.cache.k_pages[layer][table].flatten(1, 2)
        v_seq = self.cache.v_pages[layer][table].flatten(1, 2)
        o, _ = decode_reference(
            padded.view(self.batch, self.tq, *q.shape[1:]), k_seq, v_seq, self.cache_seqlens
        )
        return o.to(q.device, q.dtype).view(self.batch * self.tq, *q.shape[1:])[self.rows]


def check_attention(where: str, attention: str) -> str:
    if attention not in ATTENTION:
        raise ValueError(f"{where}: attention must be one of {ATTENTION}, got {attention!r}")
    return attention


def new_cache(model, num_pages: int, page_size: int = 16) -> PagedKVCache:
    """An empty paged cache shaped for `model` (the serving interface's num_layers, num_kv_heads, ...)."""
    return PagedKVCache(
        model.num_layers, num_pages, page_size, model.num_kv_heads, model.head_dim, model.dtype, model.device
    )


@torch.no_grad()
def forward_tokens(model, cache: PagedKVCache, feeds, attention: str = "kernel") -> list[torch.Tensor]:
    """One `model.forward_step` over every sequence of `feeds`, a list of (seq_id, new tokens); each
    sequence's tokens go at the positions after its cached length, their K/V into new slots of `cache`.
    Returns each sequence's logits (n_i, vocab) float32, in the order of `feeds` (a sequence fed no
    token gets a (0, vocab) tensor and takes no part in the step)."""
    check_attention("forward_tokens", attention)
    live = [(s, list(t)) for s, t in feeds if len(t) > 0]
    if not live:
        return [torch.empty(0, 0) for _ in feeds]
    starts = [cache.seqs[s].length if s in cache.seqs else 0 for s, _ in live]
    slots = torch.cat([cache.append(s, len(t)) for s, t in live])
    kv_class = PagedKV if attention == "kernel" else TorchPagedKV
    kv = kv_class.for_step(cache, [s for s, _ in live], [len(t) for _, t in live], slots)
    device = model.device
    ids = torch.tensor([x for _, t in live for x in t], dtype=torch.int64, device=device)
    pos = torch.tensor([p for (_, t), a in zip(live, starts) for p in range(a, a + len(t))], device=device)
    logits = model.forward_step(ids, pos, kv).float()
    pieces = iter(logits.split([len(t) for _, t in live]))
    return [next(pieces) if len(t) > 0 else logits[:0] for _, t in feeds]


def truncate(cache: PagedKVCache, seq_id: int, length: int) -> int:
    """Shrink sequence `seq_id` to its first `length` tokens (0 <= length <= its length): pages wholly
    past the new end are released (a shared page loses one reference and stays with its other owners).
    Returns the number of page references released. Notebook 15."""
    if seq_id not in cache.seqs:
        raise ValueError(f"truncate: sequence {seq_id!r} is not in the cache")
    s = cache.seqs[seq_id]
    length = check_int("truncate", "length", length, 0)
    if length > s.length:
        raise ValueError(f"truncate: length {length} is more than sequence {seq_id!r}'s {s.length} tokens")
    keep = -(-length // cache.page_size)
    dropped = s.pages[keep:]
    for page in dropped:
        cache.allocator.release(page)
    del s.pages[keep:]
    s.length = length
    return len(dropped)
