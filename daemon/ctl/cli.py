"""``hwrctl``: the operator's view of hwrd.

Usage: ``hwrctl [--socket PATH] SUBCOMMAND [ARGS] [--json]``. The socket comes from the flag,
else ``$HWR_SOCKET``, else your own hwrd or the node's service (``hwr.client.paths.client_socket``).

Output: a readable table by default; with ``--json`` a stable document for scripts
(``ls``: array of objects with at least ``key``, ``size_bytes``, ``state``, ``leases``;
``leases``: array with at least ``key``, ``pid``; ``status``: object with at least ``version``,
``root``, ``artifacts``, ``leases``).

Exit status (documented in ``hwrctl --help`` too): 0 ok, 1 the operation failed, 2 usage error,
3 the daemon is unreachable. Errors are one line on stderr (``hwrctl: CODE: message``), never a
traceback. Long operations draw a progress bar on stderr (``hwr.daemon.ctl.progress``), never on
stdout. ``hwrctl completion bash|zsh`` prints a shell completion script (no daemon needed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from hwr import __version__
from hwr.client.client import Client, connect
from hwr.client.errors import DaemonUnavailable, HwrError
from hwr.daemon.ctl.progress import human_bytes

__all__ = ["main"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


def printable(text: str) -> str:
    """``text`` safe for a terminal: every control or format character other than a newline
    (escape sequences, carriage returns, bidirectional overrides) written as its Python escape
    (``\\x1b``), so that client-supplied strings (client and model names) cannot move the cursor,
    recolour or hide output. ``--json`` output is JSON-escaped instead."""
    if all(c == "\n" or c.isprintable() for c in text):
        return text
    return "".join(c if c == "\n" or c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned text table (numbers right-aligned; cells through ``printable``)."""
    cells = [[printable(str(c)) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    numeric = [bool(cells) and all(_is_num(r[i]) for r in cells) for i in range(len(headers))]

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w)
                         for c, w, num in zip(row, widths, numeric, strict=True)).rstrip()

    return "\n".join([fmt(list(headers)), *(fmt(r) for r in cells)])


def _is_num(text: str) -> bool:
    return text.replace(".", "", 1).replace(" ", "").rstrip("KMGTiB").isdigit()


def ago(ts: float, now: float | None = None) -> str:
    """How long before ``now`` (default: this clock's time) ``ts`` was, as ``5m ago``."""
    delta = max(0.0, (time.time() if now is None else now) - ts)
    for unit, seconds in (("d", 86400), ("h", 3600), ("m", 60)):
        if delta >= seconds:
            return f"{delta / seconds:.0f}{unit} ago"
    return f"{delta:.0f}s ago"


# subcommands ------------------------------------------------------------------------------------
def cmd_status(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    s = client.status()
    text = "\n".join([
        f"hwrd {s['version']} (pid {s['pid']}, up {s['uptime_s']:.0f}s)",
        f"root:         {s['root']}",
        f"socket:       {s['socket']}",
        f"artifacts:    {s['artifacts']} ({human_bytes(s['store_bytes'])})",
        f"leases:       {s['leases']}",
        f"sessions:     {s['sessions']}",
        f"publications: {s['publications']}",
        *_remote_lines(s.get("remote")),
        *_channel_lines(s.get("channels") or []),
    ])
    return s, text


def _channel_lines(channels: list[dict[str, Any]]) -> list[str]:
    if not channels:
        return []
    rows = [[c["name"], c["key"][:16], c["generation"], "yes" if c["durable"] else "no", c["watchers"],
             c["switches"]] for c in channels]
    return ["channels:", *("  " + line for line in table(
        ["NAME", "KEY", "GENERATION", "DURABLE", "WATCHERS", "SWITCHES"], rows).splitlines())]


def _remote_lines(remote: dict[str, Any] | None) -> list[str]:
    if not remote:
        return []
    if remote["reachable"]:
        state = "reachable"
    elif remote.get("error_code") == "REMOTE_DENIED":  # the keys or the policy, not the network
        state = f"DENIED ({remote['error']})"
    else:
        state = f"UNREACHABLE ({remote['error']})"
    return [f"remote:       {remote['url']} {state}, push {'on' if remote['push'] else 'off'}, "
            f"{remote['pending_pushes']} pending pushes, {human_bytes(remote['bytes_pulled'])} pulled, "
            f"{human_bytes(remote['bytes_pushed'])} pushed",
            *(f"pulling:      {p['key'][:16]} {p['phase']} {_share(p)}, {len(p['waiters'])} waiting "
              f"(pids {', '.join(str(w['pid']) for w in p['waiters']) or '-'})" for p in remote.get("pulls", ())),
            *_peer_lines(remote.get("peers"))]


def _peer_lines(peers: dict[str, Any] | None) -> list[str]:
    """The peer tier's lines of ``hwrctl status`` (none when it is off)."""
    if not peers:
        return []
    cap = f"capped at {human_bytes(peers['cap_bytes_per_s'])}/s" if peers["cap_bytes_per_s"] else "no cap"
    serving = (f"serving at {peers['address']} ({cap}) to {len(peers['serving_peers'])} peers now "
               f"({', '.join(peers['serving_peers']) or '-'})" if peers["serve"] else "not serving")
    return [f"peers:        node {peers['node']}, {serving}, fetch {'on' if peers['fetch'] else 'off'}; "
            f"{human_bytes(peers['served_bytes'])} served, {human_bytes(peers['fetched_bytes'])} pulled from peers "
            f"({human_bytes(peers['fallback_bytes'])} from the remote instead); dropped {peers['lying_peers']} "
            f"lying, {peers['failed_peers']} failing; {peers['refused']} refused; transfer process "
            f"{_agent(peers)}",
            *(f"peer pull:    {p['key'][:16]} {_share(p)} from {', '.join(p['peers'])}, "
              f"{_rate(p)}" for p in peers["pulls"])]


def _agent(peers: dict[str, Any]) -> str:
    """The transfer process: its memory and pid, or that it is down; its restarts when any."""
    restarts = peers.get("agent_restarts", 0)
    state = (f"{human_bytes(peers['agent_rss_bytes'])} (pid {peers['agent_pid']})" if peers.get("agent_pid")
             else "DOWN (restarting)")
    return state + (f", {restarts} restart{'s' if restarts != 1 else ''}" if restarts else "")


def _rate(pull: dict[str, Any]) -> str:
    elapsed = max(1e-3, time.time() - pull["started_at"])
    return f"{human_bytes(int(pull['done_bytes'] / elapsed))}/s"


def _share(pull: dict[str, Any]) -> str:
    done, total = pull["done_bytes"], pull["total_bytes"]
    if not total:
        return "-"
    return f"{human_bytes(done)} of {human_bytes(total)} ({100 * done // total}%)"


def cmd_ls(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    items = sorted(client.list_artifacts(include_denied=True), key=lambda a: a["created_at"])
    rows = [[a["key"][:16], human_bytes(a["size_bytes"]), a["state"], a["leases"], a["tensors"],
             a["model_id"], a["dtype"], ago(a["created_at"]) if a["created_at"] else "-"] for a in items]
    text = table(["KEY", "SIZE", "STATE", "LEASES", "TENSORS", "MODEL", "DTYPE", "CREATED"], rows)
    return items, text if items else text + "\n(no artifacts)"


def cmd_show(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    info = client.inspect(args.key)
    ident = info.get("identity") or {}
    lines = [
        f"key:        {info['key']}",
        f"state:      {info['state']}" + (f" ({info['deny_reason']})" if info.get("deny_reason") else ""),
        f"size:       {human_bytes(info['size_bytes'])} ({info['size_bytes']} bytes)",
        f"leases:     {info['leases']}",
        f"model:      {info['model_id']} ({ident.get('source', {}).get('revision', '?')})",
        f"component:  {info['component']}",
        f"dtype:      {info['dtype']}",
        f"layout:     {json.dumps(ident.get('layout', {}), sort_keys=True)}",
        f"producer:   {json.dumps(ident.get('producer', {}), sort_keys=True)}",
        f"content:    {info['content_sha256']}",
        f"created:    {ago(info['created_at'])}",
        "files:",
        *(f"  {f['file_name']}  {human_bytes(f['size'])}  sha256 {f['sha256'][:16]}…" for f in info["files"]),
        f"tensors:    {len(info['tensors'])}",
        *([f"remote:     {info['remote_state']}"] if info.get("remote_state") else []),
        *([f"channels:   {', '.join(info['channels'])}"] if info.get("channels") else []),
        *(["durable:    no (gone at hwrd's next start)"] if info.get("non_durable") else []),
    ]
    return info, "\n".join(lines)


def cmd_leases(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """Leases (the JSON array); the table also lists acquirers waiting for a pull (``status
    --json`` has them under ``remote.pulls``)."""
    items = client.leases()
    rows = [[x["lease_id"], x["key"][:16], x["pid"], x["uid"], x["client_name"], ago(x["acquired_at"])]
            for x in items]
    pulls = (client.status().get("remote") or {}).get("pulls", [])
    rows += [[f"(waiting: pull {_share(p)})", p["key"][:16], w["pid"], w["uid"], w["client_name"], ago(w["since"])]
             for p in pulls for w in p["waiters"]]
    text = table(["LEASE", "KEY", "PID", "UID", "CLIENT", "ACQUIRED"], rows)
    return items, text if rows else text + "\n(no leases)"


COMMANDS: dict[str, tuple[Callable[[Client, argparse.Namespace], tuple[Any, str]], str]] = {
    "status": (cmd_status, "daemon version, store root and counters"),
    "ls": (cmd_ls, "list artifacts"),
    "show": (cmd_show, "describe one artifact (KEY: 64-hex key or unique prefix)"),
    "leases": (cmd_leases, "list live leases"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # usage errors exit 2 with one line
        self.print_usage(sys.stderr)
        print(f"hwrctl: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def register(name: str, help_text: str, arguments: Callable[[argparse.ArgumentParser], None] | None = None):
    """Decorator for subcommands defined in other modules (``EXTENSIONS``).

    A handler takes ``(client, args)`` and returns ``(json_document, human_text)``.
    """

    def wrap(fn: Callable[[Client, argparse.Namespace], tuple[Any, str]]):
        COMMANDS[name] = (fn, help_text)
        if arguments is not None:
            ARGUMENTS[name] = arguments
        return fn

    return wrap


ARGUMENTS: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "show": lambda p: p.add_argument("key"),
}
LOCAL_COMMANDS: set[str] = {"completion"}  # subcommands whose handler gets ``client=None``


@register("completion", "print a bash or zsh completion script",
          lambda p: p.add_argument("shell", choices=("bash", "zsh")))
def cmd_completion(client: Client | None, args: argparse.Namespace) -> tuple[Any, str]:
    from hwr.daemon.ctl.completion import completion_script

    script = completion_script(args.shell, build_parser())
    return {"shell": args.shell, "script": script}, script.rstrip("\n")


# modules that register more subcommands, imported by main()
EXTENSIONS: tuple[str, ...] = ("hwr.daemon.ctl.checkpoints", "hwr.daemon.ctl.store_admin", "hwr.daemon.ctl.remote",
                               "hwr.daemon.ctl.channels")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hwrctl", description="Inspect and manage hwrd, the Host Weight Runtime daemon.",
                     epilog="exit status: 0 ok, 1 the operation failed, 2 usage error, 3 hwrd unreachable")
    parser.add_argument("--socket", help="hwrd socket (default: $HWR_SOCKET, else your own hwrd's default socket "
                        "when one is there, else the node's service /run/hwrd/hwrd.sock)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per call (default 30)")
    parser.add_argument("--version", action="version", version=f"hwrctl {__version__}")
    json_parent = argparse.ArgumentParser(add_help=False)
    json_parent.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (_fn, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, parents=[json_parent])
        if name in ARGUMENTS:
            ARGUMENTS[name](p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one hwrctl command; the exit status (module docstring). A reader that stops reading
    early (``hwrctl ls | head -1``) ends the output quietly: no traceback, exit 0, as ``ls``
    and ``cat`` behave under a shell's pipeline."""
    try:
        status = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
    except BrokenPipeError:
        # Whatever is still buffered for stdout goes nowhere: the interpreter's last flush would
        # fail again and print "Exception ignored ... BrokenPipeError".
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_OK
    return status


def _main(argv: list[str] | None) -> int:
    import importlib

    for module in EXTENSIONS:
        importlib.import_module(module)
    args = build_parser().parse_args(argv)
    handler = COMMANDS[args.command][0]
    if args.command in LOCAL_COMMANDS:  # answered without a daemon
        document, text = handler(None, args)  # type: ignore[arg-type]
        print(json.dumps(document, indent=2, sort_keys=True) if args.json else text)
        return EXIT_OK
    try:
        with connect(args.socket, timeout=args.timeout, client_name="hwrctl") as client:
            document, text = handler(client, args)
    except DaemonUnavailable as exc:
        print(f"hwrctl: {exc.code}: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except HwrError as exc:
        print(f"hwrctl: {exc.code}: {printable(str(exc))}", file=sys.stderr)
        return EXIT_FAILURE
    print(json.dumps(document, indent=2, sort_keys=True) if args.json else printable(text))
    return EXIT_OK


if __name__ == "__main__":
    # Run the canonical module's main: extension modules register into ``hwr.daemon.ctl.cli``,
    # not into this ``__main__`` copy.
    from hwr.daemon.ctl.cli import main as _main

    sys.exit(_main())
