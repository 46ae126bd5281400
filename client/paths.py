"""Default locations of hwrd's socket and store, as fixed in ARCHITECTURE.md.

Socket (``default_socket``, where an hwrd started without ``--socket`` listens): ``$HWR_SOCKET``,
else ``/run/hwrd/hwrd.sock`` for root, else ``$XDG_RUNTIME_DIR/hwrd.sock`` (or
``/tmp/hwrd-$UID/hwrd.sock``).

A client's socket (``client_socket``: ``connect()``, ``hwrctl``, the vLLM-Omni plugin) adds the
node's service: ``$HWR_SOCKET`` when set; else the caller's own default above when a socket file
is there (an hwrd the user started); else the service socket ``/run/hwrd/hwrd.sock``
(``SERVICE_SOCKET``) when it exists and its place passes the client's daemon-trust rules
(``hwr.client.daemon_trust``; the daemon's uid is checked when connecting); else the caller's own
default (whose error then names every place looked at, ``SocketChoice.hint``). So a user
added to the service's group reaches it with no configuration, and a user who runs an hwrd of
their own keeps reaching that one. For root both are ``/run/hwrd/hwrd.sock``.
Root: ``$HWR_ROOT``, else ``/var/cache/hwr`` for root, else ``$XDG_CACHE_HOME/hwr`` (or
``~/.cache/hwr``). The peer socket lives beside the socket at ``<socket>.peer``.
A checkpoint reference is resolved on the caller's side by ``checkpoint_ref``.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SERVICE_SOCKET", "SocketChoice", "checkpoint_ref", "client_socket", "default_root", "default_socket",
           "find_service_socket", "peer_path", "pick_socket"]

#: The node's service socket (the systemd unit's ``RuntimeDirectory=hwrd``). A module constant so
#: that tests can place a "service" elsewhere in a process of their own.
SERVICE_SOCKET = Path("/run/hwrd/hwrd.sock")

_ID_PREFIX = re.compile(r"[0-9a-f]{4,64}")


def default_socket(env: dict[str, str] | None = None) -> Path:
    env = dict(os.environ) if env is None else env
    if env.get("HWR_SOCKET"):
        return Path(env["HWR_SOCKET"])
    if os.geteuid() == 0:
        return SERVICE_SOCKET
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "hwrd.sock"
    return Path(f"/tmp/hwrd-{os.getuid()}") / "hwrd.sock"


@dataclass(frozen=True)
class SocketChoice:
    """The socket a client uses (``path``), why (``origin``), and every place it looked at."""

    path: Path
    origin: str
    looked: tuple[Path, ...]

    def hint(self) -> str:
        """What to add to a failed connection's message: the places looked at, and how to name
        another socket."""
        if self.origin == "$HWR_SOCKET":
            return "the socket named by $HWR_SOCKET"
        places = ", ".join(str(p) for p in self.looked)
        return f"looked at {places} ($HWR_SOCKET is unset): start hwrd, or set $HWR_SOCKET (or --socket) to its socket"


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def _service_place_trusted(path: Path) -> bool:
    """Whether the service socket's place passes the daemon-trust rules (the daemon's own uid is
    checked when the client connects; here the socket directory's owner stands for it)."""
    from hwr.client.daemon_trust import problem, walk

    me = os.geteuid()
    for candidate in (path, peer_path(path)):
        try:
            way = walk(candidate)
        except OSError:
            return False
        if way.leaf is None or problem(way, way.dirs[-1].uid, me) is not None:
            return False
    return True


def find_service_socket() -> Path | None:
    """``SERVICE_SOCKET`` when a socket file is there and its place passes the daemon-trust
    rules, else None."""
    service = SERVICE_SOCKET
    return service if _is_socket(service) and _service_place_trusted(service) else None


def pick_socket(hwr_socket: str | None, own: Path, service: Path, *, own_present: bool,
                service_usable: bool) -> SocketChoice:
    """The pure decision of ``client_socket``: ``$HWR_SOCKET`` (``hwr_socket``) when set; else the
    caller's own default ``own`` when a socket is there (``own_present``); else ``service`` when
    ``service_usable`` (there, and its place trusted); else ``own``, for the error to name."""
    if hwr_socket:
        return SocketChoice(Path(hwr_socket), "$HWR_SOCKET", (Path(hwr_socket),))
    if own == service:  # root: its own default is the service's socket
        return SocketChoice(own, "the service socket", (own,))
    looked = (own, service)
    if own_present:
        return SocketChoice(own, "your own hwrd's default socket", looked)
    if service_usable:
        return SocketChoice(service, "the node's service socket", looked)
    return SocketChoice(own, "your own hwrd's default socket", looked)


def client_socket(env: dict[str, str] | None = None) -> SocketChoice:
    """The socket a client connects to when none is given (the order of the module docstring)."""
    env = dict(os.environ) if env is None else env
    own = default_socket(env)
    return pick_socket(env.get("HWR_SOCKET"), own, SERVICE_SOCKET, own_present=_is_socket(own),
                       service_usable=find_service_socket() is not None)


def default_root(env: dict[str, str] | None = None) -> Path:
    env = dict(os.environ) if env is None else env
    if env.get("HWR_ROOT"):
        return Path(env["HWR_ROOT"])
    if os.geteuid() == 0:
        return Path("/var/cache/hwr")
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]) / "hwr"
    return Path.home() / ".cache" / "hwr"


def peer_path(socket_path: Path | str) -> Path:
    return Path(f"{socket_path}.peer")


def checkpoint_ref(ref: str | os.PathLike[str]) -> str:
    """What the daemon is asked for when a caller names a registered checkpoint as ``ref``.

    A string of 4 to 64 lowercase hex digits is a checkpoint id or unique id prefix and passes
    unchanged; anything else (and any ``os.PathLike``) is a path on this host, made absolute here
    the way ``Client.add_checkpoint`` makes the path it registers absolute: the daemon cannot
    resolve a relative path, its working directory is not the caller's. A directory whose name
    is all hex digits is named as ``./NAME``. The empty string passes unchanged (the daemon
    refuses it).
    """
    if not isinstance(ref, str):
        return os.path.abspath(ref)
    if not ref or _ID_PREFIX.fullmatch(ref):
        return ref
    return os.path.abspath(ref)
