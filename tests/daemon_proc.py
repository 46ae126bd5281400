"""Test-side name for the daemon launcher, and the end-of-test check of every daemon fixture.

``finish_daemon(daemon, allow)`` stops a daemon that still runs and fails the test when it
exited with a non-zero status (SIGTERM must exit 0; a SIGKILL the test sent, status -9, is
fine) or when its log holds a traceback or an asyncio "exception was never retrieved" whose
text matches no ``allow`` pattern. An exception in a background task of the daemon then fails
the test that caused it instead of passing unnoticed. A test that provokes one on purpose says
so with ``@pytest.mark.daemon_log_allows("regex", reason="...")`` (``allowed(request)`` collects
them for a fixture).
"""

from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Iterable

import pytest

from hwr.daemon.app.launcher import DaemonProcess

__all__ = ["DaemonProcess", "allowed", "daemon_problems", "finish_daemon"]

# A logged traceback starts with this line; an asyncio task that died unobserved logs the other.
_MARKERS = re.compile(r"^.*(Traceback \(most recent call last\)|exception was never retrieved).*$", re.M)


def allowed(request: pytest.FixtureRequest) -> list[str]:
    """The ``daemon_log_allows`` patterns of the requesting test (none for a shared fixture)."""
    if request.scope != "function":
        return []
    return [m.args[0] for m in request.node.iter_markers("daemon_log_allows")]


def _records(text: str) -> list[str]:
    """Each traceback of the log with the lines that follow it up to the next timestamped line."""
    out = []
    for match in _MARKERS.finditer(text):
        rest = text[match.start():].splitlines()
        body = [rest[0]]
        for line in rest[1:]:
            if re.match(r"^(\d{4}-\d\d-\d\dT|<\d>)", line):  # the next log record
                break
            body.append(line)
        out.append("\n".join(body[:60]))
    return out


def daemon_problems(daemon: DaemonProcess, returncode: int | None, allow: Iterable[str] = ()) -> list[str]:
    """What is wrong with how ``daemon`` ended (empty when nothing)."""
    problems = []
    if returncode not in (None, 0, -signal.SIGKILL):
        problems.append(f"hwrd exited with status {returncode}")
    patterns = [re.compile(p) for p in allow]
    try:
        text = daemon.log.read_text(errors="replace")
    except FileNotFoundError:
        text = ""
    for record in _records(text):
        if not any(p.search(record) for p in patterns):
            problems.append(f"hwrd logged:\n{record}")
    return problems


def finish_daemon(daemon: DaemonProcess, allow: Iterable[str] = (), timeout: float = 20.0) -> None:
    """Stop ``daemon`` (if it still runs) and fail on a bad exit or a logged traceback."""
    if daemon.proc is None:
        return
    hung = []
    if daemon.proc.poll() is None:
        daemon.proc.send_signal(signal.SIGTERM)
        try:
            daemon.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            hung.append(f"hwrd did not exit within {timeout} s of SIGTERM")
    returncode = None if hung else daemon.proc.returncode
    daemon.kill()  # SIGKILL if it hung; closes the log (idempotent)
    problems = hung + daemon_problems(daemon, returncode, allow)
    if problems:
        pytest.fail(f"hwrd on {daemon.root}: " + "\n".join(problems)[-6000:], pytrace=False)
