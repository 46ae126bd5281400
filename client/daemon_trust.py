"""Whom a client talks to: the checks that keep it from being served another user's weights.

Any local user can run an hwrd of their own. The default socket of a user without
``XDG_RUNTIME_DIR`` is ``/tmp/hwrd-$UID/hwrd.sock``, and ``/tmp`` lets anyone create that
directory first; ``HWR_SOCKET`` can name any path. So before a session is opened the client
checks the daemon answering on the peer socket (its uid, read with ``SO_PEERCRED``) and the
place of both sockets (``<socket>`` and ``<socket>.peer``), and refuses with
``UntrustedDaemon`` (a ``DaemonUnavailable``: vLLM-Omni's ``preferred`` mode falls back to
canonical loading, ``required`` fails) when one rule fails. With ``me`` the client's effective
uid, *trusted* = {root, ``me``} and *opted in* = the uids ``HWR_TRUSTED_UIDS`` names (a comma-
separated list the client's user sets to accept the daemons of those users; empty by default):

1. **Links.** Every symlink on the way to a socket belongs to a trusted uid.
2. **Directories above the socket's.** Each belongs to a trusted uid and is writable by group or
   others only with the sticky bit (then nobody can move another user's entry in it).
3. **The socket's directory ``D``** (owner ``O``) is *vouched for*: ``O`` is trusted or opted
   in; or ``D``'s parent belongs to a trusted uid and is not writable by group or others, and
   ``D`` is not a per-user directory (named ``O`` or ``hwrd-O``): only root can have made it
   and given it to ``O`` for a service (``/run/hwrd`` of the unit's ``User=hwrd``). A per-user
   directory (``/tmp/hwrd-1001`` in a sticky ``/tmp``, ``/run/user/1001``) is that user's own
   place, and a daemon there is that user's: accepted only when ``O`` is ``me`` or opted in.
4. ``D`` is not writable by group or others, unless sticky: then each socket file belongs to a
   trusted uid or to the daemon's.
5. **The daemon's uid** (``SO_PEERCRED`` of the peer socket; ``0`` for sockets systemd made) is
   trusted or is ``O``.

So a root hwrd under ``/run/hwrd``, the unit's ``hwrd`` user in its own ``/run/hwrd``, and one's
own hwrd in ``$XDG_RUNTIME_DIR`` or ``/tmp/hwrd-$UID`` are accepted, also through an explicit
``HWR_SOCKET``; a service user's hwrd is accepted in a directory root made for it (rule 3).
Refused: a ``/tmp/hwrd-$UID`` another uid made (whatever its mode), a socket directory others
may write (they could swap the gRPC socket, which carries no credentials), and the hwrd of a
third, unprivileged uid in its own place (``/tmp/hwrd-1001``, ``/run/user/1001``), however the
client got there (``HWR_SOCKET``, a symlink of its own), unless ``HWR_TRUSTED_UIDS`` names it.
Limits: the gRPC socket is judged by its place only (grpcio gives no peer credentials of
a Unix socket); checks are of modes and owners, POSIX ACLs are not read (a directory an ACL
opens to others passes); a root client is checked like any other.

``problem(walk, peer_uid, me, opted_in)`` is the pure decision; ``walk(path)``, ``peer_uid(sock)``
and ``opted_in_uids(environ)`` are the edges.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from hwr.client.errors import UntrustedDaemon

__all__ = ["TRUSTED_UIDS_ENV", "Node", "Walk", "check_daemon", "opted_in_uids", "peer_uid", "problem", "walk"]

#: Symlinks followed on one path before giving up (the kernel's own limit).
MAX_LINKS = 40
#: The uids (comma-separated) of other users whose daemons the client's user accepts.
TRUSTED_UIDS_ENV = "HWR_TRUSTED_UIDS"
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


@dataclass(frozen=True)
class Node:
    """One path on the way, as ``lstat`` saw it."""

    path: str
    uid: int
    mode: int


@dataclass(frozen=True)
class Walk:
    """The way to a socket: the symlinks followed, the directories from ``/`` down to the
    socket's own (resolved), and the socket file itself (None when missing)."""

    links: tuple[Node, ...]
    dirs: tuple[Node, ...]
    leaf: Node | None


def _writable_by_others(node: Node) -> bool:
    return bool(node.mode & _OTHERS_WRITE)


def _sticky(node: Node) -> bool:
    return bool(node.mode & stat.S_ISVTX)


def _per_user(node: Node) -> bool:
    """A directory named for its owner (``1001``, ``hwrd-1001``): that user's own place."""
    return os.path.basename(node.path) in (str(node.uid), f"hwrd-{node.uid}")


def opted_in_uids(environ: dict[str, str] | os._Environ[str]) -> frozenset[int]:
    """The uids ``HWR_TRUSTED_UIDS`` names; ``UntrustedDaemon`` for a value that is not a
    comma-separated list of uids (a typo must not widen or silently drop the opt-in)."""
    value = environ.get(TRUSTED_UIDS_ENV, "").strip()
    if not value:
        return frozenset()
    uids = [part.strip() for part in value.split(",") if part.strip()]
    if not all(part.isascii() and part.isdigit() and int(part) < 1 << 32 for part in uids):
        raise UntrustedDaemon(f"{TRUSTED_UIDS_ENV} must be a comma-separated list of uids, not {value[:80]!r}",
                              details={"field": TRUSTED_UIDS_ENV})
    return frozenset(int(part) for part in uids)


def problem(way: Walk, peer: int, me: int, opted_in: frozenset[int] = frozenset()) -> str | None:
    """Why the daemon of uid ``peer`` answering at the end of ``way`` is not to be trusted by
    uid ``me``, who opted in to the daemons of ``opted_in`` (the rules of the module
    docstring), or None."""
    trusted = {0, me}
    for link in way.links:
        if link.uid not in trusted:
            return f"{link.path} is a symlink owned by uid {link.uid}"
    *above, here = way.dirs
    for node in above:
        if node.uid not in trusted:
            return f"{node.path} belongs to uid {node.uid}"
        if _writable_by_others(node) and not _sticky(node):
            return f"{node.path} is writable by group or others"
    parent = above[-1] if above else None
    if here.uid not in trusted and here.uid not in opted_in:
        if _per_user(here):
            return (f"the socket directory {here.path} is uid {here.uid}'s own: the daemon there is another "
                    f"user's (set {TRUSTED_UIDS_ENV}={here.uid} to accept it)")
        if parent is None or _writable_by_others(parent):
            return (f"the socket directory {here.path} belongs to uid {here.uid}, and nothing shows it was made "
                    f"for that uid (its parent is writable by others)")
    if _writable_by_others(here):
        if not _sticky(here):
            return f"the socket directory {here.path} is writable by group or others"
        if way.leaf is not None and way.leaf.uid not in trusted | {peer}:
            return f"{way.leaf.path} belongs to uid {way.leaf.uid}"
    if peer not in trusted and peer != here.uid:
        return (f"the daemon answering runs as uid {peer}: neither yours ({me}), root, nor the owner of "
                f"{here.path} ({here.uid})")
    return None


def _node(path: str) -> Node:
    st = os.lstat(path)
    return Node(path, st.st_uid, st.st_mode)


def walk(path: Path | str) -> Walk:
    """``lstat`` every component of ``path``, following symlinks by hand (each one recorded).
    Raises ``OSError`` (``ELOOP`` past ``MAX_LINKS``, ``ENOTDIR`` for a file on the way)."""
    parts = [p for p in os.path.abspath(os.fspath(path)).split("/") if p]
    dirs = [_node("/")]
    links: list[Node] = []
    leaf: Node | None = None
    while parts:
        name = parts.pop(0)
        if name == ".":
            continue
        if name == "..":
            if len(dirs) > 1:
                dirs.pop()
            continue
        candidate = os.path.join(dirs[-1].path, name)
        try:
            node = _node(candidate)
        except FileNotFoundError:
            if parts:
                raise
            break  # a missing socket: the connection says so
        if stat.S_ISLNK(node.mode):
            links.append(node)
            if len(links) > MAX_LINKS:
                raise OSError(40, "too many symbolic links", os.fspath(path))
            target = os.readlink(candidate)
            if target.startswith("/"):
                dirs = dirs[:1]
            parts[:0] = [p for p in target.split("/") if p]
            continue
        if not parts:
            leaf = node
        elif stat.S_ISDIR(node.mode):
            dirs.append(node)
        else:
            raise NotADirectoryError(20, "not a directory", candidate)
    return Walk(tuple(links), tuple(dirs), leaf)


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process that made the listening socket ``sock`` is connected to."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def check_daemon(socket_path: Path, peer_sock: socket.socket) -> None:
    """Raise ``UntrustedDaemon`` unless the daemon on the connected ``peer_sock`` and the place of
    both sockets of ``socket_path`` pass the rules of the module docstring."""
    peer = peer_uid(peer_sock)
    me = os.geteuid()
    opted_in = opted_in_uids(os.environ)
    for path in (Path(socket_path), Path(f"{socket_path}.peer")):
        try:
            reason = problem(walk(path), peer, me, opted_in)
        except OSError as exc:
            reason = f"cannot inspect {path}: {exc.strerror or exc}"
        if reason is not None:
            raise UntrustedDaemon(f"refusing the hwrd on {socket_path}: {reason}",
                                  details={"socket": str(socket_path), "daemon_uid": peer, "reason": reason})
