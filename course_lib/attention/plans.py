"""Attention's plans: a call seen before runs again without deciding anything (`kernels.plans`, notebook 08).

Each attention call's Python checks its inputs, views them as (B, H, N, d), picks a route (the Gluon
kernels, the Triton kernels) and a launch, and binds each launch's forty arguments: 70-110 us of host time per
forward on an H200's host against SDPA's 19 (`bench/host_time.py`). A plan keeps all that per call key.

The key (`call_key`) holds what those decisions read: q, k and v's shapes, strides, dtypes, devices and
16-byte alignment, the current GPU, and the arguments causal, scale and window by type and value. Calls with
sinks, windows, a fixed launch or a teaching variant have no plan, and neither have the split-KV route (its
own plans are `decode.split_kv`'s), nor calls whose inputs had to be copied or alias each other: those keep
the full path. A change of a shape class's launch (`launch.choose`: autotuning, `launch.trying`) forgets every
plan.

`forward.ForwardPlan` and `backward.BackwardPlan` are the plans; `api.py` keys and runs them.
"""

from __future__ import annotations

from ..kernels.plans import ENABLED, current_gpu, find, store, table  # noqa: F401 (find, store: api.py's)
from .launch import CHOICE_LISTENERS

FORWARD = table()  # call key -> forward.ForwardPlan
_GENERATION = [0]  # how many times every plan was forgotten: a plan made in another generation is stale


def generation() -> int:
    """The current generation of plans (a plan remembers the one it was made in; `clear` starts a new one)."""
    return _GENERATION[0]


def call_key(q, k, v, causal, scale, window, sinks) -> tuple | None:
    """What an attention call's decisions depend on (module docstring), or None for a call that is never
    planned (sinks, plans off). Tensors only: the callers check that first."""
    if sinks is not None or not ENABLED:
        return None
    return (
        q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
        q.get_device(), k.get_device(), v.get_device(), current_gpu(),
        q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16,
        type(causal), causal, type(scale), scale, type(window), window,
    )  # fmt: skip


def clear() -> None:
    """Forget every plan (a launch choice changed, or a test wants the full path again)."""
    FORWARD.clear()
    _GENERATION[0] += 1


CHOICE_LISTENERS.append(clear)
