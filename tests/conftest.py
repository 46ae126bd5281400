from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemon_proc import HWRD, DaemonProcess, RunAs, allowed, finish_daemon, make_daemon, requested_user

# Every property test runs without a per-example deadline: on a loaded 2-core CI machine one
# example of real work (a file written and mapped, a config parsed, a layout planned) can take
# far longer than Hypothesis' default 200 ms, which then fails as "Flaky" or DeadlineExceeded
# and proves nothing. Example counts stay bounded (100 unless a test sets its own), and so does
# each test's wall time (pytest-timeout). Data generation that is slow on such a machine is not
# a finding either (too_slow).
settings.register_profile("hwr", deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("hwr")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "daemon_log_allows(pattern, reason): a traceback in the daemon's log that "
                            "matches the regex is expected (the test provokes it); see tests/daemon_proc.py")


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temp dir (Unix socket paths are limited to 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="hwr-") as d:
        os.chmod(d, 0o700)
        yield Path(d)


@pytest.fixture(params=["root", "unprivileged"])
def daemon_user(request: pytest.FixtureRequest) -> RunAs | None:
    """Who the test's daemons run as: root, or the unit's unprivileged user (``daemon_proc.HWRD``).
    A test (or module) that requests it runs twice; ``spawn_daemon``, ``spawn`` and ``hwrd``
    follow it."""
    return HWRD if request.param == "unprivileged" else None


@pytest.fixture
def hwrd(short_tmp: Path, request: pytest.FixtureRequest) -> Iterator[DaemonProcess]:
    """A fresh daemon per test; the test fails on its bad exit or a logged traceback."""
    daemon = make_daemon(short_tmp, user=requested_user(request))
    daemon.start()
    try:
        yield daemon
    finally:
        finish_daemon(daemon, allowed(request))


@pytest.fixture
def unprivileged_hwrd(short_tmp: Path, request: pytest.FixtureRequest) -> Iterator[DaemonProcess]:
    """A fresh daemon per test running as the unit's unprivileged user (``daemon_proc.HWRD``)."""
    daemon = make_daemon(short_tmp, user=HWRD)
    daemon.start()
    try:
        yield daemon
    finally:
        finish_daemon(daemon, allowed(request))
