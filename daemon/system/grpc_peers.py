"""Who may send gRPC bytes to hwrd: the peer credentials of each connection, judged at accept.

grpcio's Python server reads a whole request message (up to its receive limit) before any
handler or interceptor can look at the caller, and it gives no peer credentials of a Unix
socket. So the public gRPC socket is served by ``activation.GrpcRelay``, which asks ``GrpcPeers``
about each accepted connection before it reads a byte: ``admit(sock)`` reads ``SO_PEERCRED``
and returns a ``RelayTicket`` (the relay reports the connection's activity to it and releases
it when the connection ends), or None to close the connection unread. Refused: a uid the
allow-list does not admit (``peercred.peer_allowed``, the peer socket's rule), a uid that
already has ``max_per_uid`` gRPC connections open (``max_grpc_connections_per_uid``), and, when
the node-wide budget is full, a uid that holds as many as the biggest holder less one
(``hwr.daemon.policy.connection_share``; otherwise the biggest holder's least recently active
connection is shed to let it in). The budget: the relay connections that hold at most half of
hwrd's soft ``RLIMIT_NOFILE`` (three descriptors each: the client's, the relay's to gRPC, and
gRPC's own), re-read at each accept; the other half stays for peer sessions, leases' payload
descriptors and the store. So however many uids connect, relayed gRPC connections cannot
exhaust hwrd's descriptors, and a uid holding less than its fair share always gets in.

Contract: on the event loop only (no lock); a ticket's ``release`` is idempotent, and a shed
connection's ``abort`` is called at most once. The allow-list is read through ``allow()`` at each
accept, so a SIGHUP reload applies to new connections.
"""

from __future__ import annotations

import logging
import resource
import socket
import time
from collections.abc import Callable

from hwr.daemon.policy.connection_share import connection_budget, share_verdict
from hwr.daemon.system.peercred import AllowList, peer_allowed, read_peercred

__all__ = ["FDS_PER_CONNECTION", "GrpcPeers", "RelayTicket"]

log = logging.getLogger("hwrd.grpc")

#: Descriptors one relayed connection holds in hwrd: the client's socket, the relay's socket to
#: the private gRPC path, and gRPC's accepted end of it.
FDS_PER_CONNECTION = 3
#: The share of the soft open-files limit that relayed connections may hold.
SHARE = 0.5
#: The budget never drops below this (a tiny open-files limit still serves a few clients).
MIN_BUDGET = 16


class RelayTicket:
    """One admitted connection: its uid, how to abort it (shedding), when it was last active."""

    def __init__(self, peers: GrpcPeers, uid: int, abort: Callable[[], None]) -> None:
        self.uid = uid
        self.last_active = time.monotonic()
        self._peers = peers
        self._abort = abort
        self.released = False

    def touch(self) -> None:
        """The client sent bytes: the connection is in use (shed last)."""
        self.last_active = time.monotonic()

    def release(self) -> None:
        """The connection ended (idempotent)."""
        if not self.released:
            self.released = True
            self._peers._forget(self)

    def shed(self) -> None:
        """Close the connection to make room (its release follows at once)."""
        if not self.released:
            self.release()
            self._abort()


class GrpcPeers:
    def __init__(self, allow: Callable[[], AllowList], max_per_uid: int,
                 nofile: Callable[[], int] | None = None) -> None:
        self._allow = allow
        self.max_per_uid = max_per_uid
        self._nofile = nofile or _soft_nofile
        self._tickets: dict[int, list[RelayTicket]] = {}
        self.refused = 0
        self.shed = 0

    @property
    def open_by_uid(self) -> dict[int, int]:
        return {uid: len(tickets) for uid, tickets in self._tickets.items()}

    def budget(self) -> int:
        """Relayed connections hwrd holds at most, node-wide (see the module docstring)."""
        return connection_budget(self._nofile(), FDS_PER_CONNECTION, SHARE, MIN_BUDGET)

    def admit(self, sock: socket.socket, abort: Callable[[], None]) -> RelayTicket | None:
        """A ticket for an admitted connection, or None (see the module docstring); ``abort``
        closes this connection if it is shed later."""
        try:
            cred = read_peercred(sock)
        except OSError:
            return None
        if not peer_allowed(cred, self._allow()):
            self.refused += 1
            log.warning("refused gRPC connection pid=%d uid=%d gid=%d: not on the allow-list",
                        cred.pid, cred.uid, cred.gid)
            return None
        held = len(self._tickets.get(cred.uid, ()))
        if held >= self.max_per_uid:
            self.refused += 1
            log.warning("refused gRPC connection pid=%d uid=%d: it has %d open (max_grpc_connections_per_uid)",
                        cred.pid, cred.uid, held)
            return None
        budget = self.budget()
        verdict = share_verdict(self.open_by_uid, cred.uid, budget)
        if not verdict.admit:
            self.refused += 1
            log.warning("refused gRPC connection pid=%d uid=%d: hwrd holds %d gRPC connections, its budget, and "
                        "this uid holds as many as any other", cred.pid, cred.uid, budget)
            return None
        if verdict.shed_uid is not None:
            victim = min(self._tickets[verdict.shed_uid], key=lambda t: t.last_active)
            self.shed += 1
            log.warning("shed the least recently active gRPC connection of uid %d (it holds the most) to admit "
                        "uid %d: hwrd holds %d, its budget", victim.uid, cred.uid, budget)
            victim.shed()
        ticket = RelayTicket(self, cred.uid, abort)
        self._tickets.setdefault(cred.uid, []).append(ticket)
        return ticket

    def _forget(self, ticket: RelayTicket) -> None:
        tickets = self._tickets.get(ticket.uid)
        if tickets is None:
            return
        try:
            tickets.remove(ticket)
        except ValueError:
            return
        if not tickets:
            del self._tickets[ticket.uid]


def _soft_nofile() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20
