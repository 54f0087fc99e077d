"""Tests of course_lib.attention.launch's choice of a launch configuration (CPU: the GPU's record is
stubbed), of the recorded H200 choices' keys, and of kernels compiled ahead in the background."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import course_lib
from course_lib import runtime
from course_lib.attention import configs, launch
from course_lib.attention.configs import Launch


@pytest.fixture
def record(monkeypatch):
    """A stand-in GPU record (multi-head dK/dV and dQ entries) and a fresh per-process memory."""
    rec = {
        "dkdv": {
            "4096/128/True/bfloat16/False/1": [32, 128, 4, 2],  # not the rule: the test can tell
            "4096/128/True/bfloat16/True/1": [64, 128, 8, 2],
            "4096/64/True/bfloat16/False/8": [32, 64, 4, 3],
        },
        "dq": {"4096/128/True/bfloat16": [128, 64, 8, 3]},
    }
    monkeypatch.setattr(launch, "tuned_record", lambda: rec)
    monkeypatch.setattr(launch, "CHOSEN", {})
    monkeypatch.setattr(launch, "autotune_enabled", lambda: False)
    return rec


def _rule(table, shape):
    n, d, causal, dtype = shape[:4]
    return table.choose(d, causal, n, dtype, runtime.INTERPRET)


def test_recorded_choice_is_used(record):
    shape = (4096, 128, True, torch.bfloat16)
    assert launch.shape_key(shape) == "4096/128/True/bfloat16"
    assert launch.chosen(configs.DQ, shape) == Launch(128, 64, 8, 3), "dq: the recorded choice"
    assert launch.chosen(configs.DKDV, shape + (False, 1)) == Launch(32, 128, 4, 2), "dkdv, group 1"


@pytest.mark.parametrize("atomic,group", [(False, 4), (False, 8), (True, 2)])
def test_grouped_query_falls_back_to_group_one(record, atomic, group):
    """A grouped-query dK/dV shape with no entry of its own takes its group-1 twin's recorded choice
    (same bucket, d, causal, dtype and dQ mode) before the table's rule."""
    shape = (4096, 128, True, torch.bfloat16, atomic, group)
    want = Launch(*record["dkdv"][f"4096/128/True/bfloat16/{atomic}/1"])
    got = launch.chosen(configs.DKDV, shape)
    assert got == want, f"dkdv {shape}: got {got}, want the group-1 record {want}"


def test_own_record_beats_group_one_and_rule_is_last(record):
    own = (4096, 64, True, torch.bfloat16, False, 8)
    assert launch.chosen(configs.DKDV, own) == Launch(32, 64, 4, 3), "a grouped shape's own record first"
    no_twin = (2048, 64, False, torch.bfloat16, False, 4)  # no group-1 entry either: the rule
    assert launch.chosen(configs.DKDV, no_twin) == _rule(configs.DKDV, no_twin)
    # the fallback is the dK/dV kernel's only: other kernels' keys end in no group size
    other = (2048, 128, True, torch.bfloat16)
    assert launch.chosen(configs.DQ, other) == _rule(configs.DQ, other)


def test_trying_a_candidate_then_restoring(record):
    """`launch.trying` (a sweep's candidate) holds for its block only: before it, and after it, the
    process launches what it chose (or would choose) without it."""
    shape = (4096, 128, True, torch.bfloat16, False, 1)
    candidate = Launch(64, 64, 4, 3)
    with launch.trying(configs.DKDV, shape, candidate):
        assert launch.chosen(configs.DKDV, shape) == candidate
    assert launch.chosen(configs.DKDV, shape) == Launch(32, 128, 4, 2), "the record again"
    with launch.trying(configs.DKDV, shape, candidate):
        assert launch.chosen(configs.DKDV, shape) == candidate
    assert launch.chosen(configs.DKDV, shape) == Launch(32, 128, 4, 2), "the process's own choice again"


def test_h200_record_keys():
    """Every recorded key names a shape class of today's kernels: (bucket, d, causal, dtype) and, for
    dK/dV, (atomic, group); every choice is a well-formed launch."""
    record = json.loads((launch.TUNED_DIR / "nvidia-h200.json").read_text())
    assert set(record) == {"forward", "dq", "dkdv"}, sorted(record)
    for kernel, choices in record.items():
        for key, choice in choices.items():
            fields = key.split("/")
            assert len(fields) == (6 if kernel == "dkdv" else 4), f"{kernel}: key {key!r}"
            n, d, causal, dtype = fields[:4]
            assert int(n) == launch.n_bucket(int(n)) and int(d) in (64, 128), f"{kernel}: {key!r}"
            assert causal in ("True", "False") and hasattr(torch, dtype), f"{kernel}: {key!r}"
            if kernel == "dkdv":
                assert fields[4] in ("True", "False") and int(fields[5]) >= 1, f"{kernel}: {key!r}"
            block_m, block_n, warps, stages = choice
            assert min(block_m, block_n) >= 16 and warps in (4, 8) and stages >= 1, (
                f"{kernel} {key}: {choice}"
            )


def test_background_compilation_finishes_before_exit(tmp_path):
    """A compilation started ahead (`launch.compile_in_background`) that is still running when the
    script ends is waited for, not stopped inside the compiler (which aborts the process); and
    `wait_compiled` joins it before a launch."""
    done = tmp_path / "done.txt"
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from course_lib.attention import launch
        out = Path({str(done)!r})
        launch.compile_in_background(("test", 1), lambda: (time.sleep(0.5), out.write_text("done")))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert done.read_text() == "done", "the process ended before the background work did"

    seen = []
    launch.compile_in_background(("test", 2), lambda: seen.append(1))
    launch.wait_compiled(("test", 2))
    assert seen == [1] and ("test", 2) not in launch.COMPILING


@pytest.mark.gpu
@pytest.mark.skipif(not course_lib.ON_GPU, reason="needs a CUDA GPU")
def test_compiled_ahead_kernel_is_loaded_in_the_background(tmp_path, monkeypatch):
    """A kernel compiled ahead (`launch.compile_kernel_ahead`) comes back with its launcher built and
    its binary loaded on the GPU (`launch.load_compiled`), so its first launch does neither, and that
    launch computes the right result."""
    from course_lib.attention import launch
    from course_lib.runtime import tl, triton

    @triton.jit
    def add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)

    loaded = []
    real = launch.load_compiled
    monkeypatch.setattr(launch, "load_compiled", lambda compiled: (real(compiled), loaded.append(compiled)))
    x = torch.randn(1000, device="cuda")
    y = torch.empty_like(x)
    name = ("test load ahead", tmp_path.name)
    launch.compile_kernel_ahead(name, add_one, (4,), (x, y, x.numel()), {"BLOCK": 256})
    launch.wait_compiled(name)
    assert len(loaded) == 1 and loaded[0].module is not None, "the compiled kernel was not loaded ahead"
    add_one[(4,)](x, y, x.numel(), BLOCK=256)
    assert torch.equal(y, x + 1.0)
