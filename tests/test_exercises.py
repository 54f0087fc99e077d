"""Exercise checks (friendly failures, which part is off, progressive hints) and scored predictions."""

import numpy as np
import pytest
import torch

from course_lib import exercises


def test_wrong_number_names_the_part():
    with pytest.raises(exercises.ExerciseWrong, match=r"part 1 \(computed tiles\): got 2016, expected 2080"):
        exercises.check("tiles", lambda: (2016, 0.5), (2080, 0.5), parts=["computed tiles", "fraction"])


def test_wrong_array_gives_first_mismatching_index():
    expected = torch.arange(12.0).reshape(3, 4)
    actual = expected.clone()
    actual[1, 2] = -1.0
    with pytest.raises(
        exercises.ExerciseWrong, match=r"1 of 12 values differ; the first at index \(1, 2\): got -1"
    ):
        exercises.check("array", lambda: actual, expected)
    with pytest.raises(exercises.ExerciseWrong, match="dtype torch.float32, expected torch.float64"):
        exercises.check("dtype", lambda: actual, expected.double())
    with pytest.raises(exercises.ExerciseWrong, match=r"shape \(2,\), expected \(3,\)"):
        exercises.check("np shape", lambda: np.ones(2), np.ones(3))


def test_hints_advance_with_each_wrong_attempt():
    hints = ["a nudge", "the formula"]

    def unsolved():
        raise NotImplementedError

    with pytest.raises(exercises.ExerciseNotDone, match="Hint 1 of 2: a nudge"):
        exercises.check("hinted", unsolved, 1, hints=hints)
    with pytest.raises(exercises.ExerciseWrong, match="Hint 1 of 2: a nudge"):
        exercises.check("hinted", lambda: 2, 1, hints=hints)
    with pytest.raises(exercises.ExerciseWrong, match="Hint 2 of 2: the formula"):
        exercises.check("hinted", lambda: 2, 1, hints=hints)
    with pytest.raises(exercises.ExerciseWrong, match=r"No more hints.*solution\('hinted'\)"):
        exercises.check("hinted", lambda: 3, 1, hints=hints)
    exercises.check("hinted", lambda: 1, 1, hints=hints)


def test_hints_come_from_the_registry_by_name(monkeypatch):
    """A notebook's check names no hints: they come from course_lib.hints, one per failed attempt."""
    from course_lib import hints as registry

    monkeypatch.setattr(registry, "all_hints", lambda: {"registered": ("first", "second")})
    with pytest.raises(exercises.ExerciseWrong, match="Hint 1 of 2: first"):
        exercises.check("registered", lambda: 2, 1)
    with pytest.raises(exercises.ExerciseWrong, match="Hint 2 of 2: second"):
        exercises.check("registered", lambda: 2, 1)


def test_every_registered_hint_names_an_exercise_of_a_notebook():
    """Each name in course_lib.hints appears as a string in some notebook (a renamed exercise would otherwise
    lose its hints silently); names may reach `check` through a variable, so any string literal counts."""
    from pathlib import Path

    from course_lib.hints import all_hints

    text = "\n".join(p.read_text() for p in Path(__file__).parents[1].glob("notebooks/*.py"))
    missing = {name for name in all_hints() if f'"{name}"' not in text and f"'{name}'" not in text}
    assert not missing, f"hints for exercises no notebook names: {missing}"


def test_check_cases_names_the_first_failing_case():
    def reference(n, causal):
        return torch.arange(n, dtype=torch.float64), torch.ones(2, dtype=torch.float64)

    def learner(n, causal):
        o, l = reference(n, causal)
        if n == 7 and causal:
            o = o.clone()
            o[5] = -1
        return o.float(), l

    cases = [{"n": 4, "causal": False}, {"n": 7, "causal": True}, {"n": 9, "causal": True}]
    with pytest.raises(
        exercises.ExerciseWrong, match=r"case n=7, causal=True: output O: 1 of 7 values differ"
    ):
        exercises.check_cases("cases", cases, learner, reference, outputs=("O", "L"))
    exercises.check_cases("cases ok", cases, reference, reference, outputs=("O", "L"))

    def unsolved(n, causal):
        raise NotImplementedError

    with pytest.raises(exercises.ExerciseNotDone):
        exercises.check_cases("cases unsolved", cases, unsolved, reference)
    with pytest.raises(exercises.ExerciseWrong, match=r"case n=4, causal=False: expected 2 outputs"):
        exercises.check_cases(
            "cases arity", cases, lambda n, causal: torch.zeros(n), reference, outputs=("O", "L")
        )


def test_solution_only_on_request_from_the_instructor_source(capsys):
    """No hint is an answer; `solution(name)` prints the instructor's region for a real exercise."""
    exercises.solution("lse_from_base2")
    out = capsys.readouterr().out
    assert "the answer starts here" in out and "06_flash_forward.py" in out
    exercises.solution("no such exercise")
    assert "No worked answer" in capsys.readouterr().out


def test_grade_log_records_checks_and_predictions(tmp_path, monkeypatch):
    import json

    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("COURSE_GRADE_LOG", str(log))
    with pytest.raises(exercises.ExerciseWrong):
        exercises.check("logged", lambda: 2, 1, hints=[])
    exercises.check("logged", lambda: 1, 1, hints=[])
    exercises.predict("logged guess", 2.0, "x").score(3.0)
    exercises.predict("blank guess", None).score(3.0)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["event"], e.get("status")) for e in events[:2]] == [("check", "wrong"), ("check", "correct")]
    scores = [e for e in events if e["event"] == "score"]
    assert scores[0]["predicted"] == 2.0 and scores[0]["good"] and scores[1]["predicted"] is None


def test_ipython_shows_only_the_message():
    try:
        exercises.check("shown", lambda: 2, 1)
    except exercises.ExerciseWrong as exc:
        lines = exc._render_traceback_()
    assert len(lines) == 1 and "'shown' is not right yet: got 2, expected 1" in lines[0]
    assert not any("course_lib" in line for line in lines)


def test_predict_scores_within_a_factor(capsys):
    p = exercises.predict("speed-up", 3, "x")
    assert p.score(4.5) == pytest.approx(1.5)
    assert "good: within 2x (your guess was 1.5x too low)" in capsys.readouterr().out
    assert exercises.score("speed-up", 30) == pytest.approx(10)
    assert "off by 10x (your guess was too low)" in capsys.readouterr().out
    exercises.predict("speed-up", 3.1, "x").score(3)
    assert "spot on" in capsys.readouterr().out
    assert exercises.predict("none", None).score(2.0) is None
    with pytest.raises(ValueError, match="no prediction named 'other'"):
        exercises.score("other", 1.0)
    with pytest.raises(TypeError, match="expected a number, got str"):
        exercises.predict("text", "fast")


def _add_one_kernel(masked: bool):
    from course_lib.runtime import tl, triton

    @triton.jit
    def add_one(x_ptr, out_ptr, n, BLOCK: tl.constexpr, MASKED: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        if MASKED:
            tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)
        else:
            tl.store(out_ptr + offs, tl.load(x_ptr + offs) + 1.0)

    return lambda x, out, n: add_one[(triton.cdiv(n, 32),)](x, out, n, BLOCK=32, MASKED=masked)


@pytest.mark.parametrize("masked", [True, False])
def test_guarded_empty_catches_a_store_past_the_end(masked):
    """A learner's kernel that stores past its output's end (no mask) is named by the guard, not left to
    overwrite memory; a masked one passes and leaves the guard as it was. x is the start of a longer buffer,
    so the unmasked loads stay in memory the test owns."""
    from course_lib import runtime

    x = torch.randn(128, device=runtime.DEVICE)
    out, check_guard = exercises.guarded_empty(
        (3, 30), torch.float32, runtime.DEVICE
    )  # 90: not a multiple of 32
    _add_one_kernel(masked)(x, out, 90)
    assert out.shape == (3, 30) and out.is_contiguous()
    assert torch.equal(out.flatten(), x[:90] + 1.0)
    if masked:
        check_guard("add one")
    else:
        with pytest.raises(
            exercises.ExerciseWrong, match=r"'add one': the kernel stored past the end .*6 of the 256"
        ):
            check_guard("add one")


def _copy_kernels():
    """Three copies of x into out: every access masked; the load unmasked but the store masked (the output
    is right, so only the source can tell); and the store unmasked."""
    from course_lib.runtime import tl, triton

    @triton.jit
    def copy_masked(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, offs < n), mask=offs < n)

    @triton.jit
    def copy_unmasked_load(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs)
        tl.store(out_ptr + offs, x, mask=offs < n)

    @triton.jit
    def copy_unmasked_store(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n, other=0.0))

    return copy_masked, copy_unmasked_load, copy_unmasked_store


def test_check_masked_memory_ops_names_the_unmasked_access():
    """The unmasked load whose lanes the masked store drops gives the right output, which the guard cannot
    see; the source check names it. A kernel whose every access is masked (by keyword or by position)
    passes."""
    from course_lib import runtime
    from course_lib.runtime import triton

    copy_masked, copy_unmasked_load, copy_unmasked_store = _copy_kernels()
    x = torch.randn(128, device=runtime.DEVICE)  # a longer buffer: the unmasked load stays in owned memory
    out, check_guard = exercises.guarded_empty((90,), torch.float32, runtime.DEVICE)
    copy_unmasked_load[(triton.cdiv(90, 32),)](x, out, 90, BLOCK=32)
    check_guard("copy")  # nothing stored past the end, and the output is right ...
    assert torch.equal(out, x[:90])
    with pytest.raises(  # ... yet the load reads past it
        exercises.ExerciseWrong, match=r"'copy': `tl.load\(x_ptr \+ offs\)` in copy_unmasked_load has no mask"
    ):
        exercises.check_masked_memory_ops(copy_unmasked_load, "copy")
    with pytest.raises(
        exercises.ExerciseWrong, match=r"`tl.store\(out_ptr \+ offs, .*\)` in copy_unmasked_store"
    ):
        exercises.check_masked_memory_ops(copy_unmasked_store, "copy")
    exercises.check_masked_memory_ops(copy_masked, "copy")


def test_an_answer_that_raises_is_a_wrong_attempt_with_its_hint():
    """An error in the learner's code (or one their answer causes in the check) is a wrong answer: the
    message names the error and the learner's line, and shows the hint, where a bare traceback from deep
    inside the check was shown before. A name the check itself cannot find means the exercise's cell was
    not run; a NameError inside the learner's function is their bug, not that."""

    def unpacks_none():
        m, l = None  # noqa: F841
        return m

    with pytest.raises(
        exercises.ExerciseWrong,
        match=r"your code raised TypeError: cannot unpack non-iterable NoneType object \(at line \d+ of "
        r"unpacks_none: `m, l = None.*`\)\nHint 1 of 1: unpack",
    ) as caught:
        exercises.check("raises", unpacks_none, 1.0, hints=["unpack"])
    assert isinstance(caught.value.__cause__, TypeError)  # the full traceback stays reachable

    def misspelt():
        return np_log2(8)  # noqa: F821

    with pytest.raises(exercises.ExerciseWrong, match="your code raised NameError: name 'np_log2'"):
        exercises.check("misspelt", misspelt, 3.0)
    with pytest.raises(exercises.ExerciseNotDone, match="Run the exercise's cell first"):
        exercises.check("not run", lambda: never_defined(), 3.0)  # noqa: F821

    def guarded():  # a verdict from inside the answer's run (a kernel's output guard) comes out as it is
        raise exercises.ExerciseWrong("Exercise 'guarded': the kernel stored past the end of its output")

    with pytest.raises(exercises.ExerciseWrong, match="^Exercise 'guarded': the kernel stored past the end"):
        exercises.check("guarded", guarded, 1.0)


def test_answers_of_another_kind_are_named():
    cases = [
        (lambda: "1.5", 1.5, r"got '1\.5', expected 1\.5 \(str, expected float64\)"),
        (lambda: None, 1.5, r"got None, expected 1\.5 \(NoneType, expected float64\)"),
        (lambda: [np.ones(2), np.ones(3)], np.ones(5), "could not read your answer as an array"),
        (lambda: {"a": 1, "b": 2.0}, {"a": 1, "b": 2.5}, r"key 'b': got 2, expected 2\.5"),
        (lambda: {"a": 1}, {"a": 1, "b": 2}, r"dict keys differ: missing \['b'\]"),
        (lambda: (1, 2), {"a": 1}, r"expected a dict with keys \['a'\], got tuple"),
    ]
    for answer, expected, words in cases:
        with pytest.raises(exercises.ExerciseWrong, match=words):
            exercises.check("kind", answer, expected)
    exercises.check("bfloat16", lambda: torch.tensor(1.5, dtype=torch.bfloat16), 1.5)
    exercises.check("dict", lambda: {"a": 1, "b": 2.5}, {"a": 1, "b": 2.5})


def test_values_that_print_alike_get_more_digits_and_counts_are_exact():
    # one float32 step below log(FLT_MAX)'s float32: both print as 88.7228 at six digits
    below = float(np.nextafter(np.float32(88.72283935546875), np.float32(0)))
    with pytest.raises(
        exercises.ExerciseWrong, match=r"got 88\.72283172607421\d*, expected 88\.72283935546875"
    ):
        exercises.check("digits", lambda: below, 88.72283935546875, rtol=0, atol=0)
    with pytest.raises(exercises.ExerciseWrong, match="got 4294967294, expected 4294967295"):
        exercises.check("count", lambda: 4294967294, 4294967295)  # once within the default rtol=1e-5
    exercises.check("count from floats", lambda: 2080.0000000001, 2080)
    with pytest.raises(exercises.ExerciseWrong, match=r"\(compared within rtol=1e-05, atol=1e-06\)"):
        exercises.check("tolerance named", lambda: 1.1, 1.0)


def test_predictions_must_be_positive_and_finite():
    for value in (0, -2, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="a prediction is a positive number"):
            exercises.predict("p", value)
    with pytest.raises(TypeError, match="expected a number, got bool"):
        exercises.predict("p", True)


def test_the_merge_exercise_refuses_an_unstable_merge():
    """`testing.check_merge` (notebooks 09 and 13) accepts the library's merge and refuses the literal
    log(exp(a) + exp(b)), which overflows on its row of large logsumexps; every case row is there."""
    from course_lib.attention.merge import merge_attention_states
    from course_lib.testing import check_merge, merge_cases

    o_a, lse_a, o_b, lse_b = merge_cases()
    assert lse_a.isneginf().any() and lse_b.isneginf().any() and (lse_a.isneginf() & lse_b.isneginf()).any()
    assert (lse_a > 709).any() and not o_a[lse_a.isneginf()].any() and not o_b[lse_b.isneginf()].any()
    check_merge("merge", merge_attention_states)

    def unstable(o_a, lse_a, o_b, lse_b):
        lse = torch.log(torch.exp(lse_a) + torch.exp(lse_b))
        safe = torch.where(lse.isneginf(), torch.zeros_like(lse), lse)
        return torch.exp(lse_a - safe)[:, None] * o_a + torch.exp(lse_b - safe)[:, None] * o_b, lse

    with pytest.raises(exercises.ExerciseWrong, match="logaddexp"):
        check_merge("merge", unstable)


def test_exercise_check_messages():
    exercises.check("sum", lambda: 3, 3)

    def unsolved():
        raise NotImplementedError

    with pytest.raises(exercises.ExerciseNotDone, match="'todo' is not done yet"):
        exercises.check("todo", unsolved, 1)

    def wrapped():
        try:
            unsolved()
        except NotImplementedError as exc:
            raise RuntimeError("kernel failed") from exc

    with pytest.raises(exercises.ExerciseNotDone, match="'kernel' is not done yet"):
        exercises.check("kernel", wrapped, 1)
    with pytest.raises(exercises.ExerciseWrong, match="your code raised ZeroDivisionError") as caught:
        exercises.check("crash", lambda: 1 / 0, 1)  # a wrong attempt; the error stays as its cause
    assert isinstance(caught.value.__cause__, ZeroDivisionError)
    with pytest.raises(exercises.ExerciseWrong, match="'wrong' is not right yet"):
        exercises.check("wrong", lambda: torch.ones(3), torch.zeros(3))
    with pytest.raises(exercises.ExerciseWrong, match="shape"):
        exercises.check("shape", lambda: [1, 2], [1, 2, 3])
