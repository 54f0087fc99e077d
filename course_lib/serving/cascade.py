"""Cascade attention: a batch whose sequences share a prefix reads the prefix once (notebook 14).

Paged decoding reads each sequence's whole cache: B sequences that share a P-token prefix read it B times.
Cascade attention (FlashInfer's cascade inference; vLLM v1 uses it from a 256-token common prefix) splits each
sequence's keys in two disjoint sets and merges the partial results with notebook 03's rule:

1. prefix: every query row of the batch, B * Tq of them, attends to the shared prefix's pages in ONE pass of the
   paged kernel: one K/V stream read once, many query rows against it (compute-friendly, like a prefill);
   no mask (the prefix lies wholly before every query);
2. suffix: each sequence attends to its own pages with the paged decoding kernel, causal bottom-right (the
   queries are the last Tq tokens of the suffix);
3. (O, L) = merge((O_prefix, L_prefix), (O_suffix, L_suffix)): L = logaddexp, O weighted by exp(L_part - L).

Bytes: paged decoding reads B (P + S) tokens of K and V; cascade reads P + B S. Checked against float64
attention over each full sequence (`cascade_reference`, tests/test_cascade.py).
"""

from __future__ import annotations

import math

import torch

from ..attention.merge import merge_attention_states
from ..checks import check_tensor
from ..decode import paged_decode_attention

__all__ = ["cascade_decode_attention", "cascade_reference"]


def _check(q, k_pages, prefix_pages, prefix_len, block_table, suffix_lens, where: str):
    for name, t in (
        ("q", q),
        ("prefix_pages", prefix_pages),
        ("block_table", block_table),
        ("suffix_lens", suffix_lens),
    ):
        check_tensor(where, name, t)
    if q.dim() != 4:
        raise ValueError(f"{where}: q must be (B, Tq, Hq, d), got shape {tuple(q.shape)}")
    if prefix_pages.dim() != 1 or prefix_pages.dtype != torch.int32:
        raise TypeError(f"{where}: prefix_pages must be a (P_pages,) int32 tensor, got {prefix_pages.dtype} "
                        f"of shape {tuple(prefix_pages.shape)}")  # fmt: skip
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, int):
        raise TypeError(
            f"{where}: prefix_len must be an int (tokens of the shared prefix), got {prefix_len!r}"
        )
    page_size = k_pages.shape[1]
    if not 0 < prefix_len <= prefix_pages.numel() * page_size:
        raise ValueError(
            f"{where}: prefix_len {prefix_len} must be in 1..{prefix_pages.numel() * page_size} "
            f"({prefix_pages.numel()} prefix pages of {page_size} tokens)"
        )
    if suffix_lens.shape != (q.shape[0],):
        raise ValueError(f"{where}: suffix_lens must be ({q.shape[0]},), one length per sequence, "
                         f"got shape {tuple(suffix_lens.shape)}")  # fmt: skip
    if suffix_lens.device.type == "cpu" and bool((suffix_lens < q.shape[1]).any()):
        raise ValueError(
            f"{where}: every suffix must hold at least the Tq = {q.shape[1]} query tokens (they are its last "
            f"tokens), got suffix_lens {suffix_lens.tolist()}"
        )


def cascade_decode_attention(
    q, k_pages, v_pages, prefix_pages, prefix_len: int, block_table, suffix_lens, scale=None, num_splits=None
):
    """Decoding attention of B sequences that share a prefix, the prefix read once.

    q (B, Tq, Hq, d): the last Tq tokens of each sequence; k_pages, v_pages (num_pages, page_size, Hkv, d): the
    paged cache; prefix_pages (P_pages,) int32: the pages of the shared prefix, whose first prefix_len tokens are
    the prefix; block_table (B, max_pages) int32 and suffix_lens (B,) int32 (each >= Tq): each sequence's own
    tokens after the prefix, as `paged_decode_attention` takes them. Sequence b is prefix + its suffix; query t
    of it sees the whole prefix and suffix keys j <= suffix_lens[b] - Tq + t. Returns out (B, Tq, Hq, d) in q's
    dtype. Not differentiable (serving)."""
    where = "cascade_decode_attention"
    _check(q, k_pages, prefix_pages, prefix_len, block_table, suffix_lens, where)
    B, Tq, Hq, d = q.shape
    rows = q.reshape(1, B * Tq, Hq, d)  # every query of the batch: one multi-query pass over the prefix
    prefix_len_t = torch.full(
        (1,), prefix_len, dtype=torch.int32, device=q.device
    )  # a fill: graph-capturable
    o_p, lse_p = paged_decode_attention(
        rows, k_pages, v_pages, prefix_pages.view(1, -1), prefix_len_t, causal=False, scale=scale,
        num_splits=num_splits, return_lse=True,
    )  # fmt: skip
    o_s, lse_s = paged_decode_attention(
        q, k_pages, v_pages, block_table, suffix_lens, causal=True, scale=scale, num_splits=num_splits,
        return_lse=True,
    )  # fmt: skip
    out, _ = merge_attention_states(o_p.view(B, Tq, Hq, d), lse_p.view(B, Tq, Hq), o_s, lse_s)
    return out


def cascade_reference(q, k_pages, v_pages, prefix_pages, prefix_len, block_table, suffix_lens, scale=None):
    """The same attention in float64 over each full sequence (prefix then suffix gathered from the pages), with
    Hq / Hkv query heads per K/V head and the bottom-right causal mask: (B, Tq, Hq, d) float64."""
    B, Tq, Hq, d = q.shape
    page_size, Hkv = k_pages.shape[1], k_pages.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale

    def gather(pages, table, n):
        idx = torch.arange(n)
        return pages[table.long().cpu()[idx // page_size], idx % page_size].double()  # (n, Hkv, d)

    out = torch.empty(B, Tq, Hq, d, dtype=torch.float64)
    k_all, v_all = k_pages.cpu(), v_pages.cpu()
    for b in range(B):
        n_s = int(suffix_lens[b])
        k = torch.cat([gather(k_all, prefix_pages, prefix_len), gather(k_all, block_table[b], n_s)])
        v = torch.cat([gather(v_all, prefix_pages, prefix_len), gather(v_all, block_table[b], n_s)])
        k = k.repeat_interleave(Hq // Hkv, dim=1)  # (N, Hq, d)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
        s = torch.einsum("thd,nhd->htn", q[b].cpu().double(), k) * scale  # (Hq, Tq, N)
        n = k.shape[0]
        visible = torch.arange(n)[None, :] <= (n - Tq + torch.arange(Tq))[:, None]
        s = s.masked_fill(~visible, float("-inf"))
        out[b] = torch.einsum("htn,nhd->thd", torch.softmax(s, dim=-1), v)
    return out
