"""Where the vLLM-Omni plugin finds hwrd: the environment, a marker file in the runtime root, or the node's service.

vLLM-Omni rejects unknown diffusion config keys, so the daemon's address cannot travel as a new
``vllm serve`` flag. It comes, in this order, from:

1. ``HWR_SOCKET`` in the worker's environment (an explicit per-process choice wins);
2. ``<--host-weight-runtime-root>/hwrd.json``, a marker the operator writes next to the runtime
   root (the file vLLM-Omni is already told about)::

       {"socket": "/run/hwrd/hwrd.sock"}

   Fields: ``socket`` (absolute path of hwrd's gRPC socket, required), ``connect_timeout_s``
   (positive number, default 10) and ``preferred_pull`` (below). Unknown fields are rejected so
   a typo is never silently ignored. JSON rather than TOML so that the file cannot be mistaken for hwrd's own
   ``hwrd.toml`` daemon configuration.

``preferred_pull`` (marker field, or ``HWR_PREFERRED_PULL``, which wins): what a ``preferred``
start does when hwrd is pulling its artifact from the fleet tier's remote (or would pull it).
``"wait"`` (the default) waits for the pull while it advances, logging its progress, as a
``required`` start always does: on a new node the pull of the final layout is the fast path,
and falling back would start a second, larger transfer (the canonical checkpoint) that competes
with it for the network and the disk. ``"fallback"`` loads canonically at once and leaves the
pull running for the next start: for nodes whose canonical checkpoint is local and warm.

3. the node's hwrd service, ``/run/hwrd/hwrd.sock``, when its socket is there and its place
   passes the client's daemon-trust rules (``hwr.client.paths.find_service_socket``): a worker on
   a node with the service installed needs no configuration.

``HWR_VLLM_PLUGIN=0`` turns the plugin off in a process whatever else is set. With none of the
three, the plugin leaves vLLM-Omni's own filesystem store in place.

Contract: ``resolve_target`` returns ``None`` (not configured) or a ``DaemonTarget``; a marker
that exists but is malformed raises ``ConfigError`` naming the file and the field. Limits: the
marker is read once per ``HostWeightRuntime`` construction; it is not watched.
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec

from hwr.client.errors import ConfigError
from hwr.client.paths import find_service_socket

__all__ = ["ENV_DISABLE", "ENV_PREFERRED_PULL", "ENV_SOCKET", "MARKER_FILE", "PREFERRED_PULL", "DaemonTarget",
           "plugin_disabled", "resolve_target"]

ENV_SOCKET = "HWR_SOCKET"
ENV_DISABLE = "HWR_VLLM_PLUGIN"
ENV_PREFERRED_PULL = "HWR_PREFERRED_PULL"
PREFERRED_PULL = ("wait", "fallback")
MARKER_FILE = "hwrd.json"
DEFAULT_CONNECT_TIMEOUT_S = 10.0
_MAX_MARKER_BYTES = 64 * 1024


class _Marker(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    socket: str
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    preferred_pull: str = "wait"


@dataclass(frozen=True)
class DaemonTarget:
    """One hwrd to use: its socket, where that came from (for messages), the connect timeout,
    and whether a ``preferred`` start waits for a pull (``preferred_pull``)."""

    socket: Path
    origin: str
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    preferred_pull: str = "wait"


def plugin_disabled(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(ENV_DISABLE, "").strip().lower() in {"0", "false", "no", "off"}


def resolve_target(root: Path | str | None, environ: Mapping[str, str] | None = None) -> DaemonTarget | None:
    """The hwrd this process should use for a runtime rooted at ``root``, or None."""
    env = os.environ if environ is None else environ
    if plugin_disabled(env):
        return None
    choice = env.get(ENV_PREFERRED_PULL, "").strip().lower()
    if choice and choice not in PREFERRED_PULL:
        raise ConfigError(f"${ENV_PREFERRED_PULL} must be 'wait' or 'fallback'", details={"field": ENV_PREFERRED_PULL})
    if env.get(ENV_SOCKET):
        target: DaemonTarget | None = DaemonTarget(Path(env[ENV_SOCKET]), f"${ENV_SOCKET}")
    else:
        target = read_marker(Path(root).expanduser() / MARKER_FILE) if root is not None else None
        if target is None:
            service = find_service_socket()
            if service is not None:
                target = DaemonTarget(service, f"the node's hwrd service ({service})")
    if target is not None and choice:
        target = dataclasses.replace(target, preferred_pull=choice)
    return target


def read_marker(path: Path) -> DaemonTarget | None:
    """Parse ``hwrd.json``; None when it does not exist, ``ConfigError`` when it is malformed."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read the hwrd marker {path}: {exc.strerror}",
                          details={"file": str(path)}) from None
    if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_MARKER_BYTES:
        raise ConfigError(f"the hwrd marker {path} is not a small regular file", details={"file": str(path)})
    try:
        marker = msgspec.json.decode(path.read_bytes(), type=_Marker)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(f"the hwrd marker {path} is invalid: {exc}", details={"file": str(path)}) from None
    except OSError as exc:
        raise ConfigError(f"cannot read the hwrd marker {path}: {exc.strerror}",
                          details={"file": str(path)}) from None
    if not marker.socket or not os.path.isabs(marker.socket):
        raise ConfigError(f"{path}: 'socket' must be an absolute path", details={"file": str(path), "field": "socket"})
    timeout = marker.connect_timeout_s
    if not math.isfinite(timeout) or timeout <= 0:
        raise ConfigError(f"{path}: 'connect_timeout_s' must be a positive number",
                          details={"file": str(path), "field": "connect_timeout_s"})
    if marker.preferred_pull not in PREFERRED_PULL:
        raise ConfigError(f"{path}: 'preferred_pull' must be 'wait' or 'fallback'",
                          details={"file": str(path), "field": "preferred_pull"})
    return DaemonTarget(Path(marker.socket), str(path), float(timeout), marker.preferred_pull)
