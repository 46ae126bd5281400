"""Worker for the role tests: drop to another uid, try each operation on hwrd, report outcomes.

Run as root: ``python role_worker.py UID SOCKET`` with a JSON object on stdin (``key``: an
artifact to acquire, deny, pin, evict and verify; ``checkpoints``: directories to register). The
process loads what it needs, drops to ``UID`` (gid ``UID``, no supplementary groups), then
prints one JSON line: operation -> ``{"ok": true, ...}`` or ``{"ok": false, "code", "role",
"message"}``. Nothing is mocked: a real client process on hwrd's real sockets.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import grpc
import grpc._channel  # loaded before the privileges go (the checkout may be unreadable)
import torch

import hwr.client.checkpoint_lease
import hwr.client.lease
import hwr.client.publisher  # noqa: F401
from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import HwrError
from hwr.protos.hwr.v1 import hwr_pb2 as pb


def attempt(action: Callable[[], Any]) -> dict[str, Any]:
    try:
        value = action()
    except HwrError as exc:
        return {"ok": False, "code": exc.code, "role": exc.details.get("role"), "message": exc.message,
                "details": json.dumps(exc.details, default=str)}
    except grpc.RpcError as exc:  # not typed: the test fails on it
        return {"ok": False, "code": f"grpc:{exc.code()}", "role": None, "message": str(exc)[:300]}
    return {"ok": True, "value": value}


def main(argv: list[str]) -> int:
    uid, socket_path = int(argv[0]), argv[1]
    plan = json.loads(sys.stdin.read())
    os.setgid(uid)
    os.setgroups([])
    os.setuid(uid)
    key = plan["key"]
    report: dict[str, Any] = {"uid": os.getuid()}
    with connect(socket_path, timeout=30) as client:
        def acquire() -> int:
            with client.acquire(key) as lease:
                return len(lease.tensors)

        def raw_begin() -> None:  # the gRPC form of publishing (client.publish uses the peer socket)
            identity = ArtifactIdentity.simple("roles/raw").canonical_bytes
            client._connection.call("BeginPublication", pb.BeginPublicationRequest(
                identity_json=identity, tensors=[pb.TensorSpec(name="w", dtype="F32", shape=[4])]))

        report["acquire"] = attempt(acquire)
        report["publish"] = attempt(lambda: client.publish(ArtifactIdentity.simple("roles/pub"),
                                                           {"w": torch.ones(4)}))
        report["begin_rpc"] = attempt(raw_begin)
        report["deny"] = attempt(lambda: client.deny(key, "not yours") and None)
        report["pin"] = attempt(lambda: client.pin(key) and None)
        report["evict"] = attempt(lambda: client.evict(key) and None)
        report["gc"] = attempt(lambda: client.gc() and None)
        report["verify"] = attempt(lambda: client.verify(key) and None)
        report["pull"] = attempt(lambda: client.pull(key) and None)  # fleet tier: operator actions
        report["push"] = attempt(lambda: client.push(key) and None)
        for name, path in plan.get("checkpoints", {}).items():
            def add_and_read(path: str = path) -> str:
                ckpt = client.add_checkpoint(path)
                with client.acquire_checkpoint(ckpt["checkpoint_id"]) as lease:
                    return repr(sorted(lease.tensors))[:200]
            report[f"checkpoint:{name}"] = attempt(add_and_read)
        report["acquire_after"] = attempt(acquire)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
