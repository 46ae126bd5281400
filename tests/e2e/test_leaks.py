"""Acceptance: a thousand acquire/release cycles leak no descriptor in hwrd (nor in the client)."""

from __future__ import annotations

import os

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.publisher import specs_for
from hwr.daemon.app.launcher import DaemonProcess

from .helpers import count_mappings, fd_count, patterned, wait_until

CYCLES = 1000
SLACK = 5


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_no_descriptor_leak_after_a_thousand_cycles(shared_hwrd: DaemonProcess) -> None:
    daemon = shared_hwrd
    identity = ArtifactIdentity.simple("e2e/leak")
    tensors = {"w": patterned(1 << 20, 13, torch.bfloat16).reshape(1024, 512),
               "b": torch.zeros(1024, dtype=torch.float32)}
    artifacts = daemon.root / "artifacts"
    with connect(daemon.socket) as client:
        key = client.publish(identity, tensors)
        for _ in range(20):  # warm up lazily opened descriptors (gRPC, thread pools, caches)
            with client.acquire(key):
                pass
        daemon_before, client_before = fd_count(daemon.pid), fd_count("self")
        maps_before = count_mappings(os.getpid(), artifacts)

        for i in range(CYCLES):
            lease = client.acquire(identity if i % 2 else key)  # by identity and by key
            assert lease.key == key
            if i % 100 == 0:  # now and then with a live view, released while the view lives
                view = lease.tensors["b"]
                lease.close()
                assert float(view.sum()) == 0.0
                del view
            else:
                lease.close()
        # Session churn and abandoned publications go through the same descriptor paths.
        for n in range(20):
            with connect(daemon.socket) as other:
                other.acquire(key)  # left open: the session's end releases it
                with other.publisher(ArtifactIdentity.simple(f"e2e/leak-abort-{n}"),
                                     specs_for(tensors)) as pub:
                    pub.abort()

        wait_until(lambda: client.status()["leases"] == 0, timeout=2.0)  # sessions end asynchronously
        daemon_after, client_after = fd_count(daemon.pid), fd_count("self")
        maps_after = count_mappings(os.getpid(), artifacts)
    print(f"\nhwrd descriptors: {daemon_before} before, {daemon_after} after {CYCLES} cycles; "
          f"client descriptors {client_before} -> {client_after}; mappings {maps_before} -> {maps_after}")
    assert daemon_after - daemon_before <= SLACK
    assert client_after - client_before <= SLACK
    assert maps_after - maps_before <= SLACK
