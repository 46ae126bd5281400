"""The peer channel: authentication, session liveness and descriptor passing.

One SOCK_STREAM Unix socket at ``<socket>.peer``. Per connection:

1. The daemon reads SO_PEERCRED and applies the allow-list; a refused peer gets one error frame
   ``{"ok": false, "code": "PERMISSION_DENIED", ...}`` and the connection is closed.
2. Otherwise it opens a session and sends ``{"ok": true, "session_id", "token", "pid", "uid"}``.
3. Requests, one at a time, each answered by one frame:
   - ``{"op": "fds", "lease_id", "lease_token"}`` -> the artifact's payload descriptors
     (O_RDONLY) in manifest file order, sent with SCM_RIGHTS.
   - ``{"op": "staging_fds", "publication_id", "publication_token"}`` -> writable descriptors of
     the staging files of a publication of this session.
   - ``{"op": "ping"}`` -> ``{"ok": true}``.
4. EOF (or any protocol error) ends the session: its leases are released and its staged
   publications aborted, immediately (well within the 2 s liveness bound).

Only the connection that owns a session can fetch its descriptors: the token alone is useless
to another process. Descriptors are opened per request and closed right after sending.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from hwr.client.errors import HwrError, PermissionDeniedError
from hwr.client.wire import MAX_FRAME, encode_frame
from hwr.daemon.peercred import AllowList, peer_allowed, read_peercred
from hwr.daemon.sessions import Registry, Session

__all__ = ["PeerServer"]

log = logging.getLogger("hwrd.peer")
_LEN = struct.Struct(">I")


class PeerServer:
    def __init__(
        self,
        path: Path,
        *,
        registry: Registry,
        allow: Callable[[], AllowList],
        open_lease_fds: Callable[[Session, str, str], list[int]],
        open_staging_fds: Callable[[Session, str, str], list[int]],
        on_session_end: Callable[[Session], Awaitable[None]],
        mode: int = 0o660,
        listen_sock: socket.socket | None = None,
    ) -> None:
        self.path = path
        self._registry = registry
        self._allow = allow
        self._open_lease_fds = open_lease_fds
        self._open_staging_fds = open_staging_fds
        self._on_session_end = on_session_end
        self._mode = mode
        self._sock = listen_sock
        self._task: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        if self._sock is None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(self.path))
            os.chmod(self.path, self._mode)
            sock.listen(512)
            self._sock = sock
        self._sock.setblocking(False)
        self._task = asyncio.get_running_loop().create_task(self._accept_loop())

    async def stop_accepting(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def close(self) -> None:
        await self.stop_accepting()
        for task in list(self._conns):
            task.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            task = loop.create_task(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        conn.setblocking(False)
        session: Session | None = None
        try:
            cred = read_peercred(conn)
            if not peer_allowed(cred, self._allow()):
                log.warning("refused peer pid=%d uid=%d gid=%d", cred.pid, cred.uid, cred.gid)
                await self._send(conn, _error(PermissionDeniedError(
                    f"uid {cred.uid} is not on hwrd's allow-list")))
                return
            session = self._registry.open_session(cred)
            await self._send(conn, {"ok": True, "session_id": session.session_id,
                                    "token": session.token, "pid": cred.pid, "uid": cred.uid})
            while True:
                request = await _recv_frame(loop, conn)
                if request is None:
                    return
                reply, fds = self._dispatch(session, request)
                try:
                    await self._send(conn, reply, fds)
                finally:
                    for fd in fds:
                        os.close(fd)
        except (ConnectionError, OSError) as exc:
            log.debug("peer connection ended: %s", exc)
        finally:
            conn.close()
            if session is not None:
                await self._on_session_end(session)

    def _dispatch(self, session: Session, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        op = req.get("op")
        try:
            if op == "ping":
                return {"ok": True}, []
            if op == "fds":
                fds = self._open_lease_fds(session, _str(req, "lease_id"), _str(req, "lease_token"))
                return {"ok": True, "count": len(fds)}, fds
            if op == "staging_fds":
                fds = self._open_staging_fds(
                    session, _str(req, "publication_id"), _str(req, "publication_token"))
                return {"ok": True, "count": len(fds)}, fds
            return _error(PermissionDeniedError(f"unknown peer operation {str(op)[:40]!r}")), []
        except HwrError as exc:
            return _error(exc), []

    async def _send(self, conn: socket.socket, obj: dict[str, Any], fds: list[int] = ()) -> None:  # type: ignore[assignment]
        loop = asyncio.get_running_loop()
        data = encode_frame(obj)
        if fds:
            # Descriptors ride on the first byte; a fresh request/response socket always has room
            # for one byte, so this only loops if the client stopped reading (then we wait).
            while True:
                try:
                    socket.send_fds(conn, [data[:1]], fds)
                    break
                except BlockingIOError:
                    await asyncio.sleep(0.001)
            data = data[1:]
        await loop.sock_sendall(conn, data)


def _str(req: dict[str, Any], name: str) -> str:
    value = req.get(name)
    if not isinstance(value, str) or not value or len(value) > 256:
        raise PermissionDeniedError(f"peer request field {name!r} is missing or invalid")
    return value


def _error(exc: HwrError) -> dict[str, Any]:
    return {"ok": False, "code": exc.code, "message": exc.message, "details": exc.details}


async def _recv_frame(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> dict[str, Any] | None:
    head = await _recv_exact(loop, conn, _LEN.size, eof_ok=True)
    if head is None:
        return None
    (length,) = _LEN.unpack(head)
    if length > MAX_FRAME:
        raise ConnectionError("peer frame too large")
    body = await _recv_exact(loop, conn, length, eof_ok=False)
    try:
        obj = json.loads(body or b"")
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than json allows
        raise ConnectionError("malformed peer frame") from exc
    if not isinstance(obj, dict):
        raise ConnectionError("malformed peer frame")
    return obj


async def _recv_exact(
    loop: asyncio.AbstractEventLoop, conn: socket.socket, n: int, *, eof_ok: bool
) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(conn, n - len(buf))
        if not chunk:
            if eof_ok and not buf:
                return None
            raise ConnectionError("peer closed mid-frame")
        buf += chunk
    return bytes(buf)
