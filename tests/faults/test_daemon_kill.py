"""SIGKILL of the daemon, and of clients, at random points under client load (seeded).

Quick size (CI): ``pytest tests/faults/test_daemon_kill.py`` runs 6 daemon kills and 8 client
kills. Long size (20 daemon kills; more for soak)::

    HWR_FAULT_ROUNDS=20 HWR_FAULT_SEED=1 .venv/bin/python -m pytest tests/faults/test_daemon_kill.py -q

``HWR_FAULT_ROUNDS`` sets both round counts; ``HWR_FAULT_SEED`` the seed (printed on failure).

Daemon kills: one hwrd lineage under a store limit small enough that publications evict; two
churn workers (acquire + check bytes, publish, list) and one holder that leases two artifacts for
the whole test. At a seeded random moment the daemon is SIGKILLed. Before the restart the disk is
checked as the crash left it (every ``artifacts/`` entry complete and matching its manifest: no
partial artifact). After the restart a ``gc`` to zero runs *before* the holder can reattach (the
lease journal and the mappings scan must protect its artifacts), then the holder checks every
byte, then the full invariants run (``faultkit.check_invariants``).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

from hwr.client import connect

from .faultkit import Worker, check_invariants, check_on_disk, fd_count, publish, tally, wait_for

ROUNDS = int(os.environ.get("HWR_FAULT_ROUNDS", "0"))
SEED = int(os.environ.get("HWR_FAULT_SEED", "20240611"))
ART = (1 << 18) + 136


def test_sigkill_of_the_daemon_under_load_loses_nothing(spawn, fault_tmp: Path) -> None:
    rounds = ROUNDS or 6
    rng = random.Random(SEED)
    daemon = spawn("--store-limit-bytes", str(12 * ART), "--housekeeping-interval-s", "0.5")
    with connect(daemon.socket) as client:
        base = [publish(client, f"m-{n}", n) for n in range(4)]
    holder = Worker("hold", str(daemon.socket), "0", ",".join(base[:2]))
    holder.expect("held")
    churners = [Worker("churn", str(daemon.socket), str(SEED + i), f"c{i}", ",".join(base)) for i in range(2)]
    for w in churners:
        w.expect("ready")
    kills = 0
    try:
        for round_no in range(rounds):
            time.sleep(rng.uniform(0.1, 1.5))
            daemon.kill()
            kills += 1
            # The crash state itself: nothing partial in artifacts/, whatever step was running.
            check_on_disk(Path(daemon.root))
            daemon = spawn(daemon=daemon)
            with connect(daemon.socket) as client:
                report = client.gc(0)
                assert not set(base[:2]) & set(report["evicted"]), (
                    f"round {round_no} (seed {SEED}): a held artifact was evicted after a restart")
            holder.send("check")
            assert holder.expect("ok").isdigit(), f"round {round_no} (seed {SEED}): holder bytes changed"
        # Let the holder reattach (background watcher), then the churners finish.
        with connect(daemon.socket) as client:
            wait_for(lambda: {x["key"] for x in client.leases() if x["pid"] == holder.pid} == set(base[:2]),
                     30, "the holder to reattach its leases")
        results = [w.stop() for w in churners]
        assert sum(r["bad"] for r in results) == 0, results
        assert sum(r["ops"] for r in results) > 0, results
        check_invariants(daemon, held=base[:2], live_pids=[holder.pid])
    finally:
        holder.kill()
        for w in churners:
            w.kill()
    tally("daemon SIGKILL under load", tried=kills)


def test_sigkill_of_clients_mid_operation_leaks_nothing(spawn, fault_tmp: Path) -> None:
    rounds = ROUNDS or 8
    rng = random.Random(SEED + 1)
    daemon = spawn("--store-limit-bytes", str(12 * ART))
    with connect(daemon.socket) as client:
        base = [publish(client, f"m-{n}", n) for n in range(3)]
    baseline_fds = fd_count(daemon.pid)
    workers = [Worker("churn", str(daemon.socket), str(SEED + i), f"k{i}", ",".join(base)) for i in range(2)]
    for w in workers:
        w.expect("ready")
    killed = 0
    try:
        for i in range(rounds):
            time.sleep(rng.uniform(0.05, 0.8))
            victim = rng.randrange(len(workers))
            workers[victim].kill()
            killed += 1
            workers[victim] = Worker("churn", str(daemon.socket), str(SEED + 100 + i), f"k{i}x", ",".join(base))
            workers[victim].expect("ready")
        results = [w.stop() for w in workers]
        assert sum(r["bad"] for r in results) == 0, results
        check_invariants(daemon, held=base)
        with connect(daemon.socket) as client:
            assert client.leases() == [] and client.status()["sessions"] == 1
        wait_for(lambda: fd_count(daemon.pid) <= baseline_fds + 2, 10,
                 f"the daemon's descriptors to return to {baseline_fds} (now {fd_count(daemon.pid)})")
    finally:
        for w in workers:
            w.kill()
    tally("client SIGKILL mid-operation", tried=killed)
