"""gRPC handlers of the fleet tier: ListRemote, PullArtifact (streamed progress), PushArtifact,
ListPeerHolders.

Thin adapters over ``hwr.daemon.fleet.tier.Fleet``; errors map through ``STATUS_BY_CODE`` like every
handler's (``hwr.daemon.rpc.support``). Pull and push need the ``operator`` role
(``hwr.daemon.service.roles``); listing (the remote's artifacts, the peer tier's holder records)
needs a session.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from hwr.client.errors import ArtifactNotFound, HwrError, Unsupported
from hwr.client.identity import is_key
from hwr.daemon.fleet.peer_tier import Holder, Holders
from hwr.daemon.policy.cursor_pages import cursor_page
from hwr.daemon.policy.key_prefix import is_prefix, unique_prefix
from hwr.daemon.rpc.collaborators import Ctx, Handlers
from hwr.daemon.rpc.support import abort_with, rpc
from hwr.daemon.service.roles import OPERATOR
from hwr.protos.hwr.v1 import hwr_pb2 as pb

if TYPE_CHECKING:
    from hwr.daemon.fleet.tier import Fleet

__all__ = ["RemoteRpc", "remote_status"]

PROGRESS_INTERVAL_S = 0.2
#: Keys per page of the paged ListRemote: a RemoteArtifact is about 85 bytes (~1.7 MiB a page).
REMOTE_PAGE = 20_000


def _fleet(fleet: Fleet | None) -> Fleet:
    if fleet is None:
        raise Unsupported("hwrd has no remote tier configured (config key remote)")
    return fleet


async def remote_status(fleet: Fleet | None) -> pb.RemoteStatus | None:
    """The ``remote`` field of GetStatus (None when the tier is off)."""
    if fleet is None:
        return None
    reachable, error, error_code = await fleet.reachable()
    pulls = [pb.RemotePull(key=p.key, phase=p.phase, done_bytes=p.done_bytes, total_bytes=p.total_bytes,
                           started_at=p.started_at, waiters=[
                               pb.PullWaiter(session_id=w.session_id, pid=w.pid, uid=w.uid,
                                             client_name=w.client_name, since=w.since)
                               for w in sorted(p.waiters.values(), key=lambda w: w.since)])
             for p in sorted(fleet.puller.in_flight.values(), key=lambda p: p.started_at)]
    return pb.RemoteStatus(url=fleet.location.display, reachable=reachable, error=error, error_code=error_code,
                           push=fleet.push_enabled,
                           pending_pushes=len(fleet.pusher.pending()), pulls_in_flight=len(fleet.puller.in_flight),
                           bytes_pulled=fleet.bytes_pulled, bytes_pushed=fleet.bytes_pushed, pulls=pulls,
                           peers=peer_status(fleet))


def peer_status(fleet: Fleet) -> pb.PeerTierStatus | None:
    """The peer tier's part of ``remote`` (None when it is off)."""
    if fleet.peers is None:
        return None
    s = fleet.peers.status()
    pulls = [pb.PeerPull(key=p["key"], peers=p["peers"], done_bytes=p["done_bytes"], total_bytes=p["total_bytes"],
                         started_at=p["started_at"], from_store_bytes=p["from_store_bytes"],
                         verified_bytes=p["verified_bytes"]) for p in s["pulls"]]
    return pb.PeerTierStatus(
        node=s["node"], address=s["address"], serve=s["serve"], fetch=s["fetch"], served_bytes=s["served_bytes"],
        serving_peers=s["serving_peers"], fetched_bytes=s["fetched_bytes"], fallback_bytes=s["fallback_bytes"],
        refused=s["refused"], lying_peers=s["lying_peers"], failed_peers=s["failed_peers"],
        peer_pulls=s["peer_pulls"], cap_bytes_per_s=s["cap_bytes_per_s"], agent_rss_bytes=s["agent_rss_bytes"],
        pulls=pulls, agent_restarts=s["agent_restarts"], agent_pid=s["agent_pid"],
        staging_served_bytes=s["staging_served_bytes"], partial_fetched_bytes=s["partial_fetched_bytes"])


async def _remote_key(fleet: Fleet, text: str) -> str:
    """A full key, or a unique prefix among the remote's complete artifacts."""
    if is_key(text):
        return text
    where = fleet.location.display
    ready = [e.key for e in await fleet.entries() if e.ready] if is_prefix(text) else []
    return unique_prefix(text, ready, missing=lambda p: ArtifactNotFound(
        f"no artifact in remote {where} matches that key", details={"key": p, "remote": where}))


class RemoteRpc(Handlers):
    @rpc
    async def ListRemote(self, request: pb.ListRemoteRequest, context: Ctx) -> pb.ListRemoteResponse:
        self._session(context)
        fleet = _fleet(self.c.fleet)
        entries = await fleet.entries()
        local = await self.c.catalog.known_keys()
        total, next_after = 0, ""
        if request.paged:
            entries = sorted(entries, key=lambda e: e.key)
            total = len(entries)
            entries, next_after = cursor_page(entries, lambda e: e.key, request.after, request.limit, REMOTE_PAGE)
        return pb.ListRemoteResponse(url=fleet.location.display, next_after=next_after, total=total, artifacts=[
            pb.RemoteArtifact(key=e.key, size_bytes=e.size_bytes, complete=e.ready, local=e.key in local)
            for e in entries])

    async def PullArtifact(self, request: pb.PullArtifactRequest, context: Ctx) -> AsyncIterator[
            pb.PullArtifactResponse]:
        # Streaming: errors are mapped here, as in VerifyArtifact.
        try:
            self._authorize(context, OPERATOR, "pull")
            fleet = _fleet(self.c.fleet)
            key = await _remote_key(fleet, request.key)
            progress = await fleet.puller.start(key, fresh=True)
            task = progress.task
            assert task is not None
            while not task.done():
                await asyncio.wait({task}, timeout=PROGRESS_INTERVAL_S)
                if not task.done():
                    yield pb.PullArtifactResponse(done_bytes=progress.done_bytes, total_bytes=progress.total_bytes)
            record, outcome = task.result()
            # The wait on an eviction round, as an acquire does after a pull (the record stays valid).
            record = await self.c.catalog.record_or_pull(key, how=None)
        except HwrError as exc:
            await abort_with(context, exc)
            return
        yield pb.PullArtifactResponse(finished=True, key=key, outcome=outcome, size_bytes=record.size_bytes,
                                      done_bytes=progress.done_bytes, total_bytes=progress.total_bytes)

    @rpc
    async def PushArtifact(self, request: pb.PushArtifactRequest, context: Ctx) -> pb.PushArtifactResponse:
        self._authorize(context, OPERATOR, "push")
        fleet = _fleet(self.c.fleet)
        key = await self.c.catalog.resolve(request.key)
        record = await self.c.catalog.record_or_pull(key, how=None)  # ArtifactNotFound / ArtifactDenied first
        outcome = await fleet.pusher.push(key)
        return pb.PushArtifactResponse(key=key, outcome=outcome, size_bytes=record.size_bytes)

    @rpc
    async def ListPeerHolders(self, request: pb.ListPeerHoldersRequest, context: Ctx) -> pb.ListPeerHoldersResponse:
        self._session(context)
        fleet = _fleet(self.c.fleet)
        if is_key(request.key):  # records may name a key that neither lists (yet)
            keys = [request.key]
        else:
            keys = sorted({e.key for e in await fleet.entries()} | await self.c.catalog.known_keys())
        if request.key and not is_key(request.key):
            where = fleet.location.display
            keys = [unique_prefix(request.key, keys, missing=lambda p: ArtifactNotFound(
                f"no artifact in remote {where} or on this node matches that key",
                details={"key": p, "remote": where}))]
        # A reader of its own: the listing works whether or not this node's peer tier is on.
        holders = fleet.peers.holders if fleet.peers is not None else Holders(fleet.remote, "", "", 0.0)

        def read() -> list[tuple[str, list[Holder]]]:
            return [(key, holders.records(key)) for key in keys]

        found = await asyncio.to_thread(read)
        now = time.time()
        return pb.ListPeerHoldersResponse(node=fleet.peers.node if fleet.peers is not None else "", now=now, holders=[
            pb.PeerHolder(key=key, node=h.node, address=h.address, recorded_at=h.recorded_at,
                          expires_at=h.expires_at, live=h.expires_at > now)
            for key, records in found for h in records])
