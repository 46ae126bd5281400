"""Load test: N clients x a fixed number of operations against one real hwrd; ops/s, latency
percentiles, and a check that the end state is clean (no lease, publication, staging file or
descriptor left behind).

    .venv/bin/python benchmarks/load.py                       # 16 clients x 200 ops
    .venv/bin/python benchmarks/load.py --clients 64 --ops 500 --processes 8
    .venv/bin/python benchmarks/load.py --quick               # 4 clients x 50 ops (CI smoke)

Clients are sessions (each its own ``hwr.client.Client``: its own peer connection and session
in the daemon, and a gRPC channel opened on its first publish or list: acquire and release go
over the peer connection), run as threads inside ``--processes`` worker processes: 64 processes
that each import torch cost about 200 MiB apiece (~13 GiB), which a 24 GiB, 2-core machine cannot
spare next to the daemon, and would measure the scheduler rather than hwrd. The daemon cannot tell
the difference: every session has its own sockets. Operations (``--mix``, weights): ``acquire``
(lease a random pre-published artifact, read one byte of every page, release: timed as one
acquire and one release), ``publish`` (a new small artifact), ``list``. Prints a markdown table,
then one JSON line (``benchmarks.common.json_line``). ``benchmarks/churn.py`` is this engine with
publications under eviction pressure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    fmt_ms,
    freeze_startup_heap,
    histogram_window,
    hwrd,
    json_line,
    md_table,
    scrape_metrics,
    short_tmpdir,
    summarize,
    wait_until,
)

ELEMENTS = 1 << 14  # float32 elements per artifact (64 KiB)
OPS = ("acquire", "release", "publish", "list")


# ------------------------------------------------------------------------------ worker process
def _client_loop(sock: str, seed: int, ops: int, keys: list[str], mix: dict[str, float], prefix: str,
                 out: dict[str, Any], go: threading.Event, interval: float = 0.0) -> None:
    """One client's operations. ``interval`` 0: closed loop (the next operation starts when the
    last ended). ``interval`` > 0: open loop, one operation per ``interval`` seconds on a fixed
    schedule (an acquire/release cycle takes two slots); latency then counts from the operation's
    scheduled start, so a client that falls behind reports the wait too (no coordinated omission)."""
    import torch

    from hwr.client import ArtifactIdentity, connect
    from hwr.client.errors import HwrError

    rng = random.Random(seed)
    names, weights = zip(*mix.items(), strict=True)
    latencies: dict[str, list[float]] = {op: [] for op in OPS}
    errors: dict[str, int] = {}
    client = connect(sock, timeout=60)
    go.wait()
    done = 0
    # Open loop: a random phase spreads the clients' schedules over one interval.
    slot = time.perf_counter() + rng.random() * interval
    while done < ops:
        op = rng.choices(names, weights)[0]
        if interval:
            wait_until(slot, time.perf_counter)
        try:
            if op == "acquire":
                t0 = slot if interval else time.perf_counter()
                slot += 2 * interval
                lease = client.acquire(rng.choice(keys))
                t1 = time.perf_counter()
                w = lease.tensors["w"]
                _ = float(w[:: 1024].sum())  # one element per 4 KiB page
                t2 = time.perf_counter()
                lease.close()
                t3 = time.perf_counter()
                latencies["acquire"].append((t1 - t0) * 1e3)
                latencies["release"].append((t3 - t2) * 1e3)
                done += 2
                continue
            t0 = slot if interval else time.perf_counter()
            slot += interval
            if op == "publish":
                n = rng.randrange(1 << 40)
                client.publish(ArtifactIdentity.simple(f"{prefix}-{n}"),
                               {"w": torch.full((ELEMENTS,), float(n % 1000), dtype=torch.float32)}, wait_timeout=60)
            else:
                client.list_artifacts()
            latencies[op].append((time.perf_counter() - t0) * 1e3)
        except HwrError as exc:
            errors[exc.code] = errors.get(exc.code, 0) + 1
        done += 1
    client.close()
    out["latencies"] = latencies
    out["errors"] = errors


def worker(sock: str, seed: int, sessions: int, ops: int, keys: list[str], mix: dict[str, float],
           interval: float = 0.0) -> None:
    go = threading.Event()
    outs: list[dict[str, Any]] = [{} for _ in range(sessions)]
    threads = [threading.Thread(target=_client_loop, args=(sock, seed * 1000 + i, ops, keys, mix,
                                                           f"load-{seed}-{i}", outs[i], go, interval))
               for i in range(sessions)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # sessions connect before the barrier
    freeze_startup_heap()  # as a vLLM worker does after start-up (see the function)
    print("ready", flush=True)
    sys.stdin.readline()
    started = time.perf_counter()
    go.set()
    for t in threads:
        t.join()
    merged: dict[str, list[float]] = {op: [] for op in OPS}
    errors: dict[str, int] = {}
    for out in outs:
        for op, values in out.get("latencies", {}).items():
            merged[op] += values
        for code, n in out.get("errors", {}).items():
            errors[code] = errors.get(code, 0) + n
    print(json.dumps({"latencies": merged, "errors": errors, "seconds": time.perf_counter() - started,
                      "rss_kib": _rss_kib()}), flush=True)


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


# ------------------------------------------------------------------------------ driver
def end_state(daemon: Any, baseline_fds: int, *, ignore_pid: int | None = None) -> dict[str, Any]:
    """Wait (up to 30 s) until no lease (except ``ignore_pid``'s), publication, staging file or
    extra daemon descriptor is left, then report what is left and whether that is nothing."""
    from hwr.client import connect

    root = Path(daemon.root)
    deadline = time.monotonic() + 30
    while True:
        with connect(daemon.socket) as client:
            status = client.status()
            leases = [x for x in client.leases() if x["pid"] != ignore_pid]
        staging = os.listdir(root / "tmp")
        fds = len(os.listdir(f"/proc/{daemon.pid}/fd"))
        clean = not leases and status["publications"] == 0 and not staging and fds <= baseline_fds
        if clean or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    store_fds = []
    for fd in os.listdir(f"/proc/{daemon.pid}/fd"):
        try:
            target = os.readlink(f"/proc/{daemon.pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith((str(root / "artifacts"), str(root / "tmp"))):
            store_fds.append(target)
    return {"leases_left": len(leases), "publications_left": status["publications"], "staging_left": len(staging),
            "daemon_fds": fds, "daemon_fds_baseline": baseline_fds, "store_fds_left": len(store_fds),
            "clean": clean and not store_fds}


def run(*, clients: int, ops: int, processes: int, mix: dict[str, float], base: int = 16,
        daemon_args: tuple[str, ...] = (), pin_base: bool = False, label: str = "load",
        rate: float = 0.0) -> dict[str, Any]:
    """Run the load; ``rate`` > 0 offers that many operations per second in all (open loop,
    spread evenly over the clients), 0 runs every client closed loop (capacity). hwrd serves
    its metrics on a Unix socket: the result's ``publication_phases_ms`` is its
    ``hwr_publication_phase_seconds`` histogram over the timed window (see ``histogram_window``)."""
    processes = max(1, min(processes, clients))
    per_process = [clients // processes + (1 if i < clients % processes else 0) for i in range(processes)]
    metrics_dir = short_tmpdir("hwm-")
    metrics = metrics_dir / "metrics.sock"
    try:
        with hwrd(None, *daemon_args, "--metrics-listen", f"unix:{metrics}") as daemon:
            results, wall, end, evictions, phases = _drive(daemon, metrics, ops, mix, base, pin_base, label,
                                                           clients / rate if rate else 0.0, per_process)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    latencies: dict[str, list[float]] = {op: [] for op in OPS}
    errors: dict[str, int] = {}
    for r in results:
        for op, values in r["latencies"].items():
            latencies[op] += values
        for code, n in r["errors"].items():
            errors[code] = errors.get(code, 0) + n
    every = [v for values in latencies.values() for v in values]
    total = len(every) + sum(errors.values())
    return {"clients": clients, "processes": processes, "ops_per_client": ops, "ops": total, "wall_s": wall,
            "offered_ops_per_s": rate or None,
            "ops_per_s": total / wall, "latency_ms": {op: summarize(v) for op, v in latencies.items() if v},
            "all_ms": summarize(every), "errors": errors, "evictions": evictions, "end_state": end,
            "publication_phases_ms": phases,
            "worker_rss_mib": max(r["rss_kib"] for r in results) / 1024}


def _drive(daemon: Any, metrics: Path, ops: int, mix: dict[str, float], base: int, pin_base: bool,
           label: str, interval: float, per_process: list[int]) -> tuple[list[dict[str, Any]], float,
                                                                        dict[str, Any], int, dict[str, Any]]:
    """Publish the base artifacts, run the worker processes, check the end state."""
    import torch

    from hwr.client import ArtifactIdentity, connect

    with connect(daemon.socket) as client:
        keys = [client.publish(ArtifactIdentity.simple(f"{label}-base-{i}"),
                               {"w": torch.full((ELEMENTS,), float(i))}) for i in range(base)]
        if pin_base:
            for key in keys:
                client.pin(key)
    baseline_fds = len(os.listdir(f"/proc/{daemon.pid}/fd"))
    cmd = [sys.executable, __file__, "--worker", str(daemon.socket), "--mix", json.dumps(mix),
           "--keys", ",".join(keys), "--ops", str(ops), "--interval", repr(interval)]
    procs = [subprocess.Popen([*cmd, "--seed", str(i + 1), "--sessions", str(n)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for i, n in enumerate(per_process)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready", "a worker failed to start"
    before = scrape_metrics(metrics)
    started = time.perf_counter()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    for p in procs:
        assert p.stdout is not None
        results.append(json.loads(p.stdout.readline()))
        p.wait(60)
    wall = time.perf_counter() - started
    phases = histogram_window(before, scrape_metrics(metrics), "hwr_publication_phase_seconds", "phase")
    end = end_state(daemon, baseline_fds, ignore_pid=os.getpid())
    with connect(daemon.socket) as client:
        evictions = client.store_usage()["evictions"]
    return results, wall, end, evictions, phases


def _pipeline_order(item: tuple[str, Any]) -> tuple[int, str]:
    from hwr.daemon.system.metrics import PUBLICATION_PHASES as order  # a publication's phases in turn

    return (order.index(item[0]) if item[0] in order else len(order), item[0])


def report(result: dict[str, Any], title: str) -> str:
    rows = [[op, s["n"], fmt_ms(s["p50"]), fmt_ms(s["p90"]), fmt_ms(s["p99"]), fmt_ms(s["max"])]
            for op, s in [*result["latency_ms"].items(), ("all", result["all_ms"])]]
    end = result["end_state"]
    pacing = (f", open loop at {result['offered_ops_per_s']:,.0f} ops/s offered (latency from each "
              f"operation's scheduled start)") if result.get("offered_ops_per_s") else ", closed loop"
    lines = [f"### {title}: {result['clients']} clients ({result['processes']} processes) x "
             f"{result['ops_per_client']} ops{pacing}", "",
             md_table(["operation", "n", "p50", "p90", "p99", "max"], rows), "",
             f"**{result['ops_per_s']:,.0f} ops/s** ({result['ops']} ops in {result['wall_s']:.1f} s); "
             f"typed errors: {result['errors'] or 'none'}; evictions: {result['evictions']}; "
             f"worker RSS {result['worker_rss_mib']:.0f} MiB each", "",
             md_table(["end state", "value"], [[k, v] for k, v in end.items()])]
    phases = result.get("publication_phases_ms")
    if phases:
        rows = [[phase, f"{row['n']:.0f}", fmt_ms(row["mean_ms"]), fmt_ms(row["p50_ms"]), fmt_ms(row["p90_ms"]),
                 fmt_ms(row["p99_ms"])] for phase, row in sorted(phases.items(), key=_pipeline_order)]
        lines += ["", f"#### {title}: where a publication's time goes inside hwrd (its "
                  "`hwr_publication_phase_seconds` histogram over the run; quantiles estimated from "
                  "the buckets, so coarse)", "",
                  md_table(["phase", "n", "mean", "p50", "p90", "p99"], rows)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--ops", type=int, default=200, help="operations per client")
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--mix", default='{"acquire": 0.8, "publish": 0.1, "list": 0.1}')
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json-out")
    # worker-process arguments
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--keys", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--sessions", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--interval", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.seed, args.sessions, args.ops, args.keys.split(","), json.loads(args.mix),
               args.interval)
        return 0
    if args.quick:
        args.clients, args.ops, args.processes = 4, 50, 2
    result = run(clients=args.clients, ops=args.ops, processes=args.processes, mix=json.loads(args.mix))
    print(report(result, "hwrd load"))
    json_line({"benchmark": "load", **result}, args.json_out)
    return 0 if result["end_state"]["clean"] else 1


if __name__ == "__main__":
    sys.exit(main())
