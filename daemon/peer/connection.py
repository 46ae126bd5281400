"""One peer connection of the peer socket (``hwr.daemon.peer.server``): its session, its read
buffer and frame watch, the requests it serves in order, and its replies with descriptors.

Reading: bytes accumulate in ``buf``; every complete frame is served in order (``_pump``): a
request the server answers without awaiting is answered at once, anything else pauses reading,
runs in a task (``_later``) and resumes when answered, so one connection has one request in
flight. Replies: ``_send_now`` writes the frame and its descriptors with one ``sendmsg`` when the
socket has room, else ``_send_later`` retries with backoff until the client reads; descriptors
are closed once sent (or when the connection ends). The end of the connection (EOF, a protocol
error, a stalled frame, ``abort``) ends the session through the server's ``on_session_end``.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import logging
import socket
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from hwr.client.errors import HwrError, InvalidRequest
from hwr.client.wire import close_fds, encode_frame, error_frame, take_frame
from hwr.daemon.peer.limits import READ_SIZE, FrameWatch, InflightFds
from hwr.daemon.service.sessions import Session

if TYPE_CHECKING:
    from hwr.daemon.peer.server import PeerServer

__all__ = ["LATER", "Later", "PeerConnection", "Served"]

log = logging.getLogger("hwrd.peer")


class Later(enum.Enum):
    """What ``PeerServer.handle_now`` returns for a request that needs the event loop (it awaits)."""

    LATER = "later"


LATER = Later.LATER
#: A served request: the reply frame, the descriptors sent with it (closed by the sender once
#: sent) and the bytes that follow the frame (a manifest).
Served = tuple[dict[str, Any], list[int], bytes]


class PeerConnection(asyncio.Protocol):
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
        # When the client last sent bytes (the session budget sheds the least recently active),
        # and whether it was shed (its session was taken off the ledger then).
        self.last_active = time.monotonic()
        self.shed = False
        self.frames = FrameWatch(server.ledger, loop, self, lambda: self.busy or self.write_paused,
                                 self._stalled)

    # asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if hasattr(transport, "max_size"):  # bound what one read adds to the buffer (peer_limits)
            transport.max_size = READ_SIZE  # type: ignore[attr-defined]
        try:
            session, hello = self.server._greet(self.sock, self)
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
        self.last_active = time.monotonic()
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
            self.server._session_gone(self)
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
            except InvalidRequest as exc:  # a whole frame, but not text (decode_body): answered, in step
                request, result = None, (error_frame(exc), [], b"")
            else:
                if request is None:
                    return
                result = self.server.handle_now(self.session, request)
            if result is LATER:
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
        reply, fds, tail = await self.server.handle_later(self.session, request, self._notify)
        await self._send_later(reply, fds, tail)

    def _notify(self, frame: dict[str, Any]) -> bool:
        """An interim frame (no descriptors) before the reply of the request in flight; False
        once the connection is gone. It goes through the transport's buffer when the socket is
        full, which ``pause_writing`` bounds like any reply."""
        if self.closed or self.transport is None:
            return False
        return self._send_now(frame, [], b"") and not self.closed

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
