"""A real S3-compatible server process and hwrd nodes sharing it (the fleet tier's tests).

``S3Server`` runs moto's standalone server (``python -m moto.server``) as its own process on
127.0.0.1 and talks to it over HTTP with boto3; hwrd reaches it only through its ``remote`` and
``remote_endpoint_url`` settings and the standard credential chain (environment variables set
here), so nothing in hwrd knows which server it is. Two ``DaemonProcess``es with separate roots
stand in for two nodes of a fleet.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hwr.daemon.app.launcher import DaemonProcess, RunAs

#: Credentials of the test server: the standard chain's environment variables, never hwrd flags.
S3_ENV = {"AWS_ACCESS_KEY_ID": "fleet-test-access", "AWS_SECRET_ACCESS_KEY": "fleet-test-secret-value",
          "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """moto's standalone S3 server in a subprocess; ``stop``/``start`` simulate an outage."""

    def __init__(self, log: Path, port: int | None = None, env: dict[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.env = S3_ENV if env is None else env  # over os.environ, for the server process

    def start(self, timeout: float = 60.0) -> S3Server:
        env = {**os.environ, **self.env}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                          str(self.port)], stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited: {self.log.read_text()[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.5):
                return self
            time.sleep(0.1)
        raise TimeoutError("moto server did not come up")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def client(self) -> Any:
        import boto3

        return boto3.session.Session(aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                                     aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
                                     region_name="us-east-1").client("s3", endpoint_url=self.endpoint)

    def new_bucket(self) -> str:
        name = f"fleet-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    pytest.importorskip("boto3", reason="the fleet tier's s3 tests need the s3 extra (boto3)")
    pytest.importorskip("moto.server", reason="the fleet tier's s3 tests need moto[server] (the test extra)")
    server = S3Server(tmp_path_factory.mktemp("moto") / "moto.log").start()
    try:
        yield server
    finally:
        server.stop()


def node(base: Path, name: str, remote: str, *extra: str, endpoint: str = "",
         user: RunAs | None = None) -> DaemonProcess:
    """An unstarted hwrd "node" with its own root and socket under ``base``, on ``remote``; as
    ``user`` (the unit's unprivileged user, ``daemon_proc.HWRD``) on directories laid out like
    the unit's (``daemon_proc.make_daemon``)."""
    args = ["--remote", remote, *(("--remote-endpoint-url", endpoint) if endpoint else ()), *extra]
    if user is None:
        return DaemonProcess(base / f"{name}-store", base / f"{name}.sock", *args, env=S3_ENV)
    from daemon_proc import make_daemon

    base.chmod(0o755)
    (base / name).mkdir(exist_ok=True)
    return make_daemon(base / name, *args, user=user, env=S3_ENV)


def artifact_dirs(root: Path) -> list[str]:
    with contextlib.suppress(FileNotFoundError):
        return sorted(os.listdir(root / "artifacts"))
    return []


def staging_dirs(root: Path) -> list[str]:
    with contextlib.suppress(FileNotFoundError):
        return sorted(os.listdir(root / "tmp"))
    return []


class SlowLink:
    """A TCP relay from 127.0.0.1:``port`` to the S3 server that moves at most ``rate`` bytes/s
    each way and counts the bytes: a slow network at the OS boundary, so a test can kill hwrd in
    the middle of a transfer (``wait_bytes``) instead of racing a fast local one, or stall it
    (``pause``: connections stay open, nothing moves, until ``resume``; or only the downloads
    already past some bytes: a stalled transfer while small requests still get through)."""

    def __init__(self, target_port: int, rate: float) -> None:
        self.target_port = target_port
        self.rate = rate
        self.sent = {"up": 0, "down": 0}  # up: hwrd -> server (uploads); down: server -> hwrd
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = int(self._listener.getsockname()[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._closed = False
        self._sockets: list[socket.socket] = []
        import threading

        self._lock = threading.Lock()
        self._moving = threading.Event()
        self._moving.set()
        self._hold_after = 0  # while paused: 0 holds every connection, else downloads past this many bytes
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), 5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, "down"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        started, moved = time.monotonic(), 0
        try:
            while True:
                data = src.recv(64 * 1024)
                if not data:
                    break
                while self._held(direction, moved):  # paused: hold the bytes, keep the connection
                    if self._closed:
                        return
                    self._moving.wait(0.1)
                dst.sendall(data)
                moved += len(data)
                with self._lock:
                    self.sent[direction] += len(data)
                ahead = moved / self.rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def _held(self, direction: str, moved: int) -> bool:
        """Whether a connection's pump that has moved ``moved`` bytes ``direction`` waits now."""
        if self._moving.is_set():
            return False
        return self._hold_after == 0 or (direction == "down" and moved >= self._hold_after)

    def pause(self, after: int = 0) -> None:
        """Stop moving bytes until ``resume``: on every connection, or (``after`` > 0) only on
        downloads that have moved ``after`` bytes already (one stalled transfer; the remote still
        answers small requests, such as hwrd's reachability probe behind ``hwrctl status``)."""
        self._hold_after = after
        self._moving.clear()

    def resume(self) -> None:
        self._moving.set()

    def wait_bytes(self, direction: str, nbytes: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.sent[direction] < nbytes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {self.sent[direction]} bytes went {direction}")
            time.sleep(0.01)

    def close(self) -> None:
        self._closed = True
        self._moving.set()
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.close()
