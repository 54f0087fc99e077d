"""Where a step would wait for the GPU, and what it launches, found on a CPU (the serving step of notebooks 10, 14).

A kernel launch returns at once; the host runs ahead of the GPU until it needs a value the GPU computes. Then
it waits for every launch queued before (a sync), and the launches after it start only once the GPU has run
dry. PyTorch syncs wherever a value leaves a GPU tensor for Python (`.item()`, `.tolist()`, `int(t)`,
`bool(t)`, `.cpu()`, `.numpy()`), wherever an output's size depends on the values (`torch.nonzero`,
`torch.unique`, `masked_select`, indexing with a boolean mask, `repeat_interleave` with tensor repeats), and at
every copy from host memory to the GPU that is not `non_blocking` (`copy_kernel_cuda` runs
`memcpy_and_sync`: a `cudaMemcpyAsync`, then a `cudaStreamSynchronize`): `torch.tensor(data, device=...)`,
`t.to(device)` of a CPU tensor, a CPU index into a GPU tensor.

`watch()` finds these on a machine without a GPU. Within the block, every tensor is taken to live on the GPU
except those that would be on the host in a GPU run: made from host data (`torch.from_numpy`,
`torch.tensor(data)` with no device), by a factory with no device (`torch.arange(n)`), by `.cpu()`, or by an
operation on host tensors alone. `.to(device)` and `.cuda()` move to the GPU, `.to("cpu")` (the string) to
the host. A tensor made before the block is on the GPU unless it is listed in `host`. Then it counts

    syncs     each value read from a GPU tensor, each size that depends on GPU values, each blocking copy
              to the GPU, by kind and by where (the innermost frames outside torch)
    copies    copies from the host to the GPU (blocking or not), by where, with their bytes
    ops       the ATen operations on GPU tensors that launch work (views and allocations left out): the
              launches a GPU step would make from PyTorch (as the CPU's operators decompose: a CUDA one may
              launch more than one kernel), by operation and by where
    kernels   Triton launches, by kernel (with `launches=False` they return at once without running,
              as `scripts/host_time.py`'s `no_launch`)
    mixed     operations given host and GPU tensors together (an error on a GPU, unless the host one
              is a 0-dim scalar)

Only the branches a CPU run takes are seen: code that asks `t.is_cuda` or `device.type` takes its CPU branch
here. `on_gpu_branches()` makes `checks.should_validate` answer as on a GPU (`validate`, instead of always
True), so a call with validate=True shows its syncs and one with validate=False none; a check that reads values
only where that is free asks `should_validate(False, device)`, and is seen as a GPU skips it.

    with watch() as seen:
        model.forward_step(tokens, positions, kv)
    print(seen.table())

Used by `scripts/serving_probe.py --step` (a serving model's prefill and decode steps); tested in
tests/test_syncs.py.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# value reads: a GPU tensor's values go to Python or to host memory (blocking)
READS = {
    "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "cpu", "numpy",
    "__array__", "__format__", "__repr__", "__contains__", "equal", "allclose", "is_nonzero",
}  # fmt: skip
# outputs whose size depends on the values: the host waits to learn it
SIZED_BY_VALUES = {"nonzero", "argwhere", "unique", "unique_consecutive", "masked_select", "bincount"}
INDEXING = {"__getitem__", "__setitem__", "index_put_", "index_put", "index"}
FACTORIES_FROM_DATA = {"tensor", "as_tensor", "asarray"}
# metadata and views: no launch (at the ATen level `OpOverload.is_view` marks views)
NO_LAUNCH = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense", "lift_fresh",
    "detach", "alias", "set_", "resize_", "_reshape_alias", "_unsafe_view", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type",
}  # fmt: skip
_HERE = os.path.abspath(__file__)
_SKIP_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, contextlib)
)  # the stdlib


def _site(depth: int) -> str:
    """The innermost `depth` frames outside torch, Triton, the standard library and this module, innermost
    first, as 'file:line function' joined by ' < '."""
    frame, out = sys._getframe(2), []
    while frame is not None and len(out) < depth:
        name = frame.f_code.co_filename
        if name != _HERE and not name.startswith(_SKIP_DIRS) and "/triton/" not in name and "<" not in name:
            out.append(f"{os.path.basename(name)}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(out) or "?"


def _tensors(args, kwargs) -> list[torch.Tensor]:
    flat, _ = tree_flatten((args, kwargs or {}))
    return [a for a in flat if isinstance(a, torch.Tensor)]


@dataclass
class Seen:
    """What `watch` counted (module docstring). Counters keyed by (kind, where) or (name, where)."""

    syncs: Counter = field(default_factory=Counter)
    copies: Counter = field(default_factory=Counter)
    copy_bytes: int = 0
    ops: Counter = field(default_factory=Counter)
    host_ops: int = 0
    kernels: Counter = field(default_factory=Counter)
    mixed: Counter = field(default_factory=Counter)

    @property
    def num_syncs(self) -> int:
        return sum(self.syncs.values())

    @property
    def num_copies(self) -> int:
        return sum(self.copies.values())

    @property
    def num_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def num_kernels(self) -> int:
        return sum(self.kernels.values())

    def within(self, text: str) -> Seen:
        """The counts whose site holds `text` (a function's name: 'forward_step'); kernels and host operations, which
        carry no site, are left out. Sites hold `watch`'s `depth` frames: enough of them to reach the function."""
        keep = Seen()
        for name in ("syncs", "copies", "ops", "mixed"):
            getattr(keep, name).update({key: n for key, n in getattr(self, name).items() if text in key[1]})
        return keep

    def by(self, counter: str, part: int) -> Counter:
        """`counter` ('syncs', 'copies', 'ops', 'mixed') summed by part 0 (kind or name) or 1 (where) of its keys."""
        out = Counter()
        for key, n in getattr(self, counter).items():
            out[key[part]] += n
        return out

    def table(self, top: int = 12) -> str:
        """Counts, then each sync, copy and mixed operation by where, then the most frequent launches."""
        lines = [
            f"syncs {self.num_syncs}, copies to the GPU {self.num_copies} ({self.copy_bytes} bytes), "
            f"PyTorch launches {self.num_ops} (and {self.host_ops} host operations), Triton launches "
            f"{self.num_kernels}, host and GPU tensors mixed {sum(self.mixed.values())}"
        ]
        for name, label in (("syncs", "sync"), ("copies", "copy"), ("mixed", "mixed")):
            for (kind, where), n in getattr(self, name).most_common():
                lines.append(f"  {label} x{n}: {kind} at {where}")
        for (op, where), n in self.ops.most_common(top):
            lines.append(f"  launch x{n}: {op} at {where}")
        for kernel, n in self.kernels.most_common():
            lines.append(f"  Triton x{n}: {kernel}")
        return "\n".join(lines)


class _Watch(TorchFunctionMode):
    """Host or GPU for each tensor the block makes (`host`, by id), value reads, copies and mixes."""

    def __init__(self, seen: Seen, depth: int, host):
        super().__init__()
        self.seen, self.depth, self.host = seen, depth, {}
        self.paused = 0  # within a Triton launch that runs: the interpreter's tensors are not the block's
        self.factory_on_host = False  # where the factory being called (no tensor argument) puts its output
        for t in host:
            self.mark(t, True)

    def mark(self, t, on_host: bool) -> None:
        if not isinstance(t, torch.Tensor):
            return
        key = id(t)
        if on_host:
            self.host[key] = weakref.ref(t, lambda _, key=key, host=self.host: host.pop(key, None))
        else:
            self.host.pop(key, None)

    def on_host(self, t) -> bool:
        ref = self.host.get(id(t))
        return ref is not None and ref() is t

    def note(self, counter: str, kind: str) -> None:
        getattr(self.seen, counter)[(kind, _site(self.depth))] += 1

    def copy_in(self, t, blocking: bool, what: str) -> None:
        self.seen.copies[(what, _site(self.depth))] += 1
        self.seen.copy_bytes += t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
        if blocking:
            self.note("syncs", f"blocking copy to the GPU ({what})")

    def target(self, rest, kwargs, name):
        """Where `.to(...)` / `.cuda()` / `.type(...)` sends a tensor: None (a dtype only), "host" or "gpu"."""
        if name == "cuda":
            return "gpu"
        if name == "type":
            return None
        device = kwargs.get("device")
        for a in rest:
            if isinstance(a, torch.Tensor):  # .to(other): where `other` is
                return "host" if self.on_host(a) else "gpu"
            if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
                device = a
        if device is None:
            return None
        return "host" if isinstance(device, str) and device == "cpu" else "gpu"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.paused or name == "__get__":  # an attribute (t.shape, t.device): no values
            return func(*args, **kwargs)
        tensors = _tensors(args, kwargs)
        self_t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        self_gpu = self_t is not None and not self.on_host(self_t)
        device = kwargs.get("device")
        if not tensors:
            self.factory_on_host = device is None or (isinstance(device, str) and device == "cpu")
        out = func(*args, **kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if name in READS:
            if self_gpu or (name in ("equal", "allclose") and any(not self.on_host(t) for t in tensors)):
                self.note("syncs", f"{name}()")
            if out is self_t and self_gpu:  # .cpu() on the CPU: a new tensor on a GPU, so a new one here
                out = out.view_as(out)
            self.mark(out, True)
            return out
        if name in ("to", "cuda", "type"):
            where = self.target(args[1:], kwargs, name)
            if where is None or (where == "host") != self_gpu:  # a dtype alone, or where it is already
                self.mark(out, not self_gpu)
                return out
            if self_gpu:
                self.note("syncs", f".{name}() to the host")
            else:
                self.copy_in(self_t, not kwargs.get("non_blocking", False), f".{name}(device)")
            if out is self_t:  # the CPU's no-op move is a new tensor on the other side in a GPU run
                out = out.view_as(out)
            self.mark(out, where == "host")
            return out
        if name in FACTORIES_FROM_DATA or name == "new_tensor":
            to_gpu = self_gpu if name == "new_tensor" else not self.factory_on_host
            if to_gpu:
                self.copy_in(outs[0] if outs else None, True, f"{name}(data) on the GPU")
            for t in outs:
                self.mark(t, not to_gpu)
            return out
        if name == "copy_" and self_gpu and len(args) > 1 and self.on_host(args[1]):
            blocking = not (kwargs.get("non_blocking") or (len(args) > 2 and args[2]))
            self.copy_in(args[1], blocking, "copy_(a host tensor)")
            return out
        gpu = [t for t in tensors if not self.on_host(t)]
        if name in SIZED_BY_VALUES and gpu:
            self.note("syncs", f"{name}() (output sized by values)")
        elif name == "where" and len(args) + len(kwargs) == 1 and gpu:
            self.note("syncs", "where(condition) (output sized by values)")
        elif name == "repeat_interleave" and gpu and "output_size" not in kwargs:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if isinstance(repeats, torch.Tensor):
                self.note("syncs", "repeat_interleave(tensor repeats) (output sized by values)")
        elif name in INDEXING and self_gpu:
            index = [t for t in tensors if t is not self_t]
            if any(t.dtype in (torch.bool, torch.uint8) for t in index):
                self.note("syncs", f"{name} with a boolean mask (output sized by values)")
            moved = [t for t in index if self.on_host(t) and t.dim() > 0]
            if moved:  # ATen moves a host index to the GPU (a blocking copy), so it is not mixed
                self.copy_in(moved[0], True, f"a host index in {name}")
            tensors = [t for t in tensors if not any(t is m for m in moved)]
        if gpu and any(self.on_host(t) and t.dim() > 0 for t in tensors):
            self.note("mixed", name)
        on_host = not gpu if tensors else (self.factory_on_host and not name.startswith("new_"))
        for t in outs:
            self.mark(t, on_host)
        return out


class _Launches(TorchDispatchMode):
    """ATen operations that launch work, counted where any tensor argument is on the GPU (`_Watch.on_host`)."""

    def __init__(self, seen: Seen, depth: int, watch: _Watch):
        super().__init__()
        self.seen, self.depth, self.watch = seen, depth, watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.watch.paused or name in NO_LAUNCH or getattr(func, "is_view", False):
            return out
        tensors = _tensors(args, kwargs)
        on_host = all(self.watch.on_host(t) for t in tensors) if tensors else self.watch.factory_on_host
        if on_host:
            self.seen.host_ops += 1
            for t in tree_flatten(out)[0]:  # inside a composite operation: host in, host out
                self.watch.mark(t, True)
        else:
            self.seen.ops[(name, _site(self.depth))] += 1
        return out


@contextlib.contextmanager
def _triton_launches(seen: Seen, run: bool, watch: _Watch):
    """Triton launches counted by kernel name; with run=False they return at once."""
    try:
        from triton.runtime import interpreter, jit
    except ImportError:  # no Triton: nothing to count
        yield
        return
    classes = [cls for cls in (interpreter.InterpretedFunction, jit.JITFunction) if "run" in cls.__dict__]
    saved = [(cls, cls.__dict__["run"]) for cls in classes]

    def counting(original):
        def call(self, *args, **kwargs):
            fn = getattr(self, "fn", self)
            seen.kernels[getattr(fn, "__name__", type(self).__name__)] += 1
            if not run:
                return None
            watch.paused += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                watch.paused -= 1

        return call

    for cls, original in saved:
        cls.run = counting(original)
    try:
        yield
    finally:
        for cls, original in saved:
            cls.run = original


@contextlib.contextmanager
def _from_numpy_on_host(watch: _Watch):
    """`torch.from_numpy` (not seen by a TorchFunctionMode: it takes no tensor) makes host tensors."""
    saved = torch.from_numpy

    def from_numpy(array):
        t = saved(array)
        watch.mark(t, True)
        return t

    torch.from_numpy = from_numpy
    try:
        yield
    finally:
        torch.from_numpy = saved


@contextlib.contextmanager
def watch(host=(), depth: int = 3, launches: bool = True):
    """Count, within the block, what a GPU run of it would sync on, copy and launch (module docstring).
    host: tensors made before the block that a GPU run holds on the host. depth: frames kept per site.
    launches=False: Triton kernels are counted and not run (their outputs are left unwritten).
    Yields a `Seen`, complete once the block ends."""
    seen = Seen()
    functions = _Watch(seen, depth, host)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_triton_launches(seen, launches, functions))
        stack.enter_context(_from_numpy_on_host(functions))
        stack.enter_context(functions)
        stack.enter_context(_Launches(seen, depth, functions))
        yield seen


@contextlib.contextmanager
def on_gpu_branches():
    """Within the block, `checks.should_validate` answers as on a GPU outside a graph's capture (`validate`,
    where the CPU always answers True), in every module that imported it: a call with validate=True reads
    its lengths and page ids, one with validate=False reads nothing."""
    from .. import checks

    original = checks.should_validate
    patched = [  # course_lib's modules only: another package's lazy attributes import on access (transformers')
        module for name, module in list(sys.modules.items())
        if (name == "course_lib" or name.startswith("course_lib.")) and module is not None
        and getattr(module, "should_validate", None) is original
    ]  # fmt: skip
    for module in patched:
        module.should_validate = lambda validate, device: bool(validate)
    try:
        yield
    finally:
        for module in patched:
            module.should_validate = original
