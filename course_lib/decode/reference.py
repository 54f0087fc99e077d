"""Decoding attention the plain way, in float64: the ground truth for the decode kernels (notebook 09).

Loops over the sequences, repeats each kv head for its G query heads and builds the bottom-right
causal mask explicitly. Slow and simple on purpose.
"""

from __future__ import annotations

import torch


def decode_reference(q, k_cache, v_cache, cache_seqlens, causal=True, scale=None):
    """out (B, Tq, Hq, d) float64 and lse (B, Tq, Hq) float64 for q (B, Tq, Hq, d) over caches
    k_cache, v_cache (B, Nmax, Hkv, d) holding cache_seqlens[b] valid keys; any dtype and device.
    causal=True: query t sees keys j <= cache_seqlens[b] - Tq + t. Rows with no key: out 0, lse -inf."""
    B, Tq, Hq, d = q.shape
    Hkv = k_cache.shape[2]
    scale = d**-0.5 if scale is None else scale
    out = torch.zeros(B, Tq, Hq, d, dtype=torch.float64)
    lse = torch.full((B, Tq, Hq), float("-inf"), dtype=torch.float64)
    for b in range(B):
        n = int(cache_seqlens[b])
        if n == 0:
            continue
        qb = q[b].double().cpu().transpose(0, 1)  # (Hq, Tq, d)
        kb = k_cache[b, :n].double().cpu().transpose(0, 1).repeat_interleave(Hq // Hkv, 0)  # (Hq, n, d)
        vb = v_cache[b, :n].double().cpu().transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
        s = qb @ kb.transpose(1, 2) * scale  # (Hq, Tq, n)
        if causal:
            t = torch.arange(Tq)[:, None]
            j = torch.arange(n)[None, :]
            s = s.masked_fill(j > n - Tq + t, float("-inf"))
        lb = torch.logsumexp(s, -1)  # (Hq, Tq)
        p = torch.exp(s - torch.where(torch.isneginf(lb), 0.0, lb)[..., None])
        out[b] = (p @ vb).transpose(0, 1)
        lse[b] = lb.transpose(0, 1)
    return out, lse


def gather_pages(pages: torch.Tensor, block_table: torch.Tensor, capacity: int) -> torch.Tensor:
    """A contiguous (B, capacity, Hkv, d) cache from a page pool (num_pages, page_size, Hkv, d) and a
    block table (B, max_pages): what the paged kernel reads, laid out flat (for tests and pictures)."""
    page_size = pages.shape[1]
    n_pages = -(-capacity // page_size)
    flat = pages[block_table[:, :n_pages].long()]  # (B, n_pages, page_size, Hkv, d)
    return flat.reshape(block_table.shape[0], n_pages * page_size, *pages.shape[2:])[:, :capacity]
