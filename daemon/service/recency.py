"""Recency of use of the store's artifacts: the clock and the order of LRU eviction.

``Recency`` pairs the persisted last-use times (``AccessTimes``: survive a restart, best effort)
with the in-memory index that walks them oldest first (``LruIndex``). A lease, a release and a
commit ``touch`` a key; ``sync`` notes the artifacts the store validated since the last call (all
of them at the first) at their recorded last use, or else their creation time; a removed
artifact is ``forget``-ten in both.

Contract: on the daemon's event loop only (``AccessTimes`` and ``LruIndex`` are loop-only there
too), so no lock. Limit: an artifact is in the index only once ``sync`` has run after its
validation (every eviction round and every housekeeping tick run it).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from hwr.daemon.policy.lru import LruIndex

if TYPE_CHECKING:
    from hwr.daemon.service.access_times import AccessTimes
    from hwr.daemon.store.root import Store

__all__ = ["Recency"]


class Recency:
    """Last use of each artifact and the LRU order over it (see the module contract)."""

    def __init__(self, access: AccessTimes, store: Store) -> None:
        self.access = access
        self.lru = LruIndex()  # the artifacts by last use (or creation): see sync
        self._store = store

    def touch(self, key: str) -> None:
        now = time.time()
        self.access.touch(key, now)
        self.lru.note(key, now)

    def sync(self) -> None:
        """Note the artifacts validated since the last call (all of them at the first) in the
        LRU index, at their recorded last use or else their creation time."""
        for key in self._store.records.take_added():
            record = self._store.records.listed(key)
            if record is not None:
                self.lru.note(key, self.access.get(key, record.created_at))

    def last_use(self, key: str, default: float) -> float:
        return self.access.get(key, default)

    def forget(self, key: str) -> None:
        self.access.forget(key)
        self.lru.forget(key)
