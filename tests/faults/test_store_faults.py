"""Faults at the store's OS boundary: ENOSPC/EIO at every write step, a full tmpfs, files changed
behind the daemon's back, and wall-clock jumps. Every test ends with ``check_invariants``.

Injection (``hwr.daemon.app.fault_injection``): the daemon starts with ``HWR_TEST_FAULTS=<control
file>``; the test then arms "fail the N-th store syscall (fallocate/pwrite/fsync/rename) with
ERRNO" and publishes; the daemon logs every counted call, so the test learns which step failed
and stops when a publication completes with no fault fired (every step has then been hit once).

Quick size (CI) and long size are the same here: the write steps are enumerated exhaustively
(about 10 per publication x ENOSPC/EIO). ``.venv/bin/python -m pytest tests/faults -q`` runs the
whole fault suite; the two full-disk tests mount a small tmpfs, as root or, without privileges,
inside a user + mount namespace (``tests/faults/tmpfs.py``), and skip only when neither works
(fail when ``CI`` is set).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import HwrError, InsufficientCapacity, NoSpace, PublicationFailed, StoreIOError

from .faultkit import Control, Outcome, check_invariants, fd_count, model_number, publish, wait_for
from .tmpfs import small_tmpfs

EXPECTED = {"ENOSPC": (NoSpace,), "EIO": (PublicationFailed, StoreIOError)}


@pytest.mark.parametrize("errno_name", ["ENOSPC", "EIO"])
def test_fault_at_every_write_step_of_a_publication(spawn, fault_tmp: Path, errno_name: str,
                                                   outcome: Outcome) -> None:
    outcome.kind = f"{errno_name} at each publication write step"
    control = Control(fault_tmp)
    daemon = spawn(faults=control.path)
    with connect(daemon.socket) as client:
        kept = publish(client, "kept-0", 0)
        lease = client.acquire(kept)  # a lease that must survive every fault below
        steps: list[str] = []
        for n in range(1, 64):
            control.set(fail_at=n, errno=errno_name)
            name = f"victim-{errno_name}-{n}"
            try:
                key = publish(client, name, n)
                error = None
            except HwrError as exc:
                error = exc
            fired = [op for _, op, verdict in control.calls() if verdict == "FAILED"]
            if not fired:
                assert error is None, f"{name}: failed with no fault injected: {error!r}"
                break
            steps.append(fired[0])
            outcome.tried += 1
            if error is None:
                pytest.fail(f"{errno_name} at call {n} ({fired[0]}) was swallowed: the publication succeeded")
            assert isinstance(error, EXPECTED[errno_name]), f"call {n} ({fired[0]}): {error!r}"
            if errno_name == "ENOSPC":
                assert error.code == "ENOSPC"
            control.set()  # no more faults while the invariants are checked
            check_invariants(daemon, held=[kept], live_pids=[os.getpid()], outcome=outcome)
            # Either nothing of the failed publication is visible, or (a failure after the
            # atomic rename, when only the directory fsync failed) the whole artifact is.
            listed = {a["key"] for a in client.list_artifacts()}
            key = ArtifactIdentity.simple(name).key
            if key in listed:
                with client.acquire(key) as got:
                    assert bool((got.tensors["w"] == float(n)).all())
        else:
            pytest.fail("the publication never completed: more than 63 store syscalls?")
        assert {"fallocate", "pwrite", "fsync", "rename"} <= set(steps), steps
        intact = bool((lease.tensors["w"] == 0.0).all())
        outcome.lost += not intact
        assert intact, "the lease held through every fault changed"
        lease.close()


def test_full_disk_on_a_small_tmpfs(spawn, fault_tmp: Path, outcome: Outcome) -> None:
    outcome.kind = "full tmpfs (typed refusal, eviction, kernel ENOSPC)"
    fs = small_tmpfs(fault_tmp / "mnt", "8m")
    mnt = fs.view  # where this process reaches the tmpfs (the daemon runs inside its namespaces)
    try:
        daemon = spawn(tmpfs=fs)
        numel = 1 << 19  # 2 MiB per artifact: three fit in 8 MiB, a fourth does not
        with connect(daemon.socket) as client:
            keys = [publish(client, f"full-{n}", n, numel) for n in range(3)]
            leases = [client.acquire(k) for k in keys]
            # No room, nothing evictable (all leased): typed refusal, nothing staged.
            outcome.tried += 1
            with pytest.raises(InsufficientCapacity):
                publish(client, "full-3", 3, numel)
            leases[0].close()
            outcome.tried += 1
            fourth = publish(client, "full-3", 3, numel)  # evicts the unleased LRU one
            listed = {a["key"] for a in client.list_artifacts()}
            assert listed == {keys[1], keys[2], fourth}
            # A real ENOSPC from the kernel after the capacity check passed: leave exactly the
            # payload's pages free, so preallocation fits and the manifest write does not.
            need = os.stat(next((mnt / "store" / "artifacts" / fourth).glob("*.safetensors"))).st_size
            client.evict(fourth)
            st = os.statvfs(mnt)
            free = st.f_bavail * st.f_frsize
            pages = -(-need // 4096) * 4096
            filler = mnt / "filler"
            with open(filler, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, free - pages)
            outcome.tried += 1
            with pytest.raises(NoSpace):
                publish(client, "full-4", 4, numel)
            check_invariants(daemon, held=keys[1:], live_pids=[os.getpid()], outcome=outcome)
            filler.unlink()
            publish(client, "full-4", 4, numel)
            for lease in leases[1:]:
                intact = bool((lease.tensors["w"] == float(_n(lease))).all())
                outcome.lost += not intact
                assert intact, f"{lease.key} changed under its lease"
                lease.close()
        check_invariants(daemon)
        assert daemon.stop() == 0
    finally:
        fs.close()


def _fill(mnt: Path) -> Path:
    """Take every free block of the filesystem at ``mnt``; returns the filler file."""
    filler = mnt / "filler"
    with open(filler, "wb") as f:
        st = os.statvfs(mnt)
        with contextlib.suppress(OSError):
            os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize)
        with contextlib.suppress(OSError):
            while True:
                os.write(f.fileno(), b"x" * 4096)
    assert os.statvfs(mnt).f_bavail == 0
    return filler


def test_acquires_on_a_full_disk_are_refused_typed_and_leak_nothing(spawn, fault_tmp: Path,
                                                                    outcome: Outcome) -> None:
    """The lease journal cannot be written on a full disk: an acquire is refused with NoSpace
    (no descriptor leaves without its journal record), and nothing leaks. Before the fix each
    refusal was an untyped internal error that leaked the payload descriptors, so an evicted
    artifact's blocks stayed allocated after deletion, and the journal dropped the buffered
    records of other leases."""
    outcome.kind = "full disk at acquire (lease journal refused typed, no descriptor leaked)"
    fs = small_tmpfs(fault_tmp / "mnt", "4m")
    mnt = fs.view
    try:
        daemon = spawn(tmpfs=fs)
        with connect(daemon.socket) as client:
            keys = [publish(client, f"journal-{n}", n, 1 << 16) for n in range(2)]
            held = client.acquire(keys[0])  # granted before the disk filled: must survive it
            baseline = fd_count(daemon.pid)
            filler = _fill(mnt)
            refused = 0
            for n in range(300):  # the journal's last page may take a few more records first
                outcome.tried += 1
                try:
                    client.acquire(keys[n % 2]).close()
                except NoSpace as exc:
                    assert "lease journal" in exc.message and exc.retryable
                    refused += 1
            assert refused >= 250, f"only {refused} of 300 acquires refused on a full disk"
            assert fd_count(daemon.pid) <= baseline, "refused acquires leaked descriptors"
            intact = bool((held.tensors["w"] == 0.0).all())
            outcome.lost += not intact
            assert intact, "the lease granted before the disk filled changed"
            held.close()  # its release record waits in memory for room
            filler.unlink()
            with client.acquire(keys[1]) as lease:
                assert model_number(lease) == 1
            assert client.leases() == []
        check_invariants(daemon, held=keys, outcome=outcome)
        daemon.kill()  # the journal on disk, not the daemon's memory, must tell the truth
        daemon = spawn(daemon=daemon)
        with connect(daemon.socket) as client:
            assert client.leases() == [] and {a["key"] for a in client.list_artifacts()} == set(keys)
        check_invariants(daemon)
        assert daemon.stop() == 0
    finally:
        fs.close()


def _n(lease) -> int:  # type: ignore[no-untyped-def]
    return int(lease.manifest.identity.source.model_id.rsplit("-", 1)[1])


def _rewrite(path: Path, offset: int) -> None:
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))
    os.chmod(path, 0o444)


@pytest.mark.usefixtures("daemon_user")  # root and the unit's unprivileged user
def test_store_files_changed_behind_the_daemons_back(spawn, outcome: Outcome) -> None:
    outcome.kind = "store files changed behind the daemon"
    daemon = spawn()
    root = Path(daemon.root)
    with connect(daemon.socket) as client:
        kept = publish(client, "kept-1", 1)
        lease = client.acquire(kept)
        victims = {name: publish(client, f"{name}-{i}", i) for i, name in
                   enumerate(["flipped", "truncated", "unready", "replaced", "manifest"], start=2)}
        for k in victims.values():  # validated and cached: the warm path must notice changes too
            with client.acquire(k):
                pass
        art = {name: root / "artifacts" / key for name, key in victims.items()}

        @contextlib.contextmanager
        def writable(directory: Path):  # type: ignore[no-untyped-def]
            os.chmod(directory, 0o755)
            try:
                yield
            finally:
                os.chmod(directory, 0o555)

        _rewrite(art["flipped"] / "model-00001.safetensors", 4096)
        os.chmod(art["truncated"] / "model-00001.safetensors", 0o644)
        os.truncate(art["truncated"] / "model-00001.safetensors", 1000)
        with writable(art["unready"]):
            (art["unready"] / "READY.json").unlink()
        with writable(art["replaced"]):
            payload = art["replaced"] / "model-00001.safetensors"
            data = payload.read_bytes()
            payload.unlink()
            payload.write_bytes(data)  # same bytes, a new inode: not the validated file
            os.chmod(payload, 0o444)
        with writable(art["manifest"]):
            m = art["manifest"] / "manifest.json"
            text = m.read_bytes()
            m.unlink()
            m.write_bytes(text.replace(b'"kind":"parameter"', b'"kind":"buffer"'))
        outcome.tried += len(victims)
        for name, key in victims.items():
            with pytest.raises(HwrError) as refused:
                client.acquire(key)
            assert refused.value.code in ("MANIFEST_CORRUPT", "ARTIFACT_DENIED", "CHECKSUM_MISMATCH"), (
                name, refused.value)
        assert not {a["key"] for a in client.list_artifacts()} & set(victims.values())
        # A flipped byte with sizes and mtime restored: verify (a full re-hash) refuses it.
        sneaky = publish(client, "sneaky-9", 9)
        payload = root / "artifacts" / sneaky / "model-00001.safetensors"
        st = os.stat(payload)
        _rewrite(payload, 5000)
        outcome.tried += 1
        os.utime(payload, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert not client.verify(sneaky)["ok"]
        with pytest.raises(HwrError):
            client.acquire(sneaky)
        intact = bool((lease.tensors["w"] == 1.0).all())
        outcome.lost += not intact
        assert intact, "the lease on the untouched artifact changed"
        lease.close()
    # Corrupt artifacts are denied (and, on a checksum mismatch, quarantined), never served.
    denied = set(os.listdir(root / "deny"))
    assert {f"{k}.json" for k in [*victims.values(), sneaky]} <= denied
    with connect(daemon.socket) as client:
        for name, key in victims.items():  # the operator cleans up (evict works on denied artifacts)
            try:
                client.evict(key)
            except HwrError as exc:
                raise AssertionError(f"evict {name}: {exc!r}") from exc
    check_invariants(daemon, held=[kept], outcome=outcome)


def test_wall_clock_jumps_do_not_move_the_stalled_publication_deadline(spawn, fault_tmp: Path,
                                                                       outcome: Outcome) -> None:
    """The stalled-publisher deadline runs on the event loop's monotonic clock: a wall-clock
    jump forward does not cancel early, a jump backward does not postpone it. (Leases have no
    deadlines: they end with their session, so there is no lease timer a jump could move.)"""
    outcome.kind = "wall-clock jumps (+10 y, -10 y)"
    control = Control(fault_tmp)
    daemon = spawn("--publication-deadline-s", "3", "--housekeeping-interval-s", "0.2", faults=control.path)
    stall_worker = Path(__file__).resolve().parents[1] / "e2e" / "store_worker.py"
    staller = subprocess.Popen([sys.executable, str(stall_worker), "stall", str(daemon.socket), "stalled"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert staller.stdout is not None and staller.stdout.readline().strip() == "ready"
        began = time.monotonic()
        with connect(daemon.socket) as client:
            control.set(clock_offset_s=10 * 365 * 86400.0)  # ten years ahead
            outcome.tried += 1
            time.sleep(1.5)
            assert client.status()["publications"] == 1, "a forward wall-clock jump cancelled it early"
            control.set(clock_offset_s=-10 * 365 * 86400.0)  # ten years back
            outcome.tried += 1
            wait_for(lambda: client.status()["publications"] == 0, 15, "the deadline to cancel the stall")
            elapsed = time.monotonic() - began
            assert elapsed >= 2.5, elapsed
            # Leases granted while the wall clock is off still work and end with the session.
            key = publish(client, "clock-1", 1)
            with client.acquire(key) as lease:
                assert float(lease.tensors["w"][0]) == 1.0
        control.set()
        check_invariants(daemon, live_pids=[staller.pid])
    finally:
        staller.kill()
        staller.wait()


def test_a_slow_disk_does_not_time_out_a_small_publication_on_the_peer_channel(spawn, fault_tmp: Path,
                                                                               outcome: Outcome) -> None:
    """A small publication commits over the peer socket; with every fsync slow its commit takes
    longer than the client's connection timeout. The commit exchange has its own, longer bound,
    so the publication lands and the session (with the client's other lease) survives: a timed-out
    peer exchange would have ended the session and dropped that lease until a reconnect."""
    outcome.kind = "slow disk under a small peer publication"
    control = Control(fault_tmp)
    daemon = spawn(faults=control.path)
    with connect(daemon.socket, timeout=1.0) as client:
        held = client.acquire(publish(client, "slow-base", 1))
        control.set(ops=["fsync"], slow_s=0.4)  # a commit runs about five fsyncs: ~2 s > 1 s
        outcome.tried += 1
        began = time.monotonic()
        key = client.publish(ArtifactIdentity.simple("slow-disk"), {"w": torch.full((64,), 3.0)})
        took = time.monotonic() - began
        control.set()
        assert took > 1.0, f"the fsyncs were not slowed ({took:.2f} s): the test proves nothing"
        assert client._connection.channel is None, "the publication must have used the peer socket"
        assert client.reconnects == 0 and not held.closed
        assert [x["lease_id"] for x in client.leases() if x["session_id"] == client.session_id] == [held.lease_id]
        with client.acquire(key) as lease:
            assert float(lease.tensors["w"][0]) == 3.0
        held.close()
    check_invariants(daemon, outcome=outcome)
