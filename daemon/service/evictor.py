"""LRU eviction: rounds that free a shortfall, and the removal of one artifact by hand.

One round (``Evictor.round``; the caller, ``hwr.daemon.service.capacity.Capacity``, holds its
capacity lock)::

    1. candidates = artifacts that are not leased, pinned, a channel's, held (journal),
       publishing or denied
    2. mark them EVICTING: an Acquire of a marked key waits until the round ends
       (``Catalog.record_settled`` waits on ``settled``)
    3. scan /proc/*/maps once for their payload (dev, inode)s, off the event loop; skipped for
       keys never leased (nobody can map them) and for keys a scan found unmapped that nobody
       acquired since (``MappingScan``)
    4. plan = LRU candidates not mapped, until the shortfall is covered (``policy.eviction``)
    5. remove the planned keys (no lease can have appeared: step 2), unmark everything. With
       ``defer`` (a publication's reservation) the keys are only *retired* (renamed into tmp/
       trash, on the loop) and the trash returned in the report; ``Capacity`` purges it
       (``Capacity.reserve`` says when); the trash never leaves ``hwr.daemon.service.capacity``.

Because a lease is the only way to obtain a descriptor, and step 2 blocks new leases before the
scan, a mapping that the scan did not see cannot appear before the removal. Denied artifacts are
never evicted automatically (an operator may want to inspect them); ``evict`` removes them.

Contract: on the daemon's event loop only; blocking store work runs in worker threads. The
records come from the read API (``hwr.daemon.service.catalog``); only the removals
(``Retirement.retire``/``Store.remove``) are direct store calls. The marks (``EvictionMarks``: ``evicting``
and ``settled``, shared with the read API, which waits on them) need no lock (one thread); each
round and each ``evict`` runs under the capacity lock, which the caller holds, so rounds never
overlap. ``settled`` is replaced at the end of every round: a waiter waits on the event it read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from hwr.client.errors import ActiveLease, ArtifactNotFound
from hwr.daemon.policy.eviction import Candidate, Plan, plan

if TYPE_CHECKING:
    from hwr.daemon.policy.capacity import Reservations
    from hwr.daemon.service.catalog import Catalog
    from hwr.daemon.service.eviction_marks import EvictionMarks
    from hwr.daemon.service.lease_journal import LeaseHolds
    from hwr.daemon.service.mapping_scan import MappingScan, PayloadFiles
    from hwr.daemon.service.pinning import PinSet
    from hwr.daemon.service.purger import Purger
    from hwr.daemon.service.recency import Recency
    from hwr.daemon.service.sessions import Registry
    from hwr.daemon.store.inspection import ArtifactRecord
    from hwr.daemon.store.root import Store

__all__ = ["EvictionReport", "Evictor"]

log = logging.getLogger("hwrd.store")


@dataclass
class EvictionReport:
    evicted: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    trash: list[Path] = field(default_factory=list)  # retired, not yet purged (``defer``)
    skipped: list[tuple[str, str]] = field(default_factory=list)


class Evictor:
    """Eviction rounds and manual eviction over one store (see the module contract).

    ``reservations``: the capacity's ledger; a key reserved by a publication (from its admission
    until it is finished, its build included) is never an eviction candidate.
    ``protected(key)``: True while a channel needs ``key`` (``Channels.protects``; given by the
    service graph, none by default).
    """

    def __init__(self, store: Store, catalog: Catalog, marks: EvictionMarks, registry: Registry, recency: Recency,
                 holds: LeaseHolds, scan: MappingScan, pins: PinSet, purger: Purger,
                 reservations: Reservations, *, protected: Callable[[str], bool] | None = None,
                 on_evict: Callable[[str], None] | None = None) -> None:
        self.store = store  # removals and the usage rescan; records come from ``catalog``
        self.catalog = catalog
        self.marks = marks
        self.registry = registry
        self.recency = recency
        self.holds = holds
        self.scan = scan
        self.pins = pins
        self.purger = purger
        self.reservations = reservations
        self.on_evict = on_evict  # metrics hook: reason is a fixed word
        self.protected: Callable[[str], bool] = protected or _nothing_protected
        self.evictions = 0

    def is_busy(self, key: str) -> bool:
        """Being evicted, or reserved by a publication (admitted and not yet finished): never
        an eviction candidate."""
        return key in self.marks.evicting or self.reservations.holds(key)

    def flags(self, key: str, size: int, default_access: float) -> Candidate:
        busy = self.is_busy(key)
        return Candidate(key=key, size_bytes=size, last_access=self.recency.last_use(key, default_access),
                         leased=self.registry.lease_count(key) > 0, pinned=key in self.pins,
                         channel=self.protected(key), held=bool(self.holds.held_pids(key)), busy=busy)

    async def round(self, shortfall: int, exclude: set[str] = frozenset(),  # type: ignore[assignment]
                    *, require_fit: bool = False, defer: bool = False, explain: bool = True) -> EvictionReport:
        """One eviction round (see the module docstring). ``defer``: only retire the chosen
        artifacts (renamed out of ``artifacts/``, bytes still on disk) and return their trash in
        the report; the caller (``Capacity``) purges it before anything else uses those bytes.
        ``explain=False``: pinned, leased and busy artifacts are passed over without a
        ``Candidate`` and left out of ``report.skipped`` (a publication's round needs no
        report; under churn it walked past every pinned artifact at each try)."""
        report = EvictionReport()
        # Walk the artifacts in LRU order (``LruIndex``: popped lazily, put back at the end) and
        # flag only the prefix that can matter: ``plan`` stops at the first prefix of evictable
        # bytes covering the shortfall, so nothing past it is chosen or reported. Cost per
        # round: the entries walked, not a sort (and Candidate objects) of every artifact.
        pins, lease_count, is_busy, protected = self.pins, self.registry.lease_count, self.is_busy, self.protected
        lru = self.recency.lru
        self.recency.sync()
        walk = lru.pop_in_order()
        popped: list[tuple[float, str]] = []
        records: dict[str, ArtifactRecord] = {}
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
                    record = self.catalog.listed_record(key)
                    if record is None:  # removed or denied since: it comes back through Recency.sync
                        lru.forget(key)
                        continue
                    if key in exclude or (not explain and (key in pins or is_busy(key) or lease_count(key)
                                                           or protected(key))):
                        continue
                    records[key] = record
                    size = record.size_bytes
                    c = self.flags(key, size, last)
                    candidates.append(c)
                    if not any((c.leased, c.pinned, c.held, c.busy)):
                        free.add(key)
                        batch.append(key)
                        covered += size
                if not batch:
                    break
                self.marks.evicting |= set(batch)
                mapped.update(await self.scan.mapped([records[key] for key in batch]))
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
                if self.protected(key):  # likewise: a channel's set waits out a round that marked its key
                    report.skipped.append((key, "channel"))
                    continue
                keys.append(key)
            # Each key counts as freed only once removed. Retiring (``defer``: a flock and a rename
            # per key, no fsync) runs inline for the reason given in ``Capacity.usage``; the
            # key locks it takes are free (publications of these keys are excluded as busy) except
            # in the rare instant a verify quarantines one. Full removal (fsync + delete) takes a
            # thread.
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
                await self.purger.purge(report.trash)
                raise failure
        finally:
            walk.close()
            lru.restore(popped)
            self.marks.evicting -= free
            self.marks.settle()
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
                        trash.append(self.store.retirement.retire(key))
                    else:
                        self.store.remove(key)
                done.append(key)
        except Exception as exc:  # re-raised on the loop once the removed keys are accounted
            return done, trash, exc
        return done, trash, None

    async def _remove(self, key: str, reason: str = "capacity") -> None:
        with contextlib.suppress(ArtifactNotFound):
            await asyncio.to_thread(self.store.remove, key)
        self._forget_removed(key, reason)

    def _forget_removed(self, key: str, reason: str = "capacity") -> None:
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(reason)
        self.recency.forget(key)
        self.holds.forget(key)
        self.scan.forget(key)

    async def evict(self, key: str) -> int:
        """Evict ``key`` by hand (the caller holds the capacity lock); ``ActiveLease``
        (details.reason) when anything uses it."""
        sizes = await asyncio.to_thread(self.store.rescan_usage)
        if key not in sizes:
            raise ArtifactNotFound("no artifact with that key", details={"key": key})
        c = self.flags(key, sizes[key], 0.0)
        if c.leased:
            pids = sorted({x.pid for x in self.registry.leases() if x.key == key})
            raise ActiveLease(f"artifact {key[:16]} is leased by pid(s) {pids}",
                              details={"key": key, "reason": "leased", "pids": ",".join(map(str, pids))})
        if c.pinned:
            raise ActiveLease(f"artifact {key[:16]} is pinned; unpin it first",
                              details={"key": key, "reason": "pinned"})
        if c.channel:
            raise ActiveLease(f"artifact {key[:16]} is what a channel points to (or falls back to); "
                              "point the channel elsewhere or remove it first",
                              details={"key": key, "reason": "channel"})
        if c.held:
            pids = self.holds.held_pids(key)
            raise ActiveLease(f"artifact {key[:16]} is held by pid(s) {pids} (leased before a restart)",
                              details={"key": key, "reason": "held", "pids": ",".join(map(str, pids))})
        if c.busy:
            raise ActiveLease(f"artifact {key[:16]} is being published or evicted",
                              details={"key": key, "reason": "publishing"})
        self.marks.evicting.add(key)
        try:
            record = await asyncio.to_thread(self._record_any, key)
            mapped = await self.scan.mapped([record]) if record is not None else {}
            if mapped.get(key):
                pids = sorted(mapped[key])
                raise ActiveLease(f"artifact {key[:16]} is mapped by pid(s) {pids} (no lease)",
                                  details={"key": key, "reason": "mapped", "pids": ",".join(map(str, pids))})
            await self._remove(key, "manual")
        finally:
            self.marks.evicting.discard(key)
            self.marks.settle()
        return sizes[key]

    def _record_any(self, key: str) -> PayloadFiles:
        """The validated record, or a fresh inspection of a denied artifact (for its inodes)."""
        record = self.catalog.inspected(key)
        return record if record is not None else _FilesOnly(key, self.store.root / "artifacts" / key)


def _nothing_protected(key: str) -> bool:
    return False


@dataclass(frozen=True)
class _FileId:
    path: str
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
                    files.append(_FileId(str(path / name), st.st_dev, st.st_ino))
        self.files = tuple(files)
