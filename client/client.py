"""``hwr.client.connect()``: a session with hwrd, leases and publication.

A ``Client`` owns two connections: the peer channel (``<socket>.peer``: authentication, the
session's liveness, descriptor passing) and a gRPC channel (control calls carrying the session
token). Closing the client, or the process exiting, ends the session and the daemon releases
every lease it still holds.

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
import json
import os
import socket
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import torch

from hwr import __version__
from hwr.client.errors import (
    DaemonUnavailable,
    HwrError,
    InvalidRequest,
    PermissionDeniedError,
    error_from_code,
)
from hwr.client.identity import ArtifactIdentity, is_key
from hwr.client.lease import Lease
from hwr.client.manifest import Manifest
from hwr.client.paths import default_socket, peer_path
from hwr.client.publisher import Publisher, TensorSpec, specs_for
from hwr.client.wire import SESSION_KEY, error_from_rpc, recv_frame, send_frame
from hwr.protos.hwr.v1 import hwr_pb2 as pb
from hwr.protos.hwr.v1 import hwr_pb2_grpc

__all__ = ["Client", "connect"]

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
        try:
            self._peer = _open_peer(socket_path, timeout)
            hello, _ = recv_frame(self._peer)
            if not hello.get("ok"):
                raise error_from_code(str(hello.get("code")), str(hello.get("message")),
                                      hello.get("details") or {})
            self._token = str(hello["token"])
            self.session_id = str(hello["session_id"])
            self._metadata = ((SESSION_KEY, self._token),)
            self._channel = grpc.insecure_channel(f"unix:{socket_path}")
            self._stub = hwr_pb2_grpc.HostWeightRuntimeStub(self._channel)
            self._call("OpenSession", pb.OpenSessionRequest(
                client_name=(client_name or f"pid-{os.getpid()}")[:128], client_version=__version__))
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
    def _check_usable(self) -> None:
        if self._closed:
            raise DaemonUnavailable("the client is closed")
        if os.getpid() != self._pid:
            raise DaemonUnavailable("this client belongs to the parent process; connect() again after fork")

    def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        self._check_usable()
        try:
            return getattr(self._stub, method)(request, metadata=self._metadata,
                                               timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

    def _peer_request(self, request: dict[str, Any], *, want_fds: bool) -> list[int]:
        self._check_usable()
        assert self._peer is not None
        with self._peer_lock:
            try:
                send_frame(self._peer, request)
                reply, fds = recv_frame(self._peer, want_fds=want_fds)
            except (ConnectionError, OSError) as exc:
                raise DaemonUnavailable(f"peer channel to hwrd broke: {exc}") from None
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            raise error_from_code(str(reply.get("code")), str(reply.get("message")),
                                  reply.get("details") or {})
        return fds

    # leases ---------------------------------------------------------------------------------
    def acquire(self, artifact: ArtifactIdentity | str, *, copy_on_write: bool = False,
                populate: bool = False, timeout: float | None = None) -> Lease:
        """Lease an artifact by identity or 64-hex key; raises ``ArtifactNotFound`` on a miss."""
        ref = _ref(artifact)
        response = self._call("Acquire", pb.AcquireRequest(artifact=ref), timeout)
        try:
            manifest = Manifest.from_json(bytes(response.manifest_json))
            fds = self._peer_request({"op": "fds", "lease_id": response.lease_id,
                                      "lease_token": response.lease_token}, want_fds=True)
        except BaseException:
            self._release(response.lease_id)
            raise
        return Lease(lease_id=response.lease_id, key=response.key, manifest=manifest, fds=fds,
                     release=self._release, copy_on_write=copy_on_write, populate=populate)

    def _release(self, lease_id: str) -> None:
        if self._closed or os.getpid() != self._pid:
            return
        self._call("Release", pb.ReleaseRequest(lease_id=lease_id))

    # publication ----------------------------------------------------------------------------
    def publisher(self, identity: ArtifactIdentity, specs: Sequence[TensorSpec], *,
                  wait_timeout: float = 600.0, verify: bool = False) -> Publisher:
        """Start a streaming publication (see ``hwr.client.publisher``)."""
        def staging_fds(publication_id: str, token: str) -> list[int]:
            return self._peer_request({"op": "staging_fds", "publication_id": publication_id,
                                       "publication_token": token}, want_fds=True)

        return Publisher(identity=identity, specs=specs, call=self._call, staging_fds=staging_fds,
                         wait_timeout=wait_timeout, verify=verify)

    def publish(self, identity: ArtifactIdentity, tensors: Mapping[str, torch.Tensor], *,
                buffers: Sequence[str] = (), wait_timeout: float = 600.0, verify: bool = False) -> str:
        """Publish a mapping of CPU tensors; returns the key (also when it already existed)."""
        if not tensors:
            raise InvalidRequest("nothing to publish")
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
                "store_bytes": r.store_bytes, "uptime_s": round(r.uptime_s, 3), "pid": r.pid}

    def list_artifacts(self) -> list[dict[str, Any]]:
        return [_artifact_dict(a) for a in self._call("ListArtifacts", pb.ListArtifactsRequest()).artifacts]

    def inspect(self, key: str) -> dict[str, Any]:
        r = self._call("InspectArtifact", pb.InspectArtifactRequest(key=key))
        out = _artifact_dict(r.artifact)
        out["identity"] = _json(r.identity_json)
        manifest = _json(r.manifest_json)
        out["files"] = manifest.get("files", []) if isinstance(manifest, dict) else []
        out["tensors"] = manifest.get("tensors", []) if isinstance(manifest, dict) else []
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

    # lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """End the session (the daemon releases its leases); idempotent."""
        self._closed = True
        peer, self._peer = self._peer, None
        if peer is not None:
            with contextlib.suppress(OSError):
                peer.close()
        channel, self._channel = self._channel, None
        if channel is not None and os.getpid() == self._pid:
            channel.close()

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


def _open_peer(socket_path: Path, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(peer_path(socket_path)))
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


def _ref(artifact: ArtifactIdentity | str) -> pb.ArtifactRef:
    if isinstance(artifact, ArtifactIdentity):
        return pb.ArtifactRef(identity_json=artifact.canonical_bytes)
    if isinstance(artifact, str) and is_key(artifact):
        return pb.ArtifactRef(key=artifact)
    raise InvalidRequest("acquire takes an ArtifactIdentity or a 64-hex key")


def _artifact_dict(a: pb.ArtifactInfo) -> dict[str, Any]:
    return {"key": a.key, "size_bytes": a.size_bytes, "state": STATE_NAMES.get(a.state, "unknown"),
            "leases": a.leases, "model_id": a.model_id, "component": a.component, "dtype": a.dtype,
            "tensors": a.tensor_count, "created_at": a.created_at, "content_sha256": a.content_sha256}


def _json(data: bytes) -> Any:
    try:
        return json.loads(data) if data else {}
    except ValueError:
        return {}


