"""gRPC handlers of the fleet tier: ListRemote, PullArtifact (streamed progress), PushArtifact.

Thin adapters over ``hwr.daemon.fleet.tier.Fleet``; errors map through ``STATUS_BY_CODE`` like every
handler's (``hwr.daemon.rpc.support``). Pull and push need the ``operator`` role
(``hwr.daemon.service.roles``); listing needs a session.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from hwr.client.errors import ArtifactNotFound, HwrError, InvalidRequest, Unsupported
from hwr.client.identity import is_key
from hwr.daemon.rpc.support import abort_with, rpc, session_of
from hwr.daemon.service.roles import OPERATOR, authorize
from hwr.protos.hwr.v1 import hwr_pb2 as pb

__all__ = ["RemoteRpc", "remote_status"]

PROGRESS_INTERVAL_S = 0.2
_HEX = frozenset("0123456789abcdef")


def _fleet(daemon: Any) -> Any:
    if daemon.fleet is None:
        raise Unsupported("hwrd has no remote tier configured (config key remote)")
    return daemon.fleet


async def remote_status(daemon: Any) -> pb.RemoteStatus | None:
    """The ``remote`` field of GetStatus (None when the tier is off)."""
    fleet = daemon.fleet
    if fleet is None:
        return None
    reachable, error = await fleet.reachable()
    return pb.RemoteStatus(url=fleet.location.display, reachable=reachable, error=error, push=fleet.push_enabled,
                           pending_pushes=len(fleet.pusher.pending()), pulls_in_flight=len(fleet.puller.in_flight),
                           bytes_pulled=fleet.bytes_pulled, bytes_pushed=fleet.bytes_pushed)


async def _remote_key(fleet: Any, text: str) -> str:
    """A full key, or a unique prefix among the remote's complete artifacts."""
    if is_key(text):
        return text
    if not 4 <= len(text) <= 64 or not set(text) <= _HEX:
        raise InvalidRequest("a key prefix needs 4 to 64 lowercase hex digits", details={"key": text[:80]})
    matches = [e.key for e in await fleet.entries() if e.ready and e.key.startswith(text)]
    if not matches:
        raise ArtifactNotFound(f"no artifact in remote {fleet.location.display} matches that key",
                               details={"key": text, "remote": fleet.location.display})
    if len(matches) > 1:
        raise InvalidRequest("ambiguous key prefix", details={"key": text, "matches": len(matches)})
    return str(matches[0])


class RemoteRpc:
    d: Any

    @rpc
    async def ListRemote(self, request: pb.ListRemoteRequest, context: Any) -> pb.ListRemoteResponse:
        session_of(self.d, context)
        fleet = _fleet(self.d)
        entries = await fleet.entries()
        local = await asyncio.to_thread(self.d.store.known_keys)
        return pb.ListRemoteResponse(url=fleet.location.display, artifacts=[
            pb.RemoteArtifact(key=e.key, size_bytes=e.size_bytes, complete=e.ready, local=e.key in local)
            for e in entries])

    async def PullArtifact(self, request: pb.PullArtifactRequest, context: Any) -> AsyncIterator[
            pb.PullArtifactResponse]:
        # Streaming: errors are mapped here, as in VerifyArtifact.
        try:
            authorize(self.d, context, OPERATOR, "pull")
            fleet = _fleet(self.d)
            key = await _remote_key(fleet, request.key)
            progress = await fleet.puller.start(key, fresh=True)
            task = progress.task
            assert task is not None
            while not task.done():
                await asyncio.wait({task}, timeout=PROGRESS_INTERVAL_S)
                if not task.done():
                    yield pb.PullArtifactResponse(done_bytes=progress.done_bytes, total_bytes=progress.total_bytes)
            record, outcome = task.result()
            # The eviction gate, as an acquire does after a pull (the record stays valid).
            record = await self.d.store_service.lookup(key)
        except HwrError as exc:
            await abort_with(context, exc)
            return
        yield pb.PullArtifactResponse(finished=True, key=key, outcome=outcome, size_bytes=record.size_bytes,
                                      done_bytes=progress.done_bytes, total_bytes=progress.total_bytes)

    @rpc
    async def PushArtifact(self, request: pb.PushArtifactRequest, context: Any) -> pb.PushArtifactResponse:
        authorize(self.d, context, OPERATOR, "push")
        fleet = _fleet(self.d)
        key = await self.d.store_service.resolve(request.key)
        record = await self.d.store_service.lookup(key)  # ArtifactNotFound / ArtifactDenied first
        outcome = await fleet.pusher.push(key)
        return pb.PushArtifactResponse(key=key, outcome=outcome, size_bytes=record.size_bytes)
