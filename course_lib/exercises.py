"""Checking a learner's exercise answers with a clear message.

Used by the cells tagged `check` in every notebook (marking rules: `course_lib.tools.notebooks`).
A check that fails says which exercise, and whether it is unsolved or wrong and by how much.
"""

from __future__ import annotations

import numpy as np
import torch


class ExerciseNotDone(AssertionError):
    """The exercise's code still raises NotImplementedError (or was never defined)."""


class ExerciseWrong(AssertionError):
    """The exercise runs but gives a wrong answer."""


def check(name: str, compute, expected, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Call `compute()` (a learner's answer, wrapped in a lambda) and compare it with `expected`.

    Works for numbers, NumPy arrays and torch tensors (or tuples of them). Prints a line on success;
    raises ExerciseNotDone or ExerciseWrong with a message naming the exercise otherwise."""
    try:
        actual = compute()
    except NameError as exc:
        raise ExerciseNotDone(f"Exercise '{name}': {exc}. Run the exercise's cell first.") from None
    except Exception as exc:
        if not _unsolved(exc):
            raise
        raise ExerciseNotDone(
            f"Exercise '{name}' is not done yet: replace the `raise NotImplementedError` in its cell "
            "with your code, run that cell, then run this check again."
        ) from None
    try:
        _compare(actual, expected, rtol, atol)
    except AssertionError as exc:
        raise ExerciseWrong(f"Exercise '{name}' is not right yet:\n{exc}") from None
    print(f"Exercise '{name}': correct.")


def _unsolved(exc: BaseException) -> bool:
    """True if `exc` is, wraps, or (as Triton's interpreter and compiler do) quotes a NotImplementedError."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, NotImplementedError) or "NotImplementedError" in str(exc):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _compare(actual, expected, rtol, atol) -> None:
    if isinstance(expected, (tuple, list)):
        if not isinstance(actual, (tuple, list)) or len(actual) != len(expected):
            raise AssertionError(
                f"expected a sequence of {len(expected)} results, got {type(actual).__name__}"
            )
        for a, e in zip(actual, expected):
            _compare(a, e, rtol, atol)
        return
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise AssertionError(f"expected a torch.Tensor, got {type(actual).__name__}")
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
        return
    expected_arr, actual_arr = np.asarray(expected), np.asarray(actual)
    if expected_arr.shape != actual_arr.shape:
        raise AssertionError(f"shape {actual_arr.shape}, expected {expected_arr.shape}")
    np.testing.assert_allclose(actual_arr, expected_arr, rtol=rtol, atol=atol, equal_nan=True)
