"""Deny markers and quarantine: what the store refuses to serve, and corrupt bytes set aside.

Files::

    <root>/deny/<key>.json                      schema_version, stage, reason, message
    <root>/quarantine/<key>.<reason>.<uuid>/    an artifact directory moved aside for inspection

A deny marker is written atomically (temp file, rename, ``deny/`` fsync) and read back at every
open (``DenyList.load``); the in-memory map (key -> reason code) is what lookups consult. Two
kinds of deny: an operator's (``OPERATOR_DENIED``: only ``allow`` lifts it) and a corruption
found by validation (``CORRUPTION_CODES``: a new publication of the key may replace it, see
``publication_may_replace``).

Contract: a key is denied in memory even when its marker could not be persisted (the write
raises ``StoreIOError`` after that); ``clear`` forgets a key only once its marker is gone. This
module keeps no artifact records: ``RecordCache`` drops a denied key's record around ``write``
and ``clear`` (the invariant "a denied key is never served" lives there).

Limits: quarantine moves are fsynced but never cleaned up here (an operator inspects and deletes
them); only 64-hex keys reach this module (the callers check).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import uuid
from pathlib import Path

from hwr.client.errors import ChecksumMismatch, ManifestCorrupt, ManifestIncompatible
from hwr.client.identity import canonical_json, is_key
from hwr.daemon.store import fileio as store_io
from hwr.daemon.store.domain import read_deny_code
from hwr.daemon.store.usage import UsageLedger

__all__ = ["CORRUPTION_CODES", "OPERATOR_DENIED", "DenyList", "publication_may_replace"]

log = logging.getLogger("hwrd.store")

#: Deny reasons that a new publication of the same key may replace (corruption, not an operator).
CORRUPTION_CODES = frozenset({ManifestCorrupt.code, ChecksumMismatch.code, ManifestIncompatible.code})
OPERATOR_DENIED = "OPERATOR_DENIED"


def publication_may_replace(code: str) -> bool:
    """Whether a deny with reason ``code`` gives way to a new publication of the same key."""
    return code in CORRUPTION_CODES


class DenyList:
    """The deny markers of one root (``deny/``), their in-memory map, and quarantine moves.

    Lock order: ``_lock`` serialises marker writes and removals and is held across their
    rename and fsync; it may be taken under a key lock (``KeyLocks``) and takes no other lock.
    Readers (``reason``, ``in``, ``sorted_keys``) take no lock: a single dict operation or copy is
    atomic under the interpreter lock, and a reader must not wait behind a marker's fsync.
    ``quarantine`` takes no lock of its own (its caller holds the key's lock); the usage
    ledger's leaf lock is taken inside it.
    """

    def __init__(self, root: Path, usage: UsageLedger) -> None:
        self._deny_dir = root / "deny"
        self._quarantine_dir = root / "quarantine"
        self._artifacts = root / "artifacts"
        self._usage = usage
        self._lock = threading.Lock()
        self._denied: dict[str, str] = {}  # key -> deny reason code

    def load(self) -> None:
        """Read every marker in ``deny/`` (at open); removes leftovers of interrupted writes.
        An unreadable marker still denies its key (as ``OPERATOR_DENIED``)."""
        for entry in os.listdir(self._deny_dir):
            key = entry.removesuffix(".json")
            if entry.endswith(".json") and is_key(key):
                self._denied[key] = read_deny_code(self._deny_dir / entry, OPERATOR_DENIED)
            else:
                store_io.remove_tree(self._deny_dir / entry)

    def reason(self, key: str) -> str | None:
        return self._denied.get(key)

    def __contains__(self, key: str) -> bool:
        return key in self._denied

    def sorted_keys(self) -> list[str]:
        return sorted(self._denied.copy())

    def write(self, key: str, stage: str, code: str, message: str) -> None:
        """Deny ``key`` with a persistent marker (``stage``: ``VALIDATION`` or ``LIFECYCLE``)."""
        log.warning("artifact %s denied (%s, %s): %r", key, stage.lower(), code, str(message)[:200])
        document = {"schema_version": 1, "stage": stage, "reason": code, "message": str(message)[:1000]}
        path = self._deny_dir / f"{key}.json"
        tmp = self._deny_dir / f".{key}.{uuid.uuid4().hex}.tmp"
        with self._lock:
            try:
                store_io.write_new_file(tmp, canonical_json(document))
                store_io.rename(tmp, path)
                store_io.fsync_dir(path.parent)
            except OSError as exc:
                store_io.remove_tree(tmp)
                raise store_io.io_error(exc, "deny marker") from None
            finally:
                self._denied[key] = code  # denied in memory even if the marker could not be persisted

    def clear(self, key: str) -> None:
        """Remove ``key``'s marker (idempotent); it stays denied if that fails."""
        with self._lock:
            path = self._deny_dir / f"{key}.json"
            try:
                path.unlink(missing_ok=True)
                store_io.fsync_dir(path.parent)
            except OSError as exc:
                raise store_io.io_error(exc, "allow") from None
            self._denied.pop(key, None)

    def quarantine(self, path: Path, reason: str, key: str) -> Path:
        """Move ``path`` (an ``artifacts/`` entry, or a stray one) to ``quarantine/`` and fsync
        its parent; a ``path`` already gone is not an error. Returns the target name."""
        target = self._quarantine_dir / f"{key}.{reason}.{uuid.uuid4().hex}"
        try:
            with self._usage.moved(path.name if path.parent == self._artifacts else None, None):
                store_io.move_out(path, target)
            store_io.fsync_dir(path.parent)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise store_io.io_error(exc, "quarantine") from None
        return target
