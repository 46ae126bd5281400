"""The control RPCs of a client (inspection, checkpoints, prewarm, store administration, fleet
tier) and the conversion of their responses into plain dicts (what ``hwrctl --json`` prints).

``AdminCalls`` is a base class of ``Client``: these are about twenty thin wrappers, each one RPC
made through the client's ``Connection`` and its response converted; forwarding each from a
collaborator would repeat every signature for nothing. It needs only ``_connection``.

Contract: every failure raises the typed ``HwrError`` of the RPC's status (``hwr.client.wire``);
nothing returns ``None``/``False`` for an error. A verification's mismatch is a verdict, not an
error. The dict keys are stable for scripts (ARCHITECTURE.md fixes ``ls``, ``leases`` and
``status``); new keys may be added. After a reconnect every call is made once more except
VerifyArtifact (``Connection.NO_RETRY``) and Prewarm (a stream made on the stub directly). No
state of its own: thread safety is the connection's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from hwr.client.channel_calls import channel_dict
from hwr.client.errors import CheckpointNotFound, DaemonUnavailable, HwrError
from hwr.client.paths import checkpoint_ref
from hwr.client.wire import error_from_rpc
from hwr.protos.hwr.v1 import hwr_pb2 as pb

if TYPE_CHECKING:
    from hwr.client.connection import Connection

__all__ = ["STATE_NAMES", "AdminCalls"]

STATE_NAMES = {pb.ARTIFACT_STATE_READY: "ready", pb.ARTIFACT_STATE_DENIED: "denied",
               pb.ARTIFACT_STATE_PUBLISHING: "publishing", pb.ARTIFACT_STATE_UNSPECIFIED: "unknown"}

#: The deadline of a verification, pull or push: the bytes they move bound them, not a deadline of ours.
_LONG_CALL_S = 7 * 24 * 3600.0


class AdminCalls:
    """The control RPCs of ``Client`` (see the module contract)."""

    _connection: Connection

    # inspection -----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        r: pb.GetStatusResponse = self._connection.call("GetStatus", pb.GetStatusRequest())
        return {"version": r.version, "root": r.root, "socket": r.socket, "artifacts": r.artifacts,
                "leases": r.leases, "sessions": r.sessions, "publications": r.publications,
                "store_bytes": r.store_bytes, "uptime_s": round(r.uptime_s, 3), "pid": r.pid,
                "remote": _remote_status_dict(r.remote) if r.HasField("remote") else None,
                "channels": [channel_dict(c) for c in r.channels]}

    def list_artifacts(self, *, include_denied: bool = False) -> list[dict[str, Any]]:
        """The artifacts the daemon serves; ``include_denied`` adds the denied ones (``state``
        "denied", ``deny_reason`` the reason code)."""
        request = pb.ListArtifactsRequest(include_denied=include_denied)
        r: pb.ListArtifactsResponse = self._connection.call("ListArtifacts", request)
        return [_artifact_dict(a) for a in r.artifacts]

    def inspect(self, key: str) -> dict[str, Any]:
        """One artifact (ready or denied) with its identity, files and tensors; the tensor list
        comes in pages, so that any tensor count the daemon accepts fits gRPC's message limit."""
        r: pb.InspectArtifactResponse = self._connection.call(
            "InspectArtifact", pb.InspectArtifactRequest(key=key, paged=True))
        first = r
        out = _artifact_dict(r.artifact)
        out["identity"] = _json(r.identity_json)
        manifest = _json(r.manifest_json)
        out["files"] = manifest.get("files", []) if isinstance(manifest, dict) else []
        remote_state = r.remote_state or None  # of the first page (the others repeat it)
        tensors: list[Any] = list(_json(r.tensors_json) or []) if r.tensors_json else []
        full_key = r.artifact.key or key
        while r.tensors_json and r.next_tensor_offset < r.tensor_count:
            before = r.next_tensor_offset
            r = self._connection.call("InspectArtifact", pb.InspectArtifactRequest(
                key=full_key, paged=True, tensor_offset=before))
            if r.next_tensor_offset <= before:
                raise HwrError("hwrd returned an empty page of tensors", details={"key": full_key})
            tensors += _json(r.tensors_json) or []
        if not r.tensors_json and not tensors:  # an older daemon: the whole manifest at once
            tensors = manifest.get("tensors", []) if isinstance(manifest, dict) else []
        out["tensors"] = tensors
        out["remote_state"] = remote_state
        out["channels"] = list(first.channels)
        out["non_durable"] = first.non_durable
        return out

    def leases(self) -> list[dict[str, Any]]:
        """Every live lease, fetched in pages (any number fits gRPC's message limit); sorted by
        lease id. Leases granted or released while the pages come may be missing."""
        out: list[dict[str, Any]] = []
        for r in self._pages("ListLeases", pb.ListLeasesRequest):
            out += [_lease_dict(x) for x in r.leases]
        return out

    def _pages(self, method: str, request: Callable[..., Any]) -> Iterator[Any]:
        """The responses of a paged listing (``paged``/``after`` -> ``next_after``), first to last."""
        after = ""
        while True:
            r = self._connection.call(method, request(paged=True, after=after))
            yield r
            if not r.next_after:
                return
            if r.next_after <= after:
                raise HwrError(f"hwrd returned a {method} page that does not advance", details={"after": after})
            after = r.next_after

    def keepalive(self) -> dict[str, Any]:
        r: pb.KeepAliveResponse = self._connection.call("KeepAlive", pb.KeepAliveRequest())
        return {"session_id": r.session_id, "lease_count": r.lease_count,
                "publication_count": r.publication_count}

    # checkpoints and prewarm ----------------------------------------------------------------
    def add_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Register a checkpoint directory on the daemon's host; returns its description
        (``added`` is False when the same content was already registered)."""
        r: pb.AddCheckpointResponse = self._connection.call(
            "AddCheckpoint", pb.AddCheckpointRequest(path=os.path.abspath(path)))
        return {**_checkpoint_dict(r.checkpoint), "added": r.added}

    def list_checkpoints(self) -> list[dict[str, Any]]:
        r: pb.ListCheckpointsResponse = self._connection.call("ListCheckpoints", pb.ListCheckpointsRequest())
        return [_checkpoint_dict(c) for c in r.checkpoints]

    def prewarm(self, checkpoint: str | os.PathLike[str], producer: str, *, dtype: str = "",
                keep_fp32: Sequence[str] = (),
                tp_size: int = 0, tp_plan: bytes = b"", tp_ranks: Sequence[int] = (),
                timeout_s: float = 0.0, wait_timeout_s: float = 0.0,
                on_progress: Callable[[dict[str, Any]], None] | None = None,
                producer_config: bytes = b"") -> list[dict[str, Any]]:
        """Build artifacts from a registered checkpoint in the daemon; returns one dict per rank
        (``key``, ``tp_rank``, ``outcome``, ``size_bytes``, ``content_sha256``, ...).

        ``producer_config``: for ``vllm-omni``, the JSON object of vLLM-Omni config fields of the
        serving worker (``hwr.daemon.producers.vllm_omni``).
        ``checkpoint`` is an id, a unique id prefix, or a registered path (resolved as by
        ``checkpoint_ref``: a relative path is taken from this process's working directory).
        Blocks until the build ends (no gRPC deadline: the daemon's producer timeout bounds it).
        A ``KeyboardInterrupt`` while waiting cancels the call, which cancels the build in the
        daemon (the producer is killed, nothing is published), and is re-raised.
        """
        connection = self._connection
        connection.check_usable()
        ref = checkpoint_ref(checkpoint)
        request = pb.PrewarmRequest(
            checkpoint=ref, producer=producer, dtype=dtype, keep_fp32=list(keep_fp32),
            tp_size=tp_size, tp_plan=tp_plan, tp_ranks=list(tp_ranks),
            timeout_ms=int(timeout_s * 1000), wait_timeout_ms=int(wait_timeout_s * 1000),
            producer_config=producer_config)
        call = connection.stub.Prewarm(request, metadata=connection.metadata)
        result: list[dict[str, Any]] = []
        try:
            message: pb.PrewarmResponse
            for message in call:
                if message.WhichOneof("event") == "progress" and on_progress is not None:
                    p = message.progress
                    on_progress({"tp_rank": p.tp_rank, "done_bytes": p.done_bytes,
                                 "total_bytes": p.total_bytes, "tensor": p.tensor})
                elif message.WhichOneof("event") == "result":
                    result = [{"key": a.key, "tp_rank": a.tp_rank,
                               "outcome": pb.PrewarmOutcome.Name(a.outcome).removeprefix(
                                   "PREWARM_OUTCOME_").lower(),
                               "size_bytes": a.size_bytes, "content_sha256": a.content_sha256,
                               "producer_peak_rss_bytes": a.producer_peak_rss_bytes,
                               "build_seconds": round(a.build_seconds, 3)}
                              for a in message.result.artifacts]
        except grpc.RpcError as exc:
            error = error_from_rpc(exc)
            if isinstance(error, CheckpointNotFound) and ref != checkpoint:
                error = CheckpointNotFound(f"no checkpoint registered at {ref} (the path {os.fspath(checkpoint)!r} "
                                           "made absolute; registered ones: `hwrctl checkpoints`)",
                                           details={**error.details, "given": os.fspath(checkpoint)[:300]})
            raise error from None
        except BaseException:
            call.cancel()
            raise
        return result

    # store administration -------------------------------------------------------------------
    def verify(self, key: str, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Re-hash an artifact (key or unique prefix); ``progress(done, total)`` per update.

        Returns the verdict: ``ok``, ``error_code``, ``message``, ``quarantined`` and the
        ``affected_leases`` already granted on a corrupt artifact. A mismatch is a verdict (the
        daemon quarantined and denied the artifact), not an exception.
        """
        stream: Iterator[pb.VerifyArtifactResponse] = self._connection.call(
            "VerifyArtifact", pb.VerifyArtifactRequest(key=key), _LONG_CALL_S)
        try:
            for message in stream:
                if not message.finished:
                    if progress is not None:
                        progress(message.done_bytes, message.total_bytes)
                    continue
                return {"key": message.key, "ok": message.ok, "error_code": message.error_code,
                        "message": message.message, "quarantined": message.quarantined,
                        "size_bytes": message.total_bytes,
                        "affected_leases": [_lease_dict(x) for x in message.affected_leases]}
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        raise DaemonUnavailable("the verification stream ended without a verdict")

    def deny(self, key: str, reason: str) -> dict[str, Any]:
        r: pb.DenyArtifactResponse = self._connection.call(
            "DenyArtifact", pb.DenyArtifactRequest(key=key, reason=reason))
        return {"key": r.key, "affected_leases": [_lease_dict(x) for x in r.affected_leases]}

    def allow(self, key: str) -> dict[str, Any]:
        r: pb.AllowArtifactResponse = self._connection.call("AllowArtifact", pb.AllowArtifactRequest(key=key))
        return {"key": r.key, "was_denied": r.was_denied}

    def pin(self, key: str) -> dict[str, Any]:
        r: pb.PinArtifactResponse = self._connection.call("PinArtifact", pb.PinArtifactRequest(key=key))
        return {"key": r.key, "already_pinned": r.already_pinned, "size_bytes": r.size_bytes,
                "locked_bytes": r.locked_bytes, "residency": r.residency}

    def unpin(self, key: str) -> dict[str, Any]:
        r: pb.UnpinArtifactResponse = self._connection.call("UnpinArtifact", pb.UnpinArtifactRequest(key=key))
        return {"key": r.key, "was_pinned": r.was_pinned}

    def evict(self, key: str) -> dict[str, Any]:
        """Evict one artifact; ``ActiveLease`` (``details['reason']``) when it is in use."""
        r: pb.EvictArtifactResponse = self._connection.call("EvictArtifact", pb.EvictArtifactRequest(key=key))
        return {"key": r.key, "freed_bytes": r.freed_bytes}

    def gc(self, target_bytes: int | None = None) -> dict[str, Any]:
        request = pb.CollectGarbageRequest()
        if target_bytes is not None:
            request.target_bytes = target_bytes
        r: pb.CollectGarbageResponse = self._connection.call("CollectGarbage", request, 3600.0)
        return {"evicted": list(r.evicted), "freed_bytes": r.freed_bytes, "store_bytes": r.store_bytes,
                "target_bytes": r.target_bytes, "staging_reclaimed": r.staging_reclaimed,
                "skipped": [{"key": x.key, "reason": x.reason} for x in r.skipped]}

    def store_usage(self) -> dict[str, Any]:
        r: pb.GetStoreUsageResponse = self._connection.call("GetStoreUsage", pb.GetStoreUsageRequest())
        return {"store_bytes": r.store_bytes, "reserved_bytes": r.reserved_bytes,
                "store_limit_bytes": r.store_limit_bytes, "artifact_limit_bytes": r.artifact_limit_bytes,
                "min_free_bytes": r.min_free_bytes, "free_bytes": r.free_bytes, "pinned_bytes": r.pinned_bytes,
                "locked_bytes": r.locked_bytes, "evictions": r.evictions,
                "artifacts": [{"key": a.key, "size_bytes": a.size_bytes, "last_access": a.last_access,
                               "pinned": a.pinned, "leases": a.leases, "held_by_pids": list(a.held_by_pids)}
                              for a in r.artifacts]}

    # fleet tier (the daemon's remote object store) ------------------------------------------
    def remote_list(self) -> list[dict[str, Any]]:
        """The remote's artifacts: ``key``, ``size_bytes``, ``state`` (complete | incomplete), ``local``."""
        out: list[dict[str, Any]] = []
        for r in self._pages("ListRemote", pb.ListRemoteRequest):
            out += [{"key": a.key, "size_bytes": a.size_bytes, "state": "complete" if a.complete else "incomplete",
                     "local": a.local, "remote": r.url} for a in r.artifacts]
        return out

    def peer_holders(self, key: str = "") -> dict[str, Any]:
        """The peer tier's holder records in the remote, for one key (full or a unique prefix) or,
        with ``key=""``, for every artifact of the remote and of the node: ``node`` (this node's
        name, "" when its peer tier is off), ``now`` (hwrd's clock) and ``holders``, each with
        ``key``, ``node``, ``address``, ``recorded_at`` (0: not said), ``expires_at``, ``live``."""
        r: pb.ListPeerHoldersResponse = self._connection.call("ListPeerHolders", pb.ListPeerHoldersRequest(key=key))
        return {"node": r.node, "now": r.now,
                "holders": [{"key": h.key, "node": h.node, "address": h.address, "recorded_at": h.recorded_at,
                             "expires_at": h.expires_at, "live": h.live} for h in r.holders]}

    def pull(self, key: str, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Pull an artifact from the remote into the store (verified); ``progress(done, total)``.
        Returns ``key``, ``outcome`` (pulled | already_present) and ``size_bytes``."""
        stream: Iterator[pb.PullArtifactResponse] = self._connection.call(
            "PullArtifact", pb.PullArtifactRequest(key=key), _LONG_CALL_S)
        try:
            for m in stream:
                if progress is not None and m.total_bytes:
                    progress(m.done_bytes, m.total_bytes)
                if not m.finished:
                    continue
                return {"key": m.key, "outcome": m.outcome, "size_bytes": m.size_bytes}
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        raise HwrError("the pull ended without a result")

    def push(self, key: str) -> dict[str, Any]:
        """Upload an artifact to the remote now: ``key``, ``outcome`` (pushed | already_present), ``size_bytes``."""
        r: pb.PushArtifactResponse = self._connection.call("PushArtifact", pb.PushArtifactRequest(key=key),
                                                           _LONG_CALL_S)
        return {"key": r.key, "outcome": r.outcome, "size_bytes": r.size_bytes}


def _json(data: bytes) -> Any:
    """A JSON document of a response (identity, manifest, tensor page); {} when empty or malformed."""
    try:
        return json.loads(data) if data else {}
    except ValueError:
        return {}


def _artifact_dict(a: pb.ArtifactInfo) -> dict[str, Any]:
    return {"key": a.key, "size_bytes": a.size_bytes, "state": STATE_NAMES.get(a.state, "unknown"),
            "leases": a.leases, "model_id": a.model_id, "component": a.component, "dtype": a.dtype,
            "tensors": a.tensor_count, "created_at": a.created_at, "content_sha256": a.content_sha256,
            "deny_reason": a.deny_reason}


def _remote_status_dict(r: pb.RemoteStatus) -> dict[str, Any]:
    return {"url": r.url, "reachable": r.reachable, "error": r.error or None, "error_code": r.error_code or None,
            "push": r.push,
            "pending_pushes": r.pending_pushes, "pulls_in_flight": r.pulls_in_flight,
            "bytes_pulled": r.bytes_pulled, "bytes_pushed": r.bytes_pushed,
            "pulls": [{"key": p.key, "phase": p.phase, "done_bytes": p.done_bytes, "total_bytes": p.total_bytes,
                       "started_at": p.started_at,
                       "waiters": [{"session_id": w.session_id, "pid": w.pid, "uid": w.uid,
                                    "client_name": w.client_name, "since": w.since} for w in p.waiters]}
                      for p in r.pulls],
            "peers": _peer_status_dict(r.peers) if r.HasField("peers") else None}


def _peer_status_dict(r: pb.PeerTierStatus) -> dict[str, Any]:
    return {"node": r.node, "address": r.address, "serve": r.serve, "fetch": r.fetch,
            "served_bytes": r.served_bytes, "serving_peers": list(r.serving_peers), "fetched_bytes": r.fetched_bytes,
            "fallback_bytes": r.fallback_bytes, "refused": r.refused, "lying_peers": r.lying_peers,
            "failed_peers": r.failed_peers, "peer_pulls": r.peer_pulls, "cap_bytes_per_s": r.cap_bytes_per_s,
            "agent_rss_bytes": r.agent_rss_bytes, "agent_restarts": r.agent_restarts, "agent_pid": r.agent_pid,
            "staging_served_bytes": r.staging_served_bytes, "partial_fetched_bytes": r.partial_fetched_bytes,
            "pulls": [{"key": p.key, "peers": list(p.peers), "done_bytes": p.done_bytes, "total_bytes": p.total_bytes,
                       "started_at": p.started_at, "from_store_bytes": p.from_store_bytes,
                       "verified_bytes": p.verified_bytes} for p in r.pulls]}


def _checkpoint_dict(c: pb.CheckpointInfo) -> dict[str, Any]:
    return {"checkpoint_id": c.checkpoint_id, "path": c.path, "model_id": c.model_id,
            "revision": c.revision, "files": c.file_count, "tensors": c.tensor_count,
            "size_bytes": c.size_bytes, "source_kind": c.source_kind, "state": c.state,
            "leases": c.leases, "registered_at": c.registered_at}


def _lease_dict(x: pb.LeaseInfo) -> dict[str, Any]:
    return {"lease_id": x.lease_id, "key": x.key, "pid": x.pid, "uid": x.uid, "session_id": x.session_id,
            "client_name": x.client_name, "acquired_at": x.acquired_at}
