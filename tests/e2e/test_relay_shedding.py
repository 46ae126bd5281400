"""A client whose gRPC connection hwrd sheds keeps its session: its watch subscribes again.

A real hwrd with an open-files limit small enough that its gRPC connection budget is the
minimum (16). This process (root) fills the budget: a client with a channel watch, then idle
HTTP/2 connections. Another uid then connects: root holds the most, so its least recently
active connection (the watch's: silent since it subscribed) is shed. Once room is back the
watch subscribes again on the same session and hears the next change.
"""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from daemon_proc import NOBODY, as_user, finish_daemon, needs_root

from hwr.client import ArtifactIdentity, connect
from hwr.daemon.app.launcher import DaemonProcess
from hwr.daemon.system.grpc_peers import MIN_BUDGET

from .helpers import wait_until

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
NOFILE = 96  # half of it at 3 descriptors per connection is below MIN_BUDGET: the budget is 16
KNOCK = """
import socket, sys, time
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
sock.sendall(bytes.fromhex(sys.argv[2]))
time.sleep(2)
"""


def idle_connection(path: Path) -> socket.socket | None:
    """An idle HTTP/2 connection, or None when hwrd refused it (the budget is full)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        sock.sendall(PREFACE)
    except OSError:
        sock.close()
        return None
    return sock


@pytest.mark.timeout(120)
def test_a_shed_watch_connection_resubscribes_on_the_same_session(short_tmp: Path) -> None:
    needs_root()
    short_tmp.chmod(0o755)
    daemon = DaemonProcess(short_tmp / "store", short_tmp / "hwrd.sock", "--socket-mode", "666",
                           "--allow-uid", str(NOBODY.uid)).start()
    held: list[socket.socket] = []
    try:
        resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (NOFILE, NOFILE))
        with connect(daemon.socket) as client:
            key = client.publish(ArtifactIdentity.simple("shed/a"), {"w": torch.zeros(4)})
            other = client.publish(ArtifactIdentity.simple("shed/b"), {"w": torch.ones(4)})
            client.set_channel("shed", key)
            session = client._connection.session_id
            watch = client.watch_channel("shed")
            assert watch.wait(10) is not None
            client.status()  # the unary connection: more recently active than the watch's
            # Fill the budget with idle connections of this uid (root), each newer than the watch.
            for _ in range(MIN_BUDGET):  # the last ones are refused: root already holds two
                sock = idle_connection(daemon.socket)
                if sock is not None:
                    held.append(sock)
                time.sleep(0.01)
            time.sleep(0.3)
            knock = subprocess.run(as_user(NOBODY, [sys.executable, "-c", KNOCK, str(daemon.socket), PREFACE.hex()]),
                                   timeout=60, cwd="/", capture_output=True, text=True)
            assert knock.returncode == 0, knock.stderr[-2000:]
            wait_until(lambda: "shed the least recently active gRPC connection" in daemon.log.read_text(), 10)
            for sock in held:  # room again: the watch may subscribe anew
                sock.close()
            held.clear()
            wait_until(lambda: watch.resubscriptions >= 1 and watch.connected, 30)
            client.set_channel("shed", other)
            update = watch.wait(30)
            assert update is not None and update.key == other
            assert client._connection.session_id == session  # the session was never replaced
            assert client._connection.reconnects == 0
            watch.close()
    finally:
        for sock in held:
            sock.close()
        finish_daemon(daemon)  # a clean exit, no traceback in its log
