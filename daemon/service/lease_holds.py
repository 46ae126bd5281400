"""Leases that outlive a daemon restart: the lease journal's records and the *holds* it recovers.

``LeaseHolds`` writes every lease's acquire and release to the ``LeaseJournal``
(``hwr.daemon.service.lease_journal``: what a restarted daemon replays) and keeps the journal's
recovered holds: leases taken before the restart by processes that are still the same live
process. A held key counts as in use (never evicted) until its process exits (``prune``, each
housekeeping tick) or acquires the key again from a new session (``acquired`` then releases the
hold: the new lease protects the key from now on).

Contract: called on the daemon's event loop only (the registry's lease observer, housekeeping,
eviction), so it has no lock. Limits: a process's start time is read once per session (cached,
the cache dropped whole past 65,536 sessions); a hold of a process that exited is found only at
the next ``prune``, which keeps it conservative (held a little too long, never too short).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from hwr.daemon.service.lease_journal import Hold, LeaseJournal, process_start, same_process

if TYPE_CHECKING:
    from hwr.daemon.service.sessions import LeaseRecord

__all__ = ["LeaseHolds"]

log = logging.getLogger("hwrd.store")


class LeaseHolds:
    """The journal of leases and the holds recovered from it (see the module contract)."""

    def __init__(self, journal: LeaseJournal) -> None:
        self.journal = journal
        self.holds: list[Hold] = list(journal.recovered)
        self._starts: dict[str, int] = {}  # session id -> its process's start time (0: unknown)
        if self.holds:
            log.info("recovered %d lease holds of live processes from before the restart", len(self.holds))

    def acquired(self, lease: LeaseRecord) -> None:
        """Journal a new lease; a hold of the same process on the same key ends (reattached)."""
        start = self._starts.get(lease.session_id)
        if start is None:
            if len(self._starts) > 65536:
                self._starts.clear()
            start = process_start(lease.pid) or 0
            self._starts[lease.session_id] = start
        self.journal.acquired(lease.lease_id, lease.key, lease.pid, start, lease.uid)
        self._reattach(lease.key, lease.pid)

    def released(self, lease: LeaseRecord) -> None:
        self.journal.released(lease.lease_id)

    def _reattach(self, key: str, pid: int) -> None:
        if not self.holds:
            return
        keep = []
        for hold in self.holds:
            if hold.key == key and hold.pid == pid:
                self.journal.released(hold.lease_id)
            else:
                keep.append(hold)
        self.holds = keep

    def prune(self) -> None:
        """Drop holds of processes that exited (or whose pid now names another process)."""
        keep = []
        for hold in self.holds:
            if same_process(hold.pid, hold.start):
                keep.append(hold)
            else:
                self.journal.released(hold.lease_id)
        self.holds = keep

    def held_pids(self, key: str) -> list[int]:
        return sorted({h.pid for h in self.holds if h.key == key})

    def lessee_uids(self, key: str) -> set[int]:
        """The uids that ever leased ``key`` (kept across restarts until the artifact goes)."""
        return self.journal.lessee_uids(key)

    def forget(self, key: str) -> None:
        """The artifact is gone: its lessee uids go too."""
        self.journal.forget(key)

    def close(self) -> None:
        self.journal.close()
