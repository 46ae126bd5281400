"""Socket activation: hwrd serves on listening sockets inherited through LISTEN_FDS (gRPC through
the relay, the peer socket directly), never unlinks them, and a restarted hwrd serves a client
that connected while no daemon was running (the connection waited in the inherited backlog)."""

from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path

import pytest
from ops_helpers import HWRD, hwrd_process, wait_for

from hwr.client import ArtifactIdentity, connect
from hwr.daemon.system.activation import InheritedSocket, assign, listen_fd_count, private_grpc_path

# Like systemd: put the sockets at fds 3.., set LISTEN_PID to the pid that will run hwrd, exec.
LAUNCH = """
import os, sys
fds = [int(x) for x in sys.argv[1].split(",")]
dups = [os.dup(fd) for fd in fds]
for i, fd in enumerate(dups):
    os.dup2(fd, 3 + i)
    os.set_inheritable(3 + i, True)  # dup2 onto itself is a no-op that keeps os.dup's CLOEXEC
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS=str(len(fds)), LISTEN_FDNAMES=sys.argv[2])
os.execv(sys.executable, [sys.executable, *sys.argv[3:]])
"""


def _listening(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(64)
    return s


def test_listen_fds_only_for_this_pid() -> None:
    assert listen_fd_count({"LISTEN_PID": "42", "LISTEN_FDS": "2"}, 42) == 2
    assert listen_fd_count({"LISTEN_PID": "41", "LISTEN_FDS": "2"}, 42) == 0
    assert listen_fd_count({"LISTEN_FDS": "2"}, 42) == 0


def test_assign_matches_by_path_and_closes_strangers(short_tmp: Path) -> None:
    a, b, c = (_listening(short_tmp / n) for n in ("g.sock", "g.sock.peer", "other"))
    items = [InheritedSocket(s.detach(), "hwrd", str(short_tmp / n)) for s, n in
             ((a, "g.sock"), (b, "g.sock.peer"), (c, "other"))]
    result = assign(items, short_tmp / "g.sock", short_tmp / "g.sock.peer")
    assert result.grpc is not None and result.grpc.getsockname() == str(short_tmp / "g.sock")
    assert result.peer is not None and result.peer.getsockname() == str(short_tmp / "g.sock.peer")
    with pytest.raises(OSError):
        socket.socket(fileno=items[2].fd).getsockname()  # the stranger was closed
    result.grpc.close()
    result.peer.close()


@pytest.mark.timeout(180)
def test_serves_on_inherited_sockets_and_survives_restart(short_tmp: Path) -> None:
    sock, peer = short_tmp / "hwrd.sock", short_tmp / "hwrd.sock.peer"
    grpc_listen, peer_listen = _listening(sock), _listening(peer)
    fds = (grpc_listen.fileno(), peer_listen.fileno())
    argv = [sys.executable, "-c", LAUNCH, f"{fds[0]},{fds[1]}", "hwrd:hwrd", *HWRD[1:],
            "--root", str(short_tmp / "store"), "--socket", str(sock)]
    inode = sock.stat().st_ino
    with hwrd_process(argv=argv, pass_fds=fds, log=short_tmp / "a.log") as proc:
        wait_for(lambda: private_grpc_path(sock).exists() or proc.poll() is not None, 90, "hwrd up")
        assert proc.poll() is None, (short_tmp / "a.log").read_text()
        with connect(sock, timeout=30) as client:
            key = client.publish(ArtifactIdentity.simple("act/model"), {"w": __import__("torch").ones(8)})
            with client.acquire(key) as lease:
                assert float(lease.tensors["w"].sum()) == 8.0
            assert client.status()["pid"] == proc.pid
        proc.terminate()
        assert proc.wait(30) == 0
    # systemd's sockets are still there (same inode); only the private gRPC path is gone.
    assert sock.stat().st_ino == inode and peer.exists()
    assert not private_grpc_path(sock).exists()

    # A client connects while no daemon runs: it waits in the backlog and a new hwrd serves it.
    outcome: dict[str, object] = {}

    def early_client() -> None:
        try:
            with connect(sock, timeout=120) as client:
                outcome["keys"] = [a["key"] for a in client.list_artifacts()]
        except Exception as exc:
            outcome["error"] = repr(exc)

    thread = threading.Thread(target=early_client)
    thread.start()
    with hwrd_process(argv=argv, pass_fds=fds, log=short_tmp / "b.log"):
        thread.join(150)
    assert outcome.get("keys") == [key], outcome
    grpc_listen.close()
    peer_listen.close()
