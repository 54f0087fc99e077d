"""On a machine without a GPU: every course kernel, as the CPU tests launch it, also compiles for a
Hopper GPU (`course_lib.tools.compile_check`), and the check catches a kernel that the interpreter
runs but the compiler refuses."""

import importlib
import sys
import textwrap

import pytest
import torch

from course_lib import runtime

pytestmark = pytest.mark.skipif(
    not runtime.INTERPRET, reason="kernels are compiled here already: the GPU tests run them"
)

# The interpreter runs this; Triton's compiler does not: `even` is computed from compile-time constants
# but is no constant itself, so both branches are compiled and `mask` is undefined in the second.
INTERPRETER_ONLY = """
import course_lib  # noqa: F401  (the interpreter decision before the kernel is defined)
import triton
import triton.language as tl


@triton.jit
def masked_copy_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    even = EVEN and BLOCK > 0
    if even:
        x = tl.load(x_ptr + offs)
    else:
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
    if even:
        tl.store(out_ptr + offs, x)
    else:
        tl.store(out_ptr + offs, x, mask=mask)
"""


def test_the_check_catches_what_only_the_interpreter_accepts(tmp_path, monkeypatch):
    from course_lib.tools.compile_check import compile_in_fresh_process, recorded_launches

    (tmp_path / "interpreter_only.py").write_text(textwrap.dedent(INTERPRETER_ONLY))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("interpreter_only")
    try:
        x, out = torch.randn(16), torch.empty(16)
        with recorded_launches() as launches:
            module.masked_copy_kernel[(1,)](x, out, 16, BLOCK=16, EVEN=True)
        assert torch.equal(out, x)  # the interpreter ran it
        assert [(launch.name, dict(launch.constants)) for launch in launches] == [
            ("masked_copy_kernel", {"BLOCK": 16, "EVEN": True})
        ]
        failures = compile_in_fresh_process(launches, paths=(str(tmp_path),))
    finally:
        sys.modules.pop("interpreter_only", None)
    assert len(failures) == 1
    assert "CompilationError" in failures[0][1] and "mask" in failures[0][1]


def test_every_course_kernel_compiles_for_hopper():
    from course_lib.tools.compile_check import check, kernels_defined

    launches, failures = check()
    report = "\n".join(f"{launch.describe()}\n  {error[:2000]}" for launch, error in failures)
    assert not failures, f"{len(failures)} of {len(launches)} launches do not compile:\n{report}"
    launched = {(launch.module, launch.name) for launch in launches}
    missing = kernels_defined() - launched
    assert not missing, f"the compile check's workload never launches {sorted(missing)}: add a call"
    # variants: dtypes (bf16 also in its GPU form), causal alignments, dW modes, RoPE layouts, ...
    assert len(launches) >= 40
