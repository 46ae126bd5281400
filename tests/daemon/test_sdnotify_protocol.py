"""sd_notify: READY=1 only once hwrd serves, WATCHDOG=1 at half of $WATCHDOG_USEC, STOPPING=1 on
SIGTERM; a daemon that fails to start never says READY. Real hwrd, a real datagram socket."""

from __future__ import annotations

import itertools
import signal
import statistics
import time
from pathlib import Path

import pytest
from ops_helpers import NotifySocket, answers, hwrd_process

from hwr.client import connect
from hwr.daemon.system.sdnotify import Notifier, watchdog_interval


def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}, pid=2) is None
    assert watchdog_interval({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "2"}, pid=2) == 0.5


def test_notifier_without_socket_is_a_no_op(short_tmp: Path) -> None:
    assert Notifier.from_env({}).ready("x") is False
    listener = NotifySocket(short_tmp / "n")
    try:
        assert Notifier.from_env({"NOTIFY_SOCKET": str(short_tmp / "n")}).send(STATUS="a\nb") is True
        assert listener.next(5) == {"STATUS": "a b"}  # a newline cannot inject another assignment
    finally:
        listener.close()


@pytest.mark.timeout(120)
def test_ready_only_when_serving_then_watchdog_then_stopping(short_tmp: Path) -> None:
    notify = NotifySocket(short_tmp / "notify")
    sock = short_tmp / "hwrd.sock"
    env = {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "400000"}
    try:
        with hwrd_process("--root", str(short_tmp / "store"), "--socket", str(sock), env=env,
                          log=short_tmp / "hwrd.log") as proc:
            first = notify.next(90)
            # The very first message is READY, and at that moment both channels already serve.
            assert first.get("READY") == "1", first
            assert answers(sock) and answers(Path(f"{sock}.peer"))
            with connect(sock, timeout=10) as client:
                assert client.status()["pid"] == proc.pid
            assert first["STATUS"].startswith("serving:")
            pings = []
            while len(pings) < 6:
                message = notify.next(30)
                assert "READY" not in message  # READY is sent once
                if message.get("WATCHDOG") == "1":
                    pings.append(time.monotonic())
            gaps = [b - a for a, b in itertools.pairwise(pings)]
            # WatchdogSec/2 = 0.2 s. Gaps are measured on arrival (a ping queued while the test was
            # busy arrives early relative to the previous one), so judge the median.
            assert 0.15 < statistics.median(gaps) < 1.5, gaps
            proc.send_signal(signal.SIGTERM)
            stopping, _ = notify.until("STOPPING", 30)
            assert stopping["STOPPING"] == "1"
            assert proc.wait(30) == 0
    finally:
        notify.close()


@pytest.mark.timeout(120)
def test_failed_start_never_sends_ready(short_tmp: Path, hwrd) -> None:  # type: ignore[no-untyped-def]
    notify = NotifySocket(short_tmp / "notify2")
    try:
        # Same store root as the running daemon: the second one must fail (root locked).
        with hwrd_process("--root", str(hwrd.root), "--socket", str(short_tmp / "other.sock"),
                          env={"NOTIFY_SOCKET": str(notify.path)}, log=short_tmp / "second.log") as proc:
            assert proc.wait(90) == 1
        notify.sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            notify.sock.recv(4096)
    finally:
        notify.close()
