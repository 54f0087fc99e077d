"""One serving step's view of the paged KV cache: what a model's attention layers call (notebook 10).

`ContinuousBatcher` (`batching.py`) builds one `PagedKV` per step and hands it to `model.forward_step`;
`DecodeGraphs` (`graphs.py`) holds one over fixed tensors per captured batch shape. Each attention layer
calls `kv.attend(layer, q, k, v)`, which writes the new K/V into the cache's pages and runs
`paged_decode_attention` over them (the model interface is in `batching.py`'s docstring).

A prefill step whose every sequence brings many new tokens over many keys (a long prompt, or the uncached
rest of a cached one: `DENSE_PREFILL_MIN_ROWS`, `DENSE_PREFILL_MIN_PAIRS`) attends each sequence with the
FlashAttention-2 forward (notebook 06) over its K/V gathered from its pages in one copy (`PagedKV.prefill_plan`):
the paged kernel is a decoding kernel (64-key blocks read page by page through the block table, tiles of 64
rows). Steps that mix prefill and decoding rows, short prefills and decoding steps take the paged kernel. On a
Hopper GPU a sequence whose new tokens follow cached ones (the rest of a cached prompt, a later chunk) takes
`prefill_split` instead, from its `MIN_PAIRS` on: K/V gathered head-major, the warp-specialised forward with its keys
split where the tiles would leave the GPU's last wave part idle, the combine writing token-major.
"""

from __future__ import annotations

import numpy as np
import torch

from ..attention import flash_attention
from .api import paged_decode_attention
from .cache import PagedKVCache
from .prefill_split import split_prefill

# When a step attends densely (module docstring): every sequence brings at least DENSE_PREFILL_MIN_ROWS new tokens
# and (new tokens) x (keys) >= DENSE_PREFILL_MIN_PAIRS. Measured on an H200 (`scripts/serving_probe.py --prefill`:
# one layer of the serving bench's model, 16 / 4 heads, d = 64, bf16, pages of 16; paged kernel ms / dense route
# ms, 2026-11-29): new tokens x keys 256 x 256 0.086 / 0.081, 512 x 512 0.082 / 0.127, 1024 x 1024 0.063 /
# 0.082, 128 x 1024 0.041 / 0.043, 416 x 4096 0.108 / 0.101, 4096 x 4096 0.191 / 0.155, 1648 x 16384 0.495 /
# 0.339, 3280 x 32768 1.888 / 1.217 (221 / 344 TFLOP/s), 32768 x 32768 8.487 / 5.226 (259 / 421). Below a
# million pairs the dense route's three launches (two gathers, the forward) and its grid of
# cdiv(rows, 128) x heads programs lose; from 1.7 million on it won every cell.
DENSE_PREFILL_MIN_ROWS = 384
DENSE_PREFILL_MIN_PAIRS = 3 << 19  # 1.57 million


class PagedKV:
    """One step's view of the paged cache, handed to `model.forward_step` (module docstring).

    The step feeds new_lens[i] tokens of sequence seq_ids[i] (tokens laid out sequence after sequence,
    T = sum(new_lens)). For the kernel the queries are padded to (B, Tq, Hq, d), Tq = max(new_lens), each
    sequence's tokens in its last new_lens[i] rows: bottom-right causal then holds for every sequence,
    and the padding rows' outputs are dropped. Where every sequence brings Tq tokens (T = B x Tq) there is
    no padding: the rows are 0..T-1 and q goes to the kernel as it is.

    block_table (B, max_pages) int32, cache_seqlens (B,) int32, slots (T,) int64 (where each new token's
    K/V go) and rows (T,) int64 (each token's row of the padded queries) are tensors on the pools'
    device; `for_step` builds them from the cache's bookkeeping. A step replayed as a CUDA graph
    (`graphs.DecodeGraphs`) holds one PagedKV over fixed tensors and refills them in place.

    prefill: None, or `prefill_plan`'s host list of (new tokens, length, pages) per sequence: the step attends
    each sequence with the dense forward over its gathered K/V instead (module docstring)."""

    def __init__(self, cache: PagedKVCache, block_table, cache_seqlens, slots, rows, tq: int, prefill=None):
        self.cache = cache
        self.block_table, self.cache_seqlens, self.slots, self.rows = block_table, cache_seqlens, slots, rows
        self.tq, self.prefill = tq, prefill
        self.batch = block_table.shape[0]
        # Every sequence brings tq tokens (a prefill of one prompt, a decode step, a captured step): the rows
        # are 0..T-1 and q is its own padded layout, so no zeros, scatter or gather per layer (three launches
        # and three passes over q and o)
        self.padded = rows.shape[0] != self.batch * tq

    @staticmethod
    def step_arrays(
        cache: PagedKVCache, seq_ids: list[int], new_lens: list[int], slots: torch.Tensor
    ) -> tuple[list[np.ndarray], int]:
        """The host arrays of a step that feeds new_lens[i] tokens of sequence seq_ids[i], whose K/V go to `slots`
        (a CPU tensor, as `PagedKVCache.append` gives): [block_table, cache_seqlens, slots, rows] in NumPy (the
        class docstring's dtypes), and Tq; `to_device` takes them to the GPU in one copy. Slots are checked here
        once a step where the pools are on the CPU (`attend` writes without checking them again)."""
        tq = max(new_lens)
        # token -> padded row: sequence b's n tokens go to rows b * tq + tq - n ... b * tq + tq - 1 (left-padded).
        # In NumPy, one pass: a 32k-token prefill's rows took 4.5 ms as a Python list, 65 us here (a 2-core CPU;
        # a step of 8 decoding tokens 6.2 -> 8.4 us); one sequence's are 0..tq-1 (one array made, not five).
        if len(new_lens) == 1:
            rows = np.arange(tq, dtype=np.int64)
        else:
            lens = np.asarray(new_lens, dtype=np.int64)
            ends = np.cumsum(lens)
            rows = np.repeat(np.arange(len(lens)) * tq + tq - ends, lens) + np.arange(ends[-1])
        if cache.device.type == "cpu":  # on a GPU the slots were never read (it would sync every layer)
            cache.check_slots(slots)
        arrays = [cache.block_table_array(seq_ids), cache.seqlens_array(seq_ids), slots.numpy(), rows]
        return arrays, tq

    @classmethod
    def for_step(
        cls, cache: PagedKVCache, seq_ids: list[int], new_lens: list[int], slots: torch.Tensor
    ) -> PagedKV:
        """The view of a step that feeds new_lens[i] tokens of sequence seq_ids[i], whose K/V go to `slots`: its
        `step_arrays` on the pools' device in one copy."""
        arrays, tq = cls.step_arrays(cache, seq_ids, new_lens, slots)
        prefill = cls.prefill_plan(new_lens, arrays[1], cache.page_size)
        return cls(cache, *to_device(arrays, cache.device), tq, prefill)

    @staticmethod
    def prefill_plan(
        new_lens: list[int], seqlens: np.ndarray, page_size: int
    ) -> list[tuple[int, int, int]] | None:
        """For a step whose every sequence brings at least DENSE_PREFILL_MIN_ROWS new tokens and at least
        DENSE_PREFILL_MIN_PAIRS (new token, key) pairs: (new tokens, length after the step, pages) of each
        sequence, from the host's arrays (`step_arrays`' cache_seqlens); else None (the paged kernel)."""
        plan = [(int(n), int(length), -(-int(length) // page_size)) for n, length in zip(new_lens, seqlens)]
        if all(
            n >= DENSE_PREFILL_MIN_ROWS and n * length >= DENSE_PREFILL_MIN_PAIRS for n, length, _ in plan
        ):
            return plan
        return None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write k, v (T, Hkv, d) into layer `layer`'s pages, then attend: q (T, Hq, d) -> o (T, Hq, d)."""
        self.cache.write(layer, self.slots, k, v, validate=False)  # checked once a step (`step_arrays`)
        if self.prefill is not None:
            return self._attend_dense(layer, q)
        if self.padded:
            rows = q.new_zeros(self.batch * self.tq, *q.shape[1:])
            rows[self.rows] = q
        else:
            rows = q.contiguous()
        o = paged_decode_attention(
            rows.view(self.batch, self.tq, *q.shape[1:]),
            self.cache.k_pages[layer],
            self.cache.v_pages[layer],
            self.block_table,
            self.cache_seqlens,
            causal=True,
            validate=False,  # the cache built the table; no sync per layer
        )
        o = o.view(self.batch * self.tq, *q.shape[1:])
        return o[self.rows] if self.padded else o

    def _attend_dense(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """A prefill step (`prefill_plan`): sequence by sequence, its K/V gathered from its pages (one copy each,
        (length, Hkv, d), read as (1, Hkv, length, d) through strides) and the dense FlashAttention-2 forward
        of its new tokens' queries, causal bottom-right (they are its last tokens); or, for new tokens after cached
        ones on a Hopper GPU, `prefill_split.split_prefill`. q (T, Hq, d) -> (T, Hq, d)."""
        k_pages, v_pages = self.cache.k_pages[layer], self.cache.v_pages[layer]
        outs, start = [], 0
        for b, (n, length, pages) in enumerate(self.prefill):
            ids = self.block_table[b, :pages]  # on the pools' device: no copy from the host, no wait
            if n < length and k_pages.is_cuda:  # after cached tokens: on a Hopper GPU, the keys split
                o = split_prefill(q[start : start + n], k_pages, v_pages, ids, length)
                if o is not None:
                    outs.append(o)
                    start += n
                    continue
            k, v = (
                gather_tokens(pool, ids, length).unsqueeze(0).transpose(1, 2) for pool in (k_pages, v_pages)
            )
            rows = q[start : start + n].unsqueeze(0).transpose(1, 2)  # (1, Hq, n, d)
            o = flash_attention(rows, k, v, causal=True if n == length else "bottom_right")
            outs.append(o[0].transpose(0, 1))
            start += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def gather_tokens(pool: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens held by `pages` ((n_pages,) int32 or int64 page ids, on the pool's device) of one
    layer's page pool (num_pages, page_size, Hkv, d), in one copy: (length, Hkv, d) contiguous. What the dense
    prefill route (`PagedKV`) and cascade attention's `serving.cascade.gather_prefix` read."""
    return pool.index_select(0, pages).flatten(0, 1)[:length]


def to_device(arrays, device) -> list[torch.Tensor]:
    """NumPy arrays (any shapes, int64 or int32; what a step's host bookkeeping makes) as tensors on `device`, with
    their dtypes: on a GPU through one pinned host buffer and one copy that does not wait, each tensor a view of the
    copy. Copying each array with `.to(device)` waits for the GPU to finish its queued work every time (PyTorch's
    blocking copy from host memory ends in `cudaStreamSynchronize`): a serving step made 7 of those. On the CPU the
    tensors are views of one buffer too (the arrays are copied once: they may be read-only views of a prompt)."""
    device = torch.device(device)
    arrays = [np.ascontiguousarray(a) for a in arrays]
    starts, nbytes = [], 0
    for a in arrays:
        starts.append(nbytes)
        # each array at a multiple of 16 bytes, as a tensor of its own would be: a kernel specialises on a pointer's
        # 16-byte alignment, and a plan's key holds it (`kernels.plans.tensor_key`)
        nbytes += -(-a.nbytes // 16) * 16
    host = torch.empty(max(nbytes, 16), dtype=torch.uint8, pin_memory=device.type == "cuda")
    buffer = host.numpy()
    for a, start in zip(arrays, starts):
        buffer[start : start + a.nbytes] = a.view(np.uint8).ravel()
    moved = host.to(device, non_blocking=True)
    # the copy viewed once per dtype, each array a slice of that view (and a reshape if not 1-D): with a slice, a
    # dtype view and a reshape each, a prefill step's 7 arrays took 44 us here, 30 us so (a 2-core CPU)
    typed = {dtype: moved.view(_DTYPES[dtype]) for dtype in {a.dtype for a in arrays}}
    out = []
    for a, start in zip(arrays, starts):
        first = start // a.itemsize
        flat = typed[a.dtype][first : first + a.size]
        out.append(flat if a.ndim == 1 else flat.view(a.shape))
    return out


_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
