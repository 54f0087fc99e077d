"""Launch sizes shared by the fused kernels (RMSNorm and RoPE, notebook 11).

Both are memory-bound: a program should own enough bytes to keep many loads in flight, and no more
registers than it needs. Two named tables answer the two launch questions:
- `num_warps(block)`: threads per program for a row of `block` elements (more warps for longer rows,
  so that each thread holds a few 16-byte vectors, not dozens);
- `persistent_programs(n_rows, block)`: how many programs a persistent kernel (one that loops over
  rows, as the RMSNorm backward does) launches: a few per streaming multiprocessor (SM), so the GPU is
  full once and the per-program partial results (the dW partial sums) stay few.
"""

from __future__ import annotations

import functools

import torch

from .. import runtime

# Longest row (elements) that one program keeps in registers: the kernels read a row once.
MAX_ROW = 1 << 16

# block (elements, a power of two) -> warps per program; the first entry whose bound is >= block wins.
WARPS = ((1024, 4), (4096, 8), (16384, 16), (MAX_ROW, 32))

# block -> programs per SM for persistent kernels: short rows leave room for more programs per SM.
PROGRAMS_PER_SM = ((2048, 4), (8192, 2), (MAX_ROW, 1))

# Under the interpreter programs run one after another: few programs keep the loop visible and cheap.
INTERPRETER_PROGRAMS = 4


def _lookup(table: tuple[tuple[int, int], ...], block: int) -> int:
    for bound, value in table:
        if block <= bound:
            return value
    raise ValueError(f"a row of {block} elements is longer than one program can hold ({MAX_ROW})")


def num_warps(block: int) -> int:
    """Warps per program for a row of `block` elements (see `WARPS`)."""
    return _lookup(WARPS, block)


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H200)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def persistent_programs(n_rows: int, block: int, device: torch.device) -> int:
    """Programs for a kernel that loops over `n_rows` rows of `block` elements: a few per SM on a
    GPU (see `PROGRAMS_PER_SM`), `INTERPRETER_PROGRAMS` under the interpreter; never more than rows."""
    if runtime.INTERPRET or device.type != "cuda":
        wanted = INTERPRETER_PROGRAMS
    else:
        wanted = sm_count(device) * _lookup(PROGRAMS_PER_SM, block)
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
