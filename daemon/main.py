"""``hwrd``: the node daemon's command line.

Exit status: 0 after a clean shutdown (SIGTERM/SIGINT), 1 on a runtime failure (store locked,
untrusted store, socket in use), 2 on a configuration or usage error. Errors are one line on
stderr, without a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from hwr import __version__
from hwr.client.errors import ConfigError, HwrError
from hwr.daemon.config import DaemonConfig, load_config

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hwrd", description="Host Weight Runtime daemon")
    p.add_argument("--config", type=Path, help="TOML config file (default /etc/hwrd/hwrd.toml if present)")
    p.add_argument("--root", help="store root directory (env HWR_ROOT)")
    p.add_argument("--socket", help="gRPC Unix socket path (env HWR_SOCKET)")
    p.add_argument("--socket-mode", type=lambda s: int(s, 8), help="socket file mode, octal (default 660)")
    p.add_argument("--allow-uid", type=int, action="append", dest="allow_uids", help="allowed client uid")
    p.add_argument("--allow-gid", type=int, action="append", dest="allow_gids", help="allowed client gid")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    p.add_argument("--version", action="version", version=f"hwrd {__version__}")
    return p


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    return {
        "root": args.root, "socket": args.socket, "socket_mode": args.socket_mode,
        "allow_uids": tuple(args.allow_uids) if args.allow_uids else None,
        "allow_gids": tuple(args.allow_gids) if args.allow_gids else None,
        "log_level": args.log_level,
    }


async def serve(config: DaemonConfig) -> None:
    from hwr.daemon.server import Daemon

    daemon = Daemon(config)
    await daemon.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"hwrd: serving on {config.socket} (root {config.root})", file=sys.stderr, flush=True)
    await stop.wait()
    logging.getLogger("hwrd").info("shutting down")
    await daemon.stop()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config, overrides=_overrides(args))
    except ConfigError as exc:
        print(f"hwrd: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(config))
    except HwrError as exc:
        print(f"hwrd: {exc.code}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"hwrd: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
