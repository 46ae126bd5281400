"""The daemon's artifact store: one owner per root, atomic publication, immutable artifacts.

Layout (the same names as vLLM-Omni 0.30, so one of its roots can be adopted)::

    <root>/domain.json                 schema_version, domain_uuid, scope, domain_id, backend,
                                       storage_class, filesystem_type
    <root>/locks/daemon.lock           flock held for the Store's life (one daemon per root)
    <root>/artifacts/<key>/            READY.json, manifest.json, *.safetensors (dir 0555, files 0444)
    <root>/tmp/<key>.<pid>.<uuid>/     staging (and trash being deleted); wiped at every start
    <root>/quarantine/<key>.<reason>.<uuid>/   corrupt artifacts moved aside for inspection
    <root>/deny/<key>.json             deny marker: schema_version, stage, reason, message
    <root>/volatile/<key>              marker of a non-durable artifact: removed at the next open

``Store`` owns the root (its lock, ``domain.json``, recovery and validation at open) and
wires the collaborators that each own one concept, its state and its lock. Callers use the
collaborators directly (``store.records.lookup(key)``, ``store.installer.commit(staging)``);
``Store`` itself keeps only what combines several of them (``verify``, ``deny``, ``remove``,
``rescan_usage``, ``reclaim_stale_staging``, ``denied_records``, ``known_keys``):

``recovery``      what the previous owner left half done, at open (and stale trash later)
``installer``     ``store.installer``, ``Installer``: begin/abort/commit/publish (sealing in
                  ``sealing``), the install rules
``records``       ``store.records``, ``RecordCache``: validated records and every lookup
                  (listed, cached, absent_now, lookup, open_payloads, artifacts, take_added)
``inspection``    metadata checks of an artifact directory (no payload byte read)
``checksums``     ``verify``: every byte re-hashed
``usage``         ``store.usage``, ``UsageLedger``: payload bytes per ``artifacts/`` entry, in memory
``denylist``      ``store.denylist``, ``DenyList``: deny markers and quarantine moves
``retirement``    ``store.retirement``, ``Retirement``: retire into trash, delete it once durable
``keylocks``      ``KeyLocks``: per-key mutual exclusion
``volatile``      ``store.volatile``, ``VolatileSet``: markers of non-durable artifacts, dropped
                  at the next open
``writer_bounds`` ``store.reaper``, ``StagingReaper``: discarded stagings a writer still holds

Keys: the methods that act on a caller's key (``records.lookup``, ``records.allow``,
``retirement.retire``, and ``verify``, ``deny``, ``is_denied`` here) check it
(``records.check_key``: ``InvalidRequest`` unless 64 lowercase hex digits); the cheap reads
(``records.listed``, ``records.cached``, ``records.absent_now``, ``denylist.reason``) expect a
key its caller already checked.

Publication steps (``FAULT_HOOK`` is called with each name of ``PUBLICATION_STEPS``, in order)
are described in ``installer``. A crash before the rename leaves only staging (wiped at the
next start); after it a complete artifact.

Validation: full hashing once at publication and on ``verify``; metadata level
(``inspection``) at start and on the first lookup, then a warm lookup compares recorded
``lstat`` fingerprints (a few microseconds). Corruption writes a deny marker and raises
``ManifestCorrupt``/``ChecksumMismatch``/``ManifestIncompatible``; a denied key raises
``ArtifactDenied``; only 64-hex keys ever become paths.

Limits: a writer that keeps its ``O_RDWR`` descriptor after commit can still write (the kernel
cannot revoke it); such a write changes mtime/ctime and is caught at the next lookup, to the
filesystem's timestamp granularity, and always by ``verify``. Thread-safe; not fork-safe (a child
must not use its parent's Store). Usage is accounted in memory (``usage``); no lock but the key's
own is held across the rename of an ``artifacts/`` entry.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from hwr.client.errors import ArtifactNotFound, HwrError, StoreIOError, StoreLocked
from hwr.client.identity import is_key
from hwr.daemon.store import fileio as store_io
from hwr.daemon.store import recovery
from hwr.daemon.store.checksums import verify
from hwr.daemon.store.denylist import CORRUPTION_CODES, OPERATOR_DENIED, DenyList
from hwr.daemon.store.domain import ensure_domain
from hwr.daemon.store.inspection import ArtifactRecord, Fingerprint
from hwr.daemon.store.installer import Installer
from hwr.daemon.store.keylocks import KeyLocks
from hwr.daemon.store.records import RecordCache, check_key
from hwr.daemon.store.retirement import Retirement
from hwr.daemon.store.staging import StagedTensor, Staging
from hwr.daemon.store.usage import UsageLedger, listing_changes, scan_sizes
from hwr.daemon.store.volatile import VolatileSet
from hwr.daemon.store.writer_bounds import StagingReaper
from hwr.daemon.system import fsguard

__all__ = [
    "CORRUPTION_CODES",
    "FAULT_HOOK",
    "OPERATOR_DENIED",
    "PUBLICATION_STEPS",
    "ArtifactRecord",
    "Fingerprint",
    "StagedTensor",
    "Staging",
    "Store",
]

log = logging.getLogger("hwrd.store")

#: Test hook called with each publication step name (see ``installer``).
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
_SUBDIRS = ("locks", "artifacts", "tmp", "quarantine", "deny", "volatile")


def _step(name: str) -> None:
    hook = FAULT_HOOK  # read at each step: tests set it on this module
    if hook is not None:
        hook(name)


class Store:
    """The artifact store of one root; use ``Store.open`` (also a context manager).

    Lock order (a lock may be taken while holding only those above it; each collaborator's
    docstring repeats its part):

    1. a key's lock (``KeyLocks.hold``): outermost, and a thread holds at most one; held
       across the disk work on ``artifacts/<key>`` (an install's rename, chmod and group fsync,
       a retirement's rename, a quarantine, the first inspection of a directory);
    2. ``DenyList._lock``: held across a deny marker's write, rename and fsync;
    3. ``UsageLedger._scan_lock``: held across a usage rescan's listing, under no other lock;
    4. leaves, held only for in-memory updates, never across a syscall nor while taking another
       lock: ``RecordCache._lock``, ``UsageLedger._lock``, ``Installer._lock``,
       ``Retirement._lock``, ``KeyLocks._table_lock``, ``StagingReaper._lock`` and
       ``GroupSync``'s. Waiting for a ``GroupSync`` round under a key's lock is safe: the
       round's leader only fsyncs, it never waits for a lock meanwhile.

    Readers of single values (``records.listed``, ``records.cached``, ``denylist.reason``,
    ``usage.by_key``, ``usage.total``) take no lock: a dict lookup or copy is atomic under the
    interpreter lock.
    """

    def __init__(self, root: Path, lock_fd: int, filesystem_type: str) -> None:
        self.root = root
        self.filesystem_type = filesystem_type
        self.euid = os.geteuid()
        self.start_report: list[tuple[str, HwrError]] = []
        self._lock_fd: int | None = lock_fd
        self.reaper = StagingReaper()  # discarded stagings a writer still holds (writer_bounds)
        # Commits and retirements rename entries of artifacts/; they share its fsyncs (GroupSync).
        self._artifacts_sync = store_io.GroupSync(root / "artifacts")
        # Unique names for staging and trash directories (tmp/ is wiped at every start, so
        # unique within this run suffices): a random run prefix and a counter, not a uuid4
        # (a getrandom call) each time.
        self._run = uuid.uuid4().hex[:24]
        self._seq = itertools.count()
        self._keys = KeyLocks()
        self.usage = UsageLedger()
        self.denylist = DenyList(root, self.usage)
        self.records = RecordCache(root, self.euid, self.denylist, self._keys, self.usage)
        self.volatile = VolatileSet(root / "volatile")
        self.installer = Installer(
            root,
            records=self.records,
            denied=self.denylist,
            keys=self._keys,
            usage=self.usage,
            artifacts_sync=self._artifacts_sync,
            reaper=self.reaper,
            volatile=self.volatile,
            unique=self._unique,
            require_open=self._require_open,
            step=_step,
        )
        self.retirement = Retirement(
            root,
            records=self.records,
            keys=self._keys,
            usage=self.usage,
            artifacts_sync=self._artifacts_sync,
            unique=self._unique,
            volatile=self.volatile,
        )

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
            store._start(lock_fd)
        except BaseException:
            store.close()
            raise
        return store

    def _start(self, lock_fd: int) -> None:
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
        ensure_domain(self.root, self.filesystem_type)
        recovery.remove_legacy_key_locks(self.root / "locks")
        recovery.wipe_tmp(self.root / "tmp")
        self.volatile.drop_at_open(self.root / "artifacts")  # before validation: see ``volatile``
        self.denylist.load()
        self.start_report.extend(
            recovery.validate_at_open(self.root / "artifacts", self.euid, self.denylist, self.records)
        )
        self.usage.reset(self._scan_sizes())

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
        return f"Store(root={str(self.root)!r}, artifacts={len(self.records)}, {state})"

    def _require_open(self) -> None:
        if self._lock_fd is None:
            raise StoreIOError("the store is closed")

    def _unique(self) -> str:
        """32 hex digits, unique within this Store's life (see ``_run``)."""
        return f"{self._run}{next(self._seq):08x}"

    # ----------------------------------------------------------------- keys and verification
    def known_keys(self) -> set[str]:
        """Keys present in ``artifacts/`` or carrying a deny marker."""
        denied = set(self.denylist.sorted_keys())
        return {e for e in os.listdir(self.root / "artifacts") if is_key(e)} | denied

    def verify(self, key: str, progress: Callable[[int, int], None] | None = None) -> ArtifactRecord:
        """Re-hash every byte; a mismatch quarantines and denies the key, raising ``ChecksumMismatch``.
        A key an operator denied is verified too (its bytes are judged, the deny stays); one
        denied because it was found corrupt raises ``ArtifactDenied``."""
        return verify(check_key(key), records=self.records, denied=self.denylist, keys=self._keys, progress=progress)

    # ----------------------------------------------------------------- usage and staging
    def rescan_usage(self) -> dict[str, int]:
        """Re-read ``artifacts/`` (sizes of validated artifacts from memory, others by ``lstat``)
        into the accounting, logging entries added or removed behind the daemon's back; blocking
        (a worker thread), one ``listdir`` plus ``lstat`` calls for unknown entries."""
        result = self.usage.rescan(self._scan_sizes)
        added, gone = listing_changes(result.before, result.after)
        if added or gone:
            log.warning(
                "artifacts/ changed behind the daemon: %d entries appeared (%s), %d vanished (%s)",
                len(added),
                ",".join(k[:12] for k in added[:5]),
                len(gone),
                ",".join(k[:12] for k in gone[:5]),
            )
        return dict(result.after)

    def _scan_sizes(self) -> dict[str, int]:
        """``usage.scan_sizes`` of ``artifacts/``, knowing validated and accounted entries."""
        known = self.records.sizes()
        known.update(self.usage.by_key())
        return scan_sizes(self.root / "artifacts", known)

    def reclaim_stale_staging(self) -> int:
        """Remove ``tmp/`` entries that belong to no open staging (trash of interrupted removals),
        and reclaim discarded stagings a writer held (``StagingReaper.sweep``)."""
        live = self.installer.open_ids()
        return self.reaper.sweep() + recovery.reclaim_trash(self.root / "tmp", live)

    # ----------------------------------------------------------------- deny and remove
    def is_denied(self, key: str) -> bool:
        """Whether ``key`` carries a deny marker (any kind); ``InvalidRequest`` for a bad key."""
        return check_key(key) in self.denylist

    def denied_records(self) -> list[tuple[str, ArtifactRecord | None]]:
        """Every denied key, by key, with the record of its directory when that is still in
        ``artifacts/`` and valid (an operator's deny), else None. Inspected here, never cached:
        a denied artifact is not served."""
        return [(key, self.records.inspect_denied(key)) for key in self.denylist.sorted_keys()]

    def deny(self, key: str, reason: str) -> None:
        """Deny ``key`` by an operator (a later publication will not replace it)."""
        self.records.deny(check_key(key), "LIFECYCLE", OPERATOR_DENIED, reason)

    def remove(self, key: str) -> None:
        """Delete the artifact (moved into ``tmp/`` first, so a crash never leaves half of it)."""
        self.retirement.delete([self.retirement.retire(key)])
