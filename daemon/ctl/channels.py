"""hwrctl subcommands of channels: ``channel ls``, ``channel show NAME``, ``channel set NAME KEY``,
``channel rm NAME``, each with ``--json``.

``--json`` documents (stable for scripts): ``ls`` an array and ``show``/``set``/``rm`` an object,
each channel with at least ``name``, ``key``, ``history`` (newest last: ``key``, ``generation``,
``set_at``, ``set_by``, ``durable``, ``uid``: who made the change, null for hwrd's own) and
``watchers``, plus ``generation``, ``durable``, ``durable_key``, ``switches``, ``created_at``,
``updated_at``, ``owner_uid`` (the publisher that owns it; null: an operator's channel) (``set``
adds ``changed``).
``set`` and ``rm`` need hwrd's operator role (exit 1, ``PERMISSION_DENIED``, otherwise); a
missing channel exits 1 with ``CHANNEL_NOT_FOUND``.
"""

from __future__ import annotations

import argparse
from typing import Any

from hwr.client.client import Client
from hwr.daemon.ctl.cli import ago, register, table

__all__: list[str] = []


def _arguments(p: argparse.ArgumentParser) -> None:
    # ``--json`` is accepted after the action too (``hwrctl channel ls --json``); SUPPRESS keeps
    # the action's parser from resetting a ``--json`` given before it.
    flag = argparse.ArgumentParser(add_help=False)
    flag.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    actions = p.add_subparsers(dest="action", required=True, metavar="{ls,show,set,rm}")
    actions.add_parser("ls", help="list channels", parents=[flag])
    actions.add_parser("show", help="one channel with its history", parents=[flag]).add_argument("name")
    set_parser = actions.add_parser("set", help="point a channel at an artifact (operator role)", parents=[flag])
    set_parser.add_argument("name")
    set_parser.add_argument("key", help="64-hex key or unique prefix")
    actions.add_parser("rm", help="remove a channel (operator role)", parents=[flag]).add_argument("name")


@register("channel", "channels: named pointers to artifact keys (ls | show NAME | set NAME KEY | rm NAME)",
          _arguments)
def cmd_channel(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    if args.action == "ls":
        items = client.list_channels()
        rows = [[c["name"], c["key"][:16], c["generation"], "yes" if c["durable"] else "no", c["watchers"],
                 c["switches"], ago(c["updated_at"])] for c in items]
        text = table(["NAME", "KEY", "GENERATION", "DURABLE", "WATCHERS", "SWITCHES", "UPDATED"], rows)
        return items, text if items else text + "\n(no channels)"
    if args.action == "show":
        info = client.inspect_channel(args.name)
        return info, _describe(info)
    if args.action == "set":
        info = client.set_channel(args.name, args.key)
        verb = "set" if info["changed"] else "unchanged:"
        return info, f"{verb} {info['name']} -> {info['key']} (generation {info['generation']}" + (
            ", non-durable: lost at hwrd's next start" if not info["durable"] else "") + ")"
    info = client.remove_channel(args.name)
    return info, f"removed {info['name']} (it pointed to {info['key']})"


def _describe(info: dict[str, Any]) -> str:
    lines = [
        f"name:        {info['name']}",
        f"key:         {info['key']}",
        f"generation:  {info['generation']}" + ("" if info["durable"] else "  (non-durable)"),
        f"durable key: {info['durable_key'] or '-'}",
        f"watchers:    {info['watchers']}",
        f"switches:    {info['switches']}",
        f"created:     {ago(info['created_at'])}",
        f"owner:       {'operators' if info.get('owner_uid') is None else 'uid ' + str(info['owner_uid'])}",
        "history (newest last):",
    ]
    rows = [[e["generation"], e["key"][:16], e["set_by"], "-" if e.get("uid") is None else e["uid"],
             "yes" if e["durable"] else "no", ago(e["set_at"])] for e in info["history"]]
    lines += ["  " + line for line in table(["GENERATION", "KEY", "BY", "UID", "DURABLE", "SET"],
                                            rows).splitlines()]
    return "\n".join(lines)
