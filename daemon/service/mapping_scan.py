"""Which processes map an artifact's payloads, from one ``/proc/*/maps`` scan, with a cache.

An eviction round must not remove an artifact that some process maps. ``MappingScan.mapped``
scans every process's maps once for the payload (dev, inode)s of a batch of artifacts, off the
event loop (``hwr.daemon.system.mappings``), and attributes the hits back to keys. A process whose
maps are unreadable counts as mapping every artifact its uid ever leased (the lease journal's
lessee uids) and every artifact it holds from before a restart, unless a write-lease probe of
each payload (``hwr.daemon.system.exclusive.opened_elsewhere``) proves that no open file
description of it exists anywhere: that clears the suspicion. A daemon that is not root reads
no other uid's maps, so without the probe every artifact a worker's uid ever leased would stay
unevictable as long as that uid runs any process.

The scan is skipped, per key, when it provably has no mapping outside the daemon: committed
payloads reach another process only through a lease (a staging file's writer is proven gone at
commit, ``hwr.daemon.system.exclusive``; the store is private to the daemon's user). So a key the
journal never saw leased is mapped by nobody, and a key a scan found unmapped stays so until its
next acquire (``leased`` bumps a per-key lease generation before the descriptor is sent).

Contract: on the daemon's event loop only (the scan itself runs in a worker thread; the cache
is touched before and after it, on the loop), so no lock. Limits: a cached "nobody maps it"
expires after ``UNMAPPED_TTL_S`` anyway, which bounds the case of a process that still holds an
unmapped descriptor of an earlier lease and maps it later; both caches are dropped whole past
65,536 keys (they only save scans).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from hwr.daemon.system import exclusive, mappings

if TYPE_CHECKING:
    from hwr.daemon.service.lease_journal import LeaseHolds

__all__ = ["MappingScan", "PayloadFiles"]


def _unopened(records: Sequence[PayloadFiles]) -> list[str]:
    """Keys none of whose files has an open file description outside this call (blocking)."""
    return [r.key for r in records if r.files and all(_unopened_file(fp) for fp in r.files)]


def _unopened_file(fp: FileIdentity) -> bool:
    try:
        st = os.lstat(fp.path)
    except OSError:  # gone (its inode may live on in a mapping): nothing can be proven
        return False
    if (st.st_dev, st.st_ino) == (fp.device, fp.inode) and st.st_uid != os.geteuid():
        # Put there behind the daemon's back: every descriptor a lease sends is of a validated
        # file the daemon's user owns, so no lessee received this one from it.
        return True
    return exclusive.opened_elsewhere(fp.path, fp.device, fp.inode) is False


class FileIdentity(Protocol):
    @property
    def path(self) -> str: ...

    @property
    def device(self) -> int: ...

    @property
    def inode(self) -> int: ...


class PayloadFiles(Protocol):
    """What a scan needs of an artifact: its key and its payload files' (device, inode)s
    (an ``ArtifactRecord``, or the bare inodes of an artifact that no longer validates)."""

    @property
    def key(self) -> str: ...

    @property
    def files(self) -> Sequence[FileIdentity]: ...


class MappingScan:
    """Mapping scans for eviction, and the per-key cache that skips them (see the module)."""

    #: How long a scan's "nobody maps it" stands for a key that nobody leased since.
    UNMAPPED_TTL_S = 2.0

    def __init__(self, holds: LeaseHolds) -> None:
        self._holds = holds
        self.maps_reader: Callable[[int], bytes] | None = None  # tests inject EACCES here
        # key -> lease generation bumped at every acquire, and key -> (generation, monotonic
        # time) of the last scan that found nobody mapping it.
        self._lease_gen: dict[str, int] = {}
        self._unmapped_at: dict[str, tuple[int, float]] = {}
        self.scans = 0  # /proc scans run (a benchmark/diagnostic counter)

    def leased(self, key: str) -> None:
        """A lease of ``key`` is being granted: a cached "nobody maps it" is void from now on
        (called before the descriptor leaves)."""
        self._lease_gen[key] = self._lease_gen.get(key, 0) + 1

    def forget(self, key: str) -> None:
        """The artifact is gone: drop what the cache knows of it."""
        self._unmapped_at.pop(key, None)
        self._lease_gen.pop(key, None)

    def needs_scan(self, key: str, now: float) -> bool:
        """False when ``key`` provably has no mapping outside the daemon, without a /proc scan
        (see the module docstring)."""
        if not self._holds.lessee_uids(key):
            return False
        cached = self._unmapped_at.get(key)
        return cached is None or cached[0] != self._lease_gen.get(key, 0) or now - cached[1] > self.UNMAPPED_TTL_S

    async def mapped(self, records: Sequence[PayloadFiles]) -> dict[str, set[int]]:
        """key -> pids that map (or, unreadable, possibly map) one of its payloads."""
        now = time.monotonic()
        records = [r for r in records if self.needs_scan(r.key, now)]
        if not records:
            return {}
        generations = {r.key: self._lease_gen.get(r.key, 0) for r in records}  # before the scan
        by_file = {(fp.device, fp.inode): r.key for r in records for fp in r.files}
        self.scans += 1
        result = await asyncio.to_thread(mappings.scan, list(by_file), skip_pids={os.getpid()},
                                         reader=self.maps_reader)
        out = self._attribute(records, by_file, result)
        suspected = {key for key in out if key not in {by_file[fid] for fid in result.mapped}}
        if suspected:  # only unreadable processes implicate these: a probe may clear them
            cleared = await asyncio.to_thread(_unopened, [r for r in records if r.key in suspected])
            for key in cleared:
                del out[key]
        if len(self._unmapped_at) > 65536:
            self._unmapped_at.clear()
        for key, generation in generations.items():
            if key in out:
                self._unmapped_at.pop(key, None)
            else:
                self._unmapped_at[key] = (generation, now)
        return out

    def _attribute(self, records: Sequence[PayloadFiles], by_file: dict[mappings.FileId, str],
                   result: mappings.ScanResult) -> dict[str, set[int]]:
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
                foreign = uid is not None and uid != euid and uid in self._holds.lessee_uids(record.key)
                if foreign or pid in self._holds.held_pids(record.key):
                    out.setdefault(record.key, set()).add(pid)
        return out
