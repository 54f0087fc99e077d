"""Set-up shared by every test: the tests that write records (to temporary folders) write them whatever
the shell's COURSE_RECORDS says; a test of COURSE_RECORDS=off sets it itself. On a GPU each test hands
the memory it cached back to the device, so that the other test processes sharing the GPU can use it."""

import os

import pytest


def pytest_configure(config):
    """Under pytest-xdist, share the machine's cores among the workers: torch's default (one thread per
    core in every worker) oversubscribes the CPU, two workers x two threads on a 2-core machine, and its
    threads then wait for each other. Left alone where the user set OMP_NUM_THREADS."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "PYTEST_XDIST_WORKER" in os.environ and "OMP_NUM_THREADS" not in os.environ:
        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // workers))


@pytest.fixture(autouse=True)
def _records_written(monkeypatch):
    monkeypatch.delenv("COURSE_RECORDS", raising=False)


@pytest.fixture(autouse=True)
def _random_draws_follow_the_test(request):
    """Seed PyTorch's global generator from the test's own id, so a test draws the same random inputs
    whichever tests ran before it in its process (a failure seen in CI comes back when the test runs alone),
    and different tests still draw different inputs."""
    import zlib

    import torch

    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _no_plans_from_other_tests():
    """Plans (`course_lib.kernels.plans`: attention's, decoding's) remember the decisions of calls seen before;
    a test that patches a decision (a route, a launch rule) must not meet a plan another test left."""
    import sys

    for name in ("course_lib.attention.plans", "course_lib.kernels.plans"):
        plans = sys.modules.get(name)
        if plans is not None and hasattr(plans, "clear"):
            plans.clear()
        elif plans is not None:
            plans.clear_all()


# `make test-gpu` runs a worker per 12 GiB of GPU memory at most (`runtime.gpu_test_workers`); most tests take far
# less, a few a little more (12.6 GiB, 2026-12-01). A test that holds twice that starves the others' tests of
# memory, and they, not it, fail out of memory (the training bench's quick run once took 105 GiB).
GPU_TEST_GIB = 24


@pytest.fixture(autouse=True)
def _gpu_memory_returned(request):
    """PyTorch's caching allocator keeps a process's freed GPU memory for that process: after a test
    with a large float64 reference, a worker of `make test-gpu` (pytest -n) would hold gigabytes the
    other workers need. Empty the cache after each test that used the GPU. A test whose peak passed
    GPU_TEST_GIB is named in a warning; COURSE_GPU_MEMORY_LOG=path appends every GPU test's peak there."""
    yield
    import torch

    if not torch.cuda.is_initialized():
        return
    peak = torch.cuda.max_memory_reserved() / 2**30
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.empty_cache()
    if os.environ.get("COURSE_GPU_MEMORY_LOG"):
        with open(os.environ["COURSE_GPU_MEMORY_LOG"], "a") as log:
            log.write(f"{peak:.2f} GiB\t{os.getpid()}\t{request.node.nodeid}\n")
    if peak > GPU_TEST_GIB:
        import warnings

        warnings.warn(
            f"{request.node.nodeid} held {peak:.1f} GiB of GPU memory, over {GPU_TEST_GIB}: twice what a test "
            "process of make test-gpu may count on",
            stacklevel=1,
        )


@pytest.fixture(scope="module")
def one_thread():
    """One CPU thread for a module's tests (`pytestmark = pytest.mark.usefixtures("one_thread")`): small
    models' matrices run several times faster on a shared machine than with a thread per core."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
