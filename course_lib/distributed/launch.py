"""Start a few CPU processes joined by torch.distributed's gloo backend, from a notebook, a script or a
test (notebook 13).

    results = run_ranks(fn, world=4, args=(...,))   # fn(rank, world, *args) in each process

Each rank is a fresh Python interpreter (forking a process that already runs torch threads can hang),
started as `python -c <bootstrap>`: it takes the parent's sys.path, imports `fn` by name, runs it and
writes what it returned to a file that the parent reads. Unlike multiprocessing's "spawn", the ranks never
import the parent's `__main__`, so the caller needs no `if __name__ == "__main__":` guard: a notebook
exported as a plain script (`python notebooks/13_ring_attention.py`) runs as it does in Jupyter. So `fn`
must be importable: a function of a module, not one defined in a notebook cell or in the script that
calls run_ranks (`course_lib.distributed.workers` holds the ones the course uses). What `fn` returns comes
back in a list indexed by rank; keep it small and plain (numbers, lists, dicts): it travels pickled.
On a GPU machine the same code runs under `torchrun` with the NCCL backend instead (scripts/ring_bench.py).
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback

# NVLink multicast (NVLS) stays off: the ring needs point-to-point transfers only, and multicast can
# disturb other jobs on a shared host. Set before NCCL starts.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# What a rank's interpreter runs: the parent's sys.path first (so course_lib and the module of `fn` are
# found as the parent found them), then `_rank_main` on the rest of stdin.
_BOOTSTRAP = (
    "import pickle, sys; sys.path[:] = pickle.load(sys.stdin.buffer); "
    "from course_lib.distributed.launch import _rank_main; _rank_main(sys.stdin.buffer)"
)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(stream) -> None:
    """One rank (in its own interpreter): read (fn, rank, world, port, args, backend, result path) from
    `stream`, join the group, run fn, write (ok, value or traceback) to the result path, leave the group."""
    fn, rank, world, port, args, backend, result_path = pickle.load(stream)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # the ranks share the machine's cores
        if backend == "nccl":
            for name, value in NCCL_ENV.items():
                os.environ.setdefault(name, value)
            torch.cuda.set_device(rank)
        try:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
            )
            report = (True, fn(rank, world, *args))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException:  # report anything, so the parent can name the rank that failed
        report = (False, traceback.format_exc())
    try:
        blob = pickle.dumps(report)
    except Exception:  # fn returned something that cannot travel
        blob = pickle.dumps((False, traceback.format_exc()))
    partial = f"{result_path}.partial"
    with open(partial, "wb") as f:
        f.write(blob)
    os.replace(partial, result_path)  # the parent sees a whole file or none


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
    if getattr(fn, "__module__", None) == "__main__":
        raise ValueError(
            f"run_ranks: {getattr(fn, '__qualname__', fn)!r} is defined in __main__ (a notebook cell or the "
            "script that calls run_ranks); each rank is a new process that imports fn, so define it in a "
            "module (course_lib.distributed.workers holds the course's)"
        )
    try:  # before any process starts
        pickle.dumps((fn, args))
    except Exception as e:
        raise ValueError(
            f"run_ranks: fn and args must be picklable (a module-level function, plain values): {e}"
        ) from e
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


def _start(fn, rank: int, world: int, port: int, args: tuple, backend: str, result_path: str):
    """One rank's interpreter, its inputs written to its stdin."""
    proc = subprocess.Popen([sys.executable, "-c", _BOOTSTRAP], stdin=subprocess.PIPE)
    try:
        pickle.dump(list(sys.path), proc.stdin)
        pickle.dump((fn, rank, world, port, args, backend, result_path), proc.stdin)
        proc.stdin.close()
    except BrokenPipeError:  # it died at start-up: its exit code reports it
        pass
    return proc


def _run_once(fn, world: int, args: tuple, timeout: float, backend: str, port: int) -> list:
    """`run_ranks` with this rendezvous port; raises _PortTaken if the port was taken meanwhile."""
    out: dict[int, object] = {}
    with tempfile.TemporaryDirectory(prefix="run_ranks_") as tmp:
        paths = [os.path.join(tmp, f"rank{r}.pickle") for r in range(world)]
        procs = []
        deadline = time.monotonic() + timeout
        try:
            for r in range(world):
                procs.append(_start(fn, r, world, port, args, backend, paths[r]))
            while len(out) < world:
                exited = {r: p.poll() for r, p in enumerate(procs)}  # before the files: no race
                for r in range(world):
                    if r in out or not os.path.exists(paths[r]):
                        continue
                    with open(paths[r], "rb") as f:
                        ok, value = pickle.load(f)
                    if not ok:
                        if "EADDRINUSE" in value or "address already in use" in value:
                            raise _PortTaken
                        raise RuntimeError(f"run_ranks: rank {r} of {world} failed:\n{value}")
                    out[r] = value
                dead = [r for r, code in exited.items() if code is not None and r not in out]
                if dead:
                    raise RuntimeError(f"run_ranks: rank {dead[0]} exited with code {exited[dead[0]]}")
                if len(out) < world:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"run_ranks: {world} ranks did not finish within {timeout} s")
                    time.sleep(0.05)
            for p in procs:
                try:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(5)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
    return [out[r] for r in range(world)]
