"""The store as a node service: the facade that composes capacity, eviction, pins, restart
recovery, admission, scrub and housekeeping over one ``Store``.

``StoreService`` builds one collaborator per concept, each owning its state (and its lock, where
it has one), and wires them on the daemon's event loop:

``LeaseHolds`` (``lease_holds``)    the lease journal and the holds recovered from it at a restart
``Recency`` (``recency``)           last use of each artifact and the LRU order over it
``MappingScan`` (``mapping_scan``)  who maps an artifact (/proc), with the cache that skips scans
``Purger`` (``purger``)             deletion of retired artifacts, in a pool of its own
``Evictor`` (``evictor``)           LRU eviction rounds and eviction by hand
``CapacityGate`` (``capacity_gate``) admission and capacity reservations of publications
``Pinning`` (``pinning``)           pin, unpin, residency of pinned artifacts
``Scrubber`` (``scrubber``)         background re-verification at a bandwidth cap
``Housekeeping`` (``housekeeping``) the periodic tick

The eviction gate stays here (``lookup_now``/``lookup``: an acquire of a key that an eviction round
has marked waits for the round to end); readers reach it through the read API
(``hwr.daemon.service.catalog``), which also resolves key prefixes. The lease
observer (``_on_lease``) feeds the journal, the mapping-scan cache, the LRU clock and the room
queue of waiting publications. The public methods and attributes are those callers used before
the split; most delegate.

Lock order (the daemon's event loop unless said otherwise; each lock is declared, with its own
order, in the module of its owner)::

    admission slot -> room-queue turn -> CapacityGate.lock       (capacity_gate)
    Pinning._lock                                                 (pinning; never nested with the above)
    PinSet._save_lock, AccessTimes._write_lock                    (worker threads; leaves: no lock under them)

The eviction marks (``Evictor.evicting``, ``settled``) are not a lock: ``lookup`` waits on them,
a round never waits on a lookup. The lease journal, the LRU state and the mapping-scan cache are
loop-only and unlocked. Blocking store work runs in worker threads (the loop's default executor,
and ``Purger``'s own pool) and takes only the store's own locks.

Restart recovery: the lease journal's recovered holds (processes that leased before the restart
and are still the same live process) make their keys *held* until the process exits or acquires
the key again from a new session; the mappings scan backs this up for processes that never
leased through this daemon instance. LRU access times live in ``<root>/access.json``, written at
most every housekeeping tick and at stop (after a SIGKILL the order of the last few seconds may be
lost; it only changes which unused artifact goes first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hwr.daemon.service.access_times import AccessTimes
from hwr.daemon.service.capacity_gate import CapacityGate, Ticket
from hwr.daemon.service.evictor import EvictionReport, Evictor
from hwr.daemon.service.housekeeping import Housekeeping
from hwr.daemon.service.lease_holds import LeaseHolds
from hwr.daemon.service.lease_journal import Hold, LeaseJournal
from hwr.daemon.service.mapping_scan import MappingScan
from hwr.daemon.service.pinning import Pinning
from hwr.daemon.service.pins import PinSet, Residency
from hwr.daemon.service.purger import Purger
from hwr.daemon.service.recency import Recency
from hwr.daemon.service.scrubber import Scrubber

if TYPE_CHECKING:
    import concurrent.futures

    from hwr.daemon.policy.admission import Admission
    from hwr.daemon.policy.capacity import CapacityPolicy, Reservation, Reservations, Usage
    from hwr.daemon.service.publications import Publications
    from hwr.daemon.service.sessions import LeaseRecord, Registry
    from hwr.daemon.store.inspection import ArtifactRecord
    from hwr.daemon.store.root import Store
    from hwr.daemon.store.staging import StagedTensor
    from hwr.daemon.system.config import DaemonConfig

__all__ = ["AccessTimes", "EvictionReport", "StoreService", "Ticket"]

log = logging.getLogger("hwrd.store")


class StoreService:
    """The store's node service (see the module docstring)."""

    PURGE_AFTER_COMMIT_MAX_BYTES = CapacityGate.PURGE_AFTER_COMMIT_MAX_BYTES
    UNMAPPED_TTL_S = MappingScan.UNMAPPED_TTL_S

    def __init__(self, config: DaemonConfig, store: Store, registry: Registry) -> None:
        self.config = config
        self.store = store
        self.registry = registry
        root = Path(store.root)
        self.publications: Publications | None = None
        self.pins = PinSet.open(root)
        self.residency = Residency(config.mlock_budget_bytes)
        self.lease_holds = LeaseHolds(LeaseJournal.open(root / "leases.journal"))
        self.journal = self.lease_holds.journal
        self.recency = Recency(AccessTimes(root / "access.json"), store)
        self.access = self.recency.access
        self.lru = self.recency.lru
        self.mapping_scan = MappingScan(self.lease_holds)
        self.purger = Purger(store)
        self.evictor = Evictor(store, registry, self.recency, self.lease_holds, self.mapping_scan, self.pins,
                               self.purger, in_flight=self._in_flight)
        self.gate = CapacityGate(config, store, self.recency, self.purger, make_room=self._make_room)
        self.admission: Admission = self.gate.admission
        self.pinning = Pinning(store, self.pins, self.residency, lookup=self.lookup)
        self.scrubber = Scrubber(config, store)
        self.housekeeping = Housekeeping(config, store, self.lease_holds, self.recency)
        self._tasks: list[asyncio.Task[None]] = []
        registry.observers.append(self._on_lease)

    # ------------------------------------------------------------------ lifecycle
    async def start(self, publications: Publications | None) -> None:
        self.publications = publications
        self._tasks.append(asyncio.get_running_loop().create_task(self.housekeeping.run(publications)))
        if self.pins.keys():
            self._tasks.append(asyncio.get_running_loop().create_task(self.pinning.restore()))
        if self.config.scrub_bandwidth_mib_s > 0:
            self._tasks.append(asyncio.get_running_loop().create_task(self.scrubber.run()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.access.flush()
        self.lease_holds.close()
        await self.pinning.close()
        self.purger.close()

    # ------------------------------------------------------------------ leases, holds
    def _on_lease(self, event: str, lease: LeaseRecord) -> None:
        try:
            if event == "acquire":
                # Before the descriptor leaves: a cached "nobody maps it" is void from now on.
                self.mapping_scan.leased(lease.key)
                self.lease_holds.acquired(lease)
            else:
                self.lease_holds.released(lease)
                if not self.registry.lease_count(lease.key):  # only now can it be evicted
                    self._signal_room()
            self.recency.touch(lease.key)
        except OSError as exc:
            log.error("lease journal write failed: %s", exc)

    @property
    def holds(self) -> list[Hold]:
        return self.lease_holds.holds

    @holds.setter
    def holds(self, holds: list[Hold]) -> None:
        self.lease_holds.holds = holds

    def prune_holds(self) -> None:
        """Drop holds of processes that exited (or whose pid now names another process)."""
        self.lease_holds.prune()

    def held_pids(self, key: str) -> list[int]:
        return self.lease_holds.held_pids(key)

    # ------------------------------------------------------------------ acquire gate
    def lookup_now(self, key: str) -> ArtifactRecord | None:
        """The cached validated record when ``key`` can be leased right now without waiting or
        touching the disk (``RecordCache.cached``), else None: then await ``lookup``."""
        return None if key in self.evicting else self.store.records.cached(key)

    async def lookup(self, key: str) -> ArtifactRecord:
        """``RecordCache.lookup`` that waits while ``key`` is being evicted. No await follows the final
        check, so the caller's ``add_lease`` runs before any later eviction round can mark it."""
        record = await asyncio.to_thread(self.store.records.lookup, key)
        while key in self.evicting:
            await self._settled.wait()
            record = await asyncio.to_thread(self.store.records.lookup, key)
        return record

    # ------------------------------------------------------------------ eviction marks (read by lookup)
    @property
    def evicting(self) -> set[str]:
        return self.evictor.evicting

    @evicting.setter
    def evicting(self, keys: set[str]) -> None:
        self.evictor.evicting = keys

    @property
    def _settled(self) -> asyncio.Event:
        return self.evictor.settled

    # ------------------------------------------------------------------ publication gate
    async def admit(self, key: str, specs: Sequence[StagedTensor], wait_timeout: float,
                    max_file_bytes: int | None = None) -> Ticket:
        return await self.gate.admit(key, specs, wait_timeout, max_file_bytes)

    def purge_sync(self, trash: list[Path]) -> None:
        """Delete retired artifacts' bytes now, in the calling (worker) thread (one directory
        fsync at most for the lot: ``Retirement.delete``)."""
        self.purger.purge_sync(trash)

    def allocated(self, ticket: Ticket) -> None:
        self.gate.allocated(ticket)

    def finished(self, ticket: Ticket, committed: bool) -> None:
        self.gate.finished(ticket, committed)

    def _signal_room(self) -> None:
        self.gate.signal_room()

    async def usage(self) -> Usage:
        """Committed + reserved bytes, never an undercount (``CapacityGate.usage``)."""
        return await self.gate.usage()

    async def reserve(self, key: str, need: int, wait_timeout: float = 0.0) -> tuple[Reservation, list[Path], bool]:
        """Reserve ``need`` bytes for a publication of ``key`` (``CapacityGate.reserve``)."""
        return await self.gate.reserve(key, need, wait_timeout)

    @property
    def policy(self) -> CapacityPolicy:
        return self.gate.policy

    @policy.setter
    def policy(self, policy: CapacityPolicy) -> None:  # new limits (SIGHUP): the gate reads them
        self.gate.policy = policy

    @property
    def reservations(self) -> Reservations:
        return self.gate.reservations

    @reservations.setter
    def reservations(self, reservations: Reservations) -> None:
        self.gate.reservations = reservations

    @property
    def _purge_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        return self.purger.pool

    def _in_flight(self, key: str) -> bool:
        """Reserved or being built: a publication will (re)write ``key`` (never evicted)."""
        return self.gate.reservations.holds(key) or (
            self.publications is not None and self.publications.building(key))

    async def _make_room(self, shortfall: int, key: str) -> EvictionReport:
        # Through ``_evict_round`` (looked up at each call), the round of every eviction here.
        return await self._evict_round(shortfall, exclude={key}, require_fit=True, defer=True, explain=False)

    # ------------------------------------------------------------------ eviction
    async def _evict_round(self, shortfall: int, exclude: set[str] = frozenset(),  # type: ignore[assignment]
                           *, require_fit: bool = False, defer: bool = False,
                           explain: bool = True) -> EvictionReport:
        """One eviction round (``Evictor.round``); the caller holds the capacity lock."""
        return await self.evictor.round(shortfall, exclude, require_fit=require_fit, defer=defer, explain=explain)

    async def evict(self, key: str) -> int:
        """Evict ``key`` by hand; ``ActiveLease`` (details.reason) when anything uses it."""
        async with self.gate.lock:
            return await self.evictor.evict(key)

    async def collect_garbage(self, target_bytes: int | None) -> tuple[EvictionReport, int, int, int]:
        """Evict LRU unused artifacts down to ``target_bytes`` (default: the configured limits)."""
        async with self.gate.lock:
            staging = await asyncio.to_thread(self.store.reclaim_stale_staging)
            usage = await self.usage()
            target = target_bytes if target_bytes is not None else (
                self.policy.store_limit_bytes or usage.committed_bytes + usage.reserved_bytes)
            shortfall = max(0, usage.committed_bytes + usage.reserved_bytes - target,
                            self.policy.min_free_bytes - usage.free_bytes)
            report = await self._evict_round(shortfall) if shortfall else EvictionReport()
            usage = await self.usage()
            return report, usage.committed_bytes, target, staging

    @property
    def on_evict(self) -> Callable[[str], None] | None:
        """Metrics hook, called with a fixed word (``capacity``, ``manual``) per eviction."""
        return self.evictor.on_evict

    @on_evict.setter
    def on_evict(self, hook: Callable[[str], None] | None) -> None:
        self.evictor.on_evict = hook

    @property
    def evictions(self) -> int:
        return self.evictor.evictions

    @property
    def maps_reader(self) -> Callable[[int], bytes] | None:
        return self.mapping_scan.maps_reader

    @maps_reader.setter
    def maps_reader(self, reader: Callable[[int], bytes] | None) -> None:  # tests inject EACCES here
        self.mapping_scan.maps_reader = reader

    @property
    def scans(self) -> int:
        """/proc scans run (a benchmark/diagnostic counter)."""
        return self.mapping_scan.scans

    # ------------------------------------------------------------------ pins, scrub, housekeeping
    async def pin(self, key: str) -> tuple[bool, int, int, str]:
        """Pin ``key``: (already pinned, size, locked bytes, residency) (``Pinning.pin``)."""
        return await self.pinning.pin(key)

    async def unpin(self, key: str) -> bool:
        return await self.pinning.unpin(key)

    async def scrub_once(self) -> list[str]:
        """Verify every artifact at the configured bandwidth cap; returns the keys found corrupt."""
        return await self.scrubber.scrub_once()

    @property
    def scrubbed(self) -> int:
        return self.scrubber.scrubbed

    @property
    def cancelled_publications(self) -> int:
        return self.housekeeping.cancelled_publications

