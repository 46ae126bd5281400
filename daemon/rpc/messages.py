"""Proto messages built from the service room's values (listing entries, leases); pure."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from hwr.protos.hwr.v1 import hwr_pb2 as pb

if TYPE_CHECKING:
    from hwr.daemon.service.sessions import LeaseRecord
    from hwr.daemon.store.inspection import ArtifactRecord

__all__ = ["artifact_info", "denied_info", "lease_infos"]


def artifact_info(record: ArtifactRecord, deny_reason: str | None, leases: int) -> pb.ArtifactInfo:
    """One artifact's listing entry; in memory only (the deny state is a dict lookup: no
    thread hop, which per artifact queued in the default executor under load)."""
    manifest = record.manifest
    identity = manifest.identity
    return pb.ArtifactInfo(
        key=record.key, size_bytes=record.size_bytes, deny_reason=deny_reason or "",
        state=pb.ARTIFACT_STATE_DENIED if deny_reason is not None else pb.ARTIFACT_STATE_READY,
        leases=leases, model_id=identity.source.model_id,
        component=identity.component.name, dtype=identity.representation.dtype,
        tensor_count=len(manifest.tensors), created_at=record.created_at,
        content_sha256=manifest.artifact_content_sha256,
    )


def denied_info(key: str, deny_reason: str | None, leases: int) -> pb.ArtifactInfo:
    """The listing entry of a denied key whose directory is gone (quarantined)."""
    return pb.ArtifactInfo(key=key, state=pb.ARTIFACT_STATE_DENIED, deny_reason=deny_reason or "", leases=leases)


def lease_infos(leases: Iterable[LeaseRecord]) -> list[pb.LeaseInfo]:
    return [pb.LeaseInfo(lease_id=x.lease_id, key=x.key, session_id=x.session_id, pid=x.pid, uid=x.uid,
                         client_name=x.client_name, acquired_at=x.acquired_at) for x in leases]
