"""Warm start and weight memory with 1, 2, 4 and 8 concurrent workers on one artifact.

For each N and each way of getting the weights, N fresh worker processes import torch,
safetensors and hwr, meet at a barrier, then all at once get every tensor of the same bf16
artifact and read one byte of every 4 KiB page ("time to usable" per worker, from the barrier):

- ``hwrd``: ``connect()`` + ``acquire(key)``: read-only views of one shared copy;
- ``load_file copy``: ``safetensors.torch.load_file(p, backend="pread")``: a private copy each;
- ``safe_open``: ``safe_open`` + ``get_tensor``: mmap views of the page cache (shared, but only
  for the canonical file as it is on disk: no final layout, no cast).

While every worker still holds its tensors, the parent reads each worker's PSS
(``/proc/PID/smaps_rollup``); the aggregate *weight* PSS is the sum of (PSS after - PSS at the
barrier), as ``hwr/demo.py`` separates weights from the interpreter. Limit: the page-cache copy
of the file itself is in nobody's PSS unless mapped; it exists once per node for every mode.

    .venv/bin/python benchmarks/scaling.py [--size-mib 256] [--workers 1,2,4,8] [--png scaling.png] [--json-out F]

Prints a markdown table (ratios against one copy of the artifact and against hwrd), writes the
PNG (needs matplotlib, the ``bench`` extra) and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

THIS = str(Path(__file__).resolve())
MiB = 1 << 20
MODES = {"hwrd": "hwrd lease", "copy": "load_file copy (pread)", "safe_open": "safe_open (page cache)"}


# --- worker (a fresh process) -----------------------------------------------------------------
def worker(spec: dict[str, Any]) -> None:
    from peers import preimport_hwr
    from safetensors import safe_open
    from safetensors.torch import load_file

    import hwr.client as hc

    preimport_hwr()  # like every mode's imports: before the barrier
    print("armed", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    t0 = time.perf_counter()
    keep: list[Any] = []
    if spec["mode"] == "hwrd":
        client = hc.connect(spec["socket"])
        lease = client.acquire(spec["key"])
        tensors = lease.tensors
        keep += [client, lease]
    elif spec["mode"] == "copy":
        tensors = load_file(spec["path"], backend="pread")
    else:
        handle = safe_open(spec["path"], framework="pt")
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 - not a dict
        keep.append(handle)
    t1 = time.perf_counter()
    checksum = common.touch_pages(tensors)
    t2 = time.perf_counter()
    print("READY " + json.dumps({"usable_ms": (t1 - t0) * 1e3, "touch_ms": (t2 - t0) * 1e3,
                                 "checksum": checksum}), flush=True)
    sys.stdin.readline()  # hold the weights until the parent has read our PSS
    for obj in reversed(keep):
        # safe_open handles are context managers; whether they also have close() depends on the
        # safetensors release, so leave through the protocol every release has.
        if hasattr(obj, "close"):
            obj.close()
        else:
            obj.__exit__(None, None, None)


# --- driver ----------------------------------------------------------------------------------
def pss(pid: int) -> int:
    return common.pss_kib(pid).get("Pss", 0)


def phase(spec: dict[str, Any], n: int) -> dict[str, Any]:
    """N workers of one mode from one barrier; per-worker times and the aggregate weight PSS."""
    procs = [subprocess.Popen([sys.executable, THIS, "--worker", json.dumps(spec)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(n)]
    try:
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "armed":
                raise RuntimeError(f"a {spec['mode']} worker failed before the barrier")
        before = [pss(p.pid) for p in procs]
        t0 = time.perf_counter()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        reports = []
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.startswith("READY "):
                raise RuntimeError(f"a {spec['mode']} worker failed: {line!r}")
            reports.append(json.loads(line[6:]))
        all_ready_ms = (time.perf_counter() - t0) * 1e3
        after = [pss(p.pid) for p in procs]
    finally:
        for proc in procs:
            with contextlib.suppress(BrokenPipeError, OSError):
                assert proc.stdin is not None
                proc.stdin.write("\n")
                proc.stdin.close()
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    touch = [r["touch_ms"] for r in reports]
    return {"workers": n, "touch_ms_median": statistics.median(touch), "touch_ms_max": max(touch),
            "usable_ms_median": statistics.median(r["usable_ms"] for r in reports),
            "all_ready_ms": all_ready_ms, "weights_pss_mib": (sum(after) - sum(before)) / 1024,
            "checksums": sorted({r["checksum"] for r in reports})}


def plot(results: dict[str, Any], png: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # the plot needs the `bench` extra; the tables and JSON do not
        print(f"matplotlib is not installed (pip install -e '.[bench]'): no plot written to {png}", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2), dpi=90)
    for mode, label in MODES.items():
        rows = results["scaling"].get(mode, [])
        ns = [r["workers"] for r in rows]
        left.plot(ns, [r["touch_ms_median"] for r in rows], marker="o", label=label)
        right.plot(ns, [r["weights_pss_mib"] for r in rows], marker="o", label=label)
    size = results["artifact_bytes"] / MiB
    right.axhline(size, color="grey", linestyle=":", linewidth=1, label="one copy")
    for ax, title, unit in ((left, "time to usable + touch (median worker)", "ms"),
                            (right, "aggregate weight PSS", "MiB")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(results["workers"], [str(n) for n in results["workers"]])
        ax.set_xlabel("concurrent workers")
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    left.set_yscale("log")
    right.legend(fontsize=7)
    fig.suptitle(f"{size:.0f} MiB bf16 artifact, warm page cache, {os.cpu_count()} CPUs", fontsize=9)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--png", help="write the plot here (default: no plot)")
    ap.add_argument("--json-out")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    import warm_start as ws
    from safetensors.torch import save_file

    import hwr.client as hc

    counts = [int(n) for n in args.workers.split(",") if n]
    work = Path(tempfile.mkdtemp(prefix="hwr-scaling-"))
    results: dict[str, Any] = {"benchmark": "scaling", "workers": counts, "loadavg_start": os.getloadavg(),
                               "scaling": {m: [] for m in MODES}}
    started = time.perf_counter()
    try:
        tensors = ws.make_tensors(ws.dit_shapes(args.size_mib * MiB, args.tensors))
        results["artifact_bytes"] = sum(t.nbytes for t in tensors.values())
        results["tensor_count"] = len(tensors)
        path = work / "model.safetensors"
        save_file(tensors, str(path))
        path.read_bytes()  # warm the page cache
        with common.hwrd(work / "hwrd-root") as daemon:
            with hc.connect(str(daemon.socket)) as client:
                key = client.publish(hc.ArtifactIdentity.simple("bench/scaling"), tensors)
            del tensors
            gc.collect()
            specs = {"hwrd": {"mode": "hwrd", "socket": str(daemon.socket), "key": key},
                     "copy": {"mode": "copy", "path": str(path)},
                     "safe_open": {"mode": "safe_open", "path": str(path)}}
            for n in counts:
                for mode, spec in specs.items():
                    results["scaling"][mode].append(phase(spec, n))
            results["daemon_pss_mib"] = pss(daemon.pid) / 1024
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sums = {c for rows in results["scaling"].values() for r in rows for c in r["checksums"]}
    if len(sums) != 1:
        raise RuntimeError(f"workers disagree on the bytes: {sums}")
    results["wall_s"] = round(time.perf_counter() - started, 1)
    results["loadavg_end"] = os.getloadavg()
    report(results)
    if args.png:
        plot(results, Path(args.png))
        print(f"\nplot: {args.png}")
    common.json_line(results, args.json_out)
    return 0


def report(results: dict[str, Any]) -> None:
    size = results["artifact_bytes"] / MiB
    print(f"\n## Scaling: N workers at once on one {size:.0f} MiB bf16 artifact ({results['tensor_count']} "
          f"tensors), page cache warm\n")
    rows = []
    by_n = {m: {r["workers"]: r for r in rows_} for m, rows_ in results["scaling"].items()}
    for n in results["workers"]:
        ref = by_n["hwrd"][n]
        for mode, label in MODES.items():
            r = by_n[mode][n]
            rows.append([n, label, common.fmt_ms(r["touch_ms_median"]), common.fmt_ms(r["touch_ms_max"]),
                         common.fmt_ms(r["all_ready_ms"]),
                         common.fmt_ratio(r["touch_ms_median"], ref["touch_ms_median"]),
                         f"{r['weights_pss_mib']:,.0f} MiB", f"{r['weights_pss_mib'] / size:.2f}x"])
    print(common.md_table(["workers", "path", "usable+touch (median)", "(max)", "all N ready",
                           "hwrd x faster (median)", "aggregate weight PSS", "/ one copy"], rows))
    four = by_n["hwrd"].get(4)
    if four:
        x = four["weights_pss_mib"] / size
        results["hwrd_4_workers_pss_over_one_copy"] = x
        verdict = "met" if x <= 1.2 else "MISSED"
        print(f"\nhwrd, 4 workers: aggregate weight PSS {x:.2f}x one copy (goal <= 1.2x: {verdict}).")


if __name__ == "__main__":
    sys.exit(main())
