"""A client process for the fault suite: ``python fault_worker.py MODE SOCKET SEED [ARGS]``.

``churn SOCKET SEED PREFIX KEYS [PROTECTED [ACKS]]``: until a ``stop`` line arrives on stdin, loop
over random operations (acquire one of KEYS (comma separated) or of the daemon's listing, check that
every element equals the model number, release; publish ``PREFIX-<n>`` with ``n`` in the content;
list artifacts). Only the typed errors a fault explains count as ``typed`` (``EXPECTED``: the daemon
was killed or restarting, a publication was cut off, an unprotected artifact was evicted); any other
typed error (an ``ArtifactDenied`` or ``ChecksumMismatch`` on a good artifact, a miss on one of
PROTECTED, whose leases another process holds), anything untyped, or a lease whose bytes are not
what its model says, is counted as ``bad`` and described on stderr. Each acknowledged publication's
key is appended to the file ACKS (one line, flushed before the next operation), so the test can
check that every publication the daemon acknowledged survives a kill. Prints ``ready``; answers
``mark`` (start a new epoch of counts) with ``marked`` and ``count`` with ``count N`` (operations
completed in the current epoch); after ``stop``, prints ``result {json}`` (totals, plus ``epochs``:
operations per epoch, and ``codes``: typed errors by code).

``hold SOCKET SEED KEYS``: lease every key, print ``held``, then answer each ``check`` line with
``ok R`` (R = reconnects so far) when every byte of every lease is still right, else ``bad``.
"""

from __future__ import annotations

import json
import os
import random
import select
import sys
import time
from collections import Counter

import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import (
    ActiveBuildTimeout,
    ArtifactNotFound,
    DaemonUnavailable,
    DeadlineExceeded,
    HwrError,
    LeaseClosed,
    PublicationFailed,
    SessionInvalid,
    StoreLimitExceeded,
)

# What a daemon kill, a restart or an eviction may answer. ArtifactNotFound is expected only for
# unprotected keys (checked below); StoreLimitExceeded when every artifact is briefly in use.
EXPECTED: tuple[type[HwrError], ...] = (ActiveBuildTimeout, ArtifactNotFound, DaemonUnavailable,
                                        DeadlineExceeded, LeaseClosed, PublicationFailed, SessionInvalid,
                                        StoreLimitExceeded)


def _number(lease) -> int:  # type: ignore[no-untyped-def]
    return int(lease.manifest.identity.source.model_id.rsplit("-", 1)[1])


_pending = bytearray()


def _stdin_line() -> str | None:
    """The next whole line on stdin, or None if none has arrived (never blocks). Reads the raw
    descriptor: a buffered ``sys.stdin`` could hold a second line that ``select`` cannot see."""
    while b"\n" not in _pending and select.select([0], [], [], 0)[0]:
        chunk = os.read(0, 4096)
        if not chunk:
            return "stop"  # stdin closed: the test is gone
        _pending.extend(chunk)
    if b"\n" not in _pending:
        return None
    line, _, rest = bytes(_pending).partition(b"\n")
    _pending[:] = rest
    return line.decode().strip()


def _finding(counts: dict[str, int], what: str) -> None:
    counts["bad"] += 1
    print(what[:300], file=sys.stderr, flush=True)


def churn(sock: str, seed: int, prefix: str, keys: list[str], protected: set[str], acks: str | None) -> None:
    rng = random.Random(seed)
    counts = {"ops": 0, "typed": 0, "bad": 0, "published": 0, "acquired": 0}
    epochs = [0]
    codes: Counter[str] = Counter()
    ack_file = open(acks, "a") if acks else None  # noqa: SIM115 - closed at the end
    client = None
    print("ready", flush=True)
    while True:
        command = _stdin_line()
        if command == "stop":
            break
        if command == "mark":
            epochs.append(0)
            print("marked", flush=True)
        elif command == "count":
            print(f"count {epochs[-1]}", flush=True)
        key = None
        try:
            if client is None:
                client = connect(sock, timeout=10)
            roll = rng.random()
            if roll < 0.55:
                pool = keys or [a["key"] for a in client.list_artifacts()]
                if pool:
                    key = rng.choice(pool)
                    with client.acquire(key) as lease:
                        if not bool((lease.tensors["w"] == float(_number(lease))).all()):
                            _finding(counts, f"bytes of {key} are not its model's")
                    counts["acquired"] += 1
            elif roll < 0.9:
                n = rng.randrange(1000, 10**6)
                published = client.publish(ArtifactIdentity.simple(f"{prefix}-{n}"),
                                           {"w": torch.full((1 << 14,), float(n), dtype=torch.float32)},
                                           wait_timeout=5)
                if ack_file is not None:
                    ack_file.write(published + "\n")
                    ack_file.flush()
                counts["published"] += 1
            else:
                client.list_artifacts()
            counts["ops"] += 1
            epochs[-1] += 1
        except HwrError as exc:
            codes[exc.code] += 1
            if not isinstance(exc, EXPECTED) or (isinstance(exc, ArtifactNotFound) and key in protected):
                _finding(counts, f"unexpected {type(exc).__name__} ({exc.code}) on {key}: {exc}")
            else:
                counts["typed"] += 1
            if client is not None:
                client.close()
            client = None
            time.sleep(0.02)
        except Exception as exc:  # anything untyped is a finding
            _finding(counts, f"untyped {type(exc).__name__}: {exc}")
            time.sleep(0.02)
    if client is not None:
        client.close()
    if ack_file is not None:
        ack_file.close()
    print("result " + json.dumps({**counts, "epochs": epochs, "codes": dict(codes)}), flush=True)


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
        def listed(i: int) -> list[str]:
            return [k for k in argv[i].split(",") if k] if len(argv) > i else []

        churn(sock, seed, argv[3], listed(4), set(listed(5)), argv[6] if len(argv) > 6 else None)
    elif mode == "hold":
        hold(sock, argv[3].split(","))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1:])
