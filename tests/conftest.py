from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemon_proc import DaemonProcess, allowed, finish_daemon


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "daemon_log_allows(pattern, reason): a traceback in the daemon's log that "
                            "matches the regex is expected (the test provokes it); see tests/daemon_proc.py")


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temp dir (Unix socket paths are limited to 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="hwr-") as d:
        os.chmod(d, 0o700)
        yield Path(d)


@pytest.fixture
def hwrd(short_tmp: Path, request: pytest.FixtureRequest) -> Iterator[DaemonProcess]:
    """A fresh daemon per test; the test fails on its bad exit or a logged traceback."""
    root = short_tmp / "store"
    daemon = DaemonProcess(root, short_tmp / "hwrd.sock")
    daemon.start()
    try:
        yield daemon
    finally:
        finish_daemon(daemon, allowed(request))
