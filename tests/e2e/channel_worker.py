"""A client process for the channel tests (nothing mocked: a real process on hwrd's real sockets).

``python channel_worker.py watch SOCKET NAME``: watch a channel; prints ``subscribed``, then
waits for a line on stdin before each ``wait`` (``wait SECONDS``), printing ``update KEY
GENERATION``, ``none`` or ``ended CODE``; ``quit`` ends it. The test controls when the watcher
reads, which is how it plays a slow watcher.

``python channel_worker.py roles UID SOCKET`` (a JSON plan on stdin: ``key``, ``channel``): drop
to ``UID`` and try each channel operation; prints one JSON line: operation -> ``{"ok": true}`` or
``{"ok": false, "code", "role"}``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import grpc._channel  # noqa: F401 - loaded before the privileges go
import torch

import hwr.client.channel_watch
import hwr.client.lease
import hwr.client.publisher
import hwr.client.revision_diff  # noqa: F401 - publish imports it lazily, after the uid drop
from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import HwrError


def watch(socket_path: str, name: str) -> int:
    with connect(socket_path, timeout=30) as client, client.watch_channel(name) as channel_watch:
        print("subscribed", flush=True)
        for line in sys.stdin:
            command = line.split()
            if not command or command[0] == "quit":
                break
            try:
                update = channel_watch.wait(float(command[1]))
            except HwrError as exc:
                print("ended", exc.code, flush=True)
                return 0
            print("none" if update is None else f"update {update.key} {update.generation}", flush=True)
    return 0


def attempt(action: Callable[[], Any]) -> dict[str, Any]:
    try:
        action()
    except HwrError as exc:
        return {"ok": False, "code": exc.code, "role": exc.details.get("role")}
    return {"ok": True}


def roles(uid: int, socket_path: str) -> int:
    plan = json.loads(sys.stdin.read())
    os.setgid(uid)
    os.setgroups([])
    os.setuid(uid)
    key, channel = plan["key"], plan["channel"]
    report: dict[str, Any] = {"uid": os.getuid()}
    with connect(socket_path, timeout=30) as client:
        def acquire() -> None:
            with client.acquire_channel(channel) as lease:
                assert lease.key == key

        def watch_it() -> None:
            with client.watch_channel(channel) as channel_watch:
                update = channel_watch.wait(10)
                assert update is not None and update.key == key

        report["acquire_channel"] = attempt(acquire)
        report["watch_channel"] = attempt(watch_it)
        report["set_channel"] = attempt(lambda: client.set_channel(channel, key))
        report["remove_channel"] = attempt(lambda: client.remove_channel(channel))
        report["publish_to_channel"] = attempt(lambda: client.publish(
            ArtifactIdentity.simple("channels/by-nobody"), {"w": torch.ones(8)}, channel=channel))
        report["publish_to_own_channel"] = attempt(lambda: client.publish(
            ArtifactIdentity.simple("channels/by-nobody"), {"w": torch.ones(8)}, channel=f"{channel}-own"))
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "watch":
        sys.exit(watch(sys.argv[2], sys.argv[3]))
    sys.exit(roles(int(sys.argv[2]), sys.argv[3]))
