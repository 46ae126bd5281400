"""Acquire and release: the one lease grant behind gRPC and the peer channel.

``Leasing.grant`` (and its synchronous fast path ``grant_now``) is the whole acquire use case:
both transports call it with the same arguments and only encode its ``Grant`` (the peer channel
``hwr.daemon.peer.channel``: a JSON frame, the descriptors and the manifest tail; gRPC
``hwr.daemon.rpc.servicer``: an ``AcquireResponse``, no descriptors). So they share the lease
table, the read API (``hwr.daemon.service.catalog``: the deny/quarantine checks and the wait on
a key an eviction round has marked), the lease journal and the metrics.

A warm acquire crosses three module boundaries each way, none a pure forward::

    peer.channel (or rpc.servicer)   parse the request, encode the Grant
      -> service.leasing             this transaction: lookup, lease, descriptors, journal, manifest
        -> service.catalog           the eviction marks, the cached record, the fstat-checked opens
          -> store.records           the record cache (three lstat calls), the payload opens

The grant, step by step (nothing awaits between the eviction check and ``add_lease``, so no
eviction round can mark the key in between):

1. record = ``Catalog.lookup_now``: the cached validated record when the key is not being
   evicted (no disk access, no thread hop: the trust argument is ``RecordCache.cached``'s); when
   it is None ``grant_now`` returns None and the transport awaits ``grant``, which awaits
   ``Catalog.lookup`` (validates from disk in a worker thread, waits out an eviction round,
   pulls a miss from the remote tier when one is configured). Who may start that pull is the
   publish role's decision (a pull stages and commits like a publication); anyone who may
   acquire waits for a pull already running. ``wait=False`` (a ``preferred`` caller that falls
   back at once) leaves the pull running and misses.
2. lease = ``Registry.add_lease`` (the journal observer buffers the ``acquire`` record; the
   acquire-duration histogram observes the time since step 1).
3. manifest = ``Catalog.manifest`` (JSON bytes and their SHA-256, once per record); the bytes go
   in the grant unless the caller's ``have`` names that digest.
4. descriptors (``descriptors=True``, the peer channel): ``Catalog.open_payloads`` (``fstat``
   re-check of every payload, a changed payload is denied: ``MANIFEST_CORRUPT``), then the journal
   is flushed *before* the caller sends them (``hwr.daemon.service.lease_journal``'s durability
   argument); a journal that cannot be written (a full disk) refuses the acquire with a typed,
   retryable error (``NoSpace``/``StoreIOError``) and no descriptor leaves. gRPC sends no
   descriptors (``descriptors=False``: nothing opened, nothing flushed; its clients fetch them
   on the peer channel's ``fds`` request, which flushes).
5. rollback: any failure in 3-4 closes the descriptors opened and releases the lease; the typed
   error goes back.

Descriptors of a lease already granted (the peer channel's ``fds`` request) come from
``lease_fds``: an artifact's payloads, or a checkpoint's original files for a checkpoint lease
(``CHECKPOINT_LEASE_PREFIX`` + checkpoint id; granted on gRPC only, ``hwr.daemon.rpc.checkpoints``).

Contract: called on the daemon's event loop only; every failure is a typed ``HwrError``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hwr.client.errors import IdentityError, InvalidRequest
from hwr.client.identity import ArtifactIdentity, is_key
from hwr.client.wire import close_fds
from hwr.daemon.service.catalog import MissPolicy, Waiter
from hwr.daemon.service.roles import PUBLISH
from hwr.daemon.store import fileio as store_io

if TYPE_CHECKING:
    from hwr.daemon.checkpoints.registry import Checkpoints
    from hwr.daemon.service.catalog import ArtifactRecord, Catalog
    from hwr.daemon.service.lease_journal import LeaseJournal
    from hwr.daemon.service.sessions import LeaseRecord, Registry, Session
    from hwr.daemon.service.settings import Settings

__all__ = ["CHECKPOINT_LEASE_PREFIX", "Grant", "Leasing", "key_of", "parse_identity"]

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


@dataclass(frozen=True, slots=True)
class Grant:
    """A granted lease as a transport encodes it (step 3-4 of the module docstring).

    ``manifest``: the manifest's JSON bytes, or ``b""`` when the caller's ``have`` named
    ``manifest_sha256``. ``fds``: the payload descriptors in manifest file order (empty when
    none were asked for); the transport sends them, then closes them. ``record``: the artifact's
    validated record (its manifest lists the payload files).
    """

    lease_id: str
    token: str
    key: str
    manifest_sha256: str
    manifest: bytes
    fds: list[int]
    record: ArtifactRecord


class Leasing:
    def __init__(self, catalog: Catalog, registry: Registry, *, journal: LeaseJournal | None,
                 checkpoints: Checkpoints, on_acquire: Callable[[float], None] | None = None,
                 settings: Settings | None = None) -> None:
        self.catalog = catalog
        self._registry = registry
        self._journal = journal  # flushed before any descriptor leaves (step 4)
        self._checkpoints = checkpoints
        self._on_acquire = on_acquire  # the acquire-duration histogram
        self._settings = settings  # its roles decide who may start a pull on miss; None: everyone

    def grant_now(self, session: Session, key: str, *, have: str | None = None,
                  descriptors: bool = True) -> Grant | None:
        """The grant without awaiting, when the record is cached and the key is not being
        evicted; None when the caller must ``await grant`` instead (nothing was done)."""
        started = time.perf_counter()
        record = self.catalog.lookup_now(key)
        if record is None:
            return None
        return self._grant(session, key, record, started, have, descriptors)

    async def grant(self, session: Session, key: str, *, have: str | None = None, descriptors: bool = True,
                    wait: bool = True) -> Grant:
        """The whole acquire (module docstring, steps 1-5); ``wait`` as ``MissPolicy.wait``."""
        started = time.perf_counter()
        record = self.catalog.lookup_now(key)
        if record is None:
            record = await self.catalog.lookup(key, how=self.miss_policy(session, wait=wait))
        return self._grant(session, key, record, started, have, descriptors)

    def miss_policy(self, session: Session, *, wait: bool = True) -> MissPolicy:
        """What ``session``'s miss may do with the remote tier (step 1)."""
        cred = session.cred
        start = self._settings is None or self._settings.roles.grants(cred, PUBLISH)
        return MissPolicy(start=start, wait=wait, waiter=Waiter(
            session.session_id, cred.pid, cred.uid, session.client_name, time.time()))

    def _grant(self, session: Session, key: str, record: ArtifactRecord, started: float, have: str | None,
               descriptors: bool) -> Grant:
        """Steps 2-5, with no await between the caller's lookup and the lease."""
        lease = self._lease(session, key, started)
        try:
            data, digest = self.catalog.manifest(record)
            fds = self._payload_fds(record) if descriptors else []
        except BaseException:
            self._registry.release(session, lease.lease_id)
            raise
        return Grant(lease.lease_id, lease.token, key, digest, b"" if have == digest else data, fds, record)

    def _lease(self, session: Session, key: str, started: float) -> LeaseRecord:
        lease = self._registry.add_lease(session, key)
        if self._on_acquire is not None:
            self._on_acquire(time.perf_counter() - started)
        return lease

    def release(self, session: Session, lease_id: str) -> bool:
        if not lease_id or len(lease_id) > 64:
            raise InvalidRequest("lease_id is required")
        return self._registry.release(session, lease_id)

    def _payload_fds(self, record: ArtifactRecord) -> list[int]:
        """Step 4: read-only payload descriptors in manifest order, journal flushed (the caller
        sends and closes them); the descriptors are closed again when the flush fails."""
        fds = self.catalog.open_payloads(record)
        try:
            self._flush_journal()
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
        return self._payload_fds(self.catalog.lookup_sync(lease.key))

    def _flush_journal(self) -> None:
        if self._journal is not None:
            try:
                self._journal.flush()
            except OSError as exc:
                raise store_io.io_error(exc, "lease journal") from None
