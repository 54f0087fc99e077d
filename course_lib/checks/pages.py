"""Checks of a KV cache's bookkeeping: cache lengths, block tables and page ids, slots (notebooks 09, 10, 14).

What the tensors say (shape, dtype, device: `check_cache_seqlens`, `check_block_table`) is checked on every
call; what their values say (`check_lengths`, `check_page_ids`, `check_slots`) is read only where that costs
no sync (`should_validate`): on the CPU always, on a GPU when asked, never while a CUDA graph is captured.
"""

from __future__ import annotations

import torch

from .tensors import shape_and_dtype


def should_validate(validate: bool, device: torch.device) -> bool:
    """Checks that read tensor values run on the CPU always, on a GPU when `validate` (they sync), and
    never during CUDA-graph capture (a sync there is illegal; capture with validate=False)."""
    if device.type == "cpu":
        return True
    return bool(validate) and not torch.cuda.is_current_stream_capturing()


def check_cache_seqlens(
    where: str, cache_seqlens, batch: int, device: torch.device | None, name: str = "cache_seqlens"
) -> None:
    """Lengths of a batch's caches: a (B,) int32 tensor (B = `batch`) on `device` where given; no value
    read. A TypeError or ValueError naming `name`."""
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a (B,) int32 tensor, got {type(cache_seqlens).__name__}")
    if cache_seqlens.dtype != torch.int32:
        raise TypeError(f"{where}: {name} must be int32, got {cache_seqlens.dtype}")
    if cache_seqlens.shape != (batch,):
        raise ValueError(
            f"{where}: {name} must have shape (B,) = ({batch},); got {tuple(cache_seqlens.shape)}"
        )
    if device is not None and cache_seqlens.device != device:
        raise ValueError(f"{where}: {name} is on {cache_seqlens.device}, q on {device}")


def check_lengths(where: str, cache_seqlens: torch.Tensor, capacity: int) -> None:
    """cache_seqlens must lie in [0, capacity] (values are read: syncs on a GPU)."""
    bad = (cache_seqlens < 0) | (cache_seqlens > capacity)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{where}: cache_seqlens[{i}] = {int(cache_seqlens[i])} is outside [0, {capacity}] "
            "(the keys the cache or its block table covers)"
        )


def check_block_table(
    where: str,
    block_table,
    batch: int | None = None,
    device=None,
    name: str = "block_table",
    row: bool = False,
) -> None:
    """A table of page ids: a (B, max_pages) int32 tensor (B = `batch` where given), or with `row` one
    (pages,) row of it, on `device` where given; no value read. A ValueError for the wrong kind, shape or
    device, a TypeError for the wrong dtype, each naming `name`."""
    layout = "(pages,)" if row else "(B, max_pages)"
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != (1 if row else 2):
        raise ValueError(
            f"{where}: {name} must be a {layout} int32 tensor, got {shape_and_dtype(block_table)}"
        )
    if block_table.dtype != torch.int32:
        raise TypeError(f"{where}: {name} must be int32, got {block_table.dtype}")
    if batch is not None and block_table.shape[0] != batch:
        raise ValueError(f"{where}: {name} has {block_table.shape[0]} rows, q has batch {batch}")
    if device is not None and block_table.device != device:
        raise ValueError(f"{where}: {name} is on {block_table.device}, q on {device}")


def check_page_ids(where: str, block_table, cache_seqlens, num_pages: int, page_size: int) -> None:
    """Every page a sequence uses (the first cdiv(cache_seqlens[b], page_size) entries of its row) must
    be a page id in [0, num_pages). Reads values: syncs on a GPU."""
    pages_used = (cache_seqlens.to(torch.int64) + page_size - 1) // page_size  # (B,)
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < pages_used[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    if bool(bad.any()):
        b, p = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"{where}: block_table[{b}, {p}] = {int(block_table[b, p])} is not a page id in [0, {num_pages}) "
            f"(sequence {b} has {int(cache_seqlens[b])} tokens, so it uses its first {int(pages_used[b])} pages)"
        )
