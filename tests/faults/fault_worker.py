"""A client process for the fault suite: ``python fault_worker.py MODE SOCKET SEED [ARGS]``.

``churn SOCKET SEED PREFIX KEYS``: until a ``stop`` line arrives on stdin, loop over random
operations (acquire one of KEYS (comma separated) or of the daemon's listing, check that every
element equals the model number, release; publish ``PREFIX-<n>`` with ``n`` in the content; list
artifacts). Typed errors (``HwrError``: the daemon was killed, an artifact was evicted, ...) are
counted and the client reconnects; anything else, or a lease whose bytes are not what its model
says, is counted as ``bad``. Prints ``ready`` and, after ``stop``, ``result {json}``.

``hold SOCKET SEED KEYS``: lease every key, print ``held``, then answer each ``check`` line with
``ok R`` (R = reconnects so far) when every byte of every lease is still right, else ``bad``.
"""

from __future__ import annotations

import json
import random
import select
import sys
import time

import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import HwrError


def _number(lease) -> int:  # type: ignore[no-untyped-def]
    return int(lease.manifest.identity.source.model_id.rsplit("-", 1)[1])


def _stdin_says(word: str) -> bool:
    ready, _, _ = select.select([sys.stdin], [], [], 0)
    return bool(ready) and sys.stdin.readline().strip() == word


def churn(sock: str, seed: int, prefix: str, keys: list[str]) -> None:
    rng = random.Random(seed)
    counts = {"ops": 0, "typed": 0, "bad": 0, "published": 0, "acquired": 0}
    client = None
    print("ready", flush=True)
    while not _stdin_says("stop"):
        try:
            if client is None:
                client = connect(sock, timeout=10)
            roll = rng.random()
            if roll < 0.55:
                pool = keys or [a["key"] for a in client.list_artifacts()]
                if pool:
                    with client.acquire(rng.choice(pool)) as lease:
                        if not bool((lease.tensors["w"] == float(_number(lease))).all()):
                            counts["bad"] += 1
                    counts["acquired"] += 1
            elif roll < 0.9:
                n = rng.randrange(1000, 10**6)
                client.publish(ArtifactIdentity.simple(f"{prefix}-{n}"),
                               {"w": torch.full((1 << 14,), float(n), dtype=torch.float32)}, wait_timeout=5)
                counts["published"] += 1
            else:
                client.list_artifacts()
            counts["ops"] += 1
        except HwrError:
            counts["typed"] += 1
            if client is not None:
                client.close()
            client = None
            time.sleep(0.02)
        except Exception as exc:  # anything untyped is a finding
            counts["bad"] += 1
            print(f"untyped {type(exc).__name__}: {exc}"[:300], file=sys.stderr, flush=True)
            time.sleep(0.02)
    if client is not None:
        client.close()
    print("result " + json.dumps(counts), flush=True)


def hold(sock: str, keys: list[str]) -> None:
    client = connect(sock)
    leases = [client.acquire(k) for k in keys]
    print("held", flush=True)
    for line in sys.stdin:
        if line.strip() != "check":
            continue
        good = all(bool((lease.tensors["w"] == float(_number(lease))).all()) for lease in leases)
        print(f"ok {client.reconnects}" if good else "bad", flush=True)


def main(argv: list[str]) -> None:
    mode, sock, seed = argv[0], argv[1], int(argv[2])
    if mode == "churn":
        churn(sock, seed, argv[3], [k for k in argv[4].split(",") if k] if len(argv) > 4 else [])
    elif mode == "hold":
        hold(sock, argv[3].split(","))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1:])
