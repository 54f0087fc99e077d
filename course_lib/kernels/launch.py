"""One type for every kernel's launch table: what a launch needs beyond its arguments (notebooks 06-11).

Each kernel module keeps its own table next to its kernel, with the measurements that chose it; every entry
of every table is a `Launch`:

- `attention.configs`: the Triton forward, dK/dV and dQ tiles (block_m x block_n, warps, stages), and the
  rows per program of the atomic backward's preprocessing kernel;
- `attention.backward`: the elements per program of the grouped-query dK/dV sum;
- `attention.hopper`, `attention.hopper_backward`: the Gluon kernels' variants (K/V block, ring stages,
  consumer warpgroups, ping-pong, persistent grid);
- `decode.heuristics`: the split-KV tiles per head dim (`DecodeTile`);
- `fused.launch`: RMSNorm's and RoPE's rows, tokens and warps per program, the column-sum tile.

A `Launch` is a frozen dataclass (a table's entries cannot change under a running kernel, and they can key a
cache). A field declared with `keyword("BLOCK_N")` is a keyword of the kernel launch, and `kwargs()` gives
them all, ready for `kernel[grid](*args, **launch.kwargs())`; a field without one sizes the grid or guides
a choice (`DecodeTile.programs_per_sm`, `BackwardLaunch.programs_per_sm`).

Why a subclass per kernel, not one dataclass with every field: the kernels take different keywords
(BLOCK_M and BLOCK_N; BLOCK_N alone; ROWS or CHUNK; TOKENS; NUM_STAGES and NUM_CONSUMERS, which in Gluon
are the kernel's own constants, not Triton's pipelining), and one class would carry fields that most
entries leave empty. Why the base declares no fields, not even num_warps and num_stages: a dataclass puts
inherited fields first in its constructor, and entries are built positionally (the GPU's records of
autotuned choices in `attention/tuned/` are lists in the order block_m, block_n, num_warps, num_stages);
the fused kernels launch with Triton's default stages and name their warps `warps`, as their host
functions' keyword does; the Gluon kernels always launch 4 warps (`hopper.launch_options`).

A launch unpacks and indexes as the tuple it replaces, fields in order (`block_n, stages, consumers, *_ =
variant`, `variant[2]`).

`PerDevice` holds a setting that differs under the interpreter (small programs keep its Python loop short)
and on a GPU; `current()` picks the one for where the kernels run.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Generic, TypeVar

from .. import runtime


def keyword(name: str, default=dataclasses.MISSING):
    """A `Launch` field that the kernel takes as keyword `name` (a constexpr, or num_warps / num_stages)."""
    return dataclasses.field(default=default, metadata={"keyword": name})


@dataclass(frozen=True)
class Launch:
    """A kernel's launch setting; subclasses name its fields (module docstring)."""

    def kwargs(self) -> dict:
        """The keyword arguments of the launch: {keyword: value} for every field declared with `keyword`."""
        return {keyword: getattr(self, name) for keyword, name in _keywords(type(self))}

    def __iter__(self):
        return iter(tuple(getattr(self, name) for name in _names(type(self))))

    def __getitem__(self, index):
        """Indexing as the tuple it replaces (`variant[2]`), so code written against the tuples still runs."""
        return tuple(self)[index]


@functools.cache
def _keywords(cls) -> tuple[tuple[str, str], ...]:
    """(kernel keyword, field name) of each field of a `Launch` class declared with `keyword`: read from the
    class once (`kwargs()` with `dataclasses.fields` on every launch: 1.3 us; with this, 0.6 us, a 2-core CPU)."""
    return tuple((f.metadata["keyword"], f.name) for f in dataclasses.fields(cls) if "keyword" in f.metadata)


@functools.cache
def _names(cls) -> tuple[str, ...]:
    """The field names of a `Launch` class, in order."""
    return tuple(f.name for f in dataclasses.fields(cls))


T = TypeVar("T", bound=Launch)


@dataclass(frozen=True)
class PerDevice(Generic[T]):
    """One launch under the Triton interpreter, another on a GPU."""

    interpreter: T
    gpu: T

    def current(self) -> T:
        """The launch for where the kernels run (`runtime.INTERPRET`)."""
        return self.interpreter if runtime.INTERPRET else self.gpu
