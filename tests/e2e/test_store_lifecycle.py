"""An artifact's life in the store, end to end: real hwrd processes, real workers, real files.

Capacity and LRU eviction that never touches a leased, pinned or mapped artifact (even one whose
mapping process's session died), concurrent publications under a store limit, the stalled
publisher deadline, verification + quarantine, pins across restarts, hwrctl, and restart
recovery with automatic client reattachment.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import ActiveLease, ArtifactDenied, StoreLimitExceeded
from hwr.daemon.ctl import cli as ctl

from .helpers import rot_a_byte

WORKER = Path(__file__).with_name("store_worker.py")
MIB = 1 << 20
ART = MIB + 136  # one 256Ki-float32 tensor plus its safetensors header, as the store lays it out


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1 << 18,), float(seed), dtype=torch.float32)}


def _publish(client, name: str, seed: int = 0) -> str:  # type: ignore[no-untyped-def]
    key = client.publish(ArtifactIdentity.simple(name), _tensors(seed))
    time.sleep(0.02)  # distinct LRU timestamps
    return key


def _worker(*args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, str(WORKER), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    assert line.strip() == "ready", (line, proc.stderr.read() if proc.stderr else "")
    return proc


def _keys(client) -> set[str]:  # type: ignore[no-untyped-def]
    return {a["key"] for a in client.list_artifacts()}


def _ctl(sock: Path, *args: str) -> int:
    return ctl.main(["--socket", str(sock), *args])


@pytest.mark.usefixtures("daemon_user")  # root and the unit's unprivileged user
def test_eviction_is_lru_and_spares_leased_pinned_and_mapped(spawn_daemon, short_tmp: Path) -> None:
    daemon = spawn_daemon("--store-limit-bytes", str(4 * ART))
    with connect(daemon.socket) as client:
        mapped, leased, pinned, old = (_publish(client, n, i) for i, n in
                                       enumerate(["mapped", "leased", "pinned", "old"]))
        mapper = _worker("map-then-drop-session", str(daemon.socket), mapped)
        try:
            deadline = time.monotonic() + 10
            while client.leases() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert client.leases() == []  # the mapper's session is gone: only its mapping remains
            lease = client.acquire(leased)
            client.pin(pinned)
            with client.acquire(old):  # touch "old" after the others: it becomes the most recent
                pass
            # The store is full: the next publication must evict exactly one unused artifact.
            # LRU order is mapped < leased < pinned < old, and the first three are in use.
            newer = _publish(client, "newer", 9)
            assert _keys(client) == {mapped, leased, pinned, newer}
            with pytest.raises(ActiveLease) as refused:
                client.evict(mapped)
            assert refused.value.details["reason"] == "mapped"
            assert str(mapper.pid) in refused.value.details["pids"]
            with pytest.raises(ActiveLease, match="leased"):
                client.evict(leased)
            with pytest.raises(ActiveLease, match="pinned"):
                client.evict(pinned)
            report = client.gc(0)
            assert report["evicted"] == [newer]
            assert {s["reason"] for s in report["skipped"]} == {"mapped", "leased", "pinned"}
            # Nothing evictable left: a publication that needs room gets a typed error.
            with pytest.raises(StoreLimitExceeded):
                client.publish(ArtifactIdentity.simple("x"), {"w": torch.zeros(4 << 18)})
            with pytest.raises(StoreLimitExceeded):
                client.publish(ArtifactIdentity.simple("too-big"), {"w": torch.zeros(5 << 18)})
        finally:
            mapper.kill()
            mapper.wait()
        assert client.evict(mapped)["freed_bytes"] == ART  # the mapping is gone with its process
        lease.close()


def test_lru_order_survives_a_clean_restart(spawn_daemon) -> None:
    daemon = spawn_daemon("--store-limit-bytes", str(3 * ART))
    with connect(daemon.socket) as client:
        first, second, third = (_publish(client, n, i) for i, n in enumerate(["first", "second", "third"]))
        with client.acquire(first):  # "first" becomes the most recently used
            pass
    assert daemon.stop() == 0  # a clean stop saves the access times (access.json)
    daemon = spawn_daemon("--store-limit-bytes", str(3 * ART))
    with connect(daemon.socket) as client:
        # Forgotten access times would make commit order the LRU order and evict "first".
        newer = _publish(client, "newer", 9)
        keys = _keys(client)
        assert second not in keys and keys == {first, third, newer}


@pytest.mark.usefixtures("daemon_user")  # root and the unit's unprivileged user
def test_concurrent_publications_never_exceed_the_store_limit(spawn_daemon) -> None:
    limit = 3 * ART
    daemon = spawn_daemon("--store-limit-bytes", str(limit))
    peak = [0]
    stop = threading.Event()
    errors: list[BaseException] = []

    def listing() -> tuple[list[str], list[str]]:
        return sorted(os.listdir(Path(daemon.root) / "artifacts")), sorted(os.listdir(Path(daemon.root) / "tmp"))

    def watch() -> None:
        # What is really on disk: committed payloads plus preallocated staging payloads. A sample
        # counts only when the directory listings did not change while it was taken (a walk is
        # not atomic: it could see an evicted artifact and the staging that replaced it).
        while not stop.is_set():
            before = listing()
            total = 0
            for sub in ("artifacts", "tmp"):
                for dirpath, _dirs, files in os.walk(Path(daemon.root) / sub):
                    for name in files:
                        if name.endswith(".safetensors") and ".removed." not in dirpath:
                            with contextlib.suppress(FileNotFoundError):
                                total += os.lstat(os.path.join(dirpath, name)).st_size
            if listing() == before:
                peak[0] = max(peak[0], total)

    published: list[str] = []

    def publish(n: int) -> None:
        with connect(daemon.socket) as c:
            for i in range(4):
                try:
                    published.append(_publish(c, f"c{n}-{i}", n * 10 + i))
                except BaseException as exc:  # collected and asserted below
                    errors.append(exc)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=publish, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    # Several reservations at once may fill the limit: the others are refused, typed, never overshoot.
    assert all(isinstance(e, StoreLimitExceeded) for e in errors), errors
    assert len(published) >= 6
    with connect(daemon.socket) as c:
        u = c.store_usage()
        assert u["store_bytes"] <= limit and u["reserved_bytes"] == 0
        assert u["evictions"] >= len(published) - 3
    assert peak[0] <= limit
    assert os.listdir(Path(daemon.root) / "tmp") == []


def test_stalled_publisher_is_cancelled_at_its_deadline(spawn_daemon) -> None:
    daemon = spawn_daemon("--publication-deadline-s", "1.0", "--housekeeping-interval-s", "0.2")
    staller = _worker("stall", str(daemon.socket), "stalled-model")
    try:
        with connect(daemon.socket) as client:
            deadline = time.monotonic() + 15
            while client.status()["publications"] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert client.status()["publications"] == 0
            assert client.store_usage()["reserved_bytes"] == 0
        assert os.listdir(Path(daemon.root) / "tmp") == []
        assert staller.stdin is not None and staller.stdout is not None
        staller.stdin.write("go\n")
        staller.stdin.flush()
        assert staller.stdout.readline().strip() == "error PUBLICATION_FAILED"
    finally:
        staller.kill()
        staller.wait()


@pytest.mark.usefixtures("daemon_user")  # root and the unit's unprivileged user
def test_verify_catches_a_flipped_byte_and_stops_handing_it_out(spawn_daemon) -> None:
    daemon = spawn_daemon()
    with connect(daemon.socket) as client:
        key = _publish(client, "victim", 3)
        seen: list[tuple[int, int]] = []
        assert client.verify(key[:8], lambda d, t: seen.append((d, t)))["ok"]
    daemon.stop()
    # Bit rot: one byte flips on disk, sizes and timestamps stay (metadata checks cannot see it).
    rot_a_byte(Path(daemon.root) / "artifacts" / key / "model-00001.safetensors", 4096)
    daemon = spawn_daemon(daemon=daemon)
    with connect(daemon.socket) as client:
        lease = client.acquire(key)  # metadata still validates: only a re-hash can tell
        verdict = client.verify(key)
        assert not verdict["ok"] and verdict["error_code"] == "CHECKSUM_MISMATCH" and verdict["quarantined"]
        assert [x["lease_id"] for x in verdict["affected_leases"]] == [lease.lease_id]
        with pytest.raises(ArtifactDenied):
            client.acquire(key)
        assert any(e.startswith(key) for e in os.listdir(Path(daemon.root) / "quarantine"))
        assert _ctl(daemon.socket, "verify", "--all") == 0  # nothing left to verify is fine
        lease.close()


@pytest.mark.usefixtures("daemon_user")  # root and the unit's unprivileged user
def test_pins_survive_restart_and_ctl_commands(spawn_daemon, short_tmp: Path, capsys) -> None:
    daemon = spawn_daemon()
    with connect(daemon.socket) as client:
        key = _publish(client, "pinned")
        other = _publish(client, "other")
    assert _ctl(daemon.socket, "pin", key[:10]) == 0
    daemon.kill()
    daemon = spawn_daemon()
    with connect(daemon.socket) as client:
        assert [a["pinned"] for a in client.store_usage()["artifacts"] if a["key"] == key] == [True]
    capsys.readouterr()
    assert _ctl(daemon.socket, "evict", key) == 1
    assert "pinned" in capsys.readouterr().err
    assert _ctl(daemon.socket, "deny", other, "--reason", "bad batch") == 0
    with connect(daemon.socket) as client, pytest.raises(ArtifactDenied):
        client.acquire(other)
    assert _ctl(daemon.socket, "allow", other) == 0
    assert _ctl(daemon.socket, "verify", other, "--json") == 0
    assert _ctl(daemon.socket, "unpin", key) == 0
    assert _ctl(daemon.socket, "gc", "--target-bytes", "0", "--json") == 0
    assert _ctl(daemon.socket, "usage") == 0
    with connect(daemon.socket) as client:
        assert _keys(client) == set()


def test_restart_keeps_held_artifacts_and_clients_reattach(spawn_daemon) -> None:
    daemon = spawn_daemon()
    with connect(daemon.socket) as client:
        key = _publish(client, "held", 7)
        spare = _publish(client, "spare", 8)
    holder = _worker("hold", str(daemon.socket), key)
    try:
        daemon.kill()  # SIGKILL: no chance to persist anything more
        daemon = spawn_daemon()
        with connect(daemon.socket) as client:
            # Before the holder reattaches, the journal (and its mapping) keep the artifact.
            report = client.gc(0)
            assert key not in report["evicted"]
            assert holder.stdout is not None
            line = holder.stdout.readline().split()
            assert line[0] == "reattached" and float(line[2]) == 7.0
            assert [x["pid"] for x in client.leases()] == [holder.pid]
            assert spare not in _keys(client)
        holder.kill()
        holder.wait()
        with connect(daemon.socket) as client:
            deadline = time.monotonic() + 10
            while client.leases() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert client.gc(0)["evicted"] == [key]
    finally:
        holder.kill()
        holder.wait()


def test_restart_protects_an_artifact_held_only_through_the_lease_journal(spawn_daemon) -> None:
    """The holder has the lease's descriptors but no mapping (so the /proc mappings scan cannot
    see it) and never reattaches: across a SIGKILL of the daemon, the replayed lease journal is
    the only thing that keeps ``gc`` from evicting its artifact. Once the holder exits, the
    hold goes and the same ``gc`` evicts it."""
    daemon = spawn_daemon()
    root = Path(daemon.root)
    with connect(daemon.socket) as client:
        key = _publish(client, "journal-only", 9)
        spare = _publish(client, "journal-spare", 10)
    holder = _worker("hold-unmapped", str(daemon.socket), key)
    try:
        payloads = sorted((root / "artifacts" / key).glob("*.safetensors"))
        expected = [hashlib.sha256(p.read_bytes()).hexdigest() for p in payloads]
        daemon.kill()  # SIGKILL: the journal on disk is all the restarted daemon learns from
        daemon = spawn_daemon()
        # The premise: nothing but the journal can protect it.
        maps = Path(f"/proc/{holder.pid}/maps").read_text()
        assert str(root.resolve() / "artifacts") not in maps, "the holder maps the artifact"
        with connect(daemon.socket) as client:
            assert client.leases() == [], "the holder reattached: the journal is not alone"
            report = client.gc(0)
            assert key not in report["evicted"], "gc evicted an artifact a live process may still map"
            assert spare in report["evicted"], report  # gc did run, and evicts what nobody holds
            assert key in _keys(client)
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.write("check\n")
        holder.stdin.flush()
        assert holder.stdout.readline().split() == ["sha", *expected]
        holder.kill()
        holder.wait()
        with connect(daemon.socket) as client:
            deadline = time.monotonic() + 10
            while key not in client.gc(0)["evicted"]:
                assert time.monotonic() < deadline, "the hold outlived its process"
                time.sleep(0.1)
    finally:
        holder.kill()
        holder.wait()


def test_leases_closed_while_the_client_reattaches_leave_none_behind(spawn_daemon) -> None:
    """After a daemon restart the client reattaches its open leases (a new lease id each) while
    the application closes them. A close that lands between a reattach's check and its new
    binding once released the old id and left the new one held by the session: the artifact
    stayed leased (unevictable) until the client exited."""
    daemon = spawn_daemon()
    with connect(daemon.socket) as client:
        key = _publish(client, "reattach-race")
    with connect(daemon.socket) as client:
        client.auto_reconnect = False  # this test drives the reconnect itself
        for _ in range(5):
            leases = [client.acquire(key) for _ in range(150)]
            daemon.kill()
            daemon = spawn_daemon()
            closer = threading.Thread(target=lambda leases=leases: [lease.close() for lease in reversed(leases)])
            reattach = threading.Thread(target=client.reconnect)
            reattach.start()
            closer.start()
            reattach.join(60)
            closer.join(60)
            with connect(daemon.socket) as admin:
                assert admin.leases() == [], "a lease closed during the reattach is still held"
