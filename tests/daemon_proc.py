"""Test-side name for the daemon launcher, and the end-of-test check of every daemon fixture.

``finish_daemon(daemon, allow)`` stops a daemon that still runs and fails the test when it
exited with a non-zero status (SIGTERM must exit 0; a SIGKILL the test sent, status -9, is
fine) or when its log holds a traceback or an asyncio "exception was never retrieved" whose
text matches no ``allow`` pattern. An exception in a background task of the daemon then fails
the test that caused it instead of passing unnoticed. A test that provokes one on purpose says
so with ``@pytest.mark.daemon_log_allows("regex", reason="...")`` (``allowed(request)`` collects
them for a fixture).

Unprivileged daemons, as deployed (the systemd unit's ``User=hwrd``): ``make_daemon(base, ...,
user=HWRD)`` lays out ``base`` the way the unit's ``RuntimeDirectory=``/``CacheDirectory=`` do
(``base`` 0755, ``base/run`` for the sockets and ``base/store`` 0700, both owned by the daemon
user) and runs hwrd as that uid and gid, without groups or capabilities
(``hwr.daemon.app.launcher.RunAs``). ``HWRD`` is a uid and gid of their own (no passwd entry
needed), neither root nor an attacker's: attackers run as ``NOBODY`` (65534) or ``STRANGER``,
through ``as_user(user, command)``. Fixtures (``tests/conftest.py``): ``daemon_user`` is
parametrized ``root``/``unprivileged``; ``spawn_daemon``, ``spawn`` and ``hwrd`` honour it when a
test requests it (``@pytest.mark.usefixtures("daemon_user")``), and ``unprivileged_hwrd`` is a
fresh unprivileged daemon. Switching uids needs root: ``needs_root()`` skips, or fails when
``CI`` is set (CI must run these tests, not skip them).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest

from hwr.daemon.app.launcher import DaemonProcess, RunAs, as_user_command

__all__ = ["HWRD", "NOBODY", "STRANGER", "DaemonProcess", "RunAs", "allowed", "as_user", "daemon_problems",
           "finish_daemon", "make_daemon", "needs_root", "own", "requested_user"]

#: The daemon's user in the unprivileged fixtures (the unit's ``User=hwrd``/``Group=hwr``, ``UMask=0007``).
HWRD = RunAs(64301, 64301)
#: Attackers: ``nobody``, and a second uid that is neither the daemon's nor nobody.
NOBODY = RunAs(65534, 65534, umask=0o022)
STRANGER = RunAs(64302, 64302, umask=0o022)


def needs_root(why: str = "switching to another uid needs root") -> None:
    """Skip the calling test unless this process is root; under ``CI`` fail instead."""
    if os.geteuid() == 0:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{why} (CI is set: these tests must run, not skip)")
    pytest.skip(why)


def own(path: Path, user: RunAs, mode: int) -> Path:
    """Create directory ``path`` (if missing) owned by ``user`` with ``mode``; returns it."""
    path.mkdir(exist_ok=True)
    os.chown(path, user.uid, user.gid)
    path.chmod(mode)
    return path


def make_daemon(base: Path, *extra: str, user: RunAs | None = None, root: Path | None = None,
                sock: Path | None = None, env: dict[str, str] | None = None) -> DaemonProcess:
    """A (not started) hwrd on ``base``: as root, ``base/store`` and ``base/hwrd.sock``; as ``user``,
    laid out like the unit's directories (module docstring). A given ``root`` or ``sock`` whose
    directory does not exist yet is created for ``user`` the same way."""
    if user is None:
        return DaemonProcess(root or base / "store", sock or base / "hwrd.sock", *extra, env=env)
    needs_root()
    base.chmod(0o755)  # the unit's directories sit in root-owned, world-searchable ones (/run, /var/cache)
    sock = sock or own(base / "run", user, 0o755) / "hwrd.sock"
    if not sock.parent.exists():
        own(sock.parent, user, 0o755)
    root = root or base / "store"
    if not root.exists():
        own(root, user, 0o700)
    return DaemonProcess(root, sock, *extra, env=env, user=user)


def requested_user(request: pytest.FixtureRequest) -> RunAs | None:
    """The ``daemon_user`` of the requesting test, or None (root) when it does not ask for one."""
    return request.getfixturevalue("daemon_user") if "daemon_user" in request.fixturenames else None


def as_user(user: RunAs, command: Sequence[str]) -> list[str]:
    """``command`` (this interpreter with a script, ``-m`` or ``-c``; or any program) run as ``user``."""
    needs_root()
    return as_user_command(user, [sys.executable, *command[1:]] if command[0] == "python" else list(command))

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
