"""Churn: 64 clients x 500 acquire/release/publish operations under eviction pressure (issue 6).

    .venv/bin/python benchmarks/churn.py              # 64 clients x 500 ops, 8 worker processes
    .venv/bin/python benchmarks/churn.py --quick      # 8 clients x 60 ops, 2 processes

The engine is ``benchmarks/load.py`` (clients are sessions run as threads in a few worker
processes: see its docstring for why 64 torch-importing processes do not fit). Here the daemon
runs with a store limit that holds the 16 pinned base artifacts plus room for only 32 published
ones, and 40 % of operations publish a new artifact, so most publications evict the least
recently used unpinned, unleased artifact first. Goal (issue 6): >= 1,000 ops/s and p99 < 10 ms on
2 cores. At the end it proves that nothing leaked: no lease, no publication, no staging file in
``tmp/``, no descriptor of the daemon into the store, and the daemon's descriptor count back at
its baseline (``/proc/<daemon pid>/fd``). Prints a markdown table, then one JSON line; exits 1
when the end state is not clean.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import json_line
from benchmarks.load import ELEMENTS, report, run

BASE = 16
ROOM = 32  # published artifacts that fit besides the pinned base: the rest evicts
ARTIFACT_BYTES = ELEMENTS * 4 + 136


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--ops", type=int, default=500, help="operations per client")
    p.add_argument("--processes", type=int, default=8)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    if args.quick:
        args.clients, args.ops, args.processes = 8, 60, 2
    limit = (BASE + ROOM) * ARTIFACT_BYTES
    result = run(clients=args.clients, ops=args.ops, processes=args.processes,
                 mix={"acquire": 0.6, "publish": 0.4}, base=BASE, pin_base=True, label="churn",
                 daemon_args=("--store-limit-bytes", str(limit)))
    result["goal"] = {"ops_per_s": 1000, "p99_ms": 10.0,
                      "met": result["ops_per_s"] >= 1000 and result["all_ms"]["p99"] < 10.0}
    print(report(result, "hwrd churn under eviction pressure"))
    print(f"\ngoal >= 1,000 ops/s and p99 < 10 ms: {'met' if result['goal']['met'] else 'NOT met'}")
    json_line({"benchmark": "churn", "store_limit_bytes": limit, **result}, args.json_out)
    return 0 if result["end_state"]["clean"] else 1


if __name__ == "__main__":
    sys.exit(main())
