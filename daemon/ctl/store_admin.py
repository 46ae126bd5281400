"""hwrctl subcommands of store administration: verify, deny, allow, pin, unpin, evict, gc, usage.

``verify KEY|--all`` re-hashes with a progress bar on stderr (when stderr is a terminal, or always
with ``--progress``); a mismatch exits 1 after the daemon quarantined and denied the artifact,
naming the leases already granted on it. ``evict`` refuses (exit 1, ``ACTIVE_LEASE``) an artifact
that is leased, pinned, held or mapped, saying which and by whom. ``gc`` evicts unused artifacts
(LRU first) down to ``--target-bytes`` or the configured limits and lists what it skipped.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from hwr.client.client import Client
from hwr.client.errors import ChecksumMismatch, InvalidRequest, error_from_code
from hwr.daemon.ctl.cli import register, table
from hwr.daemon.ctl.progress import ProgressBar, human_bytes

__all__: list[str] = []


def _verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("key", nargs="?", help="64-hex key or unique prefix")
    p.add_argument("--all", action="store_true", help="verify every artifact")
    p.add_argument("--progress", action="store_true", help="draw the progress bar even when not a terminal")


@register("verify", "re-hash artifacts (KEY or --all); corrupt ones are quarantined and denied", _verify_args)
def cmd_verify(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    if bool(args.key) == bool(args.all):
        raise InvalidRequest("give a KEY or --all")
    keys = [a["key"] for a in client.list_artifacts() if a["state"] == "ready"] if args.all else [args.key]
    quiet = not (sys.stderr.isatty() or args.progress) or args.json
    results = []
    for key in keys:
        with ProgressBar(key[:16], unit="bytes", quiet=quiet) as bar:
            results.append(client.verify(key, bar.update))
    bad = [r for r in results if not r["ok"]]
    if bad:
        leases = [f"{x['lease_id']} (pid {x['pid']})" for r in bad for x in r["affected_leases"]]
        codes = {r["error_code"] for r in bad}
        # A mismatch is CHECKSUM_MISMATCH; one other code (a denied or vanished artifact) is kept.
        code = codes.pop() if len(codes) == 1 else "CHECKSUM_MISMATCH"
        message = (
            f"{len(bad)} of {len(results)} artifacts failed verification: "
            + ", ".join(f"{r['key'][:16]} {r['error_code']}{' quarantined' if r['quarantined'] else ''}" for r in bad)
            + (f"; leases already granted: {', '.join(leases)}" if leases else "; no leases were granted on them"))
        details = {"keys": ",".join(r["key"] for r in bad)}
        raise ChecksumMismatch(message, details=details) if code == "CHECKSUM_MISMATCH" else error_from_code(
            code, message, details)
    rows = [[r["key"][:16], human_bytes(r["size_bytes"]), "ok"] for r in results]
    return results, table(["KEY", "SIZE", "VERDICT"], rows) if rows else "(no artifacts)"


def _deny_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("key")
    p.add_argument("--reason", required=True, help="why (kept in deny/<key>.json)")


@register("deny", "stop handing out an artifact (KEY --reason TEXT)", _deny_args)
def cmd_deny(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    r = client.deny(args.key, args.reason)
    leases = r["affected_leases"]
    text = f"denied {r['key']}"
    if leases:
        text += f"\n{len(leases)} leases already granted keep their mappings: " + ", ".join(
            f"{x['lease_id']} (pid {x['pid']})" for x in leases)
    return r, text


def _key_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("key", help="64-hex key or unique prefix")


@register("allow", "remove a deny marker (KEY)", _key_arg)
def cmd_allow(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    r = client.allow(args.key)
    return r, f"allowed {r['key']}" + ("" if r["was_denied"] else " (it was not denied)")


@register("pin", "exempt an artifact from eviction and keep it resident (KEY)", _key_arg)
def cmd_pin(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    r = client.pin(args.key)
    return r, (f"pinned {r['key']} ({human_bytes(r['size_bytes'])}, {r['residency']}"
               f"{', already pinned' if r['already_pinned'] else ''})")


@register("unpin", "undo pin (KEY)", _key_arg)
def cmd_unpin(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    r = client.unpin(args.key)
    return r, f"unpinned {r['key']}" + ("" if r["was_pinned"] else " (it was not pinned)")


@register("evict", "remove an unused artifact now (KEY); refuses leased, pinned or mapped ones", _key_arg)
def cmd_evict(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    r = client.evict(args.key)
    return r, f"evicted {r['key']} ({human_bytes(r['freed_bytes'])} freed)"


def _gc_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target-bytes", type=int, help="evict until the store holds at most N bytes")


@register("gc", "evict least-recently-used unused artifacts down to --target-bytes or the limits", _gc_args)
def cmd_gc(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    if args.target_bytes is not None and args.target_bytes < 0:
        raise InvalidRequest("--target-bytes must not be negative")
    r = client.gc(args.target_bytes)
    lines = [f"evicted {len(r['evicted'])} artifacts, freed {human_bytes(r['freed_bytes'])}; store now "
             f"{human_bytes(r['store_bytes'])} (target {human_bytes(r['target_bytes'])})"]
    lines += [f"  evicted {k}" for k in r["evicted"]]
    lines += [f"  kept    {x['key']} ({x['reason']})" for x in r["skipped"]]
    return r, "\n".join(lines)


@register("usage", "store capacity, reservations, pins and per-artifact use")
def cmd_usage(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    u = client.store_usage()
    limit = human_bytes(u["store_limit_bytes"]) if u["store_limit_bytes"] else "unlimited"
    rows = [[a["key"][:16], human_bytes(a["size_bytes"]), a["leases"], "yes" if a["pinned"] else "",
             ",".join(map(str, a["held_by_pids"])), time.strftime("%Y-%m-%d %H:%M:%S",
                                                                  time.localtime(a["last_access"]))]
            for a in sorted(u["artifacts"], key=lambda a: a["last_access"])]
    head = (f"store {human_bytes(u['store_bytes'])} of {limit}, reserved {human_bytes(u['reserved_bytes'])}, "
            f"free {human_bytes(u['free_bytes'])}, pinned {human_bytes(u['pinned_bytes'])} "
            f"(locked {human_bytes(u['locked_bytes'])}), evictions {u['evictions']}")
    return u, head + "\n" + table(["KEY", "SIZE", "LEASES", "PINNED", "HELD BY", "LAST ACCESS"], rows)


