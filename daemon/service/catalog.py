"""The read API in front of the store: look up, open payloads, resolve a key prefix, list.

Both transports (``hwr.daemon.peer.channel`` and ``hwr.daemon.rpc.servicer``, through
``hwr.daemon.service.leasing``) and the admin RPCs read the store only through a ``Catalog``, so
a key means the same thing everywhere:

- ``lookup_now(key)``: the cached validated record when ``key`` can be leased right now (not being
  evicted, cheap guard holds), else None; never blocks, never touches the payloads.
- ``lookup(key)``: the validated record, waiting out an eviction round that marked ``key`` and,
  on a miss with a remote tier (``fetcher``), pulling it first as the caller's ``MissPolicy``
  says (whether it may start a pull, whether it waits for one, who waits). A record that fails
  validation counts in ``hwr_verification_failures_total`` and raises its typed error.
- ``open_payloads(record)``: read-only descriptors in manifest order, each re-checked by
  ``fstat`` (a changed payload is denied: ``MANIFEST_CORRUPT``); the caller closes them.
- ``resolve(prefix)``: one namespace for every admin command and ``hwrctl show``: the keys
  present in ``artifacts/``, the denied ones (with or without their directory) and the pinned
  ones. So a denied key resolves for ``show``, ``allow`` and ``evict`` alike.
- ``entries(include_denied)`` / ``record_any_state(key)``: the listing, ready and denied.
- ``manifest(record)``: the manifest's JSON bytes and their SHA-256, computed once per record.

Contract: async methods run on the daemon's event loop; disk work hops to a worker thread.
Limits: the catalog adds no lock of its own; the ordering arguments are the store's
(``hwr.daemon.store.root``) and the eviction gate's (``StoreService.lookup``).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from hwr.client.errors import ArtifactNotFound, ChecksumMismatch, ManifestCorrupt, ManifestIncompatible
from hwr.daemon.policy.key_prefix import unique_prefix

if TYPE_CHECKING:
    from hwr.daemon.service.store_service import StoreService
    from hwr.daemon.store.inspection import ArtifactRecord
    from hwr.daemon.store.root import Store

__all__ = ["WAIT", "Catalog", "Entry", "MissFetcher", "MissPolicy", "PullState", "Waiter"]

#: The manifest cache is dropped whole past this many keys (a store holds far fewer).
MANIFEST_CACHE_KEYS = 4096


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


@dataclass(frozen=True)
class Entry:
    """One listed artifact: its key and its record (None for a denied key whose directory is
    gone: only its deny marker is left)."""

    key: str
    record: ArtifactRecord | None


class Catalog:
    def __init__(self, store: Store, gate: StoreService, *,
                 on_verification_failure: Callable[[str], None] | None = None) -> None:
        self._store = store
        self._gate = gate  # the eviction gate: lookup waits out a round that marked the key
        self._on_verification_failure = on_verification_failure
        #: Filled by the wiring when a remote tier is configured (it is built after the catalog).
        self.fetcher: MissFetcher | None = None
        # key -> (manifest object, its JSON bytes, sha256 hex of the bytes): rebuilt when the
        # store's record (and so its manifest object) changes.
        self._manifests: dict[str, tuple[object, bytes, str]] = {}

    # ---------------------------------------------------------------- lookups
    def lookup_now(self, key: str) -> ArtifactRecord | None:
        return self._gate.lookup_now(key)

    async def lookup(self, key: str, *, pull: bool = True, how: MissPolicy = WAIT) -> ArtifactRecord:
        """``pull=False``: a miss stays a miss (an operator's push names a local artifact)."""
        try:
            return await self._gate.lookup(key)  # waits while the key is being evicted
        except ArtifactNotFound:
            if self.fetcher is None or not pull:
                raise
            await self.fetcher.pull_on_miss(key, how)  # a miss here: pull it from the remote tier, then
            return await self._gate.lookup(key)  # the eviction gate again (see its docstring)
        except (ManifestCorrupt, ManifestIncompatible, ChecksumMismatch) as exc:
            if self._on_verification_failure is not None:
                self._on_verification_failure(exc.code)
            raise

    def pulling(self, key: str) -> PullState | None:
        """The pull of ``key`` in flight, if a remote tier runs one."""
        return None if self.fetcher is None else self.fetcher.pulling(key)

    def lookup_sync(self, key: str) -> ArtifactRecord:
        """For a key a lease already holds (the peer channel's descriptor request, off the
        await path): the cached record, else the store's full lookup in this thread."""
        return self._gate.lookup_now(key) or self._store.records.lookup(key)

    def open_payloads(self, record: ArtifactRecord) -> list[int]:
        return [fd for _name, fd in self._store.records.open_payloads(record)]

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
        return self._store.denylist.reason(key)

    # ---------------------------------------------------------------- keys and listings
    async def resolve(self, prefix: str) -> str:
        """A full key from a key or a unique prefix (see the module docstring's namespace)."""
        return unique_prefix(prefix, await self.known_keys() | self._gate.pins.keys())

    async def known_keys(self) -> set[str]:
        """Keys present in ``artifacts/`` or carrying a deny marker."""
        return await asyncio.to_thread(self._store.known_keys)

    async def artifacts(self) -> list[ArtifactRecord]:
        """Every validated, not denied artifact, by key."""
        return await asyncio.to_thread(self._store.records.artifacts)

    async def entries(self, include_denied: bool = False) -> list[Entry]:
        records = await self.artifacts()
        entries = [Entry(r.key, r) for r in records]
        if include_denied:  # inspected from disk (not cached): denied artifacts are few
            entries += [Entry(k, r) for k, r in await asyncio.to_thread(self._store.denied_records)]
        return entries

    async def record_any_state(self, key: str) -> ArtifactRecord | None:
        """The record of ``key``, ready or denied; None for a denied key whose directory is
        gone; ``ArtifactNotFound`` when it is neither."""
        for record in await self.artifacts():
            if record.key == key:
                return record
        for denied, record in await asyncio.to_thread(self._store.denied_records):
            if denied == key:
                return record
        raise ArtifactNotFound("no artifact with that key", details={"key": key})
