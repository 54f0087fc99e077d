"""Plans: a kernel call seen before runs again without deciding anything (host time, notebook 08).

A model calls the same kernels with the same kinds of arguments on every layer and every step, and each call's
Python re-decides what it decided the time before: checks, a route, a launch, each kernel's arguments bound.
A plan is what a call decided, kept under a key that holds everything those decisions read (shapes, strides,
dtypes, devices, 16-byte alignment of the tensors, the current GPU, the other arguments by type and value):
its launches with every non-tensor argument fixed (`bound.Prepared`, recorded by `bound.recording`) and how
to allocate and view the tensors they take. A call whose key has a plan allocates and launches; one without
runs the full path, which leaves a plan where the call can be repeated so.

This module holds what every plan table shares: the switch (COURSE_PLANS=0 turns plans off, for the
comparison and for tests of the full path), the key of one tensor, and the tables' lookup and bound. The
plans themselves live beside the code they repeat: `attention.plans` (attention's forward and backward),
`decode.split_kv` (a decoding step's split-KV launches).
"""

from __future__ import annotations

import os

import torch

from .bound import plain_launches

ENABLED = os.environ.get("COURSE_PLANS", "1").strip() not in ("0", "")
MAX_PLANS = 1024  # per table; past it the table starts again (calls whose shapes never repeat)


TABLES: list = []  # every plan table (`table`), for `clear_all`


def table() -> dict:
    """A new plan table {key: plan}, known to `clear_all`."""
    made: dict = {}
    TABLES.append(made)
    return made


def clear_all() -> None:
    """Forget every plan of every table (a test that patches a decision wants the full path again)."""
    for known in TABLES:
        known.clear()


def current_gpu() -> int:
    """The current CUDA device's index (-1 where CUDA is not initialised: no GPU work yet, or a CPU run)."""
    if not torch.cuda.is_initialized():
        return -1
    get = getattr(torch._C, "_cuda_getDevice", None)  # torch.cuda.current_device() without its Python
    return get() if get is not None else torch.cuda.current_device()


def on_current_device(t: torch.Tensor) -> bool:
    """Whether t needs no change of the current GPU to be launched on (a CPU tensor: yes): a plan records
    launches made on the current GPU, so a call that switches devices for its launch keeps the full path."""
    return not t.is_cuda or t.device.index == torch.cuda.current_device()


def tensor_key(t) -> tuple | None:
    """What a launch's decisions may read of a tensor: shape, strides, dtype, device and whether its address
    is a multiple of 16 bytes (what a compiled kernel specialises on); None for None."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % 16)


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
