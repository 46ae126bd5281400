"""Who may send gRPC bytes to hwrd: the peer credentials of each connection, judged at accept.

grpcio's Python server reads a whole request message (up to its receive limit) before any
handler or interceptor can look at the caller, and it gives no peer credentials of a Unix
socket. So the public gRPC socket is served by ``activation.GrpcRelay``, which asks ``GrpcPeers``
about each accepted connection before it reads a byte: ``admit(sock)`` reads ``SO_PEERCRED``
and returns a release callable, or None to close the connection unread. Refused: a uid the
allow-list does not admit (``peercred.peer_allowed``, the peer channel's rule), and a uid that
already has ``max_per_uid`` gRPC connections open (``max_grpc_connections_per_uid``).

Contract: on the event loop only (no lock); the release callable is idempotent. The allow-list
is read through ``allow()`` at each accept, so a SIGHUP reload applies to new connections.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

from hwr.daemon.system.peercred import AllowList, peer_allowed, read_peercred

__all__ = ["GrpcPeers"]

log = logging.getLogger("hwrd.grpc")


class GrpcPeers:
    def __init__(self, allow: Callable[[], AllowList], max_per_uid: int) -> None:
        self._allow = allow
        self.max_per_uid = max_per_uid
        self.open_by_uid: dict[int, int] = {}
        self.refused = 0

    def admit(self, sock: socket.socket) -> Callable[[], None] | None:
        """A release callable for an admitted connection, or None (see the module docstring)."""
        try:
            cred = read_peercred(sock)
        except OSError:
            return None
        if not peer_allowed(cred, self._allow()):
            self.refused += 1
            log.warning("refused gRPC connection pid=%d uid=%d gid=%d: not on the allow-list",
                        cred.pid, cred.uid, cred.gid)
            return None
        held = self.open_by_uid.get(cred.uid, 0)
        if held >= self.max_per_uid:
            self.refused += 1
            log.warning("refused gRPC connection pid=%d uid=%d: it has %d open (max_grpc_connections_per_uid)",
                        cred.pid, cred.uid, held)
            return None
        self.open_by_uid[cred.uid] = held + 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            left = self.open_by_uid.get(cred.uid, 1) - 1
            if left > 0:
                self.open_by_uid[cred.uid] = left
            else:
                self.open_by_uid.pop(cred.uid, None)

        return release
