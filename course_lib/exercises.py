"""Checking a learner's exercise answers, and scoring a learner's predictions, with clear messages.

Used by the cells tagged `check` in every notebook (marking rules: `course_lib.tools.notebooks`), and by the
predict-then-measure cells (first in notebook 01).

- `check(name, compute, expected, hints=[...])` runs the learner's answer. A failure is shown in the notebook as a
  short message (no traceback into course_lib) that says which part is off, e.g. "part 1 (computed tiles): 2016,
  expected 2080", or for an array the first index that differs; each new wrong attempt shows the next hint.
  The cell still counts as failed (it raises), so an automatic run of the notebook notices. An answer whose
  code raises is a wrong attempt too: the message names the error and the learner's line, with the hint.
- `check_cases(name, cases, learner, reference)` runs a learner's function (a kernel's launcher, a tiled loop)
  over many cases (ragged sizes, Nq != Nk, both causal alignments) against a float64 reference, and names the
  first failing case and output.
- Hints are not in the notebooks: they live in `course_lib.hints` by exercise name and appear one per failed
  attempt. A worked answer appears only when asked for: `solution(name)`.
- `predict(name, value, unit)` records a guess before a measurement; `.score(measured)` after it says how close the
  guess was (within 2x counts as good). In the student edition every prediction starts as None: the learner types it.
- `time_kernels(name, learner=..., course_lib=..., sdpa=...)` times a learner's solved kernel next to the
  finished one on a GPU (and says why not on a CPU).
- With `COURSE_GRADE_LOG` set (by `python -m course_lib grade`), every check, prediction, score and timing is
  appended to that file as a JSON line, for the scorecard.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import os
import re
import textwrap
import traceback
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "ExerciseNotDone",
    "ExerciseWrong",
    "Prediction",
    "check",
    "check_cases",
    "check_masked_memory_ops",
    "guarded_empty",
    "predict",
    "score",
    "solution",
    "time_kernels",
]


def _log(event: str, **fields) -> None:
    """Append one JSON line to the grade log named by COURSE_GRADE_LOG (set by `python -m course_lib grade`)."""
    path = os.environ.get("COURSE_GRADE_LOG")
    if not path:
        return
    record = {"event": event, "notebook": os.environ.get("COURSE_GRADE_NOTEBOOK", ""), **fields}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=float) + "\n")


class _Feedback(AssertionError):
    """A failed check: IPython shows only the message (`_render_traceback_`), Python shows the usual traceback."""

    def _render_traceback_(self) -> list[str]:
        return [
            f"\x1b[1;33m{line}\x1b[0m" if i == 0 else line for i, line in enumerate(str(self).splitlines())
        ]


class ExerciseNotDone(_Feedback):
    """The exercise's code still raises NotImplementedError (or was never defined)."""


class ExerciseWrong(_Feedback):
    """The exercise runs but gives a wrong answer."""


# Failed attempts per exercise in this kernel: the k-th wrong answer shows hint k.
_failed_attempts: dict[str, int] = {}


def check(
    name: str,
    compute,
    expected,
    rtol: float | None = None,
    atol: float | None = None,
    hints: Sequence[str] | None = None,
    parts: Sequence[str] | None = None,
) -> None:
    """Call `compute()` (a learner's answer, wrapped in a lambda) and compare it with `expected`.

    Works for numbers, NumPy arrays and torch tensors, tuples/lists of them (`parts` names each element in
    the message) and dicts of them (compared key by key). Tolerances left out: an integer answer must be
    exact (to float rounding, rtol=1e-12), any other within rtol=1e-5, atol=1e-6. Prints a line on
    success. Otherwise raises ExerciseNotDone (the exercise still raises
    NotImplementedError) or ExerciseWrong (with what differs: the value, or an array's shape, dtype or first
    mismatching index). `hints`, ordered from a nudge to the formula: each wrong attempt shows the next one;
    an unsolved exercise shows the first. Left out, the hints come from `course_lib.hints` by `name` (the
    notebooks' way: a hint is never on screen before an attempt fails). Taught in 00_setup."""
    hints = _hints(name, hints)
    try:
        actual = compute()
    except NameError as exc:
        if _raised_by_the_check(exc):  # the check names something never defined: its cell was not run
            raise ExerciseNotDone(
                _with_hint(
                    f"Exercise '{name}': {exc}. Run the exercise's cell first, then this check.", hints, 1
                )
            ) from None
        _wrong(name, f"your code raised {_describe_error(exc)}", hints, exc)
    except _Feedback:  # the check's own verdict from inside (a guard past a kernel's output): as it is
        raise
    except Exception as exc:
        if not _unsolved(exc):  # the answer runs, and fails: a wrong answer, with its hint
            _wrong(name, f"your code raised {_describe_error(exc)}", hints, exc)
        _not_done(name, hints)
    try:
        _compare(actual, expected, rtol, atol, list(parts or []), ())
    except AssertionError as exc:
        _wrong(name, str(exc), hints)
    _correct(name, "correct.")


def check_cases(
    name: str,
    cases: Sequence[dict],
    learner,
    reference,
    rtol: float = 1e-5,
    atol: float = 1e-5,
    outputs: Sequence[str] | None = None,
    hints: Sequence[str] | None = None,
) -> None:
    """Run `learner(**case)` for every case and compare it with `reference(**case)` (float64), naming the first
    failing case and output.

    `cases`: dicts of keyword arguments (shapes, `causal`, block sizes ...), from easy to hard: the first that
    fails is named in the message with its arguments, e.g. "case Nq=100, Nk=75, causal='bottom_right': output
    L: 3 of 200 values differ; the first at index (0, 1, 7): got ..., expected ...". `learner` and `reference`
    return one tensor or a tuple of them (`outputs` names them: ("O", "L")); each learner output is compared
    after conversion to float64 within `rtol`/`atol`, shapes must match. The hints, as for `check`. Used by the
    kernel and algorithm exercises from notebook 03 on (the tiled forward, FlashAttention-2's kernels, ...)."""
    hints = _hints(name, hints)
    names = list(outputs or [])
    for case in cases:
        label = ", ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in case.items())
        try:
            actual = learner(**case)
        except _Feedback:
            raise
        except Exception as exc:
            if _unsolved(exc):
                _not_done(name, hints)
            _wrong(name, f"case {label}: your code raised {_describe_error(exc)}", hints, exc)
        expected = reference(**case)
        single = not isinstance(expected, (tuple, list))
        actual_t = (actual,) if single and not isinstance(actual, (tuple, list)) else actual
        expected_t = (expected,) if single else tuple(expected)
        if not isinstance(actual_t, (tuple, list)) or len(actual_t) != len(expected_t):
            got = len(actual_t) if isinstance(actual_t, (tuple, list)) else type(actual).__name__
            _wrong(name, f"case {label}: expected {len(expected_t)} outputs {names or ''}, got {got}", hints)
        for i, (a, e) in enumerate(zip(actual_t, expected_t)):
            what = (
                f"output {names[i]}" if i < len(names) else (f"output {i + 1}" if len(expected_t) > 1 else "")
            )
            try:
                if not isinstance(a, (torch.Tensor, np.ndarray, int, float, np.number)):
                    raise AssertionError(f"expected a tensor, got {type(a).__name__}")
                _compare(_as_array(a, ""), _as_array(e, ""), rtol, atol, [], ())
            except AssertionError as exc:
                _wrong(name, f"case {label}: {what + ': ' if what else ''}{exc}", hints)
    _correct(name, f"correct on all {len(cases)} cases.")


def _hints(name: str, given) -> list[str]:
    if given is not None:
        return list(given)
    from .hints import hints_for

    return hints_for(name)


_solved: set[str] = set()


def _correct(name: str, what: str) -> None:
    _failed_attempts.pop(name, None)
    _solved.add(name)
    _log("check", name=name, status="correct")
    print(f"Exercise '{name}': {what}")


def _not_done(name: str, hints: list[str]):
    _log("check", name=name, status="not_done")
    raise ExerciseNotDone(
        _with_hint(
            f"Exercise '{name}' is not done yet:\nreplace the `raise NotImplementedError` in its cell "
            "with your code, run that cell, then run this check again.",
            hints,
            1,
            name,
        )
    ) from None


def _wrong(name: str, what: str, hints: list[str], cause: BaseException | None = None):
    """Count a wrong attempt and raise ExerciseWrong with the next hint (`cause`: the error the answer raised,
    kept as the exception's cause for a full traceback: `%debug`, or `sys.last_value.__cause__`)."""
    attempts = _failed_attempts.get(name, 0) + 1
    _failed_attempts[name] = attempts
    _log("check", name=name, status="wrong", attempt=attempts)
    raise ExerciseWrong(
        _with_hint(f"Exercise '{name}' is not right yet: {what}", hints, attempts, name)
    ) from cause


def _raised_by_the_check(exc: BaseException) -> bool:
    """True when `exc` was raised in the check's own lambda (`check` -> the lambda, no deeper frame)."""
    tb = exc.__traceback__
    inner = tb.tb_next if tb is not None else None
    return inner is not None and inner.tb_next is None and inner.tb_frame.f_code.co_name == "<lambda>"


def _describe_error(exc: BaseException) -> str:
    """'TypeError: ... (at line 7 of your cell: `return m, l`)': the error and the last line of the
    learner's own code it passed through (not course_lib's, PyTorch's or NumPy's)."""
    text = f"{type(exc).__name__}: {exc}".strip()
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = frame.filename.replace("\\", "/")
        if "/course_lib/" in path or "site-packages" in path or path.startswith("<frozen"):
            continue
        if frame.name == "<lambda>" and frame.lineno and "check(" in (frame.line or ""):
            continue  # the check cell itself
        code = f": `{frame.line.strip()}`" if frame.line else ""
        return f"{text} (at line {frame.lineno} of {frame.name}{code})"
    return text


def _with_hint(message: str, hints: list[str], k: int, name: str | None = None) -> str:
    """The message with hint k (the last one once they run out), and where a worked answer is once they have."""
    if not hints:
        return message
    if k > len(hints) and name is not None:
        return (
            f"{message}\nNo more hints (you have seen all {len(hints)}). Still stuck? "
            f"`course_lib.exercises.solution({name!r})` shows a worked answer."
        )
    k = min(k, len(hints))
    more = " (another wrong attempt shows the next hint)" if k < len(hints) else ""
    return f"{message}\nHint {k} of {len(hints)}: {hints[k - 1]}{more}"


def _unsolved(exc: BaseException) -> bool:
    """True if `exc` is, wraps, or (as Triton's interpreter and compiler do) quotes a NotImplementedError."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, NotImplementedError) or "NotImplementedError" in str(exc):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _where(parts: list[str], path: tuple[int, ...]) -> str:
    """'part 2 (fraction)' for the element at `path` of a nested expected answer, '' at the top."""
    if not path:
        return ""
    label = "part " + ".".join(str(i + 1) for i in path)
    if len(path) == 1 and path[0] < len(parts):
        label += f" ({parts[path[0]]})"
    return label + ": "


def _fmt(x, digits: int = 6) -> str:
    if isinstance(x, (float, np.floating)):
        return f"{float(x):.{digits}g}"
    return repr(x.item() if isinstance(x, (np.generic, torch.Tensor)) else x)


def _got_expected(actual, expected, rtol, atol) -> str:
    """'got 88.7228, expected 88.72 (...)': as many digits as it takes to tell them apart, the types when
    they differ in kind (text against a number), and the tolerance a number was compared with."""
    got, want = _fmt(actual), _fmt(expected)
    if got == want:
        got, want = _fmt(actual, 17), _fmt(expected, 17)
    text = f"got {got}, expected {want}"
    numbers = all(
        isinstance(x, (int, float, np.number)) and not isinstance(x, bool) for x in (actual, expected)
    )
    if not numbers:
        text += f" ({type(actual).__name__}, expected {type(expected).__name__})"
    elif rtol or atol:
        text += f" (compared within rtol={rtol:g}, atol={atol:g})"
    return text


def _as_array(x, where: str) -> np.ndarray:
    """x as a NumPy array (float64 for floating tensors of any width, bfloat16 included)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return (x.double() if x.is_floating_point() else x).numpy()
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise AssertionError(
            f"{where}could not read your answer as an array ({type(x).__name__}: {exc}); return one "
            "array or tensor, not a list of pieces"
        ) from None


def _compare(actual, expected, rtol, atol, parts: list[str], path: tuple[int, ...]) -> None:
    where = _where(parts, path)
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            raise AssertionError(
                f"{where}expected a dict with keys {sorted(expected)}, got {type(actual).__name__}"
            )
        if set(actual) != set(expected):
            missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
            raise AssertionError(f"{where}dict keys differ: missing {missing}, unexpected {extra}")
        for key in expected:
            try:
                _compare(actual[key], expected[key], rtol, atol, [], ())
            except AssertionError as exc:
                raise AssertionError(f"{where}key {key!r}: {exc}") from None
        return
    if isinstance(expected, (tuple, list)):
        if not isinstance(actual, (tuple, list)) or len(actual) != len(expected):
            if isinstance(actual, (tuple, list)):
                raise AssertionError(
                    f"{where}got {len(actual)} results, expected {len(expected)} "
                    f"(shape ({len(actual)},), expected ({len(expected)},))"
                )
            raise AssertionError(
                f"{where}expected a sequence of {len(expected)} results, got {type(actual).__name__}"
            )
        for i, (a, e) in enumerate(zip(actual, expected)):
            _compare(a, e, rtol, atol, parts, (*path, i))
        return
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise AssertionError(f"{where}expected a torch.Tensor, got {type(actual).__name__}")
        if actual.dtype != expected.dtype:
            raise AssertionError(f"{where}dtype {actual.dtype}, expected {expected.dtype}")
    expected_arr, actual_arr = _as_array(expected, where), _as_array(actual, where)
    if expected_arr.shape != actual_arr.shape:
        raise AssertionError(f"{where}shape {actual_arr.shape}, expected {expected_arr.shape}")
    counts = expected_arr.dtype.kind in "iu"  # an integer answer (a count, bytes): exact unless told
    rtol = (1e-12 if counts else 1e-5) if rtol is None else rtol
    atol = (0.0 if counts else 1e-6) if atol is None else atol
    try:
        close = np.isclose(actual_arr, expected_arr, rtol=rtol, atol=atol, equal_nan=True)
    except TypeError:  # not numbers (strings, objects): compare for equality
        close = np.asarray(actual_arr == expected_arr)
    if close.all():
        return
    if expected_arr.ndim == 0:
        scalar = actual if not isinstance(actual, (torch.Tensor, np.ndarray)) else actual_arr[()]
        raise AssertionError(f"{where}{_got_expected(scalar, expected_arr[()], rtol, atol)}")
    bad = np.argwhere(~close)
    first = tuple(int(i) for i in bad[0])
    raise AssertionError(
        f"{where}{len(bad)} of {close.size} values differ; the first at index {first}: "
        f"{_got_expected(actual_arr[first], expected_arr[first], rtol, atol)}"
    )


GUARD_FILL = -7.0


def guarded_empty(shape, dtype, device, guard: int = 256):
    """An output tensor for a learner's kernel, followed in memory by `guard` elements it must not touch.

    Returns `(out, check_guard)`: `out` (contiguous, `shape`) is the start of a longer buffer filled with
    GUARD_FILL; `check_guard(name)` raises ExerciseWrong when the elements past `out` changed, i.e. the
    kernel stored past the end (a store without its mask, or a wrong one). Without the guard such a store
    overwrites memory that belongs to something else and, under the interpreter, can crash the process
    later, far from its cause. Used by the kernel exercises of notebooks 05-07."""
    numel = math.prod(shape)
    buffer = torch.full((numel + guard,), GUARD_FILL, dtype=dtype, device=device)

    def check_guard(name: str) -> None:
        tail = buffer[numel:]
        touched = int((tail != GUARD_FILL).sum())
        if touched:
            raise ExerciseWrong(
                f"Exercise '{name}': the kernel stored past the end of its output ({touched} of the {guard} "
                "elements just after it changed). Mask every store that can fall outside the tensor, e.g. "
                "`mask=offs < n` (notebook 05, section 3: what goes wrong without a mask)."
            )

    return buffer[:numel].view(shape), check_guard


def check_masked_memory_ops(kernel, name: str) -> None:
    """Raise ExerciseWrong when a `tl.load` or `tl.store` in the learner's `kernel` (a @triton.jit function)
    has no mask (nor a block pointer's `boundary_check`).

    The guard of `guarded_empty` catches a store past the end by its effect; a load past the end has none
    the check can see when its lanes are masked off at the store, yet on a GPU it reads memory that is not
    the tensor's (an illegal-address error, or a fault only at some sizes). So the kernel's source is read
    instead. For exercises whose every load and store can fall past an edge (notebook 05's exercises)."""
    fn = getattr(kernel, "fn", kernel)
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError, AttributeError):  # no source to read (defined in a string): nothing to say
        return
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("load", "store")
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "tl"
        ):
            continue
        op = node.func.attr
        # where a positional mask would stand: tl.load(pointer, mask, ...), tl.store(pointer, value, mask)
        masked_position = 1 if op == "load" else 2
        if len(node.args) > masked_position or {k.arg for k in node.keywords} & {"mask", "boundary_check"}:
            continue
        verb = "read" if op == "load" else "write"
        raise ExerciseWrong(
            f"Exercise '{name}': `{ast.get_source_segment(source, node)}` in "
            f"{getattr(fn, '__name__', 'the kernel')} has no mask. The last program's lanes past the edge "
            f"{verb} memory that is not the tensor's: on a GPU, an illegal-address error or garbage. Give it "
            "`mask=` (notebook 05, section 3)."
        )


@dataclass
class Prediction:
    """A learner's guess of a quantity, written down before it is measured (see `predict`)."""

    name: str
    value: float | None
    unit: str = ""

    def score(self, measured: float, factor: float = 2.0) -> float | None:
        """Print how close the guess was to `measured` and return measured / guess (None if no guess).

        Within `factor` either way counts as good. Both numbers must be positive. Taught in 01_roofline."""
        measured = float(measured)
        if self.value is None:
            _log("score", name=self.name, predicted=None, measured=measured)
            print(
                f"'{self.name}': measured {_fmt(measured)}{self.unit}, unscored: no prediction was written down. "
                "Next time, type your estimate in place of None before you run the measurement."
            )
            return None
        guess = float(self.value)
        if not (guess > 0 and measured > 0 and math.isfinite(guess) and math.isfinite(measured)):
            raise ValueError(f"'{self.name}': prediction {guess} and measurement {measured} must be positive")
        ratio = measured / guess
        off = max(ratio, 1 / ratio)
        direction = "low" if ratio > 1 else "high"
        if off <= 1.25:
            verdict = "spot on (within 25%)"
        elif off <= factor:
            verdict = f"good: within {factor:g}x (your guess was {off:.2g}x too {direction})"
        else:
            verdict = (
                f"off by {off:.3g}x (your guess was too {direction}): find which assumption of your "
                "estimate the measurement breaks"
            )
        print(
            f"'{self.name}': you predicted {_fmt(guess)}{self.unit}, measured {_fmt(measured)}{self.unit}: {verdict}."
        )
        _log("score", name=self.name, predicted=guess, measured=measured, ratio=ratio, good=off <= factor)
        return ratio


_predictions: dict[str, Prediction] = {}


def predict(name: str, value: float | None, unit: str = "") -> Prediction:
    """Write down a prediction before measuring; score it afterwards with `.score(measured)` or `score(name, ...)`.

    `value` is a positive number in `unit` (e.g. `predict("fused speed-up", 3, "x")`); None means no guess yet
    (the student edition starts every prediction at None: the learner types the number). Taught in 01_roofline;
    used before each measurement of the course."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float, np.number))):
        raise TypeError(f"prediction '{name}': expected a number, got {type(value).__name__}")
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"prediction '{name}': a prediction is a positive number (a time, a rate, a ratio), got {value!r}"
        )
    prediction = Prediction(name, None if value is None else float(value), unit)
    _predictions[name] = prediction
    _log("predict", name=name, value=prediction.value)
    if value is None:
        print(
            f"Prediction '{name}': none written down (type your estimate in place of None, then run this again)."
        )
    else:
        print(f"Prediction '{name}': {_fmt(float(value))}{unit}. Now measure.")
    return prediction


def score(name: str, measured: float, factor: float = 2.0) -> float | None:
    """Score the prediction made with `predict(name, ...)` against `measured` (see Prediction.score)."""
    if name not in _predictions:
        raise ValueError(f"no prediction named '{name}': run the cell with predict('{name}', ...) first")
    return _predictions[name].score(measured, factor)


def _notebook_sources():
    """The instructor edition's percent-format sources (notebooks/NN_name.py), where worked answers live."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "notebooks"
    return sorted(root.glob("[0-9][0-9]*_*.py"))


_CELL = re.compile(r"^# %%.*$", re.MULTILINE)


def _solution_text(name: str) -> tuple[str, str] | None:
    """(notebook file name, the worked answer) of exercise `name`, read from the instructor edition: the
    solution regions (or cells tagged `solution`) between the previous check cell and the one that checks
    `name`."""
    call = re.compile(r"\bcheck(?:_cases)?\(\s*(?:name\s*=\s*)?[\"']" + re.escape(name) + r"[\"']")
    for path in _notebook_sources():
        text = path.read_text(encoding="utf-8")
        headers = list(_CELL.finditer(text))
        cells = [
            (h.group(0), text[h.end() : headers[i + 1].start() if i + 1 < len(headers) else len(text)])
            for i, h in enumerate(headers)
        ]
        for i, (header, body) in enumerate(cells):
            if "check" not in header or not call.search(body):
                continue
            pieces = []
            for prev_header, prev in reversed(cells[:i]):
                if "check" in prev_header and "[markdown]" not in prev_header:
                    break
                if '"solution"' in prev_header:
                    pieces.append(prev.strip("\n"))
                elif "### BEGIN SOLUTION" in prev:
                    pieces.append(_with_regions_marked(prev.strip("\n")))
            if pieces:
                return path.name, "\n\n".join(reversed(pieces))
    return None


def _with_regions_marked(source: str) -> str:
    """The cell with its solution markers turned into comments a learner reads as 'this is the answer'."""
    return source.replace("### BEGIN SOLUTION", "# --- the answer starts here ---").replace(
        "### END SOLUTION", "# --- the answer ends here ---"
    )


def solution(name: str) -> None:
    """Print a worked answer to exercise `name`, read from the instructor edition (notebooks/NN_name.py).

    Only on request: the checks show hints one failed attempt at a time and never the answer. Recorded in the
    grade log, so an instructor's scorecard shows which answers were looked up."""
    found = _solution_text(name)
    if found is None:
        print(
            f"No worked answer for '{name}' was found: the instructor edition (notebooks/*.py of the course's "
            "repository) is not next to this course_lib, or no exercise has that name."
        )
        return
    notebook, text = found
    _log("solution", name=name)
    print(f"A worked answer to '{name}' (from the instructor edition, {notebook}):\n\n{text}")


def time_kernels(name: str, learner, course_lib=None, sdpa=None, flops: float | None = None, note: str = ""):
    """On a GPU: time the learner's solved kernel (`learner`, a no-argument callable) next to course_lib's
    finished one and PyTorch's SDPA (optional callables), print milliseconds, TFLOP/s when `flops` is given and
    the ratio to course_lib's, then `note` (why they differ, in one line). Returns {provider: ms} or None.

    On a CPU the kernels run in Triton's interpreter, whose times say nothing about a GPU: it says so and
    returns None. Before exercise `name` passes its check it says that too (there is nothing to time)."""
    if name not in _solved:
        print(f"'{name}': not timed, the exercise has not passed its check in this session yet.")
        return None
    if not torch.cuda.is_available():
        print(
            f"'{name}': timing needs a GPU. Here the kernels run in Triton's interpreter, one Python step per "
            "block, and its times say nothing about a GPU: see the recorded runs instead."
        )
        return None
    from .perf.timing import benchmark

    calls = {"yours": learner, "course_lib": course_lib, "SDPA": sdpa}
    times = {k: benchmark(fn) for k, fn in calls.items() if fn is not None}
    parts = []
    for k, ms in times.items():
        rate = f", {flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s" if flops else ""
        parts.append(f"{k} {ms:.3f} ms{rate}")
    line = f"'{name}': " + "; ".join(parts)
    if "course_lib" in times:
        line += f". Yours takes {times['yours'] / times['course_lib']:.2f}x course_lib's time"
    print(line + ("." if not note else f".\n{note}"))
    _log("timing", name=name, **{f"{k}_ms": v for k, v in times.items()})
    return times
