"""The store as a node service: capacity, LRU eviction, pins, restart recovery, admission, scrub.

``StoreService`` glues the pure policies (``capacity``, ``eviction``, ``admission``) to the
adapters (``mappings``, ``pins``, ``lease_journal``, the ``Store``) on the daemon's event loop.

Eviction protocol (one round, under the capacity lock)::

    1. candidates = artifacts that are not leased, pinned, held (journal), publishing or denied
    2. mark them EVICTING: an Acquire of a marked key waits until the round ends (``lookup``)
    3. scan /proc/*/maps once for their payload (dev, inode)s, off the event loop; skipped for
       keys never leased (nobody can map them) and for keys a scan found unmapped that nobody
       acquired since (per-key lease generation, ``UNMAPPED_TTL_S``): see ``_needs_scan``
    4. plan = LRU candidates not mapped, until the shortfall is covered
    5. remove the planned keys (no lease can have appeared: step 2), unmark everything. For a
       publication's reservation the keys are only *retired* (renamed into tmp/ trash, on the
       loop) under the lock; the reservation stands in for their bytes and the publication
       deletes them after the lock, so other publications do not queue behind a directory
       fsync: before its staging exists (the disk then never holds more than committed +
       reserved bytes), or, for a little trash on a disk that keeps its free-space floor with
       it, after its own commit's ``artifacts/`` fsync (``StoreService.reserve``).

Usage snapshots read the reservations before the disk (see ``usage``): the other order missed a
commit landing in between and let concurrent publications overshoot the store limit.

Because a lease is the only way to obtain a descriptor, and step 2 blocks new leases before the
scan, a mapping that the scan did not see cannot appear before the removal. Denied artifacts are
never evicted automatically (an operator may want to inspect them); ``hwrctl evict`` removes them.

Restart recovery: the lease journal's recovered holds (processes that leased before the restart
and are still the same live process) make their keys *held* until the process exits or acquires
the key again from a new session; the mappings scan backs this up for processes that never
leased through this daemon instance. LRU access times live in ``<root>/access.json``, written at
most every housekeeping tick and at stop (after a SIGKILL the order of the last few seconds may be
lost; it only changes which unused artifact goes first).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hwr.client.errors import ActiveLease, ArtifactNotFound, HwrError, InvalidRequest
from hwr.daemon.policy.admission import Admission, overdue
from hwr.daemon.policy.capacity import CapacityPolicy, Reservation, Reservations, Usage, assess, shortfall_error
from hwr.daemon.policy.eviction import Candidate, Plan, plan
from hwr.daemon.policy.lru import LruIndex
from hwr.daemon.service.access_times import AccessTimes
from hwr.daemon.service.lease_journal import Hold, LeaseJournal, process_start, same_process
from hwr.daemon.service.pins import PinSet, Residency
from hwr.daemon.service.sessions import LeaseRecord, Registry
from hwr.daemon.store.staging import plan_payloads
from hwr.daemon.system import mappings

__all__ = ["AccessTimes", "EvictionReport", "StoreService", "Ticket"]

log = logging.getLogger("hwrd.store")
_HEX = frozenset("0123456789abcdef")


@dataclass
class Ticket:
    key: str
    took_slot: bool
    reservation: Reservation
    #: Artifacts retired to make room, still on disk: the publication must ``purge_sync`` them
    #: before it creates its staging (``hwr.daemon.service.publications`` does both in one worker hop),
    #: or, when ``purge_after_commit``, delete them after its commit (see ``reserve``).
    trash: list[Path] = field(default_factory=list)
    purge_after_commit: bool = False

    def take_trash(self) -> list[Path]:
        """The trash not yet deleted, handed over once (the next call returns an empty list)."""
        trash, self.trash = self.trash, []
        return trash


@dataclass
class EvictionReport:
    evicted: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    trash: list[Path] = field(default_factory=list)  # retired, not yet purged (``defer``)
    skipped: list[tuple[str, str]] = field(default_factory=list)


class StoreService:
    def __init__(self, config: Any, store: Any, registry: Registry) -> None:
        self.config = config
        self.store = store
        self.registry = registry
        root = Path(store.root)
        self.policy = CapacityPolicy(config.store_limit_bytes, config.artifact_limit_bytes, config.min_free_bytes)
        self.on_evict: Callable[[str], None] | None = None  # metrics hook: reason is a fixed word
        self.reservations = Reservations()
        self.admission = Admission(serialized=config.serialized_admission)
        self.pins = PinSet.open(root)
        self.residency = Residency(config.mlock_budget_bytes)
        self.journal = LeaseJournal.open(root / "leases.journal")
        self.holds: list[Hold] = list(self.journal.recovered)
        self.access = AccessTimes(root / "access.json")
        self.lru = LruIndex()  # the artifacts by last use (or creation): see _sync_lru
        self.publications: Any = None
        self.evicting: set[str] = set()
        self.evictions = 0
        self.cancelled_publications = 0
        self.scrubbed = 0
        self._settled = asyncio.Event()
        self._capacity_lock = asyncio.Lock()
        # Publications waiting for room, oldest first (see reserve and _signal_room).
        self._room_waiters: collections.deque[asyncio.Event] = collections.deque()
        self._pin_lock = asyncio.Lock()
        self._starts: dict[str, int] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.maps_reader: Callable[[int], bytes] | None = None  # tests inject EACCES here
        # Mapping-scan cache (see _mapped): key -> lease generation bumped at every acquire, and
        # key -> (generation, monotonic time) of the last scan that found nobody mapping it.
        self._lease_gen: dict[str, int] = {}
        self._unmapped_at: dict[str, tuple[int, float]] = {}
        self.scans = 0  # /proc scans run (a benchmark/diagnostic counter)
        # Purges (directory fsync + delete) run here, not in the loop's default executor, where
        # threads stuck in fsync would make every acquire's lookup hop wait for a free worker.
        self._purge_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="hwr-purge")
        registry.observers.append(self._on_lease)
        if self.holds:
            log.info("recovered %d lease holds of live processes from before the restart", len(self.holds))

    # ------------------------------------------------------------------ lifecycle
    async def start(self, publications: Any) -> None:
        self.publications = publications
        self._tasks.append(asyncio.get_running_loop().create_task(self._housekeeping()))
        if self.pins.keys():
            self._tasks.append(asyncio.get_running_loop().create_task(self._restore_pins()))
        if self.config.scrub_bandwidth_mib_s > 0:
            self._tasks.append(asyncio.get_running_loop().create_task(self._scrub_loop()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.access.flush()
        self.journal.close()
        await asyncio.to_thread(self.residency.close)
        self._purge_pool.shutdown(wait=True)

    async def _restore_pins(self) -> None:
        for key in sorted(self.pins.keys()):
            try:
                await self._hold_resident(key)
            except HwrError as exc:
                log.warning("pinned artifact %s cannot be made resident: %s", key, exc)

    async def _housekeeping(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.config.housekeeping_interval_s)
            try:
                self.prune_holds()
                snapshot = self.access.snapshot()  # encoded here (on the loop, O(keys) but fast);
                if snapshot is not None:           # written in a thread
                    await asyncio.to_thread(self.access.write, snapshot)
                # Also without eviction pressure (no limit: no rounds), so the store's list of
                # added keys never grows with every commit of a months-long run.
                self._sync_lru()
                if self.publications is not None:
                    from hwr.daemon.service.publications import PubState

                    staged = [(p.publication_id, p.started_at) for p in self.publications.active()
                              if p.state is PubState.STAGED and p.started_at]
                    for pub_id in overdue(staged, loop.time(), self.config.publication_deadline_s):
                        if await self.publications.cancel(
                                pub_id, f"stalled past the {self.config.publication_deadline_s:g} s deadline"):
                            self.cancelled_publications += 1
                            log.warning("cancelled stalled publication %s", pub_id)
                    await self._bound_staging()
                # Last, so a failing listing cannot skip the deadline checks above.
                await asyncio.to_thread(self.store.rescan_usage)  # changes behind the daemon's back
            except Exception:
                log.exception("housekeeping failed")

    async def _bound_staging(self) -> None:
        """Cancel staged publications whose files grew past their plan, and take back the
        blocks of discarded stagings a writer still holds (``hwr.daemon.store.staging_bounds``)."""
        from hwr.daemon.store.staging_bounds import overgrown

        assert self.publications is not None
        for pub_id in await asyncio.to_thread(overgrown, self.publications.active()):
            if await self.publications.cancel(pub_id, "its staging grew past its reservation"):
                self.cancelled_publications += 1
                log.warning("cancelled publication %s: its staging grew past its reservation", pub_id)
        await asyncio.to_thread(self.store.reaper.sweep)

    # ------------------------------------------------------------------ leases, holds, access
    def _on_lease(self, event: str, lease: LeaseRecord) -> None:
        try:
            if event == "acquire":
                # Before the descriptor leaves: a cached "nobody maps it" is void from now on.
                self._lease_gen[lease.key] = self._lease_gen.get(lease.key, 0) + 1
                start = self._starts.get(lease.session_id)
                if start is None:
                    if len(self._starts) > 65536:
                        self._starts.clear()
                    start = process_start(lease.pid) or 0
                    self._starts[lease.session_id] = start
                self.journal.acquired(lease.lease_id, lease.key, lease.pid, start, lease.uid)
                self._reattach(lease.key, lease.pid)
            else:
                self.journal.released(lease.lease_id)
                if not self.registry.lease_count(lease.key):  # only now can it be evicted
                    self._signal_room()
            self._touch(lease.key)
        except OSError as exc:
            log.error("lease journal write failed: %s", exc)

    def _touch(self, key: str) -> None:
        now = time.time()
        self.access.touch(key, now)
        self.lru.note(key, now)

    def _sync_lru(self) -> None:
        """Note the artifacts validated since the last call (all of them at the first) in the
        LRU index, at their recorded last use or else their creation time."""
        for key in self.store.take_added():
            record = self.store.listed(key)
            if record is not None:
                self.lru.note(key, self.access.get(key, record.created_at))

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

    def prune_holds(self) -> None:
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

    # ------------------------------------------------------------------ acquire gate
    def lookup_now(self, key: str) -> Any:
        """The cached validated record when ``key`` can be leased right now without waiting or
        touching the disk (``Store.cached``), else None: then await ``lookup``."""
        return None if key in self.evicting else self.store.cached(key)

    async def lookup(self, key: str) -> Any:
        """``Store.lookup`` that waits while ``key`` is being evicted. No await follows the final
        check, so the caller's ``add_lease`` runs before any later eviction round can mark it."""
        record = await asyncio.to_thread(self.store.lookup, key)
        while key in self.evicting:
            await self._settled.wait()
            record = await asyncio.to_thread(self.store.lookup, key)
        return record

    # ------------------------------------------------------------------ publication gate
    async def admit(self, key: str, specs: Sequence[Any], wait_timeout: float) -> Ticket:
        need = sum(p.size for p in plan_payloads(list(specs)))
        took = await self.admission.enter(key, wait_timeout)
        try:
            reservation, trash, late = await self.reserve(key, need, wait_timeout)
        except BaseException:
            self.admission.leave(took)
            raise
        return Ticket(key, took, reservation, trash, late)

    def purge_sync(self, trash: list[Path]) -> None:
        """Delete retired artifacts' bytes now, in the calling (worker) thread (one directory
        fsync at most for the lot: ``Store.delete_retired``)."""
        self.store.delete_retired(trash)

    def allocated(self, ticket: Ticket) -> None:
        self.reservations.mark_allocated(ticket.reservation)

    def finished(self, ticket: Ticket, committed: bool) -> None:
        trash = ticket.take_trash()  # not deleted by the commit (it failed, or was aborted)
        if trash:
            try:
                future = self._purge_pool.submit(self.purge_sync, trash)
            except RuntimeError:  # the pool is shut down (daemon stopping): the next start wipes tmp/
                log.info("leaving %d retired artifacts in tmp/ for the next start", len(trash))
            else:
                future.add_done_callback(_log_purge_failure)
        self.reservations.drop(ticket.reservation)
        self.admission.leave(ticket.took_slot)
        ticket.took_slot = False
        if committed:
            self._touch(ticket.key)
        self._signal_room()

    def _signal_room(self) -> None:
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

        The committed bytes are the store's in-memory accounting (``Store.committed_bytes``:
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
        committed, free = self._disk_usage()
        return Usage(committed, reserved, unallocated, free)

    def _disk_usage(self) -> tuple[int, int]:
        committed = self.store.committed_bytes()
        st = os.statvfs(self.store.root)
        return committed, st.f_bavail * st.f_frsize

    #: Retired bytes a publication may leave on disk until its commit (``reserve``).
    PURGE_AFTER_COMMIT_MAX_BYTES = 64 << 20

    async def reserve(self, key: str, need: int, wait_timeout: float = 0.0) -> tuple[Reservation, list[Path], bool]:
        """Reserve ``need`` bytes for a publication of ``key``, evicting LRU artifacts if needed:
        (reservation, trash, purge_after_commit). The evicted artifacts are only retired here and
        their trash returned; the caller must ``purge_sync`` it before it writes anything (in the
        same worker hop as its staging), or, when ``purge_after_commit`` is True, may instead
        delete it once its commit's ``artifacts/`` fsync made the retirement durable
        (``Store.delete_retired``: saves a directory fsync). That is allowed only for at most
        ``PURGE_AFTER_COMMIT_MAX_BYTES`` of trash and only when the filesystem keeps
        ``min_free_bytes`` free with the trash still on it: the store limit counts committed and
        reserved bytes (retired ones are neither), and the free-space floor then holds on the
        disk itself.

        When the request does not fit even after eviction but publications in flight hold
        reservations (their bytes will be committed, and become evictable once unused, or be
        returned), it waits up to ``wait_timeout`` for a reservation to end or an artifact's last
        lease to be released and tries again, in arrival order (``_signal_room``; a request that
        arrives while others wait queues behind them first); then the typed capacity error.
        Requests that can never fit (``ArtifactTooLarge``, larger than the whole store) fail at
        once.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, wait_timeout)
        turn = asyncio.Event()  # our place in the room queue (_signal_room), once a try failed
        queued = False
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
                async with self._capacity_lock:
                    usage = await self.usage()
                    shortfall = assess(self.policy, usage, need, key=key)
                    if shortfall:
                        on_disk_free = usage.free_bytes  # with the retired bytes still on the disk
                        report = await self._evict_round(shortfall, exclude={key}, require_fit=True, defer=True,
                                                         explain=False)
                        # Sound without re-reading the disk: nothing but eviction (under this lock)
                        # takes bytes out of the snapshot, and the retired bytes are purged before
                        # this publication's staging is created (after the lock, below).
                        usage = replace(usage, committed_bytes=usage.committed_bytes - report.freed_bytes,
                                        free_bytes=usage.free_bytes + report.freed_bytes)
                        if assess(self.policy, usage, need, key=key):
                            await self._purge(report.trash)  # nothing will stand in for it: free it now
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
                if not in_flight or remaining <= 0:
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
                self._signal_room()  # pass it on: room may be left, or this one absorbed a wake-up
        # The reservation stands in for the retired artifacts' bytes (they were taken out of the
        # committed count); the caller deletes them before its staging exists, or after its
        # commit when the disk's floor holds with them on it (see the docstring), so other
        # publications take the lock meanwhile instead of queueing behind a directory fsync.
        late = bool(report.trash) and report.freed_bytes <= self.PURGE_AFTER_COMMIT_MAX_BYTES and (
            on_disk_free - usage.unallocated_reserved_bytes - need >= self.policy.min_free_bytes)
        return reservation, report.trash, late

    # ------------------------------------------------------------------ eviction
    def _is_busy(self, key: str) -> bool:
        """Being evicted, reserved or published: never an eviction candidate."""
        return key in self.evicting or self.reservations.holds(key) or (
            self.publications is not None and self.publications.building(key))

    def _flags(self, key: str, size: int, default_access: float) -> Candidate:
        busy = self._is_busy(key)
        return Candidate(key=key, size_bytes=size, last_access=self.access.get(key, default_access),
                         leased=self.registry.lease_count(key) > 0, pinned=key in self.pins,
                         held=bool(self.held_pids(key)), busy=busy)

    #: How long a scan's "nobody maps it" stands for a key that nobody leased since.
    UNMAPPED_TTL_S = 2.0

    def _needs_scan(self, key: str, now: float) -> bool:
        """False when ``key`` provably has no mapping outside the daemon, without a /proc scan.

        Committed payloads reach another process only through a lease: a staging file's writer is
        proven gone at commit (``hwr.daemon.system.exclusive``) and the store is private to the daemon's
        user. So a key the journal never saw leased (no lessee uid, which also means no hold;
        kept across restarts and dropped only when the artifact goes) is mapped by nobody, and a
        key that a scan found unmapped stays so until its next acquire (the generation the
        ``acquire`` observer bumps before the descriptor is sent). The cached answer expires after
        ``UNMAPPED_TTL_S`` anyway, bounding the documented limit of a process that still held an
        unmapped descriptor of an earlier lease.
        """
        if not self.journal.lessee_uids(key):
            return False
        cached = self._unmapped_at.get(key)
        return cached is None or cached[0] != self._lease_gen.get(key, 0) or now - cached[1] > self.UNMAPPED_TTL_S

    async def _mapped(self, records: list[Any]) -> dict[str, set[int]]:
        """key -> pids that map (or, unreadable, possibly map) one of its payloads."""
        now = time.monotonic()
        records = [r for r in records if self._needs_scan(r.key, now)]
        if not records:
            return {}
        generations = {r.key: self._lease_gen.get(r.key, 0) for r in records}  # before the scan
        by_file = {(fp.device, fp.inode): r.key for r in records for fp in r.files}
        self.scans += 1
        result = await asyncio.to_thread(mappings.scan, list(by_file), skip_pids={os.getpid()},
                                         reader=self.maps_reader)
        out = self._attribute(records, by_file, result)
        if len(self._unmapped_at) > 65536:
            self._unmapped_at.clear()
        for key, generation in generations.items():
            if key in out:
                self._unmapped_at.pop(key, None)
            else:
                self._unmapped_at[key] = (generation, now)
        return out

    def _attribute(self, records: list[Any], by_file: dict[Any, str], result: Any) -> dict[str, set[int]]:
        out: dict[str, set[int]] = {}
        for fid, pids in result.mapped.items():
            out.setdefault(by_file[fid], set()).update(pids)
        euid = os.geteuid()
        for pid, uid in result.unreadable.items():
            for record in records:
                # Policy for a process whose maps we may not read (see hwr.daemon.system.mappings): it
                # may map an artifact its uid ever leased. A process of the daemon's own uid that
                # is unreadable is more privileged (non-dumpable, another user namespace, init):
                # it cannot be a worker that received descriptors, unless it holds a journal hold.
                foreign = uid is not None and uid != euid and uid in self.journal.lessee_uids(record.key)
                if foreign or pid in self.held_pids(record.key):
                    out.setdefault(record.key, set()).add(pid)
        return out

    async def _evict_round(self, shortfall: int, exclude: set[str] = frozenset(),  # type: ignore[assignment]
                           *, require_fit: bool = False, defer: bool = False,
                           explain: bool = True) -> EvictionReport:
        """One eviction round (see the module docstring). ``defer``: only retire the chosen
        artifacts (renamed out of ``artifacts/``, bytes still on disk) and return their trash in
        the report; the caller must ``_purge`` it before anything else uses those bytes.
        ``explain=False``: pinned, leased and busy artifacts are passed over without a
        ``Candidate`` and left out of ``report.skipped`` (a publication's round needs no
        report; under churn it walked past every pinned artifact at each try)."""
        report = EvictionReport()
        # Walk the artifacts in LRU order (``LruIndex``: popped lazily, put back at the end) and
        # flag only the prefix that can matter: ``plan`` stops at the first prefix of evictable
        # bytes covering the shortfall, so nothing past it is chosen or reported. Cost per
        # round: the entries walked, not a sort (and Candidate objects) of every artifact.
        pins, lease_count, is_busy = self.pins, self.registry.lease_count, self._is_busy
        self._sync_lru()
        walk = self.lru.pop_in_order()
        popped: list[tuple[float, str]] = []
        records: dict[str, Any] = {}
        candidates: list[Candidate] = []
        free: set[str] = set()
        mapped: dict[str, set[int]] = {}
        try:
            while True:
                batch: list[str] = []
                covered = sum(c.size_bytes for c in candidates if c.key in free and c.key not in mapped)
                while covered < shortfall:
                    entry = next(walk, None)
                    if entry is None:
                        break
                    popped.append(entry)
                    last, key = entry
                    record = self.store.listed(key)
                    if record is None:  # removed or denied since: it comes back through _sync_lru
                        self.lru.forget(key)
                        continue
                    if key in exclude or (not explain and (key in pins or is_busy(key) or lease_count(key))):
                        continue
                    records[key] = record
                    size = record.size_bytes
                    c = self._flags(key, size, last)
                    candidates.append(c)
                    if not any((c.leased, c.pinned, c.held, c.busy)):
                        free.add(key)
                        batch.append(key)
                        covered += size
                if not batch:
                    break
                self.evicting |= set(batch)
                mapped.update(await self._mapped([records[key] for key in batch]))
            flagged = [replace(c, mapped=True) if c.key in mapped else c for c in candidates]
            chosen: Plan = plan(flagged, shortfall)
            report.skipped = list(chosen.skipped)
            if require_fit and not chosen.fits:
                return report  # evicting would not make the request fit: evict nothing
            sizes = {c.key: c.size_bytes for c in candidates}
            keys = []
            for key in chosen.keys:
                if self.registry.lease_count(key):  # impossible while marked; kept as a guard
                    report.skipped.append((key, "leased"))
                    continue
                if key in self.pins:  # likewise: pin() waits out a round that marked its key
                    report.skipped.append((key, "pinned"))
                    continue
                keys.append(key)
            # Each key counts as freed only once removed. Retiring (``defer``: a flock and a rename
            # per key, no fsync) runs inline for the reason given in ``usage``; the key locks it
            # takes are free (publications of these keys are excluded as busy) except in the rare
            # instant a verify quarantines one. Full removal (fsync + delete) takes a thread.
            if defer:
                removed, trash, failure = self._remove_files(keys, defer)
            else:
                removed, trash, failure = await asyncio.to_thread(self._remove_files, keys, defer)
            report.trash = trash
            for key in removed:
                self._forget_removed(key)
                report.evicted.append(key)
                report.freed_bytes += sizes[key]
            if failure is not None:
                await self._purge(report.trash)
                raise failure
        finally:
            walk.close()
            self.lru.restore(popped)
            self.evicting -= free
            self._settled.set()
            self._settled = asyncio.Event()
        if report.evicted:  # DEBUG: a round per publication under churn (counted in the metrics)
            log.debug("evicted %d artifacts (%d bytes): %s", len(report.evicted), report.freed_bytes,
                      ",".join(k[:12] for k in report.evicted))
        return report

    def _remove_files(self, keys: list[str], defer: bool) -> tuple[list[str], list[Path], BaseException | None]:
        """Remove (``defer``: retire) ``keys`` in a worker thread: the keys gone, their trash,
        and the error that stopped the batch."""
        done: list[str] = []
        trash: list[Path] = []
        try:
            for key in keys:
                with contextlib.suppress(ArtifactNotFound):
                    if defer:
                        trash.append(self.store.retire(key))
                    else:
                        self.store.remove(key)
                done.append(key)
        except Exception as exc:  # re-raised on the loop once the removed keys are accounted
            return done, trash, exc
        return done, trash, None

    async def _purge(self, trash: list[Path]) -> None:
        """Delete retired artifacts' bytes, to the end even if the caller is cancelled."""
        if not trash:
            return
        task = asyncio.get_running_loop().run_in_executor(
            self._purge_pool, self.store.delete_retired, list(trash))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await task
            raise

    async def _remove(self, key: str, reason: str = "capacity") -> None:
        with contextlib.suppress(ArtifactNotFound):
            await asyncio.to_thread(self.store.remove, key)
        self._forget_removed(key, reason)

    def _forget_removed(self, key: str, reason: str = "capacity") -> None:
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(reason)
        self.access.forget(key)
        self.lru.forget(key)
        self.journal.forget(key)
        self._unmapped_at.pop(key, None)
        self._lease_gen.pop(key, None)

    async def evict(self, key: str) -> int:
        """Evict ``key`` by hand; ``ActiveLease`` (details.reason) when anything uses it."""
        async with self._capacity_lock:
            sizes = await asyncio.to_thread(self.store.rescan_usage)
            if key not in sizes:
                raise ArtifactNotFound("no artifact with that key", details={"key": key})
            c = self._flags(key, sizes[key], 0.0)
            if c.leased:
                pids = sorted({x.pid for x in self.registry.leases() if x.key == key})
                raise ActiveLease(f"artifact {key[:16]} is leased by pid(s) {pids}",
                                  details={"key": key, "reason": "leased", "pids": ",".join(map(str, pids))})
            if c.pinned:
                raise ActiveLease(f"artifact {key[:16]} is pinned; unpin it first",
                                  details={"key": key, "reason": "pinned"})
            if c.held:
                pids = self.held_pids(key)
                raise ActiveLease(f"artifact {key[:16]} is held by pid(s) {pids} (leased before a restart)",
                                  details={"key": key, "reason": "held", "pids": ",".join(map(str, pids))})
            if c.busy:
                raise ActiveLease(f"artifact {key[:16]} is being published or evicted",
                                  details={"key": key, "reason": "publishing"})
            self.evicting.add(key)
            try:
                record = await asyncio.to_thread(self._record_any, key)
                mapped = await self._mapped([record]) if record is not None else {}
                if mapped.get(key):
                    pids = sorted(mapped[key])
                    raise ActiveLease(f"artifact {key[:16]} is mapped by pid(s) {pids} (no lease)",
                                      details={"key": key, "reason": "mapped", "pids": ",".join(map(str, pids))})
                await self._remove(key, "manual")
            finally:
                self.evicting.discard(key)
                self._settled.set()
                self._settled = asyncio.Event()
            return sizes[key]

    def _record_any(self, key: str) -> Any:
        """The validated record, or a fresh inspection of a denied artifact (for its inodes)."""
        from hwr.daemon.store.validation import inspect_artifact

        try:
            return self.store.lookup(key)
        except HwrError:
            pass
        try:
            return inspect_artifact(self.store.root / "artifacts" / key, key, self.store.euid)
        except HwrError:
            return _FilesOnly(key, self.store.root / "artifacts" / key)

    async def collect_garbage(self, target_bytes: int | None) -> tuple[EvictionReport, int, int, int]:
        """Evict LRU unused artifacts down to ``target_bytes`` (default: the configured limits)."""
        async with self._capacity_lock:
            staging = await asyncio.to_thread(self.store.reclaim_stale_staging)
            usage = await self.usage()
            target = target_bytes if target_bytes is not None else (
                self.policy.store_limit_bytes or usage.committed_bytes + usage.reserved_bytes)
            shortfall = max(0, usage.committed_bytes + usage.reserved_bytes - target,
                            self.policy.min_free_bytes - usage.free_bytes)
            report = await self._evict_round(shortfall) if shortfall else EvictionReport()
            usage = await self.usage()
            return report, usage.committed_bytes, target, staging

    # ------------------------------------------------------------------ pins
    async def _hold_resident(self, key: str, record: Any = None) -> str:
        if record is None:
            record = await asyncio.to_thread(self.store.lookup, key)

        def hold() -> str:
            fds = self.store.open_payloads(record)
            try:
                return self.residency.hold(key, [fd for _, fd in fds])
            finally:
                for _, fd in fds:
                    os.close(fd)

        async with self._pin_lock:
            return await asyncio.to_thread(hold)

    async def pin(self, key: str) -> tuple[bool, int, int, str]:
        """Pin ``key``: (already pinned, size, locked bytes, residency). The pin takes effect
        on the loop right after ``lookup``'s final check (which waits out an eviction round that
        has marked the key, so the artifact is either gone, ``ArtifactNotFound``, or present and
        unmarked), before any await: no later round can choose the key. A pin that fails
        (pins.json not written, payloads not mappable) leaves the key as it was; a cancelled
        one may stand."""
        record = await self.lookup(key)
        added = self.pins.add(key)
        try:
            if added:
                await asyncio.to_thread(self.pins.save)
            residency = await self._hold_resident(key, record)  # pinned: the record stays valid
        except Exception:  # not on cancellation: the thread still saves, so the pin stands
            if added:
                self.pins.discard(key)
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(self.pins.save)
            raise
        return (not added, record.size_bytes, self.residency.locked(key), residency)

    async def unpin(self, key: str) -> bool:
        removed = self.pins.discard(key)
        if removed:
            try:
                await asyncio.to_thread(self.pins.save)
            except OSError:
                self.pins.add(key)  # pins.json not replaced: still pinned on disk, stay pinned
                raise
        async with self._pin_lock:
            await asyncio.to_thread(self.residency.drop, key)
        return removed

    # ------------------------------------------------------------------ scrub
    async def _scrub_loop(self) -> None:
        while True:
            await asyncio.sleep(min(self.config.scrub_interval_s, 5.0) if not self.scrubbed else
                                self.config.scrub_interval_s)
            await self.scrub_once()

    async def scrub_once(self) -> list[str]:
        """Verify every artifact at the configured bandwidth cap; returns the keys found corrupt."""
        rate = self.config.scrub_bandwidth_mib_s * (1 << 20)
        bad = []
        for record in await asyncio.to_thread(self.store.artifacts):
            started = time.monotonic()

            def throttle(done: int, _total: int, started: float = started) -> None:
                # Called under the hashing lock: sleeping here paces every hashing thread.
                ahead = done / rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(min(ahead, 1.0))

            try:
                await asyncio.to_thread(self.store.verify, record.key, throttle if rate else None)
            except ArtifactNotFound:
                continue  # evicted or removed since the listing: nothing left to scrub
            except HwrError as exc:
                bad.append(record.key)
                log.error("scrub: artifact %s failed verification: %s", record.key, exc)
            self.scrubbed += 1
        return bad

    # ------------------------------------------------------------------ keys
    async def resolve(self, prefix: str) -> str:
        """A full key from a key or unique prefix, among present, denied and pinned artifacts."""
        if not 4 <= len(prefix) <= 64 or not set(prefix) <= _HEX:
            raise InvalidRequest("a key prefix needs 4 to 64 lowercase hex digits", details={"key": prefix[:80]})
        keys = await asyncio.to_thread(self.store.known_keys) | self.pins.keys()
        matches = [k for k in keys if k.startswith(prefix)]
        if not matches:
            raise ArtifactNotFound("no artifact matches that key", details={"key": prefix})
        if len(matches) > 1:
            raise InvalidRequest("ambiguous key prefix", details={"key": prefix, "matches": len(matches)})
        return matches[0]


@dataclass(frozen=True)
class _FileId:
    device: int
    inode: int


class _FilesOnly:
    """Payload inodes of an artifact directory that no longer validates (for the mapping scan)."""

    def __init__(self, key: str, path: Path) -> None:
        self.key = key
        files = []
        with contextlib.suppress(OSError):
            for name in os.listdir(path):
                with contextlib.suppress(OSError):
                    st = os.lstat(path / name)
                    files.append(_FileId(st.st_dev, st.st_ino))
        self.files = tuple(files)


def _log_purge_failure(future: concurrent.futures.Future[None]) -> None:
    exc = future.exception()
    if exc is not None:  # the bytes stay in tmp/ until the next start wipes it
        log.error("deleting retired artifacts failed: %s", exc)
