"""The peer channel: authentication, session liveness, descriptor passing, and the lease hot path.

One SOCK_STREAM Unix socket at ``<socket>.peer``. Per connection:

1. The daemon reads SO_PEERCRED and applies the allow-list; a refused peer gets one error frame
   ``{"ok": false, "code": "PERMISSION_DENIED", ...}`` and the connection is closed.
2. Otherwise it opens a session and sends ``{"ok": true, "session_id", "token", "pid", "uid"}``.
3. Requests, one at a time, each answered by one frame (state table: any request is valid in
   any order once the session is open; the session is the connection):

   ====================  ======================================  ==================================
   request op            fields                                  reply (``ok: true``)
   ====================  ======================================  ==================================
   ``hello``             ``client_name``, ``client_version``     ``session_id``, ``pid``, ``uid``,
                         (strings <= 128 chars)                  ``daemon_version`` (= OpenSession)
   ``acquire``           ``key`` (64 hex) or ``identity``        ``lease_id``, ``lease_token``,
                         (canonical identity JSON as a string);  ``key``, ``manifest_sha256``,
                         optional ``have`` (a manifest sha256    ``manifest_bytes`` (N), ``count``;
                         the client holds: then N is 0)          descriptors + N raw manifest bytes
   ``release``           ``lease_id``                            ``released`` (bool)
   ``fds``               ``lease_id``, ``lease_token``           ``count``; descriptors
   ``staging_fds``       ``publication_id``, ``publication_token`` ``count``; descriptors
   ``publish_begin``     see ``hwr.daemon.peer.publish``          ``outcome``, ``key``, placements;
   ``publish_commit``    (the publication RPCs on this channel)   staging descriptors when staged
   ``publish_abort``
   ``ping``              -                                       -
   ====================  ======================================  ==================================

   ``acquire``/``release`` are the same operations as the gRPC ``Acquire``/``Release`` RPCs (one
   implementation: ``hwr.daemon.service.leasing``), with typed errors as error frames
   ``{"ok": false, "code", "message", "details"}`` carrying the same code, message and details
   the RPC would put in its status and trailing metadata. An ``acquire`` reply carries the
   payload descriptors (O_RDONLY, manifest file order, SCM_RIGHTS on the first byte) and, after
   the JSON frame, ``manifest_bytes`` raw bytes of manifest JSON (never size-limited by
   ``MAX_FRAME``). A request that is valid JSON but wrong (unknown op, missing or invalid field)
   gets an error frame and the connection stays usable; bytes that are not a frame end it.
4. EOF (or any protocol error) ends the session: its leases are released and its staged
   publications aborted, immediately (well within the 2 s liveness bound).

Only the connection that owns a session can fetch its descriptors: the token alone is useless
to another process. Descriptors are opened per request and closed right after sending.

Bounds per connection and per uid (sessions, descriptors in flight, partial frames, a stalled
frame's timeout): ``hwr.daemon.peer.limits``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hwr import __version__
from hwr.client.errors import DaemonUnavailable, HwrError, InvalidRequest, PermissionDeniedError
from hwr.client.wire import MAX_FRAME, close_fds, encode_frame, error_frame, send_frame, take_frame
from hwr.daemon.peer.limits import READ_SIZE, FrameWatch, InflightFds, Ledger, PeerLimits
from hwr.daemon.service.sessions import Registry, Session
from hwr.daemon.system.accepting import Acceptor, cancel_and_wait
from hwr.daemon.system.peercred import AllowList, peer_allowed, read_peercred

if TYPE_CHECKING:
    from hwr.daemon.peer.publish import PeerPublishing
    from hwr.daemon.service.leasing import Leasing
    from hwr.daemon.service.sessions import LeaseRecord
    from hwr.daemon.store.validation import ArtifactRecord

__all__ = ["PeerServer"]

log = logging.getLogger("hwrd.peer")

_LATER = object()  # a request that needs the event loop (awaits): handled by a task
_PUBLISH_OPS = {"publish_begin": "begin", "publish_commit": "commit", "publish_abort": "abort"}


class PeerServer:
    """The peer channel's server (see the module docstring).

    Connections are ``asyncio.Protocol`` objects: a request whose work is synchronous (every
    operation except an ``acquire`` that must wait for validation or an eviction round) is
    parsed, served and answered inside ``data_received``, with the reply sent by one direct
    ``sendmsg`` on the socket (descriptors and all) -- no task, future or reader registration per
    request. Anything else pauses reading, runs in a task, and resumes; requests on one
    connection are always answered in order.
    """

    def __init__(
        self,
        path: Path,
        *,
        registry: Registry,
        allow: Callable[[], AllowList],
        on_session_end: Callable[[Session], Awaitable[None]],
        mode: int = 0o660,
        listen_sock: socket.socket | None = None,
        leasing: Leasing | None = None,
        publishing: PeerPublishing | None = None,
        limits: PeerLimits | None = None,
    ) -> None:
        self.path = path
        self._registry = registry
        self._allow = allow
        self._on_session_end = on_session_end
        self._leasing = leasing  # acquire/release/lease descriptors; None: refused
        self._publishing = publishing  # publish_* and staging descriptors; None: refused
        self._mode = mode
        self._sock = listen_sock
        self._task: asyncio.Task[None] | None = None
        self._acceptor: Acceptor | None = None
        self._conns: set[_Connection] = set()
        self.ledger = Ledger(limits or PeerLimits())

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
        self._acceptor = Acceptor(self._sock, "peer channel", refuse=_refuse)
        self._task = asyncio.get_running_loop().create_task(self._accept_loop())

    async def stop_accepting(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        if self._acceptor is not None:
            self._acceptor.close()
            self._acceptor = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def close(self) -> None:
        await self.stop_accepting()
        conns = list(self._conns)
        for conn in conns:
            conn.abort()
        if conns:
            await asyncio.gather(*(conn.ended for conn in conns), return_exceptions=True)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._acceptor is not None
        while True:
            sock = await self._acceptor.accept()
            conn = _Connection(self, sock, loop)
            self._conns.add(conn)
            conn.ended.add_done_callback(lambda _f, c=conn: self._conns.discard(c))
            try:
                await loop.connect_accepted_socket(lambda c=conn: c, sock)
            except OSError as exc:
                log.debug("peer connection failed at setup: %s", exc)
                sock.close()
                conn.connection_lost(exc)

    # ---------------------------------------------------------------- request handling
    def _greet(self, sock: socket.socket) -> tuple[Session | None, dict[str, Any]]:
        cred = read_peercred(sock)
        if not peer_allowed(cred, self._allow()):
            log.warning("refused peer pid=%d uid=%d gid=%d", cred.pid, cred.uid, cred.gid)
            return None, error_frame(PermissionDeniedError(f"uid {cred.uid} is not on hwrd's allow-list"))
        if not self.ledger.session_allowed(cred.uid):
            limit = self.ledger.limits.max_sessions_per_uid
            log.warning("refused peer pid=%d uid=%d: it has %d sessions open (max_sessions_per_uid)",
                        cred.pid, cred.uid, limit)
            return None, error_frame(DaemonUnavailable(
                f"uid {cred.uid} has {limit} sessions open, the most hwrd allows one uid; close some",
                details={"reason": "SESSIONS_PER_UID", "limit": limit}))
        session = self._registry.open_session(cred)
        self.ledger.session_opened(cred.uid)
        return session, {"ok": True, "session_id": session.session_id, "token": session.token,
                         "pid": cred.pid, "uid": cred.uid}

    def _handle_now(self, session: Session, req: dict[str, Any]) -> Any:
        """(reply, fds, tail) for a request served synchronously, or ``_LATER``; every failure
        becomes an error frame (``_failure_frame``) and the connection stays usable."""
        op = req.get("op")
        try:
            if op == "acquire":
                key = _acquire_key(req)
                now = self._leasing.acquire_now(session, key) if self._leasing is not None else None
                if now is None:
                    return _LATER
                return self._acquired(session, req, key, *now)
            if op in _PUBLISH_OPS:
                return _LATER
            reply, fds = self._serve_now(session, op, req)
            return reply, fds, b""
        except Exception as exc:
            return _failure_frame(op, exc), [], b""

    async def _handle_later(self, session: Session, req: dict[str, Any]) -> tuple[dict[str, Any], list[int], bytes]:
        """A request that awaits (a publication op, or an ``acquire`` that must validate or wait
        out an eviction round); every failure becomes an error frame (``_failure_frame``)."""
        op = req.get("op")
        try:
            if op in _PUBLISH_OPS:
                if self._publishing is None:
                    raise PermissionDeniedError(f"peer operation {op!r} is not served here")
                reply, fds = await getattr(self._publishing, _PUBLISH_OPS[op])(session, req)
                return reply, fds, b""
            key = _acquire_key(req)
            if self._leasing is None:
                raise PermissionDeniedError("peer operation 'acquire' is not served here")
            record, lease = await self._leasing.acquire(session, key)
            return self._acquired(session, req, key, record, lease)
        except Exception as exc:
            return _failure_frame(op, exc), [], b""

    def _acquired(self, session: Session, req: dict[str, Any], key: str, record: ArtifactRecord,
                  lease: LeaseRecord) -> tuple[dict[str, Any], list[int], bytes]:
        leasing = self._leasing
        try:
            data, digest = leasing.manifest(record)
            fds = leasing.payload_fds(record)  # flushes the lease journal before they leave
        except BaseException:
            leasing.release(session, lease.lease_id)
            raise
        tail = b"" if req.get("have") == digest else data
        return ({"ok": True, "lease_id": lease.lease_id, "lease_token": lease.token, "key": key,
                 "manifest_sha256": digest, "manifest_bytes": len(tail), "count": len(fds)}, fds, tail)

    def _serve_now(self, session: Session, op: object, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """``hello``, ``release``, ``ping``, ``fds``, ``staging_fds`` (module docstring); an
        unknown op is refused. Raises typed errors (the caller makes them frames)."""
        if op == "ping":
            return {"ok": True}, []
        if op == "hello":
            name, version = req.get("client_name", ""), req.get("client_version", "")
            if not isinstance(name, str) or not isinstance(version, str) or len(name) > 128 \
                    or len(version) > 128:
                raise InvalidRequest("client_name/client_version must be strings of at most 128 characters")
            session.client_name, session.client_version = name, version
            return {"ok": True, "session_id": session.session_id, "pid": session.cred.pid,
                    "uid": session.cred.uid, "daemon_version": __version__}, []
        if op in ("release", "fds"):
            if self._leasing is None:
                raise PermissionDeniedError(f"peer operation {op!r} is not served here")
            if op == "fds":
                fds = self._leasing.lease_fds(session, _str(req, "lease_id"), _str(req, "lease_token"))
                return {"ok": True, "count": len(fds)}, fds
            lease_id = req.get("lease_id")
            if not isinstance(lease_id, str):
                raise InvalidRequest("lease_id is required")
            return {"ok": True, "released": self._leasing.release(session, lease_id)}, []
        if op == "staging_fds":
            if self._publishing is None:
                raise PermissionDeniedError(f"peer operation {op!r} is not served here")
            fds = self._publishing.staging_fds(session, _str(req, "publication_id"), _str(req, "publication_token"))
            return {"ok": True, "count": len(fds)}, fds
        raise PermissionDeniedError(f"unknown peer operation {str(op)[:40]!r}")


class _Connection(asyncio.Protocol):
    """One peer connection = one session (see ``PeerServer``)."""

    def __init__(self, server: PeerServer, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self.sock = sock  # the transport's socket: replies with descriptors go out by sendmsg here
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.session: Session | None = None
        self.buf = bytearray()
        self.busy = False  # a request is in a task; reading is paused until it is answered
        self.write_paused = False  # the client is not reading its replies (see pause_writing)
        self.closed = False
        self.ended: asyncio.Future[None] = loop.create_future()  # set once the session has ended
        self._tasks: set[asyncio.Task[None]] = set()
        self.inflight: InflightFds | None = None  # descriptors sent, maybe not received yet
        self.frames = FrameWatch(server.ledger, loop, self, lambda: self.busy or self.write_paused,
                                 self._stalled)

    # asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if hasattr(transport, "max_size"):  # bound what one read adds to the buffer (peer_limits)
            transport.max_size = READ_SIZE  # type: ignore[attr-defined]
        try:
            session, hello = self.server._greet(self.sock)
        except OSError as exc:
            log.debug("peer connection ended at greeting: %s", exc)
            self.abort()
            return
        self.session = session
        if session is not None:
            self.inflight = InflightFds(self.server.ledger, session.cred.uid, self.sock)
        if not self._send_now(hello, [], b""):
            self._later(self._send_later(hello, [], b""))
        if session is None:
            assert self.transport is not None
            self.transport.close()  # after the refusal frame is flushed

    def pause_writing(self) -> None:
        """The transport's buffer of unsent replies passed its high-water mark (64 KiB): the
        client sends requests without reading the replies. Stop reading its requests until it
        catches up, so the daemon's memory for one connection stays bounded (otherwise every
        request would add its reply to an unbounded buffer)."""
        self.write_paused = True
        self._set_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._set_reading()
        self._pump()
        self._account()

    def _set_reading(self) -> None:
        """Read requests unless one is in a task (``busy``), replies are backed up, or this
        connection's partial frame is over the shared buffer budget (``peer_limits``)."""
        if self.transport is None or self.closed:
            return
        over = self.frames.over()
        if over:
            self.server.ledger.wait_for_budget(self, self._set_reading)
        if self.busy or self.write_paused or over:
            self.transport.pause_reading()
            if self.busy or self.write_paused:
                self.frames.restart()  # not the client's stall
        else:
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._pump()
        self._account()

    def _account(self) -> None:
        """Charge the buffer to the shared budget and watch an incomplete first frame."""
        if not self.closed and self.frames.account(self.buf):
            self._set_reading()

    def _stalled(self, timeout: float) -> None:
        if self.closed:
            return
        cred = self.session.cred if self.session is not None else None
        log.warning("peer connection of pid %s uid %s: a request frame is still incomplete after %.0f s "
                    "(%d bytes buffered); ending the session", cred.pid if cred else "?",
                    cred.uid if cred else "?", timeout, len(self.buf))
        self.abort()

    def eof_received(self) -> bool:
        return False  # close the transport: EOF ends the session

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed:
            return
        self.closed = True
        self.buf.clear()
        self.frames.close()
        if self.inflight is not None:
            self.inflight.close()
        if self.session is not None:
            self.server.ledger.session_closed(self.session.cred.uid)
        if exc is not None:
            log.debug("peer connection ended: %s", exc)
        self.loop.create_task(self._end())

    async def _end(self) -> None:
        try:
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            if self.session is not None:
                await self.server._on_session_end(self.session)
        finally:
            if not self.ended.done():
                self.ended.set_result(None)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
        else:
            self.connection_lost(None)

    # requests ----------------------------------------------------------------------------
    def _pump(self) -> None:
        """Serve every complete frame in the buffer, in order, until one needs a task."""
        while not self.busy and not self.write_paused and not self.closed and self.session is not None:
            try:
                request = self._next_frame()
            except ConnectionError as exc:
                log.debug("peer protocol error: %s", exc)
                self.abort()
                return
            if request is None:
                return
            result = self.server._handle_now(self.session, request)
            if result is _LATER:
                self._later(self._serve_later(request))
                return
            reply, fds, tail = result
            try:
                sent = self._send_now(reply, fds, tail)
            except BaseException:
                close_fds(fds)
                raise
            if sent:
                close_fds(fds)
            else:  # no room for the descriptors: wait for the client to read (it owns them now)
                self._later(self._send_later(reply, fds, tail))
                return

    def _next_frame(self) -> dict[str, Any] | None:
        return take_frame(self.buf)  # ConnectionError: bytes that are not a frame end the session

    def _later(self, coro: Awaitable[None]) -> None:
        self.busy = True
        self._set_reading()
        task = self.loop.create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._resume)

    def _resume(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("peer request failed: %r", task.exception())
            self.abort()
        self.busy = False
        if not self.closed and self.transport is not None:
            self._set_reading()
            self._pump()
            self._account()

    async def _serve_later(self, request: dict[str, Any]) -> None:
        assert self.session is not None
        reply, fds, tail = await self.server._handle_later(self.session, request)
        await self._send_later(reply, fds, tail)

    # replies -----------------------------------------------------------------------------
    def _send_now(self, obj: dict[str, Any], fds: list[int], tail: bytes) -> bool:
        """Send one reply without waiting; False when descriptors cannot go out yet (the caller
        then uses ``_send_later``). Bytes that do not fit go through the transport's buffer."""
        if self.closed or self.transport is None:
            return True  # the session is over: nothing to answer
        try:
            data = encode_frame(obj, tail)
        except InvalidRequest:  # over MAX_FRAME (details too long): the error instead, no tail
            data = encode_frame(error_frame(HwrError("reply too large for a peer frame")))
        if self.transport.get_write_buffer_size():
            if fds:
                return False
            self.transport.write(data)
            return True
        if fds and self.inflight is not None and not self.inflight.may_send(len(fds)):
            return False  # the client has not read earlier descriptors (peer_limits)
        try:
            sent = socket.send_fds(self.sock, [data], fds) if fds else self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            if fds:
                return False
            sent = 0
        except OSError as exc:
            if fds and exc.errno == errno.ETOOMANYREFS:
                return False  # the daemon's user has too many descriptors in flight: wait
            log.debug("peer send failed: %s", exc)
            self.abort()
            return True
        if fds and self.inflight is not None:
            self.inflight.sent(len(fds))
        if sent < len(data):
            self.transport.write(data[sent:])
        return True

    async def _send_later(self, obj: dict[str, Any], fds: list[int], tail: bytes) -> None:
        delay = 0.001
        try:
            while not self._send_now(obj, fds, tail):
                await asyncio.sleep(delay)  # a client that stopped reading its replies
                delay = min(2 * delay, 0.05)
        finally:
            close_fds(fds)


def _acquire_key(req: dict[str, Any]) -> str:
    from hwr.daemon.service.leasing import key_of

    key, identity = req.get("key"), req.get("identity")
    if identity is not None:
        if not isinstance(identity, str) or len(identity) > MAX_FRAME:
            raise InvalidRequest("identity must be canonical identity JSON text", details={"field": "identity"})
        return key_of(identity_json=identity.encode())
    if key is not None and not isinstance(key, str):
        raise InvalidRequest("key must be 64 lowercase hex digits", details={"field": "artifact.key"})
    return key_of(key=key)


def _str(req: dict[str, Any], name: str) -> str:
    value = req.get(name)
    if not isinstance(value, str) or not value or len(value) > 256:
        raise PermissionDeniedError(f"peer request field {name!r} is missing or invalid")
    return value


def _refuse(sock: socket.socket) -> None:
    """The greeting of a connection accepted with the spare descriptor while the daemon has
    none left (``hwr.daemon.system.accepting``): a typed, retryable error instead of a timeout."""
    sock.settimeout(1.0)
    send_frame(sock, error_frame(DaemonUnavailable(
        "hwrd has no file descriptor left for a new session (too many open connections); retry later",
        details={"reason": "EMFILE"})))


def _failure_frame(op: object, exc: Exception) -> dict[str, Any]:
    """The error frame of a request that failed: a typed error as it is; an OS error (out of
    descriptors or memory: the host's state, not a bug) with its errno and a warning, no
    traceback; anything else is a bug, logged with one. The request fails, not the session."""
    if isinstance(exc, HwrError):
        return error_frame(exc)
    name = str(op)[:40]
    if isinstance(exc, OSError):
        log.warning("peer operation %s failed: %s", name, exc)
        return error_frame(HwrError(f"peer operation {name} failed: {exc.strerror or exc}",
                                    details={"errno": errno.errorcode.get(exc.errno or 0, str(exc.errno))}))
    log.error("internal error in peer operation %s", name, exc_info=exc)
    return error_frame(HwrError(f"internal error in peer operation {name}"))
