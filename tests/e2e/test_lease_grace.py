"""A publication that needs room while every artifact is leased and nothing else is in flight
waits briefly (``LEASE_GRACE_S``) for a lease to be released, instead of failing at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import StoreLimitExceeded
from hwr.daemon.app.launcher import DaemonProcess
from hwr.daemon.service.capacity import LEASE_GRACE_S

ART = (1 << 18) * 4 + 136  # one 256Ki-float32 tensor plus its safetensors header


def _tensors(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1 << 18,), value)}


@pytest.mark.usefixtures("daemon_user")  # root and the unit's unprivileged user
@pytest.mark.timeout(120)
def test_a_lease_released_during_the_grace_makes_room(spawn_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = spawn_daemon("--store-limit-bytes", str(ART))
    with connect(daemon.socket) as holder, connect(daemon.socket) as publisher:
        first = holder.publish(ArtifactIdentity.simple("first"), _tensors(1.0))
        lease = holder.acquire(first)
        threading.Timer(0.3, lease.close).start()  # the last lease goes during the grace
        started = time.monotonic()
        second = publisher.publish(ArtifactIdentity.simple("second"), _tensors(2.0), wait_timeout=30)
        waited = time.monotonic() - started
        assert 0.25 <= waited < LEASE_GRACE_S + 5
        with publisher.acquire(second) as got:
            assert float(got.tensors["w"][0]) == 2.0
        assert first not in {a["key"] for a in publisher.list_artifacts()}  # evicted to make room


@pytest.mark.usefixtures("daemon_user")  # root and the unit's unprivileged user
@pytest.mark.timeout(120)
def test_a_lease_held_past_the_grace_is_the_typed_error_after_it(spawn_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = spawn_daemon("--store-limit-bytes", str(ART))
    with connect(daemon.socket) as holder, connect(daemon.socket) as publisher:
        first = holder.publish(ArtifactIdentity.simple("first"), _tensors(1.0))
        with holder.acquire(first):
            started = time.monotonic()
            with pytest.raises(StoreLimitExceeded):
                publisher.publish(ArtifactIdentity.simple("second"), _tensors(2.0), wait_timeout=30)
            waited = time.monotonic() - started
            assert LEASE_GRACE_S * 0.9 <= waited < LEASE_GRACE_S + 5  # the grace, not the 30 s
            with pytest.raises(StoreLimitExceeded):  # wait_timeout 0: no grace at all
                publisher.publish(ArtifactIdentity.simple("third"), _tensors(3.0), wait_timeout=0)
