"""Fixtures of the end-to-end tests: real hwrd processes on temp roots, stopped (or killed) after;
a daemon's non-zero exit or logged traceback fails the test (``daemon_proc.finish_daemon``).

``shared_hwrd`` is one daemon for every test that asks for it in the session (each test uses its
own identities and leaves no lease behind), because a daemon start costs seconds on a small CI
machine, and because each test then also proves that the daemon survived the ones before. Tests
that restart, kill or reconfigure the daemon use ``spawn_daemon`` and get their own. (``hwrd``,
from ``tests/conftest.py``, is still a fresh daemon per test.)
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemon_proc import DaemonProcess, allowed, finish_daemon, make_daemon, requested_user


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: an end-to-end test that takes several seconds (still run in CI)")


@pytest.fixture(scope="session")
def shared_hwrd() -> Iterator[DaemonProcess]:
    with tempfile.TemporaryDirectory(prefix="hwr-") as d:
        os.chmod(d, 0o700)
        daemon = DaemonProcess(Path(d) / "store", Path(d) / "hwrd.sock").start()
        try:
            yield daemon
        finally:
            finish_daemon(daemon)  # no allow-list: a test that provokes a traceback needs its own daemon


@pytest.fixture
def spawn_daemon(short_tmp: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., DaemonProcess]]:
    """Start hwrd processes (``root``/``socket`` default to ``short_tmp``); all stopped at teardown.
    They run as the test's ``daemon_user`` when it asks for one (``daemon_proc.make_daemon``)."""
    started: list[DaemonProcess] = []
    user = requested_user(request)

    def spawn(*extra: str, root: Path | None = None, sock: Path | None = None,
              daemon: DaemonProcess | None = None) -> DaemonProcess:
        proc = daemon or make_daemon(short_tmp, *extra, user=user, root=root, sock=sock)
        started.append(proc)
        return proc.start()

    yield spawn
    failures = []
    for proc in reversed(started):
        try:
            finish_daemon(proc, allowed(request))
        except pytest.fail.Exception as exc:
            failures.append(str(exc))
    if failures:
        pytest.fail("\n".join(dict.fromkeys(failures)), pytrace=False)
