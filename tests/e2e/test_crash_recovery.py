"""Acceptance: hwrd killed with SIGKILL during publications restarts clean on the same root, and
each publisher gets a typed error (never a raw gRPC error, never a hang).

One daemon life covers both moments a publication can be caught in: a publisher that has staged
and written part of its tensors, and a publisher blocked in ``CommitPublication`` while hwrd is
inside the commit (a store fault hook holds the commit after hashing, so the kill lands there
deterministically).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hwr.client import ArtifactIdentity, ArtifactNotFound, connect
from hwr.daemon.app.launcher import DaemonProcess

from .helpers import MIB, FaultDaemon, Worker, artifact_entries, digests, staging_entries, wait_until

COMMIT_STEP = "hashed"  # after every byte was hashed, before fsync, manifest and rename


def _assert_typed(report: dict[str, object]) -> None:
    error = report["error"]
    assert isinstance(error, dict), report
    assert error["hwr"] is True and error["grpc"] is False, error
    assert (error["type"], error["code"]) == ("DaemonUnavailable", "DAEMON_UNAVAILABLE"), error


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_daemon_killed_during_publications_restarts_clean(
    spawn_daemon: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    root, sock = short_tmp / "store", short_tmp / "hwrd.sock"
    partial_model, committing_model = "e2e/crash-partial", "e2e/crash-committing"
    marker = short_tmp / "commit-blocked"
    daemon = spawn_daemon(daemon=FaultDaemon(root, sock, COMMIT_STEP, marker))
    partial = Worker("publish-killed", str(sock), partial_model, str(8 * MIB))
    committing = Worker("publish-killed", str(sock), committing_model, str(8 * MIB))
    try:
        partial.expect("partial")  # staged; one tensor of four written through the passed descriptor
        committing.expect("partial")
        committing.send("continue")
        committing.expect("committing")
        wait_until(marker.exists, timeout=60)  # hwrd is inside that commit now, the publisher waits
        assert len(staging_entries(root)) == 2

        daemon.kill()
        partial.send("continue")  # writes the rest through its descriptor, then commits
        reports = {"partial": partial.result(timeout=60), "committing": committing.result(timeout=60)}
        assert partial.wait() == 0, partial.stderr
        assert committing.wait() == 0, committing.stderr
    finally:
        partial.close()
        committing.close()
    print(f"\npublishers saw: {reports}")
    for report in reports.values():
        _assert_typed(report)
    assert len(staging_entries(root)) == 2, "the killed daemon had no chance to reclaim its staging"

    spawn_daemon(root=root, sock=sock)
    assert staging_entries(root) == []
    assert artifact_entries(root) == []
    with connect(sock) as client:
        assert client.list_artifacts() == []
        assert client.status()["publications"] == 0
        for model in (partial_model, committing_model):
            with pytest.raises(ArtifactNotFound):
                client.acquire(ArtifactIdentity.simple(model))
            # The identity is free again: the next publisher succeeds and its bytes are served.
            tensors = {"w": torch.arange(64, dtype=torch.float32)}
            key = client.publish(ArtifactIdentity.simple(model), tensors)
            with client.acquire(key) as lease:
                assert digests(lease.tensors) == digests(tensors)
    assert staging_entries(root) == []
