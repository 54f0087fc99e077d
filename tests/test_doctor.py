"""course_lib.doctor: `python -m course_lib doctor` exits 0 and names the mode; known-bad version
combinations are flagged with a fix."""

import subprocess
import sys

import course_lib
from course_lib import doctor, runtime


def test_doctor_command_exits_zero_and_names_the_mode():
    out = subprocess.run(
        [sys.executable, "-m", "course_lib", "doctor"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "triton interpreted" in out.stdout
    assert ("yes" if course_lib.INTERPRET else "no") in out.stdout.split("triton interpreted")[
        1
    ].splitlines()[0]
    assert "All good" in out.stdout


def test_doctor_flags_old_triton_with_new_numpy(monkeypatch):
    monkeypatch.setattr(runtime.triton, "__version__", "3.6.0")
    monkeypatch.setattr(doctor.np, "__version__", "2.4.1")
    monkeypatch.setattr(runtime, "INTERPRET", True)
    found = doctor.problems()
    assert any("numpy" in p and "triton" in p and "Fix" in p for p in found), found


def test_doctor_flags_mismatched_torch_triton(monkeypatch):
    monkeypatch.setattr(doctor, "torch_triton_requirement", lambda: "3.9.0")
    monkeypatch.setattr(runtime.triton, "__version__", "3.7.1")
    assert any("built for triton 3.9.0" in p for p in doctor.problems())
