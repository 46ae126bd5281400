"""The daemon's store: publication, lookup, corruption handling, concurrency, trust checks."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from hwr.client.errors import (
    ArtifactDenied,
    ArtifactNotFound,
    ChecksumMismatch,
    IdentityCollision,
    InvalidRequest,
    ManifestCorrupt,
    NoSpace,
    PublicationFailed,
    StoreLocked,
    UntrustedStore,
)
from hwr.client.identity import ArtifactIdentity
from hwr.client.safetensors_header import read_header
from hwr.daemon.store import fileio as store_io
from hwr.daemon.store.root import StagedTensor, Store
from hwr.daemon.store.staging import write_tensor
from hwr.daemon.system import fsguard

IDENTITY = ArtifactIdentity.simple("org/model")


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "blocks.0.w": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "blocks.0.b": torch.randn(32, generator=g),
        "scale": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
        "steps": torch.arange(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


def _read_back(store: Store, key: str) -> dict[str, bytes]:
    record = store.records.lookup(key)
    out = {}
    for (name, fd), _ in zip(store.records.open_payloads(record), record.manifest.files, strict=True):
        try:
            header = read_header(fd)
            for t in record.manifest.tensors_in(name):
                e = header.entry(t.storage_key)
                out[t.name] = os.pread(fd, e.nbytes, header.data_offset + e.begin)
        finally:
            os.close(fd)
    return out


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def store(tmp_path: Path):
    with Store.open(tmp_path / "store") as s:
        yield s


def test_publish_then_lookup_returns_identical_bytes(store: Store) -> None:
    tensors = _tensors()
    record = store.installer.publish(IDENTITY, tensors, max_file_bytes=4096)
    assert record.key == IDENTITY.key and len(record.manifest.files) >= 2
    assert _read_back(store, IDENTITY.key) == {n: _raw(t) for n, t in tensors.items()}
    assert store.verify(IDENTITY.key) == record
    path = store.root / "artifacts" / IDENTITY.key
    assert oct(path.stat().st_mode & 0o777) == "0o555"
    assert all(p.stat().st_mode & 0o777 == 0o444 for p in path.iterdir())
    assert not list((store.root / "tmp").iterdir())


def test_the_record_built_at_commit_equals_a_full_inspection(store: Store) -> None:
    """``record_for_commit`` (no re-read) must describe exactly what ``inspect_artifact`` finds."""
    from hwr.daemon.store.inspection import inspect_artifact

    record = store.installer.publish(IDENTITY, _tensors(), max_file_bytes=4096)
    inspected = inspect_artifact(store.root / "artifacts" / IDENTITY.key, IDENTITY.key, os.geteuid())
    assert record == inspected
    assert record.fingerprints == inspected.fingerprints and record.files == inspected.files
    assert store.records.cached(IDENTITY.key) is record  # the cheap guard holds for the commit-time record


def test_content_digest_is_independent_of_file_split(tmp_path: Path) -> None:
    with Store.open(tmp_path / "a") as a, Store.open(tmp_path / "b") as b:
        one = a.installer.publish(IDENTITY, _tensors())
        many = b.installer.publish(IDENTITY, _tensors(), max_file_bytes=1)
    assert len(one.manifest.files) == 1 and len(many.manifest.files) == 5
    assert one.manifest.artifact_content_sha256 == many.manifest.artifact_content_sha256


def test_restart_keeps_artifacts_and_second_owner_is_refused(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s") as s:
        s.installer.publish(IDENTITY, _tensors())
        with pytest.raises(StoreLocked):
            Store.open(tmp_path / "s")
    with Store.open(tmp_path / "s") as s:
        assert [r.key for r in s.records.artifacts()] == [IDENTITY.key] and not s.start_report
        assert (s.root / "domain.json").is_file()


def test_lookup_errors(store: Store) -> None:
    with pytest.raises(ArtifactNotFound):
        store.records.lookup("0" * 64)
    for bad in ("../etc", "A" * 64, "0" * 63, IDENTITY.canonical_bytes.decode()):
        with pytest.raises(InvalidRequest):
            store.records.lookup(bad)


def test_expected_hash_mismatch_removes_staging(store: Store) -> None:
    tensors = _tensors()
    staging = store.installer.begin(IDENTITY, [StagedTensor(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    for n, t in tensors.items():
        write_tensor(staging, n, t)
    expected = {n: hashlib.sha256(_raw(t)).hexdigest() for n, t in tensors.items()}
    expected["steps"] = "0" * 64
    with pytest.raises(ChecksumMismatch):
        store.installer.commit(staging, expected_tensor_sha256=expected)
    assert not staging.path.exists()
    with pytest.raises(ArtifactNotFound):
        store.records.lookup(IDENTITY.key)


def test_overwritten_header_is_rejected_at_commit(store: Store) -> None:
    staging = store.installer.begin(IDENTITY, [StagedTensor("w", torch.float32, (4,))])
    _name, path, _ = staging.files[0]
    with open(path, "r+b") as f:
        f.write(b"\xff" * 8)
    with pytest.raises(ManifestCorrupt):
        store.installer.commit(staging)
    store.installer.abort(staging)  # idempotent after commit removed it


def test_two_publishers_of_one_identity_make_one_artifact(store: Store) -> None:
    results, errors = [], []

    def publish() -> None:
        try:
            results.append(store.installer.publish(IDENTITY, _tensors()))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=publish) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len({r.marker.publication_id for r in results}) == 1
    assert os.listdir(store.root / "artifacts") == [IDENTITY.key]


def test_collision_keeps_the_first_artifact(store: Store) -> None:
    first = store.installer.publish(IDENTITY, _tensors(0))
    with pytest.raises(IdentityCollision):
        store.installer.publish(IDENTITY, _tensors(1))
    assert store.records.lookup(IDENTITY.key) == first
    assert not list((store.root / "tmp").iterdir())


def _writable(path: Path) -> None:
    os.chmod(path.parent, 0o755)
    os.chmod(path, 0o644)


def _corrupt_payload_byte(store: Store) -> None:
    path = next((store.root / "artifacts" / IDENTITY.key).glob("*.safetensors"))
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    _writable(path)
    path.write_bytes(bytes(data))
    os.chmod(path, 0o444)
    os.chmod(path.parent, 0o555)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # a careful tamperer restores mtime


def test_corrupt_bytes_found_by_verify_are_quarantined_and_denied(store: Store) -> None:
    store.installer.publish(IDENTITY, _tensors())
    _corrupt_payload_byte(store)
    with pytest.raises(ManifestCorrupt):  # the ctime moved: the warm check catches it
        store.records.lookup(IDENTITY.key)
    store.records.allow(IDENTITY.key)  # operator re-admits; metadata checks now pass, bytes do not
    store.records.lookup(IDENTITY.key)
    with pytest.raises(ChecksumMismatch):
        store.verify(IDENTITY.key)
    assert store.is_denied(IDENTITY.key) and (store.root / "deny" / f"{IDENTITY.key}.json").is_file()
    assert any(p.name.startswith(IDENTITY.key + ".checksum.") for p in (store.root / "quarantine").iterdir())
    with pytest.raises(ArtifactDenied):
        store.records.lookup(IDENTITY.key)
    store.installer.publish(IDENTITY, _tensors())  # corruption-denied keys may be rebuilt once
    assert not store.is_denied(IDENTITY.key) and store.verify(IDENTITY.key)


def _truncate(path: Path) -> None:
    _writable(path)
    os.truncate(path, path.stat().st_size - 1)
    os.chmod(path, 0o444)
    os.chmod(path.parent, 0o555)


def _chmod(path: Path) -> None:
    os.chmod(path, 0o644)


def _extra_file(path: Path) -> None:
    os.chmod(path.parent, 0o755)
    (path.parent / "extra.bin").write_bytes(b"x")
    os.chmod(path.parent, 0o555)


def _missing_file(path: Path) -> None:
    os.chmod(path.parent, 0o755)
    path.unlink()
    os.chmod(path.parent, 0o555)


def _symlink(path: Path) -> None:
    os.chmod(path.parent, 0o755)
    target = path.parent.parent.parent / "elsewhere.safetensors"
    target.write_bytes(path.read_bytes())
    os.chmod(target, 0o444)
    path.unlink()
    path.symlink_to(target)
    os.chmod(path.parent, 0o555)


def _hardlink(path: Path) -> None:
    os.link(path, path.parent.parent.parent / "alias")


def _hostile_header(path: Path) -> None:
    _writable(path)
    with open(path, "r+b") as f:
        f.write((2**62).to_bytes(8, "little"))
    os.chmod(path, 0o444)
    os.chmod(path.parent, 0o555)


@pytest.mark.parametrize("damage", [_truncate, _chmod, _extra_file, _missing_file, _symlink, _hardlink,
                                    _hostile_header])  # fmt: skip
@pytest.mark.parametrize("restart", [False, True])
def test_metadata_damage_is_denied_not_leased(tmp_path: Path, damage, restart: bool) -> None:
    root = tmp_path / "s"
    with Store.open(root) as s:
        s.installer.publish(IDENTITY, _tensors(), max_file_bytes=4096)
        payload = sorted((root / "artifacts" / IDENTITY.key).glob("*.safetensors"))[0]
        damage(payload)
        if not restart:
            with pytest.raises(ManifestCorrupt):
                s.records.lookup(IDENTITY.key)
    with Store.open(root) as s:
        if restart:
            assert [k for k, _ in s.start_report] == [IDENTITY.key]
        assert s.is_denied(IDENTITY.key) and s.records.artifacts() == []
        with pytest.raises(ArtifactDenied):
            s.records.lookup(IDENTITY.key)


def test_tampered_manifest_is_denied(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with Store.open(root) as s:
        s.installer.publish(IDENTITY, _tensors())
    manifest = root / "artifacts" / IDENTITY.key / "manifest.json"
    _writable(manifest)
    manifest.write_bytes(manifest.read_bytes().replace(b'"weight"', b'"weigh7"'))
    os.chmod(manifest, 0o444)
    os.chmod(manifest.parent, 0o555)
    with Store.open(root) as s:
        assert s.is_denied(IDENTITY.key)


def test_deny_allow_remove(store: Store) -> None:
    store.installer.publish(IDENTITY, _tensors())
    store.deny(IDENTITY.key, "bad weights reported")
    with pytest.raises(ArtifactDenied):
        store.records.lookup(IDENTITY.key)
    with pytest.raises(ArtifactDenied):  # an operator deny is not replaced by a publisher
        store.installer.publish(IDENTITY, _tensors())
    store.records.allow(IDENTITY.key)
    assert store.records.lookup(IDENTITY.key).key == IDENTITY.key
    store.remove(IDENTITY.key)
    with pytest.raises(ArtifactNotFound):
        store.records.lookup(IDENTITY.key)


@pytest.mark.parametrize("helper", ["fallocate", "fsync", "rename", "pwrite"])
def test_injected_io_errors_are_typed_and_leave_no_staging(store: Store, monkeypatch, helper: str) -> None:
    code = errno.ENOSPC if helper in ("fallocate", "pwrite") else errno.EIO

    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(store_io, helper, fail)
    with pytest.raises(NoSpace if code == errno.ENOSPC else PublicationFailed):
        store.installer.publish(IDENTITY, _tensors())
    monkeypatch.undo()
    assert not list((store.root / "tmp").iterdir())
    assert not list((store.root / "artifacts").iterdir())
    store.installer.publish(IDENTITY, _tensors())


def test_world_writable_root_is_rejected(tmp_path: Path) -> None:
    root = tmp_path / "open"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(UntrustedStore):
        Store.open(root)
    os.chmod(root, 0o700)
    Store.open(root).close()


def test_remote_filesystem_is_rejected(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(fsguard, "statfs_magic", lambda path: 0x6969)  # NFS, injected at the syscall
    with pytest.raises(UntrustedStore, match="nfs"):
        Store.open(tmp_path / "nfs")
    monkeypatch.undo()
    with pytest.raises(UntrustedStore):
        Store.open(tmp_path / "narrow", allow_fs_types=["xfs"])  # this disk is ext4/overlay


def test_close_is_idempotent_and_releases_the_root(tmp_path: Path) -> None:
    s = Store.open(tmp_path / "s")
    s.close()
    s.close()
    Store.open(tmp_path / "s").close()


def test_a_lookup_racing_a_removal_or_a_quarantine_reports_the_artifact_state(store: Store) -> None:
    """An acquire validated just before an eviction or a quarantine moved the directory must
    answer with what the artifact is now (gone, or denied), never a raw I/O error."""
    store.installer.publish(IDENTITY, _tensors())
    record = store.records.lookup(IDENTITY.key)
    store.retirement.delete([store.retirement.retire(IDENTITY.key)])  # evicted between lookup and open
    with pytest.raises(ArtifactNotFound):
        store.records.open_payloads(record)
    store.installer.publish(IDENTITY, _tensors())
    record = store.records.lookup(IDENTITY.key)
    store.deny(IDENTITY.key, "quarantined by a scrub")
    store.retirement.retire(IDENTITY.key)
    with pytest.raises(ArtifactDenied):
        store.records.open_payloads(record)


@pytest.mark.parametrize("sizes", [[0, 1, 4097], [1 << 16, 3 << 20], [5 << 20]])
def test_hash_ranges_small_reads_and_large_maps_agree_with_hashlib(tmp_path: Path, sizes: list[int]) -> None:
    """Up to ``SMALL_READ_BYTES`` in all the files are read, above it mapped: same digests."""
    jobs, want_files, want_ranges, fds = [], [], {}, []
    try:
        for i, size in enumerate(sizes):
            data = os.urandom(size)
            path = tmp_path / f"f{i}"
            path.write_bytes(data)
            fd = os.open(path, os.O_RDONLY)
            fds.append(fd)
            ranges = [(f"t{i}a", 0, size // 3), (f"t{i}b", size // 3, size)]
            jobs.append((fd, size, ranges))
            want_files.append(hashlib.sha256(data).hexdigest())
            want_ranges.update({n: hashlib.sha256(data[b:e]).hexdigest() for n, b, e in ranges})
        seen: list[tuple[int, int]] = []
        got_files, got_ranges = store_io.hash_ranges(jobs, lambda done, total: seen.append((done, total)))
    finally:
        for fd in fds:
            os.close(fd)
    assert got_files == want_files and got_ranges == want_ranges
    assert seen and seen[-1][0] == seen[-1][1]  # progress reaches the total


def test_hash_ranges_refuses_a_file_shorter_than_its_plan(tmp_path: Path) -> None:
    path = tmp_path / "short"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as info:
            store_io.hash_ranges([(fd, 200, [])])
    finally:
        os.close(fd)
    assert info.value.errno == errno.EIO


def test_remove_tree_deletes_read_only_flat_and_nested_directories(tmp_path: Path) -> None:
    flat = tmp_path / "flat"
    flat.mkdir()
    for name in ("a.safetensors", "manifest.json", "READY.json"):
        (flat / name).write_bytes(b"x")
        (flat / name).chmod(0o444)
    flat.chmod(0o555)  # as an artifact directory
    nested = tmp_path / "nested"
    (nested / "sub").mkdir(parents=True)
    (nested / "file").write_bytes(b"x")
    (nested / "sub" / "deep").write_bytes(b"y")
    (nested / "sub").chmod(0o555)
    nested.chmod(0o555)
    store_io.remove_tree(flat)
    store_io.remove_tree(nested)  # the general walk: the flat path gives up on a subdirectory
    store_io.remove_tree(tmp_path / "missing")  # nothing there: no error
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage", [False, True])
def test_a_commit_closes_the_checked_descriptors_it_is_given(store: Store, damage: bool) -> None:
    """``commit(opened=...)`` hashes through the sole-opener check's descriptors and closes
    every one of them, committed or refused (no descriptor leak in the daemon)."""
    from hwr.daemon.system.exclusive import open_sole

    tensor = torch.arange(1 << 12, dtype=torch.float32)
    staging = store.installer.begin(IDENTITY, [StagedTensor("w", tensor.dtype, tuple(tensor.shape))])
    write_tensor(staging, "w", tensor)
    if damage:
        with open(staging.files[0][1], "r+b") as f:
            f.write(b"\xff" * 8)
    before = len(os.listdir("/proc/self/fd"))
    opened = {Path(p).name: open_sole(Path(p)) for _n, p, _s in staging.files}
    assert len(os.listdir("/proc/self/fd")) == before + len(opened)
    if damage:
        with pytest.raises(ManifestCorrupt):
            store.installer.commit(staging, opened=opened)
    else:
        record = store.installer.commit(staging, opened=opened)
        assert record.manifest.tensors[0].sha256 == hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
    assert len(os.listdir("/proc/self/fd")) == before
    for fd in opened.values():
        with pytest.raises(OSError):
            os.fstat(fd)


@pytest.mark.parametrize("bad_shape", [(True, 4), (2.0, 4)])
def test_plan_validation_is_not_skipped_for_specs_equal_to_a_planned_one(bad_shape: tuple) -> None:
    """``(True, 4)`` and ``(2.0, 4)`` compare and hash equal to ``(1, 4)`` / ``(2, 4)``: a plan
    memoised for the int shape must not let the bool or float shape through validation."""
    from hwr.client.errors import InvalidRequest
    from hwr.daemon.store.staging import plan_payloads

    good = tuple(int(d) for d in bad_shape)
    plan_payloads([StagedTensor("w", torch.float32, good)])  # now memoised
    with pytest.raises(InvalidRequest):
        plan_payloads([StagedTensor("w", torch.float32, bad_shape)])


def _retire_at(monkeypatch, store: Store, name: str, target: Path) -> list[Path]:
    """On the first ``os.<name>`` call on ``target`` (or a file in it), retire the artifact from
    another thread, as an eviction does, and give it up to 1 s before the call goes on (it waits
    for the key lock when the lookup holds it)."""
    real = getattr(os, name)
    trash: list[Path] = []
    evictor: list[threading.Thread] = []

    def call(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not evictor and str(path).startswith(str(target)):
            evictor.append(threading.Thread(target=lambda: trash.append(store.retirement.retire(target.name))))
            evictor[0].start()
            evictor[0].join(1.0)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, name, call)
    return trash


@pytest.mark.parametrize("cached", [True, False])
def test_a_lookup_racing_an_eviction_reports_not_found_and_denies_nothing(
        store: Store, monkeypatch, cached: bool) -> None:
    """An eviction renames the directory away while a lookup checks it. A warm record's
    ``lstat`` fingerprints are checked without the key lock: the eviction lands, and the lookup
    reports the artifact gone. A first inspection holds the key lock: the eviction waits, and
    the lookup returns the intact artifact. Never a deny: that would refuse every later
    publication of the identity until an operator allowed it."""
    store.installer.publish(IDENTITY, _tensors())
    if not cached:
        store.deny(IDENTITY.key, "x")
        store.records.allow(IDENTITY.key)  # drops the validated record: the next lookup inspects
    target = store.root / "artifacts" / IDENTITY.key
    trash = _retire_at(monkeypatch, store, "lstat" if cached else "open", target)
    if cached:
        with pytest.raises(ArtifactNotFound):
            store.records.lookup(IDENTITY.key)
    else:
        assert store.records.lookup(IDENTITY.key).key == IDENTITY.key
    deadline = time.monotonic() + 10
    while not trash and time.monotonic() < deadline:
        time.sleep(0.01)
    monkeypatch.undo()
    assert trash, "the retire never ran: the test raced nothing"
    store.retirement.delete(trash)
    with pytest.raises(ArtifactNotFound):
        store.records.lookup(IDENTITY.key)
    assert store.denylist.reason(IDENTITY.key) is None and not list((store.root / "deny").iterdir())
    assert store.installer.publish(IDENTITY, _tensors()).key == IDENTITY.key
    assert _read_back(store, IDENTITY.key)["steps"] == _raw(_tensors()["steps"])


def test_a_lookup_during_a_commit_rename_waits_for_the_commit(store: Store, monkeypatch) -> None:
    """Between a commit's rename into ``artifacts/`` and its chmod to 0555, the directory is at
    its staging mode; a lookup then must wait for the commit, not deny the new artifact."""
    from hwr.daemon.store import root as store_module

    seen: dict[str, object] = {}

    def lookup() -> None:
        try:
            seen["record"] = store.records.lookup(IDENTITY.key)
        except Exception as exc:  # the assertion below names it
            seen["error"] = exc

    def hook(step: str) -> None:
        if step == "renamed":
            mode = (store.root / "artifacts" / IDENTITY.key).stat().st_mode & 0o777
            seen["mode"] = mode
            t = threading.Thread(target=lookup)
            t.start()
            t.join(1.0)  # the lookup's first try fails on the mode, then it waits for the key lock
            seen["waited"] = t.is_alive()
            seen["thread"] = t

    monkeypatch.setattr(store_module, "FAULT_HOOK", hook)
    record = store.installer.publish(IDENTITY, _tensors())
    seen["thread"].join(10)  # type: ignore[attr-defined]
    assert seen["mode"] != 0o555, "the window this test is about no longer exists"
    assert "error" not in seen, seen.get("error")
    assert seen["waited"] and seen["record"] == record
    assert store.denylist.reason(IDENTITY.key) is None


def test_an_inspection_racing_an_eviction_and_a_republication_never_caches_the_old_record(
        store: Store, monkeypatch) -> None:
    """A lookup inspects an artifact's directory (no record cached); right after its last check
    (the payload's descriptor is closed) the key is evicted and published again, with other
    content, by another thread. The old directory's record must not be cached over the new one:
    every later lookup would find it "changed since it was validated" and deny a good artifact.
    The inspection runs under the key lock, so the other thread's eviction waits for it (up to
    1 s here, then the lookup goes on)."""
    store.installer.publish(IDENTITY, _tensors())
    store.deny(IDENTITY.key, "x")
    store.records.allow(IDENTITY.key)  # no record cached: the next lookup inspects the directory
    payload = str(store.root / "artifacts" / IDENTITY.key / "model-00001.safetensors")
    rebuilt = {**_tensors(), "extra": torch.ones(100)}  # another size: no fingerprint can match
    real_open, real_close = os.open, os.close
    payload_fds: list[int] = []
    other: list[threading.Thread] = []

    def republish() -> None:
        store.retirement.delete([store.retirement.retire(IDENTITY.key)])
        store.installer.publish(IDENTITY, rebuilt)

    def open_(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        fd = real_open(path, *args, **kwargs)
        if str(path) == payload and not other:
            payload_fds.append(fd)
        return fd

    def close(fd: int) -> None:
        real_close(fd)
        if fd in payload_fds and not other and threading.current_thread() is threading.main_thread():
            other.append(threading.Thread(target=republish))
            other[0].start()
            other[0].join(1.0)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "close", close)
    first = store.records.lookup(IDENTITY.key)
    other[0].join(10)
    monkeypatch.undo()
    assert not other[0].is_alive() and "extra" not in {t.name for t in first.manifest.tensors}
    assert "extra" in {t.name for t in store.records.lookup(IDENTITY.key).manifest.tensors}  # the new record
    assert store.denylist.reason(IDENTITY.key) is None
    assert _read_back(store, IDENTITY.key)["extra"] == _raw(rebuilt["extra"])
