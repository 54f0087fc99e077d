"""The runtime decision (course_lib.runtime): the device and the interpreter chosen before any kernel is
defined, kernels that run whatever the import order, bf16 casts as PyTorch rounds them, what imports
without Triton, and the worker counts for compiling and for the GPU tests."""

import os
import subprocess
import sys

import pytest
import torch

import course_lib
from course_lib import runtime


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
