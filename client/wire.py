"""Wire helpers shared by hwrd and its clients: the error table and peer-channel framing.

Error table: ``STATUS_BY_CODE`` is the one place that maps an hwr error code to a gRPC status
code. The daemon sends the status plus trailing metadata ``hwr-error-code`` and
``hwr-error-details`` (a JSON object); ``error_from_rpc`` rebuilds the typed error on the client.

Peer-channel frames (``<socket>.peer``, a SOCK_STREAM Unix socket):

    +----------------+-------------------------------+
    | u32 big-endian | JSON object (msgspec), N bytes |
    |     length N   |                               |
    +----------------+-------------------------------+

A frame that carries descriptors sends them (SCM_RIGHTS, at most ``MAX_FDS``: Linux's
SCM_MAX_FD) with the first byte of its length prefix. A body larger than ``MAX_FRAME`` is a
protocol error and closes the connection. An acquire reply is followed by ``manifest_bytes`` raw
bytes (at most ``MAX_TAIL``). Error frames are ``{"ok": false, "code", "message", "details"}``
(``error_frame`` / ``error_from_frame``).

This module is the one codec of the channel: the client's requests and hwrd's replies (and
hwrd's request parsing, ``take_frame``) all go through it, so the limits live only here.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import socket
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
import msgspec

from hwr.client.errors import DaemonUnavailable, DeadlineExceeded, HwrError, InvalidRequest, error_from_code
from hwr.client.identity import find_lone_surrogate

__all__ = [
    "ERROR_CODE_KEY",
    "ERROR_DETAILS_KEY",
    "MAX_FDS",
    "MAX_FRAME",
    "MAX_TAIL",
    "MAX_WAIT_TIMEOUT_MS",
    "SESSION_KEY",
    "STATUS_BY_CODE",
    "close_fds",
    "decode_body",
    "encode_frame",
    "error_frame",
    "error_from_frame",
    "error_from_rpc",
    "frame_size",
    "recv_final_reply",
    "recv_frame",
    "recv_reply",
    "send_frame",
    "status_for",
    "take_frame",
]

SESSION_KEY = "hwr-session"
ERROR_CODE_KEY = "hwr-error-code"
ERROR_DETAILS_KEY = "hwr-error-details"
MAX_FRAME = 1 << 20
#: The longest ``BeginPublicationRequest.wait_timeout_ms`` hwrd accepts (one hour); longer is
#: INVALID_ARGUMENT.
MAX_WAIT_TIMEOUT_MS = 3_600_000
MAX_FDS = 253  # SCM_MAX_FD: the most descriptors Linux passes in one message
MAX_TAIL = 1 << 30  # the longest raw tail (manifest bytes) after a reply frame
_LEN = struct.Struct(">I")
_READ = 1 << 16  # one greedy read of a reply
_CMSG_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode

SC = grpc.StatusCode
STATUS_BY_CODE: dict[str, grpc.StatusCode] = {
    "LOCAL_MISS": SC.NOT_FOUND,
    "CHANNEL_NOT_FOUND": SC.NOT_FOUND,
    "REMOTE_UNAVAILABLE": SC.UNAVAILABLE,
    "REMOTE_DENIED": SC.PERMISSION_DENIED,
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
    "EXCEEDS_FILESYSTEM": SC.RESOURCE_EXHAUSTED,
    "ACTIVE_LEASE": SC.FAILED_PRECONDITION,
    "ACTIVE_BUILD_TIMEOUT": SC.DEADLINE_EXCEEDED,
    "PUBLICATION_FAILED": SC.FAILED_PRECONDITION,
    "PERMISSION_DENIED": SC.PERMISSION_DENIED,
    "SESSION_INVALID": SC.UNAUTHENTICATED,
    "LEASE_CLOSED": SC.FAILED_PRECONDITION,
    "DOMAIN_UNAVAILABLE": SC.UNAVAILABLE,
    "DAEMON_UNAVAILABLE": SC.UNAVAILABLE,
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


def encode_frame(obj: Mapping[str, Any], tail: bytes = b"") -> bytes:
    """One frame (length prefix + JSON body) followed by ``tail`` raw bytes.

    Encoded with msgspec; a value msgspec cannot encode (an integer past 64 bits, an object)
    falls back to ``json`` with ``str()`` for what JSON has no form for. Raises
    ``InvalidRequest`` when the body is over ``MAX_FRAME``.
    """
    try:
        body = _encode(obj)
    except (TypeError, ValueError, OverflowError):
        body = json.dumps(obj, default=str, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise InvalidRequest("too large for a peer frame", details={"limit": MAX_FRAME})
    return b"".join((_LEN.pack(len(body)), body, tail))


def decode_body(body: bytes) -> dict[str, Any]:
    """A frame's JSON object. msgspec decodes; what it refuses but JSON-with-extensions takes
    (NaN, integers past 64 bits) goes to ``json``. Raises ``ConnectionError`` for anything that
    is not a JSON object (nesting too deep for a decoder included), and ``InvalidRequest`` for
    an object holding a lone surrogate (``"\\ud800"``: valid JSON, not Unicode text; msgspec
    refuses it, ``json`` would not): the frame is consumed, so the channel stays in step and
    the sender gets a typed error."""
    try:
        obj = _decode(body)
    except RecursionError as exc:  # nesting deeper than any request has
        raise ConnectionError("malformed peer frame") from exc
    except (msgspec.DecodeError, ValueError):
        try:
            obj = json.loads(body or b"")
        except (ValueError, RecursionError) as exc:
            raise ConnectionError("malformed peer frame") from exc
        try:
            where = find_lone_surrogate(obj)
        except RecursionError as exc:
            raise ConnectionError("malformed peer frame") from exc
        if where is not None:
            raise InvalidRequest(f"{where} holds a lone surrogate (not Unicode text)",
                                 details={"field": where}) from None
    if not isinstance(obj, dict):
        raise ConnectionError("malformed peer frame")
    return obj


def frame_size(buf: bytes | bytearray) -> int | None:
    """Bytes of the first frame in ``buf`` (prefix + body, whatever the length says), or None
    while its prefix is incomplete."""
    if len(buf) < _LEN.size:
        return None
    return _LEN.size + _LEN.unpack_from(buf)[0]


def _checked_size(buf: bytes | bytearray) -> int | None:
    """``frame_size``; a body over ``MAX_FRAME`` is a ``ConnectionError``."""
    size = frame_size(buf)
    if size is not None and size - _LEN.size > MAX_FRAME:
        raise ConnectionError("peer frame too large")
    return size


def take_frame(buf: bytearray) -> dict[str, Any] | None:
    """Remove the first complete frame from ``buf`` and decode it; None while it is incomplete.
    Raises ``ConnectionError`` for a frame over ``MAX_FRAME`` or a body that is not an object."""
    size = _checked_size(buf)
    if size is None or len(buf) < size:
        return None
    body = bytes(buf[_LEN.size:size])
    del buf[:size]
    return decode_body(body)


def error_frame(exc: HwrError) -> dict[str, Any]:
    """The error frame of a typed error: the code, message and details its RPC status carries."""
    return {"ok": False, "code": exc.code, "message": exc.message, "details": exc.details}


def error_from_frame(reply: Mapping[str, Any]) -> HwrError:
    """The typed error an error frame carries (the inverse of ``error_frame``)."""
    details = reply.get("details")
    return error_from_code(str(reply.get("code")), str(reply.get("message")),
                           details if isinstance(details, dict) else {})


def send_frame(sock: socket.socket, obj: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    """Send one frame (blocking socket), with descriptors riding on its first byte."""
    data = encode_frame(obj)
    if fds:
        if socket.send_fds(sock, [data[:1]], list(fds)) != 1:
            raise ConnectionError("short send of a descriptor frame")
        data = data[1:]
    sock.sendall(data)


def recv_frame(sock: socket.socket, *, want_fds: bool = False) -> tuple[dict[str, Any], list[int]]:
    """Receive exactly one frame (blocking socket) and any descriptors sent with it; bytes after
    it (an acquire reply's manifest) stay in the socket.

    Raises ``ConnectionError`` on EOF or a malformed frame. Received descriptors are returned
    (the caller closes them) also with an error frame; on a raise they are closed.
    """
    fds: list[int] = []
    try:
        if want_fds:
            first, fds = _recv_with_fds(sock, 1)
            head = first + _recv_exact(sock, _LEN.size - 1)
        else:
            head = _recv_exact(sock, _LEN.size)
        size = _checked_size(head)
        assert size is not None
        return decode_body(_recv_exact(sock, size - _LEN.size)), fds
    except BaseException:
        close_fds(fds)
        raise


def recv_reply(sock: socket.socket, *, want_fds: bool) -> tuple[dict[str, Any], list[int], bytes]:
    """One reply frame plus its raw tail (``manifest_bytes`` of an ok reply, at most
    ``MAX_TAIL``), read greedily: usually one ``recvmsg``. Raises ``ConnectionError`` on EOF, a
    malformed reply or bytes after it, with any received descriptors closed."""
    fds: list[int] = []
    try:
        if want_fds:
            data, fds = _recv_with_fds(sock, _READ)
        else:
            data = sock.recv(_READ)
        if not data:
            raise ConnectionError("peer socket closed")
        buf = bytearray(data)
        _fill(sock, buf, _LEN.size)
        end = _checked_size(buf)
        assert end is not None
        _fill(sock, buf, end)
        reply = decode_body(bytes(buf[_LEN.size:end]))
        n = reply.get("manifest_bytes", 0) if reply.get("ok") else 0
        if not isinstance(n, int) or n < 0 or n > MAX_TAIL:
            raise ConnectionError("invalid manifest length in a peer reply")
        _fill(sock, buf, end + n)
        if len(buf) != end + n:
            raise ConnectionError("unexpected bytes after a peer reply")
    except BaseException:
        close_fds(fds)
        raise
    return reply, fds, bytes(buf[end:]) if n else b""


def recv_final_reply(sock: socket.socket, *, want_fds: bool,
                     on_pending: Callable[[dict[str, Any]], None]) -> tuple[dict[str, Any], list[int], bytes]:
    """``recv_reply`` for a request the daemon may answer with interim frames first: every frame
    ``{"ok": true, "pending": ...}`` (never carrying descriptors or a tail) goes to
    ``on_pending``, then the final reply is returned as ``recv_reply`` returns it. Each read is a
    ``recvmsg`` when ``want_fds`` (the final reply's descriptors may ride on a read that also
    ends an interim frame), and bytes after one frame are kept for the next."""
    fds: list[int] = []
    buf = bytearray()

    def read() -> None:
        if want_fds:
            data, got = _recv_with_fds(sock, _READ)
            fds.extend(got)
        else:
            data = sock.recv(_READ)
        if not data:
            raise ConnectionError("peer socket closed")
        buf.extend(data)

    try:
        while True:
            while len(buf) < _LEN.size or len(buf) < (_checked_size(buf) or 0):
                read()
            end = _checked_size(buf)
            assert end is not None
            reply = decode_body(bytes(buf[_LEN.size:end]))
            if reply.get("ok") and reply.get("pending"):
                del buf[:end]
                on_pending(reply)
                continue
            n = reply.get("manifest_bytes", 0) if reply.get("ok") else 0
            if not isinstance(n, int) or n < 0 or n > MAX_TAIL:
                raise ConnectionError("invalid manifest length in a peer reply")
            while len(buf) < end + n:
                read()
            if len(buf) != end + n:
                raise ConnectionError("unexpected bytes after a peer reply")
            return reply, fds, bytes(buf[end:]) if n else b""
    except BaseException:
        close_fds(fds)
        raise


def _recv_with_fds(sock: socket.socket, size: int) -> tuple[bytes, list[int]]:
    """Up to ``size`` bytes and the descriptors riding on them (at most ``MAX_FDS``; more is a
    ``ConnectionError``, with the ones received closed). The descriptors arrive close-on-exec
    (``MSG_CMSG_CLOEXEC``, atomically): a child another thread spawns meanwhile never inherits one."""
    data, ancdata, flags, _addr = sock.recvmsg(size, _CMSG_SPACE, socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
            fds.extend(arr)
    if flags & socket.MSG_CTRUNC:
        close_fds(fds)
        raise ConnectionError("hwrd sent more descriptors than one message can carry")
    if not data:
        close_fds(fds)
        raise ConnectionError("peer socket closed")
    return data, fds


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes: nothing after them is read."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer socket closed")
        buf += chunk
    return bytes(buf)


def _fill(sock: socket.socket, buf: bytearray, n: int) -> None:
    """Read until ``buf`` holds ``n`` bytes (more when one read brings more)."""
    while len(buf) < n:
        chunk = sock.recv(max(n - len(buf), _READ))
        if not chunk:
            raise ConnectionError("peer socket closed")
        buf += chunk


def close_fds(fds: Sequence[int]) -> None:
    """Close every descriptor, ignoring ones already closed (error and cleanup paths)."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
