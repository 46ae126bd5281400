"""Retirement: artifacts moved out of ``artifacts/`` into trash, and the trash deleted later.

``retire`` renames ``artifacts/<key>`` to ``tmp/<key>.removed.<unique>`` under the key's lock
(fast: no fsync, so the event loop can evict inline; ``fileio.move_out`` makes the 0555
directory movable for a daemon that is not root); its bytes stay on disk until
``delete``, which first makes the retirement durable. Deleting before the rename out is durable
could let a crash bring back a half-deleted artifact, so ``delete`` runs an ``artifacts/`` fsync
unless one that started after every retirement has already completed (typically the caller's
own commit ran it: ``fileio.GroupSync`` marks).

Limits: trash left by a crash (or by a caller that never deletes it) stays in ``tmp/`` until the
next start wipes ``tmp/`` or ``recovery.reclaim_trash`` removes it; a failed fsync still deletes
the trash (only the renames' durability failed) and raises ``StoreIOError``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from hwr.client.errors import ArtifactNotFound
from hwr.daemon.store import fileio as store_io
from hwr.daemon.store.keylocks import KeyLocks
from hwr.daemon.store.records import RecordCache, check_key
from hwr.daemon.store.usage import UsageLedger
from hwr.daemon.store.volatile import VolatileSet

__all__ = ["TRASH_INFIX", "Retirement"]

log = logging.getLogger("hwrd.store")

#: In the name of every trash directory of ``tmp/`` (``recovery.stale_trash`` tells them by it).
TRASH_INFIX = ".removed."


class Retirement:
    """Retirements of one store and the ``GroupSync`` marks that tell when they are durable.

    Lock order: ``retire`` holds the key's lock (``KeyLocks``) across the rename and takes leaf
    locks under it (the record cache's, the usage ledger's, the group sync's, ``_lock``).
    ``_lock`` is a leaf, held only to record or take marks; ``delete`` holds no lock across its
    fsync or the deletion.
    """

    def __init__(
        self,
        root: Path,
        *,
        records: RecordCache,
        keys: KeyLocks,
        usage: UsageLedger,
        artifacts_sync: store_io.GroupSync,
        unique: Callable[[], str],
        volatile: VolatileSet,
    ) -> None:
        self._artifacts = root / "artifacts"
        self._volatile = volatile
        self._tmp = root / "tmp"
        self._records = records
        self._keys = keys
        self._usage = usage
        self._artifacts_sync = artifacts_sync
        self._unique = unique
        self._lock = threading.Lock()
        self._marks: dict[Path, int] = {}  # trash -> GroupSync mark taken after its retire

    def retire(self, key: str) -> Path:
        """Move ``key``'s artifact into a trash directory in ``tmp/`` and return its path.
        Raises ``InvalidRequest`` (not a key), ``ArtifactNotFound`` (no directory),
        ``StoreIOError``. Fast (no fsync); the bytes stay on disk until ``delete``."""
        with self._keys.hold(check_key(key)):
            self._records.drop(key)
            path = self._artifacts / key
            if not os.path.lexists(path):
                raise ArtifactNotFound(f"no artifact {key}", details={"key": key})
            trash = self._tmp / f"{key}{TRASH_INFIX}{self._unique()}"
            # Logged before the rename, so a log that lacks this line proves the artifact was
            # never removed on purpose (the fault suite tells lost artifacts from evicted ones).
            log.debug("retiring artifact %s", key)
            try:
                with self._usage.moved(key, None):
                    store_io.move_out(path, trash)
            except OSError as exc:
                raise store_io.io_error(exc, "remove") from None
            self._volatile.clear(key)  # under the key's lock: a new commit of the key marks after
            mark = self._artifacts_sync.mark()  # after the rename: any round started later covers it
            with self._lock:
                self._marks[trash] = mark
            return trash

    def delete(self, trash: Sequence[Path]) -> None:
        """Make the retirements of ``trash`` durable when no round has yet, then delete it."""
        with self._lock:
            marks = [self._marks.pop(path, -1) for path in trash]
        if trash and not all(mark >= 0 and self._artifacts_sync.covered(mark) for mark in marks):
            try:
                self._artifacts_sync.sync()
            except OSError as exc:
                for path in trash:  # the bytes go even so: only the renames' durability failed
                    store_io.remove_tree(path)
                raise store_io.io_error(exc, "remove") from None
        for path in trash:
            store_io.remove_tree(path)
