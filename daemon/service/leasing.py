"""Acquire and release: the one lease grant behind gRPC and the peer socket.

``Leasing.grant`` (and its synchronous fast path ``grant_now``) is the whole acquire use case:
both transports call it with the same arguments and only encode its ``Grant`` (the peer socket
``hwr.daemon.peer.server``: a JSON frame, the descriptors and the manifest tail; gRPC
``hwr.daemon.rpc.servicer``: an ``AcquireResponse``, no descriptors). So they share the lease
table, the read API (``hwr.daemon.service.catalog``: the deny/quarantine checks and the wait on
a key an eviction round has marked), the lease journal and the metrics.

A warm acquire crosses three module boundaries each way, none a pure forward::

    peer.server (or rpc.servicer)    parse the request, encode the Grant
      -> service.leasing             this transaction: lookup, lease, descriptors, journal, manifest
        -> service.catalog           the eviction marks, the cached record, the fstat-checked opens
          -> store.records           the record cache (three lstat calls), the payload opens

The grant, step by step (nothing awaits between the eviction check and ``add_lease``, so no
eviction round can mark the key in between):

1. record = ``Catalog.record_now``: the cached validated record when the key is not being
   evicted (no disk access, no thread hop: the trust argument is ``RecordCache.cached``'s); when
   it is None ``grant_now`` returns None and the transport awaits ``grant``, which awaits
   ``Catalog.record_or_pull`` (validates from disk in a worker thread, waits out an eviction round,
   pulls a miss from the remote tier when one is configured). Who may start that pull is the
   publish role's decision (a pull stages and commits like a publication); anyone who may
   acquire waits for a pull already running. ``wait=False`` (a ``preferred`` caller that falls
   back at once) leaves the pull running and misses.
2. lease = ``Registry.add_lease``, then ``Leasing`` journals it itself (``_journaled``: the
   mapping scan's cached "nobody maps it" is voided, the lease journal buffers the ``acquire``
   record, recency notes the use); the acquire-duration histogram observes the time since step 1.
3. manifest = ``Catalog.manifest`` (JSON bytes and their SHA-256, once per record); the bytes go
   in the grant unless the caller's ``have`` names that digest.
4. descriptors (``descriptors=True``, the peer socket): ``Catalog.open_payloads`` (``fstat``
   re-check of every payload, a changed payload is denied: ``MANIFEST_CORRUPT``), then the journal
   is flushed *before* the caller sends them (``hwr.daemon.service.lease_journal``'s durability
   argument); a journal that cannot be written (a full disk) refuses the acquire with a typed,
   retryable error (``NoSpace``/``StoreIOError``) and no descriptor leaves. gRPC sends no
   descriptors (``descriptors=False``: nothing opened, nothing flushed; its clients fetch them
   on the peer socket's ``fds`` request, which flushes).
5. rollback: any failure in 3-4 closes the descriptors opened and releases the lease; the typed
   error goes back.

Leasing owns every lease it grants and every release: artifact leases (``grant``), checkpoint
leases (``grant_checkpoint``: ``CHECKPOINT_LEASE_PREFIX`` + checkpoint id; asked for on gRPC
only, ``hwr.daemon.rpc.checkpoints``), ``release`` and ``end_session``; each change is journaled
here (``_journaled``), and a key that lost its last lease wakes a publication waiting for room
(``on_last_release``, capacity's room queue). A reference names an artifact by key, identity or
weight channel (``ArtifactRef``); ``key_for`` resolves it (a channel to the key it points to
now), so the transports only decode and encode.

Descriptors of a lease already granted (the peer socket's ``fds`` request) come from
``lease_fds``: an artifact's payloads, or a checkpoint's original files for a checkpoint lease.

Contract: called on the daemon's event loop only; every failure is a typed ``HwrError``.
"""

from __future__ import annotations

import asyncio
import logging
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
    from hwr.daemon.checkpoints.registry import Checkpoint, Checkpoints
    from hwr.daemon.service.catalog import ArtifactRecord, Catalog, PullState
    from hwr.daemon.service.channels import Channels
    from hwr.daemon.service.lease_journal import LeaseHolds
    from hwr.daemon.service.mapping_scan import MappingScan
    from hwr.daemon.service.recency import Recency
    from hwr.daemon.service.sessions import LeaseRecord, Registry, Session
    from hwr.daemon.service.settings import Settings

__all__ = ["CHECKPOINT_LEASE_PREFIX", "ArtifactRef", "Grant", "Leasing", "key_of", "parse_identity"]

log = logging.getLogger("hwrd.store")

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
class ArtifactRef:
    """What a request names, as a transport decoded it: exactly one of a 64-hex ``key``, canonical
    ``identity_json`` bytes, or a weight ``channel`` name (``Leasing.key_for`` resolves it)."""

    key: str | None = None
    identity_json: bytes | None = None
    channel: str | None = None


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
    """Acquire and release (the module docstring). ``holds``/``scan``/``recency``: where a lease
    change is journaled (None in a catalog-only setup: nothing journaled); ``on_last_release``:
    called when a key lost its last lease (capacity's room queue); ``channels``: the weight
    channels a reference may name (None: refused)."""

    def __init__(self, catalog: Catalog, registry: Registry, *, checkpoints: Checkpoints,
                 holds: LeaseHolds | None = None, scan: MappingScan | None = None, recency: Recency | None = None,
                 channels: Channels | None = None, on_last_release: Callable[[], None] | None = None,
                 on_acquire: Callable[[float], None] | None = None, settings: Settings | None = None) -> None:
        self._catalog = catalog
        self._registry = registry
        self._holds = holds  # its journal is flushed before any descriptor leaves (step 4)
        self._scan = scan
        self._recency = recency
        self._checkpoints = checkpoints
        self._channels = channels
        self._on_last_release = on_last_release
        self._on_acquire = on_acquire  # the acquire-duration histogram
        self._settings = settings  # its roles decide who may start a pull on miss; None: everyone

    def key_for(self, ref: ArtifactRef) -> str:
        """The artifact key ``ref`` names: a channel resolves to the key it points to now (the
        caller leases it in the same loop step, ``grant_now``, or right after)."""
        if ref.channel is not None:
            if self._channels is None:
                raise InvalidRequest("this hwrd serves no channels", details={"field": "channel"})
            return self._channels.resolve(ref.channel)
        return key_of(key=ref.key, identity_json=ref.identity_json)

    def pulling(self, key: str) -> PullState | None:
        """The pull of ``key`` the remote tier runs for waiting acquires, if any (progress)."""
        return self._catalog.pulling(key)

    def grant_now(self, session: Session, key: str, *, have: str | None = None,
                  descriptors: bool = True) -> Grant | None:
        """The grant without awaiting, when the record is cached and the key is not being
        evicted; None when the caller must ``await grant`` instead (nothing was done)."""
        started = time.perf_counter()
        record = self._catalog.record_now(key)
        if record is None:
            return None
        return self._grant(session, key, record, started, have, descriptors)

    async def grant(self, session: Session, key: str, *, have: str | None = None, descriptors: bool = True,
                    wait: bool = True) -> Grant:
        """The whole acquire (module docstring, steps 1-5); ``wait`` as ``MissPolicy.wait``."""
        started = time.perf_counter()
        record = self._catalog.record_now(key)
        if record is None:
            record = await self._catalog.record_or_pull(key, how=self.miss_policy(session, wait=wait))
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
            data, digest = self._catalog.manifest(record)
            fds = self._payload_fds(record) if descriptors else []
        except BaseException:
            self._release(session, lease.lease_id)
            raise
        return Grant(lease.lease_id, lease.token, key, digest, b"" if have == digest else data, fds, record)

    def _lease(self, session: Session, key: str, started: float) -> LeaseRecord:
        lease = self._registry.add_lease(session, key)
        self._journaled("acquire", lease)
        if self._on_acquire is not None:
            self._on_acquire(time.perf_counter() - started)
        return lease

    async def grant_checkpoint(self, session: Session, checkpoint_id: str) -> tuple[LeaseRecord, Checkpoint]:
        """A lease on a registered checkpoint's original files, after checking them unchanged
        (in a worker thread, with the registrant's rights); journaled like an artifact lease."""
        ckpt = self._checkpoints.get(checkpoint_id)
        await asyncio.to_thread(self._checkpoints.check, ckpt)
        lease = self._registry.add_lease(session, CHECKPOINT_LEASE_PREFIX + ckpt.checkpoint_id)
        self._journaled("acquire", lease)
        return lease, ckpt

    def release(self, session: Session, lease_id: str) -> bool:
        """Release one lease of ``session``; False when it released it already."""
        if not lease_id or len(lease_id) > 64:
            raise InvalidRequest("lease_id is required")
        return self._release(session, lease_id)

    def end_session(self, session: Session) -> list[LeaseRecord]:
        """End ``session`` and release every lease it holds (idempotent); the leases released."""
        if session.closed:
            return []
        held = list(session.leases.values())
        for lease in held:  # one at a time: the room queue wakes when a key's last lease goes
            self._release(session, lease.lease_id)
        self._registry.close_session(session)
        return held

    def _release(self, session: Session, lease_id: str) -> bool:
        lease = session.leases.get(lease_id)
        released = self._registry.release(session, lease_id)
        if released and lease is not None:
            self._journaled("release", lease)
        return released

    def _journaled(self, event: str, lease: LeaseRecord) -> None:
        """After each lease change: void the mapping scan's cached "nobody maps it" before a
        descriptor leaves, journal the lease (restart recovery), note the use for the LRU order,
        and wake a publication waiting for room when the key lost its last lease (only now can it
        be evicted). A journal write that fails is logged; the flush before descriptors leave
        (step 4) reports it to the caller."""
        try:
            if event == "acquire":
                if self._scan is not None:
                    self._scan.leased(lease.key)
                if self._holds is not None:
                    self._holds.acquired(lease)
            else:
                if self._holds is not None:
                    self._holds.released(lease)
                if not self._registry.lease_count(lease.key) and self._on_last_release is not None:
                    self._on_last_release()
            if self._recency is not None:
                self._recency.touch(lease.key)
        except OSError as exc:
            log.error("lease journal write failed: %s", exc)

    def _payload_fds(self, record: ArtifactRecord) -> list[int]:
        """Step 4: read-only payload descriptors in manifest order, journal flushed (the caller
        sends and closes them); the descriptors are closed again when the flush fails."""
        fds = [fd for _name, fd in self._catalog.open_payloads(record)]
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
        return self._payload_fds(self._catalog.record_blocking(lease.key))

    def _flush_journal(self) -> None:
        if self._holds is not None:
            try:
                self._holds.journal.flush()
            except OSError as exc:
                raise store_io.io_error(exc, "lease journal") from None
