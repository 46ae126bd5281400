"""``hwrd install-service``: lay out the systemd service from the installed package (no checkout).

Writes, under ``--prefix`` (default ``/``), with ``install -D`` semantics (missing directories are
created 0755, files replaced atomically, mode 0644):

- ``etc/systemd/system/hwrd.service`` with ``ExecStart=<hwrd> --config /etc/hwrd/hwrd.toml``, where
  ``<hwrd>`` is ``--hwrd`` or the ``hwrd`` script beside the running interpreter (``/opt/hwr/bin/hwrd``
  for a venv in ``/opt/hwr``), and ``etc/systemd/system/hwrd.socket``;
- ``etc/sysusers.d/hwrd.conf`` and ``etc/tmpfiles.d/hwrd.conf``;
- ``etc/hwrd/hwrd.toml`` from the example, only when absent (an operator's file is never
  replaced: one whose ``allow_gids`` lacks the group's gid is reported on stderr), with
  ``allow_gids`` set to the gid of the group ``hwr``;
- ``etc/systemd/system/hwrd.service.d/remote.conf`` when the configuration (the file above) names
  a remote, a TCP metrics port or the peer tier: the narrowest widening of the unit's sandbox
  that lets it work (``PrivateNetwork=no`` and ``AF_INET``/``AF_INET6`` for ``s3://``, TCP
  metrics and the peer tier, plus ``AF_NETLINK`` for the peer tier's UCX; ``ReadWritePaths=`` for
  a ``file://`` directory; ``IPAddressDeny=any`` and ``IPAddressAllow=`` localhost and
  ``fleet_peer_networks`` when the peer tier is all that uses the network). Without any, a stale
  one is removed. A ``fleet_peer_python`` under
  ``/tmp`` or ``/var/tmp`` is refused (the unit's ``PrivateTmp=yes`` hides it from the service).

With the prefix ``/`` it also creates the user and directories (``systemd-sysusers``,
``systemd-tmpfiles --create``: before the configuration, whose gid comes from the group they
create) and runs ``systemctl daemon-reload`` when systemd is running. It never enables or starts
anything. Rerun it after changing ``remote``, ``metrics_listen`` or the ``fleet_peer_*`` keys (then
``systemctl restart hwrd``); it is idempotent.

Exit status: 0 done, 1 a step failed (one line on stderr naming it), 2 usage.
"""

from __future__ import annotations

import argparse
import grp
import ipaddress
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import tomllib
from importlib import resources
from pathlib import Path
from urllib.parse import unquote, urlsplit

__all__ = ["main", "sandbox_dropin"]

CONFIG = "/etc/hwrd/hwrd.toml"
GROUP = "hwr"
_UNIT_EXEC = "ExecStart=/usr/local/bin/hwrd --config /etc/hwrd/hwrd.toml\n"


class InstallError(Exception):
    """A step of the installation failed; the message names it."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hwrd install-service",
        description="Write hwrd's systemd units, sysusers/tmpfiles files, /etc/hwrd/hwrd.toml (when absent) "
                    "and the sandbox drop-in its remote needs; with the prefix /, also create the user "
                    "and directories and reload systemd. Enables and starts nothing.")
    p.add_argument("--prefix", type=Path, default=Path("/"),
                   help="root of the tree to write into (default /; another prefix only writes files)")
    p.add_argument("--hwrd", type=Path, default=None,
                   help="the hwrd executable the unit runs (default: the hwrd beside this Python, "
                        f"here {_default_hwrd()})")
    p.add_argument("--allow-gid", type=int, default=None,
                   help=f"gid written into a new hwrd.toml's allow_gids (default: the group {GROUP!r}'s)")
    return p


def _default_hwrd() -> Path:
    # Not resolved: a venv's python is a symlink to the system's, the venv's scripts sit beside it.
    beside = Path(sys.executable).parent / "hwrd"
    if beside.exists():
        return beside.absolute()
    found = shutil.which("hwrd")
    return Path(found).absolute() if found else beside.absolute()


def _shipped(name: str) -> str:
    return resources.files("hwr.systemd").joinpath(name).read_text(encoding="utf-8")


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    """``install -D -m MODE``: parents created 0755, the file replaced atomically."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    print(f"hwrd install-service: wrote {path}")


def unit_text(hwrd: Path) -> str:
    """The shipped ``hwrd.service`` with ``ExecStart`` running ``hwrd``."""
    text = _shipped("hwrd.service")
    if _UNIT_EXEC not in text:  # the shipped unit and this module disagree: a packaging bug
        raise InstallError("the packaged hwrd.service has no ExecStart line to rewrite")
    if not hwrd.is_absolute() or any(c.isspace() for c in str(hwrd)):
        raise InstallError(f"the hwrd path must be absolute and without spaces: {hwrd}")
    return text.replace(_UNIT_EXEC, f"ExecStart={hwrd} --config {CONFIG}\n")


def config_text(gid: int | None) -> str:
    """The example configuration with ``allow_gids = [gid]`` (unchanged when ``gid`` is None)."""
    text = _shipped("hwrd.toml")
    if gid is not None:
        text = text.replace("\nallow_gids = []\n", f"\nallow_gids = [{gid}]  # the group {GROUP}\n", 1)
    return text


#: Directories the unit's ``PrivateTmp=yes`` replaces with empty ones of its own.
_PRIVATE_TMP = (Path("/tmp"), Path("/var/tmp"))


def _peer_lines(config: dict[str, object]) -> list[str]:
    """The comment that says what the peer tier uses of the network (the lines themselves are
    the network ones of ``sandbox_dropin``), after checking that its interpreter is visible."""
    python = str(config.get("fleet_peer_python") or "")
    if python:
        for path in {Path(python), Path(os.path.realpath(python))}:
            if any(path.is_relative_to(d) for d in _PRIVATE_TMP):
                raise InstallError(f"fleet_peer_python {python} is under /tmp or /var/tmp, which the unit's "
                                   "PrivateTmp=yes hides from hwrd: install that interpreter elsewhere")
    interpreter = python or "hwrd's own Python"
    listen = str(config.get("fleet_peer_listen") or "")
    port = listen.rpartition(":")[2] if config.get("fleet_peer_serve") and listen else ""
    text = ("The peer tier: " + (f"TCP port {port} inbound (fleet_peer_listen, control connections), " if port else "")
            + "TCP outbound to the peers' control ports, and the NIXL transfer process's UCX connections over TCP "
            "both ways (ports UCX picks, or UCX_TCP_PORT_RANGE in its environment); AF_NETLINK: without it UCX "
            f"finds no network interface and the transfer process does not start. It runs {interpreter} under "
            "this unit: everything else of the sandbox applies to it as to hwrd.")
    return ["# " + line for line in textwrap.wrap(text, 98)]


def _peer_addresses(config: dict[str, object], others: list[str]) -> list[str]:
    """``IPAddressAllow=`` for ``fleet_peer_networks`` (and localhost) with ``IPAddressDeny=any``,
    when the peer tier is all that needs the network (``others`` is what else does: then hwrd
    alone enforces the networks, and a comment says so)."""
    items = config.get("fleet_peer_networks") or []
    if isinstance(items, str):
        items = [part for part in items.split(",") if part.strip()]
    if not isinstance(items, list) or not items:
        return []
    try:
        networks = [str(ipaddress.ip_network(str(item).strip(), strict=False)) for item in items]
    except ValueError as exc:
        raise InstallError(f"fleet_peer_networks: {exc}") from None
    if others:
        return [f"# fleet_peer_networks is enforced by hwrd only: {' and '.join(others)} needs other addresses."]
    return ["# Only the fleet's networks (fleet_peer_networks) and this host.",
            "IPAddressDeny=any", f"IPAddressAllow=localhost {' '.join(networks)}"]


def sandbox_dropin(config: dict[str, object]) -> str | None:
    """The ``[Service]`` drop-in that the configuration's remote, metrics port and peer tier
    need, or None.

    ``s3://`` (and a TCP ``metrics_listen``): the network namespace of the host and the IP address
    families; the peer tier (``fleet_peer_serve`` or ``fleet_peer_fetch``): the same and
    ``AF_NETLINK`` (its transfer process's UCX enumerates interfaces over netlink);
    ``file:///DIR``: ``DIR`` writable (pulls read it, pushes write it). Nothing else of the
    sandbox changes. ``InstallError`` when ``fleet_peer_python`` lies where the unit hides it.
    """
    lines: list[str] = []
    remote = str(config.get("remote") or "")
    metrics = str(config.get("metrics_listen") or "")
    peers = bool(config.get("fleet_peer_serve") or config.get("fleet_peer_fetch"))
    network_for: list[str] = []
    if remote.startswith("s3://"):
        network_for.append(f"the remote {remote}")
    if metrics and not metrics.startswith("unix:"):
        network_for.append(f"metrics_listen {metrics}")
    if peers:
        network_for.append("the peer tier")
        lines += _peer_lines(config)
    if network_for:
        families = "AF_UNIX AF_INET AF_INET6" + (" AF_NETLINK" if peers else "")
        lines += [f"# Network for {' and '.join(network_for)}.",
                  "PrivateNetwork=no", f"RestrictAddressFamilies={families}"]
    if peers:
        lines += _peer_addresses(config, network_for[:-1])
    if remote.startswith("file://"):
        directory = unquote(urlsplit(remote).path)
        if any(c.isspace() for c in directory):
            raise InstallError(f"a file:// remote with spaces cannot be named in a unit: {remote}")
        lines += ["# The file:// remote's directory: pulls read it, pushes write it.",
                  f"ReadWritePaths={directory}"]
    if not lines:
        return None
    header = ("# Written by `hwrd install-service` from /etc/hwrd/hwrd.toml; rerun it after changing `remote`,\n"
              "# `metrics_listen` or `fleet_peer_*` (then `systemctl daemon-reload` is done for you; restart hwrd).\n")
    return header + "[Service]\n" + "\n".join(lines) + "\n"


def _run(argv: list[str]) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    except OSError as exc:
        raise InstallError(f"{argv[0]}: {exc}") from None
    if proc.returncode != 0:
        raise InstallError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()[:500]}")
    print(f"hwrd install-service: ran {' '.join(argv)}")


def _group_gid() -> int | None:
    try:
        return grp.getgrnam(GROUP).gr_gid
    except KeyError:
        return None


def install(prefix: Path, hwrd: Path, allow_gid: int | None) -> None:
    """Everything the module docstring lists, in order (see there)."""
    live = prefix.resolve() == Path("/")
    if live and os.geteuid() != 0:  # before writing anything
        raise InstallError("installing into / needs root (or pass --prefix DIR to only write files)")
    etc = prefix / "etc"
    _write(etc / "systemd/system/hwrd.service", unit_text(hwrd))
    _write(etc / "systemd/system/hwrd.socket", _shipped("hwrd.socket"))
    _write(etc / "sysusers.d/hwrd.conf", _shipped("sysusers.d/hwrd.conf"))
    _write(etc / "tmpfiles.d/hwrd.conf", _shipped("tmpfiles.d/hwrd.conf"))
    if live:
        _run(["systemd-sysusers", str(etc / "sysusers.d/hwrd.conf")])
        _run(["systemd-tmpfiles", "--create", str(etc / "tmpfiles.d/hwrd.conf")])
    config_path = etc / "hwrd/hwrd.toml"
    if config_path.exists():
        print(f"hwrd install-service: kept {config_path} (never replaced)")
    else:
        gid = allow_gid if allow_gid is not None else _group_gid()
        if gid is None:
            print(f"hwrd install-service: no group {GROUP!r} here: allow_gids stays empty in {config_path}",
                  file=sys.stderr)
        _write(config_path, config_text(gid))
    try:
        config = tomllib.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InstallError(f"cannot read {config_path}: {exc}") from None
    gid = _group_gid() if live else allow_gid
    if gid is not None and gid not in (config.get("allow_gids") or []):
        print(f"hwrd install-service: {config_path} does not list the gid {gid} of {GROUP!r} in allow_gids: "
              "members of the group reach the socket but are refused", file=sys.stderr)
    dropin = etc / "systemd/system/hwrd.service.d/remote.conf"
    text = sandbox_dropin(config)
    if text is not None:
        _write(dropin, text)
        remote = str(config.get("remote") or "")
        if remote.startswith("file://") and not Path(unquote(urlsplit(remote).path)).is_dir():
            print(f"hwrd install-service: {remote} does not exist yet: create it (writable by user hwrd) "
                  "before starting hwrd, or the unit fails to set up its sandbox", file=sys.stderr)
    elif dropin.exists():
        dropin.unlink()
        print(f"hwrd install-service: removed {dropin} (no remote, TCP metrics or peer tier configured)")
    if live and Path("/run/systemd/system").is_dir():
        _run(["systemctl", "daemon-reload"])


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    hwrd = args.hwrd if args.hwrd is not None else _default_hwrd()
    try:
        install(args.prefix, hwrd, args.allow_gid)
    except (InstallError, OSError) as exc:
        print(f"hwrd install-service: {exc}", file=sys.stderr)
        return 1
    return 0
