"""Kernel launches bound once per specialisation: Triton's launch without its per-call Python (notebook 08).

`kernel[grid](*args, **kwargs)` costs the CPU 30-40 us in Triton's Python before the launch itself
(notes/attention.md, "Host time per call"): it binds every argument to the kernel's signature, works out
how each one specialises the compiled code (a pointer's dtype and 16-byte alignment, an integer equal to 1,
divisible by 16, or past 32 bits), hashes that into a cache key, looks the compiled kernel up, and only
then calls the C launcher. A model calls the same kernels with the same kinds of arguments thousands of
times; `launch` does that work once per kind:

- the first call with a given `key` launches through Triton as usual and keeps what it compiled (the
  `CompiledKernel`) and the order of the kernel's parameters with the constants filled in;
- a later call with the same key puts its arguments into that order and calls the launcher directly.

The key is at least as fine as Triton's specialisation, so a call never runs code compiled for other
arguments: every compile-time constant by value, a tensor by dtype and whether its address is a multiple of
16, an integer by (== 1, divisible by 16, fits 32 bits, fits 64), a float or a bool by type, a TMA
descriptor by its dtype, shape, strides, block and layout, plus the current device and the launch keywords
(warps, stages). An argument of any other kind, a grid given as a function of the constants, or a profiler's
launch hook sends the call through Triton every time. `COURSE_BOUND_LAUNCH=0` sends every call through
Triton (for comparison); `COURSE_BOUND_LAUNCH=check` also asks Triton, on every bound call, which kernel it
would have run and raises if it differs (the GPU tests run a workload so).

`prepare` goes one step further for a caller that repeats a whole call (`attention.plans`): a launch whose
non-tensor arguments are all fixed (a `Prepared`), run again by handing it only the tensors, by name.

On the CPU, Triton's interpreter runs the kernels and nothing is bound: `launch` is `kernel[grid](...)`,
and a `Prepared` launch is that call again with the new tensors.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading

import torch

from .. import runtime

MODE = os.environ.get("COURSE_BOUND_LAUNCH", "1").strip().lower()
if MODE not in ("0", "1", "check"):
    raise ValueError(f"COURSE_BOUND_LAUNCH must be 0, 1 or check, got {MODE!r}")
ACTIVE = MODE != "0" and runtime.ON_GPU and not runtime.INTERPRET
# `_Encoded`; 0: Triton encodes every TMA descriptor at every launch
ENCODE = os.environ.get("COURSE_ENCODED_DESCRIPTORS", "1").strip() != "0"
_I32 = (-(2**31), 2**31)  # (`_Signature.key` writes these bounds out)
_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter
_INT_KEYS: dict = {}  # int -> `_int_key` (sizes and strides recur); cleared past MAX_ENTRIES
_I64 = (-(2**63), 2**63)


class _Unbound(Exception):
    """An argument whose specialisation `launch` does not know how to key: the call goes through Triton."""


def _int_key(a: int):
    return (a == 1, a % 16 == 0, _I32[0] <= a < _I32[1], _I64[0] <= a < _I64[1])


_LAYOUTS: dict = {}  # id(layout) -> (layout, its text): a layout may hold a list, so it has no hash


def _layout_key(layout) -> str:
    known = _LAYOUTS.get(id(layout))
    if known is None or known[0] is not layout:  # kept alive in the dict: its id cannot be reused
        if len(_LAYOUTS) >= 1024:
            _LAYOUTS.clear()
        known = _LAYOUTS[id(layout)] = (layout, repr(layout))
    return known[1]


def _descriptor_key(a):
    base = a.base
    return (
        type(a), base.dtype, base.data_ptr() % 16 == 0, tuple(a.shape), tuple(a.strides),
        tuple(a.block_shape), _layout_key(a.layout), getattr(a, "padding", None),
    )  # fmt: skip


def _runtime_key(a):
    """How a runtime (non-constexpr) argument specialises a kernel (module docstring)."""
    t = type(a)
    if t is torch.Tensor or isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if t is int:
        return _int_key(a)
    if t is float or t is bool or a is None:
        return t
    if hasattr(a, "block_shape") and hasattr(a, "base"):  # a TMA descriptor (Gluon's host-side descriptor)
        return _descriptor_key(a)
    raise _Unbound(t)


def _constant_key(a):
    """A compile-time constant keys by type and value (True and 1 are equal in Python, not to Triton's cache);
    hashable ones only: anything else is not bound."""
    try:
        hash(a)
    except TypeError as exc:
        raise _Unbound(type(a)) from exc
    return (type(a), a)


class _Signature:
    """What `launch` reads once per kernel: which parameters are compile-time constants, by position and
    by name."""

    def __init__(self, kernel):
        self.kernel = kernel  # held: the tables are keyed by id(kernel), which must not be reused
        params = kernel.params
        self.constant = tuple(p.is_constexpr for p in params)
        self.index = {p.name: i for i, p in enumerate(params)}
        self.runtime_names = frozenset(p.name for p in params if not p.is_constexpr)
        self.entries: dict = {}

    def key(self, args: tuple, kwargs: dict) -> tuple:
        """What `_constant_key` and `_runtime_key` decide for each argument, written out for tensors, integers and
        keyword constants: a call's key costs part of what its launch saves (RoPE's 29 arguments and 10 keywords:
        11.1 -> 5.2 us, rms_norm's 9 and 4: 3.8 -> 2.7, best of 5, a 2-core CPU). An integer's key is looked up
        (`_INT_KEYS`); keywords that are all constants (compile-time constants or launch options) key as their
        names, values and types together. A constant is keyed without hashing it first: the table's look-up
        hashes the key, and an unhashable constant fails there (`_launch` sends that call through Triton)."""
        if len(args) > len(self.constant):
            raise _Unbound("more arguments than parameters")
        key, ints = [], _INT_KEYS
        append = key.append
        for is_constant, a in zip(self.constant, args):
            t = type(a)
            if is_constant:
                append((t, a))
            elif t is int:
                k = ints.get(a)
                if k is None:
                    if len(ints) >= MAX_ENTRIES:
                        ints.clear()
                    k = ints[a] = _int_key(a)
                append(k)
            elif t is _TENSOR or t is _PARAMETER:
                append((a.dtype, a.data_ptr() % 16 == 0))
            else:
                append(_runtime_key(a))
        if not kwargs:
            return tuple(key)
        if self.runtime_names.isdisjoint(kwargs):
            values = tuple(kwargs.values())
            append(tuple(kwargs))
            append(values)
            append(tuple(map(type, values)))
            return tuple(key)
        index, constant = self.index, self.constant
        for name, value in kwargs.items():
            i = index.get(name)
            append((name, _runtime_key(value) if i is not None and not constant[i] else (type(value), value)))
        return tuple(key)


class _Entry:
    """A bound launch: the compiled kernel, and the full argument list (in signature order, constants and
    defaults filled in) into which each call's runtime arguments go."""

    __slots__ = ("compiled", "template", "keyword_slots", "n_args")

    def __init__(self, compiled, template: list, keyword_slots: tuple, n_args: int):
        self.compiled, self.template = compiled, template
        self.keyword_slots, self.n_args = keyword_slots, n_args


_current_stream = torch._C._cuda_getCurrentRawStream if ACTIVE else None  # what Triton's launch asks too
_SIGNATURES: dict = {}
_NOT_BOUND: dict = {}  # id(kernel) -> (kernel, why binding it failed once): launched through Triton from then on
UNBOUND_CALLS: dict = {}  # (kernel name, why its arguments could not be keyed) -> calls
MAX_ENTRIES = 4096  # per kernel; past it, the table starts again (shapes that never repeat)


def _signature(kernel) -> _Signature:
    sig = _SIGNATURES.get(id(kernel))  # by identity: a JITFunction's own hash walks its source's key
    if sig is None or sig.kernel is not kernel:
        sig = _SIGNATURES[id(kernel)] = _Signature(kernel)
    return sig


def _bind(kernel, sig: _Signature, compiled, device: int, args: tuple, kwargs: dict) -> _Entry:
    binder = kernel.device_caches[device][-1]  # (kernel cache, [key cache,] target, backend, binder)
    bound_args, _, _ = binder(*args, **kwargs)
    names = list(bound_args)
    if names[: len(args)] != [p.name for p in kernel.params[: len(args)]]:
        raise _Unbound("argument order")
    keyword_slots = tuple(
        (name, names.index(name))
        for name in kwargs
        if name in sig.index and not sig.constant[sig.index[name]]
    )
    template = list(bound_args.values())
    for slot in [*range(len(args)), *(slot for _, slot in keyword_slots)]:
        template[slot] = None  # every call fills these: the entry keeps no tensor of the first call alive
    if not callable(compiled.run) or compiled.function is None:
        raise _Unbound("compiled kernel")
    return _Entry(compiled, template, keyword_slots, len(args))


def _hooks_set() -> bool:
    """Whether a launch hook is installed (a profiler's: Triton must run it, so the call is not bound)."""
    triton = runtime.triton
    if hasattr(triton, "knobs"):
        hooks = triton.knobs.runtime
        return _hook_set(hooks.launch_enter_hook) or _hook_set(hooks.launch_exit_hook)
    compiled = triton.compiler.CompiledKernel
    return _hook_set(getattr(compiled, "launch_enter_hook", None)) or _hook_set(
        getattr(compiled, "launch_exit_hook", None)
    )


def _hook_set(hook) -> bool:
    """A hook is set: a function, or Triton's chain of hooks (`knobs.HookChain`, never None) holding one."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _triton_would_run(kernel, device: int, args: tuple, kwargs: dict):
    """The compiled kernel Triton's own lookup finds for this call (COURSE_BOUND_LAUNCH=check)."""
    from triton.runtime import jit

    caches = kernel.device_caches[device]
    knobs = runtime.triton.knobs
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    if hasattr(knobs.compilation, "instrumentation_mode"):
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    _, specialization, options = caches[-1](*args, **kwargs)
    if hasattr(jit, "compute_cache_key"):
        return caches[0].get(jit.compute_cache_key(caches[1], specialization, options))
    return caches[0].get(str(specialization) + str(options))


def launch(kernel, grid, *args, **kwargs) -> None:
    """Launch Triton (or Gluon) kernel `kernel` on `grid` (a tuple of 1-3 ints) with `args` and `kwargs`,
    as `kernel[grid](*args, **kwargs)` does, binding the arguments once per specialisation on a GPU."""
    _launch(kernel, grid, args, kwargs)
    recordings = _OPEN.recordings
    if recordings:  # a caller records what it launches (`recording`): this launch, once made, is part of it
        recordings[-1].note(kernel, grid, args, kwargs)


def _launch(kernel, grid, args: tuple, kwargs: dict) -> None:
    if not ACTIVE or id(kernel) in _NOT_BOUND or callable(grid) or _hooks_set():
        kernel[grid](*args, **kwargs)
        return
    sig = _signature(kernel)
    device = torch.cuda.current_device()
    try:
        key = (device, sig.key(args, kwargs))
        entry = sig.entries.get(key)  # hashes the key: an unhashable constant is not bound either
    except (_Unbound, TypeError) as exc:
        why = (getattr(kernel, "__name__", "?"), f"{type(exc).__name__}: {exc}")
        UNBOUND_CALLS[why] = UNBOUND_CALLS.get(why, 0) + 1
        kernel[grid](*args, **kwargs)
        return
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)
        try:
            entry = _bind(kernel, sig, compiled, device, args, kwargs)
        except Exception as exc:  # another Triton's internals: this kernel goes through Triton from now on
            _NOT_BOUND[id(kernel)] = (kernel, f"{type(exc).__name__}: {exc}")  # the kernel held, as above
            return
        if len(sig.entries) >= MAX_ENTRIES:
            sig.entries.clear()
        sig.entries[key] = entry
        return
    if MODE == "check" and _triton_would_run(kernel, device, args, kwargs) is not entry.compiled:
        raise RuntimeError(f"bound launch of {kernel}: Triton would run another compiled kernel for {key}")
    values = entry.template.copy()
    values[: entry.n_args] = args
    for name, slot in entry.keyword_slots:
        values[slot] = kwargs[name]
    compiled = entry.compiled
    n = len(grid)
    compiled.run(
        grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
        _current_stream(device), compiled.function, compiled.packed_metadata,
        None, None, None, *values,
    )  # fmt: skip


ENCODED_MAX = 64  # encoded TMA descriptors kept per descriptor of a `Prepared` launch (addresses that recur)


class _Encoded:
    """A `Prepared` launch's TMA descriptors encoded once per address: Triton's launcher encodes every descriptor
    on every launch (`make_tensordesc_arg`: `cuTensorMapEncodeTiled` and its Python; 7 a launch of the one-pass
    backward, in up to 4 launches a call), though a descriptor of a `Prepared` launch differs from one call to the next
    only by its tensor's address. Here each is encoded the first time its address is seen and kept (up to
    `ENCODED_MAX` addresses a descriptor: a model's layers each have their own), and the launch goes to the
    launcher below Triton's wrapper (`wrap_handle_tensordesc`'s `launcher`) with the descriptors already
    expanded as the wrapper would expand them, and every other tensor as its address (as in `Prepared`). `of`
    returns None where the launcher is not built so (another Triton): then the launch encodes as Triton does."""

    __slots__ = ("run", "values", "slots", "descriptors")

    def __init__(self, run, values, slots, descriptors):
        self.run, self.values, self.slots, self.descriptors = run, values, slots, descriptors

    @staticmethod
    def of(compiled, values: list, slots: tuple, descriptors: tuple):
        wrapped = getattr(compiled.run, "launch", None)
        code, cells = getattr(wrapped, "__code__", None), getattr(wrapped, "__closure__", None)
        if code is None or cells is None or not descriptors:
            return None
        try:
            found = {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}
            launcher, metas = found["launcher"], list(found["tensordesc_meta"])
            encode = wrapped.__globals__["make_tensordesc_arg"]
            indices = sorted(found["tensordesc_indices"])
        except (KeyError, ValueError, TypeError):
            return None
        if any("shape" not in d[3] for d in descriptors):
            return None
        if indices != [d[0] for d in descriptors] or len(metas) != len(indices) or None in metas:
            return None
        run = copy.copy(compiled.run)
        run.launch = launcher
        expanded, at, where = [], {}, []
        for i, a in enumerate(values):
            at[i] = len(expanded)
            if i in indices:
                where.append(len(expanded))
                fields = descriptors[len(where) - 1][3]
                expanded.extend([None] * (1 + 2 * len(fields["shape"])))  # the encoded map, shape, strides
            else:
                expanded.append(a)
        return _Encoded(
            run, expanded, tuple((at[slot], name) for slot, name in slots),
            tuple((pos, d[1], d[2], d[3], d[4], meta, encode, {}) for pos, d, meta in zip(where, descriptors, metas)),
        )  # fmt: skip

    def __call__(self, grid, stream, compiled, tensors: dict) -> None:
        values = self.values.copy()
        for pos, name in self.slots:
            values[pos] = tensors[name].data_ptr()
        for pos, name, cls, fields, shape, meta, encode, known in self.descriptors:
            t = tensors[name]
            address = t.data_ptr()
            args = known.get(address)
            if args is None:
                desc = object.__new__(cls)
                desc.__dict__.update(fields)
                desc.base = t.view(shape)
                args = encode(desc, meta)
                if len(known) >= ENCODED_MAX:
                    known.clear()
                known[address] = args
            values[pos : pos + len(args)] = args
        run, function, metadata = self.run, compiled.function, compiled.packed_metadata
        run(grid[0], grid[1], grid[2], stream, function, metadata, None, None, None, *values)


class Prepared:
    """A launch to run again with other tensors of the same kinds: the kernel, the grid and every non-tensor
    argument as the call given to `prepare` had them. `prepared(tensors)` takes a dict {name: tensor} and
    puts each tensor where the first call had the tensor of that name, and each TMA descriptor of a named
    tensor's view made again over the new tensor (on a GPU, encoded once per address: `_Encoded`). On a GPU it
    calls the compiled kernel's launcher directly (the bound entry); under the interpreter it is
    `kernel[grid](...)` again, with the tensors. On a GPU each tensor goes as its address, an int: given the
    tensor, Triton's launcher calls its data_ptr and asks the driver whether the address is a GPU's
    (`cuPointerGetAttribute`, once a pointer a launch), which the plan's key (the tensors' devices) settled. The
    caller's key must fix everything but the tensors' data: their dtypes and 16-byte alignment included (fresh
    allocations are aligned)."""

    __slots__ = (
        "kernel", "compiled", "values", "slots", "descriptors", "grid", "device", "kwargs", "encoded",
    )  # fmt: skip

    def __init__(self, kernel, compiled, values, slots, descriptors, grid, device, kwargs):
        self.kernel, self.compiled, self.values, self.slots = kernel, compiled, values, slots
        self.descriptors, self.grid, self.device, self.kwargs = descriptors, grid, device, kwargs
        self.encoded = None
        if compiled is not None and descriptors and ENCODE:
            self.encoded = _Encoded.of(compiled, values, slots, descriptors)

    def __call__(self, tensors: dict) -> None:
        if self.encoded is not None:
            self.encoded(self.grid, _current_stream(self.device), self.compiled, tensors)
            return
        values = self.values.copy()
        if self.compiled is None:  # the interpreter takes the tensors
            for slot, name in self.slots:
                values[slot] = tensors[name]
        else:
            for slot, name in self.slots:  # pointers as ints: the launcher then asks the driver nothing
                values[slot] = tensors[name].data_ptr()
        for (
            slot,
            name,
            cls,
            fields,
            shape,
        ) in self.descriptors:  # the descriptor's fields, its base over the new tensor
            desc = object.__new__(cls)
            desc.__dict__.update(fields)
            desc.base = tensors[name].view(shape)
            values[slot] = desc
        compiled = self.compiled
        if compiled is None:  # the interpreter: through Triton
            self.kernel[self.grid](*values, **self.kwargs)
            return
        grid = self.grid
        compiled.run(
            grid[0], grid[1], grid[2], _current_stream(self.device), compiled.function, compiled.packed_metadata,
            None, None, None, *values,
        )  # fmt: skip


def prepare(kernel, grid, args: tuple, kwargs: dict, tensors: dict) -> Prepared | None:
    """The launch `launch(kernel, grid, *args, **kwargs)` just made, as a `Prepared` launch whose tensors are
    found by name (`tensors`: {name: tensor}; a TMA descriptor by its base's address among them); None where
    it cannot be repeated so: a tensor with no name, an argument `launch` does not bind, a grid given as a
    function, a profiler's launch hook, or (on a GPU) a launch that went through Triton's own path."""
    if callable(grid) or _hooks_set():
        return None
    grid = tuple(grid) + (1,) * (3 - len(grid))
    if not ACTIVE:
        if runtime.ON_GPU and not runtime.INTERPRET:  # COURSE_BOUND_LAUNCH=0: Triton's path, not repeated
            return None
        values = list(args)
        found = _named_slots(values, tensors)
        return None if found is None else Prepared(kernel, None, values, *found, grid, None, dict(kwargs))
    if id(kernel) in _NOT_BOUND:
        return None
    sig = _signature(kernel)
    device = torch.cuda.current_device()
    try:
        entry = sig.entries.get((device, sig.key(args, kwargs)))
    except (_Unbound, TypeError):
        return None
    if entry is None:
        return None
    values = entry.template.copy()
    values[: entry.n_args] = args
    for name, slot in entry.keyword_slots:
        values[slot] = kwargs[name]
    found = _named_slots(values, tensors)
    return None if found is None else Prepared(kernel, entry.compiled, values, *found, grid, device, {})


def _named_slots(values: list, tensors: dict) -> tuple | None:
    """(((position, name), ...), ((position, name, class, fields, view shape), ...)): where `values` holds
    each named tensor, and each TMA descriptor over a named tensor's memory; each replaced by None (a Prepared
    launch keeps no tensor alive). None if a tensor or a descriptor's base is not among `tensors` (by identity;
    a base, by its address and a contiguous named tensor of as many elements)."""
    by_id = {id(t): name for name, t in tensors.items()}
    slots, descriptors = [], []
    for i, a in enumerate(values):
        if isinstance(a, torch.Tensor):
            name = by_id.get(id(a))
            if name is None:
                return None
            slots.append((i, name))
            values[i] = None
        elif hasattr(a, "block_shape") and isinstance(getattr(a, "base", None), torch.Tensor):
            base = a.base
            names = [
                name for name, t in tensors.items()
                if t.data_ptr() == base.data_ptr() and t.numel() == base.numel() and t.is_contiguous()
            ]  # fmt: skip
            if len(names) != 1 or not base.is_contiguous() or not hasattr(a, "__dict__"):
                return None
            fields = {key: value for key, value in vars(a).items() if key != "base"}
            descriptors.append((i, names[0], type(a), fields, tuple(base.shape)))
            values[i] = None
    return tuple(slots), tuple(descriptors)


class Recording:
    """The launches made while it is open (`recording`), each as a `Prepared` launch; `complete` turns False
    if one could not be (then the call cannot be repeated from them)."""

    def __init__(self, tensors: dict):
        self.tensors, self.launches, self.complete = tensors, [], True

    def note(self, kernel, grid, args: tuple, kwargs: dict) -> None:
        self.launches.append((kernel, grid, args, kwargs))

    def prepared(self) -> tuple | None:
        """The launches noted, as `Prepared` launches in order, once they have run (the first call binds
        them); None if any cannot be repeated."""
        if not self.complete:
            return None
        named = [t for t in self.tensors.values() if t.numel()]
        if len({t.data_ptr() for t in named}) < len(named):  # aliased (k is v, say): another call may not be
            return None
        made = tuple(
            prepare(kernel, grid, args, kwargs, self.tensors) for kernel, grid, args, kwargs in self.launches
        )
        return None if any(p is None for p in made) else made

    def unrepeatable(self) -> None:
        self.complete = False


class _Open(threading.local):
    """The recordings open in this thread, innermost last: a thread's launches (autograd runs a CUDA backward on
    a thread of its own) are never noted in another thread's recording."""

    def __init__(self):
        self.recordings: list = []


_OPEN = _Open()


@contextlib.contextmanager
def recording(tensors: dict):
    """Within the block, every `launch` is noted in the `Recording` yielded (`tensors`: {name: tensor}, the
    tensors the launches may take, by the names a later call will give them). A launch made any other way
    inside the block (an autotuner's, say) must call `unrepeatable()` on it (`current_recording`)."""
    rec = Recording(tensors)
    _OPEN.recordings.append(rec)
    try:
        yield rec
    finally:
        _OPEN.recordings.pop()


def unrepeatable() -> None:
    """Mark the recording open now, if any, as not repeatable: something launched outside `launch`."""
    if _OPEN.recordings:
        _OPEN.recordings[-1].unrepeatable()


def plain_launches() -> bool:
    """Whether launches may skip Triton's own path now: no profiler's launch hook is installed (where one is,
    every launch goes through Triton, which runs it)."""
    return not _hooks_set()
