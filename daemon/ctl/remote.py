"""hwrctl subcommands of the fleet tier: ``remote ls``, ``pull KEY``, ``push KEY``, ``peers [KEY]``.

``pull`` fetches an artifact from the remote into this node's store (verified like every pull)
with a progress bar on stderr (when stderr is a terminal, or always with ``--progress``): run it
before starting vLLM-Omni in ``required`` mode on a new node. ``push`` uploads one local
artifact now (publications are uploaded in the background anyway while ``remote_push`` is on).
``peers`` lists the peer tier's holder records in the remote (which nodes announce an artifact,
at which address, how old the record is and whether it is still live), for one key or for every
artifact of the remote and of this node. All need a remote configured in hwrd (exit 1,
``UNSUPPORTED``, otherwise).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hwr.client.client import Client
from hwr.daemon.ctl.cli import ago, register, table
from hwr.daemon.ctl.progress import ProgressBar, human_bytes

__all__: list[str] = []


@register("remote", "the remote tier: 'remote ls' lists its artifacts",
          lambda p: p.add_argument("action", choices=("ls",)))
def cmd_remote(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    items = client.remote_list()
    url = items[0]["remote"] if items else (client.status().get("remote") or {}).get("url", "")
    rows = [[a["key"][:16], human_bytes(a["size_bytes"]), a["state"], "yes" if a["local"] else "no"] for a in items]
    text = f"remote: {url}\n" + table(["KEY", "SIZE", "STATE", "LOCAL"], rows)
    return items, text if items else text + "\n(no artifacts)"


def _pull_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("key", help="64-hex key or unique prefix among the remote's artifacts")
    p.add_argument("--progress", action="store_true", help="draw the progress bar even when not a terminal")


@register("pull", "pull an artifact from the remote into this node's store (verified)", _pull_args)
def cmd_pull(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    with ProgressBar(args.key[:16], unit="bytes", quiet=not (args.progress or sys.stderr.isatty())) as bar:
        result = client.pull(args.key, progress=bar.update)
    return result, f"{result['outcome']}: {result['key']} ({human_bytes(result['size_bytes'])})"


@register("push", "upload one local artifact to the remote now", lambda p: p.add_argument("key"))
def cmd_push(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    result = client.push(args.key)
    return result, f"{result['outcome']}: {result['key']} ({human_bytes(result['size_bytes'])})"


def _peers_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("key", nargs="?", default="",
                   help="64-hex key or unique prefix (default: every artifact of the remote and of this node)")


@register("peers", "the peer tier's holder records in the remote: which nodes serve an artifact", _peers_args)
def cmd_peers(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """JSON: ``node`` (this node, "" when its peer tier is off), ``now`` and ``holders`` (an array
    of objects with ``key``, ``node``, ``address``, ``recorded_at``, ``expires_at``, ``live``)."""
    listing = client.peer_holders(args.key)
    now = listing["now"]
    me = listing["node"]
    rows = [[h["key"][:16], h["node"] + (" (this node)" if me and h["node"] == me else ""), h["address"],
             ago(h["recorded_at"], now) if h["recorded_at"] else "-", _expiry(h["expires_at"], now),
             "yes" if h["live"] else "no"]
            for h in listing["holders"]]
    text = table(["KEY", "NODE", "ADDRESS", "RECORDED", "EXPIRES", "LIVE"], rows)
    return listing, text if rows else text + "\n(no holder records)"


def _expiry(expires_at: float, now: float) -> str:
    if expires_at > now:
        return f"in {expires_at - now:.0f}s"
    return f"expired {ago(expires_at, now)}"
