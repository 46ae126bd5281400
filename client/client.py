"""``hwr.client.connect()``: a session with hwrd, leases and publication.

A ``Client`` owns two connections: the peer channel (``<socket>.peer``: authentication, the
session's liveness, descriptor passing, and the lease hot path: ``acquire`` and ``release`` are
one request/one reply each there, see ``hwr.daemon.peer.channel``) and a gRPC channel (control calls
carrying the session token), opened lazily on the first call that needs it: a client that only
acquires and releases never opens one. Closing the client, or the process exiting, ends the
session and the daemon releases every lease it still holds.

Contract:
- Every failure raises a typed ``HwrError`` (``DaemonUnavailable`` when hwrd cannot be reached,
  ``ArtifactNotFound`` for a miss, ...); nothing returns ``None``/``False`` for an error.
- ``close()`` is idempotent. Leases outlive nothing: after ``close()`` their mappings stay valid
  (views keep them alive) but the daemon no longer counts them.
- Fork: a child process inherits the parent's sockets; the client closes its copy of the peer
  socket in the child (so the parent's death still ends the parent's session) and refuses to be
  used there. Leases inherited by a child are never released by the child.
- Thread safety: calls may be made from several threads; peer-channel exchanges are serialized.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from hwr import __version__
from hwr.client.errors import (
    CheckpointNotFound,
    DaemonUnavailable,
    DeadlineExceeded,
    HwrError,
    InvalidRequest,
    PermissionDeniedError,
)
from hwr.client.identity import ArtifactIdentity, is_key
from hwr.client.manifest import Manifest
from hwr.client.paths import checkpoint_ref, default_socket, peer_path
from hwr.client.wire import (
    SESSION_KEY,
    close_fds,
    encode_frame,
    error_from_frame,
    error_from_rpc,
    recv_frame,
    recv_reply,
    send_frame,
)
from hwr.protos.hwr.v1 import hwr_pb2 as pb
from hwr.protos.hwr.v1 import hwr_pb2_grpc

if TYPE_CHECKING:  # torch is imported only by the calls that build tensors (hwrctl never does)
    import torch

    from hwr.client.checkpoint_lease import CheckpointLease
    from hwr.client.lease import Lease
    from hwr.client.publisher import Publisher, TensorSpec

__all__ = ["Client", "connect"]

R = TypeVar("R")

_LIVE: weakref.WeakSet[Client] = weakref.WeakSet()
STATE_NAMES = {pb.ARTIFACT_STATE_READY: "ready", pb.ARTIFACT_STATE_DENIED: "denied",
               pb.ARTIFACT_STATE_PUBLISHING: "publishing", pb.ARTIFACT_STATE_UNSPECIFIED: "unknown"}


def connect(socket: str | os.PathLike[str] | None = None, *, timeout: float = 30.0,
            client_name: str | None = None) -> Client:
    """Open a session with hwrd (socket: argument, else ``$HWR_SOCKET``, else the default)."""
    return Client(Path(socket) if socket is not None else default_socket(), timeout=timeout,
                  client_name=client_name)


class Client:
    def __init__(self, socket_path: Path, *, timeout: float = 30.0, client_name: str | None = None) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._pid = os.getpid()
        self._closed = False
        self._peer_lock = threading.Lock()
        self._peer: socket.socket | None = None
        self._channel: grpc.Channel | None = None
        self._grpc_stub: hwr_pb2_grpc.HostWeightRuntimeStub | None = None
        self._channel_lock = threading.Lock()
        self._client_name = client_name
        # Reconnect state (see ``reconnect``): open leases with the (dev, inode) of their files.
        self.auto_reconnect = True
        self.reconnects = 0
        self._open_leases: weakref.WeakKeyDictionary[Lease, tuple[tuple[int, int], ...]] = (
            weakref.WeakKeyDictionary())
        self._reconnect_lock = threading.RLock()
        self._watcher: threading.Thread | None = None
        # Staged publications not yet committed or aborted (see ``_peer_begin_may_wait``).
        self._publications: weakref.WeakSet[Publisher] = weakref.WeakSet()
        self._beginning = 0  # publisher() calls between their start and their begin's answer
        self._publications_lock = threading.Lock()
        try:
            self._peer, hello = _open_session(socket_path, timeout, self._hello_request())
            self._token = str(hello["token"])
            self.session_id = str(hello["session_id"])
            self._metadata = ((SESSION_KEY, self._token),)
        except HwrError:
            self.close()
            raise
        except ConnectionError as exc:
            self.close()
            raise DaemonUnavailable(f"hwrd at {socket_path} closed the connection: {exc}") from None
        except BaseException:
            self.close()
            raise
        _LIVE.add(self)

    # plumbing -------------------------------------------------------------------------------
    def _hello_request(self) -> dict[str, Any]:
        # The peer channel's ``hello`` names the session (what the OpenSession RPC does).
        return {"op": "hello", "client_name": (self._client_name or f"pid-{os.getpid()}")[:128],
                "client_version": __version__}

    @property
    def _stub(self) -> hwr_pb2_grpc.HostWeightRuntimeStub:
        """The gRPC stub, its channel opened on first use (and again after a reconnect)."""
        stub = self._grpc_stub
        if stub is None:
            with self._channel_lock:
                if self._grpc_stub is None:
                    self._channel = grpc.insecure_channel(f"unix:{self.socket_path}")
                    self._grpc_stub = hwr_pb2_grpc.HostWeightRuntimeStub(self._channel)
                stub = self._grpc_stub
        return stub

    def _check_usable(self) -> None:
        if self._closed:
            raise DaemonUnavailable("the client is closed")
        if os.getpid() != self._pid:
            raise DaemonUnavailable("this client belongs to the parent process; connect() again after fork")

    def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        self._check_usable()
        peer = self._peer
        try:
            return getattr(self._stub, method)(request, metadata=self._metadata,
                                               timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            error = error_from_rpc(exc)
        if not self._may_reconnect(method, error):
            raise error
        self.reconnect(failed_peer=peer)  # raises DaemonUnavailable while hwrd is down
        try:
            return getattr(self._stub, method)(request, metadata=self._metadata,
                                               timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

    def _peer_request(self, request: dict[str, Any], *, want_fds: bool) -> list[int]:
        return self._peer_exchange(request, want_fds=want_fds)[1]

    def _peer_exchange(self, request: dict[str, Any], *, want_fds: bool,
                       timeout: float | None = None) -> tuple[dict[str, Any], list[int], bytes]:
        """One request/reply on the peer channel: (reply, descriptors, raw tail bytes).

        An error frame raises its typed error (descriptors closed); a broken channel raises
        ``DaemonUnavailable``. ``timeout``: this exchange's bound instead of the connection's
        (a timeout ends the connection, and with it the session: see below).
        """
        self._check_usable()
        with self._peer_lock:
            sock = self._peer
            if sock is None:
                raise DaemonUnavailable("the client is closed")
            usual = sock.gettimeout()
            try:
                if timeout is not None:
                    sock.settimeout(timeout)
                sock.sendall(encode_frame(request))
                reply, fds, tail = recv_reply(sock, want_fds=want_fds)
                if timeout is not None:
                    sock.settimeout(usual)
            except (ConnectionError, OSError) as exc:
                # Half an exchange (a timeout, a reset) leaves the stream out of step: end this
                # connection so no later request reads a stale reply (the watcher or the next
                # acquire reconnects and reattaches the open leases).
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                raise DaemonUnavailable(f"peer channel to hwrd broke: {exc}") from None
        if not reply.get("ok"):
            close_fds(fds)
            raise error_from_frame(reply)
        return reply, fds, tail

    def _with_reconnect(self, exchange: Callable[[], R], deadline: float | None = None) -> R:
        """``exchange()`` on the peer channel; when the channel broke (a daemon restart ends the
        session), reconnect once and run it again, as ``_call`` does for gRPC. Only for requests
        that do not belong to the old session (acquire, publish_begin). Past ``deadline``
        (``time.monotonic()``) a broken channel is ``DeadlineExceeded`` and is not retried."""
        peer = self._peer
        try:
            return exchange()
        except DaemonUnavailable as exc:
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceeded(f"hwrd did not answer before the deadline ({exc.message})") from None
            if not (self.auto_reconnect and not self._closed and os.getpid() == self._pid):
                raise
            self.reconnect(failed_peer=peer)
            return exchange()

    def _peer_acquire(self, key: str, identity: bytes | None = None,
                      deadline: float | None = None) -> tuple[str, str, Manifest, list[int]]:
        """The peer channel's ``acquire`` of ``key`` (sent as ``identity``, its canonical bytes,
        when given) within ``deadline`` (``time.monotonic()``; None: the connection's timeout):
        (lease id, key, manifest, descriptors)."""
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise DeadlineExceeded("the acquire's deadline passed before hwrd was asked")
        request: dict[str, Any] = {"op": "acquire"}
        if identity is not None:
            request["identity"] = identity.decode()
        else:
            request["key"] = key
        cached = _MANIFESTS.get(key)
        if cached is not None:  # the daemon then sends no manifest bytes
            request["have"] = cached[0]
        reply, fds, tail = self._peer_exchange(request, want_fds=True, timeout=left)
        try:
            try:
                lease_id, got_key, digest = (str(reply["lease_id"]), str(reply["key"]),
                                             str(reply["manifest_sha256"]))
            except KeyError:
                raise DaemonUnavailable("malformed acquire reply from hwrd") from None
            if tail:
                manifest = _parse_manifest(tail)
                if len(_MANIFESTS) > 256:
                    _MANIFESTS.clear()
                _MANIFESTS[got_key] = (digest, manifest)
            else:
                cached = _MANIFESTS.get(got_key)
                if cached is None or cached[0] != digest:
                    raise DaemonUnavailable("hwrd omitted a manifest this process does not hold")
                manifest = cached[1]
        except BaseException:
            close_fds(fds)
            if "lease_id" in reply:
                with contextlib.suppress(HwrError):
                    self._peer_exchange({"op": "release", "lease_id": str(reply["lease_id"])},
                                        want_fds=False)
            raise
        return lease_id, got_key, manifest, fds

    # leases ---------------------------------------------------------------------------------
    def acquire(self, artifact: ArtifactIdentity | str, *, copy_on_write: bool = False,
                populate: bool = False, timeout: float | None = None) -> Lease:
        """Lease an artifact by identity or 64-hex key; raises ``ArtifactNotFound`` on a miss.

        ``timeout`` (seconds) bounds the exchanges with hwrd (None: the connection's timeout,
        ``connect(timeout=)``); past it the acquire raises ``DeadlineExceeded`` and the
        connection is replaced (the stream is out of step). A reconnect in between (after a
        daemon restart) is bounded by the connection's timeout, not by this one."""
        if isinstance(artifact, ArtifactIdentity):
            identity = artifact.canonical_bytes
            key = hashlib.sha256(identity).hexdigest()  # = artifact.key
        elif isinstance(artifact, str) and is_key(artifact):
            key, identity = artifact, None
        else:
            raise InvalidRequest("acquire takes an ArtifactIdentity or a 64-hex key")
        deadline = None if timeout is None else time.monotonic() + timeout
        lease_id, key, manifest, fds = self._with_reconnect(
            lambda: self._peer_acquire(key, identity, deadline), deadline)
        from hwr.client.lease import Lease

        # Lease owns the descriptors from here (closes them, and releases the lease on failure).
        lease = Lease(lease_id=lease_id, key=key, manifest=manifest, fds=fds,
                      release=self._release, copy_on_write=copy_on_write, populate=populate)
        self._open_leases[lease] = lease.file_ids
        self._start_watcher()
        return lease

    def _release(self, lease_id: str) -> None:
        if self._closed or os.getpid() != self._pid:
            return
        self._peer_exchange({"op": "release", "lease_id": lease_id}, want_fds=False)

    # publication ----------------------------------------------------------------------------
    def publisher(self, identity: ArtifactIdentity, specs: Sequence[TensorSpec], *,
                  wait_timeout: float = 600.0, verify: bool = False,
                  format_metadata: Mapping[str, Any] | None = None) -> Publisher:
        """Start a streaming publication (see ``hwr.client.publisher``)."""
        def staging_fds(publication_id: str, token: str) -> list[int]:
            return self._peer_request({"op": "staging_fds", "publication_id": publication_id,
                                       "publication_token": token}, want_fds=True)

        def peer(request: dict[str, Any], timeout: float | None = None) -> tuple[dict[str, Any], list[int]]:
            reply, fds, _tail = self._peer_exchange(request, want_fds=True, timeout=timeout)
            return reply, fds

        def peer_begin(request: dict[str, Any], timeout: float | None = None) -> tuple[dict[str, Any], list[int]]:
            if request.get("op") != "publish_begin":
                return peer(request, timeout)  # commit/abort belong to the current session: never retried
            return self._with_reconnect(lambda: peer(request))

        from hwr.client.publisher import Publisher

        with self._publications_lock:
            self._beginning += 1
        try:
            pub = Publisher(identity=identity, specs=specs, call=self._call, staging_fds=staging_fds,
                            wait_timeout=wait_timeout, verify=verify, call_timeout=self.timeout,
                            format_metadata=format_metadata, peer=peer_begin,
                            peer_may_wait=self._peer_begin_may_wait)
            if pub.staged:
                with self._publications_lock:
                    self._publications.add(pub)
        finally:
            with self._publications_lock:
                self._beginning -= 1
        return pub

    def _peer_begin_may_wait(self) -> bool:
        """Whether a peer ``publish_begin`` may wait in the daemon (for another publisher of the
        identity, or for room). It holds this client's peer connection while it waits, and the
        commit of another publication of this client needs that connection: when that other
        publication is the build (or holds the room) the begin waits for, the wait could only
        end at its timeout. So while any other publication of this client is beginning, or
        staged and not finished, a begin does not wait on the peer channel; it waits through
        the RPC instead (no connection held)."""
        with self._publications_lock:
            return self._beginning <= 1 and all(p.finished for p in self._publications)

    def publish(self, identity: ArtifactIdentity, tensors: Mapping[str, torch.Tensor], *,
                buffers: Sequence[str] = (), wait_timeout: float = 600.0, verify: bool = False) -> str:
        """Publish a mapping of CPU tensors; returns the key (also when it already existed)."""
        if not tensors:
            raise InvalidRequest("nothing to publish")
        from hwr.client.publisher import specs_for

        with self.publisher(identity, specs_for(dict(tensors), buffers), wait_timeout=wait_timeout,
                            verify=verify) as pub:
            if pub.staged:
                for name, tensor in tensors.items():
                    pub.write(name, tensor)
            return pub.commit()

    # inspection -----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        r = self._call("GetStatus", pb.GetStatusRequest())
        return {"version": r.version, "root": r.root, "socket": r.socket, "artifacts": r.artifacts,
                "leases": r.leases, "sessions": r.sessions, "publications": r.publications,
                "store_bytes": r.store_bytes, "uptime_s": round(r.uptime_s, 3), "pid": r.pid,
                "remote": _remote_status_dict(r.remote) if r.HasField("remote") else None}

    def list_artifacts(self, *, include_denied: bool = False) -> list[dict[str, Any]]:
        """The artifacts the daemon serves; ``include_denied`` adds the denied ones (``state``
        "denied", ``deny_reason`` the reason code)."""
        request = pb.ListArtifactsRequest(include_denied=include_denied)
        return [_artifact_dict(a) for a in self._call("ListArtifacts", request).artifacts]

    def inspect(self, key: str) -> dict[str, Any]:
        """One artifact (ready or denied) with its identity, files and tensors; the tensor list
        comes in pages, so that any tensor count the daemon accepts fits gRPC's message limit."""
        r = self._call("InspectArtifact", pb.InspectArtifactRequest(key=key, paged=True))
        out = _artifact_dict(r.artifact)
        out["identity"] = _json(r.identity_json)
        manifest = _json(r.manifest_json)
        out["files"] = manifest.get("files", []) if isinstance(manifest, dict) else []
        remote_state = r.remote_state or None  # of the first page (the others repeat it)
        tensors: list[Any] = list(_json(r.tensors_json) or []) if r.tensors_json else []
        full_key = r.artifact.key or key
        while r.tensors_json and r.next_tensor_offset < r.tensor_count:
            before = r.next_tensor_offset
            r = self._call("InspectArtifact", pb.InspectArtifactRequest(key=full_key, paged=True,
                                                                        tensor_offset=before))
            if r.next_tensor_offset <= before:
                raise HwrError("hwrd returned an empty page of tensors", details={"key": full_key})
            tensors += _json(r.tensors_json) or []
        if not r.tensors_json and not tensors:  # an older daemon: the whole manifest at once
            tensors = manifest.get("tensors", []) if isinstance(manifest, dict) else []
        out["tensors"] = tensors
        out["remote_state"] = remote_state
        return out

    def leases(self) -> list[dict[str, Any]]:
        return [{"lease_id": x.lease_id, "key": x.key, "pid": x.pid, "uid": x.uid,
                 "session_id": x.session_id, "client_name": x.client_name,
                 "acquired_at": x.acquired_at}
                for x in self._call("ListLeases", pb.ListLeasesRequest()).leases]

    def keepalive(self) -> dict[str, Any]:
        r = self._call("KeepAlive", pb.KeepAliveRequest())
        return {"session_id": r.session_id, "lease_count": r.lease_count,
                "publication_count": r.publication_count}

    # --- checkpoints and prewarm ---
    def add_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Register a checkpoint directory on the daemon's host; returns its description
        (``added`` is False when the same content was already registered)."""
        r = self._call("AddCheckpoint", pb.AddCheckpointRequest(path=os.path.abspath(path)))
        return {**_checkpoint_dict(r.checkpoint), "added": r.added}

    def list_checkpoints(self) -> list[dict[str, Any]]:
        return [_checkpoint_dict(c) for c in
                self._call("ListCheckpoints", pb.ListCheckpointsRequest()).checkpoints]

    def acquire_checkpoint(self, checkpoint_id: str, *, populate: bool = False,
                           timeout: float | None = None) -> CheckpointLease:
        """Lease the canonical tensors of a registered checkpoint (id or unique prefix)."""
        ref = pb.ArtifactRef(checkpoint=pb.CheckpointRef(checkpoint_id=checkpoint_id))
        response = self._call("Acquire", pb.AcquireRequest(artifact=ref), timeout)
        try:
            fds = self._peer_request({"op": "fds", "lease_id": response.lease_id,
                                      "lease_token": response.lease_token}, want_fds=True)
        except BaseException:
            self._release(response.lease_id)
            raise
        from hwr.client.checkpoint_lease import CheckpointLease

        return CheckpointLease(lease_id=response.lease_id, checkpoint_id=response.key,
                               files=[(f.name, f.size) for f in response.files], fds=fds,
                               release=self._release, populate=populate)

    def prewarm(self, checkpoint: str | os.PathLike[str], producer: str, *, dtype: str = "",
                keep_fp32: Sequence[str] = (),
                tp_size: int = 0, tp_plan: bytes = b"", tp_ranks: Sequence[int] = (),
                timeout_s: float = 0.0, wait_timeout_s: float = 0.0,
                on_progress: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        """Build artifacts from a registered checkpoint in the daemon; returns one dict per rank
        (``key``, ``tp_rank``, ``outcome``, ``size_bytes``, ``content_sha256``, ...).

        ``checkpoint`` is an id, a unique id prefix, or a registered path (resolved as by
        ``checkpoint_ref``: a relative path is taken from this process's working directory).
        Blocks until the build ends (no gRPC deadline: the daemon's producer timeout bounds it).
        A ``KeyboardInterrupt`` while waiting cancels the call, which cancels the build in the
        daemon (the producer is killed, nothing is published), and is re-raised.
        """
        self._check_usable()
        ref = checkpoint_ref(checkpoint)
        request = pb.PrewarmRequest(
            checkpoint=ref, producer=producer, dtype=dtype, keep_fp32=list(keep_fp32),
            tp_size=tp_size, tp_plan=tp_plan, tp_ranks=list(tp_ranks),
            timeout_ms=int(timeout_s * 1000), wait_timeout_ms=int(wait_timeout_s * 1000))
        call = self._stub.Prewarm(request, metadata=self._metadata)
        result: list[dict[str, Any]] = []
        try:
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

    # --- store administration ---
    def verify(self, key: str, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Re-hash an artifact (key or unique prefix); ``progress(done, total)`` per update.

        Returns the verdict: ``ok``, ``error_code``, ``message``, ``quarantined`` and the
        ``affected_leases`` already granted on a corrupt artifact. A mismatch is a verdict (the
        daemon quarantined and denied the artifact), not an exception.
        """
        stream = self._call("VerifyArtifact", pb.VerifyArtifactRequest(key=key), 7 * 24 * 3600.0)
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
        r = self._call("DenyArtifact", pb.DenyArtifactRequest(key=key, reason=reason))
        return {"key": r.key, "affected_leases": [_lease_dict(x) for x in r.affected_leases]}

    def allow(self, key: str) -> dict[str, Any]:
        r = self._call("AllowArtifact", pb.AllowArtifactRequest(key=key))
        return {"key": r.key, "was_denied": r.was_denied}

    def pin(self, key: str) -> dict[str, Any]:
        r = self._call("PinArtifact", pb.PinArtifactRequest(key=key))
        return {"key": r.key, "already_pinned": r.already_pinned, "size_bytes": r.size_bytes,
                "locked_bytes": r.locked_bytes, "residency": r.residency}

    def unpin(self, key: str) -> dict[str, Any]:
        r = self._call("UnpinArtifact", pb.UnpinArtifactRequest(key=key))
        return {"key": r.key, "was_pinned": r.was_pinned}

    def evict(self, key: str) -> dict[str, Any]:
        """Evict one artifact; ``ActiveLease`` (``details['reason']``) when it is in use."""
        r = self._call("EvictArtifact", pb.EvictArtifactRequest(key=key))
        return {"key": r.key, "freed_bytes": r.freed_bytes}

    def gc(self, target_bytes: int | None = None) -> dict[str, Any]:
        request = pb.CollectGarbageRequest()
        if target_bytes is not None:
            request.target_bytes = target_bytes
        r = self._call("CollectGarbage", request, 3600.0)
        return {"evicted": list(r.evicted), "freed_bytes": r.freed_bytes, "store_bytes": r.store_bytes,
                "target_bytes": r.target_bytes, "staging_reclaimed": r.staging_reclaimed,
                "skipped": [{"key": x.key, "reason": x.reason} for x in r.skipped]}

    def store_usage(self) -> dict[str, Any]:
        r = self._call("GetStoreUsage", pb.GetStoreUsageRequest())
        return {"store_bytes": r.store_bytes, "reserved_bytes": r.reserved_bytes,
                "store_limit_bytes": r.store_limit_bytes, "artifact_limit_bytes": r.artifact_limit_bytes,
                "min_free_bytes": r.min_free_bytes, "free_bytes": r.free_bytes, "pinned_bytes": r.pinned_bytes,
                "locked_bytes": r.locked_bytes, "evictions": r.evictions,
                "artifacts": [{"key": a.key, "size_bytes": a.size_bytes, "last_access": a.last_access,
                               "pinned": a.pinned, "leases": a.leases, "held_by_pids": list(a.held_by_pids)}
                              for a in r.artifacts]}

    # --- fleet tier (the daemon's remote object store) ---
    def remote_list(self) -> list[dict[str, Any]]:
        """The remote's artifacts: ``key``, ``size_bytes``, ``state`` (complete | incomplete), ``local``."""
        r = self._call("ListRemote", pb.ListRemoteRequest())
        return [{"key": a.key, "size_bytes": a.size_bytes, "state": "complete" if a.complete else "incomplete",
                 "local": a.local, "remote": r.url} for a in r.artifacts]

    def pull(self, key: str, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Pull an artifact from the remote into the store (verified); ``progress(done, total)``.
        Returns ``key``, ``outcome`` (pulled | already_present) and ``size_bytes``."""
        stream = self._call("PullArtifact", pb.PullArtifactRequest(key=key), 7 * 24 * 3600.0)
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
        r = self._call("PushArtifact", pb.PushArtifactRequest(key=key), 7 * 24 * 3600.0)
        return {"key": r.key, "outcome": r.outcome, "size_bytes": r.size_bytes}

    # --- reconnect after a daemon restart ---
    # Contract: when hwrd restarts (clean or SIGKILL) the session ends; the client then opens a
    # new session on the same socket and re-acquires the key of every open Lease. A Lease keeps
    # its mappings (they are mappings of immutable files and stay valid whatever the daemon
    # does) and is rebound to the new lease id when the daemon hands out the *same files*
    # (same dev:inode); otherwise (evicted and republished meanwhile, or denied) it is detached:
    # still readable, no longer counted by the daemon (which still sees its mappings in the
    # mappings scan). Reconnection happens on the next call that fails with SESSION_INVALID or
    # DAEMON_UNAVAILABLE, and in the background (a watcher thread that polls the peer socket for
    # hang-up) while leases are open. Limits: publications in flight are lost (their commit
    # fails: publish again); calls bound to the old session (Release, Commit/AbortPublication)
    # are not retried; a closed Lease is not reattached.
    _NO_RETRY = frozenset({"Release", "CommitPublication", "AbortPublication", "OpenSession", "VerifyArtifact"})

    def _may_reconnect(self, method: str, error: HwrError) -> bool:
        return (self.auto_reconnect and not self._closed and os.getpid() == self._pid
                and method not in self._NO_RETRY and error.code in ("SESSION_INVALID", "DAEMON_UNAVAILABLE"))

    def reconnect(self, *, failed_peer: socket.socket | None = None) -> dict[str, Any]:
        """Open a new session and reattach open leases; returns ``{"reattached", "detached"}``.

        ``failed_peer``: the connection the caller saw fail; when another thread has replaced it
        meanwhile, nothing is done.
        """
        self._check_usable()
        with self._reconnect_lock:
            if failed_peer is not None and failed_peer is not self._peer:
                return {"reattached": 0, "detached": []}
            peer, hello = _open_session(self.socket_path, self.timeout, self._hello_request())
            old_peer = self._peer
            with self._peer_lock, self._channel_lock:
                old_channel = self._channel
                self._peer = peer
                self._token = str(hello["token"])
                self.session_id = str(hello["session_id"])
                self._metadata = ((SESSION_KEY, self._token),)
                # A fresh channel on next use: the old one may be stuck backing off to a dead socket.
                self._channel, self._grpc_stub = None, None
            for closing in (old_peer, old_channel):
                if closing is not None:
                    with contextlib.suppress(Exception):
                        closing.close()
            self.reconnects += 1
            return self._reattach()

    def _reattach(self) -> dict[str, Any]:
        reattached, detached = 0, []
        for lease, files in list(self._open_leases.items()):
            if lease.closed:
                continue
            try:
                lease_id, _key, _manifest, fds = self._peer_acquire(lease.key)
            except HwrError:
                detached.append(lease.key)
                self._open_leases.pop(lease, None)
                continue
            try:
                same = tuple((st.st_dev, st.st_ino) for st in map(os.fstat, fds)) == files
            finally:
                close_fds(fds)
            if same and lease.rebind(lease_id):
                reattached += 1
                continue
            # Other files, or the application closed the lease while it was being reattached
            # (its close released the old id): the new one is not wanted.
            with contextlib.suppress(HwrError):
                self._peer_exchange({"op": "release", "lease_id": lease_id}, want_fds=False)
            self._open_leases.pop(lease, None)
            if not same:
                detached.append(lease.key)
        return {"reattached": reattached, "detached": detached}

    def _start_watcher(self) -> None:
        if not self.auto_reconnect or (self._watcher is not None and self._watcher.is_alive()):
            return
        self._watcher = threading.Thread(target=self._watch, name="hwr-reconnect", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        delay = 0.1
        while not self._closed and os.getpid() == self._pid and any(
                not lease.closed for lease in list(self._open_leases)):
            peer = self._peer
            if peer is None:
                return
            poller = select.poll()
            try:
                poller.register(peer, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
                hung_up = bool(poller.poll(500))
            except (OSError, ValueError):
                hung_up = True
            if not hung_up or peer is not self._peer:
                continue
            try:
                self.reconnect(failed_peer=peer)
                delay = 0.1
            except HwrError:
                time.sleep(delay)
                delay = min(2.0, delay * 2)

    # lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """End the session (the daemon releases its leases); idempotent."""
        self._closed = True
        peer, self._peer = self._peer, None
        if peer is not None:
            # shutdown() sends EOF now: close() alone waits while another thread (the reconnect
            # watcher) still polls the socket. Never done after fork (``_forget_after_fork``).
            with contextlib.suppress(OSError):
                peer.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                peer.close()
        with self._channel_lock:
            channel, self._channel, self._grpc_stub = self._channel, None, None
        if channel is not None and os.getpid() == self._pid:
            channel.close()
        if os.getpid() == self._pid:
            # The session's end aborts unfinished publications: their staging descriptors are
            # useless now, and hwrd reclaims a discarded staging only once nobody holds it.
            with self._publications_lock:
                unfinished = [p for p in self._publications if not p.finished]
            for pub in unfinished:
                pub.abandon()

    def _forget_after_fork(self) -> None:
        # The child's copy of the peer socket must not keep the parent's session alive.
        peer, self._peer = self._peer, None
        if peer is not None:
            with contextlib.suppress(OSError):
                peer.close()
        self._closed = True

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> object:
        raise TypeError("a Client is bound to this process's session and cannot be pickled")

    def __repr__(self) -> str:
        return f"Client(socket={str(self.socket_path)!r}, closed={self._closed})"


def _after_fork_in_child() -> None:
    for client in list(_LIVE):
        client._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _open_session(socket_path: Path, timeout: float,
                  hello_request: dict[str, Any]) -> tuple[socket.socket, dict[str, Any]]:
    """Connect the peer channel, read the daemon's greeting and name the session (``hello``)."""
    peer = _open_peer(socket_path, timeout)
    try:
        hello, _ = recv_frame(peer)
        if not hello.get("ok"):
            raise error_from_frame(hello)
        send_frame(peer, hello_request)
        reply, _ = recv_frame(peer)
        if not reply.get("ok"):
            raise error_from_frame(reply)
    except HwrError:  # typed errors subclass built-ins (PermissionDeniedError is an OSError)
        peer.close()
        raise
    except (ConnectionError, OSError) as exc:
        peer.close()
        raise DaemonUnavailable(f"hwrd at {socket_path} closed the connection: {exc}") from None
    except BaseException:
        peer.close()
        raise
    return peer, hello


def _open_peer(socket_path: Path, timeout: float) -> socket.socket:
    """Connect the peer socket within ``timeout``. A full listen backlog (the daemon is busy
    accepting: a connect with a timeout then fails at once with EAGAIN) is retried, with a
    growing pause, until ``timeout`` has passed; then ``DaemonUnavailable``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + timeout
    delay = 0.005
    try:
        while True:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                sock.connect(str(peer_path(socket_path)))
                break
            except BlockingIOError:  # EAGAIN: the backlog is full
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DaemonUnavailable(
                        f"hwrd on {socket_path} did not accept the connection within {timeout:g} s "
                        "(its listen backlog stayed full)", details={"socket": str(socket_path)}) from None
                time.sleep(min(delay, left))
                delay = min(delay * 2, 0.1)
        sock.settimeout(timeout)
    except DaemonUnavailable:
        sock.close()
        raise
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        sock.close()
        raise DaemonUnavailable(f"hwrd is not running on {socket_path} ({exc.strerror})",
                                details={"socket": str(socket_path)}) from None
    except PermissionError:
        sock.close()
        raise PermissionDeniedError(f"no permission to connect to {socket_path}") from None
    except OSError as exc:
        sock.close()
        raise DaemonUnavailable(f"cannot reach hwrd on {socket_path}: {exc}") from None
    return sock


#: key -> (sha256 of the manifest bytes the daemon sent, parsed manifest): lets ``acquire`` tell the
#: daemon which manifest this process already holds, so the daemon sends it only once per process.
_MANIFESTS: dict[str, tuple[str, Manifest]] = {}


@functools.lru_cache(maxsize=32)
def _parse_manifest(data: bytes) -> Manifest:
    """Strictly parse a manifest once per process: a manifest is immutable, its bytes name it.

    Repeated leases of the same artifact (every restart of a pipeline in a long-lived worker,
    the latency benchmarks) then skip the O(tensors) validation. Errors are not cached.
    """
    return Manifest.from_json(data)


def _artifact_dict(a: pb.ArtifactInfo) -> dict[str, Any]:
    return {"key": a.key, "size_bytes": a.size_bytes, "state": STATE_NAMES.get(a.state, "unknown"),
            "leases": a.leases, "model_id": a.model_id, "component": a.component, "dtype": a.dtype,
            "tensors": a.tensor_count, "created_at": a.created_at, "content_sha256": a.content_sha256,
            "deny_reason": a.deny_reason}


def _json(data: bytes) -> Any:
    try:
        return json.loads(data) if data else {}
    except ValueError:
        return {}


def _remote_status_dict(r: pb.RemoteStatus) -> dict[str, Any]:
    return {"url": r.url, "reachable": r.reachable, "error": r.error or None, "push": r.push,
            "pending_pushes": r.pending_pushes, "pulls_in_flight": r.pulls_in_flight,
            "bytes_pulled": r.bytes_pulled, "bytes_pushed": r.bytes_pushed}


def _checkpoint_dict(c: pb.CheckpointInfo) -> dict[str, Any]:
    return {"checkpoint_id": c.checkpoint_id, "path": c.path, "model_id": c.model_id,
            "revision": c.revision, "files": c.file_count, "tensors": c.tensor_count,
            "size_bytes": c.size_bytes, "source_kind": c.source_kind, "state": c.state,
            "leases": c.leases, "registered_at": c.registered_at}


def _lease_dict(x: pb.LeaseInfo) -> dict[str, Any]:
    return {"lease_id": x.lease_id, "key": x.key, "pid": x.pid, "uid": x.uid, "session_id": x.session_id,
            "client_name": x.client_name, "acquired_at": x.acquired_at}
