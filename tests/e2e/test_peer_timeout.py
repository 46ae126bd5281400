"""The peer socket's timeout (``connect(timeout=)``): a daemon that stops answering (SIGSTOP)
makes an exchange fail with ``DaemonUnavailable`` after about that long, never hang; once it
answers again the same client leases as before (it reconnects). ``acquire(timeout=)`` bounds one
acquire below that: past it ``DeadlineExceeded``, without waiting for a reconnect."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import DaemonUnavailable, DeadlineExceeded


def _fails_while_stopped(pid: int, call: Callable[[], object], error: type[Exception]) -> float:
    """Seconds ``call()`` took to raise ``error`` while the daemon is stopped (SIGSTOP)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(error):
            call()
        return time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.timeout(60)
def test_a_stopped_daemon_times_out_the_exchange_and_the_client_recovers(spawn_daemon) -> None:
    daemon = spawn_daemon()
    with connect(daemon.socket, timeout=1.0) as client:
        key = client.publish(ArtifactIdentity.simple("e2e/peer-timeout"), {"w": torch.ones(256)})
        # times out, reconnects once (the greeting times out too)
        elapsed = _fails_while_stopped(daemon.pid, lambda: client.acquire(key), DaemonUnavailable)
        assert 0.9 <= elapsed < 10, elapsed
        with client.acquire(key) as lease:  # a fresh connection and session
            assert float(lease.tensors["w"].sum()) == 256.0
        assert [x["key"] for x in client.leases()] == []


@pytest.mark.timeout(60)
def test_an_acquire_timeout_bounds_the_acquire_below_the_connection_timeout(spawn_daemon) -> None:
    daemon = spawn_daemon()
    with connect(daemon.socket, timeout=30.0) as client:
        key = client.publish(ArtifactIdentity.simple("e2e/acquire-timeout"), {"w": torch.ones(64)})
        # no reconnect once the deadline has passed
        elapsed = _fails_while_stopped(daemon.pid, lambda: client.acquire(key, timeout=1.0), DeadlineExceeded)
        assert 0.9 <= elapsed < 10, elapsed
        with client.acquire(key, timeout=30.0) as lease:  # the broken connection is replaced
            assert float(lease.tensors["w"].sum()) == 64.0
