"""``client.watch_channel(name)``: hear of every change of a channel, newest first, never a queue.

    with client.watch_channel("flux-rl") as watch:
        while True:
            update = watch.wait(timeout=1.0)       # ChannelUpdate(name, key, generation) or None
            if update is not None and update.key != serving_key:
                switch_to(client.acquire(update.key))

A ``ChannelWatch`` holds one ``WatchChannel`` stream on the client's session (gRPC, read by a
background thread, on a connection that carries only watches: ``Connection.watch_stream``, so
open watches never hold up the client's other calls) and keeps only the newest state it heard
of. ``wait`` returns the newest state not yet returned (coalesced: a slow caller sees the
newest, never the states in between), or None when ``timeout`` passes first. The first
``wait`` returns the channel's state at subscription when the channel exists (compare its key
with the one you serve).

Session end and restarts: hwrd ends a watch when its session ends (and when it stops). The watch
then RESUMES on the client's next session: with ``auto_reconnect`` (the default) it reconnects
(once, shared with the client's other calls) and subscribes again, retrying with a growing pause
(up to 2 s) while hwrd is down; the first state of the new subscription is reported if it
differs from the newest one heard before (a restart that lost a non-durable revision reports
the channel's fallback to its last durable key this way). ``wait`` meanwhile returns None at its
timeout; ``connected`` says whether a subscription is live. The watch ENDS, and ``wait`` raises
a typed ``HwrError``, when the watch or its client is closed (``DaemonUnavailable``), when
``auto_reconnect`` is off and the session ended (``SessionInvalid``/``DaemonUnavailable``), or
when hwrd refuses the subscription (``InvalidRequest``: too many watches in one session).

Thread safety: ``wait`` may be called from any thread (usually one); ``close`` from any thread,
idempotent. Limit: a channel's removal is not reported (the watch waits for it to be set again).
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING

import grpc

from hwr.client.channels import ChannelUpdate, check_channel_name
from hwr.client.errors import DaemonUnavailable, DeadlineExceeded, HwrError
from hwr.client.wire import error_from_rpc
from hwr.protos.hwr.v1 import hwr_pb2 as pb

if TYPE_CHECKING:
    from hwr.client.connection import Connection

__all__ = ["ChannelWatch"]

#: Errors after which the watch subscribes again on a new session (when it may reconnect).
_RESUMABLE = frozenset({"DAEMON_UNAVAILABLE", "SESSION_INVALID"})


class ChannelWatch:
    """A subscription to one channel (see the module docstring); a context manager."""

    def __init__(self, connection: Connection, name: str) -> None:
        self.name = check_channel_name(name)
        self._connection = connection
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._newest: ChannelUpdate | None = None
        self._returned: ChannelUpdate | None = None
        self._error: HwrError | None = None
        self._closed = False
        self._subscribed = False  # the current stream has delivered its first message
        self._ever_subscribed = False
        self._call: grpc.Call | None = None
        #: Subscriptions made again after the first (a daemon restart, a session replaced).
        self.resubscriptions = 0
        self._thread = threading.Thread(target=self._run, name=f"hwr-watch-{self.name}", daemon=True)
        self._thread.start()
        # The first subscription's outcome is this call's: a refusal raises here, and a change
        # made after watch_channel returns is never missed.
        with self._cond:
            ready = self._cond.wait_for(lambda: self._ever_subscribed or self._error is not None,
                                        timeout=connection.timeout)
        if self._error is not None:
            error = self._error
            self.close()
            raise error
        if not ready:
            self.close()
            raise DeadlineExceeded(f"hwrd did not confirm the watch of channel {self.name!r} in time")

    # the caller's side --------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> ChannelUpdate | None:
        """The newest state not yet returned; None when ``timeout`` (seconds) passes first.
        Raises a typed ``HwrError`` once the watch has ended (see the module docstring)."""
        if os.getpid() != self._pid:
            raise DaemonUnavailable("this watch belongs to the parent process; watch again after fork")
        with self._cond:
            self._cond.wait_for(lambda: self._unseen() or self._error is not None or self._closed, timeout)
            if self._unseen():
                self._returned = self._newest
                return self._newest
            if self._closed:
                raise DaemonUnavailable(f"the watch of channel {self.name!r} is closed")
            if self._error is not None:
                raise self._error
            return None

    def _unseen(self) -> bool:
        return self._newest is not None and self._newest != self._returned

    @property
    def newest(self) -> ChannelUpdate | None:
        """The newest state heard of (returned by ``wait`` or not); None before the first."""
        return self._newest

    @property
    def connected(self) -> bool:
        """Whether a subscription is live now (False while hwrd restarts, and once ended)."""
        return self._subscribed and not self._closed and self._error is None

    def close(self) -> None:
        """Unsubscribe (idempotent); a ``wait`` in another thread raises ``DaemonUnavailable``."""
        with self._cond:
            self._closed = True
            call, self._call = self._call, None
            self._cond.notify_all()
        if call is not None:
            call.cancel()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> ChannelWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "ended" if self._error is not None else (
            "connected" if self._subscribed else "resubscribing")
        return f"ChannelWatch(name={self.name!r}, newest={self._newest!r}, {state})"

    # the reader thread --------------------------------------------------------------------
    def _run(self) -> None:
        delay = 0.05
        while not self._closed:
            connection = self._connection
            if not connection.active:
                self._end(DaemonUnavailable("the client is closed"))
                return
            peer = connection.peer  # the session this subscription belongs to
            error = self._stream(connection)
            if self._closed:
                return
            if not (connection.auto_reconnect and connection.active) or error.code not in _RESUMABLE:
                self._end(error)
                return
            if error.code == "DAEMON_UNAVAILABLE" and connection.peer_alive(peer):
                # Only the stream's gRPC connection went (shed by hwrd): subscribe again on the
                # same session, on a fresh connection.
                time.sleep(delay)
                delay = min(2.0, delay * 2)
                self.resubscriptions += 1
                continue
            try:
                connection.reconnect(failed_peer=peer)  # nothing when another thread already did
                delay = 0.05
            except HwrError:  # hwrd is down: try again shortly
                time.sleep(delay)
                delay = min(2.0, delay * 2)
            self.resubscriptions += 1

    def _stream(self, connection: Connection) -> HwrError:
        """Read one subscription until it ends; returns why it ended."""
        try:
            slot = connection.watch_stream()
            call = slot.stub.WatchChannel(pb.WatchChannelRequest(name=self.name), metadata=connection.metadata)
        except HwrError as exc:
            return exc
        with self._cond:
            if self._closed:
                call.cancel()
                slot.release()
                return DaemonUnavailable("closed")
            self._call = call
        try:
            for message in call:
                with self._cond:
                    self._subscribed = self._ever_subscribed = True
                    if message.exists:
                        c = message.channel
                        update = ChannelUpdate(c.name, c.key, c.generation)
                        if update != self._newest:
                            self._newest = update
                    self._cond.notify_all()
            return DaemonUnavailable("hwrd ended the watch")
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:  # closed by us, or the client replaced its channel
                return DaemonUnavailable("the watch stream was cancelled")
            return error_from_rpc(exc)
        finally:
            with self._cond:
                self._subscribed = False
                if self._call is call:
                    self._call = None
            slot.release()

    def _end(self, error: HwrError) -> None:
        with self._cond:
            self._error = error
            self._subscribed = False
            self._cond.notify_all()
