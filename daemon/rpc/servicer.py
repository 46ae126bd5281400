"""The gRPC servicer: a thin adapter from proto messages to the daemon's domain objects.

Every handler validates its request, calls the domain (store, registry, publications) and maps
a typed ``HwrError`` to a status code through ``hwr.client.wire.STATUS_BY_CODE`` (the one
table), with the hwr error code and details in trailing metadata. Anything else is logged and
answered INTERNAL; the daemon keeps serving. Nothing here returns sentinels.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import grpc

from hwr import __version__
from hwr.client.errors import ArtifactNotFound, IdentityError, InvalidRequest
from hwr.client.identity import parse_canonical
from hwr.client.wire import MAX_WAIT_TIMEOUT_MS
from hwr.daemon.rpc.checkpoints import CheckpointsMixin
from hwr.daemon.rpc.remote import RemoteRpc
from hwr.daemon.rpc.store_admin import StoreAdminRpc
from hwr.daemon.rpc.support import rpc, session_of
from hwr.daemon.service.leasing import key_of, parse_identity
from hwr.daemon.service.roles import PUBLISH, authorize
from hwr.protos.hwr.v1 import hwr_pb2 as pb
from hwr.protos.hwr.v1 import hwr_pb2_grpc

if TYPE_CHECKING:
    from hwr.daemon.app.server import Daemon
    from hwr.daemon.service.sessions import Session

__all__ = ["Servicer"]

log = logging.getLogger("hwrd.rpc")
_HEX = frozenset("0123456789abcdef")
_KIND_NAMES = {pb.TENSOR_KIND_PARAMETER: "parameter", pb.TENSOR_KIND_BUFFER: "buffer",
               pb.TENSOR_KIND_UNSPECIFIED: "parameter"}
MAX_TENSORS = 1 << 20
MAX_PUBLICATION_BYTES = 1 << 50  # 1 PiB: far above any model, far below int64 overflow


class Servicer(RemoteRpc, StoreAdminRpc, CheckpointsMixin, hwr_pb2_grpc.HostWeightRuntimeServicer):
    """Sessions, leases, publication and inspection. Handlers of other concerns live in mixins
    (``hwr.daemon.rpc_*``, built on ``hwr.daemon.rpc.support``) listed before this class's bases."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    def _session(self, context: grpc.aio.ServicerContext) -> Session:
        return session_of(self.d, context)

    @rpc
    async def OpenSession(self, request: pb.OpenSessionRequest, context: Any) -> pb.OpenSessionResponse:
        session = self._session(context)
        if len(request.client_name) > 128 or len(request.client_version) > 128:
            raise InvalidRequest("client_name/client_version must be at most 128 characters")
        session.client_name = request.client_name
        session.client_version = request.client_version
        return pb.OpenSessionResponse(session_id=session.session_id, pid=session.cred.pid,
                                      uid=session.cred.uid, daemon_version=__version__)

    @rpc
    async def KeepAlive(self, request: pb.KeepAliveRequest, context: Any) -> pb.KeepAliveResponse:
        session = self._session(context)
        return pb.KeepAliveResponse(session_id=session.session_id, lease_count=len(session.leases),
                                    publication_count=self.d.publications.live_count(session))

    @rpc
    async def Acquire(self, request: pb.AcquireRequest, context: Any) -> pb.AcquireResponse:
        if request.artifact.WhichOneof("ref") == "checkpoint":
            return await self.acquire_checkpoint(request, context)  # hwr.daemon.rpc.checkpoints
        session = self._session(context)
        key = _ref_key(request.artifact)
        record, lease = await self.d.leasing.acquire(session, key)  # shared with the peer channel
        return pb.AcquireResponse(
            lease_id=lease.lease_id, lease_token=lease.token, key=key,
            manifest_json=self.d.manifest_bytes(record),
            files=[pb.PayloadFile(name=f.name, size=f.size) for f in record.manifest.files],
        )

    @rpc
    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        session = self._session(context)
        return pb.ReleaseResponse(released=self.d.leasing.release(session, request.lease_id))

    @rpc
    async def BeginPublication(
        self, request: pb.BeginPublicationRequest, context: Any
    ) -> pb.BeginPublicationResponse:
        session = authorize(self.d, context, PUBLISH, "begin a publication")
        identity = parse_identity(bytes(request.identity_json))
        specs = _specs(request.tensors)
        if request.wait_timeout_ms > MAX_WAIT_TIMEOUT_MS:
            raise InvalidRequest("wait_timeout_ms is out of range",
                                 details={"field": "wait_timeout_ms", "limit": MAX_WAIT_TIMEOUT_MS})
        result = await self.d.publications.begin(
            session, identity, specs, wait_timeout=request.wait_timeout_ms / 1000.0,
            format_metadata=_format_metadata(bytes(request.format_metadata_json)))
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
        )

    @rpc
    async def CommitPublication(
        self, request: pb.CommitPublicationRequest, context: Any
    ) -> pb.CommitPublicationResponse:
        session = authorize(self.d, context, PUBLISH, "commit a publication")
        record, joined = await self.d.publications.commit(
            session, request.publication_id, dict(request.expected_sha256))
        return pb.CommitPublicationResponse(key=record.key, joined=joined, size_bytes=record.size_bytes,
                                            content_sha256=record.manifest.artifact_content_sha256)

    @rpc
    async def AbortPublication(
        self, request: pb.AbortPublicationRequest, context: Any
    ) -> pb.AbortPublicationResponse:
        session = authorize(self.d, context, PUBLISH, "abort a publication")
        return pb.AbortPublicationResponse(
            aborted=await self.d.publications.abort(session, request.publication_id))

    @rpc
    async def ListArtifacts(self, request: pb.ListArtifactsRequest, context: Any) -> pb.ListArtifactsResponse:
        self._session(context)
        return pb.ListArtifactsResponse(artifacts=await self.d.artifact_infos(request.include_denied))

    @rpc
    async def InspectArtifact(
        self, request: pb.InspectArtifactRequest, context: Any
    ) -> pb.InspectArtifactResponse:
        self._session(context)
        key = await self.d.resolve_prefix(request.key)
        record = await self.d.record_any_state(key)  # ArtifactNotFound when it is gone
        if record is None:  # denied, its directory quarantined: only the deny marker is left
            return pb.InspectArtifactResponse(artifact=self.d.denied_info(key))
        if request.paged:  # hwr.daemon.policy.inspect_pages
            from hwr.daemon.policy.inspect_pages import page

            manifest, tensors, count, after = page(self.d.manifest_bytes(record), request.tensor_offset,
                                                   request.tensor_limit)
            return pb.InspectArtifactResponse(
                artifact=self.d.artifact_info(record), identity_json=record.identity_bytes, manifest_json=manifest,
                tensors_json=tensors, tensor_count=count, next_tensor_offset=after,
                remote_state=await self._remote_state(key) if not request.tensor_offset else "")
        return pb.InspectArtifactResponse(
            artifact=self.d.artifact_info(record), identity_json=record.identity_bytes,
            manifest_json=self.d.manifest_bytes(record), remote_state=await self._remote_state(key))

    async def _remote_state(self, key: str) -> str:
        return await self.d.fleet.key_state(key) if self.d.fleet is not None else ""

    @rpc
    async def ListLeases(self, request: pb.ListLeasesRequest, context: Any) -> pb.ListLeasesResponse:
        self._session(context)
        return pb.ListLeasesResponse(leases=[
            pb.LeaseInfo(lease_id=lease.lease_id, key=lease.key, session_id=lease.session_id,
                         pid=lease.pid, uid=lease.uid, client_name=lease.client_name,
                         acquired_at=lease.acquired_at)
            for lease in self.d.registry.leases()
        ])

    @rpc
    async def GetStatus(self, request: pb.GetStatusRequest, context: Any) -> pb.GetStatusResponse:
        self._session(context)
        return await self.d.status()


def _format_metadata(data: bytes) -> dict[str, Any] | None:
    """An optional canonical JSON object; anything else is INVALID_ARGUMENT."""
    if not data:
        return None
    if len(data) > 1 << 20:
        raise InvalidRequest("format_metadata_json is too large", details={"field": "format_metadata_json"})
    try:
        value = parse_canonical(data)
    except IdentityError as exc:
        raise InvalidRequest(f"format_metadata_json: {exc.message}",
                             details={"field": "format_metadata_json"}) from None
    if not isinstance(value, dict):
        raise InvalidRequest("format_metadata_json must be a JSON object", details={"field": "format_metadata_json"})
    return value


def _ref_key(ref: pb.ArtifactRef) -> str:
    which = ref.WhichOneof("ref")
    if which == "identity_json":
        return key_of(identity_json=bytes(ref.identity_json))
    return key_of(key=ref.key if which == "key" else None)


def _specs(tensors: Any) -> list[Any]:
    from hwr.client.safetensors_header import DTYPES
    from hwr.daemon.store.root import TensorSpec

    if not tensors:
        raise InvalidRequest("a publication needs at least one tensor", details={"field": "tensors"})
    if len(tensors) > MAX_TENSORS:
        raise InvalidRequest("too many tensors", details={"limit": MAX_TENSORS})
    seen: set[str] = set()
    specs = []
    total_bytes = 0
    for t in tensors:
        if not t.name or len(t.name) > 1024 or t.name in seen or t.name.startswith("__"):
            raise InvalidRequest("tensor names must be unique, non-empty, at most 1024 characters",
                                 details={"field": "tensors.name", "tensor": t.name[:200]})
        if t.dtype not in DTYPES:
            raise InvalidRequest(f"unsupported dtype {t.dtype[:16]!r}", details={"tensor": t.name[:200]})
        if len(t.shape) > 16 or any(d > (1 << 40) for d in t.shape):
            raise InvalidRequest("tensor shape out of range", details={"tensor": t.name[:200]})
        # Bounded before anything sizes, reserves or preallocates it (and before eviction makes
        # room for it): byte counts past 2**63 overflow the syscalls downstream.
        total_bytes += math.prod(t.shape) * DTYPES[t.dtype].itemsize
        if total_bytes > MAX_PUBLICATION_BYTES:
            raise InvalidRequest("the tensors' total size is out of range",
                                 details={"tensor": t.name[:200], "limit": MAX_PUBLICATION_BYTES})
        if t.kind not in _KIND_NAMES:
            raise InvalidRequest("unknown tensor kind", details={"tensor": t.name[:200]})
        seen.add(t.name)
        specs.append(TensorSpec(name=t.name, dtype=t.dtype, shape=tuple(int(d) for d in t.shape),
                                kind=_KIND_NAMES[t.kind], role=t.role or "weight"))
    return specs


def prefix_match(prefix: str, keys: list[str]) -> str:
    """Resolve a unique key prefix (pure)."""
    if len(prefix) < 4 or len(prefix) > 64 or not set(prefix) <= _HEX:
        raise InvalidRequest("a key prefix needs 4 to 64 lowercase hex digits", details={"key": prefix[:80]})
    matches = [k for k in keys if k.startswith(prefix)]
    if not matches:
        raise ArtifactNotFound("no artifact matches that key", details={"key": prefix})
    if len(matches) > 1:
        raise InvalidRequest("ambiguous key prefix", details={"key": prefix, "matches": len(matches)})
    return matches[0]


