"""The machine's idle penalty: how much slower memory is right after a thread slept.

    .venv/bin/python benchmarks/idle_penalty.py          # 64 MiB, sleeps 0 / 1 / 10 / 100 / 500 ms

Why it exists: paced latency benchmarks (``warm_start.py``'s paced phase, ``churn.py --rate``)
sleep between operations, and on some virtual machines every page a thread touches after an
idle gap costs far more than when it ran back to back (the host reclaims or re-maps guest
memory behind idle vCPUs). A request that touches a few hundred pages of interpreter, library
and heap memory then pays milliseconds that neither the daemon nor the client can remove. This
measures it directly: touch one byte of every 4 KiB page of an anonymous buffer and of a file
mapping (already resident), back to back and after each sleep, and compare with a loop of pure
Python arithmetic over a tiny working set. Prints a markdown table, then one JSON line.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import json_line, md_table

PAGE = 4096


def _arith() -> int:
    total = 0
    for i in range(20000):
        total += i * i
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--sleeps-ms", default="0,1,10,100,500")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    size = args.mib << 20
    anon = bytearray(size)
    view = memoryview(anon)
    for off in range(0, size, PAGE):  # resident before anything is timed
        view[off] = 1
    with tempfile.NamedTemporaryFile(dir=Path.home()) as f:
        f.write(b"\1" * size)
        f.flush()
        fmap = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        fview = memoryview(fmap)

        def touch_anon() -> int:
            return sum(view[off] for off in range(0, size, PAGE))

        def touch_file() -> int:
            return sum(fview[off] for off in range(0, size, PAGE))

        touch_file()
        workloads = {"touch anon (1 byte/page)": touch_anon, "touch file map (1 byte/page)": touch_file,
                     "pure Python arithmetic": _arith}
        results: dict[str, dict[str, float]] = {}
        for sleep_ms in (float(x) for x in args.sleeps_ms.split(",")):
            for name, fn in workloads.items():
                times = []
                for _ in range(args.repeats):
                    if sleep_ms:
                        time.sleep(sleep_ms / 1e3)
                    t0 = time.perf_counter()
                    fn()
                    times.append((time.perf_counter() - t0) * 1e3)
                results.setdefault(name, {})[f"{sleep_ms:g}"] = statistics.median(times)
        fview.release()
        fmap.close()
    sleeps = [f"{float(x):g}" for x in args.sleeps_ms.split(",")]
    rows = [[name, *(f"{by[s]:.2f} ms" for s in sleeps), f"{by[sleeps[-1]] / by[sleeps[0]]:.1f}x"]
            for name, by in results.items()]
    print(f"### Idle penalty: median of {args.repeats} runs per cell, {args.mib} MiB, {os.cpu_count()} CPUs\n")
    print(md_table(["workload", *(f"after {s} ms sleep" for s in sleeps), "slowdown (longest sleep)"], rows))
    json_line({"benchmark": "idle_penalty", "mib": args.mib, "median_ms": results}, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
