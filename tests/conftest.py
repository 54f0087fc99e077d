"""Set-up shared by every test: the tests that write records (to temporary folders) write them whatever
the shell's COURSE_RECORDS says; a test of COURSE_RECORDS=off sets it itself."""

import pytest


@pytest.fixture(autouse=True)
def _records_written(monkeypatch):
    monkeypatch.delenv("COURSE_RECORDS", raising=False)
