"""SIGKILL of the daemon, and of clients, at random points under client load (seeded).

Quick size (CI): ``pytest tests/faults/test_daemon_kill.py`` runs 6 daemon kills and 8 client
kills. Long size (20 daemon kills; more for soak)::

    HWR_FAULT_ROUNDS=20 HWR_FAULT_SEED=1 .venv/bin/python -m pytest tests/faults/test_daemon_kill.py -q

``HWR_FAULT_ROUNDS`` sets both round counts; ``HWR_FAULT_SEED`` the seed (printed on failure).

Daemon kills: one hwrd lineage under a store limit small enough that publications evict; two
churn workers (acquire + check bytes, publish, list) and one holder that leases two artifacts for
the whole test. At a seeded random moment the daemon is SIGKILLed. Before the restart the disk is
checked as the crash left it: every ``artifacts/`` entry complete and matching its manifest (no
partial artifact), ``deny/`` empty (no good artifact quarantined), and every publication a churner
saw acknowledged still there unless the daemon's log says it retired it (an eviction, logged
before its rename). After the restart a ``gc`` to zero runs *before* the holder can reattach (the
lease journal and the mappings scan must protect its artifacts), then the holder checks every
byte, and each churner starts a new epoch of counts. At the end every churner must have completed
operations after the last restart, no churner may have met an unexpected (typed or untyped) error
or wrong bytes, and the full invariants run (``faultkit.check_invariants``).

The client processes (holder, churners, each killed client's replacement) are forked from a
tests' shared zygote (``tests/zygote.py``): processes of their own to hwrd, without an
interpreter start and a torch import each.
"""

from __future__ import annotations

import os
import random
import re
import time
from pathlib import Path

import pytest

from hwr.client import connect

from .faultkit import Outcome, Worker, check_invariants, check_on_disk, fd_count, publish, wait_for

ROUNDS = int(os.environ.get("HWR_FAULT_ROUNDS", "0"))
SEED = int(os.environ.get("HWR_FAULT_SEED", "20240611"))
ART = (1 << 18) + 136
RETIRED = re.compile(r"retiring artifact ([0-9a-f]{64})")


def acknowledged(files: list[Path]) -> set[str]:
    """Keys the churners' publications returned (whole lines only: one may be mid-write)."""
    keys: set[str] = set()
    for path in files:
        if path.exists():
            keys |= {line for line in path.read_text().split("\n")[:-1] if line}
    return keys


def retired(log: Path) -> set[str]:
    """Keys the daemon logged as retiring (evicted or removed on purpose), over all its lives."""
    return set(RETIRED.findall(log.read_text(errors="replace")))


@pytest.mark.usefixtures("daemon_user")  # root and the unit's unprivileged user
def test_sigkill_of_the_daemon_under_load_loses_nothing(forked_workers: None, spawn, fault_tmp: Path,
                                                        outcome: Outcome) -> None:
    outcome.kind = "daemon SIGKILL under load (held artifacts and acknowledged publications)"
    rounds = ROUNDS or 6
    rng = random.Random(SEED)
    daemon = spawn("--store-limit-bytes", str(12 * ART), "--housekeeping-interval-s", "0.5",
                   "--log-level", "debug")  # debug: the "retiring artifact" lines
    root = Path(daemon.root)
    with connect(daemon.socket) as client:
        base = [publish(client, f"m-{n}", n) for n in range(4)]
    held = base[:2]
    holder = Worker("hold", str(daemon.socket), "0", ",".join(held), forked=True)
    holder.expect("held")
    acks = [fault_tmp / f"acks-{i}" for i in range(2)]
    churners = [Worker("churn", str(daemon.socket), str(SEED + i), f"c{i}", ",".join(base), ",".join(held),
                       str(acks[i]), forked=True) for i in range(2)]
    for w in churners:
        w.expect("ready")
    try:
        for round_no in range(rounds):
            time.sleep(rng.uniform(0.1, 1.5))
            daemon.kill()
            outcome.tried += 1
            where = f"round {round_no} (seed {SEED})"
            # The crash state itself: nothing partial in artifacts/, whatever step was running,
            # no good artifact denied, no acknowledged publication gone without an eviction.
            on_disk = set(check_on_disk(root))
            denied = os.listdir(root / "deny")
            outcome.lost += len(denied)  # no longer served: lost to the clients
            assert denied == [], f"{where}: good artifacts were denied: {denied}"
            acked = acknowledged(acks)
            missing = acked - on_disk - retired(daemon.log)
            outcome.lost += len(missing)
            assert not missing, f"{where}: acknowledged publications are gone after the kill: {sorted(missing)}"
            daemon = spawn(daemon=daemon)
            with connect(daemon.socket) as client:
                evicted = set(held) & set(client.gc(0)["evicted"])
                outcome.lost += len(evicted)
                assert not evicted, f"{where}: held artifacts were evicted after a restart: {evicted}"
            holder.send("check")
            try:
                holder.expect("ok")
            except AssertionError:
                outcome.lost += len(held)  # the holder found changed bytes (or died)
                raise
            for w in churners:
                w.send("mark")
                w.expect("marked")
        # Let the holder reattach (background watcher); each churner must get work done against
        # the last daemon (reconnected after the kill, not just counting work from before it).
        with connect(daemon.socket) as client:
            wait_for(lambda: {x["key"] for x in client.leases() if x["pid"] == holder.pid} == set(held),
                     30, "the holder to reattach its leases")

        def progressed(w: Worker) -> bool:
            w.send("count")
            return int(w.expect("count")) > 0

        wait_for(lambda: all(progressed(w) for w in churners), 30, "every churner to work after the last restart")
        results = [w.stop() for w in churners]
        assert sum(r["bad"] for r in results) == 0, (results, [w.stderr() for w in churners])
        assert all(r["epochs"][-1] > 0 for r in results), results
        assert sum(r["published"] for r in results) > 0 and acknowledged(acks), results
        check_invariants(daemon, held=held, live_pids=[holder.pid], outcome=outcome)
    finally:
        holder.kill()
        for w in churners:
            w.kill()


def test_sigkill_of_clients_mid_operation_leaks_nothing(forked_workers: None, spawn, fault_tmp: Path,
                                                        outcome: Outcome) -> None:
    outcome.kind = "client SIGKILL mid-operation"
    rounds = ROUNDS or 8
    rng = random.Random(SEED + 1)
    daemon = spawn("--store-limit-bytes", str(12 * ART))
    with connect(daemon.socket) as client:
        base = [publish(client, f"m-{n}", n) for n in range(3)]
    baseline_fds = fd_count(daemon.pid)
    workers = [Worker("churn", str(daemon.socket), str(SEED + i), f"k{i}", ",".join(base), forked=True)
               for i in range(2)]
    for w in workers:
        w.expect("ready")
    try:
        for i in range(rounds):
            time.sleep(rng.uniform(0.05, 0.8))
            victim = rng.randrange(len(workers))
            workers[victim].kill()
            outcome.tried += 1
            workers[victim] = Worker("churn", str(daemon.socket), str(SEED + 100 + i), f"k{i}x", ",".join(base),
                                     forked=True)
            workers[victim].expect("ready")
        results = [w.stop() for w in workers]
        assert sum(r["bad"] for r in results) == 0, (results, [w.stderr() for w in workers])
        check_invariants(daemon, held=base, outcome=outcome)
        with connect(daemon.socket) as client:
            assert client.leases() == [] and client.status()["sessions"] == 1
        wait_for(lambda: fd_count(daemon.pid) <= baseline_fds + 2, 10,
                 f"the daemon's descriptors to return to {baseline_fds} (now {fd_count(daemon.pid)})")
    finally:
        for w in workers:
            w.kill()
