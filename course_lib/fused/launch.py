"""Launch sizes shared by the fused kernels (RMSNorm and RoPE, notebook 11).

Both are memory-bound: a program should own enough bytes to keep many loads in flight, and no more
registers than it needs. The named tables below are the one place where launch sizes are chosen; each
kernel's host function reads them through the helpers and also takes the value as a keyword argument,
so a sweep (`exp/fused_sweep.py` style) can try other settings without editing the tables.

- `WARPS`: threads per program for a tile of `block` elements (more warps for bigger tiles, so that each
  thread holds a few 16-byte vectors, not dozens);
- `FWD_ROWS`: rows per program of the RMSNorm forward, by row length: short rows are grouped into one
  (ROWS, BLOCK_D) tile, so that a program still moves a few kilobytes;
- `BWD_ROWS`: rows per loop iteration of the RMSNorm backward, a (ROWS, BLOCK_D) tile of x and dy loaded
  together: more bytes in flight per program than one row at a time;
- `PROGRAMS_PER_SM`: how many programs the persistent RMSNorm backward launches per streaming
  multiprocessor (SM); each program writes one row of dW partial sums;
- `COLUMN_SUM`: the tile of the Triton column-sum kernel that adds the (P, D) dW partial sums;
- `ROPE_TOKENS`: tokens per RoPE program, by the size of one token's q tile.
The values are first guesses from the sizes involved, to be replaced by the measured best settings.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .. import runtime

# Longest row (elements) that one program keeps in registers: the kernels read a row once.
MAX_ROW = 1 << 16

# tile (elements, a power of two) -> warps per program; the first entry whose bound is >= tile wins.
WARPS = ((1024, 4), (4096, 8), (16384, 16), (MAX_ROW, 32))

# BLOCK_D -> rows per program (forward) / rows per loop iteration (backward); tiles of >= 4k elements.
FWD_ROWS = ((1024, 4), (2048, 2), (MAX_ROW, 1))
BWD_ROWS = ((1024, 8), (2048, 4), (4096, 2), (MAX_ROW, 1))

# BLOCK_D -> programs per SM for the persistent backward: short rows leave room for more programs per SM.
PROGRAMS_PER_SM = ((2048, 4), (8192, 2), (MAX_ROW, 1))


class ColumnSumTile(NamedTuple):
    """The (BLOCK_R, BLOCK_C) tile the column-sum kernel loads per loop step, and its warps."""

    block_r: int
    block_c: int
    warps: int


COLUMN_SUM = ColumnSumTile(block_r=32, block_c=64, warps=4)

# BLOCK_HQ * BLOCK_PAIRS (one token's q tile, pairs) -> tokens per RoPE program.
ROPE_TOKENS = ((512, 8), (2048, 2), (MAX_ROW, 1))

# Under the interpreter programs run one after another: few programs keep the loop visible and cheap.
INTERPRETER_PROGRAMS = 4


def _lookup(table: tuple[tuple[int, int], ...], block: int) -> int:
    for bound, value in table:
        if block <= bound:
            return value
    raise ValueError(f"a tile of {block} elements is larger than one program can hold ({MAX_ROW})")


def num_warps(block: int) -> int:
    """Warps per program for a tile of `block` elements (see `WARPS`)."""
    return _lookup(WARPS, block)


def fwd_rows(block: int) -> int:
    """Rows per program of the RMSNorm forward for rows of BLOCK_D = `block` (see `FWD_ROWS`)."""
    return _lookup(FWD_ROWS, block)


def bwd_rows(block: int) -> int:
    """Rows per loop iteration of the RMSNorm backward for BLOCK_D = `block` (see `BWD_ROWS`)."""
    return _lookup(BWD_ROWS, block)


def rope_tokens(token_tile: int) -> int:
    """Tokens per RoPE program when one token's q tile has `token_tile` pairs (see `ROPE_TOKENS`)."""
    return _lookup(ROPE_TOKENS, token_tile)


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H200)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def persistent_programs(n_rows: int, block: int, device: torch.device, per_sm: int | None = None) -> int:
    """Programs for a kernel that loops over `n_rows` rows of `block` elements: `per_sm` per SM on a
    GPU (default from `PROGRAMS_PER_SM`); under the interpreter the CPU counts as one SM, with
    `INTERPRETER_PROGRAMS` programs by default. Never more than the rows."""
    if runtime.INTERPRET or device.type != "cuda":
        wanted = per_sm or INTERPRETER_PROGRAMS
    else:
        wanted = sm_count(device) * (per_sm or _lookup(PROGRAMS_PER_SM, block))
    return max(1, min(n_rows, wanted))


def check_on_kernel_device(where: str, **tensors: torch.Tensor) -> None:
    """Every tensor must be a torch.Tensor on the device where the kernels run (`course_lib.DEVICE`)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != runtime.DEVICE.type:
            raise ValueError(
                f"{where}: {name} is on {t.device} but the Triton kernels run on {runtime.DEVICE} here "
                "(move it with .to(course_lib.DEVICE))"
            )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
