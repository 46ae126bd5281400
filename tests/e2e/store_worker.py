"""A worker process for the store-service tests: ``python store_worker.py MODE SOCKET KEY``.

Modes: ``map-then-drop-session`` (lease, keep the tensor views mapped, close the client so the
session ends, print ``ready``, sleep); ``hold`` (keep the lease open, print ``ready`` and, after
the daemon restarted, ``reattached N`` once the client rebound the lease, then sleep);
``stall`` (begin a publication, print ``ready``, never write or commit; then read one line and
try to commit, printing the error code); ``hold-unmapped`` (take a lease's descriptors without
mapping them and without automatic reattachment, print ``ready``; on each line read, hash the
payloads through the descriptors and print ``sha <hex>...``, one digest per payload).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import HwrError
from hwr.client.publisher import TensorSpec


def main(mode: str, sock: str, key: str) -> None:
    client = connect(sock)
    if mode == "map-then-drop-session":
        lease = client.acquire(key)
        view = lease.tensors["w"]
        client.close()  # the session (and the daemon's lease) ends; the mapping stays
        print("ready", flush=True)
        while True:
            time.sleep(1)
            assert view.numel() > 0
    if mode == "hold":
        lease = client.acquire(key)
        first = lease.lease_id
        print("ready", flush=True)
        while lease.lease_id == first:
            time.sleep(0.05)
        print(f"reattached {client.reconnects} {float(lease.tensors['w'][0])}", flush=True)
        while True:
            time.sleep(1)
    if mode == "hold-unmapped":
        # A process that received descriptors and has not mapped them yet (the documented
        # blind spot of the /proc mappings scan), and whose client never reattaches: after a
        # daemon restart only the lease journal knows it may still map these bytes.
        client.auto_reconnect = False
        _lease_id, _key, _manifest, fds = client._acquirer.peer_acquire(key)
        print("ready", flush=True)
        for _line in sys.stdin:
            digests = []
            for fd in fds:
                h = hashlib.sha256()
                offset = 0
                while chunk := os.pread(fd, 1 << 20, offset):
                    h.update(chunk)
                    offset += len(chunk)
                digests.append(h.hexdigest())
            print("sha " + " ".join(digests), flush=True)
    if mode == "stall":
        pub = client.publisher(ArtifactIdentity.simple(key), [TensorSpec("w", torch.float32, (1024,))])
        print("ready", flush=True)
        sys.stdin.readline()
        try:
            pub.write("w", torch.zeros(1024))
            pub.commit()
            print("committed", flush=True)
        except HwrError as exc:
            print(f"error {exc.code}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
