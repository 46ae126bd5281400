"""Fixtures of the fault suite, and the summary lines CI shows (faults tried, nothing lost).

Each test calls ``faultkit.tally(kind, tried=N, lost=M)``; ``pytest_terminal_summary`` prints one line per
kind at the end of the run (``hwr faults: <kind>: N tried, M lost``) and the suite fails on any
loss through the tests' own assertions.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hwr.daemon.launcher import DaemonProcess

from .faultkit import TALLY


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if not TALLY:
        return
    terminalreporter.section("hwr fault suite")
    for kind, (tried, lost) in sorted(TALLY.items()):
        terminalreporter.write_line(f"hwr faults: {kind}: {tried} tried, {lost} lost"
                                    + ("" if lost else " (nothing lost)"))


@pytest.fixture
def fault_tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="hwrf-") as d:
        os.chmod(d, 0o700)
        yield Path(d)


@pytest.fixture
def spawn(fault_tmp: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """Start hwrd processes on ``fault_tmp`` (optionally with a fault control file); stopped after."""
    started: list[DaemonProcess] = []

    def start(*extra: str, root: Path | None = None, faults: Path | None = None,
              daemon: DaemonProcess | None = None) -> DaemonProcess:
        env = {"HWR_TEST_FAULTS": str(faults)} if faults is not None else None
        proc = daemon or DaemonProcess(root or fault_tmp / "store", fault_tmp / "hwrd.sock", *extra, env=env)
        if proc not in started:
            started.append(proc)
        return proc.start(timeout=60)

    yield start
    for proc in reversed(started):
        if proc.proc is not None and proc.proc.poll() is None:
            proc.stop()
        else:
            proc.kill()
