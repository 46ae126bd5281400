"""Acquire and release: the one daemon-side implementation behind gRPC and the peer channel.

``Servicer.Acquire``/``Release`` (gRPC, used by hwrctl and any client that speaks the wire
contract) and the peer channel's ``acquire``/``release`` operations (``hwr.daemon.peer.channel``, the
hot path of ``hwr.client``) both call ``Leasing``, so they share the lease table, the
deny/quarantine checks (``Store.cached``/``Store.lookup``), the eviction gate
(``StoreService.lookup_now``/``lookup``: an acquire of a key being evicted waits for the round),
the lease journal and the metrics.

Acquire, step by step (nothing awaits between the eviction check and ``add_lease``, so no
eviction round can mark the key in between):

1. record = the cached validated record when the key is not being evicted (no disk access,
   no thread hop: the trust argument is ``Store.cached``'s), else ``await StoreService.lookup``
   (validates from disk in a worker thread, waits out an eviction round).
2. lease = ``Registry.add_lease`` (the journal observer buffers the ``acquire`` record).
3. descriptors: ``Store.open_payloads`` (``fstat`` re-check of every payload, a changed payload is
   denied: ``MANIFEST_CORRUPT``), then the journal is flushed *before* the caller sends them
   (``hwr.daemon.service.lease_journal``'s durability argument). If opening fails the lease is released
   and the typed error goes back.

Contract: called on the daemon's event loop only; every failure is a typed ``HwrError``.
Limits: checkpoint leases (``CheckpointRef``) stay on gRPC (``hwr.daemon.rpc.checkpoints``).
"""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Any

from hwr.client.errors import IdentityError, InvalidRequest
from hwr.client.identity import ArtifactIdentity, is_key
from hwr.client.wire import close_fds
from hwr.daemon.store import fileio as store_io

if TYPE_CHECKING:
    from hwr.daemon.app.server import Daemon
    from hwr.daemon.service.sessions import LeaseRecord, Session

__all__ = ["Leasing", "key_of", "parse_identity"]


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
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        # key -> (manifest object, its JSON bytes, sha256 hex of the bytes): rebuilt when the
        # store's record (and so its manifest object) changes.
        self._manifests: dict[str, tuple[Any, bytes, str]] = {}

    async def acquire(self, session: Session, key: str) -> tuple[Any, LeaseRecord]:
        """Steps 1-2 of the module docstring: the validated record and the new lease."""
        started = time.perf_counter()
        record = self.d.store_service.lookup_now(key)
        if record is None:
            record = await self.d.lookup(key)
        return record, self._lease(session, key, started)

    def acquire_now(self, session: Session, key: str) -> tuple[Any, LeaseRecord] | None:
        """``acquire`` without awaiting when the record is cached and the key is not being
        evicted; None when the caller must ``await acquire`` instead (nothing was done)."""
        started = time.perf_counter()
        record = self.d.store_service.lookup_now(key)
        return None if record is None else (record, self._lease(session, key, started))

    def _lease(self, session: Session, key: str, started: float) -> LeaseRecord:
        lease = self.d.registry.add_lease(session, key)
        self.d.metrics_acquire(time.perf_counter() - started)
        return lease

    def release(self, session: Session, lease_id: str) -> bool:
        if not lease_id or len(lease_id) > 64:
            raise InvalidRequest("lease_id is required")
        return self.d.registry.release(session, lease_id)

    def payload_fds(self, record: Any) -> list[int]:
        """Step 3: read-only payload descriptors in manifest order, journal flushed (caller
        sends and closes them). A journal that cannot be written (a full disk) refuses the
        acquire with a typed error (``NoSpace``/``StoreIOError``, retryable) and no descriptor
        leaves: without its record, a restart could not know this process maps the artifact."""
        fds = [fd for _name, fd in self.d.store.open_payloads(record)]
        try:
            self.flush_journal()
        except BaseException:
            close_fds(fds)
            raise
        return fds

    def flush_journal(self) -> None:
        journal = getattr(self.d.store_service, "journal", None)
        if journal is not None:
            try:
                journal.flush()
            except OSError as exc:
                raise store_io.io_error(exc, "lease journal") from None

    def manifest(self, record: Any) -> tuple[bytes, str]:
        """The manifest's JSON bytes and their sha256 (hex), computed once per record."""
        cached = self._manifests.get(record.key)
        if cached is None or cached[0] is not record.manifest:
            data = record.manifest.to_json()
            cached = (record.manifest, data, hashlib.sha256(data).hexdigest())
            if len(self._manifests) > 4096:
                self._manifests.clear()
            self._manifests[record.key] = cached
        return cached[1], cached[2]
