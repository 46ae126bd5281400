"""Peer credentials (SO_PEERCRED) and the connection allow-list decision.

``peer_allowed`` is a pure function over plain values; ``read_peercred`` is the one syscall.
Policy: the daemon's own uid and root are always allowed; otherwise the peer's uid must be in
``allow_uids`` or one of its groups (primary gid from SO_PEERCRED, supplementary groups read
from ``/proc/<pid>/status``) in ``allow_gids``. Limit: supplementary groups are read after the
connect; a process that changes groups in between is judged on its new groups.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["AllowList", "PeerCred", "peer_allowed", "read_peercred", "supplementary_groups"]

_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()


@dataclass(frozen=True)
class AllowList:
    daemon_uid: int
    allow_uids: frozenset[int] = frozenset()
    allow_gids: frozenset[int] = frozenset()


def peer_allowed(cred: PeerCred, policy: AllowList) -> bool:
    if cred.uid in (0, policy.daemon_uid) or cred.uid in policy.allow_uids:
        return True
    return any(g in policy.allow_gids for g in (cred.gid, *cred.groups))


def supplementary_groups(pid: int) -> tuple[int, ...]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Groups:"):
                    return tuple(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()


def read_peercred(sock: socket.socket, *, with_groups: Iterable[int] | None = None) -> PeerCred:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    groups = tuple(with_groups) if with_groups is not None else supplementary_groups(pid)
    return PeerCred(pid, uid, gid, groups)


def daemon_allow_list(allow_uids: Iterable[int] = (), allow_gids: Iterable[int] = ()) -> AllowList:
    return AllowList(os.geteuid(), frozenset(allow_uids), frozenset(allow_gids))
