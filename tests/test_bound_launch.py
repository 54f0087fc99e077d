"""course_lib.kernels.bound: launches bound once per specialisation (notebook 08).

On the CPU: the key is at least as fine as Triton's own specialisation (two arguments with one key always
specialise a kernel alike), arguments of unknown kinds are not bound, and `launch` is `kernel[grid](...)`
under the interpreter. On a GPU: bound launches give the same results as Triton's, and under
COURSE_BOUND_LAUNCH=check every bound call is the kernel Triton would have run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from course_lib import runtime
from course_lib.kernels import bound
from course_lib.runtime import tl, triton

INTS = [0, 1, 2, 15, 16, 17, 32, 48, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**40 + 3]
INTS += [-(2**31), -(2**31) - 1, 2**63 - 16, 2**63, 2**64 - 16]


def _triton_specialize():
    from triton.runtime import jit

    fn = getattr(jit, "native_specialize_impl", None) or getattr(jit, "specialize_impl", None)
    if fn is None:
        pytest.skip("this Triton has no specialize_impl to compare with")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", 90, 32))
    return lambda value: fn(backend, value, False, True, True)


def test_integer_key_is_at_least_as_fine_as_triton():
    specialize = _triton_specialize()
    by_key = {}
    for value in INTS:
        by_key.setdefault(bound._runtime_key(value), set()).add(specialize(value))
    assert all(len(kinds) == 1 for kinds in by_key.values()), by_key
    assert len(by_key) >= 5  # 1, divisible by 16, neither, 64-bit, unsigned: told apart


def test_tensor_key_is_at_least_as_fine_as_triton():
    specialize = _triton_specialize()
    base = torch.zeros(64, dtype=torch.float32)
    cases = [
        base,
        base[1:],
        base[4:],
        torch.zeros(8, dtype=torch.bfloat16),
        torch.zeros(8, dtype=torch.bfloat16)[3:],
    ]
    by_key = {}
    for t in cases:
        by_key.setdefault(bound._runtime_key(t), set()).add(specialize(t))
    assert all(len(kinds) == 1 for kinds in by_key.values()), by_key
    assert bound._runtime_key(base) != bound._runtime_key(base[1:])  # alignment is part of the key


def test_floats_bools_and_none_key_by_kind():
    assert bound._runtime_key(0.5) is bound._runtime_key(2.0) is float
    assert bound._runtime_key(True) is bound._runtime_key(False) is bool
    assert bound._runtime_key(True) != bound._runtime_key(1)
    assert bound._runtime_key(None) is type(None)


def test_a_calls_key_tells_calls_apart_as_its_arguments_keys_do():
    """`_Signature.key` (tensors, integers and keyword constants written out, integers' keys looked up) puts two
    calls under one key exactly when every argument's `_runtime_key` or `_constant_key` agrees, keywords by name:
    never coarser than the per-argument keys (whose fineness the tests above check against Triton), and not
    finer. Random calls of the stand-in kernel (x, n, scale, out=None, BLOCK: constexpr, FLAG: constexpr)."""
    import random

    sig = bound._Signature(_Kernel())
    rng = random.Random(0)
    base = torch.zeros(64)
    tensors = [
        base,
        base[1:],
        base[4:],
        torch.zeros(8, dtype=torch.bfloat16),
        torch.nn.Parameter(torch.zeros(4)),
    ]
    runtime = [*tensors, *INTS[:8], 2**40, 0.5, 2.0, True, False, None]
    constants = [1, True, 1.0, 16, 32, "a", (1, 2), None]

    def reference(args, kwargs):
        key = [
            bound._constant_key(a) if sig.constant[i] else bound._runtime_key(a) for i, a in enumerate(args)
        ]
        return key, sorted(
            (
                name,
                bound._constant_key(v) if name in ("BLOCK", "FLAG", "num_warps") else bound._runtime_key(v),
            )
            for name, v in kwargs.items()
        )

    seen = {}
    for _ in range(3000):
        n_args = rng.choice((3, 4, 5, 6))
        args = [rng.choice(runtime) for _ in range(min(n_args, 4))] + [
            rng.choice(constants) for _ in range(n_args - 4)
        ]
        kwargs = {}
        for name in ("BLOCK", "FLAG")[n_args - 4 if n_args > 4 else 0 :]:
            if rng.random() < 0.5:
                kwargs[name] = rng.choice(constants)
        if n_args == 3 and rng.random() < 0.3:
            kwargs["out"] = rng.choice(runtime)  # a runtime argument by keyword
        if rng.random() < 0.5:
            kwargs["num_warps"] = rng.choice((4, 8, 4.0))
        try:
            key = sig.key(tuple(args), kwargs)
            hash(key)
        except TypeError:  # an unhashable constant: not bound (`_launch` sends the call through Triton)
            continue
        ref = repr(reference(args, kwargs))
        seen.setdefault(key, set()).add(ref)
    assert all(len(refs) == 1 for refs in seen.values())  # never coarser
    by_ref = {}
    for key, refs in seen.items():
        by_ref.setdefault(next(iter(refs)), set()).add(key)
    assert all(len(keys) == 1 for keys in by_ref.values())  # not finer (one call order of keywords here)
    assert len(seen) > 500


def test_an_empty_chain_of_hooks_is_no_hook():
    class Chain:
        calls = []

    assert not bound._hook_set(None) and not bound._hook_set(Chain())
    Chain.calls = [print]
    assert bound._hook_set(Chain()) and bound._hook_set(print)
    assert not bound._hooks_set()  # nothing installed in this process


def test_unknown_arguments_are_not_bound():
    with pytest.raises(bound._Unbound):
        bound._runtime_key("a string")
    with pytest.raises(bound._Unbound):
        bound._constant_key([1, 2])


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * factor, mask=mask)


def _scale(x, factor, block=64):
    out = torch.empty_like(x)
    bound.launch(_scale_kernel, (runtime.cdiv(x.numel(), block),), x, out, x.numel(), factor, BLOCK=block)
    return out


def test_launch_matches_the_plain_launch():
    """Through the interpreter (CPU) or bound (GPU): every call, first or repeated, computes its own result."""
    device = runtime.DEVICE
    for n in (100, 64, 100, 1, 100):
        x = torch.randn(n, device=device)
        for factor in (0.5, 3.0):
            torch.testing.assert_close(_scale(x, factor), x * factor, rtol=0, atol=0)
        torch.testing.assert_close(_scale(x[1:], 2.0), x[1:] * 2.0, rtol=0, atol=0)  # unaligned start


@pytest.mark.gpu
@pytest.mark.skipif(not runtime.ON_GPU, reason="binding happens on a GPU only")
def test_bound_calls_run_what_triton_would_run():
    """The kernels of a forward, a backward, decoding, RMSNorm and RoPE, twice each with new tensors and
    new lengths, in a process with COURSE_BOUND_LAUNCH=check: each bound call asks Triton which kernel it
    would run and fails if it is another."""
    code = """
import torch
from course_lib import flash_attention
from course_lib.decode import decode_attention
from course_lib.fused.api import rms_norm, rope
from course_lib.fused.rope import rope_cache
from course_lib.kernels import bound
assert bound.MODE == "check" and bound.ACTIVE
for n in (256, 300, 256, 1000):
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = (torch.randn(2, 4, n, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        for causal in (False, True):
            o = flash_attention(q, k, v, causal=causal)
            o.backward(torch.randn_like(o))
        qd = torch.randn(2, 1, 4, 64, device="cuda", dtype=dtype)
        kc, vc = (torch.randn(2, n, 2, 64, device="cuda", dtype=dtype) for _ in range(2))
        decode_attention(qd, kc, vc, torch.tensor([n, n // 2], device="cuda", dtype=torch.int32))
        x = torch.randn(3, n, 64, device="cuda", dtype=dtype)
        rms_norm(x, torch.ones(64, device="cuda", dtype=dtype))
        cos, sin = rope_cache(n, 64, device="cuda", dtype=dtype)
        qr, kr = (torch.randn(2, h, n, 64, device="cuda", dtype=dtype) for h in (4, 2))
        rope(qr, kr, cos, sin)
torch.cuda.synchronize()
print("bound", sum(len(s.entries) for s in bound._SIGNATURES.values()), "not bound", len(bound._NOT_BOUND))
print("not bound:", list(bound._NOT_BOUND.values()), "calls not keyed:", bound.UNBOUND_CALLS)
"""
    env = dict(os.environ, COURSE_BOUND_LAUNCH="check")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "not bound 0" in done.stdout and "calls not keyed: {}" in done.stdout, done.stdout


def test_a_tma_descriptor_keys_and_hashes():
    """Gluon's host-side TMA descriptor: keyed by dtype, alignment, shape, strides, block and layout (whose
    object may hold a list, so it is keyed by its text), and the key hashes."""
    hopper = pytest.importorskip("course_lib.attention.hopper")
    q = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16)
    a, b = hopper.descriptor(q, 64), hopper.descriptor(q.clone(), 64)
    assert hash(bound._runtime_key(a)) == hash(bound._runtime_key(b))
    assert bound._runtime_key(a) != bound._runtime_key(hopper.descriptor(q, 128))  # another block


# ---------------------------------------------------------------- the binding itself, with a stand-in kernel
class _Param:
    def __init__(self, name, constexpr):
        self.name, self.is_constexpr = name, constexpr


class _Compiled:
    """A compiled kernel's stand-in: records what its launcher receives."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.launches = []

    def run(self, *launch):
        self.launches.append(launch)


class _Kernel:
    """A JITFunction's stand-in with the signature (x, n, scale, out=None, BLOCK: constexpr, FLAG: constexpr)
    and Triton's specialisation of its runtime arguments: the slow path (`kernel[grid](...)`) returns the
    compiled kernel of that specialisation, as Triton's run does."""

    __name__ = "stand_in"

    def __init__(self, binder_fails=False):
        self.params = [
            _Param(n, c) for n, c in (("x", 0), ("n", 0), ("scale", 0), ("out", 0), ("BLOCK", 1), ("FLAG", 1))
        ]
        self.slow, self.compiled, self.binder_fails = [], {}, binder_fails
        self.device_caches = {0: ({}, {}, None, None, self.binder)}

    @staticmethod
    def bind(x, n, scale, out=None, BLOCK=16, FLAG=False, **options):
        return dict(x=x, n=n, scale=scale, out=out, BLOCK=BLOCK, FLAG=FLAG), None, options

    def binder(self, *args, **kwargs):  # what `bound` reads from Triton's caches
        if self.binder_fails:
            raise AttributeError("another Triton")
        return self.bind(*args, **kwargs)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.slow.append(grid)  # not the arguments: the test checks that no tensor is kept
            bound_args = self.bind(*args, **kwargs)[0]
            spec = tuple(
                (t.dtype, t.data_ptr() % 16 == 0)
                if isinstance(t, torch.Tensor)
                else (t == 1, t % 16 == 0)
                if isinstance(t, int)
                else type(t).__name__
                for t in (bound_args["x"], bound_args["n"])
            ) + (repr(bound_args["BLOCK"]), bound_args["FLAG"], kwargs.get("num_warps"))
            return self.compiled.setdefault(spec, _Compiled())

        return run


class _Pointer:
    """What Triton takes as a pointer besides a tensor: any object with data_ptr() (and a dtype)."""

    dtype = torch.float32

    def data_ptr(self):
        return 1024


@pytest.fixture
def binding(monkeypatch):
    """`bound.launch` taking its GPU path on this machine, with fresh tables."""
    monkeypatch.setattr(bound, "ACTIVE", True)
    monkeypatch.setattr(bound, "_current_stream", lambda device: 7)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for table in ("_SIGNATURES", "_NOT_BOUND", "UNBOUND_CALLS"):
        monkeypatch.setattr(bound, table, {})
    return bound


def test_a_repeated_call_goes_to_the_launcher_with_its_own_arguments(binding):
    kernel = _Kernel()
    x1, x2, out = torch.zeros(32), torch.ones(32), torch.zeros(32)
    binding.launch(kernel, (4,), x1, 64, 0.5, out, BLOCK=32, num_warps=4)
    assert len(kernel.slow) == 1  # first of its kind: through Triton, which compiles it
    binding.launch(kernel, (6, 2), x2, 96, 2.0, out, BLOCK=32, num_warps=4)  # 96: divisible by 16 too
    assert len(kernel.slow) == 1
    (compiled,) = kernel.compiled.values()
    (launch,) = compiled.launches
    assert launch[:9] == (6, 2, 1, 7, "function", "metadata", None, None, None)
    assert launch[9] is x2 and launch[10:] == (96, 2.0, out, 32, False)  # the defaults filled in
    binding.launch(kernel, (4,), x2[1:], 96, 2.0, out, BLOCK=32, num_warps=4)  # another alignment
    binding.launch(kernel, (4,), x2, 1, 2.0, out, BLOCK=32, num_warps=4)  # n == 1: Triton specialises it
    binding.launch(kernel, (4,), x2, 96, 2.0, out, BLOCK=64, num_warps=4)  # another constant
    binding.launch(kernel, (4,), x2, 96, 2.0, out, BLOCK=32, num_warps=8)  # another launch option
    assert len(kernel.slow) == 5 and len(compiled.launches) == 1
    for flag in (False, False, 0):  # 0 == False in Python, not to Triton's cache: a kind of its own
        binding.launch(kernel, (4,), x2, 96, 2.0, out, BLOCK=32, FLAG=flag, num_warps=4)
    assert len(kernel.slow) == 7 and len(compiled.launches) == 2


def test_a_keyword_argument_lands_in_its_slot_and_no_tensor_is_kept(binding):
    import gc
    import weakref

    kernel = _Kernel()
    first = torch.zeros(32)
    alive = weakref.ref(first)
    binding.launch(kernel, (1,), first, 16, 1.0, out=first, FLAG=True)
    second, out2 = torch.ones(32), torch.full((32,), 3.0)
    binding.launch(kernel, (1,), second, 32, 1.0, out=out2, FLAG=True)
    (compiled,) = kernel.compiled.values()
    launch = compiled.launches[0]
    assert launch[9] is second and launch[12] is out2 and launch[13:] == (16, True)
    del first
    gc.collect()
    assert alive() is None  # the bound entry holds no tensor of the call that made it


def test_what_cannot_be_keyed_or_bound_goes_through_triton(binding):
    kernel = _Kernel()
    x = torch.zeros(32)
    for _ in range(2):
        binding.launch(kernel, (1,), x, 16, 1.0, BLOCK=[16])  # an unhashable constant
        binding.launch(kernel, (1,), _Pointer(), 16, 1.0)  # a pointer Triton takes, of no kind keyed here
        binding.launch(kernel, lambda meta: (1,), x, 16, 1.0)  # a grid of the constants
    assert len(kernel.slow) == 6 and not any(c.launches for c in kernel.compiled.values())
    assert sum(binding.UNBOUND_CALLS.values()) == 4
    broken = _Kernel(binder_fails=True)
    for _ in range(3):
        binding.launch(broken, (1,), x, 16, 1.0)
    assert len(broken.slow) == 3 and id(broken) in binding._NOT_BOUND


def test_a_table_entry_never_serves_another_kernel_at_the_same_address(binding):
    """The tables are keyed by id(kernel); an entry made for one kernel object (here planted under another's
    id, as a freed kernel's address could be reused) is not taken for it."""
    old, new = _Kernel(), _Kernel()
    x = torch.zeros(32)
    binding.launch(old, (1,), x, 16, 1.0)
    binding._SIGNATURES[id(new)] = binding._SIGNATURES[id(old)]
    binding.launch(new, (1,), x, 16, 1.0)
    binding.launch(new, (1,), x, 16, 1.0)
    assert len(new.slow) == 1 and sum(len(c.launches) for c in new.compiled.values()) == 1
    assert not any(c.launches for c in old.compiled.values())
