"""Plans (`course_lib.attention.plans`): a call seen before repeats its launches without deciding again, and
gives exactly what the full path gives; anything that changes a decision gets a plan of its own, or none.
CPU (the interpreter runs a plan's launches) and GPU (the bound launcher)."""

import dataclasses

import pytest
import torch

import course_lib
from course_lib import flash_attention
from course_lib.attention import launch, plans
from course_lib.attention.configs import FORWARD
from course_lib.attention.forward import ForwardPlan
from course_lib.attention.reference import attention as reference
from course_lib.kernels import bound
from course_lib.kernels import plans as kernel_plans

DEVICE = course_lib.DEVICE
DTYPE = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16
TOL = 2e-5 if DTYPE == torch.float32 else 2e-2


def _inputs(q_shape, kv_shape, grad=True):
    make = lambda shape: torch.randn(*shape, device=DEVICE, dtype=DTYPE).requires_grad_(grad)  # noqa: E731
    return make(q_shape), make(kv_shape), make(kv_shape)


def _run(q, k, v, do, causal, window=None):
    """(O, dq, dk, dv) of one call through autograd, and O of one under no_grad, from fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = flash_attention(*leaves, causal=causal, window=window)
    grads = torch.autograd.grad(o, leaves, do)
    with torch.no_grad():
        o_inference = flash_attention(*leaves, causal=causal, window=window)
    return (o.detach(), o_inference, *grads)


CASES = [
    ((1, 4, 40, 32), (1, 2, 56, 32), "bottom_right"),  # GQA, Nq != Nk
    ((2, 3, 24, 16), (2, 3, 24, 16), True),
    ((2, 33, 32), (2, 20, 32), False),  # 3-D (batch, N, d): viewed as 4-D in the plan too
    ((2, 1, 3, 17, 16), (2, 1, 3, 9, 16), "top_left"),  # 5-D: leading dims merged
]


@pytest.mark.parametrize("q_shape, kv_shape, causal", CASES)
def test_a_repeated_call_runs_its_plan_and_matches_the_full_path(q_shape, kv_shape, causal):
    q, k, v = _inputs(q_shape, kv_shape)
    do = torch.randn(q_shape, device=DEVICE, dtype=DTYPE)
    first = _run(q, k, v, do, causal)  # the full path, which leaves the plans
    plan = plans.FORWARD[plans.call_key(q, k, v, causal, None, None, None)]
    assert len(plan.backward) == 1
    ran = []
    real_run = type(plan).run
    plan_type = type(plan)
    plan_type.run = lambda self, *a: ran.append(1) or real_run(self, *a)
    try:
        again = _run(q, k, v, do, causal)
    finally:
        plan_type.run = real_run
    assert len(ran) == 2  # the autograd forward and the no_grad one
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64 = reference(q64, k64, v64, causal=causal)
    grads64 = torch.autograd.grad(o64, (q64, k64, v64), do.double())
    for got, want in zip(again, (o64, o64, *grads64)):
        assert (got.double() - want).abs().max().item() < TOL * max(1.0, want.abs().max().item())


def test_each_kind_of_call_gets_its_own_plan():
    q, k, v = _inputs((1, 2, 32, 16), (1, 2, 32, 16), grad=False)
    with torch.no_grad():
        flash_attention(q, k, v, causal=True)
        flash_attention(q, k, v, causal=False)
        flash_attention(q, k, v, causal=True, scale=0.5)
        flash_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, causal=True)  # other strides
        flash_attention(q[..., :8, :], k, v, causal=True)  # another Nq
        flash_attention(q, k, v, causal=1)  # 1 is not True to the key (it is refused or taken on its own)
    assert len(plans.FORWARD) == 6


def test_a_misaligned_tensor_is_not_given_an_aligned_tensors_plan():
    """A tensor's address modulo 16 bytes specialises the compiled kernel: it is part of the key."""
    q, k, v = _inputs((1, 2, 32, 16), (1, 2, 32, 16), grad=False)
    storage = torch.randn(q.numel() + 1, device=DEVICE, dtype=DTYPE)
    shifted = storage[1:].view(q.shape)  # 4 or 2 bytes past an aligned address
    shifted.copy_(q)
    with torch.no_grad():
        want = flash_attention(q, k, v, causal=True)
        got = flash_attention(shifted, k, v, causal=True)
    assert plans.call_key(q, k, v, True, None, None, None) != plans.call_key(
        shifted, k, v, True, None, None, None
    )
    assert torch.equal(want, got)


def test_bad_arguments_still_raise_after_a_plan_exists():
    q, k, v = _inputs((1, 2, 32, 16), (1, 2, 32, 16), grad=False)
    with torch.no_grad():
        flash_attention(q, k, v, causal=True)
        with pytest.raises(ValueError, match="causal"):
            flash_attention(q, k, v, causal="diagonal")
        with pytest.raises(ValueError, match="scale"):
            flash_attention(q, k, v, causal=True, scale=float("nan"))
        with pytest.raises((TypeError, ValueError), match="dtype"):
            flash_attention(q, k.half(), v, causal=True)


def test_calls_with_sinks_or_windows_keep_the_full_path():
    q, k, v = _inputs((1, 2, 32, 16), (1, 2, 32, 16), grad=False)
    sinks = torch.zeros(2, device=DEVICE, dtype=torch.float32)
    with torch.no_grad():
        flash_attention(q, k, v, causal=True, sinks=sinks)
        flash_attention(q, k, v, causal=True, window=8)
    assert not plans.FORWARD


def test_a_changed_launch_forgets_every_plan_and_a_pending_backward_runs_the_full_path():
    q, k, v = _inputs((1, 2, 32, 16), (1, 2, 32, 16))
    do = torch.randn_like(q)
    _run(q, k, v, do, True)  # plans made
    o = flash_attention(q, k, v, causal=True)  # forward by its plan; its backward is pending
    assert plans.FORWARD
    before = plans.generation()
    shape = (launch.n_bucket(32), 16, True, DTYPE)
    with launch.trying(FORWARD, shape, launch.chosen(FORWARD, shape)):
        assert not plans.FORWARD and plans.generation() > before
        grads = torch.autograd.grad(o, (q, k, v), do)  # the stale plan is not used
    want = _run(q, k, v, do, True)
    for a, b in zip(grads, want[2:]):
        assert torch.equal(a, b)


def test_no_plans_when_turned_off_or_under_a_launch_hook(monkeypatch):
    q, k, v = _inputs((1, 2, 32, 16), (1, 2, 32, 16), grad=False)
    monkeypatch.setattr(plans, "ENABLED", False)
    with torch.no_grad():
        flash_attention(q, k, v, causal=True)
    assert not plans.FORWARD
    monkeypatch.setattr(plans, "ENABLED", True)
    with torch.no_grad():
        want = flash_attention(q, k, v, causal=True)
    assert plans.FORWARD
    monkeypatch.setattr(kernel_plans, "plain_launches", lambda: False)  # a profiler's hook: Triton's path
    ran = []
    monkeypatch.setattr(ForwardPlan, "run", lambda *a: ran.append(1))
    with torch.no_grad():
        got = flash_attention(q, k, v, causal=True)
    assert not ran and torch.equal(want, got)


def test_a_prepared_launch_keeps_no_tensor_and_refuses_an_unnamed_one():
    q, k, v = _inputs((1, 2, 32, 16), (1, 2, 32, 16), grad=False)
    with torch.no_grad():
        flash_attention(q, k, v, causal=True)
    (plan,) = plans.FORWARD.values()
    assert not any(isinstance(a, torch.Tensor) for launch_ in plan.launches for a in launch_.values)
    assert bound._named_slots([q, 3, k], {"q": q}) is None
    assert bound._named_slots([q, 3, k], {"q": q, "k": k}) == (((0, "q"), (2, "k")), ())


def test_a_descriptor_is_made_again_over_the_new_tensor(monkeypatch):
    """A TMA descriptor (the Gluon kernels') whose base is a view of a named tensor is rebuilt, fields kept,
    over the same view of the tensor a later call names; a stand-in kernel records what it is given (run as
    the interpreter's launches are, on a GPU too: a stand-in has nothing to bind)."""
    monkeypatch.setattr(bound, "ACTIVE", False)
    monkeypatch.setattr(bound.runtime, "INTERPRET", True)

    @dataclasses.dataclass
    class Descriptor:  # the fields a Gluon host descriptor has that matter here
        base: torch.Tensor
        shape: list
        block_shape: list

    class Kernel:
        def __init__(self):
            self.calls = []

        def __getitem__(self, grid):
            return lambda *values, **kwargs: self.calls.append((grid, values, kwargs))

    kernel = Kernel()
    first, second = torch.randn(2, 3, 8, 16), torch.randn(2, 3, 8, 16)
    out = torch.empty(4)
    desc = Descriptor(first.view(48, 16), [48, 16], [8, 16])
    prepared = bound.prepare(kernel, (5,), (desc, out, 7), {"FLAG": True}, {"q4": first, "o": out})
    assert prepared is not None and prepared.descriptors and prepared.values == [None, None, 7]
    other_out = torch.empty(4)
    prepared({"q4": second, "o": other_out})
    (grid, values, kwargs) = kernel.calls[-1]
    assert grid == (5, 1, 1) and kwargs == {"FLAG": True} and values[1] is other_out and values[2] == 7
    remade = values[0]
    assert type(remade) is Descriptor and remade is not desc and remade.block_shape == [8, 16]
    assert remade.base.data_ptr() == second.data_ptr() and remade.base.shape == (48, 16)
    unnamed = Descriptor(torch.randn(48, 16), [48, 16], [8, 16])
    assert bound.prepare(kernel, (5,), (unnamed, out, 7), {}, {"q4": first, "o": out}) is None


ENCODED = []  # (address, meta) of each descriptor the stand-in below encodes


def make_tensordesc_arg(desc, meta):
    """Stand-in for Triton's encoder (`bound._Encoded` finds it among the wrapper's globals): the 'map' is the
    base's address, then the shape and strides, as Triton's expands a descriptor."""
    ENCODED.append((desc.base.data_ptr(), meta))
    return [("map", desc.base.data_ptr()), *desc.shape, *desc.strides]


def _wrap(launcher, tensordesc_indices, tensordesc_meta):
    """Stand-in for Triton's `wrap_handle_tensordesc`: a closure over the raw launcher, the descriptors' positions
    and their metadata (what `bound._Encoded.of` reads), encoding each descriptor on every call."""

    def inner(*args):
        grid_and_more, values = args[:9], list(args[9:])
        expanded = []
        for i, a in enumerate(values):
            meta = tensordesc_meta[sorted(tensordesc_indices).index(i)] if i in tensordesc_indices else None
            expanded.extend(make_tensordesc_arg(a, meta) if i in tensordesc_indices else [a])
        return launcher(*grid_and_more, *expanded)

    return inner


def test_an_encoded_descriptor_is_kept_per_address_and_the_launch_gets_it_expanded():
    """`bound._Encoded`: a replayed launch's TMA descriptor is encoded once for each address its tensor comes at
    and handed to the launcher below Triton's wrapper expanded as the wrapper would (map, shape, strides), other
    tensors as their addresses; a new address is encoded, an old one found; a launcher not built so is left to
    Triton (None)."""

    @dataclasses.dataclass
    class Descriptor:
        base: torch.Tensor
        shape: list
        strides: list
        block_shape: list

    raw_calls = []

    class Run:  # a compiled kernel's launcher: its __call__ hands the grid and values to `launch`
        def __init__(self):
            self.launch = _wrap(lambda *a: raw_calls.append(a), {0}, [{"swizzle": 128}])

        def __call__(self, *args):
            self.launch(*args)

    class Compiled:
        run, function, packed_metadata = Run(), "function", "metadata"

    first, out = torch.randn(2, 8, 16), torch.empty(4)
    values = [Descriptor(first.view(16, 16), [16, 16], [16, 1], [8, 16]), out, 7]
    found = bound._named_slots(values, {"q4": first, "o": out})
    assert found is not None
    encoded = bound._Encoded.of(Compiled(), values, *found)
    assert encoded is not None and encoded.values == [None] * 6 + [7]
    ENCODED.clear()
    others = [torch.randn(2, 8, 16) for _ in range(2)]
    outs = [torch.empty(4) for _ in range(3)]  # kept: each at an address of its own
    for t, other_out in zip((others[0], others[1], others[0]), outs):
        encoded((3, 1, 1), "stream", Compiled(), {"q4": t, "o": other_out})
        args = raw_calls[-1]
        assert args[:9] == (3, 1, 1, "stream", "function", "metadata", None, None, None)
        assert args[9:15] == (("map", t.data_ptr()), 16, 16, 16, 1, other_out.data_ptr()) and args[15] == 7
    assert ENCODED == [(others[0].data_ptr(), {"swizzle": 128}), (others[1].data_ptr(), {"swizzle": 128})]

    class Plain:  # a launcher with no descriptor wrapper: Triton encodes, as before
        run = type("R", (), {"launch": staticmethod(lambda *a: None)})()

    assert bound._Encoded.of(Plain(), values, *found) is None


def test_aliased_inputs_leave_no_plan_and_a_later_call_is_still_right():
    """k is v: a plan made from it would put v's tensor in k's place for a later call whose k and v differ."""
    q, k, v = _inputs((1, 2, 32, 16), (1, 2, 32, 16), grad=False)
    with torch.no_grad():
        flash_attention(q, k, k, causal=True)
        assert not plans.FORWARD
        got = flash_attention(q, k, v, causal=True)
        again = flash_attention(q, k, v, causal=True)  # by the plan the call before left
    assert plans.FORWARD
    want = reference(q.double(), k.double(), v.double(), causal=True)
    assert (got.double() - want).abs().max().item() < TOL and torch.equal(got, again)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the Gluon kernels run on a Hopper GPU")
@pytest.mark.parametrize("causal, heads", [(False, (4, 4)), (True, (8, 2)), ("bottom_right", (4, 1))])
def test_the_gluon_routes_run_their_plans_and_match_the_full_path(causal, heads):
    """d = 128 bf16 from 2k keys: the Gluon forward, the D pass, the Gluon dQ and dK/dV on a Hopper GPU
    (the Triton kernels elsewhere); the plan's launches, descriptors remade, give the full path's bits. Under
    deterministic algorithms, which keep these two kernels where the one pass would take causal rows."""
    hq, hkv = heads
    q, k, v = _inputs((2, hq, 2048, 128), (2, hkv, 2048, 128))
    do = torch.randn_like(q)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        first = _run(q, k, v, do, causal)
        plan = plans.FORWARD[plans.call_key(q, k, v, causal, None, None, None)]
        assert len(plan.backward) == 1
        again = _run(q, k, v, do, causal)
        plans.clear()
        fresh = _run(q, k, v, do, causal)  # the full path again, after the plans ran
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b, c in zip(first, again, fresh):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the one-pass backward runs on a Hopper GPU")
@pytest.mark.parametrize("causal, heads", [(False, (4, 4)), (True, (8, 2)), ("bottom_right", (4, 1))])
def test_the_one_pass_backward_runs_its_plan_and_not_under_deterministic_algorithms(causal, heads):
    """d = 64 bf16 from 4096 causal tokens (8192 without a mask): the one-pass backward (`hopper_onepass`) on a
    Hopper GPU. A repeated call
    replays its launches (`backward.OnePassPlan`): dK, dV the full path's bits, dQ (TMA's adds in any order)
    within float64's bound; under deterministic algorithms the same call keeps a plan of its own (the two
    kernels), whose dQ repeats bit for bit."""
    from course_lib.attention import hopper_onepass
    from course_lib.attention.backward import BackwardPlan, OnePassPlan

    hq, hkv = heads
    batch = 4 // hkv  # 4 (batch, K/V head) pairs: 128 programs, half a wave or more (`hopper_onepass.choose`)
    n = 4096 if causal else 8192
    q, k, v = _inputs((batch, hq, n, 64), (batch, hkv, n, 64))
    do = torch.randn_like(q)
    if not hopper_onepass.supports(q, k, v, do):
        pytest.skip("the one pass runs on Hopper GPUs")
    first = _run(q, k, v, do, causal)
    plan = plans.FORWARD[plans.call_key(q, k, v, causal, None, None, None)]
    assert [type(p) for p in plan.backward.values()] == [OnePassPlan]
    ran = []
    real_run = OnePassPlan.run
    OnePassPlan.run = lambda self, *a: ran.append(1) or real_run(self, *a)
    try:
        again = _run(q, k, v, do, causal)
    finally:
        OnePassPlan.run = real_run
    assert ran == [1]
    for a, b in zip(first[:2] + first[3:], again[:2] + again[3:]):  # O twice, dK, dV
        assert torch.equal(a, b)
    (one_pass,) = plan.backward.values()
    kernels = one_pass.replay.launches[1:]
    # descriptors encoded once an address (`bound._Encoded`); the freed blocks taken, the next call lies elsewhere
    assert all(p.encoded is not None for p in kernels)
    held = [torch.empty_like(q) for _ in range(12)]
    moved = _run(q, k, v, do, causal)
    seen = {name: len(known) for _, name, *_, known in kernels[0].encoded.descriptors}
    assert seen["q4"] >= 2 and seen["dq_acc"] >= 1  # a new address encoded, the old one kept
    for a, b in zip(first[:2] + first[3:], moved[:2] + moved[3:]):
        assert torch.equal(a, b)
    del held
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64 = reference(q64, k64, v64, causal=causal)
    dq64 = torch.autograd.grad(o64, q64, do.double())[0]
    assert (again[2].double() - dq64).abs().max().item() < TOL * max(1.0, dq64.abs().max().item())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        exact = [_run(q, k, v, do, causal) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    assert [type(p) for p in plan.backward.values()] == [OnePassPlan, BackwardPlan]
    assert torch.equal(exact[0][2], exact[1][2])  # dQ by the two kernels, the second time from their plan


@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_repeated_decoding_step_runs_its_plan_with_the_new_pages_and_lengths(num_splits):
    """decode.split_kv's plans: the split kernel (and the combine when S > 1) again, over the block table and
    lengths of the call that runs it, equal to the full path's result and to float64 attention."""
    from course_lib.decode import paged_decode_attention, split_kv
    from course_lib.decode.reference import decode_reference, gather_pages

    B, Hq, Hkv, d, page, pages = 2, 4, 2, 32, 16, 8
    k_pages = torch.randn(pages, page, Hkv, d, device=DEVICE, dtype=DTYPE)
    v_pages = torch.randn(pages, page, Hkv, d, device=DEVICE, dtype=DTYPE)
    q = torch.randn(B, 1, Hq, d, device=DEVICE, dtype=DTYPE)
    calls = []
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        table = torch.randperm(pages, generator=gen)[: 2 * 3].view(B, 3).to(DEVICE, torch.int32)
        lens = torch.randint(1, 3 * page + 1, (B,), generator=gen).to(DEVICE, torch.int32)
        calls.append((table, lens))
    ran = []
    real_run = split_kv.CallPlan.run
    split_kv.CallPlan.run = lambda self, *a: ran.append(1) or real_run(self, *a)
    try:
        got = [paged_decode_attention(q, k_pages, v_pages, t, n, num_splits=num_splits) for t, n in calls]
    finally:
        split_kv.CallPlan.run = real_run
    assert len(ran) == 2 and len(split_kv.PLANS) == 1  # the second and third calls ran the first one's plan
    kernel_plans.clear_all()
    for (table, lens), out in zip(calls, got):
        assert torch.equal(
            out, paged_decode_attention(q, k_pages, v_pages, table, lens, num_splits=num_splits)
        )
        capacity = 3 * page
        k_flat, v_flat = gather_pages(k_pages, table, capacity), gather_pages(v_pages, table, capacity)
        want, _ = decode_reference(q, k_flat, v_flat, lens.cpu())
        assert (out.double().cpu() - want).abs().max().item() < TOL


@pytest.mark.skipif(DEVICE.type != "cuda", reason="partial dK, dV per query head from 4096 keys: GPU sizes")
@pytest.mark.parametrize("d", [64, 128])
def test_a_grouped_backward_with_partials_runs_its_plan(d, monkeypatch):
    """Grouped-query attention whose dK, dV are summed from fp32 partials (non-causal rows from 4096 keys in
    the Gluon kernel on a Hopper GPU; d <= 64 beyond 4096 keys in the Triton one elsewhere): the plan allocates
    the partials and sums them too.
    (The two kernels: at d = 64 the one pass, which has no plan, would otherwise take these shapes.)"""
    from course_lib.attention import backward as bwd

    monkeypatch.setattr(bwd, "hopper_onepass", lambda *args: None)
    q, k, v = _inputs((1, 8, 8192, d), (1, 2, 8192, d))
    do = torch.randn_like(q)
    first = _run(q, k, v, do, False)
    plan = plans.FORWARD[plans.call_key(q, k, v, False, None, None, None)]
    (backward_plan,) = plan.backward.values()
    assert backward_plan.partial_shape is not None
    again = _run(q, k, v, do, False)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_a_recording_notes_only_its_own_threads_launches(monkeypatch):
    """Autograd runs a CUDA backward on a thread of its own: a launch there must not land in a recording the
    main thread has open (nor the other way round)."""
    import threading

    monkeypatch.setattr(bound, "ACTIVE", False)  # a stand-in kernel: launched as the interpreter's are
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *values, **kwargs: calls.append(grid)

    kernel, x = Kernel(), torch.zeros(4)
    with bound.recording({"x": x}) as mine:
        other = threading.Thread(target=lambda: bound.launch(kernel, (1,), x))
        other.start()
        other.join()
        bound.launch(kernel, (2,), x)
    assert calls == [(1,), (2,)] and [grid for _, grid, _, _ in mine.launches] == [(2,)]
