"""Worker for the fleet role tests: drop to another uid, acquire one key from hwrd, report.

Run as root: ``python fleet_worker.py UID SOCKET KEY [KEY ...]``. The process loads what it
needs, drops to ``UID`` (gid ``UID``, no supplementary groups), acquires each ``KEY`` in turn
(waiting for a pull while it advances) and prints one JSON line per key: ``{"ok": true,
"digests": {tensor: sha256}}`` or ``{"ok": false, "code", "role", "details"}``. A real client
process on hwrd's real sockets.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import grpc
import grpc._channel  # noqa: F401
import torch

import hwr.client.lease  # noqa: F401
from hwr.client import connect
from hwr.client.errors import HwrError


def sha256_of(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def main(argv: list[str]) -> int:
    uid, socket_path, keys = int(argv[0]), argv[1], argv[2:]
    os.setgid(uid)
    os.setgroups([])
    os.setuid(uid)
    for key in keys:  # one after the other, each on its own connection
        try:
            with connect(socket_path, timeout=30) as client, client.acquire(key, timeout=10) as lease:
                report = {"ok": True, "digests": {name: sha256_of(t) for name, t in lease.tensors.items()}}
        except HwrError as exc:
            report = {"ok": False, "code": exc.code, "role": exc.details.get("role"),
                      "details": json.loads(json.dumps(exc.details, default=str)), "message": exc.message}
        print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
