"""What one peer connection, and one uid, can make hwrd hold (used by ``hwr.daemon.peer.server``).

A local client that is careless or hostile must not be able to deny service to the others:

- **Sessions per uid** (``max_sessions_per_uid``): a connection past the limit gets one typed
  refusal frame (``DAEMON_UNAVAILABLE``, retryable, ``details.reason = "SESSIONS_PER_UID"``) and
  is closed; held connections otherwise exhaust the daemon's descriptors.
- **Descriptors in flight** (``max_inflight_fds_per_connection``, ``max_inflight_fds_per_uid``,
  and overall half the daemon's soft ``RLIMIT_NOFILE``): descriptors sent with a reply stay
  charged to the daemon's user until the client reads that reply; once they pass its open-files
  limit the kernel refuses every further descriptor send of the daemon (``ETOOMANYREFS``), so a
  client that sends acquires without reading the replies would make innocent clients' acquires
  fail. A reply whose descriptors would pass a bound waits (the connection is not read
  meanwhile) until its client reads. How much is unread comes from ``SIOCOUTQ``, which for a
  Unix socket counts kernel buffer sizes, not bytes: so a connection's count is cleared when
  its client has read everything, and is otherwise taken as still in flight (exact for a
  client that waits for each reply, as ``hwr.client`` does; conservative for one that pipelines).
  A reply with more descriptors than a bound is still sent once nothing else is in flight.
- **Pending requests**: a connection is served one request at a time and is not read while a
  request or a reply waits, so what it can queue in the daemon is one request plus the bytes
  below.
- **Partial frames** (``peer_buffer_budget_bytes``, ``peer_frame_timeout_s``): each connection
  may buffer 64 KiB of an incomplete request frame; beyond that its bytes count against one
  budget shared by all connections, and a connection that would pass the budget is not read
  until others drain. A frame still incomplete ``peer_frame_timeout_s`` after its first byte
  ends the connection (and its session), so stalled frames cannot hold the budget for long.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import resource
import socket
import termios
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from hwr.client.wire import frame_size

__all__ = ["FrameWatch", "InflightFds", "Ledger", "PeerLimits", "unread_bytes"]

#: Bytes of an incomplete frame a connection may buffer outside the shared budget.
FREE_BUFFER = 64 << 10
#: Largest read per ``recv`` on a peer connection (asyncio's default is 256 KiB): what one
#: connection can add to its buffer before the budget is checked again.
READ_SIZE = 64 << 10


@dataclass(frozen=True)
class PeerLimits:
    max_sessions_per_uid: int = 1024
    max_inflight_fds_per_connection: int = 1024
    max_inflight_fds_per_uid: int = 4096
    buffer_budget_bytes: int = 64 << 20
    frame_timeout_s: float = 10.0

    @classmethod
    def from_config(cls, config: object) -> PeerLimits:
        return cls(
            max_sessions_per_uid=config.max_sessions_per_uid,  # type: ignore[attr-defined]
            max_inflight_fds_per_connection=config.max_inflight_fds_per_connection,  # type: ignore[attr-defined]
            max_inflight_fds_per_uid=config.max_inflight_fds_per_uid,  # type: ignore[attr-defined]
            buffer_budget_bytes=config.peer_buffer_budget_bytes,  # type: ignore[attr-defined]
            frame_timeout_s=config.peer_frame_timeout_s,  # type: ignore[attr-defined]
        )


def unread_bytes(sock: socket.socket) -> int:
    """What the peer of ``sock`` has not read yet (``SIOCOUTQ``; for a Unix socket in kernel
    buffer units, 0 exactly when everything was read); -1 when it cannot be asked."""
    out = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, out, True)
    except (OSError, ValueError):
        return -1
    return out[0]


class Ledger:
    """Counts shared by every connection of one peer server (event loop thread only)."""

    def __init__(self, limits: PeerLimits) -> None:
        self.limits = limits
        self.sessions_by_uid: Counter[int] = Counter()
        self.inflight_by_uid: Counter[int] = Counter()
        self.inflight_total = 0
        self.buffered = 0  # bytes of incomplete frames beyond each connection's FREE_BUFFER
        self._by_uid: dict[int, set[InflightFds]] = {}
        self._budget_waiters: dict[object, Callable[[], None]] = {}
        self._cap = 0
        self._cap_at = 0.0

    # sessions ---------------------------------------------------------------------------
    def session_allowed(self, uid: int) -> bool:
        return self.sessions_by_uid[uid] < self.limits.max_sessions_per_uid

    def session_opened(self, uid: int) -> None:
        self.sessions_by_uid[uid] += 1

    def session_closed(self, uid: int) -> None:
        self.sessions_by_uid[uid] -= 1
        if self.sessions_by_uid[uid] <= 0:
            del self.sessions_by_uid[uid]

    # descriptors in flight --------------------------------------------------------------
    def inflight_cap(self) -> int:
        """Half the soft open-files limit (re-read each second: ``prlimit`` may change it)."""
        now = time.monotonic()
        if now - self._cap_at > 1.0:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            self._cap = max(1, (soft if soft != resource.RLIM_INFINITY else 1 << 20) // 2)
            self._cap_at = now
        return self._cap

    def refresh(self, uid: int | None) -> None:
        """Let the connections of ``uid`` (None: all) notice what their clients have read."""
        groups = self._by_uid.values() if uid is None else [self._by_uid.get(uid, set())]
        for group in list(groups):
            for fds in list(group):
                fds.refresh()

    # partial frames ---------------------------------------------------------------------
    def over_budget(self) -> bool:
        return self.buffered > self.limits.buffer_budget_bytes

    def wait_for_budget(self, owner: object, resume: Callable[[], None]) -> None:
        self._budget_waiters[owner] = resume

    def forget(self, owner: object) -> None:
        self._budget_waiters.pop(owner, None)

    def buffered_changed(self, delta: int) -> None:
        self.buffered += delta
        if delta < 0 and self._budget_waiters and not self.over_budget():
            waiters, self._budget_waiters = self._budget_waiters, {}
            for resume in waiters.values():
                resume()


class InflightFds:
    """The descriptors one connection sent that its client may not have received yet."""

    def __init__(self, ledger: Ledger, uid: int, sock: socket.socket) -> None:
        self.ledger = ledger
        self.uid = uid
        self.sock = sock
        self.count = 0
        ledger._by_uid.setdefault(uid, set()).add(self)

    def refresh(self) -> None:
        if self.count and unread_bytes(self.sock) == 0:
            self._drop(self.count)

    def may_send(self, n: int) -> bool:
        """True when ``n`` more descriptors stay within every bound (see the module docstring)."""
        if not n:
            return True
        limits, ledger = self.ledger.limits, self.ledger
        self.refresh()
        if self.count and self.count + n > limits.max_inflight_fds_per_connection:
            return False
        if ledger.inflight_by_uid[self.uid] + n > limits.max_inflight_fds_per_uid:
            ledger.refresh(self.uid)
            if ledger.inflight_by_uid[self.uid] and ledger.inflight_by_uid[self.uid] + n > \
                    limits.max_inflight_fds_per_uid:
                return False
        if ledger.inflight_total + n > ledger.inflight_cap():
            ledger.refresh(None)
            if ledger.inflight_total and ledger.inflight_total + n > ledger.inflight_cap():
                return False
        return True

    def sent(self, n: int) -> None:
        self.count += n
        self.ledger.inflight_by_uid[self.uid] += n
        self.ledger.inflight_total += n

    def close(self) -> None:
        self._drop(self.count)
        group = self.ledger._by_uid.get(self.uid)
        if group is not None:
            group.discard(self)
            if not group:
                del self.ledger._by_uid[self.uid]

    def _drop(self, n: int) -> None:
        self.count -= n
        self.ledger.inflight_total -= n
        self.ledger.inflight_by_uid[self.uid] -= n
        if self.ledger.inflight_by_uid[self.uid] <= 0:
            del self.ledger.inflight_by_uid[self.uid]


class FrameWatch:
    """One connection's share of the buffer budget, and the clock of its incomplete frame.

    ``account(buf)`` after the buffer changed: charges it (True when the connection must now
    stop reading: over the budget) and starts the clock when the first frame is incomplete.
    ``restart()`` when the daemon, not the client, stops reading (a request in service):
    that time is not the client's stall. ``on_stall`` runs once the frame is
    ``frame_timeout_s`` old; ``close()`` undoes the charge.
    """

    def __init__(self, ledger: Ledger, loop: asyncio.AbstractEventLoop, owner: object,
                 daemon_paused: Callable[[], bool], on_stall: Callable[[float], None]) -> None:
        self.ledger = ledger
        self.loop = loop
        self.owner = owner
        self.daemon_paused = daemon_paused
        self.on_stall = on_stall
        self.charged = 0
        self.since: float | None = None
        self._timer: asyncio.TimerHandle | None = None

    def over(self) -> bool:
        return self.charged > 0 and self.ledger.over_budget()

    def account(self, buf: bytearray) -> bool:
        charge = max(0, len(buf) - FREE_BUFFER)
        grew = charge > self.charged
        if charge != self.charged:
            delta, self.charged = charge - self.charged, charge
            self.ledger.buffered_changed(delta)
        size = frame_size(buf)
        if buf and (size is None or len(buf) < size):
            if self.since is None:
                self.since = self.loop.time()
                self._arm(self.ledger.limits.frame_timeout_s)
        else:
            self.since = None
        return grew and self.ledger.over_budget()

    def restart(self) -> None:
        if self.since is not None:
            self.since = self.loop.time()

    def close(self) -> None:
        self.ledger.forget(self.owner)
        if self.charged:
            self.ledger.buffered_changed(-self.charged)
            self.charged = 0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.since = None

    def _arm(self, delay: float) -> None:
        if self._timer is None:
            self._timer = self.loop.call_later(delay, self._deadline)

    def _deadline(self) -> None:
        self._timer = None
        if self.since is None:
            return
        if self.daemon_paused():
            self.since = self.loop.time()
        timeout = self.ledger.limits.frame_timeout_s
        left = self.since + timeout - self.loop.time()
        if left > 0:
            self._arm(left)
        else:
            self.on_stall(timeout)
