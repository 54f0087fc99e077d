"""Set-up shared by every test: the tests that write records (to temporary folders) write them whatever
the shell's COURSE_RECORDS says; a test of COURSE_RECORDS=off sets it itself."""

import pytest


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
