"""Churn: 64 clients x 500 acquire/release/publish operations under eviction pressure.

    .venv/bin/python benchmarks/churn.py              # 64 clients x 500 ops: closed loop, then paced
    .venv/bin/python benchmarks/churn.py --quick      # 8 clients x 60 ops, 2 processes

The engine is ``benchmarks/load.py`` (clients are sessions run as threads in a few worker
processes: see its docstring for why 64 torch-importing processes do not fit). Here the daemon
runs with a store limit that holds the 16 pinned base artifacts plus room for only 32 published
ones, and 40 % of the clients' choices publish a new artifact (25 % of operations: an acquire
choice is two operations, acquire and release), so most publications evict the least recently
used unpinned, unleased artifact first.

Two phases, each on a fresh daemon and store:

1. **capacity**, closed loop: every client starts its next operation when the last one ends;
   ops/s is the throughput. Its latency is mostly queueing: with N clients always in flight the
   mean latency is N / throughput (Little's law), so 64 closed-loop clients could only show a
   p99 under 10 ms above 6,400 ops/s.
2. **paced**, open loop at ``--rate-of-capacity`` (default 0.7) times the capacity just
   measured, or at ``--rate`` operations per second when given (spread evenly over the clients,
   latency counted from each operation's scheduled start): the latency a client sees when the
   node serves that rate. Relative to the capacity, the goal means the same on any machine.

``--sweep 0.3,0.5,0.9`` adds paced phases at those fractions of the capacity (latency under
load, one table; ``--png`` plots it, with the matplotlib of the ``bench`` extra).

Goals: capacity >= 1,000 ops/s (a 2-core node's target); paced at 70 % of the capacity measured
in the same run, the node keeps up (>= 98 % of the offered rate served) with p99 < 10 ms over
all operations. At the end of each phase it proves that nothing leaked: no lease, no
publication, no staging file in ``tmp/``, no descriptor of the daemon into the store, and the
daemon's descriptor count back at its baseline (``/proc/<daemon pid>/fd``). Prints markdown
tables, then one JSON line; exits 1 when an end state is not clean.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import fmt_ms, json_line, md_table
from benchmarks.load import ELEMENTS, report, run

BASE = 16
ROOM = 32  # published artifacts that fit besides the pinned base: the rest evicts
ARTIFACT_BYTES = ELEMENTS * 4 + 136


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--ops", type=int, default=500, help="operations per client")
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--rate", type=float, default=None,
                   help="ops/s offered in the paced phase (0: skip it; default: --rate-of-capacity)")
    p.add_argument("--rate-of-capacity", type=float, default=0.7,
                   help="paced phase offers this fraction of the capacity measured first (default 0.7)")
    p.add_argument("--sweep", default="", help="extra paced phases at these fractions of the capacity, e.g. 0.3,0.9")
    p.add_argument("--png", help="plot the latency of every paced phase against the offered load here")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    if args.quick:
        args.clients, args.ops, args.processes = 8, 60, 2
    limit = (BASE + ROOM) * ARTIFACT_BYTES
    common = {"clients": args.clients, "ops": args.ops, "processes": args.processes,
              "mix": {"acquire": 0.6, "publish": 0.4}, "base": BASE, "pin_base": True, "label": "churn",
              "daemon_args": ("--store-limit-bytes", str(limit))}
    capacity = run(**common)
    print(report(capacity, "hwrd churn under eviction pressure, capacity"))
    rate = args.rate if args.rate is not None else round(args.rate_of_capacity * capacity["ops_per_s"])
    paced = None
    if rate > 0:
        paced = run(**common, rate=rate)
        print()
        print(report(paced, "hwrd churn under eviction pressure, paced"))
    served = paced["ops_per_s"] / rate if paced else 0.0
    of_capacity = rate / capacity["ops_per_s"] if capacity["ops_per_s"] else 0.0
    goal = {"capacity_goal_ops_per_s": 1000, "p99_ms": 10.0, "served_fraction": 0.98,
            "capacity_ops_per_s": capacity["ops_per_s"], "capacity_met": capacity["ops_per_s"] >= 1000,
            "paced_offered_ops_per_s": rate if paced else None, "paced_of_capacity": of_capacity if paced else None,
            "paced_served_fraction": served if paced else None,
            "paced_p99_ms": paced["all_ms"]["p99"] if paced else None}
    goal["paced_met"] = bool(paced) and served >= 0.98 and paced["all_ms"]["p99"] < 10.0
    goal["met"] = goal["capacity_met"] and goal["paced_met"]
    print(f"\ngoal capacity (closed loop) >= 1,000 ops/s: {'met' if goal['capacity_met'] else 'NOT met'} "
          f"({capacity['ops_per_s']:,.0f} ops/s)")
    if paced:
        print(f"goal paced at {of_capacity:.0%} of the measured capacity ({rate:,.0f} ops/s offered): >= 98 % "
              f"served with p99 < 10 ms: {'met' if goal['paced_met'] else 'NOT met'} "
              f"({paced['ops_per_s']:,.0f} ops/s served = {served:.1%}, p99 {paced['all_ms']['p99']:.1f} ms)")
    sweep = [{"of_capacity": of_capacity, **paced}] if paced else []
    for fraction in (float(f) for f in args.sweep.split(",") if f.strip()):
        r = run(**common, rate=round(fraction * capacity["ops_per_s"]))
        sweep.append({"of_capacity": fraction, **r})
    sweep.sort(key=lambda r: r["of_capacity"])
    if len(sweep) > 1:
        print_sweep(sweep, capacity)
        if args.png:
            plot_sweep(sweep, capacity, Path(args.png))
    clean = all(r["end_state"]["clean"] for r in (capacity, *sweep))
    json_line({"benchmark": "churn", "store_limit_bytes": limit, **capacity, "paced": paced, "goal": goal,
               "sweep": [{k: v for k, v in r.items() if k != "publication_phases_ms"} for r in sweep]},
              args.json_out)
    return 0 if clean else 1


def print_sweep(sweep: list[dict[str, Any]], capacity: dict[str, Any]) -> None:
    print(f"\n## Latency under load: paced at fractions of the measured capacity "
          f"({capacity['ops_per_s']:,.0f} ops/s closed loop)\n")
    rows = []
    for r in [*sweep, {"of_capacity": None, **capacity}]:
        lat = r["latency_ms"]
        rows.append(["closed loop" if r["of_capacity"] is None else f"{r['of_capacity']:.0%}",
                     f"{r['offered_ops_per_s']:,.0f}" if r.get("offered_ops_per_s") else "-",
                     f"{r['ops_per_s']:,.0f}", *(fmt_ms(lat.get(op, {}).get(q)) for op, q in
                                                  (("acquire", "p50"), ("acquire", "p99"), ("publish", "p50"),
                                                   ("publish", "p99"))),
                     fmt_ms(r["all_ms"]["p50"]), fmt_ms(r["all_ms"]["p99"])])
    print(md_table(["offered (of capacity)", "offered ops/s", "served ops/s", "acquire p50", "acquire p99",
                    "publish p50", "publish p99", "all p50", "all p99"], rows))


def plot_sweep(sweep: list[dict[str, Any]], capacity: dict[str, Any], png: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # the plot needs the `bench` extra; the tables and JSON do not
        print(f"matplotlib is not installed (pip install -e '.[bench]'): no plot written to {png}", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4), dpi=90)
    xs = [r["offered_ops_per_s"] for r in sweep]
    for op, style in (("acquire", "o-"), ("release", "s-"), ("publish", "^-")):
        if all(op in r["latency_ms"] for r in sweep):
            ax.plot(xs, [r["latency_ms"][op]["p99"] for r in sweep], style, label=f"{op} p99")
    ax.plot(xs, [r["all_ms"]["p50"] for r in sweep], "k--", label="all p50")
    ax.axvline(capacity["ops_per_s"], color="grey", linestyle=":", linewidth=1, label="capacity (closed loop)")
    ax.axhline(10.0, color="red", linestyle=":", linewidth=1, label="10 ms")
    ax.set_yscale("log")
    ax.set_xlabel("offered ops/s (open loop)")
    ax.set_ylabel("latency, ms")
    ax.set_title(f"churn under eviction, {capacity['clients']} clients, {os.cpu_count()} CPUs", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    print(f"\nplot: {png}")


if __name__ == "__main__":
    sys.exit(main())
