"""Start and stop a real ``hwrd`` process from Python: the demo, benchmarks and tests use it.

``DaemonProcess`` runs ``python -m hwr.daemon.app.main`` on a root and socket, waits until the peer
channel and gRPC answer, and stops it with SIGTERM (or SIGKILL on demand). Its output goes to
``<root's parent>/hwrd-<root name>.log``. Limit: for local, unprivileged use (no systemd).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


class DaemonProcess:
    def __init__(self, root: Path, sock: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.root = root
        self.socket = sock
        self.extra = extra
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root.parent / f"hwrd-{root.name}.log"

    def command(self) -> list[str]:
        """The command line that runs the daemon (tests override it to wrap hwrd)."""
        return [sys.executable, "-m", "hwr.daemon.app.main", "--root", str(self.root),
                "--socket", str(self.socket), *self.extra]

    def start(self, timeout: float = 30.0) -> DaemonProcess:
        cmd = self.command()
        self._log = open(self.log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hwrd exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if answers(Path(f"{self.socket}.peer")) and answers(self.socket):
                return self
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"hwrd did not come up: {self.log.read_text()[-2000:]}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        with contextlib.suppress(Exception):
            self._log.close()

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def temporary_daemon(prefix: str = "hwr-", *extra: str) -> Iterator[DaemonProcess]:
    """A started hwrd whose store and socket live in a fresh 0700 temp dir; stopped, then the dir
    removed, on exit (for test fixtures and benchmarks that need one throwaway daemon)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        os.chmod(d, 0o700)
        daemon = DaemonProcess(Path(d) / "store", Path(d) / "hwrd.sock", *extra).start()
        try:
            yield daemon
        finally:
            daemon.stop()


def answers(path: Path, timeout: float = 0.5) -> bool:
    """True when something accepts a connection on the Unix socket ``path``."""
    if not path.exists():
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()
