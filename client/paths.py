"""Default locations of hwrd's socket and store, as fixed in ARCHITECTURE.md.

Socket: ``$HWR_SOCKET``, else ``/run/hwrd/hwrd.sock`` for root, else
``$XDG_RUNTIME_DIR/hwrd.sock`` (or ``/tmp/hwrd-$UID/hwrd.sock``).
Root: ``$HWR_ROOT``, else ``/var/cache/hwr`` for root, else ``$XDG_CACHE_HOME/hwr`` (or
``~/.cache/hwr``). The peer channel lives beside the socket at ``<socket>.peer``.
A checkpoint reference is resolved on the caller's side by ``checkpoint_ref``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["checkpoint_ref", "default_root", "default_socket", "peer_path"]

_ID_PREFIX = re.compile(r"[0-9a-f]{4,64}")


def default_socket(env: dict[str, str] | None = None) -> Path:
    env = dict(os.environ) if env is None else env
    if env.get("HWR_SOCKET"):
        return Path(env["HWR_SOCKET"])
    if os.geteuid() == 0:
        return Path("/run/hwrd/hwrd.sock")
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "hwrd.sock"
    return Path(f"/tmp/hwrd-{os.getuid()}") / "hwrd.sock"


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
