"""The launch tables of every kernel are one type (`course_lib.kernels.launch`): each entry is a frozen
`Launch` dataclass, and its `kwargs()` are keywords its kernel takes (the kernel's compile-time constants,
or the launch options num_warps, num_stages, maxnreg), with the values of its fields. Settings that differ
under the interpreter are `PerDevice` values, not dicts keyed "cpu" and "gpu".
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import pytest

from course_lib import runtime
from course_lib.attention import configs
from course_lib.decode import heuristics
from course_lib.fused import launch as fused
from course_lib.kernels.launch import Launch, PerDevice

OPTIONS = {"num_warps", "num_stages", "maxnreg"}  # Triton's launch options, not kernel parameters
DECODE_TABLES = ("TILES", "PAGED_TILES", "ROW_TILES", "SHORT_TILES", "ONE_WAVE_TILES")


def module(name: str):
    return importlib.import_module(f"course_lib.{name}")


def gluon(name: str):
    return pytest.importorskip(f"course_lib.attention.{name}", reason="needs a Triton with Gluon")


def constants(kernel) -> set[str]:
    """The compile-time parameters of a Triton or Gluon kernel (compiled or interpreted)."""
    params = inspect.signature(kernel.fn).parameters.values()
    return {p.name for p in params if "constexpr" in str(p.annotation)}


def attention(table: configs.KernelConfigs, kernel) -> list:
    rules = [
        table.long(d, causal, n)
        for d in (32, 64, 128)
        for causal in (False, True)
        for n in (1024, 4096, 16384)
    ]
    entries = [*table.candidates, table.cpu, table.fixed, table.fp32, table.wide_head, table.short, *rules]
    return [(entry, kernel) for entry in entries]


def decode() -> list:
    tables = [
        name for name, value in vars(heuristics).items() if name.endswith("TILES") and isinstance(value, dict)
    ]
    assert set(DECODE_TABLES) <= set(tables), tables
    kernel = module("decode.split_kv").split_kv_kernel
    return [(tile, kernel) for name in tables for tile in getattr(heuristics, name).values()]


def fused_tables() -> list:
    norm, rope = module("fused.rms_norm"), module("fused.rope")
    forward = [
        (entry, norm.rms_norm_fwd_chunked_kernel if entry.chunk else norm.rms_norm_fwd_kernel)
        for _, entry in fused.RMS_FORWARD
    ]
    backward = [(entry, norm.rms_norm_bwd_kernel) for _, entry in fused.RMS_BACKWARD]
    return [*forward, *backward, (fused.COLUMN_SUM, norm.column_sum_kernel)] + [
        (entry, rope.rope_kernel) for _, entry in fused.ROPE
    ]


def hopper_forward() -> list:
    hopper = gluon("hopper")
    chosen = [
        hopper.choose(d, causal, n, n) for d in (64, 128) for causal in (False, True) for n in (1024, 16384)
    ]
    variants = [hopper.D128_SHORT, hopper.D128_LONG, hopper.D64, *sum(hopper.VARIANTS.values(), ())]
    return [(v, hopper.fwd_ws_kernel) for v in variants + [c for c in chosen if c is not None]]


def hopper_backward() -> list:
    kernels = gluon("hopper_backward")
    return [(entry, kernels.dkdv_ws_kernel) for entry in kernels.LAUNCHES.values()]


def per_device(value: PerDevice, kernel) -> list:
    return [(value.interpreter, kernel), (value.gpu, kernel)]


TABLES = {
    "attention forward": lambda: attention(configs.FORWARD, module("attention.forward")._fwd_kernel),
    "attention dK/dV": lambda: attention(configs.DKDV, module("attention.backward")._dkdv_kernel),
    "attention dQ": lambda: attention(configs.DQ, module("attention.backward")._dq_kernel),
    "attention preprocess": lambda: per_device(
        configs.PREPROCESS, module("attention.d_pass").preprocess_kernel
    ),
    "attention group sum": lambda: per_device(
        module("attention.backward").GROUP_SUM, module("attention.backward")._group_sum_kernel
    ),
    "decode tiles": decode,
    "fused": fused_tables,
    "hopper forward": hopper_forward,
    "hopper dK/dV": hopper_backward,
}


@pytest.mark.parametrize("name", list(TABLES))
def test_every_entry_is_a_frozen_launch(name):
    entries = TABLES[name]()
    assert entries, name
    for entry, _ in entries:
        assert isinstance(entry, Launch) and dataclasses.is_dataclass(entry), (name, entry)
        assert type(entry).__dataclass_params__.frozen, (name, type(entry))
        first = dataclasses.fields(entry)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(entry, first, getattr(entry, first))
        assert type(entry)(*entry) == entry, f"{name}: {entry} does not unpack in its fields' order"


@pytest.mark.parametrize("name", list(TABLES))
def test_kwargs_are_the_kernels_launch_keywords(name):
    for entry, kernel in TABLES[name]():
        kwargs = entry.kwargs()
        unknown = set(kwargs) - constants(kernel) - OPTIONS
        assert kwargs and not unknown, f"{name}: {entry} gives {sorted(unknown)}, not keywords of its kernel"
        for field in dataclasses.fields(entry):
            key = field.metadata.get("keyword")
            if key in kwargs:
                assert kwargs[key] == getattr(entry, field.name), (name, entry, key)


def test_interpreter_and_gpu_settings_are_named():
    """`PerDevice` values (no {"cpu": .., "gpu": ..} dicts in the table modules), and `current()` picks
    the interpreter's under the interpreter."""
    backward = module("attention.backward")
    for value in (configs.PREPROCESS, backward.GROUP_SUM):
        assert isinstance(value, PerDevice)
        assert value.current() is (value.interpreter if runtime.INTERPRET else value.gpu)
    for name in ("attention.configs", "attention.backward", "decode.heuristics", "fused.launch"):
        for key, value in vars(module(name)).items():
            assert not (isinstance(value, dict) and {"cpu", "gpu"} & set(value)), f"{name}.{key}"
