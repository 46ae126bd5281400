"""The record cache: validated artifact records in memory, and every way of looking one up.

A record (``inspection.ArtifactRecord``) is cached once an artifact passed metadata validation
(at open, at its first lookup, or as the result of a commit); a warm lookup then only compares
recorded ``lstat`` fingerprints (a few microseconds). The lookups, from the cheapest:

``listed``       in-memory record when ``artifacts`` would list it; no disk access, no lock
``cached``       the record when a three-``lstat`` guard holds (the acquire hot path)
``absent_now``   True when the key provably has no artifact (one ``lstat``)
``lookup``       the validated record or a typed error (the full check; may inspect the disk)
``try_lookup``   ``lookup`` for a caller that holds the key's lock; None when corrupt or denied

Contract: a denied key is never served. Every deny goes through ``deny``/``deny_for`` here,
which drop the key's record around the marker write, and every lookup checks the deny list
first. Only a failure confirmed under the key's lock denies a key, and a record is only cached
under that lock (see ``lookup``). ``open_payloads`` re-checks each file by ``fstat`` and denies
an artifact changed since validation before any descriptor leaves.

Limits: a change that preserves size, mtime and ctime is found only by ``verify`` or the
background scrub; the cache does not notice files changed behind the daemon's back until the
next lookup of their key.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from hwr.client.errors import (
    ArtifactDenied,
    ArtifactNotFound,
    ChecksumMismatch,
    HwrError,
    InvalidRequest,
    ManifestCorrupt,
    ManifestIncompatible,
    StoreIOError,
)
from hwr.client.identity import is_key
from hwr.daemon.store import fileio as store_io
from hwr.daemon.store.denylist import DenyList
from hwr.daemon.store.inspection import ArtifactRecord, inspect_artifact, same_fingerprints
from hwr.daemon.store.keylocks import KeyLocks
from hwr.daemon.store.usage import UsageLedger

__all__ = ["RecordCache", "check_key"]


def check_key(key: object) -> str:
    """``key`` itself when it is 64 lowercase hex digits (the only strings that become paths),
    else ``InvalidRequest``."""
    if not is_key(key):
        raise InvalidRequest("an artifact key is 64 lowercase hex digits", details={"key": str(key)[:80]})
    return key  # type: ignore[return-value]


class _Unconfirmed(Exception):
    """A lookup check failed outside the key lock: run it again under the lock (``lookup``)."""


class RecordCache:
    """Validated records by key, with the keys added since the last ``take_added``.

    Lock order: ``_lock`` is a leaf, held only for in-memory reads and updates of ``_records``
    and ``_added``, never across a syscall nor while taking another lock; single dict reads
    take no lock (atomic under the interpreter lock). Methods that inspect a directory or deny
    a key take the key's lock first (``KeyLocks``), and a deny marker's write takes the deny
    list's lock, never while ``_lock`` is held.
    """

    def __init__(self, root: Path, euid: int, denied: DenyList, keys: KeyLocks, usage: UsageLedger) -> None:
        self._artifacts = root / "artifacts"
        self._euid = euid
        self._denied = denied
        self._keys = keys
        self._usage = usage
        self._lock = threading.Lock()
        self._records: dict[str, ArtifactRecord] = {}
        # Keys that entered _records since the last ``take_added`` (the daemon's LRU index
        # learns of new artifacts from it instead of listing every record per eviction round).
        self._added: list[str] = []

    def __len__(self) -> int:
        return len(self._records)

    # ----------------------------------------------------------------- the cache itself
    def put(self, key: str, record: ArtifactRecord) -> None:
        """Cache ``record`` (callers hold ``key``'s lock, or run before anyone else can)."""
        with self._lock:
            if key not in self._records:
                self._added.append(key)
            self._records[key] = record

    def drop(self, key: str) -> None:
        """Forget ``key``'s record: its next lookup inspects the disk again."""
        with self._lock:
            self._records.pop(key, None)

    def take_added(self) -> list[str]:
        """Keys that became records (validated artifacts) since the last call, each once per
        arrival; the first call returns every key validated at start."""
        if not self._added:  # the common case, without the lock (a list's truth is atomic)
            return []
        with self._lock:
            added, self._added = self._added, []
        return added

    def sizes(self) -> dict[str, int]:
        """Payload bytes of every cached record (what a usage rescan knows without ``lstat``)."""
        with self._lock:
            return {k: r.size_bytes for k, r in self._records.items()}

    def artifacts(self) -> list[ArtifactRecord]:
        """Every validated, not denied artifact, by key."""
        with self._lock:
            items = sorted(self._records.items())
        return [r for k, r in items if k not in self._denied]

    # ----------------------------------------------------------------- deny and allow
    def deny(self, key: str, stage: str, code: str, message: str) -> None:
        """Write ``key``'s deny marker (``DenyList.write``) and drop its record, even when the
        marker could not be persisted (the key is denied in memory then, and that raises)."""
        try:
            self._denied.write(key, stage, code, message)
        finally:
            self.drop(key)

    def deny_for(self, key: str, exc: HwrError) -> None:
        """Deny ``key`` because validation found ``exc`` (a corruption a publication may replace)."""
        self.drop(key)
        self.deny(key, "VALIDATION", exc.code, exc.message)

    def allow(self, key: str) -> None:
        """Remove ``key``'s deny marker and record: its next lookup re-validates from scratch
        (idempotent; ``InvalidRequest`` for a bad key)."""
        self._denied.clear(check_key(key))
        self.drop(key)

    def inspect_denied(self, key: str) -> ArtifactRecord | None:
        """The record of a denied key's directory when it is still in ``artifacts/`` and valid
        (an operator's deny), else None. Inspected each time, never cached: it is not served."""
        path = self._artifacts / key
        if not os.path.lexists(path):
            return None
        try:
            return inspect_artifact(path, key, self._euid)
        except (HwrError, OSError):
            return None

    # ----------------------------------------------------------------- lookups
    def listed(self, key: str) -> ArtifactRecord | None:
        """The in-memory record of ``key`` when ``artifacts()`` would list it (validated, not
        denied), else None; O(1), no disk access. No lock: two single dict lookups are atomic
        under the interpreter lock."""
        return None if key in self._denied else self._records.get(key)

    def absent_now(self, key: str) -> bool:
        """True when ``key`` provably has no artifact (not validated, not denied, no directory):
        one ``lstat``, safe on the event loop. False means "ask ``lookup``" (it may exist)."""
        if key in self._records or key in self._denied:
            return False
        return not os.path.lexists(self._artifacts / key)

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

    def lookup(self, key: str) -> ArtifactRecord:
        """The validated record of ``key``.

        Raises ``InvalidRequest`` (not a key: ``check_key``), ``ArtifactDenied``,
        ``ArtifactNotFound``, ``ManifestCorrupt`` or ``ManifestIncompatible`` (the key is denied
        then), ``StoreIOError``.

        Only a failure confirmed under ``key``'s lock denies the key, and a record is only
        cached under it. Every change the store makes to ``artifacts/<key>`` (a retirement for
        eviction and removal, a commit's install, whose directory is briefly at its staging
        mode after the rename, a quarantine) holds that lock, so a check that failed without it
        may have caught one of those half done: it is run again under the lock, where it sees
        the before or the after (gone: ``ArtifactNotFound``). The fast paths (a warm record
        whose fingerprints hold; no directory at all) take no lock; the first inspection of a
        directory does."""
        check_key(key)
        try:
            return self._lookup(key, final=False)
        except _Unconfirmed:
            with self._keys.hold(key):
                return self._lookup(key, final=True)

    def try_lookup(self, key: str) -> ArtifactRecord | None:
        """``lookup`` for a caller that already holds ``key``'s lock; None when it is corrupt or denied."""
        try:
            return self._lookup(key, final=True)
        except (ManifestCorrupt, ManifestIncompatible, ChecksumMismatch, ArtifactDenied):
            return None

    def _lookup(self, key: str, *, final: bool) -> ArtifactRecord:
        """``lookup``'s body. ``final`` False (no lock held): a warm record whose fingerprints
        hold, ``ArtifactDenied`` or ``ArtifactNotFound``; anything else (a failed check, a
        directory to inspect) raises ``_Unconfirmed`` and the caller retries under the key
        lock. ``final`` True: the caller holds the key lock."""
        code = self._denied.reason(key)
        if code is not None:
            raise ArtifactDenied(f"artifact {key} is denied", details={"key": key, "reason": code})
        record = self._records.get(key)
        if record is not None:
            if same_fingerprints(record.fingerprints):
                return record
            if not final:
                raise _Unconfirmed
            exc: HwrError = ManifestCorrupt(
                "artifact changed since it was validated", details={"key": key, "check": "fingerprint"}
            )
            self.deny_for(key, exc)
            raise exc
        path = self._artifacts / key
        if not os.path.lexists(path):
            raise ArtifactNotFound(f"no artifact {key}", details={"key": key})
        if not final:
            # Inspect (and cache the record) only under the key lock: an inspection racing an
            # eviction and a re-publication of the key could otherwise cache the old
            # directory's record over the new one, which every later lookup would then find
            # "changed" and deny.
            raise _Unconfirmed
        try:
            record = inspect_artifact(path, key, self._euid)
        except (ManifestCorrupt, ManifestIncompatible) as err:
            if not os.path.lexists(path):  # removed by hand meanwhile: nothing to deny
                raise ArtifactNotFound(f"no artifact {key}", details={"key": key}) from None
            self.deny_for(key, err)
            raise
        self.put(key, record)
        if key not in self._usage and os.path.lexists(path):
            # Put there behind the daemon's back since the last rescan: count it now. (Gone by
            # now, quarantined or removed meanwhile: the caller's open_payloads says which.
            # Counted anyway when it went between the check and here: an overcount until the
            # next rescan, never an undercount.)
            with self._usage.moved(key, record.size_bytes, keep=True):
                pass
        return record

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
                    self.deny_for(record.key, exc)
                    raise exc
        except BaseException as failure:
            for _, fd in opened:
                os.close(fd)
            if isinstance(failure, FileNotFoundError) and not isinstance(failure, HwrError):
                # Raced with a quarantine (deny lands first) or an eviction/removal: say what
                # the artifact is now, not an I/O error.
                code = self._denied.reason(record.key)
                if code is not None:
                    raise ArtifactDenied(
                        f"artifact {record.key} is denied", details={"key": record.key, "reason": code}
                    ) from None
                raise ArtifactNotFound(f"no artifact {record.key}", details={"key": record.key}) from None
            if isinstance(failure, OSError) and not isinstance(failure, HwrError):
                raise StoreIOError(
                    f"cannot open payloads of {record.key}: {failure.strerror}", details={"key": record.key}
                ) from None
            raise
        return opened
