"""The store service's periodic tick: holds, access times, LRU feed, stalled and overgrown
publications, the store's usage rescan.

Every ``housekeeping_interval_s``, in this order: drop journal holds of processes that exited
(``LeaseHolds.prune``); save the access times (encoded on the loop, written in a thread); note
new artifacts in the LRU index (also without eviction pressure, so the store's list of added
keys never grows with every commit of a months-long run); cancel staged publications past
``publication_deadline_s``, those that made no progress (their staging files and handed-over
files unchanged) for ``publication_stall_timeout_s``, and those whose staging grew past its
plan, and take back the blocks of discarded stagings a writer still holds
(``hwr.daemon.store.writer_bounds``); last, rescan the store's usage (changes behind the
daemon's back), so a failing listing cannot skip the deadline checks.

Contract: on the daemon's event loop; file work runs in worker threads. A tick that fails is
logged and the next one runs as usual. Limits: a stalled publication is cancelled up to one
interval after its deadline or stall timeout (progress is sampled once per interval); after a
SIGKILL the access order of the last interval may be lost
(it only changes which unused artifact goes first).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from hwr.daemon.policy.deadline import overdue, progressed

if TYPE_CHECKING:
    from hwr.daemon.service.lease_journal import LeaseHolds
    from hwr.daemon.service.publishing import Publishing
    from hwr.daemon.service.recency import Recency
    from hwr.daemon.store.root import Store
    from hwr.daemon.system.config import DaemonConfig

__all__ = ["Housekeeping"]

log = logging.getLogger("hwrd.store")


class Housekeeping:
    """The periodic tick of the store service (see the module contract)."""

    def __init__(self, config: DaemonConfig, store: Store, holds: LeaseHolds, recency: Recency) -> None:
        self.config = config
        self.store = store
        self.holds = holds
        self.recency = recency
        self.cancelled_publications = 0

    async def run(self, publications: Publishing | None) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.config.housekeeping_interval_s)
            try:
                self.holds.prune()
                snapshot = self.recency.access.snapshot()  # encoded here (on the loop, O(keys) but fast);
                if snapshot is not None:                   # written in a thread
                    await asyncio.to_thread(self.recency.access.write, snapshot)
                self.recency.sync()
                if publications is not None:
                    from hwr.daemon.service.publishing import PubState

                    staged = [(p.publication_id, p.started_at) for p in publications.active()
                              if p.state is PubState.STAGED and p.started_at]
                    for pub_id in overdue(staged, loop.time(), self.config.publication_deadline_s):
                        if await publications.cancel(
                                pub_id, f"stalled past the {self.config.publication_deadline_s:g} s deadline"):
                            self.cancelled_publications += 1
                            log.warning("cancelled stalled publication %s", pub_id)
                    await self._cancel_stalled(publications, loop.time)
                    await self._bound_staging(publications)
                # Last, so a failing listing cannot skip the deadline checks above.
                await asyncio.to_thread(self.store.rescan_usage)  # changes behind the daemon's back
            except Exception:
                log.exception("housekeeping failed")

    async def _cancel_stalled(self, publications: Publishing, clock: Callable[[], float]) -> None:
        """Cancel staged client publications that made no progress for
        ``publication_stall_timeout_s``: a writer stopped (SIGSTOP) or hung mid-staging gives its
        reservation back. Daemon-side builds are bounded by their own limits instead (a producer's
        ``producer_timeout_s``, which covers loading a model before the first write; a pull's
        ``remote_stall_timeout_s``)."""
        from hwr.daemon.service.publishing import DAEMON_OWNER, PubState

        timeout = self.config.publication_stall_timeout_s
        if timeout <= 0:
            return
        staged = [p for p in publications.active()
                  if p.state is PubState.STAGED and p.staging is not None and p.session_id != DAEMON_OWNER]
        if not staged:
            return
        marks = await asyncio.to_thread(lambda: [publications.progress_marks(p) for p in staged])
        now = clock()
        for pub, mark in zip(staged, marks, strict=True):
            _moved, pub.progress_at = progressed(mark, pub.progress, now, pub.progress_at)
            pub.progress = mark
        for pub_id in overdue([(p.publication_id, p.progress_at) for p in staged], now, timeout):
            if await publications.cancel(pub_id, f"it made no progress for {timeout:g} s"):
                self.cancelled_publications += 1
                log.warning("cancelled publication %s: no progress for %g s", pub_id, timeout)

    async def _bound_staging(self, publications: Publishing) -> None:
        """Cancel staged publications whose files grew past their plan, and take back the
        blocks of discarded stagings a writer still holds (``hwr.daemon.store.writer_bounds``)."""
        from hwr.daemon.service.publishing import PubState
        from hwr.daemon.store.writer_bounds import overgrown

        staged = [(p.publication_id, p.staging) for p in publications.active()
                  if p.state is PubState.STAGED and p.staging is not None]
        for pub_id in await asyncio.to_thread(overgrown, staged):
            if await publications.cancel(pub_id, "its staging grew past its reservation"):
                self.cancelled_publications += 1
                log.warning("cancelled publication %s: its staging grew past its reservation", pub_id)
        await asyncio.to_thread(self.store.reaper.sweep)
