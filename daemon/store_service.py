"""The store as a node service: capacity, LRU eviction, pins, restart recovery, admission, scrub.

``StoreService`` glues the pure policies (``capacity``, ``eviction``, ``admission``) to the
adapters (``mappings``, ``pins``, ``lease_journal``, the ``Store``) on the daemon's event loop.

Eviction protocol (one round, under the capacity lock)::

    1. candidates = artifacts that are not leased, pinned, held (journal), publishing or denied
    2. mark them EVICTING: an Acquire of a marked key waits until the round ends (``lookup``)
    3. scan /proc/*/maps once for all their payload (dev, inode)s, off the event loop
    4. plan = LRU candidates not mapped, until the shortfall is covered
    5. remove the planned keys (no lease can have appeared: step 2), unmark everything

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
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hwr.client.errors import ActiveLease, ArtifactNotFound, HwrError, InvalidRequest
from hwr.daemon import mappings
from hwr.daemon.admission import Admission, overdue
from hwr.daemon.capacity import CapacityPolicy, Reservation, Reservations, Usage, assess, shortfall_error
from hwr.daemon.eviction import Candidate, Plan, plan
from hwr.daemon.lease_journal import Hold, LeaseJournal, process_start, same_process
from hwr.daemon.pins import PinSet, Residency
from hwr.daemon.sessions import LeaseRecord, Registry
from hwr.daemon.store_staging import plan_payloads

__all__ = ["AccessTimes", "EvictionReport", "StoreService", "Ticket"]

log = logging.getLogger("hwrd.store")
_HEX = frozenset("0123456789abcdef")


class AccessTimes:
    """Last use of each artifact (lease, release, commit), persisted best effort."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._times: dict[str, float] = {}
        self._dirty = False
        with contextlib.suppress(OSError, ValueError, AttributeError):
            self._times = {k: float(v) for k, v in json.loads(path.read_bytes()).get("last_access", {}).items()}

    def get(self, key: str, default: float) -> float:
        return self._times.get(key, default)

    def touch(self, key: str, now: float | None = None) -> None:
        self._times[key] = time.time() if now is None else now
        self._dirty = True

    def forget(self, key: str) -> None:
        if self._times.pop(key, None) is not None:
            self._dirty = True

    def flush(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        tmp = self.path.with_name(f".access.{uuid.uuid4().hex}.tmp")
        try:
            tmp.write_bytes(json.dumps({"schema_version": 1, "last_access": self._times}).encode())
            os.chmod(tmp, 0o600)
            os.rename(tmp, self.path)
        except OSError as exc:
            log.warning("cannot save access times: %s", exc)
            with contextlib.suppress(OSError):
                tmp.unlink()


@dataclass
class Ticket:
    key: str
    took_slot: bool
    reservation: Reservation


@dataclass
class EvictionReport:
    evicted: list[str] = field(default_factory=list)
    freed_bytes: int = 0
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
        self.publications: Any = None
        self.evicting: set[str] = set()
        self.evictions = 0
        self.cancelled_publications = 0
        self.scrubbed = 0
        self._settled = asyncio.Event()
        self._capacity_lock = asyncio.Lock()
        self._room = asyncio.Event()  # replaced after each wake-up (see _signal_room)
        self._pin_lock = asyncio.Lock()
        self._starts: dict[str, int] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.maps_reader: Callable[[int], bytes] | None = None  # tests inject EACCES here
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
                self.access.flush()
                if self.publications is not None:
                    from hwr.daemon.publications import PubState

                    staged = [(p.publication_id, p.started_at) for p in self.publications.active()
                              if p.state is PubState.STAGED and p.started_at]
                    for pub_id in overdue(staged, loop.time(), self.config.publication_deadline_s):
                        if await self.publications.cancel(
                                pub_id, f"stalled past the {self.config.publication_deadline_s:g} s deadline"):
                            self.cancelled_publications += 1
                            log.warning("cancelled stalled publication %s", pub_id)
            except Exception:
                log.exception("housekeeping failed")

    # ------------------------------------------------------------------ leases, holds, access
    def _on_lease(self, event: str, lease: LeaseRecord) -> None:
        try:
            if event == "acquire":
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
                self._signal_room()
            self.access.touch(lease.key)
        except OSError as exc:
            log.error("lease journal write failed: %s", exc)

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
            reservation = await self.reserve(key, need, wait_timeout)
        except BaseException:
            self.admission.leave(took)
            raise
        return Ticket(key, took, reservation)

    def allocated(self, ticket: Ticket) -> None:
        self.reservations.mark_allocated(ticket.reservation)

    def finished(self, ticket: Ticket, committed: bool) -> None:
        self.reservations.drop(ticket.reservation)
        self.admission.leave(ticket.took_slot)
        ticket.took_slot = False
        if committed:
            self.access.touch(ticket.key)
        self._signal_room()

    def _signal_room(self) -> None:
        """Wake publications waiting for room (a reservation ended or a lease was released)."""
        self._room.set()
        self._room = asyncio.Event()

    async def usage(self) -> Usage:
        sizes = await asyncio.to_thread(self.store.usage_by_key)
        st = await asyncio.to_thread(os.statvfs, self.store.root)
        return Usage(sum(sizes.values()), self.reservations.reserved_bytes, self.reservations.unallocated_bytes,
                     st.f_bavail * st.f_frsize)

    async def reserve(self, key: str, need: int, wait_timeout: float = 0.0) -> Reservation:
        """Reserve ``need`` bytes for a publication of ``key``, evicting LRU artifacts if needed.

        When the request does not fit even after eviction but publications in flight hold
        reservations (their bytes will be committed, and become evictable once unused, or be
        returned), it waits up to ``wait_timeout`` for a reservation to end or a lease to be
        released and tries again; then the typed capacity error. Requests that can never fit
        (``ArtifactTooLarge``, larger than the whole store) fail at once.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, wait_timeout)
        while True:
            async with self._capacity_lock:
                usage = await self.usage()
                shortfall = assess(self.policy, usage, need, key=key)
                if shortfall:
                    await self._evict_round(shortfall, exclude={key}, require_fit=True)
                    usage = await self.usage()
                    if assess(self.policy, usage, need, key=key):
                        error = shortfall_error(self.policy, usage, need, key)
                        room, in_flight = self._room, len(self.reservations)
                    else:
                        return self.reservations.add(key, need)
                else:
                    return self.reservations.add(key, need)
            remaining = deadline - loop.time()
            if not in_flight or remaining <= 0:
                raise error
            try:
                await asyncio.wait_for(room.wait(), remaining)
            except TimeoutError:
                raise error from None

    # ------------------------------------------------------------------ eviction
    def _flags(self, key: str, size: int, default_access: float) -> Candidate:
        busy = key in self.evicting or key in self.reservations.reserved_keys() or (
            self.publications is not None and any(p.key == key for p in self.publications.active()))
        return Candidate(key=key, size_bytes=size, last_access=self.access.get(key, default_access),
                         leased=self.registry.lease_count(key) > 0, pinned=key in self.pins,
                         held=bool(self.held_pids(key)), busy=busy)

    async def _mapped(self, records: list[Any]) -> dict[str, set[int]]:
        """key -> pids that map (or, unreadable, possibly map) one of its payloads."""
        by_file = {(fp.device, fp.inode): r.key for r in records for fp in r.files}
        result = await asyncio.to_thread(mappings.scan, list(by_file), skip_pids={os.getpid()},
                                         reader=self.maps_reader)
        out: dict[str, set[int]] = {}
        for fid, pids in result.mapped.items():
            out.setdefault(by_file[fid], set()).update(pids)
        euid = os.geteuid()
        for pid, uid in result.unreadable.items():
            for record in records:
                # Policy for a process whose maps we may not read (see hwr.daemon.mappings): it
                # may map an artifact its uid ever leased. A process of the daemon's own uid that
                # is unreadable is more privileged (non-dumpable, another user namespace, init):
                # it cannot be a worker that received descriptors, unless it holds a journal hold.
                foreign = uid is not None and uid != euid and uid in self.journal.lessee_uids(record.key)
                if foreign or pid in self.held_pids(record.key):
                    out.setdefault(record.key, set()).add(pid)
        return out

    async def _evict_round(self, shortfall: int, exclude: set[str] = frozenset(),  # type: ignore[assignment]
                           *, require_fit: bool = False) -> EvictionReport:
        report = EvictionReport()
        records = [r for r in await asyncio.to_thread(self.store.artifacts) if r.key not in exclude]
        candidates = [self._flags(r.key, r.size_bytes, r.created_at) for r in records]
        free = {c.key for c in candidates if not any((c.leased, c.pinned, c.held, c.busy))}
        self.evicting |= free
        try:
            mapped = await self._mapped([r for r in records if r.key in free]) if free else {}
            flagged = [Candidate(**{**c.__dict__, "mapped": c.key in mapped}) if c.key in free else c
                       for c in candidates]
            chosen: Plan = plan(flagged, shortfall)
            report.skipped = list(chosen.skipped)
            if require_fit and not chosen.fits:
                return report  # evicting would not make the request fit: evict nothing
            sizes = {c.key: c.size_bytes for c in candidates}
            for key in chosen.keys:
                if self.registry.lease_count(key):  # impossible while marked; kept as a guard
                    report.skipped.append((key, "leased"))
                    continue
                await self._remove(key)
                report.evicted.append(key)
                report.freed_bytes += sizes[key]
        finally:
            self.evicting -= free
            self._settled.set()
            self._settled = asyncio.Event()
        if report.evicted:
            log.info("evicted %d artifacts (%d bytes): %s", len(report.evicted), report.freed_bytes,
                     ",".join(k[:12] for k in report.evicted))
        return report

    async def _remove(self, key: str, reason: str = "capacity") -> None:
        with contextlib.suppress(ArtifactNotFound):
            await asyncio.to_thread(self.store.remove, key)
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(reason)
        self.access.forget(key)
        self.journal.forget(key)

    async def evict(self, key: str) -> int:
        """Evict ``key`` by hand; ``ActiveLease`` (details.reason) when anything uses it."""
        async with self._capacity_lock:
            sizes = await asyncio.to_thread(self.store.usage_by_key)
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
        from hwr.daemon.store_validation import inspect_artifact

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
    async def _hold_resident(self, key: str) -> str:
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
        record = await asyncio.to_thread(self.store.lookup, key)
        added = await asyncio.to_thread(self.pins.add, key)
        residency = await self._hold_resident(key)
        return (not added, record.size_bytes, self.residency.locked(key), residency)

    async def unpin(self, key: str) -> bool:
        removed = await asyncio.to_thread(self.pins.discard, key)
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
