"""The runtime decision, the doctor, recorded figures, exercises and timing helpers."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import course_lib
from course_lib import doctor, exercises, records, runtime
from course_lib.perf import timing


def run_python(code, **env):
    full_env = {k: v for k, v in os.environ.items() if k not in ("COURSE_DEVICE", "TRITON_INTERPRET")}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120
    )


def python_prints(code, what="", **env) -> list[str]:
    """The words `code` prints in a fresh process with `env`, after checking that it exited cleanly."""
    out = run_python(code, **env)
    assert out.returncode == 0, f"{what}: {out.stderr[-2000:]}"
    return out.stdout.split()


def test_decision_is_consistent():
    assert course_lib.DEVICE == runtime.RUNTIME.device
    assert course_lib.INTERPRET == (course_lib.DEVICE.type == "cpu")
    assert course_lib.pick(cpu=1, gpu=2) == (2 if course_lib.ON_GPU else 1)
    if course_lib.INTERPRET:
        assert os.environ.get("TRITON_INTERPRET") == "1"


def test_forced_cpu_sets_interpreter_before_kernels_are_defined():
    code = (
        "import course_lib, os; from course_lib import primer; "
        "print(course_lib.INTERPRET, os.environ['TRITON_INTERPRET'], type(primer.add_kernel).__name__)"
    )
    assert python_prints(code, COURSE_DEVICE="cpu")[:2] == ["True", "1"]


def test_bad_course_device_value_is_named():
    out = run_python("import course_lib", COURSE_DEVICE="tpu")
    assert out.returncode != 0 and "COURSE_DEVICE must be 'cpu' or 'cuda'" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown on a machine without a GPU")
def test_forcing_cuda_without_gpu_explains():
    out = run_python("import course_lib", COURSE_DEVICE="cuda")
    assert out.returncode != 0 and "sees no CUDA GPU" in out.stderr


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
    monkeypatch.setattr(doctor, "_torch_triton_requirement", lambda: "3.9.0")
    monkeypatch.setattr(runtime.triton, "__version__", "3.7.1")
    assert any("built for triton 3.9.0" in p for p in doctor.problems())


def test_records_round_trip(tmp_path):
    path = records.save_record("demo", {"x": [1, 2]}, folder=tmp_path)
    rec = json.loads(path.read_text())
    assert rec["kind"] == "demo" and rec["data"] == {"x": [1, 2]}
    for key in ("date", "torch", "triton", "gpu"):
        assert key in rec["meta"]
    assert records.load_record("demo", folder=tmp_path)["data"]["x"] == [1, 2]
    assert records.load_record("absent", folder=tmp_path) is None
    assert "recorded on" in records.label(rec)
    # a file that is not a record is named, not a bare JSONDecodeError or KeyError from every load
    (tmp_path / "demo-broken.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"demo-broken\.json is not a record of course_lib"):
        records.load_record("demo", folder=tmp_path)
    (tmp_path / "demo-broken.json").write_text('{"kind": "demo", "data": {}}')
    with pytest.raises(ValueError, match=r"demo-broken\.json is not a record .*KeyError"):
        records.load_record("demo", folder=tmp_path)
    if not course_lib.ON_GPU:
        with pytest.raises(ValueError, match="measure_here=True needs a GPU"):
            records.measured_or_recorded("demo", lambda: {"x": 1}, "none", folder=tmp_path, measure_here=True)


def test_records_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_RECORDS", "off")
    assert records.save_record("demo", {"x": [1]}, folder=tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_measured_or_recorded_shows_the_record_on_the_cpu(tmp_path, capsys):
    if course_lib.ON_GPU:
        pytest.skip("the CPU path")

    def measure():
        raise AssertionError("measure() must not run on the CPU")

    assert records.measured_or_recorded("demo", measure, "no record yet", folder=tmp_path) is None
    assert "no record yet" in capsys.readouterr().out
    records.save_record("demo", {"x": [1, 2]}, folder=tmp_path)
    data, source = records.measured_or_recorded("demo", measure, "no record yet", folder=tmp_path)
    assert data == {"x": [1, 2]} and source.startswith("recorded on"), (data, source)
    with pytest.raises(TypeError, match="measure"):
        records.measured_or_recorded("demo", {"x": 1}, "", folder=tmp_path)
    with pytest.raises(ValueError, match="kind"):
        records.measured_or_recorded("", measure, "", folder=tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not course_lib.ON_GPU, reason="needs a CUDA GPU")
def test_measured_or_recorded_measures_and_saves_on_a_gpu(tmp_path, monkeypatch):
    monkeypatch.delenv("COURSE_RECORDS", raising=False)
    data, source = records.measured_or_recorded("demo", lambda: {"x": [3]}, "unused", folder=tmp_path)
    assert data == {"x": [3]} and source.startswith("measured now on"), source
    assert records.load_record("demo", folder=tmp_path)["data"] == {"x": [3]}


def test_measured_or_recorded_measure_here_false_shows_the_record(tmp_path, capsys):
    """measure_here=False (a figure this GPU cannot measure) shows the record on any machine."""

    def measure():
        raise AssertionError("measure() must not run with measure_here=False")

    got = records.measured_or_recorded("demo", measure, "no record yet", folder=tmp_path, measure_here=False)
    assert got is None and "no record yet" in capsys.readouterr().out
    records.save_record("demo", {"x": [4]}, folder=tmp_path)
    data, source = records.measured_or_recorded("demo", measure, "", folder=tmp_path, measure_here=False)
    assert data == {"x": [4]} and source.startswith("recorded on"), (data, source)


def test_committed_records_are_stamped():
    for path in records.ASSETS.glob("*.json"):
        meta = json.loads(path.read_text())["meta"]
        assert meta.get("gpu") and meta.get("date") and meta.get("torch"), f"{path.name}: incomplete stamp"


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


def test_timing_and_flops():
    assert timing.benchmark(lambda: torch.randn(64, 64) @ torch.randn(64, 64)) > 0
    if not course_lib.ON_GPU:  # the CPU timer's unit: a 2 ms sleep reads as 2 ms, not 2e-3 or 2000
        slept = timing.benchmark(lambda: time.sleep(0.002), cpu_reps=3)
        assert 2.0 <= slept < 50.0, slept
    assert timing.attention_flops(1, 1, 128, 128, 64) == 4 * 128 * 128 * 64
    assert (
        timing.attention_flops(2, 4, 128, 128, 64, causal=True, mode="fwd_bwd")
        == 3.5 * 0.5 * 4 * 8 * 128**2 * 64
    )
    with pytest.raises(ValueError, match="mode"):
        timing.attention_flops(1, 1, 8, 8, 8, mode="sideways")
    with pytest.raises(ValueError, match="Nq = Nk only"):  # top-left 1 x 1024 sees 1 key, bottom-right all
        timing.attention_flops(1, 1, 1, 1024, 64, causal=True)


def test_interleaved_timings_put_each_call_first_in_turn():
    order = []

    def timer(fn):
        order.append(fn())
        return float(len(order))

    calls = {name: (lambda name=name: name) for name in "abc"}
    times = timing.interleaved(calls, 4, timer)
    assert "".join(order) == "abc" + "bca" + "cab" + "abc", order  # each pass starts one call later
    assert times == {"a": [1.0, 6.0, 8.0, 10.0], "b": [2.0, 4.0, 9.0, 11.0], "c": [3.0, 5.0, 7.0, 12.0]}
    real = timing.interleaved({"matmul": lambda: torch.randn(8, 8) @ torch.randn(8, 8)}, 2)  # benchmark
    assert len(real["matmul"]) == 2 and min(real["matmul"]) > 0, real
    with pytest.raises(ValueError, match="passes"):
        timing.interleaved(calls, 0, timer)
    for bad in ({}, {"a": 1}):
        with pytest.raises(TypeError, match="functions"):
            timing.interleaved(bad, 1, timer)


IMPORT_ORDERS = {
    "course_lib first": "import course_lib, torch, triton",
    "torch and triton first": "import torch, triton\nimport course_lib",
    "triton.language first": "import triton.language as tl, torch\nimport course_lib",
}

KERNELS_RUN = """
from course_lib import primer
from course_lib.testing import max_error, reference_outputs
x, y = torch.randn(300), torch.randn(300)
assert torch.equal(primer.add(x, y, block_size=128), x + y), "primer.add"
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 32, 16, requires_grad=True) for _ in range(3))
do = torch.randn(1, 2, 32, 16)
o = course_lib.flash_attention(q, k, v, causal=True)
o.backward(do)
# Float64 autograd of the reference attention; float32 kernels land within ~1e-6 of it.
o64, grads64 = reference_outputs(q.double(), k.double(), v.double(), causal=True, grad_out=do.double())
for name, got, want in zip(("O", "dQ", "dK", "dV"), (o, q.grad, k.grad, v.grad), (o64, *grads64)):
    err = max_error(got, want)
    assert err <= 1e-5, f"flash_attention {name}: max error {err:.3g} against float64"
print("ok", course_lib.INTERPRET)
"""


# These run the interpreted (CPU) kernels in a fresh process: what a laptop learner does. On a GPU machine
# its Triton may not interpret them at all (triton 3.6 with numpy >= 2.4: triton#9171).
cpu_only = pytest.mark.skipif(
    course_lib.ON_GPU, reason="the CPU interpreter's import order; GPU runs compile"
)


@cpu_only
@pytest.mark.parametrize("order", list(IMPORT_ORDERS))
def test_kernels_run_whatever_the_import_order(order):
    """Issue 14, point 1: triton imported before course_lib must not break the interpreted kernels."""
    assert python_prints(IMPORT_ORDERS[order] + KERNELS_RUN, order, COURSE_DEVICE="cpu") == ["ok", "True"]


@cpu_only
def test_kernels_run_after_importing_transformers_first():
    pytest.importorskip("transformers")
    code = "import transformers, torch\nimport course_lib" + KERNELS_RUN
    assert python_prints(code, "transformers first", COURSE_DEVICE="cpu") == ["ok", "True"]


def test_triton_helpers_are_interpreted_after_a_late_import():
    code = (
        "import triton, triton.language as tl\n"
        "import course_lib\n"
        "from triton.runtime.interpreter import InterpretedFunction\n"
        "print(course_lib.runtime.TRITON_HELPERS_REINTERPRETED > 0,"
        " isinstance(tl.cdiv, InterpretedFunction), tl.cdiv is tl.standard.cdiv)"
    )
    assert python_prints(code, COURSE_DEVICE="cpu") == ["True", "True", "True"]


def test_compile_workers_leaves_two_cpus_and_keeps_the_limit():
    from course_lib import runtime

    assert runtime.compile_workers(1) == 1
    assert runtime.compile_workers(64) == max(1, (os.cpu_count() or 2) - 2)
    assert 1 <= runtime.compile_workers(8) <= 8


def test_bfloat16_casts_round_to_nearest_even_as_pytorch_does():
    """A kernel's fp32 -> bf16 cast gives PyTorch's `.to(torch.bfloat16)` bit for bit, compiled and
    interpreted (the interpreter alone would drop the low bits: `runtime._round_bf16_casts_to_nearest`)."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast_kernel(X, Y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + offs, tl.load(X + offs, mask=offs < n).to(tl.bfloat16), mask=offs < n)

    g = torch.Generator().manual_seed(7)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 14,), generator=g, dtype=torch.int64).to(torch.int32)
    ties = (bits & ~0xFFFF) | 0x8000  # exactly halfway between two bf16 values: ties go to the even one
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3.4e38, -3.4e38, 1e-40])
    x = torch.cat([bits.view(torch.float32), ties.view(torch.float32), specials]).to(course_lib.DEVICE)
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    cast_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    expected = x.to(torch.bfloat16)
    same = (y.view(torch.int16) == expected.view(torch.int16)) | (y.isnan() & expected.isnan())
    assert bool(same.all()), (
        f"{int((~same).sum())} of {x.numel()} casts differ from PyTorch's, e.g. {x[~same][:4]}"
    )
    if course_lib.INTERPRET:
        assert runtime.BF16_ROUNDS_TO_NEAREST


def test_pure_pytorch_parts_import_without_triton():
    """As on macOS or Windows (no Triton wheels): what notebooks 01-04b use imports and runs, and a Triton
    kernel asked for says why it cannot run."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, course_lib\n"
        "from course_lib import perf, softmax, testing\n"
        "from course_lib.perf import plotting, profiling, timing\n"
        "from course_lib.attention import FlashAttentionTorch, animate, reference, tiled, tiles\n"
        "q, k, v = (torch.randn(1, 2, 40, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))\n"
        "FlashAttentionTorch.apply(q, k, v, True).sum().backward()\n"
        "try:\n"
        "    course_lib.flash_attention(q, k, v)\n"
        "except RuntimeError as exc:\n"
        "    print('refused:', 'Linux wheels only' in str(exc))\n"
    )
    assert python_prints(code, "no Triton", COURSE_DEVICE="cpu") == ["refused:", "True"]


def test_triton_driver_prepared_at_import_on_a_gpu_only():
    """On a GPU, importing course_lib starts building Triton's driver in a background thread (so the
    first kernel does not wait for its C utilities); under the interpreter nothing is started."""
    thread = runtime.TRITON_DRIVER_THREAD
    if runtime.INTERPRET or runtime.triton is None:
        assert thread is None
        return
    thread.join(timeout=120)
    assert not thread.is_alive(), "the driver's build did not finish in 120 s"
    assert runtime.triton.runtime.driver.active.get_current_target().backend == "cuda"


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


@pytest.mark.parametrize(
    "gib,cpus,expected", [(79.2, 16, 6), (139.8, 16, 11), (23.6, 16, 1), (79.2, 4, 2), (4.0, 16, 1)]
)
def test_gpu_test_workers_fit_the_gpus_memory(monkeypatch, gib, cpus, expected):
    """make test-gpu's worker count: the CPUs less two (at most 14), and at most one per 12 GiB of GPU
    memory (14 workers ran an 80 GB H100 out of memory, and once a 141 GB H200)."""
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    props = type("Props", (), {"total_memory": int(gib * 2**30)})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)
    assert runtime.gpu_test_workers() == expected, f"{gib} GiB, {cpus} CPUs"


def test_next_power_of_2_matches_triton():
    from course_lib.runtime import next_power_of_2, triton

    for n in list(range(0, 300)) + [1000, 4095, 4096, 4097, 2**20 + 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
