"""The hints of every exercise of the course, by exercise name: one module per notebook (`nb03.py` for
03_softmax, `nb04b.py` for 04b_tiled_backward, ...), each with a dict `HINTS = {name: [hint, ...]}`.

Hints live here, not in the notebooks, so that a learner meets them one failed attempt at a time
(`course_lib.exercises.check` shows the k-th hint after the k-th wrong try) and never by scrolling past a
check cell. They go from a nudge to the formula; none is the answer itself: a worked answer is shown only
when asked for, by `course_lib.exercises.solution(name)`, which reads it from the instructor edition.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

__all__ = ["hints_for", "all_hints"]


@cache
def all_hints() -> dict[str, tuple[str, ...]]:
    """Every exercise's hints, by name. An exercise name appears in one module only."""
    found: dict[str, tuple[str, ...]] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for name, hints in getattr(module, "HINTS", {}).items():
            if name in found:
                raise ValueError(f"exercise '{name}' has hints in two modules (the second: {info.name})")
            found[name] = tuple(hints)
    return found


def hints_for(name: str) -> list[str]:
    """The hints of exercise `name`, from a nudge to the formula ([] when it has none)."""
    return list(all_hints().get(name, ()))
