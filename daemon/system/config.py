"""hwrd's configuration, parsed once at the edge into a frozen typed struct.

Sources, later wins: built-in defaults < TOML file (``--config``, ``$HWR_CONFIG``, or
``/etc/hwrd/hwrd.toml`` when present and hwrd runs as the node's default service: neither a
root nor a socket named by flag or environment, ``runs_as_node_service``) < environment <
flags. Every field of ``DaemonConfig`` is settable in all three: the TOML key ``max_leases_per_session``, the variable
``HWR_MAX_LEASES_PER_SESSION`` and the flag ``--max-leases-per-session`` (lists as
``1000,1001`` in the environment and flags; ``*_mode`` fields are octal; the uid and gid lists
also take user and group names, ``allow_gids = ["hwr"]`` or ``--allow-gid hwr``, resolved at
load by ``resolve_id``, an unknown name being an error). Flags and variables are derived from the
struct, so a field added to it gets both without further code.

Errors are ``ConfigError`` and name the key and where its value came from: ``FILE:LINE`` for
the TOML file (the line of the key's assignment), the variable, or the flag; ``details`` carries
``key``, ``source`` and, for the file, ``line``. Unknown keys are errors (a typo must not be
silently ignored). ``hwrd --check-config`` prints ``describe(config, sources)``: the effective
configuration as TOML with each value's source as a comment. Limits: the file is flat (top-level
keys only; a ``[table]`` is reported as an unknown key); line numbers come from a scan of the
file for ``key =`` since ``tomllib`` does not report positions, which is exact for flat files.
"""

from __future__ import annotations

import grp
import ipaddress
import os
import pwd
import re
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from hwr.client.errors import ConfigError
from hwr.client.paths import default_root, default_socket

__all__ = [
    "ConfigSources", "DaemonConfig", "describe", "env_name", "flag_name", "load_config", "load_config_with_sources",
    "parse_address", "runs_as_node_service",
]

SYSTEM_CONFIG = Path("/etc/hwrd/hwrd.toml")


class DaemonConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    root: str
    socket: str
    socket_mode: int = 0o660
    allow_uids: tuple[int, ...] = ()
    allow_gids: tuple[int, ...] = ()
    max_leases_per_session: int = 4096
    max_leases_per_uid: int = 65536  # over all the uid's sessions (hwr.daemon.service.sessions)
    # --- peer socket limits against careless or hostile local clients (hwr.daemon.peer.limits) ---
    # Open sessions (peer connections) per uid; a connection past it gets a typed refusal.
    max_sessions_per_uid: int = 1024
    # Descriptors sent to a client that it has not received yet (the kernel refuses every
    # further descriptor send of the daemon with ETOOMANYREFS once all of them pass its
    # open-files limit): replies beyond these wait until the client reads.
    max_inflight_fds_per_connection: int = 1024
    max_inflight_fds_per_uid: int = 4096
    # Bytes of partial request frames buffered over all connections (each may hold 64 KiB
    # beyond it); a connection past it is not read until others drain.
    peer_buffer_budget_bytes: int = 64 << 20
    # A request frame that is not complete this long after its first byte ends the session.
    peer_frame_timeout_s: float = 10.0
    # gRPC connections per uid (hwr.daemon.system.grpc_peers): one more is closed before a byte of
    # it is read. A client holds one; hwrctl one per command.
    max_grpc_connections_per_uid: int = 32
    # A gRPC connection whose client sends no byte this long after it was accepted is closed
    # (hwr.daemon.system.activation.GrpcRelay; gRPC clients send their preface at once).
    grpc_first_bytes_timeout_s: float = 10.0
    publication_wait_timeout_s: float = 600.0
    shutdown_grace_s: float = 10.0
    log_level: str = "info"
    # Prewarm producers (hwr.daemon.producers): wall-clock limit per producer process, and a
    # test-only sleep after each written block so tests can cancel a build in flight.
    producer_timeout_s: float = 3600.0
    producer_throttle_s: float = 0.0
    # The interpreter that runs producer processes (needs torch and hwr[worker]; hwrd has neither
    # on a node): "" = hwrd's own, else an absolute path such as the serving venv's python.
    producer_python: str = ""
    metrics_listen: str = ""  # "" off, "127.0.0.1:9464" or "unix:/run/hwrd/metrics.sock"
    # --- store as a node service (hwr.daemon.service.capacity, .pinning, .housekeeping); 0 = unlimited / off ---
    store_limit_bytes: int = 0
    artifact_limit_bytes: int = 0
    min_free_bytes: int = 0
    mlock_budget_bytes: int = 0
    publication_deadline_s: float = 3600.0
    # A staged client publication whose staging files (sizes, blocks, modification times) and
    # handed-over files did not change for this long is cancelled: its reservation comes back (a writer stopped
    # or hung mid-staging; it gets PUBLICATION_FAILED if it resumes). 0 = off.
    publication_stall_timeout_s: float = 300.0
    serialized_admission: bool = False
    scrub_bandwidth_mib_s: float = 0.0
    scrub_interval_s: float = 86400.0
    housekeeping_interval_s: float = 2.0
    # Threads that stage and commit publications (hwr.daemon.service.publishing). More finish more
    # commits per second under churn (each spends most of its time waiting for the interpreter
    # lock, not the disk); fewer give a shorter tail at low rates. Measured with benchmarks/churn.py
    # (64 clients x 500 ops, alternated runs on 2 cores): 8 threads 906-984 ops/s, 4 threads 900-932.
    commit_threads: int = 8
    adopt: bool = False  # adopt a root written by vLLM-Omni 0.30's in-process store (hwr.daemon.store.adoption)
    # --- roles (hwr.daemon.service.roles): root and the daemon's own uid hold every role. publish_*
    # both empty = everyone allowed to connect may publish; operator_* both empty = nobody else
    # may register checkpoints, prewarm, deny/allow, pin, evict, gc, verify, pull or push. ---
    publish_uids: tuple[int, ...] = ()
    publish_gids: tuple[int, ...] = ()
    operator_uids: tuple[int, ...] = ()
    operator_gids: tuple[int, ...] = ()
    # Client publications up to this many payload bytes stage in sealed memfds (they cannot grow
    # past their size: hwr.daemon.store.writer_bounds); larger ones stage in files. 0: always files.
    memfd_staging_max_bytes: int = 64 << 20
    # Fleet tier (hwr.daemon.fleet.remote): "" off, "s3://BUCKET/PREFIX" or "file:///PATH". Credentials
    # come only from the S3 client's standard chain, never from this file.
    remote: str = ""
    remote_endpoint_url: str = ""
    remote_region: str = ""
    remote_push: bool = True  # upload local publications to the remote (when one is set)
    # A pull that receives no byte from the remote for this long is stopped and its waiters fail
    # (RemoteUnavailable, reason STALLED); a pull that advances is never cut short.
    remote_stall_timeout_s: float = 60.0
    # Peer tier (hwr.daemon.fleet.peer_tier; README "Fleets"): nodes of a fleet pull artifacts from
    # each other over NIXL, verified like every pull. Needs `remote` (discovery goes through it), the
    # fleet's shared secret (a file, mode o-rwx, >= 16 bytes) and an interpreter with the `peers` extra.
    fleet_peer_serve: bool = False  # serve this node's committed artifacts to the fleet's other nodes
    fleet_peer_fetch: bool = False  # pull from peers before (and beside) the remote
    fleet_peer_listen: str = ""  # HOST:PORT of the control connections when serving
    fleet_peer_advertise: str = ""  # HOST:PORT the other nodes use ("": fleet_peer_listen)
    fleet_peer_secret_file: str = ""
    fleet_peer_node_id: str = ""  # this node's name in holder records ("": the host name)
    fleet_peer_serve_max_bytes_per_s: int = 0  # cap on all serving together; 0: no cap
    fleet_peer_holder_ttl_s: float = 30.0  # a holder record expires this long after its last refresh
    fleet_peer_max_sources: int = 4  # peers one pull reads from at once
    fleet_peer_python: str = ""  # the transfer process's interpreter ("": hwrd's own)
    fleet_peer_ucx_tls: str = ""  # UCX_TLS for the transfer process ("": UCX's own choice)
    # The networks (CIDR) the fleet's nodes are on: control connections from elsewhere are refused,
    # holders recorded at other addresses are not asked, and `hwrd install-service` writes them as
    # the unit's IPAddressAllow= when nothing else needs the network (empty: not restricted).
    fleet_peer_networks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.socket_mode <= 0o777:
            raise ConfigError("socket_mode must be an octal mode like 0o660", details={"key": "socket_mode"})
        if self.max_leases_per_session < 1:
            raise ConfigError("max_leases_per_session must be positive",
                              details={"key": "max_leases_per_session"})
        if self.max_leases_per_uid < 1:
            raise ConfigError("max_leases_per_uid must be positive", details={"key": "max_leases_per_uid"})
        for name in ("max_sessions_per_uid", "max_inflight_fds_per_connection", "max_inflight_fds_per_uid",
                     "peer_buffer_budget_bytes", "peer_frame_timeout_s", "max_grpc_connections_per_uid",
                     "grpc_first_bytes_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive", details={"key": name})
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError("log_level must be debug, info, warning or error", details={"key": "log_level"})
        for name in ("store_limit_bytes", "artifact_limit_bytes", "min_free_bytes", "mlock_budget_bytes",
                     "publication_deadline_s", "publication_stall_timeout_s", "scrub_bandwidth_mib_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative", details={"key": name})
        for name in ("scrub_interval_s", "housekeeping_interval_s", "remote_stall_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive", details={"key": name})
        if self.memfd_staging_max_bytes < 0:
            raise ConfigError("memfd_staging_max_bytes must not be negative",
                              details={"key": "memfd_staging_max_bytes"})
        if not 1 <= self.commit_threads <= 64:
            raise ConfigError("commit_threads must be between 1 and 64", details={"key": "commit_threads"})
        if self.remote:  # without it the tier is off and the other remote_* keys are unused
            from hwr.daemon.policy.remote_location import parse_location

            parse_location(self.remote, endpoint_url=self.remote_endpoint_url, region=self.remote_region)
        if self.fleet_peer_serve_max_bytes_per_s < 0:
            raise ConfigError("fleet_peer_serve_max_bytes_per_s must not be negative",
                              details={"key": "fleet_peer_serve_max_bytes_per_s"})
        if self.fleet_peer_holder_ttl_s <= 0 or self.fleet_peer_max_sources < 1:
            raise ConfigError("fleet_peer_holder_ttl_s and fleet_peer_max_sources must be positive",
                              details={"key": "fleet_peer_holder_ttl_s"})
        peer_networks(self.fleet_peer_networks)
        if self.fleet_peer_serve or self.fleet_peer_fetch:
            if not self.remote:
                raise ConfigError("the peer tier (fleet_peer_serve/fleet_peer_fetch) needs a remote: discovery "
                                  "goes through it", details={"key": "remote"})
            if not self.fleet_peer_secret_file:
                raise ConfigError("the peer tier needs fleet_peer_secret_file (the fleet's shared secret)",
                                  details={"key": "fleet_peer_secret_file"})
            if self.fleet_peer_serve:
                parse_address(self.fleet_peer_listen, "fleet_peer_listen")
                if self.fleet_peer_advertise:
                    parse_address(self.fleet_peer_advertise, "fleet_peer_advertise")
        if self.metrics_listen:
            from hwr.daemon.system.metrics import parse_listen

            try:
                parse_listen(self.metrics_listen)
            except ValueError as exc:
                raise ConfigError(str(exc), details={"key": "metrics_listen"}) from None


@dataclass
class ConfigSources:
    """Where each value came from, and what ``load_config`` was given (reload re-reads the same)."""

    file: Path | None = None
    file_text: str = ""
    by_key: dict[str, str] = field(default_factory=dict)  # key -> "default" | "FILE:LINE" | "env X" | "flag --x"
    lines: dict[str, int] = field(default_factory=dict)


def env_name(key: str) -> str:
    return f"HWR_{key.upper()}"


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def field_names() -> tuple[str, ...]:
    return DaemonConfig.__struct_fields__


def field_type(key: str) -> Any:
    return typing.get_type_hints(DaemonConfig)[key]


def is_id_key(key: str) -> bool:
    """Whether ``key`` lists users or groups (``allow_uids``, ``publish_gids``, ...): its items
    may be numbers or names (``resolve_id``)."""
    return key.endswith(("_uids", "_gids"))


def resolve_id(key: str, item: object) -> int:
    """One item of a uid or gid list (``is_id_key``): a number, or a user's or group's name on
    this host resolved now (``hwr`` -> the gid of ``getent group hwr``). ``ValueError`` names an
    unknown name. Limit: resolved when the configuration is loaded (at start and on reload), so
    a group renamed later keeps its old number until the next reload."""
    if isinstance(item, bool):
        raise ValueError(f"expected a number or a name, not {item!r}")
    if isinstance(item, int):
        return item
    if not isinstance(item, str):
        raise ValueError(f"expected a number or a name, not {item!r}")
    text = item.strip()
    if text.isdigit():
        return int(text)
    users = key.endswith("_uids")
    try:
        return pwd.getpwnam(text).pw_uid if users else grp.getgrnam(text).gr_gid
    except KeyError:
        raise ValueError(f"no {'user' if users else 'group'} named {text!r} on this host") from None


def _resolve_ids(key: str, value: Any) -> Any:
    if not is_id_key(key) or not isinstance(value, list | tuple):
        return value
    return tuple(resolve_id(key, item) for item in value)


def parse_text(key: str, text: str) -> Any:
    """Convert a flag's or variable's text to ``key``'s type (the struct still validates it);
    the items of a uid or gid list may be names (``resolve_id``)."""
    if is_id_key(key):
        return tuple(resolve_id(key, part) for part in text.split(",") if part.strip())
    return _parse_as(field_type(key), text.strip(), octal=key.endswith("_mode"))


def _parse_as(tp: Any, text: str, *, octal: bool = False) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if text in ("", "none", "None") and type(None) in args:
            return None
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (tuple, list):
        item = args[0] if args else str
        return tuple(_parse_as(item, part.strip()) for part in text.split(",") if part.strip())
    if tp is bool:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError("expected true or false")
    if tp is int:
        if octal:
            return int(text.removeprefix("0o"), 8)
        return int(text.replace("_", ""), 0)
    if tp is float:
        return float(text)
    return text


def _line_of(text: str, key: str) -> int | None:
    pattern = re.compile(rf"""^\s*(?:{re.escape(key)}|"{re.escape(key)}"|'{re.escape(key)}')\s*=""")
    table = re.compile(rf"""^\s*\[\s*{re.escape(key)}\s*\]""")
    for number, line in enumerate(text.splitlines(), start=1):
        if pattern.match(line) or table.match(line):
            return number
    return None


def _error(message: str, key: str | None, sources: ConfigSources) -> ConfigError:
    if key is None:
        where = str(sources.file) if sources.file else "configuration"
        return ConfigError(f"{where}: {message}", details={"source": where})
    source = sources.by_key.get(key, "default")
    details: dict[str, Any] = {"key": key, "source": source}
    if key in sources.lines:
        details["line"] = sources.lines[key]
    return ConfigError(f"{source}: key {key!r}: {message}", details=details)


_MSGSPEC_KEY = re.compile(r"at `\$\.(\w+)")
_MSGSPEC_UNKNOWN = re.compile(r"unknown field `(\w+)`")


def runs_as_node_service(env: Mapping[str, str], overrides: Mapping[str, Any] | None = None,
                         flag_text: Mapping[str, str] | None = None) -> bool:
    """Whether an hwrd started with these settings is the node's default service, the one hwrd
    that reads ``/etc/hwrd/hwrd.toml`` without being told to: True unless a root or a socket is
    named (``--root``/``--socket`` or ``HWR_ROOT``/``HWR_SOCKET``). An hwrd given a place of its
    own (a test, the demo, a benchmark, a hand-started ``hwrd --root X``) is another daemon, and
    the service's allow-lists, remote and metrics socket are not its own; ``--config``/``$HWR_CONFIG``
    still load any file, ``/etc/hwrd/hwrd.toml`` included, for every hwrd."""
    for key in ("root", "socket"):
        if env.get(env_name(key)):
            return False
        if (overrides or {}).get(key) is not None or (flag_text or {}).get(key) is not None:
            return False
    return True


def load_config_with_sources(
    config_file: Path | None = None, *, overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None, flag_text: Mapping[str, str] | None = None,
) -> tuple[DaemonConfig, ConfigSources]:
    """Parse defaults, file, environment and flags into a validated ``DaemonConfig``.

    ``overrides`` are typed values from flags (``None`` means unset); ``flag_text`` are raw flag
    strings by key (converted like environment variables).
    """
    env = dict(os.environ) if env is None else dict(env)
    sources = ConfigSources()
    names = field_names()
    values: dict[str, Any] = {"root": str(default_root(env)), "socket": str(default_socket(env))}
    path = config_file or (Path(env["HWR_CONFIG"]) if env.get("HWR_CONFIG") else None)
    if path is None and runs_as_node_service(env, overrides, flag_text) and SYSTEM_CONFIG.exists():
        path = SYSTEM_CONFIG
    if path is not None:
        sources.file = path
        try:
            sources.file_text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}", details={"source": str(path)}) from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: not UTF-8 text", details={"source": str(path)}) from None
        try:
            data = tomllib.loads(sources.file_text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: {exc}", details={"source": str(path)}) from None
        for key in data:
            line = _line_of(sources.file_text, key)
            if line is not None:
                sources.lines[key] = line
            sources.by_key[key] = f"{path}:{line}" if line else str(path)
            if key not in names:
                raise _error("unknown key (see hwrd --check-config for the valid keys)", key, sources)
            try:
                data[key] = _resolve_ids(key, data[key])
            except ValueError as exc:
                raise _error(str(exc), key, sources) from None
        values.update(data)
    for key in names:
        var = env_name(key)
        if env.get(var):
            try:
                values[key] = parse_text(key, env[var])
            except ValueError as exc:
                sources.by_key[key] = f"env {var}"
                raise _error(f"cannot parse {env[var]!r}: {exc}", key, sources) from None
            sources.by_key[key] = f"env {var}"
            sources.lines.pop(key, None)
    for key, text in (flag_text or {}).items():
        if text is None:
            continue
        sources.by_key[key] = f"flag {flag_name(key)}"
        sources.lines.pop(key, None)
        try:
            values[key] = parse_text(key, text)
        except ValueError as exc:
            raise _error(f"cannot parse {text!r}: {exc}", key, sources) from None
    for key, value in (overrides or {}).items():
        if value is not None:
            sources.by_key[key] = f"flag {flag_name(key)}"
            sources.lines.pop(key, None)
            try:
                values[key] = _resolve_ids(key, value)
            except ValueError as exc:
                raise _error(str(exc), key, sources) from None
    try:
        config = msgspec.convert(values, DaemonConfig)
    except msgspec.ValidationError as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, ConfigError):
            raise _error(cause.message, cause.details.get("key"), sources) from None
        text = str(exc)
        found = _MSGSPEC_UNKNOWN.search(text) or _MSGSPEC_KEY.search(text)
        problem = text.split(" - at ")[0]
        raise _error(problem, found.group(1) if found else None, sources) from None
    except ConfigError as exc:
        raise _error(exc.message, exc.details.get("key"), sources) from None
    return config, sources


def load_config(
    config_file: Path | None = None, *, overrides: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> DaemonConfig:
    return load_config_with_sources(config_file, overrides=overrides, env=env)[0]


def _toml_value(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and key.endswith("_mode"):
        return f"0o{value:o}"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(key, v) for v in value) + "]"
    if value is None:
        return '""'
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def describe(config: DaemonConfig, sources: ConfigSources) -> str:
    """The effective configuration as TOML, each line commented with its source."""
    lines = [f"# effective hwrd configuration (file: {sources.file or 'none'})"]
    for key in field_names():
        lines.append(f"{key} = {_toml_value(key, getattr(config, key))}  # {sources.by_key.get(key, 'default')}")
    return "\n".join(lines)


def peer_networks(items: Sequence[str]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """``fleet_peer_networks`` parsed (host bits allowed: ``10.0.3.17/24`` is ``10.0.3.0/24``);
    ``ConfigError`` naming the key and the item otherwise."""
    try:
        return tuple(ipaddress.ip_network(item.strip(), strict=False) for item in items)
    except ValueError as exc:
        raise ConfigError(f"fleet_peer_networks: {exc} (each item is a network like 10.0.3.0/24 or fd00::/64)",
                          details={"key": "fleet_peer_networks"}) from None


def in_networks(host: str, networks: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> bool | None:
    """Whether the address ``host`` lies in one of ``networks`` (an IPv4-mapped IPv6 address
    counts as its IPv4 one); None when ``host`` is a name, not an address."""
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return any(address in network for network in networks)


def parse_address(text: str, key: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT`` for IPv6) -> (host, port); ``ConfigError`` naming ``key``."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{key} must be HOST:PORT (got {text!r})", details={"key": key})
    return host, int(port)
