"""Fixtures of the fault suite, and the summary lines CI shows (faults tried, nothing lost).

Each test fills its ``outcome`` fixture (``faultkit.Outcome``: kind, faults tried, losses found);
``pytest_terminal_summary`` prints one line per kind at the end of the run (``hwr faults: <kind>: N
tried, M lost`` and ``, K failed`` when a test of that kind failed; "(nothing lost)" only when no
loss was found and every test passed). The suite fails on any loss through the tests' own assertions.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zygote
from daemon_proc import DaemonProcess, allowed, finish_daemon, make_daemon, requested_user

from .faultkit import OUTCOMES, Outcome
from .tmpfs import SmallTmpfs, TmpfsDaemon


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if not OUTCOMES:
        return
    terminalreporter.section("hwr fault suite")
    kinds: dict[str, list[int]] = {}
    for o in OUTCOMES:
        counts = kinds.setdefault(o.kind, [0, 0, 0])
        counts[0] += o.tried
        counts[1] += o.lost
        counts[2] += o.failed
    for kind, (tried, lost, failed) in sorted(kinds.items()):
        terminalreporter.write_line(f"hwr faults: {kind}: {tried} tried, {lost} lost"
                                    + (f", {failed} failed" if failed else "")
                                    + ("" if lost or failed else " (nothing lost)"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # type: ignore[no-untyped-def]
    report = (yield).get_result()
    if report.when == "call":
        item.hwr_call_outcome = report.outcome


@pytest.fixture
def outcome(request: pytest.FixtureRequest) -> Iterator[Outcome]:
    """The test's ``Outcome``; recorded after the test (failed unless its call passed; a skipped
    test records nothing)."""
    result = Outcome(kind=request.node.name)
    yield result
    verdict = getattr(request.node, "hwr_call_outcome", "failed")
    if verdict != "skipped":
        result.failed = verdict != "passed"
        OUTCOMES.append(result)


@pytest.fixture
def forked_workers() -> None:
    """The tests' shared zygote (``tests/zygote.py``), for ``Worker(..., forked=True)``, started in
    the background so that its imports overlap the daemon's start; it lives as long as this
    test process."""
    threading.Thread(target=zygote.shared, daemon=True).start()


@pytest.fixture
def fault_tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="hwrf-") as d:
        os.chmod(d, 0o700)
        yield Path(d)


@pytest.fixture
def spawn(fault_tmp: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., DaemonProcess]]:
    """Start hwrd processes on ``fault_tmp`` (optionally with a fault control file); stopped after,
    failing the test on a non-zero exit or a logged traceback (``daemon_proc.finish_daemon``).
    They run as the test's ``daemon_user`` when it asks for one (``daemon_proc.make_daemon``)."""
    started: list[DaemonProcess] = []
    user = requested_user(request)

    def start(*extra: str, root: Path | None = None, faults: Path | None = None,
              daemon: DaemonProcess | None = None, tmpfs: SmallTmpfs | None = None) -> DaemonProcess:
        env = {"HWR_TEST_FAULTS": str(faults)} if faults is not None else None
        if daemon is None and tmpfs is not None:  # the store on the tmpfs, the daemon in its namespaces
            daemon = TmpfsDaemon(tmpfs, fault_tmp / "hwrd.sock", *extra, env=env)
        proc = daemon or make_daemon(fault_tmp, *extra, user=user, root=root, env=env)
        if proc not in started:
            started.append(proc)
        return proc.start(timeout=60)

    yield start
    failures = []
    for proc in reversed(started):
        try:
            finish_daemon(proc, allowed(request))
        except pytest.fail.Exception as exc:
            failures.append(str(exc))
    if failures:
        pytest.fail("\n".join(dict.fromkeys(failures)), pytrace=False)
