"""Acceptance: the peer socket's SO_PEERCRED allow-list decides who gets a session.

The client runs in a process that drops to ``nobody`` (uid/gid 65534) before connecting; the
sockets are world-connectable (``--socket-mode 666`` under a 0755 directory) so that only the
daemon's allow-list, not the file mode, refuses it. One such process tries two daemons: one with
the default allow-list and one started with ``--allow-uid 65534``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.daemon.app.launcher import DaemonProcess

from .helpers import Worker, digests, patterned

NOBODY = 65534
TENSORS = {"w": patterned(32 * 1024, 21, torch.bfloat16).reshape(64, 256), "b": torch.ones(64)}

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")


@pytest.fixture
def reachable_dir(short_tmp: Path) -> Path:
    short_tmp.chmod(0o755)  # the stores below stay 0700; only the sockets become reachable
    return short_tmp


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_uid_outside_allow_list_is_refused_and_allowed_uid_connects(
    spawn_daemon: Callable[..., DaemonProcess], reachable_dir: Path
) -> None:
    refusing_sock, allowing_sock = reachable_dir / "refusing.sock", reachable_dir / "allowing.sock"
    failures: list[BaseException] = []

    def start(*extra: str, root: Path, sock: Path) -> None:
        try:
            spawn_daemon("--socket-mode", "666", *extra, root=root, sock=sock)
        except BaseException as exc:
            failures.append(exc)

    starts = [
        threading.Thread(target=start, kwargs={"root": reachable_dir / "store-a", "sock": refusing_sock}),
        threading.Thread(target=start, args=("--allow-uid", str(NOBODY)),
                         kwargs={"root": reachable_dir / "store-b", "sock": allowing_sock}),
    ]
    for thread in starts:  # the two daemon starts overlap: each costs seconds on a small machine
        thread.start()
    for thread in starts:
        thread.join(60)
    assert not failures, failures
    for sock in (refusing_sock, allowing_sock):
        assert os.stat(sock).st_mode & 0o777 == 0o666
        assert os.stat(f"{sock}.peer").st_mode & 0o777 == 0o666
    with connect(allowing_sock) as client:
        key = client.publish(ArtifactIdentity.simple("e2e/uid"), TENSORS)

    worker = Worker("unprivileged", str(refusing_sock), str(allowing_sock), key)
    try:
        report = worker.result(timeout=90)
        assert worker.wait() == 0, worker.stderr
    finally:
        worker.close()
    print(f"\nas uid {report['uid']}: refused {report['refusing'].get('error')}")

    assert report["uid"] == NOBODY
    refused = report["refusing"]
    assert refused["connected"] is False
    assert (refused["error"]["type"], refused["error"]["code"]) == ("PermissionDeniedError", "PERMISSION_DENIED")
    with connect(refusing_sock) as client:
        assert client.status()["sessions"] == 1  # no session was opened for the refused peer

    allowed = report["allowing"]
    assert allowed["connected"] is True, allowed
    assert allowed["tensors"] == digests(TENSORS)  # read-only descriptors work across users
    assert allowed["lease_uids"] == [NOBODY]
