"""Default locations of hwrd's socket and store, as fixed in ARCHITECTURE.md.

Socket: ``$HWR_SOCKET``, else ``/run/hwrd/hwrd.sock`` for root, else
``$XDG_RUNTIME_DIR/hwrd.sock`` (or ``/tmp/hwrd-$UID/hwrd.sock``).
Root: ``$HWR_ROOT``, else ``/var/cache/hwr`` for root, else ``$XDG_CACHE_HOME/hwr`` (or
``~/.cache/hwr``). The peer channel lives beside the socket at ``<socket>.peer``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_root", "default_socket", "peer_path"]


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
