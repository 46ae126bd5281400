"""Soak: mixed concurrent load against one hwrd under eviction pressure, then invariants.

    .venv/bin/python benchmarks/soak.py                 # 60 s
    .venv/bin/python benchmarks/soak.py --seconds 600   # longer
    .venv/bin/python benchmarks/soak.py --quick         # 8 s (CI smoke)

Not a speed benchmark: it looks for races. One daemon with a store limit that holds only a few
of the artifacts, and at the same time:

- ``republish`` clients (own sessions) publish and acquire the same few identities, so each
  key is evicted and published again all the time; every lease's bytes are checked;
- ``fresh`` clients publish new identities and acquire the newest ones (mostly being evicted);
- a ``shared`` Client used by several threads at once (publications of the same identities
  from two threads of one client, leases, releases);
- an ``operator`` pins, unpins, verifies, evicts by hand, collects garbage and lists.

Each of these once found a bug (an eviction mistaken for corruption and denied, a
stale record cached over a re-published one, a pin left behind for an evicted artifact, a
client's own publications stalling each other). At the end it checks: no deny marker and no
quarantined artifact (nothing here corrupts anything); no lease, publication or staging file
left and the daemon's descriptors back at their baseline (``benchmarks.load.end_state``); no
internal error or traceback in the daemon's log; every client error of an expected kind (a
miss, a full store, a leased or pinned artifact); every lease's bytes as published. Prints a
table and one JSON line; exits 1 when an invariant does not hold.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import hwrd, json_line, md_table
from benchmarks.load import end_state

ELEMENTS = 1 << 12  # float32 elements per artifact (16 KiB)
ARTIFACT_BYTES = ELEMENTS * 4 + 136
ROOM = 6  # artifacts that fit under the store limit
IDENTITIES = 10  # the republished set (more than fit)
#: Client errors that are the system working as documented under this load.
EXPECTED = {"LOCAL_MISS", "STORE_LIMIT_EXCEEDED", "INSUFFICIENT_CAPACITY", "ACTIVE_LEASE",
            "ACTIVE_BUILD_TIMEOUT"}


class Tally:
    def __init__(self) -> None:
        self.ok: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[tuple[str, str]] = collections.Counter()
        self.unexpected: list[str] = []
        self.lock = threading.Lock()

    def run(self, op: str, fn: Any) -> Any:
        from hwr.client.errors import HwrError

        try:
            result = fn()
        except HwrError as exc:
            with self.lock:
                self.errors[(op, exc.code)] += 1
                if exc.code not in EXPECTED:
                    self.unexpected.append(f"{op}: {exc.code}: {exc.message[:120]}")
            return None
        except Exception as exc:  # anything untyped is a finding
            with self.lock:
                self.errors[(op, type(exc).__name__)] += 1
                self.unexpected.append(f"{op}: {type(exc).__name__}: {str(exc)[:120]}")
            return None
        with self.lock:
            self.ok[op] += 1
        return result


def _value(identity_index: int) -> float:
    return float(identity_index + 1)


def _check_lease(tally: Tally, lease: Any, expected: float, op: str) -> None:
    got = float(lease.tensors["w"][ELEMENTS - 1])
    if got != expected:
        with tally.lock:
            tally.unexpected.append(f"{op}: read {got}, published {expected}")


def _republish_loop(client: Any, rng: random.Random, stop: float, tally: Tally, prefix: str) -> None:
    import torch

    from hwr.client import ArtifactIdentity

    while time.monotonic() < stop:
        n = rng.randrange(IDENTITIES)
        identity = ArtifactIdentity.simple(f"{prefix}-{n}")
        if rng.random() < 0.5:
            tally.run("publish", lambda identity=identity, n=n: client.publish(
                identity, {"w": torch.full((ELEMENTS,), _value(n))}, wait_timeout=10))
        else:
            def acquire(identity: Any = identity, n: int = n) -> None:
                with client.acquire(identity) as lease:
                    _check_lease(tally, lease, _value(n), "acquire")
            tally.run("acquire", acquire)


def _fresh_loop(client: Any, rng: random.Random, stop: float, tally: Tally, seed: int, keys: list[str]) -> None:
    import torch

    from hwr.client import ArtifactIdentity

    n = 0
    while time.monotonic() < stop:
        for key in keys[-4:]:
            def acquire(key: str = key) -> None:
                with client.acquire(key) as lease:
                    if float(lease.tensors["w"][0]) < 0:
                        raise AssertionError("negative value")
            tally.run("acquire_fresh", acquire)
        n += 1
        key = tally.run("publish_fresh", lambda n=n: client.publish(
            ArtifactIdentity.simple(f"fresh-{seed}-{n}"), {"w": torch.full((ELEMENTS,), float(n))}, wait_timeout=10))
        if key is not None:
            keys.append(key)


def _operator_loop(client: Any, rng: random.Random, stop: float, tally: Tally, keys: list[str]) -> None:
    from hwr.client import ArtifactIdentity

    while time.monotonic() < stop:
        key = rng.choice([*keys[-6:], ArtifactIdentity.simple(f"own-{rng.randrange(IDENTITIES)}").key])
        op = rng.choice(["pin", "unpin", "verify", "evict", "gc", "ls", "usage"])
        if op in ("pin", "unpin", "verify", "evict"):
            tally.run(op, functools.partial(getattr(client, op), key))
        else:
            tally.run(op, {"gc": client.gc, "ls": client.list_artifacts, "usage": client.store_usage}[op])
        time.sleep(0.005)


def _count_entries(path: Path) -> int:
    try:
        return len(os.listdir(path))
    except FileNotFoundError:
        return 0


def run(seconds: float, clients: int) -> dict[str, Any]:
    from hwr.client import connect

    tally = Tally()
    limit = ROOM * ARTIFACT_BYTES
    with hwrd(None, "--store-limit-bytes", str(limit)) as daemon:
        baseline_fds = len(os.listdir(f"/proc/{daemon.pid}/fd"))
        stop = time.monotonic() + seconds
        fresh_keys: list[str] = []
        sessions: list[Any] = []
        threads: list[threading.Thread] = []

        def start(target: Any, *args: Any) -> None:
            threads.append(threading.Thread(target=target, args=args, daemon=True))

        for i in range(clients):
            own = connect(daemon.socket, timeout=60)
            sessions.append(own)
            start(_republish_loop, own, random.Random(i), stop, tally, "own")
        for i in range(2):
            own = connect(daemon.socket, timeout=60)
            sessions.append(own)
            start(_fresh_loop, own, random.Random(100 + i), stop, tally, i, fresh_keys)
        shared = connect(daemon.socket, timeout=60)
        sessions.append(shared)
        for i in range(3):
            start(_republish_loop, shared, random.Random(200 + i), stop, tally, "own")
        operator = connect(daemon.socket, timeout=60)
        sessions.append(operator)
        start(_operator_loop, operator, random.Random(300), stop, tally, fresh_keys)
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 120)
        hung = sum(t.is_alive() for t in threads)
        with connect(daemon.socket, timeout=60) as admin:
            for key in admin.store_usage()["artifacts"]:
                if key.get("pinned"):
                    tally.run("unpin", lambda key=key: admin.unpin(key["key"]))
        for session in sessions:
            session.close()
        with connect(daemon.socket, timeout=60) as admin:
            usage = admin.store_usage()
        left = end_state(daemon, baseline_fds)  # leases, publications, staging, descriptors
        log = daemon.log.read_text(errors="replace")
        state = {
            **{k: v for k, v in left.items() if k != "clean"},
            "deny_markers": _count_entries(daemon.root / "deny"),
            "quarantined": _count_entries(daemon.root / "quarantine"),
            "internal_errors_logged": log.count("internal error") + log.count("Traceback"),
            "threads_hung": hung,
            "unexpected_client_errors": len(tally.unexpected),
        }
    clean = (left["clean"] and not state["deny_markers"] and not state["quarantined"]
             and not state["internal_errors_logged"] and not hung and not tally.unexpected)
    return {"seconds": seconds, "clients": clients, "store_limit_bytes": limit, "ok": dict(tally.ok),
            "errors": {f"{op}:{code}": n for (op, code), n in sorted(tally.errors.items())},
            "unexpected": tally.unexpected[:20], "evictions": usage.get("evictions", 0),
            "end_state": state, "clean": clean}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--clients", type=int, default=4, help="republishing clients with their own sessions")
    p.add_argument("--quick", action="store_true", help="8 s")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds = 8.0
    result = run(args.seconds, args.clients)
    print(f"## hwrd soak: {args.seconds:.0f} s, {result['evictions']} evictions\n")
    rows = [[op, n] for op, n in sorted(result["ok"].items())]
    rows += [[f"{key} (error)", n] for key, n in result["errors"].items()]
    print(md_table(["operation", "count"], rows))
    print()
    print(md_table(["end state", "value"], [[k, v] for k, v in result["end_state"].items()]))
    for line in result["unexpected"]:
        print(f"UNEXPECTED {line}")
    print(f"\nsoak {'clean' if result['clean'] else 'NOT clean'}")
    json_line({"benchmark": "soak", **result}, args.json_out)
    return 0 if result["clean"] else 1


if __name__ == "__main__":
    sys.exit(main())
