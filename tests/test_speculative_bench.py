"""The speculative-decoding benchmark (course_lib.bench.speculative): its smoke run at tiny size on the CPU
(the record, its predictions and exactness), its place in `make bench`, and the shared command line."""

from __future__ import annotations

import pytest

import course_lib
from course_lib import records
from course_lib.bench import registry
from course_lib.bench import speculative as bench
from course_lib.bench.report import command_line

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.skipif(course_lib.ON_GPU, reason="the GPU run is `make bench BENCH=speculative` itself")
def test_quick_run_writes_the_record(tmp_path, capsys):
    assert bench.main(quick=True, out=tmp_path) == 0
    printed = capsys.readouterr().out
    data = records.load_record("speculative", folder=tmp_path)["data"]
    seen = {(r["method"], r["batch"]) for r in data["rows"]}
    for B in data["sizes"]["batches"]:
        for method in ("n-gram", "1-layer model", "first 1 of 2 layers"):
            assert (method, B) in seen, seen
    assert ("lookahead", 1) in seen and not any(m == "lookahead" and b > 1 for m, b in seen), seen
    for r in data["rows"]:
        assert r["exact"], r  # float32 on the CPU: the tokens of plain greedy decoding
        assert r["speedup"] == pytest.approx(r["spec_tokens_per_s"] / r["plain_tokens_per_s"], rel=1e-9)
        assert r["ratio_rounds"] == pytest.approx(r["speedup"] / r["predicted_rounds"])
        if r["method"] == "lookahead":
            continue
        assert r["t_verify_ms"] > 0 and r["t_draft_ms"] >= 0 and r["t_rollback_ms"] >= 0, r
        assert r["ratio_alpha"] == pytest.approx(r["speedup"] / r["predicted_alpha"])
        if r["batch"] == 1:  # one sequence: the rounds' prediction is tokens per round x t_step / t_round
            t_round = r["t_draft_ms"] + r["t_verify_ms"] + r["t_rollback_ms"]
            assert r["predicted_rounds"] == pytest.approx(r["tokens_per_round"] * r["t_step_ms"] / t_round)
    assert "| method | B | gamma |" in printed and "t_verify ms" in printed, printed


def test_cpu_figures_stay_out_of_assets(capsys):
    if course_lib.ON_GPU:
        pytest.skip("on a GPU, assets/benchmarks/ is where the record belongs")
    assert bench.main(quick=True, out=records.ASSETS) == 2
    assert "--out" in capsys.readouterr().out


def test_registered_for_make_bench_and_the_shared_command_line():
    assert "speculative" in registry.available() and registry.load("speculative") is bench
    got = command_line(lambda quick, out: (quick, out), "doc line\nmore", ["--quick", "--out", "/tmp/x"])
    assert got == (True, "/tmp/x")
    assert command_line(lambda quick, out: (quick, out), "doc", [])[0] is False
    # a module's own switch (speculative's --eager: no CUDA graphs), passed on as a keyword
    echo = lambda quick, out, eager: (quick, out, eager)
    flags = {"eager": "no CUDA graphs"}
    assert command_line(echo, "doc", ["--eager"], flags) == (False, str(records.ASSETS), True)
    assert command_line(echo, "doc", ["--quick"], flags) == (True, str(records.ASSETS), False)
