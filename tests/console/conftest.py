import time

import pytest


@pytest.fixture
def utc(monkeypatch):
    """Event times print in local time: pin the zone so snapshots do not depend on the machine."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.fixture
def live_daemon(request):
    """The real daemon of tests/conftest.py (duckd with a local fleet on loopback):
    .address, .token, .kill_duck(i). Skipped, with this reason, where that fixture is missing."""
    try:
        return request.getfixturevalue("duckd_daemon")
    except pytest.FixtureLookupError:
        pytest.skip("tests/conftest.py provides no duckd_daemon fixture: the live console tests need a real duckd")
