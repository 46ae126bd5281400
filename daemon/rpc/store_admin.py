"""gRPC handlers of store administration: verify, deny/allow, pin/unpin, evict, gc, usage.

A thin adapter over the read API (``Catalog``, ``self.c.catalog``: verify, deny, allow, usage
rescan, and ``resolve``: one namespace for every command), the service's ``Capacity``
(``self.c.capacity``: evict, gc, usage) and ``Pinning`` (``self.c.pinning``: pin, unpin); the
status codes of each RPC are documented in ``hwr.proto``.
Verification streams progress at most every 100 ms and then one verdict; a checksum mismatch is
a verdict (ok=false), not a failure.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from hwr.client.errors import HwrError, InvalidRequest
from hwr.daemon.rpc.collaborators import Ctx, Handlers
from hwr.daemon.rpc.messages import lease_infos
from hwr.daemon.rpc.support import abort_with, rpc
from hwr.daemon.service.roles import OPERATOR
from hwr.protos.hwr.v1 import hwr_pb2 as pb

if TYPE_CHECKING:
    from hwr.daemon.service.sessions import Registry

__all__ = ["StoreAdminRpc"]

PROGRESS_INTERVAL_S = 0.1


def _lease_infos(registry: Registry, key: str) -> list[pb.LeaseInfo]:
    return lease_infos(x for x in registry.leases() if x.key == key)


class StoreAdminRpc(Handlers):
    async def _operator_key(self, context: Ctx, action: str, ref: str) -> str:
        """The caller holds the operator role (else ``PermissionDenied`` naming ``action``); the
        full key ``ref`` (a key or a unique prefix) names in the read API's namespace."""
        self._authorize(context, OPERATOR, action)
        return await self.c.catalog.resolve(ref)

    async def VerifyArtifact(self, request: pb.VerifyArtifactRequest, context: Ctx) -> AsyncIterator[
            pb.VerifyArtifactResponse]:
        # A streaming handler cannot use @rpc (it wraps coroutines): errors before the first
        # message are mapped here the same way.
        try:
            key = await self._operator_key(context, "verify", request.key)
        except HwrError as exc:
            await abort_with(context, exc)
            return
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        last = [0.0]

        def progress(done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] >= PROGRESS_INTERVAL_S or done >= total:
                last[0] = now
                loop.call_soon_threadsafe(queue.put_nowait, (done, total))

        job = asyncio.ensure_future(self.c.catalog.verify(key, progress))
        while not job.done():
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({job, getter}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                done, total = getter.result()
                yield pb.VerifyArtifactResponse(key=key, done_bytes=done, total_bytes=total)
            else:
                getter.cancel()
        try:
            record = job.result()
        except HwrError as exc:
            self.c.metrics.count_check_failure(exc.code)
            quarantined = exc.code == "CHECKSUM_MISMATCH"
            yield pb.VerifyArtifactResponse(
                key=key, finished=True, ok=False, error_code=exc.code, message=exc.message,
                quarantined=quarantined, affected_leases=_lease_infos(self.c.registry, key))
            return
        total = record.size_bytes
        yield pb.VerifyArtifactResponse(key=key, finished=True, ok=True, done_bytes=total, total_bytes=total)

    @rpc
    async def DenyArtifact(self, request: pb.DenyArtifactRequest, context: Ctx) -> pb.DenyArtifactResponse:
        self._authorize(context, OPERATOR, "deny")
        if not request.reason or len(request.reason) > 1000:
            raise InvalidRequest("a deny needs a reason of at most 1000 characters", details={"field": "reason"})
        key = await self.c.catalog.resolve(request.key)
        await asyncio.to_thread(self.c.catalog.deny_permanently, key, request.reason)
        return pb.DenyArtifactResponse(key=key, affected_leases=_lease_infos(self.c.registry, key))

    @rpc
    async def AllowArtifact(self, request: pb.AllowArtifactRequest, context: Ctx) -> pb.AllowArtifactResponse:
        key = await self._operator_key(context, "allow", request.key)
        return pb.AllowArtifactResponse(key=key, was_denied=await self.c.catalog.allow(key))

    @rpc
    async def PinArtifact(self, request: pb.PinArtifactRequest, context: Ctx) -> pb.PinArtifactResponse:
        key = await self._operator_key(context, "pin", request.key)
        already, size, locked, residency = await self.c.pinning.pin(key)
        return pb.PinArtifactResponse(key=key, already_pinned=already, size_bytes=size, locked_bytes=locked,
                                      residency=residency)

    @rpc
    async def UnpinArtifact(self, request: pb.UnpinArtifactRequest, context: Ctx) -> pb.UnpinArtifactResponse:
        key = await self._operator_key(context, "unpin", request.key)
        return pb.UnpinArtifactResponse(key=key, was_pinned=await self.c.pinning.unpin(key))

    @rpc
    async def EvictArtifact(self, request: pb.EvictArtifactRequest, context: Ctx) -> pb.EvictArtifactResponse:
        key = await self._operator_key(context, "evict", request.key)
        return pb.EvictArtifactResponse(key=key, freed_bytes=await self.c.capacity.evict(key))

    @rpc
    async def CollectGarbage(self, request: pb.CollectGarbageRequest, context: Ctx) -> pb.CollectGarbageResponse:
        self._authorize(context, OPERATOR, "gc")
        target = request.target_bytes if request.HasField("target_bytes") else None
        report, store_bytes, target_bytes, staging = await self.c.capacity.collect_garbage(target)
        return pb.CollectGarbageResponse(
            evicted=report.evicted, freed_bytes=report.freed_bytes, store_bytes=store_bytes,
            target_bytes=target_bytes, staging_reclaimed=staging,
            skipped=[pb.SkippedArtifact(key=k, reason=r) for k, r in report.skipped])

    @rpc
    async def GetStoreUsage(self, request: pb.GetStoreUsageRequest, context: Ctx) -> pb.GetStoreUsageResponse:
        self._session(context)
        svc, pins = self.c.capacity, self.c.pinning
        sizes = await self.c.catalog.rescan_usage()  # the disk's truth for an operator
        usage = await svc.usage()
        pinned = pins.pins.keys()
        return pb.GetStoreUsageResponse(
            store_bytes=usage.committed_bytes, reserved_bytes=usage.reserved_bytes,
            store_limit_bytes=svc.policy.store_limit_bytes, artifact_limit_bytes=svc.policy.artifact_limit_bytes,
            min_free_bytes=svc.policy.min_free_bytes, free_bytes=usage.free_bytes,
            pinned_bytes=sum(sizes.get(k, 0) for k in pinned), locked_bytes=pins.residency.locked_bytes,
            evictions=svc.evictor.evictions,
            artifacts=[pb.ArtifactUsage(key=k, size_bytes=n, last_access=svc.recency.last_use(k, 0.0),
                                        pinned=k in pinned, leases=self.c.registry.lease_count(k),
                                        held_by_pids=svc.holds.held_pids(k))
                       for k, n in sorted(sizes.items())])
