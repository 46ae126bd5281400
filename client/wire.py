"""Wire helpers shared by hwrd and its clients: the error table and peer-channel framing.

Error table: ``STATUS_BY_CODE`` is the one place that maps an hwr error code to a gRPC status
code. The daemon sends the status plus trailing metadata ``hwr-error-code`` and
``hwr-error-details`` (a JSON object); ``error_from_rpc`` rebuilds the typed error on the client.

Peer-channel frames (``<socket>.peer``, a SOCK_STREAM Unix socket):

    +----------------+-------------------------------+
    | u32 big-endian | JSON object (msgspec), N bytes |
    |     length N   |                               |
    +----------------+-------------------------------+

A frame that carries descriptors sends them (SCM_RIGHTS) with the first byte of its length
prefix. Frames larger than ``MAX_FRAME`` are a protocol error and close the connection.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import socket
import struct
from collections.abc import Sequence
from typing import Any

import grpc

from hwr.client.errors import DaemonUnavailable, DeadlineExceeded, HwrError, error_from_code

__all__ = [
    "ERROR_CODE_KEY",
    "ERROR_DETAILS_KEY",
    "MAX_FDS",
    "MAX_FRAME",
    "MAX_WAIT_TIMEOUT_MS",
    "SESSION_KEY",
    "STATUS_BY_CODE",
    "close_fds",
    "encode_frame",
    "error_from_rpc",
    "recv_frame",
    "send_frame",
    "status_for",
]

SESSION_KEY = "hwr-session"
ERROR_CODE_KEY = "hwr-error-code"
ERROR_DETAILS_KEY = "hwr-error-details"
MAX_FRAME = 1 << 20
#: The longest ``BeginPublicationRequest.wait_timeout_ms`` hwrd accepts (one hour); longer is
#: INVALID_ARGUMENT.
MAX_WAIT_TIMEOUT_MS = 3_600_000
MAX_FDS = 64
_LEN = struct.Struct(">I")

SC = grpc.StatusCode
STATUS_BY_CODE: dict[str, grpc.StatusCode] = {
    "LOCAL_MISS": SC.NOT_FOUND,
    "REMOTE_UNAVAILABLE": SC.UNAVAILABLE,
    "ARTIFACT_DENIED": SC.FAILED_PRECONDITION,
    "MANIFEST_CORRUPT": SC.DATA_LOSS,
    "MANIFEST_INCOMPATIBLE": SC.DATA_LOSS,
    "CHECKSUM_MISMATCH": SC.DATA_LOSS,
    "IDENTITY_COLLISION": SC.ALREADY_EXISTS,
    "INVALID_IDENTITY": SC.INVALID_ARGUMENT,
    "INVALID_ARGUMENT": SC.INVALID_ARGUMENT,
    "INVALID_CONFIG": SC.INVALID_ARGUMENT,
    "UNSUPPORTED": SC.UNIMPLEMENTED,
    "ENOSPC": SC.RESOURCE_EXHAUSTED,
    "ARTIFACT_TOO_LARGE": SC.RESOURCE_EXHAUSTED,
    "STORE_LIMIT_EXCEEDED": SC.RESOURCE_EXHAUSTED,
    "INSUFFICIENT_CAPACITY": SC.RESOURCE_EXHAUSTED,
    "ACTIVE_LEASE": SC.FAILED_PRECONDITION,
    "ACTIVE_BUILD_TIMEOUT": SC.DEADLINE_EXCEEDED,
    "PUBLICATION_FAILED": SC.FAILED_PRECONDITION,
    "PERMISSION_DENIED": SC.PERMISSION_DENIED,
    "SESSION_INVALID": SC.UNAUTHENTICATED,
    "LEASE_CLOSED": SC.FAILED_PRECONDITION,
    "DOMAIN_UNAVAILABLE": SC.UNAVAILABLE,
    "DOMAIN_POLICY_MISMATCH": SC.FAILED_PRECONDITION,
    "DEADLINE_EXCEEDED": SC.DEADLINE_EXCEEDED,
    "CHECKPOINT_NOT_FOUND": SC.NOT_FOUND,
    "CHECKPOINT_MODIFIED": SC.FAILED_PRECONDITION,
    "PRODUCER_FAILED": SC.ABORTED,
    "PRODUCER_TIMEOUT": SC.DEADLINE_EXCEEDED,
    "BUILD_CANCELLED": SC.CANCELLED,
}


def status_for(error: HwrError) -> grpc.StatusCode:
    """The gRPC status for a typed error (INTERNAL for codes outside the table)."""
    return STATUS_BY_CODE.get(error.code, SC.INTERNAL)


def error_from_rpc(exc: grpc.RpcError) -> HwrError:
    """Rebuild the typed error the daemon raised; transport failures become DaemonUnavailable."""
    code_md = details_md = None
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == ERROR_CODE_KEY:
            code_md = value
        elif key == ERROR_DETAILS_KEY:
            details_md = value
    status = exc.code() if hasattr(exc, "code") else None
    message = (exc.details() if hasattr(exc, "details") else None) or str(status)
    if code_md:
        try:
            details = json.loads(details_md) if details_md else {}
        except ValueError:
            details = {}
        return error_from_code(str(code_md), message, details if isinstance(details, dict) else {})
    if status == SC.UNAVAILABLE:
        return DaemonUnavailable(f"hwrd is unreachable: {message}")
    if status == SC.DEADLINE_EXCEEDED:
        return DeadlineExceeded(f"hwrd did not answer in time: {message}")
    return HwrError(f"hwrd call failed ({status}): {message}")


def encode_frame(obj: dict[str, Any]) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise ValueError("frame too large")
    return _LEN.pack(len(body)) + body


def send_frame(sock: socket.socket, obj: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
    """Send one frame (blocking socket), with descriptors riding on the first byte."""
    data = encode_frame(obj)
    if fds:
        sent = socket.send_fds(sock, [data[:1]], list(fds))
        if sent != 1:
            raise ConnectionError("short send of a descriptor frame")
        data = data[1:]
    sock.sendall(data)


def recv_frame(sock: socket.socket, *, want_fds: bool = False) -> tuple[dict[str, Any], list[int]]:
    """Receive one frame (blocking socket) and any descriptors sent with it.

    Raises ``ConnectionError`` on EOF or a malformed frame. Received descriptors are always
    returned (and must be closed by the caller) even when the frame is an error frame.
    """
    fds: list[int] = []
    if want_fds:
        fdarr = array.array("i")
        msg, ancdata, _flags, _addr = sock.recvmsg(1, socket.CMSG_SPACE(MAX_FDS * fdarr.itemsize))
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fdarr.frombytes(data[: len(data) - (len(data) % fdarr.itemsize)])
        fds = list(fdarr)
        if not msg:
            close_fds(fds)
            raise ConnectionError("peer channel closed")
        head = msg + _recv_exact(sock, _LEN.size - 1, fds)
    else:
        head = _recv_exact(sock, _LEN.size, fds)
    (length,) = _LEN.unpack(head)
    if length > MAX_FRAME:
        close_fds(fds)
        raise ConnectionError("peer frame too large")
    body = _recv_exact(sock, length, fds)
    try:
        obj = json.loads(body)
    except ValueError as exc:
        close_fds(fds)
        raise ConnectionError("malformed peer frame") from exc
    if not isinstance(obj, dict):
        close_fds(fds)
        raise ConnectionError("malformed peer frame")
    return obj, fds


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    chunks: list[bytes] = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            close_fds(fds)
            raise ConnectionError("peer channel closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def close_fds(fds: Sequence[int]) -> None:
    """Close every descriptor, ignoring ones already closed (error and cleanup paths)."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
