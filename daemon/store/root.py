"""The daemon's artifact store: one owner per root, atomic publication, immutable artifacts.

Layout (the same names as vLLM-Omni 0.30, so one of its roots can be adopted)::

    <root>/domain.json                 schema_version, domain_uuid, scope, domain_id, backend,
                                       storage_class, filesystem_type
    <root>/locks/daemon.lock           flock held for the Store's life (one daemon per root)
    <root>/artifacts/<key>/            READY.json, manifest.json, *.safetensors (dir 0555, files 0444)
    <root>/tmp/<key>.<pid>.<uuid>/     staging (and trash being deleted); wiped at every start
    <root>/quarantine/<key>.<reason>.<uuid>/   corrupt artifacts moved aside for inspection
    <root>/deny/<key>.json             deny marker: schema_version, stage, reason, message

Publication order (``FAULT_HOOK`` step names in brackets): ``begin`` plans and preallocates
payloads in ``tmp/`` [staged]; the writer fills them [payload_written]; ``commit`` re-reads the
headers, hashes every file and tensor [hashed], writes ``manifest.json`` [manifest_written] and
``READY.json`` [marker_written], makes the files 0444, fsyncs the payloads [payloads_fsynced],
the two documents and the staging directory (every write before any fsync: see ``_seal``),
renames the directory into ``artifacts/`` [renamed], makes it 0555 and fsyncs ``artifacts/``
[dir_fsynced] (a group commit shared by concurrent commits: ``store_io.GroupSync``). A
daemon-owned producer's digests (``ProducerDigests``) replace the re-hash at [hashed]. A crash
before the rename leaves only staging (wiped at the next start); after it a complete artifact (a
directory still at its staging mode is finished at start).

Validation: full hashing once at publication and on ``verify``; metadata level
(``store_validation``) at start and on the first lookup, then a warm lookup compares recorded
``lstat`` fingerprints (a few microseconds). Corruption writes a deny marker and raises
``ManifestCorrupt``/``ChecksumMismatch``/``ManifestIncompatible``; a denied key raises
``ArtifactDenied``; only 64-hex keys ever become paths.

Limits: a writer that keeps its ``O_RDWR`` descriptor after commit can still write (the kernel
cannot revoke it); such a write changes mtime/ctime and is caught at the next lookup, to the
filesystem's timestamp granularity, and always by ``verify``. Thread-safe; not fork-safe (a child
must not use its parent's Store).

Usage accounting: the payload bytes of every ``artifacts/`` entry are kept in memory
(``usage_by_key``, ``committed_bytes``: no directory listing on the event loop, where a
``listdir`` of ``artifacts/`` waits on the directory lock behind commits' renames). Every move
into or out of ``artifacts/`` made here updates it right after the rename: an entry is counted
from the end of its rename in (the publication's reservation covers it until its commit returns)
until the end of its rename out. Changes made behind the daemon's back are found by
``rescan_usage`` (the daemon runs it at every housekeeping tick, and before admin usage
reports) and logged. No lock is held across a rename (see ``_moved``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import os
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hwr.client.errors import (
    ArtifactDenied,
    ArtifactNotFound,
    ChecksumMismatch,
    HwrError,
    IdentityCollision,
    InvalidRequest,
    ManifestCorrupt,
    ManifestIncompatible,
    StoreIOError,
    StoreLocked,
)
from hwr.client.identity import ArtifactIdentity, canonical_json, is_key
from hwr.client.manifest import MANIFEST_FILE, READY_FILE, FileRecord, Manifest, ReadyMarker, TensorRecord
from hwr.client.safetensors_header import contiguous_stride, read_header
from hwr.daemon.store import fileio as store_io
from hwr.daemon.store.domain import ensure_domain, read_deny_code
from hwr.daemon.store.staging import ProducerDigests, Staging, TensorSpec, plan_payloads, write_tensor
from hwr.daemon.store.staging_bounds import StagingReaper, allocation_ok, truncate_tree
from hwr.daemon.store.validation import (
    ArtifactRecord,
    Fingerprint,
    inspect_artifact,
    record_for_commit,
    same_fingerprints,
)
from hwr.daemon.system import fsguard

__all__ = [
    "FAULT_HOOK",
    "PUBLICATION_STEPS",
    "ArtifactRecord",
    "Fingerprint",
    "Staging",
    "Store",
    "TensorSpec",
]

log = logging.getLogger("hwrd.store")

#: Test hook called with each publication step name (see the module docstring).
FAULT_HOOK: Callable[[str], None] | None = None
PUBLICATION_STEPS = (
    "staged",
    "payload_written",
    "hashed",
    "manifest_written",
    "marker_written",
    "payloads_fsynced",
    "renamed",
    "dir_fsynced",
)
#: Deny reasons that a new publication of the same key may replace (corruption, not an operator).
CORRUPTION_CODES = frozenset({ManifestCorrupt.code, ChecksumMismatch.code, ManifestIncompatible.code})
OPERATOR_DENIED = "OPERATOR_DENIED"
_SUBDIRS = ("locks", "artifacts", "tmp", "quarantine", "deny")


def _step(name: str) -> None:
    hook = FAULT_HOOK
    if hook is not None:
        hook(name)


def _check_key(key: object) -> str:
    if not is_key(key):
        raise InvalidRequest("an artifact key is 64 lowercase hex digits", details={"key": str(key)[:80]})
    return key  # type: ignore[return-value]


class _Unconfirmed(Exception):
    """A lookup check failed outside the key lock: run it again under the lock (``Store.lookup``)."""


class Store:
    """The artifact store of one root; use ``Store.open`` (also a context manager)."""

    def __init__(self, root: Path, lock_fd: int, filesystem_type: str) -> None:
        self.root = root
        self.filesystem_type = filesystem_type
        self.euid = os.geteuid()
        self.start_report: list[tuple[str, HwrError]] = []
        self._lock_fd: int | None = lock_fd
        self._mutex = threading.RLock()
        self._records: dict[str, ArtifactRecord] = {}
        self._denied: dict[str, str] = {}  # key -> deny reason code
        self._stagings: dict[str, Staging] = {}
        self.reaper = StagingReaper()  # discarded stagings a writer still holds (staging_bounds)
        # Commits and retirements rename entries of artifacts/; they share its fsyncs (GroupSync).
        self._artifacts_sync = store_io.GroupSync(root / "artifacts")
        self._retired_marks: dict[Path, int] = {}  # trash -> GroupSync mark taken after its retire
        # Payload bytes per artifacts/ entry (see "Usage accounting"). Written under
        # _usage_lock, held only for in-memory updates (never across a syscall: the event loop
        # retires inline, and a lock whose holder waits for the GIL after a rename stalls it);
        # read without it (a dict copy is atomic under the GIL). _moving: keys whose rename is
        # under way; _touched: keys moved or moving since a rescan began listing (None between
        # rescans), for which the rescan keeps the in-memory state (see ``_moved``).
        self._usage_lock = threading.Lock()
        self._scan_lock = threading.Lock()
        self._moving: set[str] = set()
        self._touched: set[str] | None = None
        self._key_locks: dict[str, list[Any]] = {}  # key -> [lock, holders and waiters]
        self._key_locks_mutex = threading.Lock()
        # Unique names for staging and trash directories (tmp/ is wiped at every start, so
        # unique within this run suffices): a random run prefix and a counter, not a uuid4
        # (a getrandom call) each time. The pid is the staging name's, as vLLM-Omni names them.
        self._pid = os.getpid()
        self._run = uuid.uuid4().hex[:24]
        self._seq = itertools.count()
        self._sizes: dict[str, int] = {}
        self._total = 0  # sum of _sizes, kept with it under _usage_lock (committed_bytes: O(1))
        # Keys that entered _records since the last ``take_added`` (the daemon's LRU index
        # learns of new artifacts from it instead of listing every record per eviction round).
        self._added: list[str] = []

    # ----------------------------------------------------------------- lifecycle
    @classmethod
    def open(cls, root: Path, *, create: bool = True, allow_fs_types: Sequence[str] | None = None) -> Store:
        """Take ownership of ``root``: checks, lock, domain.json, recovery, start validation.

        Raises ``UntrustedStore`` (permissions, filesystem type), ``StoreLocked`` (another owner),
        ``ArtifactNotFound`` (missing root and ``create=False``), ``StoreIOError``. Corrupt
        artifacts are denied and listed in ``start_report``, never fatal.
        """
        root = Path(root).absolute()
        if not root.exists():
            if not create:
                raise ArtifactNotFound(f"store root {root} does not exist", details={"root": str(root)})
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
        fsguard.check_trusted_dir(root)
        verdict = fsguard.check_filesystem(root, allow_fs_types)
        for name in _SUBDIRS:
            with contextlib.suppress(FileExistsError):
                (root / name).mkdir(mode=0o700)
            fsguard.check_trusted_dir(root / name)
        lock_fd = os.open(root / "locks" / "daemon.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise StoreLocked(f"another daemon owns {root}", details={"root": str(root)}) from None
        store = cls(root, lock_fd, verdict.name)
        try:
            store._start()
        except BaseException:
            store.close()
            raise
        return store

    def _start(self) -> None:
        os.ftruncate(self._lock_fd, 0)  # type: ignore[arg-type]
        os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)  # type: ignore[arg-type]
        ensure_domain(self.root, self.filesystem_type)
        for entry in os.listdir(self.root / "locks"):  # per-key lock files of earlier versions
            if entry.endswith(".artifact") and is_key(entry.removesuffix(".artifact")):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.root / "locks" / entry)
        for entry in os.listdir(self.root / "tmp"):
            truncate_tree(self.root / "tmp" / entry)  # blocks freed even if a writer holds a file
            store_io.remove_tree(self.root / "tmp" / entry)
        for entry in os.listdir(self.root / "deny"):
            key = entry.removesuffix(".json")
            if entry.endswith(".json") and is_key(key):
                self._denied[key] = read_deny_code(self.root / "deny" / entry, OPERATOR_DENIED)
            else:
                store_io.remove_tree(self.root / "deny" / entry)  # interrupted marker writes
        for entry in sorted(os.listdir(self.root / "artifacts")):
            path = self.root / "artifacts" / entry
            if not is_key(entry):
                self._quarantine_path(path, "stray", entry[:64] or "unnamed")
                continue
            self._finish_interrupted_publication(path)
            if entry in self._denied:
                continue
            try:
                self._put_record(entry, inspect_artifact(path, entry, self.euid))
            except (ManifestCorrupt, ManifestIncompatible) as exc:
                self._deny_for(entry, exc)
                self.start_report.append((entry, exc))
            except StoreIOError as exc:
                self.start_report.append((entry, exc))
        self._sizes = self._scan_sizes()
        self._total = sum(self._sizes.values())

    def _finish_interrupted_publication(self, path: Path) -> None:
        # A crash between the rename and the chmod leaves a complete artifact at the staging
        # directory mode; only this process could have made it, so finishing it is safe.
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if (st.st_mode & 0o777) == 0o700 and os.path.isfile(path / READY_FILE):
                os.chmod(path, 0o555)
                store_io.fsync_dir(path.parent)

    def close(self) -> None:
        """Release the root (idempotent; safe on a half-opened Store). Open stagings are left for
        the next start to reclaim."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "open" if self._lock_fd is not None else "closed"
        return f"Store(root={str(self.root)!r}, artifacts={len(self._records)}, {state})"

    def _require_open(self) -> None:
        if self._lock_fd is None:
            raise StoreIOError("the store is closed")

    # ----------------------------------------------------------------- publication
    def begin(
        self,
        identity: ArtifactIdentity,
        specs: Sequence[TensorSpec],
        *,
        max_file_bytes: int | None = None,
        format_metadata: Mapping[str, Any] | None = None,
    ) -> Staging:
        """Create a staging directory with preallocated payload files and their headers written.

        Raises ``InvalidRequest`` for bad specs, ``NoSpace`` (ENOSPC/EDQUOT; staging removed).
        """
        self._require_open()
        if not isinstance(identity, ArtifactIdentity):
            raise InvalidRequest("identity must be an ArtifactIdentity")
        plans = plan_payloads(list(specs), max_file_bytes)
        staging_id = f"{identity.key}.{self._pid}.{self._unique()}"
        path = self.root / "tmp" / staging_id
        staging = Staging.from_plans(staging_id, identity, path, specs, plans, format_metadata)
        try:
            path.mkdir(mode=0o700)
            for plan in plans:
                fd = os.open(path / plan.name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    store_io.fallocate(fd, plan.size)
                    store_io.pwrite_all(fd, plan.head, 0)
                finally:
                    os.close(fd)
        except OSError as exc:
            store_io.remove_tree(path)
            raise store_io.io_error(exc, "staging", publication=True) from None
        with self._mutex:
            self._stagings[staging_id] = staging
        _step("staged")
        return staging

    def abort(self, staging: Staging) -> None:
        """Discard a staging directory (idempotent): its files are truncated first, so their
        blocks are freed even while the writer keeps a descriptor (``staging_bounds``)."""
        with self._mutex:
            self._stagings.pop(staging.id, None)
        self.reaper.discard(staging.path)

    def publish(
        self,
        identity: ArtifactIdentity,
        tensors: Mapping[str, object],
        *,
        kinds: Mapping[str, str] | None = None,
        max_file_bytes: int | None = None,
    ) -> ArtifactRecord:
        """Convenience: ``begin`` + write CPU tensors + ``commit`` (aborts on any failure)."""
        specs = [
            TensorSpec(n, t.dtype, tuple(t.shape), kind=(kinds or {}).get(n, "parameter"))  # type: ignore[attr-defined]
            for n, t in tensors.items()
        ]
        staging = self.begin(identity, specs, max_file_bytes=max_file_bytes)
        try:
            for name, tensor in tensors.items():
                write_tensor(staging, name, tensor)  # type: ignore[arg-type]
        except BaseException:
            self.abort(staging)
            raise
        return self.commit(staging)

    def commit(self, staging: Staging, *, expected_tensor_sha256: Mapping[str, str] | None = None,
               trusted_digests: ProducerDigests | None = None,
               opened: dict[str, int] | None = None) -> ArtifactRecord:
        """Validate, hash and atomically publish ``staging``; returns the committed (or joined) record.

        Raises ``ManifestCorrupt`` (a header was overwritten, a file resized), ``ChecksumMismatch``
        (``expected_tensor_sha256`` differs), ``IdentityCollision`` (the key exists with other
        content; it stays), ``ArtifactDenied`` (operator deny), ``NoSpace``/``PublicationFailed``.
        The staging is gone afterwards in every case. ``trusted_digests``: digests a daemon-owned
        producer computed while writing (see ``ProducerDigests`` for why that is sound); when they
        cover the staging exactly, the payloads are not re-read and re-hashed. ``opened``:
        read-only descriptors of payload files by name (``exclusive.open_sole``'s), used instead
        of opening them again; the commit closes them in every case.
        """
        opened = dict(opened or {})
        try:
            self._require_open()
            with self._mutex:
                if self._stagings.pop(staging.id, None) is None:
                    raise InvalidRequest("unknown or finished staging", details={"staging": staging.id})
            try:
                _step("payload_written")
                manifest, marker = self._seal(staging, expected_tensor_sha256, trusted_digests, opened)
                return self._install(staging, manifest, marker)
            except HwrError:
                raise  # several typed errors are also OSError subclasses; keep their type
            except OSError as exc:
                raise store_io.io_error(exc, "publication", publication=True) from None
            finally:
                store_io.remove_tree(staging.path)
        finally:
            for fd in opened.values():  # those _seal did not take
                os.close(fd)

    def _seal(self, staging: Staging, expected: Mapping[str, str] | None,
              trusted: ProducerDigests | None = None,
              opened: dict[str, int] | None = None) -> tuple[Manifest, ReadyMarker]:
        fds: list[int] = []
        documents: list[int] = []  # manifest.json, READY.json
        try:
            jobs = []
            before = []  # mtimes before hashing: a write since would change them
            for plan in staging.plans:
                fd = opened.pop(plan.name, None) if opened else None  # taken: closed below
                if fd is None:
                    fd = os.open(staging.path / plan.name, store_io.OPEN_READ)
                fds.append(fd)
                st = os.fstat(fd)
                before.append(st.st_mtime_ns)
                if not allocation_ok(st, plan.size):  # grown, or blocks allocated past the end
                    raise ManifestCorrupt(
                        f"{plan.name} was resized or holds more blocks than its planned size",
                        details={"file": plan.name, "key": staging.key, "size": st.st_size,
                                 "allocated": st.st_blocks * 512, "planned": plan.size},
                    )
                if os.pread(fd, len(plan.head), 0) != plan.head:
                    raise ManifestCorrupt(
                        f"{plan.name} was resized or its header overwritten",
                        details={"file": plan.name, "key": staging.key},
                    )
                ranges = [(e.name, len(plan.head) + e.begin, len(plan.head) + e.end) for e in plan.entries]
                jobs.append((fd, plan.size, ranges))
                store_io.start_writeback(fd)  # the disk works while we hash; the fsync below waits
            if trusted is not None and trusted.covers(staging):
                file_sha = [trusted.files[p.name] for p in staging.plans]
                tensor_sha = dict(trusted.tensors)
            else:
                file_sha, tensor_sha = store_io.hash_ranges(jobs)
                if [os.fstat(fd).st_mtime_ns for fd in fds] != before:
                    raise ManifestCorrupt("a payload changed while it was hashed", details={"key": staging.key})
            _step("hashed")
            if expected is not None:
                bad = sorted(n for n in tensor_sha if expected.get(n) != tensor_sha[n])
                if bad or set(expected) != set(tensor_sha):
                    raise ChecksumMismatch(
                        "tensor bytes differ from the writer's hashes",
                        details={"key": staging.key, "tensors": ",".join(bad[:20])},
                    )
            files = [FileRecord(name=p.name, size=p.size, sha256=h)
                     for p, h in zip(staging.plans, file_sha, strict=True)]
            where = {e.name: p.name for p in staging.plans for e in p.entries}
            tensors = [
                TensorRecord(
                    s.name,
                    s.kind,
                    s.role,
                    file=where[s.name],
                    storage_key=s.name,
                    shape=tuple(s.shape),
                    dtype=s.info.torch_name,
                    stride=contiguous_stride(s.shape),
                    nbytes=staging.placements[s.name][2],
                    sha256=tensor_sha[s.name],
                )
                for s in staging.specs
            ]
            manifest = Manifest.build(staging.identity, tensors, files, dict(staging.format_metadata) or None)
            manifest_bytes = manifest.to_json()
            documents.append(store_io.create_file(staging.path / MANIFEST_FILE, manifest_bytes))
            _step("manifest_written")
            marker = ReadyMarker.for_manifest(manifest_bytes, manifest, uuid.uuid4().hex)
            documents.append(store_io.create_file(staging.path / READY_FILE, marker.to_json()))
            _step("marker_written")
            for fd in fds:
                os.fchmod(fd, 0o444)
            # Every write first, then every fsync: each file is still fsynced on its own (what
            # POSIX asks for), but on a journaling filesystem (ext4, xfs) the first fsync commits
            # the one transaction holding all of them and the others return without waiting for
            # another journal commit. Nothing is visible before the rename, which follows.
            for fd in fds:
                store_io.fsync(fd)
            _step("payloads_fsynced")
            for fd in documents:
                store_io.fsync(fd)
        finally:
            for fd in fds + documents:
                os.close(fd)
        store_io.fsync_dir(staging.path)
        return manifest, marker

    def _install(self, staging: Staging, manifest: Manifest, marker: ReadyMarker) -> ArtifactRecord:
        key = staging.key
        target = self.root / "artifacts" / key
        with self._key_lock(key):
            code = self._denied.get(key)
            if code is not None and code not in CORRUPTION_CODES:
                raise ArtifactDenied(f"artifact {key} is denied by an operator", details={"key": key})
            if os.path.lexists(target):
                existing = None if code is not None else self._try_lookup(key)
                if existing is not None:
                    if existing.manifest.artifact_content_sha256 == manifest.artifact_content_sha256:
                        return existing  # joined: another publisher committed the same bytes first
                    raise IdentityCollision(f"artifact {key} exists with different content", details={"key": key})
                self._quarantine_path(target, "replaced", key)
            with self._moved(key, sum(f.size for f in manifest.files)):
                store_io.rename(staging.path, target)
            _step("renamed")
            os.chmod(target, 0o555)
            self._artifacts_sync.sync()  # group commit: see store_io.GroupSync for the ordering
            _step("dir_fsynced")
            if code is not None:
                self._clear_deny(key)
            # The bytes are the ones just sealed in a private staging directory whose writer was
            # proven gone: fingerprint them (lstat) instead of re-reading and re-parsing them.
            record = record_for_commit(target, key, manifest, marker)
            with self._mutex:
                self._put_record(key, record)
            return record

    def _put_record(self, key: str, record: ArtifactRecord) -> None:
        """``_records[key] = record`` (caller holds ``_mutex``, or runs before anyone else can),
        noting a key that was not there for ``take_added``."""
        if key not in self._records:
            self._added.append(key)
        self._records[key] = record

    def take_added(self) -> list[str]:
        """Keys that became records (validated artifacts) since the last call, each once per
        arrival; the first call returns every key validated at start."""
        if not self._added:  # the common case, without the lock (a list's truth is atomic)
            return []
        with self._mutex:
            added, self._added = self._added, []
        return added

    def listed(self, key: str) -> ArtifactRecord | None:
        """The in-memory record of ``key`` when ``artifacts()`` would list it (validated, not
        denied), else None; O(1), no disk access. No lock: two single dict lookups are atomic
        under the interpreter lock, and ``_mutex`` may be held across a deny marker's fsync."""
        return None if key in self._denied else self._records.get(key)

    def _try_lookup(self, key: str) -> ArtifactRecord | None:
        """``lookup`` for a caller that already holds ``key``'s lock; None when it is corrupt or denied."""
        try:
            return self._lookup(key, final=True)
        except (ManifestCorrupt, ManifestIncompatible, ChecksumMismatch, ArtifactDenied):
            return None

    @contextlib.contextmanager
    def _key_lock(self, key: str):  # type: ignore[no-untyped-def]
        # In memory: one process owns the root (locks/daemon.lock), so only its threads can
        # race on a key. (Earlier versions flocked a locks/<key>.artifact file: one inode
        # created per key ever published, never removed; ``_start`` deletes those.)
        with self._key_locks_mutex:  # not _mutex: deny-marker writes hold it across an fsync
            entry = self._key_locks.get(key)
            if entry is None:
                entry = self._key_locks[key] = [threading.Lock(), 0]
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._key_locks_mutex:
                entry[1] -= 1
                if not entry[1]:
                    del self._key_locks[key]

    def _unique(self) -> str:
        """32 hex digits, unique within this Store's life (see ``_run``)."""
        return f"{self._run}{next(self._seq):08x}"

    # ----------------------------------------------------------------- lookup
    def absent_now(self, key: str) -> bool:
        """True when ``key`` provably has no artifact (not validated, not denied, no directory):
        one ``lstat``, safe on the event loop. False means "ask ``lookup``" (it may exist)."""
        if key in self._records or key in self._denied:
            return False
        return not os.path.lexists(self.root / "artifacts" / key)

    def lookup(self, key: str) -> ArtifactRecord:
        """The validated record of ``key`` (see the module docstring for the errors).

        Only a failure confirmed under ``key``'s lock denies the key, and a record is only
        cached under it. Every change this Store makes to ``artifacts/<key>`` (``retire`` for
        eviction and removal, ``_install`` for a commit, whose directory is briefly at its
        staging mode after the rename, a quarantine) holds that lock, so a check that failed
        without it may have caught one of those half done: it is run again under the lock,
        where it sees the before or the after (gone: ``ArtifactNotFound``). The fast paths (a
        warm record whose fingerprints hold; no directory at all) take no lock; the first
        inspection of a directory does."""
        _check_key(key)
        try:
            return self._lookup(key, final=False)
        except _Unconfirmed:
            with self._key_lock(key):
                return self._lookup(key, final=True)

    def _lookup(self, key: str, *, final: bool) -> ArtifactRecord:
        """``lookup``'s body. ``final`` False (no lock held): a warm record whose fingerprints
        hold, ``ArtifactDenied`` or ``ArtifactNotFound``; anything else (a failed check, a
        directory to inspect) raises ``_Unconfirmed`` and the caller retries under the key
        lock. ``final`` True: the caller holds the key lock."""
        if key in self._denied:
            raise ArtifactDenied(f"artifact {key} is denied", details={"key": key, "reason": self._denied[key]})
        record = self._records.get(key)
        if record is not None:
            if same_fingerprints(record.fingerprints):
                return record
            if not final:
                raise _Unconfirmed
            exc: HwrError = ManifestCorrupt(
                "artifact changed since it was validated", details={"key": key, "check": "fingerprint"}
            )
            self._deny_for(key, exc)
            raise exc
        path = self.root / "artifacts" / key
        if not os.path.lexists(path):
            raise ArtifactNotFound(f"no artifact {key}", details={"key": key})
        if not final:
            # Inspect (and cache the record) only under the key lock: an inspection racing an
            # eviction and a re-publication of the key could otherwise cache the old
            # directory's record over the new one, which every later lookup would then find
            # "changed" and deny.
            raise _Unconfirmed
        try:
            record = inspect_artifact(path, key, self.euid)
        except (ManifestCorrupt, ManifestIncompatible) as err:
            if not os.path.lexists(path):  # removed by hand meanwhile: nothing to deny
                raise ArtifactNotFound(f"no artifact {key}", details={"key": key}) from None
            self._deny_for(key, err)
            raise
        with self._mutex:
            self._put_record(key, record)
        if key not in self._sizes and os.path.lexists(path):
            # Put there behind the daemon's back since the last rescan: count it now. (Gone by
            # now, quarantined or removed meanwhile: the caller's open_payloads says which.
            # Counted anyway when it went between the check and here: an overcount until the
            # next rescan, never an undercount.)
            with self._moved(key, record.size_bytes, keep=True):
                pass
        return record

    def cached(self, key: str) -> ArtifactRecord | None:
        """The validated record of ``key`` when a cheap guard still holds, else None (not
        validated yet, denied, removed, or changed): then call ``lookup``, which re-checks
        everything and denies a changed artifact. The acquire hot path (``hwr.daemon.service.leasing``).

        The guard is ``lookup``'s own ``lstat`` check minus the payload files: the directory,
        ``READY.json`` and ``manifest.json`` (three ``lstat`` calls, whatever the file count).
        Why skipping the payloads is sound: every acquire opens them through ``open_payloads``,
        whose ``fstat`` re-check compares inode, device, size, mtime and ctime, and any change
        that ``lstat`` would see in a 0444 file owned by the daemon's user (a write, truncate,
        chmod, chown, new link or replacement) changes one of those; a mismatch denies the
        artifact before any descriptor leaves. Only the daemon's user or root can change the
        store at all (0444 files in 0555 directories), and every mutation made by the daemon
        (deny, allow, retire/remove, quarantine, re-validation) drops the cached record first.
        Limit (unchanged from ``lookup``): a change that preserves size, mtime and ctime is
        found only by ``verify`` or the background scrub.
        """
        if key in self._denied:
            return None
        record = self._records.get(key)
        if record is None:
            return None
        return record if same_fingerprints(record.guard_fingerprints) else None

    def open_payloads(self, record: ArtifactRecord) -> list[tuple[str, int]]:
        """Open each payload ``O_RDONLY|O_NOFOLLOW|O_CLOEXEC``, re-checked by ``fstat`` (caller closes)."""
        opened: list[tuple[str, int]] = []
        try:
            for fp, file_record in zip(record.files, record.manifest.files, strict=True):
                fd = os.open(fp.path, store_io.OPEN_READ)
                opened.append((file_record.name, fd))
                st = os.fstat(fd)
                if (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns) != (
                    fp.inode,
                    fp.device,
                    fp.size,
                    fp.mtime_ns,
                    fp.ctime_ns,
                ):
                    exc = ManifestCorrupt(
                        "payload changed since it was validated",
                        details={"key": record.key, "file": file_record.name},
                    )
                    self._deny_for(record.key, exc)
                    raise exc
        except BaseException as failure:
            for _, fd in opened:
                os.close(fd)
            if isinstance(failure, FileNotFoundError) and not isinstance(failure, HwrError):
                # Raced with a quarantine (deny lands first) or an eviction/removal: say what
                # the artifact is now, not an I/O error.
                if record.key in self._denied:
                    raise ArtifactDenied(
                        f"artifact {record.key} is denied",
                        details={"key": record.key, "reason": self._denied[record.key]},
                    ) from None
                raise ArtifactNotFound(f"no artifact {record.key}", details={"key": record.key}) from None
            if isinstance(failure, OSError) and not isinstance(failure, HwrError):
                raise StoreIOError(
                    f"cannot open payloads of {record.key}: {failure.strerror}", details={"key": record.key}
                ) from None
            raise
        return opened

    def artifacts(self) -> list[ArtifactRecord]:
        """Every validated, not denied artifact, by key."""
        with self._mutex:
            return [r for k, r in sorted(self._records.items()) if k not in self._denied]

    def denied_keys(self) -> list[str]:
        with self._mutex:
            return sorted(self._denied)

    def denied_records(self) -> list[tuple[str, ArtifactRecord | None]]:
        """Every denied key, by key, with the record of its directory when that is still in
        ``artifacts/`` and valid (an operator's deny), else None. Inspected here, never cached:
        a denied artifact is not served."""
        out: list[tuple[str, ArtifactRecord | None]] = []
        for key in self.denied_keys():
            out.append((key, self._inspect_denied(key)))
        return out

    def _inspect_denied(self, key: str) -> ArtifactRecord | None:
        path = self.root / "artifacts" / key
        if not os.path.lexists(path):
            return None
        try:
            return inspect_artifact(path, key, self.euid)
        except (HwrError, OSError):
            return None

    def verify(self, key: str, progress: Callable[[int, int], None] | None = None) -> ArtifactRecord:
        """Re-hash every byte; a mismatch quarantines and denies the key, raising ``ChecksumMismatch``.
        A key an operator denied is verified too (its bytes are judged, the deny stays); one
        denied because it was found corrupt raises ``ArtifactDenied``."""
        record = self._inspect_denied(key) if self.deny_reason(key) == OPERATOR_DENIED else None
        if record is None:
            record = self.lookup(key)
        fds = self.open_payloads(record)
        try:
            jobs = []
            for (_, fd), file_record in zip(fds, record.manifest.files, strict=True):
                header = read_header(fd)
                ranges = [
                    (
                        t.name,
                        header.data_offset + header.entry(t.storage_key).begin,
                        header.data_offset + header.entry(t.storage_key).end,
                    )
                    for t in record.manifest.tensors_in(file_record.name)
                ]
                jobs.append((fd, file_record.size, ranges))
            file_sha, tensor_sha = store_io.hash_ranges(jobs, progress)
        finally:
            for _, fd in fds:
                os.close(fd)
        bad = [f.name for f, h in zip(record.manifest.files, file_sha, strict=True) if f.sha256 != h]
        bad += [t.name for t in record.manifest.tensors if tensor_sha[t.name] != t.sha256]
        if bad:
            exc = ChecksumMismatch(
                f"artifact {key} has corrupt bytes", details={"key": key, "corrupt": ",".join(bad[:20])}
            )
            with self._key_lock(key):
                self._deny_for(key, exc)
                self._quarantine_path(record.path, "checksum", key)
            raise exc
        return record

    # ----------------------------------------------------------------- service queries
    def usage_by_key(self) -> dict[str, int]:
        """Payload bytes of every key directory in ``artifacts/`` (denied ones included: they use
        disk), from memory (see "Usage accounting" in the module docstring)."""
        return dict(self._sizes)

    def committed_bytes(self) -> int:
        """Sum of ``usage_by_key``: never less than what this daemon has in ``artifacts/``."""
        return self._total

    def rescan_usage(self) -> dict[str, int]:
        """Re-read ``artifacts/`` (sizes of validated artifacts from memory, others by ``lstat``)
        into the accounting, logging entries added or removed behind the daemon's back; blocking
        (a worker thread), one ``listdir`` plus ``lstat`` calls for unknown entries."""
        with self._scan_lock:  # one rescan at a time (they share _touched)
            with self._usage_lock:
                self._touched = set(self._moving)
            try:
                sizes = self._scan_sizes()
            except BaseException:
                with self._usage_lock:
                    self._touched = None
                raise
            with self._usage_lock:
                touched, self._touched = self._touched, None
                for key in touched:  # the listing may predate or straddle their renames
                    if key in self._sizes:
                        sizes[key] = self._sizes[key]
                    else:
                        sizes.pop(key, None)
                before, self._sizes = self._sizes, sizes
                self._total = sum(sizes.values())
        added, gone = sizes.keys() - before.keys(), before.keys() - sizes.keys()
        if added or gone:
            log.warning("artifacts/ changed behind the daemon: %d entries appeared (%s), %d vanished (%s)",
                        len(added), ",".join(k[:12] for k in sorted(added)[:5]),
                        len(gone), ",".join(k[:12] for k in sorted(gone)[:5]))
        return dict(sizes)

    @contextlib.contextmanager
    def _moved(self, key: str | None, size: int | None, *, keep: bool = False):  # type: ignore[no-untyped-def]
        """Account a rename of ``key`` into (``size``) or out of (None) ``artifacts/`` done in
        the body: counted once the body returns (nothing changes when it raises). ``keep``:
        only when not counted yet. A rescan listing while the body runs keeps this key's
        in-memory state (``_moving``/``_touched``) instead of what its listing saw."""
        if key is None:
            yield
            return
        with self._usage_lock:
            self._moving.add(key)
            if self._touched is not None:
                self._touched.add(key)
        try:
            yield
        except BaseException:
            with self._usage_lock:
                self._moving.discard(key)
            raise
        with self._usage_lock:
            self._moving.discard(key)
            if self._touched is not None:
                self._touched.add(key)
            if size is None:
                self._total -= self._sizes.pop(key, 0)
            elif not keep or key not in self._sizes:
                self._total += size - self._sizes.get(key, 0)
                self._sizes[key] = size

    def _scan_sizes(self) -> dict[str, int]:
        """Sizes of the ``artifacts/`` entries: ours (accounted or validated) from memory, an
        entry this daemon knows nothing of as the bytes of every file in it."""
        with self._mutex:
            known = {k: r.size_bytes for k, r in self._records.items()}
        known.update(self._sizes)
        out: dict[str, int] = {}
        for entry in os.listdir(self.root / "artifacts"):
            if entry in known:
                out[entry] = known[entry]
            elif is_key(entry):
                total = 0
                with contextlib.suppress(OSError):
                    for name in os.listdir(self.root / "artifacts" / entry):
                        with contextlib.suppress(OSError):
                            total += os.lstat(self.root / "artifacts" / entry / name).st_size
                out[entry] = total
        return out

    def known_keys(self) -> set[str]:
        """Keys present in ``artifacts/`` or carrying a deny marker."""
        with self._mutex:
            denied = set(self._denied)
        return {e for e in os.listdir(self.root / "artifacts") if is_key(e)} | denied

    def deny_reason(self, key: str) -> str | None:
        return self._denied.get(key)

    def reclaim_stale_staging(self) -> int:
        """Remove ``tmp/`` entries that belong to no open staging (trash of interrupted removals),
        and reclaim discarded stagings a writer held (``StagingReaper.sweep``)."""
        with self._mutex:
            live = set(self._stagings)
        count = self.reaper.sweep()
        for entry in os.listdir(self.root / "tmp"):
            if entry not in live and ".removed." in entry:
                store_io.remove_tree(self.root / "tmp" / entry)
                count += 1
        return count

    def staging_entries(self) -> list[str]:
        return sorted(os.listdir(self.root / "tmp"))

    # ----------------------------------------------------------------- deny, allow, remove
    def is_denied(self, key: str) -> bool:
        return _check_key(key) in self._denied

    def deny(self, key: str, reason: str) -> None:
        """Deny ``key`` by an operator (a later publication will not replace it)."""
        self._write_deny(_check_key(key), "LIFECYCLE", OPERATOR_DENIED, reason)

    def allow(self, key: str) -> None:
        """Remove a deny marker; the next lookup re-validates from scratch (idempotent)."""
        _check_key(key)
        self._clear_deny(key)

    def remove(self, key: str) -> None:
        """Delete the artifact (moved into ``tmp/`` first, so a crash never leaves half of it)."""
        self.delete_retired([self.retire(key)])

    def retire(self, key: str) -> Path:
        """Move the artifact out of ``artifacts/`` into a trash directory in ``tmp/`` (fast, no
        fsync); its bytes stay on disk until ``delete_retired``. Trash left by a crash is wiped at start
        and by ``reclaim_stale_staging``."""
        _check_key(key)
        with self._key_lock(key):
            with self._mutex:
                self._records.pop(key, None)
            path = self.root / "artifacts" / key
            if not os.path.lexists(path):
                raise ArtifactNotFound(f"no artifact {key}", details={"key": key})
            trash = self.root / "tmp" / f"{key}.removed.{self._unique()}"
            # Logged before the rename, so a log that lacks this line proves the artifact was
            # never removed on purpose (the fault suite tells lost artifacts from evicted ones).
            log.debug("retiring artifact %s", key)
            try:
                with self._moved(key, None):
                    store_io.rename(path, trash)
            except OSError as exc:
                raise store_io.io_error(exc, "remove") from None
            mark = self._artifacts_sync.mark()  # after the rename: any round started later covers it
            with self._mutex:
                self._retired_marks[trash] = mark
            return trash

    def delete_retired(self, trash: Sequence[Path]) -> None:
        """Make ``retire``s durable (fsync ``artifacts/``), then delete the trash's files. The
        fsync is skipped when one that started after every retirement has already completed
        (typically the caller's own commit ran it): deleting before the retirement is durable
        could let a crash bring back a half-deleted artifact, so without such a round it runs one."""
        with self._mutex:
            marks = [self._retired_marks.pop(path, -1) for path in trash]
        if trash and not all(mark >= 0 and self._artifacts_sync.covered(mark) for mark in marks):
            try:
                self._artifacts_sync.sync()
            except OSError as exc:
                for path in trash:  # the bytes go even so: only the renames' durability failed
                    store_io.remove_tree(path)
                raise store_io.io_error(exc, "remove") from None
        for path in trash:
            store_io.remove_tree(path)


    def _deny_for(self, key: str, exc: HwrError) -> None:
        with self._mutex:
            self._records.pop(key, None)
        self._write_deny(key, "VALIDATION", exc.code, exc.message)

    def _write_deny(self, key: str, stage: str, code: str, message: str) -> None:
        log.warning("artifact %s denied (%s, %s): %r", key, stage.lower(), code, str(message)[:200])
        document = {"schema_version": 1, "stage": stage, "reason": code, "message": str(message)[:1000]}
        path = self.root / "deny" / f"{key}.json"
        tmp = self.root / "deny" / f".{key}.{uuid.uuid4().hex}.tmp"
        with self._mutex:
            try:
                store_io.write_new_file(tmp, canonical_json(document))
                store_io.rename(tmp, path)
                store_io.fsync_dir(path.parent)
            except OSError as exc:
                store_io.remove_tree(tmp)
                raise store_io.io_error(exc, "deny marker") from None
            finally:
                self._denied[key] = code  # deny in memory even if the marker could not be persisted
                self._records.pop(key, None)

    def _clear_deny(self, key: str) -> None:
        with self._mutex:
            path = self.root / "deny" / f"{key}.json"
            try:
                path.unlink(missing_ok=True)
                store_io.fsync_dir(path.parent)
            except OSError as exc:
                raise store_io.io_error(exc, "allow") from None
            self._denied.pop(key, None)
            self._records.pop(key, None)

    def _quarantine_path(self, path: Path, reason: str, key: str) -> Path:
        target = self.root / "quarantine" / f"{key}.{reason}.{uuid.uuid4().hex}"
        try:
            with self._moved(path.name if path.parent == self.root / "artifacts" else None, None):
                store_io.rename(path, target)
            store_io.fsync_dir(path.parent)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise store_io.io_error(exc, "quarantine") from None
        return target
