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
    with pytest.raises(exercises.ExerciseWrong, match="Hint 2 of 2: the formula"):
        exercises.check("hinted", lambda: 3, 1, hints=hints)
    exercises.check("hinted", lambda: 1, 1, hints=hints)


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
