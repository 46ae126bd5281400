"""Descriptors a client receives from hwrd are close-on-exec from the moment they arrive, so a
program another thread spawns (``fork`` + ``exec``, inheriting everything not close-on-exec)
never holds a payload or staging descriptor. A real daemon; the child is a real exec."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys

import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import HwrError
from hwr.daemon.app.launcher import DaemonProcess

LIST_FDS = "import os; print(' '.join(os.listdir('/proc/self/fd')))"


def test_received_descriptors_are_close_on_exec(hwrd: DaemonProcess) -> None:
    with connect(hwrd.socket) as client:
        key = client.publish(ArtifactIdentity.simple("cloexec/a"), {"w": torch.ones(1024)})
        reply, payload_fds, _tail = client._connection.exchange({"op": "acquire", "key": key}, want_fds=True)
        begin = {"op": "publish_begin", "identity": ArtifactIdentity.simple("cloexec/b").canonical_bytes.decode(),
                 "tensors": [["w", "F32", [1024], "parameter", ""]]}
        staged, staging_fds, _tail = client._connection.exchange(begin, want_fds=True)
        received = payload_fds + staging_fds
        try:
            assert payload_fds and staging_fds, (reply, staged)
            assert all(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC for fd in received)
            # A child exec'd without closing anything keeps only what is not close-on-exec.
            child = subprocess.run([sys.executable, "-c", LIST_FDS], close_fds=False, capture_output=True,
                                   text=True, timeout=60, check=True)
            inherited = {int(fd) for fd in child.stdout.split()}
            assert not inherited & set(received), (inherited, received)
        finally:
            for fd in received:
                os.close(fd)
            client._connection.exchange({"op": "release", "lease_id": reply["lease_id"]}, want_fds=False)
            with contextlib.suppress(HwrError):
                client._connection.exchange({"op": "publish_abort", "publication_id": staged["publication_id"]},
                                            want_fds=False)
