"""Start a few CPU processes joined by torch.distributed's gloo backend, from a notebook or a test
(notebook 13).

    results = run_ranks(fn, world=4, args=(...,))   # fn(rank, world, *args) in each process

Each rank is a fresh Python process (multiprocessing "spawn": forking a process that already runs torch
threads can hang), so `fn` must be importable: a function of a module, not one defined in a notebook
cell (`course_lib.distributed.workers` holds the ones the course uses). What `fn` returns comes back in a
list indexed by rank; keep it small and plain (numbers, lists, dicts), it travels through a pipe.
On a GPU machine the same code runs under `torchrun` with the NCCL backend instead (scripts/ring_bench.py).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import socket
import time
import traceback

# NVLink multicast (NVLS) stays off: the ring needs point-to-point transfers only, and multicast can
# disturb other jobs on a shared host. Set before NCCL starts.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank: int, world: int, port: int, args: tuple, results, backend: str) -> None:
    """One rank: join the group, run fn, report (rank, ok, value or traceback), leave the group."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share the machine's cores
    try:
        if backend == "nccl":
            for name, value in NCCL_ENV.items():
                os.environ.setdefault(name, value)
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        value = fn(rank, world, *args)
        results.put((rank, True, value))
    except BaseException:  # report anything, so the parent can name the rank that failed
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, args: tuple = (), timeout: float = 120.0, backend: str = "gloo") -> list:
    """Run fn(rank, world, *args) in `world` new processes that form a gloo process group.

    backend: "gloo" (CPU processes) or "nccl" (rank r on GPU r; for tests on a machine with several
    GPUs). Returns [fn's result on rank 0, ..., on rank world - 1]. Raises RuntimeError with the failing
    rank's traceback if any rank fails, and TimeoutError (after stopping the processes) if they have
    not all finished within `timeout` seconds. Taught in notebook 13."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"run_ranks: world must be a positive integer, got {world!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"run_ranks: backend must be 'gloo' or 'nccl', got {backend!r}")
    for attempt in range(PORT_ATTEMPTS):
        try:
            return _run_once(fn, world, args, timeout, backend, free_port())
        except _PortTaken:
            if attempt == PORT_ATTEMPTS - 1:
                raise RuntimeError(
                    f"run_ranks: the rendezvous port was taken by another process {PORT_ATTEMPTS} times in a row"
                ) from None
    raise AssertionError("unreachable")


# `free_port` finds a port free when asked; another process may bind it before rank 0 does (a race that
# shows on busy machines). Such a start is retried with a new port this many times in all.
PORT_ATTEMPTS = 3


class _PortTaken(Exception):
    """Rank 0 could not listen on the rendezvous port: another process took it after `free_port`."""


def _run_once(fn, world: int, args: tuple, timeout: float, backend: str, port: int) -> list:
    """`run_ranks` with this rendezvous port; raises _PortTaken if the port was taken meanwhile."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world, port, args, results, backend))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise RuntimeError(
                        f"run_ranks: rank {dead[0]} exited with code {procs[dead[0]].exitcode}"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"run_ranks: {world} ranks did not finish within {timeout} s"
                    ) from None
                continue
            if not ok:
                if "EADDRINUSE" in value or "address already in use" in value:
                    raise _PortTaken
                raise RuntimeError(f"run_ranks: rank {rank} of {world} failed:\n{value}")
            out[rank] = value
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
    return [out[r] for r in range(world)]
