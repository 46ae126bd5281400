"""Eviction by hwrd running as the unit's unprivileged user (``daemon_proc.HWRD``), with workers
of other uids: what a daemon that is not root may remove, and what it must keep.

Such a daemon owns its store but has no capability: it may not rename a 0555 artifact directory
out of ``artifacts/`` without making it writable first, and it may not read the
``/proc/<pid>/maps`` of another uid's processes, so whether a worker still maps an artifact is
proven with a write-lease probe of its payloads (``hwr.daemon.system.exclusive``) instead.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from daemon_proc import HWRD, STRANGER, DaemonProcess, RunAs, as_user

from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import ActiveLease
from hwr.daemon.ctl import cli as ctl

WORKER = Path(__file__).with_name("store_worker.py")

pytestmark = pytest.mark.usefixtures("daemon_user")


@pytest.fixture
def daemon_user() -> RunAs:
    """This module's daemons all run as the unit's unprivileged user."""
    return HWRD


def _publish(client, name: str, seed: float) -> str:  # type: ignore[no-untyped-def]
    return client.publish(ArtifactIdentity.simple(name), {"w": torch.full((1 << 18,), seed)})


@pytest.mark.timeout(180)
def test_a_daemon_that_is_not_root_evicts_what_nobody_maps_and_keeps_what_a_stranger_maps(
        spawn_daemon, capsys: pytest.CaptureFixture[str]) -> None:
    daemon: DaemonProcess = spawn_daemon("--allow-uid", str(STRANGER.uid), "--socket-mode", "666")
    with connect(daemon.socket) as client:
        released, by_ctl, for_gc, mapped = (_publish(client, n, i) for i, n in
                                            enumerate(["released", "by-ctl", "for-gc", "mapped"]))
        for key in (released, by_ctl, for_gc):
            with client.acquire(key):  # leased by root, whose processes the daemon cannot read
                pass
        worker = subprocess.Popen(as_user(STRANGER, [sys.executable, str(WORKER), "map-then-drop-session",
                                                     str(daemon.socket), mapped]),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert worker.stdout is not None
            assert worker.stdout.readline().strip() == "ready", worker.communicate(timeout=30)[1]
            assert client.evict(released)["freed_bytes"] > 0
            capsys.readouterr()
            assert ctl.main(["--socket", str(daemon.socket), "evict", by_ctl[:12]]) == 0, capsys.readouterr().err
            with pytest.raises(ActiveLease) as refused:  # the stranger's session is gone, its mapping is not
                client.evict(mapped)
            assert refused.value.details["reason"] == "mapped"
            assert str(worker.pid) in refused.value.details["pids"].split(",")
            report = client.gc(0)
            assert report["evicted"] == [for_gc]
            assert [s["key"] for s in report["skipped"]] == [mapped]
        finally:
            worker.kill()
            worker.wait(30)
        assert client.evict(mapped)["freed_bytes"] > 0  # gone with its process
        assert client.list_artifacts() == []
    assert sorted(p.name for p in (daemon.root / "artifacts").iterdir()) == []
    assert list((daemon.root / "tmp").iterdir()) == []
