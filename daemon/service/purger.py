"""Deletion of retired artifacts' bytes, in a thread pool of its own.

``Retirement.retire`` only renames an artifact into ``tmp/`` trash (a flock and a rename, no fsync);
``Retirement.delete`` makes the retirement durable (one directory fsync for the lot) and
deletes the bytes. ``Purger`` runs the latter in two threads of its own, not in the loop's
default executor, where threads stuck in fsync would make every acquire's lookup hop wait for a
free worker.

Contract: ``purge`` (awaited on the event loop) deletes to the end even when its caller is
cancelled; ``purge_later`` (on the loop) hands the trash to the pool and returns at once;
``purge_sync`` deletes in the calling worker thread. Limit: trash whose deletion fails, or that
is handed over after ``close``, stays in ``tmp/`` until the next start wipes it (logged).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hwr.daemon.store.root import Store

__all__ = ["Purger"]

log = logging.getLogger("hwrd.store")


class Purger:
    """Deletes retired artifacts of one store (see the module contract)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        # No lock of its own: each task is one ``Retirement.delete`` (which takes the store's
        # locks in the worker thread); nothing here is shared between the threads.
        self.pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="hwr-purge")

    def purge_sync(self, trash: list[Path]) -> None:
        """Delete retired artifacts' bytes now, in the calling (worker) thread (one directory
        fsync at most for the lot: ``Retirement.delete``)."""
        self._store.retirement.delete(trash)

    async def purge(self, trash: list[Path]) -> None:
        """Delete retired artifacts' bytes, to the end even if the caller is cancelled."""
        if not trash:
            return
        task = asyncio.get_running_loop().run_in_executor(self.pool, self._store.retirement.delete, list(trash))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await task
            raise

    def purge_later(self, trash: list[Path]) -> None:
        """Delete ``trash`` in the pool without waiting; a failure is logged."""
        if not trash:
            return
        try:
            future = self.pool.submit(self.purge_sync, trash)
        except RuntimeError:  # the pool is shut down (daemon stopping): the next start wipes tmp/
            log.info("leaving %d retired artifacts in tmp/ for the next start", len(trash))
        else:
            future.add_done_callback(_log_purge_failure)

    def close(self) -> None:
        """Wait for the deletions handed over so far; idempotent."""
        self.pool.shutdown(wait=True)


def _log_purge_failure(future: concurrent.futures.Future[None]) -> None:
    exc = future.exception()
    if exc is not None:  # the bytes stay in tmp/ until the next start wipes it
        log.error("deleting retired artifacts failed: %s", exc)
