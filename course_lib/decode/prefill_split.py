"""A cached prompt's prefill attention on the warp-specialised forward, its keys split (notebook 14; the kernel:
notebook 08c).

The rest of a prompt whose first 90 % are cached brings few query rows over many keys: 3280 new tokens over
32k keys at 16 heads is 416 tiles of 128 query rows, 3.15 waves of the H200's 132 SMs, the last of them 85 %
idle. On a Hopper GPU `split_prefill` gathers the sequence's K and V head-major in one launch (`gather.gather_heads`),
runs the warp-specialised forward (`attention.hopper`) with each tile's keys cut into S runs, a program each
(`hopper.key_splits` picks S so that the waves are full: 1 where they are already), and merges the runs' partial
(O_s, L_s) with split-KV decoding's combine (`decode.combine`, notebook 09), straight into the token-major
(T, Hq, d) layout the output projection reads. Where every head's K and V fit in the L2 cache, stream-K instead
(`hopper.stream_work`): one program an SM, each taking an equal span of all the tiles' key blocks, a tile cut
between two programs into two slots of partials, so no SM waits for a last wave (2.6-3.5 % faster than the key
splits at d = 64, `STREAM`). A call seen before runs its plan (`SplitPlan`).

Used by `paged_kv.PagedKV` for a prefill step's sequence whose new tokens follow cached ones (bottom-right), from
MIN_PAIRS (new token, key) pairs on; `split_prefill` returns None where it does not apply (no Hopper GPU or Gluon,
a dtype or head dim the kernel does not take, a shape `hopper.choose` leaves to the Triton kernel), and the dense
FlashAttention-2 route runs instead.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ..attention.forward import HOPPER_FAILED, hopper_kernels, run_gluon
from ..kernels import bound, plans
from ..runtime import sm_count
from .combine import combine
from .gather import gather_into


@functools.lru_cache(maxsize=256)
def _choice(d: int, hq: int, hkv: int, n: int, length: int, device_index: int):
    """(variant, splits, work) of a prefill's shape: `hopper.choose`, then stream-K's table on the GPU
    (`hopper.stream_work`) where it applies and every head's K and V fit in STREAM_L2 of the GPU's L2 cache
    (splits 2: its two slots of partials), else `hopper.key_splits` (work None); (None, 1, None) where the kernel
    is not chosen."""
    hopper = hopper_kernels()
    variant = hopper.choose(d, True, n, length, length - n)
    if variant is None:
        return None, 1, None
    sms = sm_count(device_index)
    fits = 4 * hkv * length * d <= STREAM_L2 * torch.cuda.get_device_properties(device_index).L2_cache_size
    table = hopper.stream_work(variant, hq, n, length, True, length - n, sms) if STREAM and fits else None
    if table is not None:
        return variant, 2, torch.from_numpy(table).to(torch.device("cuda", device_index))
    return variant, hopper.key_splits(variant, hq, n, length, True, length - n, sms), None


def _buffers(q, k_pool, v_pool, pages, length: int, splits: int, work=None) -> dict:
    """The tensors of one call by name: the inputs, Q head-major (its one copy), K and V gathered, the output
    (1, n, Hq, d) token-major and its L, and with splits the partials (S, 1, n, Hq, ...) float32, token-major
    (and stream-K's table, `work`)."""
    n, hq, d = q.shape
    f32 = torch.float32
    t = dict(
        q4=q.transpose(0, 1).contiguous().unsqueeze(0), k_pool=k_pool, v_pool=v_pool, pages=pages,
        k4=k_pool.new_empty((1, k_pool.shape[2], length, d)), v4=v_pool.new_empty((1, v_pool.shape[2], length, d)),
        out=q.new_empty((1, n, hq, d)), lse=q.new_empty((1, n, hq), dtype=f32),
    )  # fmt: skip
    if splits > 1:
        t.update(
            o_part=q.new_empty((splits, 1, n, hq, d), dtype=f32),
            l_part=q.new_empty((splits, 1, n, hq), dtype=f32),
        )
    if work is not None:
        t["work"] = work
    return t


def _launches(t: dict, variant, splits: int, length: int, scale: float) -> None:
    """Gather K, V; the forward into the output itself (one split) or into its partials (splits, or stream-K's
    two slots), then the combine; all on the tensors of `_buffers`."""
    o4, l3 = (t["out"], t["lse"]) if splits == 1 else (t["o_part"], t["l_part"])
    gather_into(t["k_pool"], t["v_pool"], t["pages"], t["k4"], t["v4"], length)
    offset = length - t["q4"].shape[2]
    work = t.get("work")
    hopper_kernels().forward(
        t["q4"], t["k4"], t["v4"], o4, l3, True, scale, variant, offset, 1 if work is not None else splits,
        token_major=True, work=work,
    )  # fmt: skip
    if splits > 1:
        combine(o4, l3, t["out"], t["lse"])


class SplitPlan:
    """A call to repeat (`kernels.plans`): its launches with every non-tensor argument fixed (the TMA descriptors
    made again over the new tensors), and its split count; `run` allocates and launches."""

    __slots__ = ("launches", "splits", "length", "work")

    def __init__(self, launches: tuple, splits: int, length: int, work=None):
        self.launches, self.splits, self.length, self.work = launches, splits, length, work

    def run(self, q, k_pool, v_pool, pages):
        t = _buffers(q, k_pool, v_pool, pages, self.length, self.splits, self.work)
        for launch_ in self.launches:
            launch_(t)
        return t["out"][0]


PLANS = plans.table()  # a call's key -> its SplitPlan, or NOT_SPLIT

# The route from this many (new token, key) pairs on. The GPU's time of a graph replay against the dense route's
# (H200, 2026-11-30, `--prefill-key-splits`, the split count `key_splits` picks): 3280 x 32k 1.20x (d = 64, 16 / 4
# heads) and 1.29x (d = 128, 32 / 8), 1648 x 16k 1.14x and 1.30x; 416 x 4096 (1.7M pairs), unsplit, 1.01x and 0.91x.
MIN_PAIRS = 16 << 20
NOT_SPLIT = "not split"
# Stream-K (`hopper.stream_work`) where it applies, else the key splits of `hopper.key_splits`. Its programs each
# sweep a different part of the keys at once, so it wins only where every head's K and V stay in the L2 cache:
# graph replays on an H200 (its L2 read off the device), ms against the split count `key_splits` picks (2026-11-30,
# `scripts/serving_probe.py --prefill-key-splits`): d = 64, 16 / 4 heads, 3280 x 32k (34 MB of K/V) 0.967 / 0.993,
# 1648 x 16k (17 MB) 0.274 / 0.284; d = 128, 32 / 8 heads, 1648 x 16k (67 MB) 0.817 / 0.825, 3280 x 32k (134 MB)
# 3.23-3.30 / 2.90-2.93.
STREAM = True
STREAM_L2 = 0.8  # the share of the L2 cache every head's K and V may take for stream-K


def split_prefill(
    q: torch.Tensor,
    k_pool,
    v_pool,
    pages: torch.Tensor,
    length: int,
    scale: float | None = None,
    splits: int | None = None,
):
    """Attention of q (n, Hq, d) (a sequence's n new tokens, token-major) over its first `length` keys, held by
    `pages` of the pools (`gather.gather_heads`), causal bottom-right (the new tokens are the last n of the length), on
    the warp-specialised forward, its keys split where that fills the GPU; None where the route does not apply
    (module docstring). Returns (n, Hq, d) in q's dtype, contiguous. splits: None (from MIN_PAIRS pairs of a new
    token and a key on, `hopper.key_splits`' choice), or the number of runs to take (1: the kernel writes the
    output itself, no combine; `scripts/serving_probe.py --prefill-key-splits` times each). A call seen before
    runs its plan (`SplitPlan`: launches bound once)."""
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int) or splits < 1):
        raise ValueError(f"split_prefill: splits must be None or an int >= 1, got {splits!r}")
    key = None
    if plans.ENABLED:
        key = (
            plans.tensor_key(q), plans.tensor_key(k_pool), plans.tensor_key(v_pool), plans.tensor_key(pages),
            length, scale, splits, plans.current_gpu(),
        )  # fmt: skip
        plan = plans.find(PLANS, key)
        if plan is not None:
            return None if plan is NOT_SPLIT else plan.run(q, k_pool, v_pool, pages)
    n, hq, d = q.shape
    hopper = hopper_kernels()
    variant = work = None
    if (
        hopper is not None and not HOPPER_FAILED and q.is_cuda and n < length and (splits or n * length >= MIN_PAIRS)
        and q.dtype in hopper.DTYPES and d in hopper.HEAD_DIMS and k_pool.dtype == q.dtype
        and hopper.capability(q.device.index)[0] == 9  # a Hopper GPU (others would fail to compile it)
    ):  # fmt: skip
        variant, chosen, work = _choice(d, hq, k_pool.shape[2], n, length, q.device.index)
        if splits is None:
            splits = chosen
        else:
            work = None  # the runs asked for
    if variant is None:
        if key is not None:
            plans.store(PLANS, key, NOT_SPLIT)
        return None
    t = _buffers(q, k_pool, v_pool, pages, length, splits, work)
    args = (t, variant, splits, length, d**-0.5 if scale is None else scale)
    with bound.recording(t) if key is not None else contextlib.nullcontext() as recorded:
        if not run_gluon("forward", HOPPER_FAILED, _launches, *args):
            return None
    launches = recorded.prepared() if recorded is not None and plans.on_current_device(q) else None
    if launches:
        plans.store(PLANS, key, SplitPlan(launches, splits, length, work))
    return t["out"][0]
