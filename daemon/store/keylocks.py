"""Per-key mutual exclusion for the threads of the one process that owns a store root.

``KeyLocks.hold(key)`` serialises every change this process makes to ``artifacts/<key>`` (a
commit's install, a retirement, a quarantine, the first inspection of a directory) and the
checks that must see such a change whole (``RecordCache.lookup``). A lock exists only while
someone holds or waits for it, so the table stays as small as the keys in use.

Limits: in memory only. That suffices because one process owns the root
(``locks/daemon.lock``); earlier versions flocked a ``locks/<key>.artifact`` file per key (one
inode per key ever published, never removed), which ``recovery.remove_legacy_key_locks`` deletes.
Not re-entrant: a thread holding ``key`` must not ask for it again.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["KeyLocks"]


class _Entry:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0  # holders and waiters: the entry goes when the last one leaves


class KeyLocks:
    """A lock per artifact key, created on first use and dropped when unused.

    Lock order: the per-key lock is the outermost lock of the store (its holder may write deny
    markers, rename, fsync, and take any other store lock). ``_table`` is a leaf, held only to
    find or count an entry, never while waiting for a key's lock.
    """

    def __init__(self) -> None:
        self._table_lock = threading.Lock()
        self._table: dict[str, _Entry] = {}

    @contextlib.contextmanager
    def hold(self, key: str) -> Iterator[None]:
        with self._table_lock:
            entry = self._table.get(key)
            if entry is None:
                entry = self._table[key] = _Entry()
            entry.users += 1
        try:
            with entry.lock:
                yield
        finally:
            with self._table_lock:
                entry.users -= 1
                if not entry.users:
                    del self._table[key]

    def __len__(self) -> int:
        """Keys held or waited for now (a diagnostic)."""
        return len(self._table)
