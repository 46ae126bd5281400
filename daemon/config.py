"""hwrd's configuration, parsed once at the edge into a frozen typed struct.

Sources, later wins: built-in defaults < TOML file (``--config``, ``$HWR_CONFIG``, or
``/etc/hwrd/hwrd.toml`` when present) < environment (``HWR_ROOT``, ``HWR_SOCKET``) < flags.
Unknown keys and wrong types are rejected with a ``ConfigError`` naming the key.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from hwr.client.errors import ConfigError
from hwr.client.paths import default_root, default_socket

__all__ = ["DaemonConfig", "load_config"]

SYSTEM_CONFIG = Path("/etc/hwrd/hwrd.toml")


class DaemonConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    root: str
    socket: str
    socket_mode: int = 0o660
    allow_uids: tuple[int, ...] = ()
    allow_gids: tuple[int, ...] = ()
    max_leases_per_session: int = 4096
    publication_wait_timeout_s: float = 600.0
    shutdown_grace_s: float = 10.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.socket_mode <= 0o777:
            raise ConfigError("socket_mode must be an octal mode like 0o660", details={"key": "socket_mode"})
        if self.max_leases_per_session < 1:
            raise ConfigError("max_leases_per_session must be positive",
                              details={"key": "max_leases_per_session"})
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError("log_level must be debug, info, warning or error", details={"key": "log_level"})


def load_config(
    config_file: Path | None = None, *, overrides: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> DaemonConfig:
    env = dict(os.environ) if env is None else env
    values: dict[str, Any] = {"root": str(default_root(env)), "socket": str(default_socket(env))}
    path = config_file or (Path(env["HWR_CONFIG"]) if env.get("HWR_CONFIG") else None)
    if path is None and SYSTEM_CONFIG.exists():
        path = SYSTEM_CONFIG
    if path is not None:
        try:
            data = tomllib.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        values.update(data)
    if env.get("HWR_ROOT"):
        values["root"] = env["HWR_ROOT"]
    if env.get("HWR_SOCKET"):
        values["socket"] = env["HWR_SOCKET"]
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return msgspec.convert(values, DaemonConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from None
