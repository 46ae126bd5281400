"""A daemon that runs out of file descriptors keeps its service: new sessions get a prompt typed
refusal while it is out, and are served again once descriptors are free.

The daemon's open-files limit is lowered from outside (``prlimit``, the OS boundary) to 64
after it started, then clients connect until the daemon has no descriptor left. Before the fix
the peer socket's accept loop died on the first ``EMFILE``: clients timed out, and no session
was ever accepted again, even after every connection had closed.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
import torch

from hwr.client import ArtifactIdentity, Client, connect
from hwr.client.errors import DaemonUnavailable, HwrError
from hwr.daemon.app.launcher import DaemonProcess

LIMIT = 64


@pytest.mark.timeout(120)
def test_out_of_descriptors_refuses_promptly_then_serves_again(spawn_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = spawn_daemon()
    with connect(daemon.socket) as client:
        key = client.publish(ArtifactIdentity.simple("fd-exhaustion"), {"w": torch.arange(4096.0)})
    resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (LIMIT, LIMIT))
    clients: list[Client] = []
    try:
        refusal = None
        for _ in range(2 * LIMIT):
            started = time.monotonic()
            try:
                clients.append(connect(daemon.socket, timeout=10))
            except DaemonUnavailable as exc:
                refusal, took = exc, time.monotonic() - started
                break
        assert refusal is not None, f"{len(clients)} sessions fit under a limit of {LIMIT} descriptors"
        assert "no file descriptor left" in refusal.message and refusal.retryable, refusal
        assert took < 5, f"the refusal took {took:.1f} s: a timeout, not an answer"
        assert len(clients) > LIMIT // 2
        with clients[0].acquire(key) as lease:  # sessions already open keep working
            assert float(lease.tensors["w"][7]) == 7.0
    finally:
        for c in clients:
            c.close()
    deadline = time.monotonic() + 20
    while True:  # the daemon notices the closed connections, then accepts again
        try:
            with connect(daemon.socket, timeout=5) as client, client.acquire(key) as lease:
                assert float(lease.tensors["w"][4095]) == 4095.0
                assert client.status()["sessions"] == 1
            break
        except DaemonUnavailable:
            assert time.monotonic() < deadline, "the daemon never accepted a session again"
            time.sleep(0.2)


def test_hwrd_raises_its_soft_open_files_limit_to_the_hard_one() -> None:
    code = ("import resource; from hwr.daemon.system.accepting import raise_nofile_limit; "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1])); "
            "print(*raise_nofile_limit(), *resource.getrlimit(resource.RLIMIT_NOFILE))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ}).stdout.split()
    soft, hard, now_soft, now_hard = map(int, out)
    assert soft == hard == now_soft == now_hard and hard >= 128


@pytest.mark.timeout(120)
def test_out_of_descriptors_in_an_acquire_fails_that_acquire_only(spawn_daemon: Callable[..., DaemonProcess]) -> None:
    """EMFILE from the daemon's ``os.open`` of payload files while it serves a peer ``acquire``
    is an error frame for that request: the session and its other leases stay."""
    daemon = spawn_daemon()
    with connect(daemon.socket, timeout=10) as client:
        held_key = client.publish(ArtifactIdentity.simple("fd-exhaustion/held"), {"w": torch.ones(64)})
        other = client.publish(ArtifactIdentity.simple("fd-exhaustion/other"), {"w": torch.full((64,), 2.0)})
        with client.acquire(other):
            pass  # validated and cached: the next acquire of it only opens its payload files
        held = client.acquire(held_key)
        session = client.session_id
        assert [x["key"] for x in client.leases()] == [held_key]  # opens the gRPC channel now
        soft, hard = resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE)
        open_now = len(os.listdir(f"/proc/{daemon.pid}/fd"))
        resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (open_now, hard))
        try:
            with pytest.raises(HwrError) as failed:
                client.acquire(other)
        finally:
            resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (soft, hard))
        assert not isinstance(failed.value, DaemonUnavailable), failed.value
        assert "Too many open files" in failed.value.message, failed.value
        assert client.session_id == session
        assert [x["key"] for x in client.leases()] == [held_key]
        assert float(held.tensors["w"].sum()) == 64.0
        with client.acquire(other) as lease:
            assert float(lease.tensors["w"].sum()) == 128.0
        held.close()
