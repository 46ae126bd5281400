"""The read API in front of the store: look up, open payloads, resolve a key prefix, list.

The one reader of the store's records above the store room (``tests/daemon/test_rooms.py``
checks it): both transports (through ``hwr.daemon.service.leasing``), the admin RPCs, the fleet
tier, the producers' builds, channels, pins and the scrub read records only through a
``Catalog``, so a key means the same thing everywhere and every acquire obeys the eviction wait:

Four ways to get one record, each named by what it waits for:

- ``record_now(key)``: waits for nothing. The cached validated record when ``key`` can be leased
  right now (not marked by an eviction round, and ``RecordCache.cached``'s cheap guard holds),
  else None; never blocks, never touches the payloads.
- ``record_blocking(key)``: waits for the disk in the calling thread (the cached record, else
  the full validation); for a key a lease holds, or a worker thread's reads (pins, reuse bases,
  builds, pushes).
- ``await record_settled(key)``: waits for an eviction round that marked ``key`` (validation in
  a worker thread). No await follows the final check, so a caller that leases or pins right
  after it runs before any later round can mark the key.
- ``await record_or_pull(key, how=...)``: ``record_settled``, and on a miss with a remote tier
  a pull first as the caller's ``MissPolicy`` says (whether it may start a pull, whether it
  waits for one, who waits; ``how=None``: no pull). A record that fails validation counts in
  the metadata-validation failure counter and raises its typed error.

And around them:

- ``open_payloads(record)``: (name, read-only descriptor) pairs in manifest order, each
  re-checked by ``fstat`` (a changed payload is denied: ``MANIFEST_CORRUPT``); the caller
  closes them. The same shape as ``RecordCache.open_payloads``.
- ``resolve(prefix)``: one namespace for every admin command and ``hwrctl show``: the keys
  present in ``artifacts/``, the denied ones (with or without their directory) and the pinned
  ones. So a denied key resolves for ``show``, ``allow`` and ``evict`` alike.
- ``records()`` / ``records_now()``, ``entries(include_denied)`` / ``record_any_state(key)``:
  the listing (ready; ready and denied).
- ``manifest(record)``: the manifest's JSON bytes and their SHA-256, computed once per record.
- the operator's record commands: ``verify`` (re-hash every byte), ``deny_permanently``,
  ``allow`` (then re-validate, so listings show it again at once), ``rescan_usage``.
- reads for the service's own bookkeeping (capacity, recency, publishing, metrics):
  ``listed_record``, ``absent_now``, ``inspected``, ``take_added``, ``deny_reason``,
  ``is_volatile``: the store's answers as they are, read here so that the store's records have
  one reader.

The eviction marks come from whoever runs eviction rounds, as an ``EvictionMarks``: the keys a
round has marked (``evicting``) and the event set when a round ends (``settled``, replaced each
round: a waiter reads it at each wait).

Contract: async methods run on the daemon's event loop; disk work hops to a worker thread.
Limits: the catalog adds no lock of its own; the ordering arguments are the store's
(``hwr.daemon.store.root``) and the eviction rounds' (``hwr.daemon.service.evictor``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from hwr.client.errors import ArtifactNotFound, ChecksumMismatch, HwrError, ManifestCorrupt, ManifestIncompatible
from hwr.daemon.policy.key_prefix import unique_prefix

# The record the read API hands out; the transports name it from here (they never import the
# store room).
from hwr.daemon.store.inspection import ArtifactRecord, inspect_artifact

if TYPE_CHECKING:
    from hwr.daemon.service.eviction_marks import EvictionMarks
    from hwr.daemon.store.root import Store

__all__ = ["WAIT", "ArtifactRecord", "Catalog", "Entry", "MissFetcher", "MissPolicy",
           "PinnedKeys", "PullState", "Waiter"]

#: The manifest cache is dropped whole past this many keys (a store holds far fewer).
MANIFEST_CACHE_KEYS = 4096


class PinnedKeys(Protocol):
    """The pinned keys (``hwr.daemon.service.pinning.PinSet``): part of ``resolve``'s namespace."""

    def keys(self) -> set[str]: ...


@dataclass(frozen=True)
class Waiter:
    """Who waits for a pull (``hwrctl status`` lists them under the pull)."""

    session_id: str
    pid: int
    uid: int
    client_name: str
    since: float  # wall-clock time the wait began


@dataclass(frozen=True)
class MissPolicy:
    """What a lookup's miss may do with a remote tier.

    ``start``: the caller may start a pull (it holds the publish role: a pull stages and commits
    an artifact like a publication); without it the caller may still wait for a pull that is
    already running. ``wait``: wait for the pull while it advances (bounded by the remote's stall
    timeout, not a total one); False: start it (when allowed), leave it running and miss at once
    (``ArtifactNotFound`` with ``details["pulling"]``). ``waiter``: who waits, for ``hwrctl status``.
    """

    start: bool = True
    wait: bool = True
    waiter: Waiter | None = None


#: The policy of callers that are not clients (an operator's RPCs, tests): start, wait.
WAIT = MissPolicy()


class PullState(Protocol):
    """A pull in flight as a waiting client is told of it (``hwr.daemon.fleet.progress``)."""

    remote: str
    phase: str
    done_bytes: int
    total_bytes: int


class MissFetcher(Protocol):
    """What fills a miss before the catalog gives up (the fleet tier's puller)."""

    async def pull_on_miss(self, key: str, how: MissPolicy) -> object: ...

    def pulling(self, key: str) -> PullState | None: ...


def _no_fetcher() -> MissFetcher | None:
    return None


@dataclass(frozen=True)
class Entry:
    """One listed artifact: its key and its record (None for a denied key whose directory is
    gone: only its deny marker is left)."""

    key: str
    record: ArtifactRecord | None


class Catalog:
    def __init__(self, store: Store, marks: EvictionMarks, *, pins: PinnedKeys | None = None,
                 on_check_failure: Callable[[str], None] | None = None,
                 fetcher: Callable[[], MissFetcher | None] | None = None) -> None:
        self._store = store
        self._records = store.records  # the record cache, read directly on the acquire hot path
        self._marks = marks  # an acquire of a key an eviction round marked waits for the round
        self._pins = pins  # None: nothing is pinned (a catalog without the node service's pins)
        self._on_check_failure = on_check_failure
        # The remote tier's puller, asked for at each miss: the tier is built after the catalog
        # (over it), so the graph hands a getter; None: no remote tier.
        self._fetcher = fetcher or _no_fetcher
        # key -> (manifest object, its JSON bytes, sha256 hex of the bytes): rebuilt when the
        # store's record (and so its manifest object) changes.
        self._manifests: dict[str, tuple[object, bytes, str]] = {}

    # ---------------------------------------------------------------- lookups
    def record_now(self, key: str) -> ArtifactRecord | None:
        """The cached validated record when ``key`` can be leased right now without waiting or
        touching the disk, else None: then await ``record_or_pull`` (or ``record_settled``).
        Waits for nothing. Nothing awaits between this check
        and the caller's lease, so no eviction round can mark ``key`` in between."""
        return None if key in self._marks.evicting else self._records.cached(key)

    async def record_settled(self, key: str) -> ArtifactRecord:
        """The validated record (``RecordCache.lookup`` in a worker thread), once no eviction
        round has ``key`` marked: waits for the round, never for a pull (no metric). No
        await follows the final check, so the caller's lease or pin runs before any later
        eviction round can mark it."""
        record = await asyncio.to_thread(self._records.lookup, key)
        while key in self._marks.evicting:
            await self._marks.settled.wait()  # read at each wait: every round has its own event
            record = await asyncio.to_thread(self._records.lookup, key)
        return record

    async def record_or_pull(self, key: str, *, how: MissPolicy | None = WAIT) -> ArtifactRecord:
        """``record_settled``, and on a miss a pull from the remote tier as ``how`` says (waits
        for the eviction round, then for the pull); ``how=None``: a miss stays a miss (an
        operator's push names a local artifact). A validation failure is counted."""
        try:
            return await self.record_settled(key)
        except ArtifactNotFound:
            fetcher = self._fetcher()
            if fetcher is None or how is None:
                raise
            await fetcher.pull_on_miss(key, how)  # a miss here: pull it from the remote tier, then
            return await self.record_settled(key)  # wait out an eviction round again
        except (ManifestCorrupt, ManifestIncompatible, ChecksumMismatch) as exc:
            if self._on_check_failure is not None:
                self._on_check_failure(exc.code)
            raise

    def pulling(self, key: str) -> PullState | None:
        """The pull of ``key`` in flight, if a remote tier runs one."""
        fetcher = self._fetcher()
        return None if fetcher is None else fetcher.pulling(key)

    def record_blocking(self, key: str) -> ArtifactRecord:
        """The cached record, else the store's full lookup in this thread (blocking; waits for
        no eviction round and no pull): for a key a lease already holds (the peer socket's
        descriptor request) or a worker thread (a push, a reuse base, a build)."""
        return self.record_now(key) or self._records.lookup(key)

    def open_payloads(self, record: ArtifactRecord) -> list[tuple[str, int]]:
        """(file name, read-only descriptor) of each payload in manifest order, each re-checked
        by ``fstat`` (a changed payload is denied: ``MANIFEST_CORRUPT``); the caller closes them.
        ``RecordCache.open_payloads``'s contract, read here so the store's records have one reader."""
        return self._records.open_payloads(record)

    def manifest(self, record: ArtifactRecord) -> tuple[bytes, str]:
        cached = self._manifests.get(record.key)
        if cached is None or cached[0] is not record.manifest:
            data = record.manifest.to_json()
            cached = (record.manifest, data, hashlib.sha256(data).hexdigest())
            if len(self._manifests) > MANIFEST_CACHE_KEYS:
                self._manifests.clear()
            self._manifests[record.key] = cached
        return cached[1], cached[2]

    def deny_reason(self, key: str) -> str | None:
        """Why ``key`` is denied, None when it is not (in memory: no thread hop)."""
        return self._store.denylist.reason(key)

    def is_volatile(self, key: str) -> bool:
        """Whether ``key`` was committed non-durably (gone at the next open)."""
        return self._store.volatile.marked(key)

    # ---------------------------------------------------------------- keys and listings
    async def resolve(self, prefix: str) -> str:
        """A full key from a key or a unique prefix (see the module docstring's namespace)."""
        return unique_prefix(prefix, await self.known_keys() | (self._pins.keys() if self._pins is not None else set()))

    async def known_keys(self) -> set[str]:
        """Keys present in ``artifacts/`` or carrying a deny marker."""
        return await asyncio.to_thread(self._store.known_keys)

    async def records(self) -> list[ArtifactRecord]:
        """Every validated, not denied artifact, by key (in a worker thread)."""
        return await asyncio.to_thread(self._records.artifacts)

    def records_now(self) -> list[ArtifactRecord]:
        """``records`` in the calling thread (the metrics scrape, the sd_notify status line)."""
        return self._records.artifacts()

    def take_added(self) -> list[str]:
        """Keys that became records since the last call, each once (the LRU index's feed)."""
        return self._records.take_added()

    async def entries(self, include_denied: bool = False) -> list[Entry]:
        records = await self.records()
        entries = [Entry(r.key, r) for r in records]
        if include_denied:  # inspected from disk (not cached): denied artifacts are few
            entries += [Entry(k, r) for k, r in await asyncio.to_thread(self._store.denied_records)]
        return entries

    async def record_any_state(self, key: str) -> ArtifactRecord | None:
        """The record of ``key``, ready or denied; None for a denied key whose directory is
        gone; ``ArtifactNotFound`` when it is neither."""
        for record in await self.records():
            if record.key == key:
                return record
        for denied, record in await asyncio.to_thread(self._store.denied_records):
            if denied == key:
                return record
        raise ArtifactNotFound("no artifact with that key", details={"key": key})

    # ---------------------------------------------------------------- capacity's reads (blocking unless said)
    def listed_record(self, key: str) -> ArtifactRecord | None:
        """The record of a validated, listed artifact from memory (no disk, no wait, eviction
        marks ignored: capacity's and recency's bookkeeping), else None."""
        return self._records.listed(key)

    def inspected(self, key: str) -> ArtifactRecord | None:
        """The validated record, else a fresh inspection of a denied artifact (its payload
        inodes, for the mapping scan); None when neither reads."""
        try:
            return self._records.lookup(key)
        except HwrError:
            pass
        try:
            return inspect_artifact(self._store.root / "artifacts" / key, key, self._store.euid)
        except HwrError:
            return None

    def absent_now(self, key: str) -> bool:
        """True when ``key`` provably has no artifact (one ``lstat``); False: ask ``record_settled``."""
        return self._records.absent_now(key)

    # ---------------------------------------------------------------- the operator's record commands
    async def verify(self, key: str, progress: Callable[[int, int], None] | None = None) -> ArtifactRecord:
        """Re-hash every byte of ``key`` in a worker thread (``Store.verify``: a mismatch
        quarantines and denies it, ``ChecksumMismatch``); ``progress(done, total)`` is called
        from that thread."""
        return await asyncio.to_thread(self._store.verify, key, progress)

    def deny_permanently(self, key: str, reason: str) -> None:
        """Deny ``key`` for good, as an operator does (code ``OPERATOR_DENIED``: a later publication
        will not replace it; also a pull whose bytes differ from the remote manifest); blocking (the
        marker's write and fsync), and on the loop it takes effect before any other step runs."""
        self._store.deny(key, reason)

    async def allow(self, key: str) -> bool:
        """Remove ``key``'s deny marker and re-validate it now, so that listings show it again
        before anyone acquires it (one that fails validation is denied again, for that reason).
        Returns whether it was denied."""
        was = self._store.denylist.reason(key) is not None
        await asyncio.to_thread(self._records.allow, key)
        with contextlib.suppress(HwrError):
            await self.record_settled(key)
        return was

    async def rescan_usage(self) -> dict[str, int]:
        """Payload bytes per ``artifacts/`` entry as the disk has them now (``Store.rescan_usage``)."""
        return await asyncio.to_thread(self._store.rescan_usage)
