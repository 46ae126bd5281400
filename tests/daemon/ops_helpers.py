"""Helpers of the operations tests: a notify socket, hwrd with extra environment, metrics scrapes.

Real processes and real sockets only: the notify socket is the same AF_UNIX datagram socket
systemd would provide, and hwrd is the real ``python -m hwr.daemon.app.main``.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from daemon_proc import finish_daemon

from hwr.daemon.app.launcher import answers as launcher_answers

HWRD = [sys.executable, "-m", "hwr.daemon.app.main"]


class NotifySocket:
    """A bound AF_UNIX datagram socket standing in for systemd's ``$NOTIFY_SOCKET``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))

    def next(self, timeout: float = 60.0) -> dict[str, str]:
        self.sock.settimeout(timeout)
        data = self.sock.recv(4096).decode()
        return dict(line.split("=", 1) for line in data.split("\n") if line)

    def until(self, key: str, timeout: float = 60.0) -> tuple[dict[str, str], list[dict[str, str]]]:
        """Messages up to and including the first carrying ``key``."""
        seen = []
        deadline = time.monotonic() + timeout
        while True:
            message = self.next(max(0.1, deadline - time.monotonic()))
            seen.append(message)
            if key in message:
                return message, seen

    def close(self) -> None:
        self.sock.close()


def answers(path: Path) -> bool:
    return launcher_answers(path, timeout=1.0)


@contextlib.contextmanager
def hwrd_process(*args: str, env: dict[str, str] | None = None, log: Path,
                 pass_fds: tuple[int, ...] = (), argv: list[str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """Run hwrd (or ``argv``) with extra environment; SIGTERM then SIGKILL at exit."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv or [*HWRD, *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, pass_fds=pass_fds)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_for(predicate, timeout: float = 60.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not met within {timeout} s")
        time.sleep(0.05)


def scrape_unix(path: Path) -> str:
    """GET /metrics over a Unix socket; returns the body."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    try:
        s.connect(str(path))
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: hwrd\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    finally:
        s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"text/plain; version=0.0.4" in head
    return body.decode()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def parse_samples(text: str) -> dict[str, float]:
    """``name{labels}`` -> value, for every sample line of a text exposition."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        assert match, f"malformed exposition line {line!r}"
        samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


@contextlib.contextmanager
def started(daemon):  # type: ignore[no-untyped-def]
    """Start a ``DaemonProcess``; stop it at exit, failing on a bad exit or a logged traceback."""
    daemon.start()
    try:
        yield daemon
    finally:
        finish_daemon(daemon)
