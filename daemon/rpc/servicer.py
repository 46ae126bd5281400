"""The gRPC servicer: a thin adapter from proto messages to the daemon's domain objects.

Every handler validates its request, calls the service room (the read API ``Catalog``, the lease
table, ``Leasing``, publications; all in ``RpcCollaborators``, passed in when built) and maps
a typed ``HwrError`` to a status code through ``hwr.client.wire.STATUS_BY_CODE`` (the one
table), with the hwr error code and details in trailing metadata. Anything else is logged and
answered INTERNAL; the daemon keeps serving. Nothing here returns sentinels.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from hwr import __version__
from hwr.client.errors import InvalidRequest
from hwr.client.identity import is_key
from hwr.daemon.policy.cursor_pages import cursor_page
from hwr.daemon.rpc.channels import ChannelsRpc, channel_info
from hwr.daemon.rpc.checkpoints import CheckpointsMixin
from hwr.daemon.rpc.collaborators import Ctx, Handlers, RpcCollaborators
from hwr.daemon.rpc.messages import artifact_info, denied_info, lease_infos
from hwr.daemon.rpc.remote import RemoteRpc, remote_status
from hwr.daemon.rpc.store_admin import StoreAdminRpc
from hwr.daemon.rpc.support import rpc
from hwr.daemon.service.leasing import ArtifactRef, parse_identity
from hwr.daemon.service.publication_checks import RequestedTensor, format_metadata, tensor_specs, wait_timeout_s
from hwr.daemon.service.roles import PUBLISH
from hwr.protos.hwr.v1 import hwr_pb2 as pb
from hwr.protos.hwr.v1 import hwr_pb2_grpc

if TYPE_CHECKING:
    from hwr.daemon.service.catalog import ArtifactRecord

__all__ = ["Servicer"]

#: Leases per page of the paged ListLeases: a LeaseInfo is at most ~650 bytes (client names are
#: at most 128 characters), so a page stays under ~1.3 MiB.
LEASE_PAGE = 2000
_KIND_NAMES = {pb.TENSOR_KIND_PARAMETER: "parameter", pb.TENSOR_KIND_BUFFER: "buffer",
               pb.TENSOR_KIND_UNSPECIFIED: "parameter"}


class Servicer(ChannelsRpc, RemoteRpc, StoreAdminRpc, CheckpointsMixin, Handlers,
               hwr_pb2_grpc.HostWeightRuntimeServicer):
    """Sessions, leases, publication and inspection. Handlers of other concerns live in mixins
    (``hwr.daemon.rpc.*``, built on ``hwr.daemon.rpc.collaborators.Handlers``) listed before
    this class's bases."""

    def __init__(self, collaborators: RpcCollaborators) -> None:
        self.c = collaborators

    @rpc
    async def OpenSession(self, request: pb.OpenSessionRequest, context: Ctx) -> pb.OpenSessionResponse:
        session = self._session(context)
        if len(request.client_name) > 128 or len(request.client_version) > 128:
            raise InvalidRequest("client_name/client_version must be at most 128 characters")
        session.client_name = request.client_name
        session.client_version = request.client_version
        return pb.OpenSessionResponse(session_id=session.session_id, pid=session.cred.pid,
                                      uid=session.cred.uid, daemon_version=__version__)

    @rpc
    async def KeepAlive(self, request: pb.KeepAliveRequest, context: Ctx) -> pb.KeepAliveResponse:
        session = self._session(context)
        return pb.KeepAliveResponse(session_id=session.session_id, lease_count=len(session.leases),
                                    publication_count=self.c.publications.live_count(session))

    @rpc
    async def Acquire(self, request: pb.AcquireRequest, context: Ctx) -> pb.AcquireResponse:
        if request.artifact.WhichOneof("ref") == "checkpoint":
            return await self.acquire_checkpoint(request, context)  # hwr.daemon.rpc.checkpoints
        session = self._session(context)
        ref = request.artifact
        key = self.c.leasing.key_for(_artifact_ref(ref))
        # The peer socket's grant; gRPC carries no descriptors (they come on the peer socket).
        grant = await self.c.leasing.grant(session, key, descriptors=False)
        return pb.AcquireResponse(
            lease_id=grant.lease_id, lease_token=grant.token, key=grant.key, manifest_json=grant.manifest,
            files=[pb.PayloadFile(name=f.name, size=f.size) for f in grant.record.manifest.files],
        )

    @rpc
    async def Release(self, request: pb.ReleaseRequest, context: Ctx) -> pb.ReleaseResponse:
        session = self._session(context)
        return pb.ReleaseResponse(released=self.c.leasing.release(session, request.lease_id))

    @rpc
    async def BeginPublication(
        self, request: pb.BeginPublicationRequest, context: Ctx
    ) -> pb.BeginPublicationResponse:
        session = self._authorize(context, PUBLISH, "begin a publication")
        identity = parse_identity(bytes(request.identity_json))
        specs = tensor_specs([RequestedTensor(t.name, t.dtype, tuple(t.shape), _KIND_NAMES.get(t.kind), t.role)
                              for t in request.tensors])
        wait_timeout = wait_timeout_s(request.wait_timeout_ms)
        result = await self.c.publications.begin(
            session, identity, specs, wait_timeout=wait_timeout,
            format_metadata=format_metadata(bytes(request.format_metadata_json)),
            channel=request.channel or None, durable=not request.non_durable, overlap=request.overlap_hashing,
            reuse_base=_reuse_base(request.reuse_base), reuse=list(request.reuse_tensors))
        if result.publication is None:
            outcome = (pb.BEGIN_OUTCOME_JOINED if result.outcome == "joined"
                       else pb.BEGIN_OUTCOME_ALREADY_PRESENT)
            return pb.BeginPublicationResponse(outcome=outcome, key=result.key)
        pub = result.publication
        staging = pub.staging
        index = {name: i for i, (name, _path, _size) in enumerate(staging.files)}
        return pb.BeginPublicationResponse(
            outcome=pb.BEGIN_OUTCOME_STAGED, key=result.key, publication_id=pub.publication_id,
            publication_token=pub.token,
            files=[pb.PayloadFile(name=name, size=size) for name, _path, size in staging.files],
            placements=[pb.TensorPlacement(name=name, file_index=index[fname], offset=offset, nbytes=nbytes)
                        for name, (fname, offset, nbytes) in sorted(staging.placements.items())],
            reused=result.reused,
        )

    @rpc
    async def CommitPublication(
        self, request: pb.CommitPublicationRequest, context: Ctx
    ) -> pb.CommitPublicationResponse:
        session = self._authorize(context, PUBLISH, "commit a publication")
        record, joined = await self.c.publications.commit(
            session, request.publication_id, dict(request.expected_sha256))
        return pb.CommitPublicationResponse(key=record.key, joined=joined, size_bytes=record.size_bytes,
                                            content_sha256=record.manifest.artifact_content_sha256)

    @rpc
    async def AbortPublication(
        self, request: pb.AbortPublicationRequest, context: Ctx
    ) -> pb.AbortPublicationResponse:
        session = self._authorize(context, PUBLISH, "abort a publication")
        return pb.AbortPublicationResponse(
            aborted=await self.c.publications.abort(session, request.publication_id))

    @rpc
    async def ListArtifacts(self, request: pb.ListArtifactsRequest,
                            context: Ctx) -> pb.ListArtifactsResponse:
        self._session(context)
        entries = await self.c.catalog.entries(request.include_denied)
        return pb.ListArtifactsResponse(artifacts=[
            self._info(e.record) if e.record is not None else self._denied_info(e.key) for e in entries])

    @rpc
    async def InspectArtifact(
        self, request: pb.InspectArtifactRequest, context: Ctx
    ) -> pb.InspectArtifactResponse:
        self._session(context)
        catalog = self.c.catalog
        key = await catalog.resolve(request.key)
        record = await catalog.record_any_state(key)  # ArtifactNotFound when it is gone
        if record is None:  # denied, its directory quarantined: only the deny marker is left
            return pb.InspectArtifactResponse(artifact=self._denied_info(key))
        if request.paged:  # hwr.daemon.policy.inspect_pages
            from hwr.daemon.policy.inspect_pages import page

            manifest, tensors, count, after = page(catalog.manifest(record)[0], request.tensor_offset,
                                                   request.tensor_limit)
            return pb.InspectArtifactResponse(
                artifact=self._info(record), identity_json=record.identity_bytes, manifest_json=manifest,
                tensors_json=tensors, tensor_count=count, next_tensor_offset=after,
                remote_state=await self._remote_state(key) if not request.tensor_offset else "",
                channels=self._channel_names(key), non_durable=catalog.is_volatile(key))
        return pb.InspectArtifactResponse(
            artifact=self._info(record), identity_json=record.identity_bytes,
            manifest_json=catalog.manifest(record)[0], remote_state=await self._remote_state(key),
            channels=self._channel_names(key), non_durable=catalog.is_volatile(key))

    def _channel_names(self, key: str) -> list[str]:
        return self.c.channels.named(key) if self.c.channels is not None else []

    def _info(self, record: ArtifactRecord) -> pb.ArtifactInfo:
        return artifact_info(record, self.c.catalog.deny_reason(record.key), self.c.registry.lease_count(record.key))

    def _denied_info(self, key: str) -> pb.ArtifactInfo:
        return denied_info(key, self.c.catalog.deny_reason(key), self.c.registry.lease_count(key))

    async def _remote_state(self, key: str) -> str:
        fleet = self.c.fleet
        return await fleet.key_state(key) if fleet is not None else ""

    @rpc
    async def ListLeases(self, request: pb.ListLeasesRequest, context: Ctx) -> pb.ListLeasesResponse:
        self._session(context)
        leases = self.c.registry.leases()
        if not request.paged:
            return pb.ListLeasesResponse(leases=lease_infos(leases))
        leases.sort(key=lambda x: x.lease_id)
        page, after = cursor_page(leases, lambda x: x.lease_id, request.after, request.limit, LEASE_PAGE)
        return pb.ListLeasesResponse(leases=lease_infos(page), next_after=after, total=len(leases))

    @rpc
    async def GetStatus(self, request: pb.GetStatusRequest, context: Ctx) -> pb.GetStatusResponse:
        self._session(context)
        c = self.c
        records = await c.catalog.records()
        return pb.GetStatusResponse(
            version=__version__, root=str(c.settings.config.root), socket=str(c.socket_path),
            artifacts=len(records), leases=c.registry.lease_count(),
            sessions=len(c.registry.sessions()), publications=len(c.publications.active()),
            store_bytes=sum(r.size_bytes for r in records), uptime_s=time.monotonic() - c.started,
            pid=os.getpid(), remote=await remote_status(c.fleet),
            channels=[channel_info(s, c.channels.watcher_count(s.name), history=False) for s in c.channels.states()]
            if c.channels is not None else [],
        )


def _reuse_base(base: str) -> str | None:
    if base and not is_key(base):
        raise InvalidRequest("reuse_base must be a 64-hex key", details={"field": "reuse_base"})
    return base or None


def _artifact_ref(ref: pb.ArtifactRef) -> ArtifactRef:
    """The request's reference, decoded (``Leasing.key_for`` resolves it)."""
    which = ref.WhichOneof("ref")
    if which == "identity_json":
        return ArtifactRef(identity_json=bytes(ref.identity_json))
    if which == "channel":
        return ArtifactRef(channel=ref.channel)
    return ArtifactRef(key=ref.key if which == "key" else None)
