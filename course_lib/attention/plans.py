"""Plans: an attention call seen before runs again without deciding anything (host time, notebook 08).

A model calls attention with the same kinds of arguments on every layer and every step. Each call's
Python nevertheless checks its inputs, views them as (B, H, N, d), picks a route (the Gluon kernel, the
split-KV kernel, the Triton kernel) and a launch, and binds the launch's forty arguments: 70-110 us of host
time per forward on an H200's host against SDPA's 19 (`bench/host_time.py`). A plan is what all that
decided, kept per call key: which kernels to launch with which fixed arguments (`kernels.bound.Prepared`),
and how to allocate and view the tensors they take. A call whose key has a plan allocates its outputs and
launches; one without runs the full path, which leaves a plan behind where the call can be repeated so.

The key (`call_key`) holds everything those decisions read: q, k and v's shapes, strides, dtypes,
devices and 16-byte alignment, the current GPU, and the arguments causal, scale and window by type and
value. Calls with sinks, a fixed launch or a teaching variant have no plan, and neither have routes that
build per-call objects (the Gluon kernels' TMA descriptors hold the tensors' addresses; the split-KV route),
nor calls whose inputs had to be copied: those keep the full path. A change of a shape class's launch
(`launch.choose`: autotuning, `launch.trying`) forgets every plan. COURSE_PLANS=0 turns plans off (for
the comparison, and for tests of the full path).

`forward.ForwardPlan` and `backward.BackwardPlan` are the plans; `api.py` keys and runs them.
"""

from __future__ import annotations

import os

import torch

from ..kernels.bound import plain_launches
from .launch import CHOICE_LISTENERS

ENABLED = os.environ.get("COURSE_PLANS", "1").strip() not in ("0", "")
MAX_PLANS = 1024  # past it the table starts again (calls whose shapes never repeat)

FORWARD: dict = {}  # call key -> forward.ForwardPlan
_GENERATION = [0]  # how many times every plan was forgotten: a plan made in another generation is stale


def generation() -> int:
    """The current generation of plans (a plan remembers the one it was made in; `clear` starts a new one)."""
    return _GENERATION[0]


def _current_gpu() -> int:
    return torch.cuda.current_device() if torch.cuda.is_initialized() else -1


if hasattr(torch._C, "_cuda_getDevice"):  # the current GPU without torch.cuda's Python around it

    def _current_gpu() -> int:  # noqa: F811
        return torch._C._cuda_getDevice() if torch.cuda.is_initialized() else -1


def call_key(q, k, v, causal, scale, window, sinks) -> tuple | None:
    """What an attention call's decisions depend on (module docstring), or None for a call that is never
    planned (sinks, plans off). Tensors only: the callers check that first."""
    if sinks is not None or not ENABLED:
        return None
    return (
        q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
        q.get_device(), k.get_device(), v.get_device(), _current_gpu(),
        q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16,
        type(causal), causal, type(scale), scale, type(window), window,
    )  # fmt: skip


def find(table: dict, key):
    """The plan kept under `key`, or None (none kept, no key, or a profiler's launch hook installed: then
    every launch goes through Triton's own path, which runs the hook)."""
    if key is None:
        return None
    plan = table.get(key)
    if plan is None or not plain_launches():
        return None
    return plan


def store(table: dict, key, plan) -> None:
    """Keep `plan` under `key` (a full table starts again)."""
    if len(table) >= MAX_PLANS:
        table.clear()
    table[key] = plan


def clear() -> None:
    """Forget every plan (a launch choice changed, or a test wants the full path again)."""
    FORWARD.clear()
    _GENERATION[0] += 1


CHOICE_LISTENERS.append(clear)
