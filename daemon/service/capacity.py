"""Capacity of the store, one owner: admission, reservations, eviction, purging retired bytes.

A publication passes here before its staging exists (``hwr.daemon.service.publishing`` calls
``admit`` with the bytes its payload plan needs, ``allocated`` once its files are preallocated,
``finished`` at its end): it takes the store-wide admission slot (``Admission``; only with
``serialized_admission``), then reserves its bytes against the store limit and the free-space
floor (``policy.capacity``), evicting LRU artifacts to make room (``Evictor.round``: a round that
only retires; see ``reserve`` for when the retired bytes are deleted). A request that does not
fit while other publications hold reservations waits for room, oldest first (``signal_room``).
The same object evicts by hand (``evict``) and collects garbage (``collect_garbage``); a key that
lost its last lease wakes the room queue (``signal_room``, called by ``Leasing``, which journals
its leases itself).

The retired files never leave this module and its helpers (``evictor``, ``purger``): a
publication's ``Claim`` keeps them, and the publication only says when its staging is about to
be created (``before_staging``), when its commit is durable (``after_commit``) and how it ended
(``finished``); capacity deletes them at the right one. A key reserved by a publication (from
``admit`` until ``finished``, its build included) is never an eviction candidate.

Usage snapshots read the reservations before the disk (see ``usage``): the other order missed a
commit landing in between and let concurrent publications overshoot the store limit.

Lock order (all on the daemon's event loop; the threads below take none of these):

    admission slot (``Admission``)  ->  a turn in the room queue  ->  ``lock`` (capacity)

A publication takes the admission slot first and keeps it until ``finished``; it waits for its
turn in the room queue without holding ``lock``; ``lock`` (an ``asyncio.Lock``) is held across
one usage snapshot and the eviction round that follows it (``evict`` and ``collect_garbage``
take it too), across thread hops that take only the store's own locks (the /proc scan,
``Retirement.retire``/``Store.remove``, ``Purger.purge``). Nothing waits for the admission slot or a room
turn while holding ``lock``, and the pin lock (``hwr.daemon.service.pinning``) is never taken
under it, nor it under the pin lock.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from hwr.client.errors import ActiveBuildTimeout
from hwr.daemon.policy.capacity import CapacityPolicy, Reservation, Reservations, Usage, assess, shortfall_error
from hwr.daemon.service.eviction_marks import EvictionMarks
from hwr.daemon.service.evictor import EvictionReport, Evictor
from hwr.daemon.service.purger import Purger

if TYPE_CHECKING:
    from hwr.daemon.service.catalog import Catalog
    from hwr.daemon.service.lease_journal import LeaseHolds
    from hwr.daemon.service.mapping_scan import MappingScan
    from hwr.daemon.service.pinning import PinSet
    from hwr.daemon.service.recency import Recency
    from hwr.daemon.service.sessions import Registry
    from hwr.daemon.store.root import Store
    from hwr.daemon.system.config import DaemonConfig

__all__ = ["Admission", "Capacity", "Claim"]

log = logging.getLogger("hwrd.store")


class Admission:
    """Optional store-wide serialization of publications: with ``serialized`` one publication
    at a time stages and commits in the whole store (a node whose disk or page cache cannot take
    two builds at once); the others wait in FIFO order up to their wait timeout, then get
    ``ActiveBuildTimeout``. One build per identity is enforced by the publications themselves."""

    def __init__(self, *, serialized: bool = False) -> None:
        self.serialized = serialized
        self._slot = asyncio.Semaphore(1) if serialized else None
        self.waiting = 0

    async def enter(self, key: str, timeout: float) -> bool:
        """Wait for the store-wide slot (no-op unless serialized); True when a slot was taken."""
        if self._slot is None:
            return False
        self.waiting += 1
        try:
            await asyncio.wait_for(self._slot.acquire(), max(0.0, timeout))
        except TimeoutError:
            raise ActiveBuildTimeout("serialized admission: another publication is building",
                                     details={"key": key, "serialized": True}) from None
        finally:
            self.waiting -= 1
        return True

    def leave(self, took_slot: bool) -> None:
        if took_slot and self._slot is not None:
            self._slot.release()


@dataclass
class Claim:
    """A publication's claim on the store's capacity: its admission slot and its reservation
    (``Capacity.admit`` to ``Capacity.finished``). Its fields are capacity's; a publication only
    hands the claim back."""

    key: str
    took_slot: bool
    reservation: Reservation
    #: Artifacts retired to make room, still on disk: deleted before the publication's staging
    #: is created (``before_staging``) or, when ``purge_after_commit``, after its commit
    #: (``after_commit``; see ``reserve``), else when it finishes.
    trash: list[Path] = field(default_factory=list)
    purge_after_commit: bool = False

    def take_trash(self) -> list[Path]:
        """The trash not yet deleted, handed over once (the next call returns an empty list)."""
        trash, self.trash = self.trash, []
        return trash


#: With no publication in flight, how long a publication that may wait gives leased artifacts to
#: be released before the capacity error (in all, per request: each release within it is a retry).
LEASE_GRACE_S = 1.0


class Capacity:
    """The store's capacity (see the module contract). ``marks`` are the eviction marks that the
    read API (``hwr.daemon.service.catalog``) waits on; ``on_evict`` (a metrics hook) and
    ``protected`` (a channel's keys, ``Channels.protects``) go to the evictor."""

    #: Retired bytes a publication may leave on disk until its commit (``reserve``).
    PURGE_AFTER_COMMIT_MAX_BYTES = 64 << 20

    def __init__(self, config: DaemonConfig, store: Store, catalog: Catalog, registry: Registry, *,
                 marks: EvictionMarks, pins: PinSet, holds: LeaseHolds, recency: Recency,
                 scan: MappingScan, protected: Callable[[str], bool] | None = None,
                 on_evict: Callable[[str], None] | None = None) -> None:
        self.recency = recency  # a committed key is the most recently used; the usage view reads it
        self.holds = holds  # the usage view's "held by" (leases from before a restart)
        self.purger = Purger(store)
        self.policy = CapacityPolicy(config.store_limit_bytes, config.artifact_limit_bytes, config.min_free_bytes)
        self.reservations = Reservations()
        self.evictor = Evictor(store, catalog, marks, registry, recency, holds, scan, pins, self.purger,
                               self.reservations, protected=protected, on_evict=on_evict)
        self._store = store  # store work: reclaim stale staging (gc)
        self.admission = Admission(serialized=config.serialized_admission)
        self.lock = asyncio.Lock()  # the capacity lock: see the lock order in the module docstring
        # Publications waiting for room, oldest first (see reserve and signal_room).
        self._room_waiters: collections.deque[asyncio.Event] = collections.deque()

    # ------------------------------------------------------------------ publications
    async def admit(self, key: str, need: int, wait_timeout: float) -> Claim:
        """Admission, then a reservation of ``need`` bytes (the publication's payload plan)."""
        took = await self.admission.enter(key, wait_timeout)
        try:
            reservation, trash, late = await self.reserve(key, need, wait_timeout)
        except BaseException:
            self.admission.leave(took)
            raise
        return Claim(key, took, reservation, trash, late)

    def before_staging(self, claim: Claim) -> None:
        """In the worker thread that is about to create ``claim``'s staging: delete the bytes
        eviction retired for it, unless they may wait for its commit (``reserve``)."""
        if not claim.purge_after_commit:
            self.purger.purge_sync(claim.take_trash())

    def after_commit(self, claim: Claim) -> None:
        """In the worker thread, right after ``claim``'s commit: its ``artifacts/`` fsync started
        after the retirements, which are durable now; delete the bytes left for it."""
        if claim.purge_after_commit:
            self.purger.purge_sync(claim.take_trash())

    def allocated(self, claim: Claim) -> None:
        self.reservations.mark_allocated(claim.reservation)

    def finished(self, claim: Claim, committed: bool) -> None:
        self.purger.purge_later(claim.take_trash())  # not deleted by the commit (it failed, or was aborted)
        self.reservations.drop(claim.reservation)
        self.admission.leave(claim.took_slot)
        claim.took_slot = False
        if committed:
            self.recency.touch(claim.key)
        self.signal_room()

    def signal_room(self) -> None:
        """Room may have appeared (a reservation ended, an artifact lost its last lease): wake
        the oldest publication waiting for it (``reserve``), which passes the wake-up on when
        it leaves the queue. One retry per event instead of one per waiter: with every waiter
        woken, dozens of publications re-ran an eviction round per lease release under churn
        (measured: 25 rounds per publication) and the youngest could overtake the oldest."""
        for waiter in self._room_waiters:
            if not waiter.is_set():
                waiter.set()
                return

    async def usage(self) -> Usage:
        """Committed + reserved bytes, never an undercount (may double count a commit in flight).

        The committed bytes are the store's in-memory accounting (``UsageLedger.total``:
        an artifact counts from the moment its rename into ``artifacts/`` is done until its rename
        out). The reservations are read BEFORE it: a publication renames its artifact into
        ``artifacts/`` first and drops its reservation afterwards (``finished``), so each of its
        bytes is in the snapshot of one or both. Read the other way round, a commit landing
        between the two reads is in neither and a concurrent reservation overshoots the limit by
        that artifact. Likewise a staging is preallocated before it is marked allocated, so free
        space measured after the unallocated snapshot double counts at worst. Sound only under
        the capacity lock (eviction, the other way bytes leave ``artifacts/``, takes it too).
        """
        reserved, unallocated = self.reservations.reserved_bytes, self.reservations.unallocated_bytes
        # Inline, not in a worker thread: the accounting is in memory and a statvfs takes
        # microseconds, while a thread hop under publication churn waits behind blocking store
        # work; it runs under the capacity lock, so every hop here serialises all publications
        # (measured: ~100 ms of admission queueing). A listdir of artifacts/ here instead cost a
        # third of the loop's time under churn: it waits on the directory lock behind renames.
        committed, free, whole = self._disk_usage()
        return Usage(committed, reserved, unallocated, free, whole)

    def _disk_usage(self) -> tuple[int, int, int]:
        """(committed bytes, free bytes, what the filesystem holds for us when empty: its size
        less the blocks reserved for root, which an unprivileged daemon cannot use)."""
        committed = self._store.usage.total()
        st = os.statvfs(self._store.root)
        reserved_for_root = st.f_bfree - st.f_bavail
        return committed, st.f_bavail * st.f_frsize, max(0, st.f_blocks - reserved_for_root) * st.f_frsize

    async def reserve(self, key: str, need: int, wait_timeout: float = 0.0) -> tuple[Reservation, list[Path], bool]:
        """Reserve ``need`` bytes for a publication of ``key``, evicting LRU artifacts if needed:
        (reservation, trash, purge_after_commit). The evicted artifacts are only retired here and
        their trash kept in the publication's ``Claim``: deleted before it writes anything
        (``before_staging``, in the same worker hop as its staging), or, when
        ``purge_after_commit`` is True, once its commit's ``artifacts/`` fsync made the
        retirement durable (``after_commit``; ``Retirement.delete``: saves a directory fsync).
        That is allowed only for at most ``PURGE_AFTER_COMMIT_MAX_BYTES`` of trash and only when
        the filesystem keeps ``min_free_bytes`` free with the trash still on it: the store limit
        counts committed and reserved bytes (retired ones are neither), and the free-space floor
        then holds on the disk itself. Deleting the trash after the lock (before the staging exists, the disk then
        never holds more than committed + reserved bytes) lets other publications take the lock
        meanwhile instead of queueing behind a directory fsync.

        When the request does not fit even after eviction but publications in flight hold
        reservations (their bytes will be committed, and become evictable once unused, or be
        returned), it waits up to ``wait_timeout`` for a reservation to end or an artifact's last
        lease to be released and tries again, in arrival order (``signal_room``; a request that
        arrives while others wait queues behind them first); then the typed capacity error. With
        nothing in flight it waits at most ``LEASE_GRACE_S`` in all, retrying at each last-lease release
        within it (every artifact may be leased for a moment by clients that are about to let go,
        and under churn another client may lease the released one before the retry).
        Requests that can never fit (``ArtifactTooLarge``, larger than the whole store,
        ``ExceedsFilesystem``) fail at once.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, wait_timeout)
        turn = asyncio.Event()  # our place in the room queue (signal_room), once a try failed
        queued = False
        grace_ends: float | None = None  # set at the first try that failed with nothing in flight
        try:
            if self._room_waiters and len(self.reservations) and deadline > loop.time():
                # Others wait for room already (and a reservation in flight will wake them):
                # queue behind them instead of a try that would only find the room taken.
                self._room_waiters.append(turn)
                queued = True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(turn.wait(), deadline - loop.time())
            while True:
                turn.clear()  # before the try: a wake-up that lands during it is kept for the wait
                async with self.lock:
                    usage = await self.usage()
                    shortfall = assess(self.policy, usage, need, key=key)
                    if shortfall:
                        on_disk_free = usage.free_bytes  # with the retired bytes still on the disk
                        # Only retire (defer) and evict nothing unless the request then fits.
                        report = await self.evictor.round(shortfall, {key}, require_fit=True, defer=True,
                                                          explain=False)
                        # Sound without re-reading the disk: nothing but eviction (under this lock)
                        # takes bytes out of the snapshot, and the retired bytes are purged before
                        # this publication's staging is created (after the lock, below).
                        usage = replace(usage, committed_bytes=usage.committed_bytes - report.freed_bytes,
                                        free_bytes=usage.free_bytes + report.freed_bytes)
                        if assess(self.policy, usage, need, key=key):
                            await self.purger.purge(report.trash)  # nothing will stand in for it: free it now
                            report.trash = []
                            usage = await self.usage()
                        if assess(self.policy, usage, need, key=key):
                            error = shortfall_error(self.policy, usage, need, key)
                            in_flight = len(self.reservations)
                        else:
                            reservation = self.reservations.add(key, need)
                            break
                    else:
                        return self.reservations.add(key, need), [], False
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise error
                if not in_flight:
                    # Nothing in flight will free room, but an artifact's last lease may be a
                    # moment from its release (which signals the queue): wait for releases,
                    # briefly, instead of failing a publication on a lease's round trip. The
                    # grace bounds the whole wait, not one wake-up: a client leasing the released
                    # artifact again before this retry must not end it early.
                    if grace_ends is None:
                        grace_ends = loop.time() + LEASE_GRACE_S
                    remaining = min(remaining, grace_ends - loop.time())
                    if remaining <= 0:
                        raise error
                if not queued:
                    self._room_waiters.append(turn)
                    queued = True
                try:
                    await asyncio.wait_for(turn.wait(), remaining)
                except TimeoutError:
                    raise error from None
        finally:
            if queued:
                self._room_waiters.remove(turn)
                self.signal_room()  # pass it on: room may be left, or this one absorbed a wake-up
        # The reservation stands in for the retired artifacts' bytes (they were taken out of the
        # committed count); the caller deletes them before its staging exists, or after its
        # commit when the disk's floor holds with them on it (see the docstring), so other
        # publications take the lock meanwhile instead of queueing behind a directory fsync.
        late = bool(report.trash) and report.freed_bytes <= self.PURGE_AFTER_COMMIT_MAX_BYTES and (
            on_disk_free - usage.unallocated_reserved_bytes - need >= self.policy.min_free_bytes)
        return reservation, report.trash, late

    # ------------------------------------------------------------------ by hand
    async def evict(self, key: str) -> int:
        """Evict ``key`` by hand; ``ActiveLease`` (details.reason) when anything uses it."""
        async with self.lock:
            return await self.evictor.evict(key)

    async def collect_garbage(self, target_bytes: int | None) -> tuple[EvictionReport, int, int, int]:
        """Evict LRU unused artifacts down to ``target_bytes`` (default: the configured limits):
        (report, committed bytes after, target, stale stagings reclaimed)."""
        async with self.lock:
            staging = await asyncio.to_thread(self._store.reclaim_stale_staging)
            usage = await self.usage()
            target = target_bytes if target_bytes is not None else (
                self.policy.store_limit_bytes or usage.committed_bytes + usage.reserved_bytes)
            shortfall = max(0, usage.committed_bytes + usage.reserved_bytes - target,
                            self.policy.min_free_bytes - usage.free_bytes)
            report = await self.evictor.round(shortfall) if shortfall else EvictionReport()
            usage = await self.usage()
            return report, usage.committed_bytes, target, staging

    def close(self) -> None:
        """Wait for the deletions of retired bytes handed over so far; idempotent."""
        self.purger.close()
