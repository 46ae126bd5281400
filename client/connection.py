"""The session with hwrd: the peer socket, the gRPC channel, reconnection and fork handling.

A ``Connection`` is what a ``Client`` holds of the daemon: the peer socket (``<socket>.peer``:
authentication, the session's liveness, descriptor passing, and the lease hot path, see
``hwr.daemon.peer.server``), the session token that control calls carry, and a gRPC channel opened on
the first call that needs it (a client that only acquires and releases never opens one).
Closing it, or the process exiting, ends the session and the daemon releases every lease the
session still holds. Every connection of the peer socket (the first and each reconnect) is
checked before a byte is sent on it: the daemon's uid and the place of both sockets
(``hwr.client.daemon_trust``; ``UntrustedDaemon`` otherwise).

Contract:
- ``call`` (gRPC) and ``exchange`` (one peer request/reply) raise a typed ``HwrError`` for every
  failure; a broken peer socket is ``DaemonUnavailable``. ``call`` returns the RPC's response
  message (the generated gRPC stub is untyped: the caller names the response type).
- ``close()`` is idempotent, and safe on a connection whose constructor failed half-way.
- Fork: a child inherits the parent's sockets; the connection closes its copy of the peer socket
  in the child (so the parent's death still ends the parent's session) and refuses to be used
  there (``DaemonUnavailable``).

Reconnect after a daemon restart: when hwrd restarts (clean or SIGKILL) the session ends; the
connection then opens a new session on the same socket and runs ``reattach`` (its owner's hook:
the client re-acquires the key of every open lease there, see ``hwr.client.acquisition``). This
happens on the next call that fails with SESSION_INVALID or DAEMON_UNAVAILABLE, and in the
background (a watcher thread that polls the peer socket for hang-up) while the owner says the
session is needed. Limits: publications in flight are lost (their commit fails: publish again);
calls bound to the old session (Release, Commit/AbortPublication) are not retried.

Streams apart from calls: hwrd serves at most ``STREAMS_PER_GRPC_CONNECTION`` (8) calls in flight
per gRPC connection, and a channel watch is a call that stays in flight. So watches never ride on
the connection the unary calls use: ``watch_stream`` hands each one a slot on a gRPC connection
of its own kind (one per ``STREAMS_PER_GRPC_CONNECTION`` watches, opened when needed and closed
when its last watch ends). A session's 64 watches thus take 8 more gRPC connections (of the
uid's ``max_grpc_connections_per_uid``) and never delay a unary call.

Thread safety: calls may be made from several threads; peer exchanges are serialized. The lock
order and what each lock guards is written where the locks are declared (``__init__``).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

import grpc

from hwr import __version__
from hwr.client.daemon_trust import check_daemon
from hwr.client.errors import DaemonUnavailable, DeadlineExceeded, HwrError, PermissionDeniedError
from hwr.client.paths import peer_path
from hwr.client.wire import (
    SESSION_KEY,
    close_fds,
    encode_frame,
    error_from_frame,
    error_from_rpc,
    recv_final_reply,
    recv_frame,
    recv_reply,
    send_frame,
)
from hwr.protos.hwr.v1 import hwr_pb2_grpc

if TYPE_CHECKING:
    from google.protobuf.message import Message

__all__ = ["STREAMS_PER_GRPC_CONNECTION", "Connection", "ReattachReport", "WatchSlot", "open_peer", "open_session"]

R = TypeVar("R")

#: Calls hwrd serves in flight on one gRPC connection (its ``grpc.max_concurrent_streams``).
STREAMS_PER_GRPC_CONNECTION = 8

#: Every connection of this process, so that a forked child can drop its copies of their sockets.
_LIVE: weakref.WeakSet[Connection] = weakref.WeakSet()


class ReattachReport(TypedDict):
    """What a reconnect did to the open leases: how many were rebound, and the keys detached."""

    reattached: int
    detached: list[str]


def _nothing_to_reattach() -> ReattachReport:
    return {"reattached": 0, "detached": []}


class _StreamChannel:
    """A gRPC connection that carries only long-lived streams (watches), at most
    ``STREAMS_PER_GRPC_CONNECTION`` of them. Its own subchannel pool: it never shares its
    connection with the unary calls' channel (grpc shares equal targets process-wide otherwise)."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        self.stub = hwr_pb2_grpc.HostWeightRuntimeStub(self.channel)
        self.users = 0


class WatchSlot:
    """One stream's place on a stream connection (``Connection.watch_stream``); ``release``
    (idempotent) gives it back, closing the connection when it was the last one there."""

    def __init__(self, owner: Connection, holder: _StreamChannel) -> None:
        self._owner, self._holder = owner, holder
        self.stub = holder.stub
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._owner._release_stream(self._holder)


class Connection:
    """One session with hwrd on ``socket_path`` (opened by the constructor), replaced on reconnect."""

    #: RPCs bound to the session they were made in: after a reconnect they would act on nothing.
    NO_RETRY = frozenset({"Release", "CommitPublication", "AbortPublication", "OpenSession", "VerifyArtifact"})

    def __init__(self, socket_path: Path, *, timeout: float = 30.0, client_name: str | None = None) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self.auto_reconnect = True
        self.reconnects = 0
        #: Run by ``reconnect`` under its lock once the new session is in place; set once by the
        #: owner before it hands out leases (the client's lease table).
        self.reattach: Callable[[], ReattachReport] = _nothing_to_reattach
        self.session_id = ""
        self.token = ""
        self.metadata: tuple[tuple[str, str], ...] = ()
        self._client_name = client_name
        self._pid = os.getpid()
        self._closed = False
        # Locks, taken in this order only (a thread holding a later one never takes an earlier one):
        # 1. _reconnect_lock: one reconnect at a time: opening the new session, swapping it in and
        #    the ``reattach`` that follows. Reentrant, so that code run by ``reattach`` may reach
        #    ``reconnect`` without deadlocking its own thread.
        # 2. _peer_lock: the peer socket, one exchange (request and its reply) at a time; and the
        #    swap of ``_peer`` with the session's token in ``reconnect``.
        # 3. _channel_lock: the lazy creation of the gRPC channel and stub, and their replacement
        #    (``reconnect``, ``close``).
        # Read without a lock (one reference read each): ``_peer`` (a snapshot, passed back as
        # ``failed_peer`` so that a failure seen by several threads, or by a caller and the watcher,
        # reconnects once), ``metadata`` (a call that carried a stale token fails with
        # SESSION_INVALID and is retried on the new session). ``close`` takes no lock: it must not
        # wait behind an exchange blocked for up to the timeout; it swaps ``_peer`` out and shuts
        # the socket down, which ends that exchange and the watcher's poll.
        self._reconnect_lock = threading.RLock()
        self._peer_lock = threading.Lock()
        self._channel_lock = threading.Lock()
        self._peer: socket.socket | None = None
        self._channel: grpc.Channel | None = None
        self._grpc_stub: hwr_pb2_grpc.HostWeightRuntimeStub | None = None
        self._watcher: threading.Thread | None = None
        # Guards ``_streams`` (taken after the locks above, never before one of them).
        self._streams_lock = threading.Lock()
        self._streams: list[_StreamChannel] = []
        try:
            self._peer, hello = open_session(socket_path, timeout, self._hello_request())
            self._take_session(hello)
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

    # state ----------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def owned_here(self) -> bool:
        """Whether this process opened the connection (False in a forked child)."""
        return os.getpid() == self._pid

    @property
    def active(self) -> bool:
        """Open, and in the process that opened it: the daemon still counts what it does."""
        return not self._closed and os.getpid() == self._pid

    @property
    def peer(self) -> socket.socket | None:
        """The current peer socket (a snapshot: pass it back as ``reconnect(failed_peer=...)``
        after a failure seen on the current session, so that several observers reconnect once)."""
        return self._peer

    @property
    def channel(self) -> grpc.Channel | None:
        """The gRPC channel, None until a call needed it (and again after a reconnect)."""
        return self._channel

    @property
    def stub(self) -> hwr_pb2_grpc.HostWeightRuntimeStub:
        """The gRPC stub, its channel opened on first use (and again after a reconnect)."""
        stub = self._grpc_stub
        if stub is None:
            with self._channel_lock:
                if self._grpc_stub is None:
                    self._channel = grpc.insecure_channel(f"unix:{self.socket_path}")
                    self._grpc_stub = hwr_pb2_grpc.HostWeightRuntimeStub(self._channel)
                stub = self._grpc_stub
        return stub

    def watch_stream(self) -> WatchSlot:
        """A slot for one long-lived stream (a channel watch) on a gRPC connection that carries
        no unary call (see the module docstring); the caller releases it when its stream ends."""
        with self._streams_lock:
            holder = next((h for h in self._streams if h.users < STREAMS_PER_GRPC_CONNECTION), None)
            if holder is None:
                holder = _StreamChannel(f"unix:{self.socket_path}")
                self._streams.append(holder)
            holder.users += 1
            return WatchSlot(self, holder)

    def _release_stream(self, holder: _StreamChannel) -> None:
        with self._streams_lock:
            holder.users -= 1
            idle = holder.users <= 0
            if idle and holder in self._streams:
                self._streams.remove(holder)
        if idle and os.getpid() == self._pid:
            holder.channel.close()

    def _drop_streams(self) -> None:
        """Forget the stream connections (a reconnect or close): their streams end with the
        session; each closes with its last release, and new watches open fresh ones."""
        with self._streams_lock:
            idle = [h for h in self._streams if h.users <= 0]
            self._streams = []
        for holder in idle:
            holder.channel.close()

    def check_usable(self) -> None:
        if self._closed:
            raise DaemonUnavailable("the client is closed")
        if os.getpid() != self._pid:
            raise DaemonUnavailable("this client belongs to the parent process; connect() again after fork")

    def _hello_request(self) -> dict[str, Any]:
        # The peer socket's ``hello`` names the session (what the OpenSession RPC does).
        return {"op": "hello", "client_name": (self._client_name or f"pid-{os.getpid()}")[:128],
                "client_version": __version__}

    def _take_session(self, hello: dict[str, Any]) -> None:
        self.token = str(hello["token"])
        self.session_id = str(hello["session_id"])
        self.metadata = ((SESSION_KEY, self.token),)

    # calls ----------------------------------------------------------------------------------
    def call(self, method: str, request: Message, timeout: float | None = None) -> Any:
        """The RPC ``method`` with the session's token; after a reconnect (the daemon restarted)
        it is made once more, unless it belongs to the old session (``NO_RETRY``). A call whose
        gRPC connection broke while the session lives on is made once more on the same session
        first."""
        self.check_usable()
        peer = self._peer
        try:
            return getattr(self.stub, method)(request, metadata=self.metadata, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            error = error_from_rpc(exc)
        if error.code == "DAEMON_UNAVAILABLE" and self.may_reconnect(method, error) and self.peer_alive(peer):
            # Only this call's gRPC connection went (hwrd sheds one to make room for other uids):
            # once more on the same session before the session is given up.
            try:
                return getattr(self.stub, method)(request, metadata=self.metadata, timeout=timeout or self.timeout)
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
        if not self.may_reconnect(method, error):
            raise error
        self.reconnect(failed_peer=peer)  # raises DaemonUnavailable while hwrd is down
        try:
            return getattr(self.stub, method)(request, metadata=self.metadata, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

    def exchange(self, request: dict[str, Any], *, want_fds: bool, timeout: float | None = None,
                 on_pending: Callable[[dict[str, Any]], None] | None = None,
                 ) -> tuple[dict[str, Any], list[int], bytes]:
        """One request/reply on the peer socket: (reply, descriptors, raw tail bytes).

        An error frame raises its typed error (descriptors closed); a broken channel raises
        ``DaemonUnavailable``. ``timeout``: this exchange's bound instead of the connection's
        (a timeout ends the connection, and with it the session: see below); with
        ``on_pending`` (a request that asked for interim frames, e.g. an acquire's pull
        progress), it bounds each silence of the daemon, and every interim frame goes to
        ``on_pending`` (which must not raise) before the final reply.
        """
        self.check_usable()
        with self._peer_lock:
            sock = self._peer
            if sock is None:
                raise DaemonUnavailable("the client is closed")
            usual = sock.gettimeout()
            try:
                if timeout is not None:
                    sock.settimeout(timeout)
                sock.sendall(encode_frame(request))
                if on_pending is None:
                    reply, fds, tail = recv_reply(sock, want_fds=want_fds)
                else:
                    reply, fds, tail = recv_final_reply(sock, want_fds=want_fds, on_pending=on_pending)
                if timeout is not None:
                    sock.settimeout(usual)
            except (ConnectionError, OSError) as exc:
                # Half an exchange (a timeout, a reset) leaves the stream out of step: end this
                # connection so no later request reads a stale reply (the watcher or the next
                # acquire reconnects and reattaches the open leases).
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                raise DaemonUnavailable(f"peer socket to hwrd broke: {exc}") from None
        if not reply.get("ok"):
            close_fds(fds)
            raise error_from_frame(reply)
        return reply, fds, tail

    def with_reconnect(self, exchange: Callable[[], R], deadline: float | None = None) -> R:
        """``exchange()`` on the peer socket; when the channel broke (a daemon restart ends the
        session), reconnect once and run it again, as ``call`` does for gRPC. Only for requests
        that do not belong to the old session (acquire, publish_begin). Past ``deadline``
        (``time.monotonic()``) a broken channel is ``DeadlineExceeded`` and is not retried."""
        peer = self._peer
        try:
            return exchange()
        except DaemonUnavailable as exc:
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceeded(f"hwrd did not answer before the deadline ({exc.message})") from None
            if not (self.auto_reconnect and self.active):
                raise
            self.reconnect(failed_peer=peer)
            return exchange()

    # reconnect ------------------------------------------------------------------------------
    def may_reconnect(self, method: str, error: HwrError) -> bool:
        return (self.auto_reconnect and self.active and method not in self.NO_RETRY
                and error.code in ("SESSION_INVALID", "DAEMON_UNAVAILABLE"))

    def reconnect(self, *, failed_peer: socket.socket | None = None) -> ReattachReport:
        """Open a new session, then run ``reattach``; returns its report.

        ``failed_peer``: the connection the caller saw fail; when another thread has replaced it
        meanwhile, nothing is done.
        """
        self.check_usable()
        with self._reconnect_lock:
            if failed_peer is not None and failed_peer is not self._peer:
                return _nothing_to_reattach()
            peer, hello = open_session(self.socket_path, self.timeout, self._hello_request())
            old_peer = self._peer
            with self._peer_lock, self._channel_lock:
                old_channel = self._channel
                self._peer = peer
                self._take_session(hello)
                # A fresh channel on next use: the old one may be stuck backing off to a dead socket.
                self._channel, self._grpc_stub = None, None
            for closing in (old_peer, old_channel):
                if closing is not None:
                    with contextlib.suppress(Exception):
                        closing.close()
            self._drop_streams()
            self.reconnects += 1
            return self.reattach()

    def peer_alive(self, peer: socket.socket | None) -> bool:
        """Whether ``peer`` is still the current session's socket and hwrd has not hung it up: a gRPC
        stream that failed meanwhile lost only its own connection (hwrd may close a gRPC
        connection to make room for other uids), not the session."""
        if peer is None or peer is not self._peer:
            return False
        poller = select.poll()
        try:
            poller.register(peer, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
            return not poller.poll(0)
        except (OSError, ValueError):
            return False

    def start_watcher(self, needed: Callable[[], bool]) -> None:
        """Watch the peer socket for hang-up in a daemon thread, and reconnect when it hangs up,
        for as long as ``needed()`` (the owner holds leases) and the connection is active."""
        if not self.auto_reconnect or (self._watcher is not None and self._watcher.is_alive()):
            return
        self._watcher = threading.Thread(target=self._watch, args=(needed,), name="hwr-reconnect", daemon=True)
        self._watcher.start()

    def _watch(self, needed: Callable[[], bool]) -> None:
        delay = 0.1
        while self.active and needed():
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
            self._drop_streams()

    def _forget_after_fork(self) -> None:
        # The child's copy of the peer socket must not keep the parent's session alive.
        peer, self._peer = self._peer, None
        if peer is not None:
            with contextlib.suppress(OSError):
                peer.close()
        self._closed = True


def _after_fork_in_child() -> None:
    for connection in list(_LIVE):
        connection._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def open_session(socket_path: Path, timeout: float,
                 hello_request: dict[str, Any]) -> tuple[socket.socket, dict[str, Any]]:
    """Connect the peer socket, read the daemon's greeting and name the session (``hello``)."""
    peer = open_peer(socket_path, timeout)
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


def open_peer(socket_path: Path, timeout: float) -> socket.socket:
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
        check_daemon(socket_path, sock)  # before a byte is sent to it (hwr.client.daemon_trust)
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
