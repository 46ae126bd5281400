"""Acceptance: a lease ends when its holder dies, even by SIGKILL, within the 2 s liveness bound."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from hwr.client import ArtifactIdentity, Client, connect
from hwr.daemon.app.launcher import DaemonProcess

from .helpers import Worker, patterned, wait_until

LIVENESS_BOUND_S = 2.0


def _publish_small(client: Client, model: str) -> str:
    return client.publish(ArtifactIdentity.simple(model), {
        "w": patterned(256 * 1024, 5, torch.bfloat16).reshape(512, 256),
        "b": torch.zeros(512, dtype=torch.float32),
    })


def _hwrctl_leases(daemon: DaemonProcess) -> list[dict[str, object]]:
    run = subprocess.run(
        [sys.executable, "-m", "hwr.daemon.ctl.cli", "--socket", str(daemon.socket), "leases", "--json"],
        capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 0, run.stderr
    document = json.loads(run.stdout)
    assert isinstance(document, list)
    return document


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkilled_client_has_no_lease_after_two_seconds(shared_hwrd: DaemonProcess) -> None:
    with connect(shared_hwrd.socket) as client:
        key = _publish_small(client, "e2e/sigkill")
        worker = Worker("hold", str(shared_hwrd.socket), key)
        try:
            worker.expect("ready")
            worker.send("acquire")
            lease_id = worker.expect("held").split()[0]
            held = [x for x in client.leases() if x["lease_id"] == lease_id]
            assert [(x["key"], x["pid"]) for x in held] == [(key, worker.pid)]

            os.kill(worker.pid, signal.SIGKILL)
            worker.wait(10)
            took = wait_until(lambda: not any(x["lease_id"] == lease_id for x in client.leases()),
                              timeout=LIVENESS_BOUND_S)
            print(f"\nlease of the SIGKILLed worker released {took * 1000:.0f} ms after its death")
        finally:
            worker.close()
        # The operator's view agrees. The observer holds a lease of its own meanwhile, so an empty
        # or broken listing cannot pass for "the dead worker's lease is gone".
        with client.acquire(key) as mine:
            listed = _hwrctl_leases(shared_hwrd)
            assert [(x["key"], x["pid"], x["lease_id"]) for x in listed] == [(key, os.getpid(), mine.lease_id)]
        assert client.status()["leases"] == 0
        assert client.keepalive()["lease_count"] == 0  # the observer's own session is untouched


@pytest.mark.timeout(90)
def test_forked_child_does_not_keep_a_killed_parents_lease(shared_hwrd: DaemonProcess) -> None:
    """The child inherits the peer socket; the client drops it in the child, so the parent's
    death still ends the parent's session while the child lives on."""
    with connect(shared_hwrd.socket) as client:
        key = _publish_small(client, "e2e/orphan")
        worker = Worker("fork-orphan", str(shared_hwrd.socket), key)
        child = 0
        try:
            lease_id, child_text = worker.expect("held").split()
            child = int(child_text)
            assert any(x["lease_id"] == lease_id for x in client.leases())
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait(10)
            os.kill(child, 0)  # the forked child is still alive, holding the inherited mapping
            wait_until(lambda: not any(x["lease_id"] == lease_id for x in client.leases()),
                       timeout=LIVENESS_BOUND_S)
        finally:
            worker.close()
            if child:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
        assert client.status()["leases"] == 0
