"""``hwrd``: the node daemon's command line.

Exit status: 0 after a clean shutdown (SIGTERM/SIGINT), 1 on a runtime failure (store locked,
untrusted store, socket in use), 2 on a configuration or usage error. Errors are one line on
stderr, without a traceback. ``hwrd --check-config`` validates the configuration, prints the
effective one (TOML, each value's source as a comment) and exits 0, or 2 when it is invalid.
``hwrd install-service [--prefix DIR]`` lays out the systemd service from the installed package
(``hwr.daemon.app.install_service``).

Under systemd: sockets inherited through ``LISTEN_FDS`` are served (``hwr.daemon.system.activation``);
``READY=1`` is sent once both channels accept connections, ``WATCHDOG=1`` every half
``$WATCHDOG_USEC`` from the event loop (a stuck loop stops the pings), ``STOPPING=1`` on
SIGTERM/SIGINT; SIGHUP reloads what can be reloaded (``hwr.daemon.app.reload``). At start the soft
open-files limit is raised to the hard one (``hwr.daemon.system.accepting``: every session holds a
connection).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from hwr import __version__
from hwr.client.errors import ConfigError, HwrError
from hwr.daemon.system import logs
from hwr.daemon.system.config import (
    DaemonConfig,
    describe,
    env_name,
    field_names,
    flag_name,
    load_config_with_sources,
)
from hwr.daemon.system.config_help import HELP

__all__ = ["main"]

#: The built-in defaults, shown by --help.
DEFAULTS = DaemonConfig(root="", socket="")


_EPILOG = """\
hwrd install-service [--prefix DIR] [--hwrd PATH]
  writes the systemd units (ExecStart: this hwrd), sysusers/tmpfiles files, /etc/hwrd/hwrd.toml
  (when absent; allow_gids = the group hwr) and the sandbox drop-in a remote needs; see
  `hwrd install-service --help` and README "Install as a system service".

hwrd imports no torch and its install carries none. Prewarm producers do: they run
`PYTHON -m hwr.daemon.producers.worker`, where PYTHON is --producer-python (producer_python,
env HWR_PRODUCER_PYTHON), an interpreter with torch and hwr[worker] installed, e.g. the serving
venv's python (with vLLM-Omni there for --producer vllm-omni); default: hwrd's own interpreter.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hwrd", description="Host Weight Runtime daemon", epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path,
                   help="TOML config file (env HWR_CONFIG). Without it, /etc/hwrd/hwrd.toml is read when present "
                        "and neither --root/--socket nor HWR_ROOT/HWR_SOCKET is given (the node's service); "
                        "an hwrd given a root or socket of its own reads no file unless told to")
    p.add_argument("--root", help="store root directory (env HWR_ROOT)")
    p.add_argument("--socket", help="gRPC Unix socket path (env HWR_SOCKET)")
    p.add_argument("--socket-mode", type=lambda s: int(s, 8),
                   help="socket file mode, octal (env HWR_SOCKET_MODE; default 660)")
    p.add_argument("--allow-uid", action="append", dest="allow_uids", metavar="USER",
                   help="a client user (uid or name) that may connect and acquire; repeatable (env HWR_ALLOW_UIDS, "
                        "comma-separated)")
    p.add_argument("--allow-gid", action="append", dest="allow_gids", metavar="GROUP",
                   help="a client group (gid or name, e.g. hwr) whose members may connect and acquire; repeatable "
                        "(env HWR_ALLOW_GIDS, comma-separated)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                   help="log verbosity (env HWR_LOG_LEVEL; default info)")
    p.add_argument("--check-config", action="store_true",
                   help="validate the configuration, print the effective one and exit (2 if invalid)")
    p.add_argument("--version", action="version", version=f"hwrd {__version__}")
    taken = {a.dest for a in p._actions}
    for key in field_names():  # every other option as a flag, parsed like its variable
        if key not in taken:
            default = getattr(DEFAULTS, key)
            text = ("true" if default else "false") if isinstance(default, bool) else str(default)
            shown = f"; default {text}" if default not in ("", ()) else ""
            p.add_argument(flag_name(key), dest=f"opt_{key}", metavar="VALUE",
                           help=f"{HELP[key]} (env {env_name(key)}{shown})")
    return p


def _flag_text(args: argparse.Namespace) -> dict[str, str]:
    return {k: getattr(args, f"opt_{k}") for k in field_names()
            if getattr(args, f"opt_{k}", None) is not None}


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    return {
        "root": args.root, "socket": args.socket, "socket_mode": args.socket_mode,
        "allow_uids": tuple(args.allow_uids) if args.allow_uids else None,
        "allow_gids": tuple(args.allow_gids) if args.allow_gids else None,
        "log_level": args.log_level,
    }


async def serve(config: DaemonConfig, args: argparse.Namespace | None = None) -> None:
    from hwr.client.paths import peer_path
    from hwr.daemon.app.reload import Reloader
    from hwr.daemon.app.server import Daemon
    from hwr.daemon.producers.runner import set_interpreter
    from hwr.daemon.system.activation import assign, inherited_sockets
    from hwr.daemon.system.sdnotify import Notifier, watchdog_interval

    set_interpreter(config.producer_python)
    inherited = assign(inherited_sockets(), Path(config.socket), peer_path(config.socket))
    daemon = Daemon(config, inherited=inherited)
    notifier = Notifier.from_env()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_stop() -> None:
        notifier.stopping()  # first, so systemd knows the exit that follows is intended
        stop.set()

    # Before start: the sockets answer from inside start(), so a supervisor may signal from then
    # on; without a handler SIGTERM (or SIGHUP) would kill the daemon with no clean shutdown. A
    # stop that arrives during start is carried out right after it; a reload waits for it.
    reload_pending = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop)
    loop.add_signal_handler(signal.SIGHUP, reload_pending.set)
    try:
        await daemon.start()
    except BaseException:
        daemon.release_sockets()  # a start refused half-way leaves no socket file behind
        raise
    reloader = Reloader(daemon, config_file=args.config if args else None,
                        overrides=_overrides(args) if args else {},
                        flag_text=_flag_text(args) if args else {}, notifier=notifier)
    loop.add_signal_handler(signal.SIGHUP, reloader.reload)
    if reload_pending.is_set() and not stop.is_set():
        reloader.reload()
    watchdog = None
    interval = watchdog_interval(os.environ)
    if interval is not None and notifier.enabled:
        watchdog = loop.create_task(_watchdog(notifier, interval))
    if not stop.is_set():  # a stop during start already told systemd STOPPING=1
        notifier.ready(daemon.status_line())
        print(f"hwrd: serving on {config.socket} (root {config.root})", file=sys.stderr, flush=True)
    await stop.wait()
    logging.getLogger("hwrd").info("shutting down")
    if watchdog is not None:
        watchdog.cancel()
    await daemon.stop()


async def _watchdog(notifier: object, interval: float) -> None:
    while True:
        notifier.watchdog()  # type: ignore[attr-defined]
        await asyncio.sleep(interval)


def main(argv: list[str] | None = None) -> int:
    from hwr.daemon.app.fault_injection import install_from_env

    install_from_env()  # test-only: a no-op unless $HWR_TEST_FAULTS is set (hwr.daemon.app.fault_injection)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["install-service"]:
        from hwr.daemon.app.install_service import main as install_service

        return install_service(argv[1:])
    args = _parser().parse_args(argv)
    try:
        config, sources = load_config_with_sources(args.config, overrides=_overrides(args),
                                                   flag_text=_flag_text(args))
    except ConfigError as exc:
        print(f"hwrd: {exc}", file=sys.stderr)
        return 2
    if args.check_config:
        print(describe(config, sources))
        return 0
    logs.configure(config.log_level)
    from hwr.daemon.system.accepting import raise_nofile_limit

    soft, _hard = raise_nofile_limit()
    logging.getLogger("hwrd").info("open-files limit %d", soft)
    try:
        asyncio.run(serve(config, args))
    except HwrError as exc:
        print(f"hwrd: {exc.code}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"hwrd: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
