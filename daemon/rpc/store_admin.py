"""gRPC handlers of store administration: verify, deny/allow, pin/unpin, evict, gc, usage.

A thin adapter over ``hwr.daemon.service.store_service.StoreService`` (``self.d.store_service``); the
status codes of each RPC are documented in ``hwr.proto``. Verification streams progress at most
every 100 ms and then one verdict; a checksum mismatch is a verdict (ok=false), not a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from hwr.client.errors import HwrError, InvalidRequest
from hwr.daemon.rpc.support import rpc, session_of
from hwr.daemon.service.roles import OPERATOR, authorize
from hwr.protos.hwr.v1 import hwr_pb2 as pb

__all__ = ["StoreAdminRpc"]

PROGRESS_INTERVAL_S = 0.1


def _lease_infos(daemon: Any, key: str) -> list[pb.LeaseInfo]:
    return [pb.LeaseInfo(lease_id=x.lease_id, key=x.key, session_id=x.session_id, pid=x.pid, uid=x.uid,
                         client_name=x.client_name, acquired_at=x.acquired_at)
            for x in daemon.registry.leases() if x.key == key]


class StoreAdminRpc:
    d: Any

    async def VerifyArtifact(self, request: pb.VerifyArtifactRequest, context: Any) -> AsyncIterator[
            pb.VerifyArtifactResponse]:
        # A streaming handler cannot use @rpc (it wraps coroutines): errors before the first
        # message are mapped here the same way.
        from hwr.daemon.rpc.support import abort_with

        try:
            authorize(self.d, context, OPERATOR, "verify")
            key = await self.d.store_service.resolve(request.key)
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

        job = asyncio.ensure_future(asyncio.to_thread(self.d.store.verify, key, progress))
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
            self.d.metrics.count_verification_failure(exc.code)
            quarantined = exc.code == "CHECKSUM_MISMATCH"
            yield pb.VerifyArtifactResponse(
                key=key, finished=True, ok=False, error_code=exc.code, message=exc.message,
                quarantined=quarantined, affected_leases=_lease_infos(self.d, key))
            return
        total = record.size_bytes
        yield pb.VerifyArtifactResponse(key=key, finished=True, ok=True, done_bytes=total, total_bytes=total)

    @rpc
    async def DenyArtifact(self, request: pb.DenyArtifactRequest, context: Any) -> pb.DenyArtifactResponse:
        authorize(self.d, context, OPERATOR, "deny")
        if not request.reason or len(request.reason) > 1000:
            raise InvalidRequest("a deny needs a reason of at most 1000 characters", details={"field": "reason"})
        key = await self.d.store_service.resolve(request.key)
        await asyncio.to_thread(self.d.store.deny, key, request.reason)
        return pb.DenyArtifactResponse(key=key, affected_leases=_lease_infos(self.d, key))

    @rpc
    async def AllowArtifact(self, request: pb.AllowArtifactRequest, context: Any) -> pb.AllowArtifactResponse:
        authorize(self.d, context, OPERATOR, "allow")
        key = await self.d.store_service.resolve(request.key)
        was = self.d.store.deny_reason(key) is not None
        await asyncio.to_thread(self.d.store.allow, key)
        # Re-validate now, so that ls and status list it again before anyone acquires it (one
        # that fails validation is denied again, for that reason).
        with contextlib.suppress(HwrError):
            await asyncio.to_thread(self.d.store.lookup, key)
        return pb.AllowArtifactResponse(key=key, was_denied=was)

    @rpc
    async def PinArtifact(self, request: pb.PinArtifactRequest, context: Any) -> pb.PinArtifactResponse:
        authorize(self.d, context, OPERATOR, "pin")
        key = await self.d.store_service.resolve(request.key)
        already, size, locked, residency = await self.d.store_service.pin(key)
        return pb.PinArtifactResponse(key=key, already_pinned=already, size_bytes=size, locked_bytes=locked,
                                      residency=residency)

    @rpc
    async def UnpinArtifact(self, request: pb.UnpinArtifactRequest, context: Any) -> pb.UnpinArtifactResponse:
        authorize(self.d, context, OPERATOR, "unpin")
        key = await self.d.store_service.resolve(request.key)
        return pb.UnpinArtifactResponse(key=key, was_pinned=await self.d.store_service.unpin(key))

    @rpc
    async def EvictArtifact(self, request: pb.EvictArtifactRequest, context: Any) -> pb.EvictArtifactResponse:
        authorize(self.d, context, OPERATOR, "evict")
        key = await self.d.store_service.resolve(request.key)
        return pb.EvictArtifactResponse(key=key, freed_bytes=await self.d.store_service.evict(key))

    @rpc
    async def CollectGarbage(self, request: pb.CollectGarbageRequest, context: Any) -> pb.CollectGarbageResponse:
        authorize(self.d, context, OPERATOR, "gc")
        target = request.target_bytes if request.HasField("target_bytes") else None
        report, store_bytes, target_bytes, staging = await self.d.store_service.collect_garbage(target)
        return pb.CollectGarbageResponse(
            evicted=report.evicted, freed_bytes=report.freed_bytes, store_bytes=store_bytes,
            target_bytes=target_bytes, staging_reclaimed=staging,
            skipped=[pb.SkippedArtifact(key=k, reason=r) for k, r in report.skipped])

    @rpc
    async def GetStoreUsage(self, request: pb.GetStoreUsageRequest, context: Any) -> pb.GetStoreUsageResponse:
        session_of(self.d, context)
        svc = self.d.store_service
        sizes = await asyncio.to_thread(self.d.store.rescan_usage)  # the disk's truth for an operator
        usage = await svc.usage()
        pinned = svc.pins.keys()
        return pb.GetStoreUsageResponse(
            store_bytes=usage.committed_bytes, reserved_bytes=usage.reserved_bytes,
            store_limit_bytes=svc.policy.store_limit_bytes, artifact_limit_bytes=svc.policy.artifact_limit_bytes,
            min_free_bytes=svc.policy.min_free_bytes, free_bytes=usage.free_bytes,
            pinned_bytes=sum(sizes.get(k, 0) for k in pinned), locked_bytes=svc.residency.locked_bytes,
            evictions=svc.evictions,
            artifacts=[pb.ArtifactUsage(key=k, size_bytes=n, last_access=svc.access.get(k, 0.0), pinned=k in pinned,
                                        leases=self.d.registry.lease_count(k), held_by_pids=svc.held_pids(k))
                       for k, n in sorted(sizes.items())])
