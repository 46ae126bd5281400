"""An artifact's life in the store across daemon processes: real hwrd processes, real workers,
real files.

Pins across restarts and hwrctl, the LRU order across a clean restart, restart recovery with
automatic client reattachment and the lease journal across a SIGKILL, and verification +
quarantine through the transport by a daemon that is not root. Eviction (LRU, sparing leased,
pinned and mapped artifacts), concurrent publications under a store limit, the stalled publisher
deadline and verification itself run in-process (tests/service/test_store_lifecycle.py).
"""

from __future__ import annotations

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
from hwr.client.errors import ArtifactDenied
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


# The service's verification runs in-process (tests/service/test_store_lifecycle.py). Here, the
# transport (the VerifyArtifact stream, its verdict, hwrctl verify) against a daemon that is not
# root: moving a 0555 artifact directory into quarantine/ needs it made writable first, which a
# root daemon's CAP_DAC_OVERRIDE would not notice missing.
@pytest.mark.usefixtures("daemon_user")
@pytest.mark.parametrize("daemon_user", ["unprivileged"], indirect=True)
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
