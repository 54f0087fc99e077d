"""Launch sizes shared by the fused kernels (RMSNorm and RoPE, notebook 11).

Both are memory-bound: a program should own enough bytes to keep many loads in flight, and no more
registers than it needs. The named tables below are the one place where launch sizes are chosen; each
kernel's host function reads them through the helpers and also takes the value as a keyword argument,
so a sweep can try other settings without editing the tables. Each entry is a `kernels.launch.Launch`,
whose `kwargs()` are its kernel's launch keywords.

- `WARPS`: threads per program for a tile of `block` elements where no measured setting applies (more
  warps for bigger tiles, so that each thread holds a few 16-byte vectors, not dozens);
- `RMS_FORWARD`: rows per program and warps of the RMSNorm forward, by row length (BLOCK_D), and the
  chunk of the chunked kernel that long rows use;
- `RMS_BACKWARD`: rows per loop iteration, programs per streaming multiprocessor (SM) and warps of the
  persistent RMSNorm backward, by row length; each program writes one row of dW partial sums;
- `COLUMN_SUM`: the tile of the Triton column-sum kernel that adds the (P, D) dW partial sums;
- `ROPE`: tokens per RoPE program and warps, by the size of one token's q tile.
The entries for rows of 2048-8192 elements and the RoPE tile of 32 heads x 64 pairs are the fastest of a
sweep on an H200 (bf16, T = 4k-64k tokens, every setting timed as a CUDA-graph replay); the others are
first guesses from the sizes involved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import runtime
from ..kernels.launch import Launch, keyword

# Longest row (elements) that one program keeps in registers: the kernels read a row once.
MAX_ROW = 1 << 16

# tile (elements, a power of two) -> warps per program; the first entry whose bound is >= tile wins.
WARPS = ((1024, 4), (4096, 8), (16384, 16), (MAX_ROW, 32))


@dataclass(frozen=True)
class RowLaunch(Launch):
    """RMSNorm forward: rows per program (a (rows, BLOCK_D) tile) and warps; chunk > 0: the chunked
    kernel instead, one row per program in pieces of `chunk` elements."""

    rows: int = keyword("ROWS")
    warps: int = keyword("num_warps")
    chunk: int = keyword("CHUNK", default=0)

    def kwargs(self) -> dict:
        """The launch keywords of the kernel this runs: ROWS for `rms_norm_fwd_kernel`, CHUNK (chunk > 0)
        for `rms_norm_fwd_chunked_kernel`; num_warps for both."""
        kwargs = super().kwargs()
        del kwargs["ROWS" if self.chunk else "CHUNK"]
        return kwargs


@dataclass(frozen=True)
class BackwardLaunch(Launch):
    """RMSNorm backward: rows per loop iteration, programs per SM, warps; stream: x and dy loaded
    evict_first and dx stored with the streaming hint (.cs)."""

    rows: int = keyword("ROWS")
    programs_per_sm: int
    warps: int = keyword("num_warps")
    stream: bool = keyword("STREAM", default=False)


@dataclass(frozen=True)
class RopeLaunch(Launch):
    """RoPE: tokens per program and warps."""

    tokens: int = keyword("TOKENS")
    warps: int = keyword("num_warps")


# BLOCK_D -> launch; the first entry whose bound is >= BLOCK_D wins.
RMS_FORWARD = (
    (1024, RowLaunch(rows=4, warps=8)),
    (2048, RowLaunch(rows=1, warps=4)),  # measured
    (4096, RowLaunch(rows=4, warps=16)),  # measured
    (8192, RowLaunch(rows=1, warps=16, chunk=8192)),  # measured: one piece, read twice (as torch.compile)
    (16384, RowLaunch(rows=1, warps=16, chunk=4096)),
    (MAX_ROW, RowLaunch(rows=1, warps=16, chunk=4096)),
)
RMS_BACKWARD = (
    (1024, BackwardLaunch(rows=8, programs_per_sm=4, warps=16)),
    (2048, BackwardLaunch(rows=1, programs_per_sm=4, warps=8)),  # measured
    (4096, BackwardLaunch(rows=1, programs_per_sm=2, warps=16)),  # measured
    (8192, BackwardLaunch(rows=1, programs_per_sm=1, warps=16, stream=True)),  # measured, see below
    (16384, BackwardLaunch(rows=1, programs_per_sm=1, warps=16, stream=True)),
    (MAX_ROW, BackwardLaunch(rows=1, programs_per_sm=1, warps=32, stream=True)),
)
# The streaming hints pay off for long rows only. Measured on an H200 (bf16, graph replays, us, without /
# with them): D = 8192 at 1 program per SM, 16 warps: T = 4k 62.6 / 61.4, 16k 225.2 / 218.5 (86 % of
# the copy ceiling; the 2 x 8 warps launch before: 231.0), 64k 871.9 / 845.6; D = 4096 (2 x 16):
# 16k 107.0 / 110.7, 64k 395.6 / 423.5; D = 2048 (4 x 8): 16k 55.9 / 57.0, 64k 198.6 / 209.5.


@dataclass(frozen=True)
class ColumnSumTile(Launch):
    """The (BLOCK_R, BLOCK_C) tile the column-sum kernel loads per loop step, and its warps."""

    block_r: int = keyword("BLOCK_R")
    block_c: int = keyword("BLOCK_C")
    warps: int = keyword("num_warps")


# measured: 528 x 2048 partial rows summed in 7.0 us (the 64 x 32 tile, 64 programs: 16.8 us)
COLUMN_SUM = ColumnSumTile(block_r=128, block_c=16, warps=8)

# BLOCK_HQ * BLOCK_PAIRS (one token's q tile, pairs) -> RoPE launch.
ROPE = (
    (512, RopeLaunch(tokens=4, warps=4)),
    (2048, RopeLaunch(tokens=1, warps=4)),  # measured: 32 heads x 64 pairs
    (MAX_ROW, RopeLaunch(tokens=1, warps=8)),
)

# The "keep" cache hint: loads that ask the L2 to keep their lines ("evict_last", as torch.compile's
# kernels mark RoPE's cos, sin and rotate_half loads and RMSNorm's first pass over a row) pay when the
# tensors a kernel streams hold more than KEEP_L2_MULTIPLE times the GPU's L2 cache, and cost where they
# nearly fit in it (`keep_hint`). Measured on an H200 (L2 60 MiB; bf16, CUDA-graph replays, us, no hint
# -> the hint; notes/fused.md):
# - RoPE, every load (q, k, cos, sin) of (T, 32, 128) q and (T, 8, 128) k, forward / backward: T = 64k
#   (q and k 671 MB) 332.8 -> 321.0 / 329.5 -> 318.3; 16k (168 MB) 82.8 -> 82.6 / 83.6 -> 82.4; 4k
#   (42 MB) 23.1 -> 23.4 / 23.1 -> 23.7 (torch.compile's forward: 327.2, 85.3, 25.4);
# - RMSNorm forward at D = 8192, the chunked kernel's first pass over x: T = 4k (x 67 MB) 32.7 -> 33.5;
#   16k 130.2 -> 126.0; 64k 518.9 -> 497.4 (torch.compile: 32.7, 125.4, 496.6).
KEEP_L2_MULTIPLE = 2

# Under the interpreter programs run one after another: few programs keep the loop visible and cheap.
INTERPRETER_PROGRAMS = 4

# Fewer programs where a few would otherwise take one row more than all the others (`persistent_programs`),
# only where each SM holds this many or more. Measured on an H200 (bf16, RMSNorm backward, graph replays,
# best of three, us, programs as wanted / cut): 4 per SM (D = 2048): T = 4k 20.6 / 20.4 (528 / 512), 16k
# 55.5 / 55.5 (528 / 512), 64k 197.2 / 195.6 (528 / 525); 2 per SM (D = 4096): 4k 33.1 / 33.7 (264 / 256),
# 16k 106.0 / 105.4 (264 / 261); 1 per SM (D = 8192): 4k 60.2 / 63.6 (132 / 128: four SMs left idle).
BALANCE_MIN_PER_SM = 4


def _lookup(table: tuple, block: int):
    for bound, value in table:
        if block <= bound:
            return value
    raise ValueError(f"a tile of {block} elements is larger than one program can hold ({MAX_ROW})")


def num_warps(block: int) -> int:
    """Warps per program for a tile of `block` elements (see `WARPS`)."""
    return _lookup(WARPS, block)


def rms_forward(block: int) -> RowLaunch:
    """The RMSNorm forward's launch for rows of BLOCK_D = `block` (see `RMS_FORWARD`)."""
    return _lookup(RMS_FORWARD, block)


def rms_backward(block: int) -> BackwardLaunch:
    """The RMSNorm backward's launch for rows of BLOCK_D = `block` (see `RMS_BACKWARD`)."""
    return _lookup(RMS_BACKWARD, block)


def rope(token_tile: int) -> RopeLaunch:
    """The RoPE launch when one token's q tile has `token_tile` pairs (see `ROPE`)."""
    return _lookup(ROPE, token_tile)


def keep_hint(nbytes: int, device: torch.device) -> str:
    """The cache hint for loads of a kernel that streams `nbytes` bytes of input (see `KEEP_L2_MULTIPLE`):
    "evict_last" on a GPU whose L2 they overflow that many times, else none ("")."""
    if device.type != "cuda":
        return ""
    return "evict_last" if nbytes > KEEP_L2_MULTIPLE * runtime.l2_cache_size(device.index) else ""


def persistent_programs(n_rows: int, block: int, device: torch.device, per_sm: int | None = None) -> int:
    """Programs for a kernel that loops over `n_rows` rows of `block` elements: `per_sm` per SM on a
    GPU (default from `RMS_BACKWARD`); under the interpreter the CPU counts as one SM, with
    `INTERPRETER_PROGRAMS` programs by default. Never more than the rows.

    With `BALANCE_MIN_PER_SM` or more programs per SM, also no more than the longest program's share of
    rows needs: program p takes rows p, p + P, ..., so with P programs the longest takes cdiv(n_rows, P),
    and the fewest programs with that longest share are cdiv(n_rows, cdiv(n_rows, P)) (65536 rows over
    528 programs: 64 of them take a 125th row after the others have finished; over 525, 436 do)."""
    if runtime.INTERPRET or device.type != "cuda":
        per_sm = per_sm or INTERPRETER_PROGRAMS
        wanted = per_sm
    else:
        per_sm = per_sm or rms_backward(block).programs_per_sm
        wanted = runtime.sm_count(device.index) * per_sm
    wanted = max(1, min(n_rows, wanted))
    if per_sm < BALANCE_MIN_PER_SM:
        return wanted
    return runtime.cdiv(n_rows, runtime.cdiv(n_rows, wanted))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
