"""Launch configurations of the Triton attention kernels, as named data in one place (notebook 08).

A `Launch` (`AttentionLaunch`: like every launch-table entry of course_lib, a `kernels.launch.Launch`) is
what a kernel launch needs beyond its arguments: BLOCK_M query rows and BLOCK_N key rows per tile (the
paper's B_r and B_c), warps per program and the software-pipelining depth of the loads. Each kernel has a
`KernelConfigs` table:

- `candidates`: what the autotuner times on a GPU (kept from sweeps on an H200, notes/attention.md);
- `choose(d, causal, n, dtype)`: the configuration used without autotuning, from those sweeps;
- `cpu`: the one configuration of the interpreter (it cannot time several; small tiles keep its
  Python loop short).

Which configuration a call uses (`course_lib.attention.launch`): a choice recorded for this GPU in
`tuned/<gpu>.json` (written by `make bench`, which autotunes), else `choose`; with
`COURSE_AUTOTUNE=1` the autotuner times the candidates itself and records its choice.
A `config` dict given to `forward`/`backward` (notebook 08's ladder) fixes the launch instead:
`split_config` reads it, and `teaching_hooks` turns its switches into the teaching variants of
`teaching.py` that the kernels take as function arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels.launch import Launch as KernelLaunch
from ..kernels.launch import PerDevice, keyword
from . import teaching


@dataclass(frozen=True)
class AttentionLaunch(KernelLaunch):
    """One launch configuration: tile shape (block_m x block_n), warps, pipeline stages."""

    block_m: int = keyword("BLOCK_M")
    block_n: int = keyword("BLOCK_N")
    num_warps: int = keyword("num_warps")
    num_stages: int = keyword("num_stages")

    def as_list(self) -> list[int]:
        """[block_m, block_n, num_warps, num_stages]: an entry of the GPU's record (`launch.record_choice`)."""
        return list(self)


Launch = AttentionLaunch  # the name the launcher, the GPU's records and the sweeps use


@dataclass(frozen=True)
class KernelConfigs:
    """A kernel's configurations. `fp32`: fp32/fp64 inputs (exact "ieee" products, no 16-bit tensor-core
    tiles: small tiles); `wide_head`: d > 128 (BLOCK_D = 256: small tiles fit on chip); `short`:
    sequences under 1024 (few tiles: small ones keep every SM busy); `long`: a function of (d, causal, n)
    for 16-bit inputs, d <= 128, n >= 1024 (the benchmarked cells)."""

    name: str
    candidates: tuple[Launch, ...]
    cpu: Launch
    fixed: Launch  # the defaults of a `config` dict that names only some launch keys
    fp32: Launch
    wide_head: Launch
    short: Launch
    long: object = field(repr=False)

    def choose(self, d: int, causal: bool, n: int, dtype: torch.dtype, interpret: bool) -> Launch:
        """The configuration to use without autotuning."""
        if interpret:
            return self.cpu
        if dtype in (torch.float32, torch.float64):
            return self.fp32
        if d > 128:
            return self.wide_head
        if n < 1024:
            return self.short
        return self.long(d, causal, n)


L = AttentionLaunch

# Forward in float32 (tests, the fp32 generation of notebook 08b): its products are fp32 FMAs ("ieee"), and
# at d = 128 a 64 x 32 block with 4 warps took 8280 FMAs a thread and spilled 4 KB (ptxas for sm_90); 32 x 32
# takes half and spills 1.2 KB. Measured on an H100 (forward alone, (2, 16, 2048, d), median us, 64 x 32 ->
# 32 x 32): d = 128 causal 6387 -> 4138, full 10968 -> 7565; d = 64 causal 1971 -> 1742, full 3187 -> 3014;
# compiling it takes about half as long (a transformers model's greedy generation in fp32 with an empty
# Triton cache, four forward variants: 31 s -> 15 s).
# Forward (one program per query block). 128 x 64 with 8 warps (a warpgroup per 64 query rows) wins most
# shapes; 64 x 64 with 4 warps wins d = 128 at N <= 2k and causal up to 8k (two programs share an SM);
# 128 x 128 wins long causal d = 128. 128 x 64 with 4 warps spills registers at d = 128.
FORWARD = KernelConfigs(
    name="forward",
    candidates=(
        L(128, 64, 8, 3),
        L(128, 64, 8, 4),
        L(128, 128, 8, 3),
        L(64, 64, 4, 3),
        L(64, 64, 4, 2),
        L(128, 64, 4, 3),
    ),
    cpu=L(32, 32, 4, 1),
    fixed=L(64, 64, 4, 3),
    fp32=L(32, 32, 4, 2),
    wide_head=L(64, 32, 4, 2),
    short=L(64, 64, 4, 2),
    long=lambda d, causal, n: (
        L(64, 64, 4, 3) if d == 128 and (n <= 2048 or (causal and n <= 8192)) else L(128, 64, 8, 3)
    ),
)

# dK/dV (one program per key block): a tall K/V block amortises its stay on chip, short query steps keep
# the transposed tiles small. 32 x 128 / 4 warps wins d = 64; 64 x 128 / 8 warps wins d = 128 at long
# sequences; 64 x 64 / 4 warps wins causal at short ones. 32 x 64 / 4 warps / 2 stages wins causal
# grouped-query programs that sum 4 query heads on chip at d = 128 (H200, N = 1k-4k: 5-9 % faster than
# the multi-head choice; notes/attention.md); 64 x 64 / 4 warps / 3 stages won two grouped cells at
# d = 64 (causal 1k, non-causal 4k) once causal programs walk the group's heads in one loop
# (`scripts/gqa_speed.py --tune` records the grouped choices).
DKDV = KernelConfigs(
    name="dkdv",
    candidates=(
        L(32, 128, 4, 3),
        L(32, 64, 4, 3),
        L(64, 128, 8, 3),
        L(64, 128, 8, 2),
        L(64, 64, 4, 2),
        L(32, 128, 8, 3),
        L(32, 64, 4, 2),
        L(64, 64, 4, 3),
    ),
    cpu=L(32, 32, 4, 1),
    fixed=L(64, 64, 4, 2),
    fp32=L(32, 32, 4, 2),
    wide_head=L(32, 64, 8, 2),
    short=L(32, 64, 4, 2),
    long=lambda d, causal, n: (
        L(32, 128, 4, 3) if d <= 64 else L(64, 64, 4, 2) if causal and n <= 2048 else L(64, 128, 8, 3)
    ),
)

# dQ (one program per query block): a tall query block, short K/V steps; 128 x 64 / 8 warps wins almost
# everywhere, 64 x 64 / 4 warps at d = 64 causal.
DQ = KernelConfigs(
    name="dq",
    candidates=(
        L(128, 64, 8, 3),
        L(128, 64, 8, 2),
        L(64, 64, 4, 3),
        L(64, 32, 4, 3),
        L(128, 32, 8, 3),
        L(128, 32, 4, 3),
    ),
    cpu=L(32, 32, 4, 1),
    fixed=L(64, 64, 4, 2),
    fp32=L(32, 32, 4, 2),
    wide_head=L(64, 32, 8, 2),
    short=L(64, 32, 4, 2),
    long=lambda d, causal, n: L(64, 64, 4, 3) if d <= 64 and causal else L(128, 64, 8, 3),
)


@dataclass(frozen=True)
class PreprocessLaunch(KernelLaunch):
    """The preprocessing kernel of the atomic backward (D = rowsum(dO * O)): rows per program."""

    block_m: int = keyword("BLOCK_M")


PREPROCESS = PerDevice(interpreter=PreprocessLaunch(block_m=32), gpu=PreprocessLaunch(block_m=64))

# --------------------------------------------------------------------------------------------------
# A `config` dict (notebook 08's ladder): launch keys fix the launch, switches choose teaching variants
# (which always run with a fixed launch: the default choice and the GPU's record are the fast kernels')
# --------------------------------------------------------------------------------------------------
LAUNCH_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
BACKWARD_LAUNCH_KEYS = ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")
# The one set of switch defaults: the fast choice. exp2=False and skip_masked_blocks=False are the
# ladder's first rungs; hopper=False keeps the Triton forward and dK/dV kernels on a Hopper GPU.
SWITCHES = {
    "exp2": True,
    "skip_masked_blocks": True,
    "hopper": True,
    "hopper_dq": True,
    "hopper_onepass": True,
}


def split_config(config: dict | None, fixed: Launch | None) -> tuple[dict | None, dict]:
    """Split a user `config` into (launch parameters or None for the default choice, switches).

    If any launch key is given, or a switch that asks for a teaching variant (exp2=False,
    skip_masked_blocks=False), the launch is fixed (missing keys take `fixed`); otherwise the default
    choice is used. Switches come back upper-case (EXP2, SKIP_MASKED, HOPPER, HOPPER_DQ, HOPPER_ONEPASS), defaults
    from SWITCHES.
    BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2 (the backward's two kernels) are launch keys too."""
    if config is not None and not isinstance(config, dict):
        raise TypeError(f"config must be a dict of launch keys and switches (or None); got {config!r}")
    config = dict(config or {})
    unknown = set(config) - set(LAUNCH_KEYS) - set(SWITCHES) - set(BACKWARD_LAUNCH_KEYS)
    if unknown:
        known = LAUNCH_KEYS + tuple(SWITCHES) + BACKWARD_LAUNCH_KEYS
        raise ValueError(
            f"unknown config keys {sorted(unknown)}; known: {', '.join(known)} (BLOCK_*1/2: backward)"
        )
    switches = {
        upper: config.pop(name, SWITCHES[name])
        for name, upper in (
            ("exp2", "EXP2"),
            ("skip_masked_blocks", "SKIP_MASKED"),
            ("hopper", "HOPPER"),
            ("hopper_dq", "HOPPER_DQ"),
            ("hopper_onepass", "HOPPER_ONEPASS"),
        )
    }  # HOPPER: the Gluon forward and dK/dV; HOPPER_DQ: the Gluon dQ beside that dK/dV (the ladder's last rung);
    # HOPPER_ONEPASS: the one-pass Gluon backward where `hopper_onepass.choose` takes it
    for upper, value in switches.items():
        if not isinstance(value, (bool, int)) or value not in (0, 1):  # "no" would read as True
            raise TypeError(f"config switch {upper.lower()} must be True or False; got {value!r}")
        switches[upper] = bool(value)
    if not config and switches["EXP2"] and switches["SKIP_MASKED"]:
        return None, switches
    launch = fixed.kwargs()
    launch.update(config)
    for key, value in launch.items():
        if key.startswith("BLOCK") and (value < 16 or value & (value - 1)):
            raise ValueError(f"config {key}={value}: block sizes must be powers of two >= 16")
    return launch, switches


def teaching_hooks(switches: dict, names: tuple[str, ...]) -> dict:
    """The kernel function arguments that `split_config`'s switches ask for: {name: @triton.jit
    function} for those of `names` (the hooks one kernel takes) that a teaching variant replaces.

    {} for the fast switches: each kernel's defaults are the production helpers (`kernels.softmax.softmax_step`,
    `kernels.softmax.logsumexp`, `backward.probabilities`, `blocks.kv_block_range`, `blocks.q_block_range`).
    EXP2=False swaps in the natural-exponential softmax, SKIP_MASKED=False the every-block range."""
    if switches["EXP2"] and switches["SKIP_MASKED"]:
        return {}
    hooks = {}
    if not switches["EXP2"]:
        hooks.update(
            SOFTMAX_STEP=teaching.softmax_step_natural,
            LOGSUMEXP=teaching.logsumexp_natural,
            PROBABILITIES=teaching.probabilities_natural,
        )
    if not switches["SKIP_MASKED"]:
        hooks.update(KV_RANGE=teaching.every_kv_block, Q_RANGE=teaching.every_q_block)
    return {name: fn for name, fn in hooks.items() if name in names}


# What a call without `config` runs (`flash_attention`, the operators, packed sequences): the default
# choice of launch (None: `launch.py` picks one per shape) and the fast switches.
DEFAULT_LAUNCH, DEFAULT_SWITCHES = split_config(None, None)
