"""Acquire and release: the one daemon-side implementation behind gRPC and the peer channel.

``Servicer.Acquire``/``Release`` (gRPC, used by hwrctl and any client that speaks the wire
contract) and the peer channel's ``acquire``/``release`` operations (``hwr.daemon.peer.channel``, the
hot path of ``hwr.client``) both call ``Leasing``, so they share the lease table, the read API
(``hwr.daemon.service.catalog``: the deny/quarantine checks and the eviction gate, where an
acquire of a key being evicted waits for the round), the lease journal and the metrics.

Acquire, step by step (nothing awaits between the eviction check and ``add_lease``, so no
eviction round can mark the key in between):

1. record = ``Catalog.lookup_now``: the cached validated record when the key is not being
   evicted (no disk access, no thread hop: the trust argument is ``RecordCache.cached``'s), else
   ``await Catalog.lookup`` (validates from disk in a worker thread, waits out an eviction
   round, pulls a miss from the remote tier when one is configured). Who may start that pull
   is the publish role's decision (a pull stages and commits like a publication); anyone who
   may acquire waits for a pull already running. ``wait=False`` (a ``preferred`` caller that
   falls back at once) leaves the pull running and misses.
2. lease = ``Registry.add_lease`` (the journal observer buffers the ``acquire`` record).
3. descriptors: ``Catalog.open_payloads`` (``fstat`` re-check of every payload, a changed payload is
   denied: ``MANIFEST_CORRUPT``), then the journal is flushed *before* the caller sends them
   (``hwr.daemon.service.lease_journal``'s durability argument). If opening fails the lease is released
   and the typed error goes back.

Descriptors of a lease already granted (the peer channel's ``open`` request) come from
``lease_fds``: an artifact's payloads, or a checkpoint's original files for a checkpoint lease
(``CHECKPOINT_LEASE_PREFIX`` + checkpoint id; granted on gRPC only, ``hwr.daemon.rpc.checkpoints``).

Contract: called on the daemon's event loop only; every failure is a typed ``HwrError``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from hwr.client.errors import IdentityError, InvalidRequest
from hwr.client.identity import ArtifactIdentity, is_key
from hwr.client.wire import close_fds
from hwr.daemon.service.catalog import MissPolicy, Waiter
from hwr.daemon.service.roles import PUBLISH
from hwr.daemon.store import fileio as store_io

if TYPE_CHECKING:
    from hwr.daemon.checkpoints.registry import Checkpoints
    from hwr.daemon.service.catalog import Catalog
    from hwr.daemon.service.lease_journal import LeaseJournal
    from hwr.daemon.service.sessions import LeaseRecord, Registry, Session
    from hwr.daemon.service.settings import Settings
    from hwr.daemon.store.inspection import ArtifactRecord

__all__ = ["CHECKPOINT_LEASE_PREFIX", "Leasing", "key_of", "parse_identity"]

#: Lease keys of checkpoint leases are this prefix + the checkpoint id (never a 64-hex key).
CHECKPOINT_LEASE_PREFIX = "checkpoint:"


def parse_identity(data: bytes) -> ArtifactIdentity:
    """Canonical identity JSON from a request -> the identity; ``IdentityError`` otherwise."""
    try:
        return ArtifactIdentity.from_canonical_bytes(data)
    except RecursionError:
        # json and the canonical walk recurse once per nesting level; a real identity has three.
        raise IdentityError("identity JSON is nested too deeply") from None


def key_of(*, key: str | None = None, identity_json: bytes | None = None) -> str:
    """The artifact key a reference names (a 64-hex key, or canonical identity JSON bytes)."""
    if identity_json is not None:
        return parse_identity(identity_json).key
    if key is not None:
        if not is_key(key):
            raise InvalidRequest("key must be 64 lowercase hex digits", details={"field": "artifact.key"})
        return key
    raise InvalidRequest("artifact reference is empty", details={"field": "artifact"})


class Leasing:
    def __init__(self, catalog: Catalog, registry: Registry, *, journal: LeaseJournal | None,
                 checkpoints: Checkpoints, on_acquire: Callable[[float], None] | None = None,
                 settings: Settings | None = None) -> None:
        self.catalog = catalog
        self._registry = registry
        self._journal = journal  # flushed before any descriptor leaves (step 3)
        self._checkpoints = checkpoints
        self._on_acquire = on_acquire  # the acquire-duration histogram
        self._settings = settings  # its roles decide who may start a pull on miss; None: everyone

    async def acquire(self, session: Session, key: str, *, wait: bool = True) -> tuple[ArtifactRecord, LeaseRecord]:
        """Steps 1-2 of the module docstring: the validated record and the new lease."""
        started = time.perf_counter()
        record = self.catalog.lookup_now(key)
        if record is None:
            record = await self.catalog.lookup(key, how=self.miss_policy(session, wait=wait))
        return record, self._lease(session, key, started)

    def miss_policy(self, session: Session, *, wait: bool = True) -> MissPolicy:
        """What ``session``'s miss may do with the remote tier (step 1)."""
        cred = session.cred
        start = self._settings is None or self._settings.roles.grants(cred, PUBLISH)
        return MissPolicy(start=start, wait=wait, waiter=Waiter(
            session.session_id, cred.pid, cred.uid, session.client_name, time.time()))

    def acquire_now(self, session: Session, key: str) -> tuple[ArtifactRecord, LeaseRecord] | None:
        """``acquire`` without awaiting when the record is cached and the key is not being
        evicted; None when the caller must ``await acquire`` instead (nothing was done)."""
        started = time.perf_counter()
        record = self.catalog.lookup_now(key)
        return None if record is None else (record, self._lease(session, key, started))

    def _lease(self, session: Session, key: str, started: float) -> LeaseRecord:
        lease = self._registry.add_lease(session, key)
        if self._on_acquire is not None:
            self._on_acquire(time.perf_counter() - started)
        return lease

    def release(self, session: Session, lease_id: str) -> bool:
        if not lease_id or len(lease_id) > 64:
            raise InvalidRequest("lease_id is required")
        return self._registry.release(session, lease_id)

    def payload_fds(self, record: ArtifactRecord) -> list[int]:
        """Step 3: read-only payload descriptors in manifest order, journal flushed (caller
        sends and closes them). A journal that cannot be written (a full disk) refuses the
        acquire with a typed error (``NoSpace``/``StoreIOError``, retryable) and no descriptor
        leaves: without its record, a restart could not know this process maps the artifact."""
        fds = self.catalog.open_payloads(record)
        try:
            self.flush_journal()
        except BaseException:
            close_fds(fds)
            raise
        return fds

    def lease_fds(self, session: Session, lease_id: str, token: str) -> list[int]:
        """The descriptors of a lease ``session`` already holds (its token checked)."""
        lease = self._registry.lease_for_fds(session, lease_id, token)
        if lease.key.startswith(CHECKPOINT_LEASE_PREFIX):
            checkpoints = self._checkpoints
            return checkpoints.open_fds(checkpoints.get(lease.key[len(CHECKPOINT_LEASE_PREFIX):]))
        return self.payload_fds(self.catalog.lookup_sync(lease.key))

    def flush_journal(self) -> None:
        if self._journal is not None:
            try:
                self._journal.flush()
            except OSError as exc:
                raise store_io.io_error(exc, "lease journal") from None

    def manifest(self, record: ArtifactRecord) -> tuple[bytes, str]:
        """The manifest's JSON bytes and their sha256 (hex), computed once per record."""
        return self.catalog.manifest(record)
