"""Eviction by hwrd running as the unit's unprivileged user (``daemon_proc.HWRD``), with workers
of other uids: what a daemon that is not root may remove, and what it must keep.

Such a daemon owns its store but has no capability: it may not rename a 0555 artifact directory
out of ``artifacts/`` without making it writable first, and it may not read the
``/proc/<pid>/maps`` of another uid's processes, so whether a worker still maps an artifact is
proven with a write-lease probe of its payloads (``hwr.daemon.system.exclusive``) instead.
That probe also runs in every eviction round that acquires race (the clients here are root, whose
maps such a daemon cannot read); the same race against the /proc scan of a root daemon runs
in-process (tests/service/test_store_policies.py).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from daemon_proc import HWRD, STRANGER, DaemonProcess, RunAs, as_user

from hwr.client import ArtifactIdentity, Client, connect
from hwr.client.errors import ActiveLease, ArtifactNotFound
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


ELEMENTS = 1 << 12  # float32 elements of the race test's artifacts (16 KiB)


def _publish_until(daemon: DaemonProcess, stop: float, seed: int, keys: list[str], failures: list[BaseException],
                   before_each: Callable[[Client], None]) -> None:
    """One client publishing new artifacts until ``stop`` (appending their keys), each publication
    evicting in a store with room for a few; ``before_each`` runs first each time."""
    try:
        with connect(daemon.socket) as client:
            n = 0
            while time.monotonic() < stop:
                before_each(client)
                n += 1
                keys.append(client.publish(ArtifactIdentity.simple(f"race-{seed}-{n}"),
                                           {"w": torch.full((ELEMENTS,), float(n))}, wait_timeout=30))
    except BaseException as exc:  # reported by the caller's assertion
        failures.append(exc)


@pytest.mark.timeout(120)
def test_acquires_racing_evictions_never_deny_an_artifact(spawn_daemon) -> None:
    """Clients acquire artifacts that other clients' publications are evicting (a store with
    room for 4): an acquire either leases the artifact or gets ArtifactNotFound. An eviction
    caught half done by a lookup once wrote a deny marker (MANIFEST_CORRUPT, "artifact changed
    since it was validated"), after which the identity could not be published again. Here each
    round's "nobody maps it" comes from the write-lease probe, racing the acquires that open
    the same payloads."""
    daemon = spawn_daemon("--store-limit-bytes", str(4 * (ELEMENTS * 4 + 136)))
    keys: list[str] = []
    counts = {"leased": 0, "not_found": 0}
    failures: list[BaseException] = []

    def acquire_newest(client: Client) -> None:
        for key in keys[-6:]:  # the newest: most are about to be evicted, some are gone
            try:
                with client.acquire(key):
                    counts["leased"] += 1
            except ArtifactNotFound:
                counts["not_found"] += 1

    stop = time.monotonic() + 6.0
    threads = [threading.Thread(target=functools.partial(_publish_until, daemon, stop, i, keys, failures,
                                                         acquire_newest)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures
    assert len(keys) > 20 and counts["leased"] > 20, (len(keys), counts)
    assert sorted(os.listdir(Path(daemon.root) / "deny")) == [], "an eviction was mistaken for corruption"
    with connect(daemon.socket) as client:
        # Every identity can still be published (evicted ones again: nothing was denied).
        for seed in range(4):
            client.publish(ArtifactIdentity.simple(f"race-{seed}-1"), {"w": torch.full((ELEMENTS,), 1.0)})
