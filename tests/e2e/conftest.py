"""Fixtures of the end-to-end tests: real hwrd processes on temp roots, stopped (or killed) after.

``shared_hwrd`` is one daemon for every test that asks for it in the session (each test uses its
own identities and leaves no lease behind), because a daemon start costs seconds on a small CI
machine, and because each test then also proves that the daemon survived the ones before. Tests
that restart, kill or reconfigure the daemon use ``spawn_daemon`` and get their own. (``hwrd``,
from ``tests/conftest.py``, is still a fresh daemon per test.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hwr.daemon.launcher import DaemonProcess, temporary_daemon


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: an end-to-end test that takes several seconds (still run in CI)")


@pytest.fixture(scope="session")
def shared_hwrd() -> Iterator[DaemonProcess]:
    with temporary_daemon("hwr-") as daemon:
        yield daemon


@pytest.fixture
def spawn_daemon(short_tmp: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """Start hwrd processes (``root``/``socket`` default to ``short_tmp``); all stopped at teardown."""
    started: list[DaemonProcess] = []

    def spawn(*extra: str, root: Path | None = None, sock: Path | None = None,
              daemon: DaemonProcess | None = None) -> DaemonProcess:
        proc = daemon or DaemonProcess(root or short_tmp / "store", sock or short_tmp / "hwrd.sock", *extra)
        started.append(proc)
        return proc.start()

    yield spawn
    for proc in reversed(started):
        if proc.proc is not None and proc.proc.poll() is None:
            proc.stop()
        else:
            proc.kill()
