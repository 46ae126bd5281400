"""What a lease's tensor views cost on an artifact of many tensors (1,000 by default).

A lease exposes every tensor of an artifact as a zero-copy CPU view of the shared mapping, and
vLLM-Omni's final-layout restorer accepts a lease only when no two of its tensors share one
storage (it compares ``(untyped_storage().data_ptr(), nbytes)``). This measures what building
those views costs a worker, through the public client API only, on one artifact of ``--tensors``
bf16 tensors (DiT-like mix of matrices, vectors and norms) published into a real hwrd:

- **first acquire, fresh process**: ``connect()`` then ``acquire(key)`` in a new process (header
  parse and check, plan, mapping, views), timed after the imports; median of ``--processes``;
- **steady acquire**: in one process and session, ``acquire`` + ``close`` cycles after a warm-up
  (the per-process plan cache hit: descriptors, mapping and views only); median and p90 of
  ``--cycles``;
- the lease's shape: how many distinct storages back its tensors, and whether vLLM-Omni's alias
  rule (one storage per tensor) holds.

    .venv/bin/python benchmarks/lease_views.py                  # 1,000 tensors, 64 MiB
    .venv/bin/python benchmarks/lease_views.py --tensors 2000 --json-out lv.json

The last line of the output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import hwr.client as hc

THIS = str(Path(__file__).resolve())
MiB = 1 << 20


def artifact(n_tensors: int, target_bytes: int) -> dict[str, torch.Tensor]:
    """``n_tensors`` bf16 tensors: per block of 10, four matrices, four biases and two norms."""
    blocks = max(1, n_tensors // 10)
    # Each block's matrices hold most of the bytes: 4 * hidden^2 * 2 bytes per block.
    hidden = max(8, int((target_bytes / blocks / 8) ** 0.5) // 8 * 8)
    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    for i in range(n_tensors):
        block, slot = divmod(i, 10)
        shape = (hidden, hidden) if slot < 4 else (hidden,)
        out[f"blocks.{block}.t{slot}"] = torch.randn(shape, generator=g).to(torch.bfloat16)
    return out


def worker_first(spec: dict[str, Any]) -> dict[str, Any]:
    common.freeze_startup_heap()
    t0 = time.perf_counter()
    client = hc.connect(spec["socket"])
    t1 = time.perf_counter()
    lease = client.acquire(spec["key"])
    count = len(lease.tensors)
    t2 = time.perf_counter()
    storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                for t in lease.tensors.values() if t.numel()}
    lease.close()
    client.close()
    return {"connect_ms": (t1 - t0) * 1e3, "acquire_ms": (t2 - t1) * 1e3, "tensors": count,
            "storages": len(storages)}


def worker_steady(spec: dict[str, Any]) -> dict[str, Any]:
    common.freeze_startup_heap()
    acquire_ms: list[float] = []
    with hc.connect(spec["socket"]) as client:
        for i in range(spec["warmup"] + spec["cycles"]):
            t0 = time.perf_counter()
            lease = client.acquire(spec["key"])
            t1 = time.perf_counter()
            lease.close()
            if i >= spec["warmup"]:
                acquire_ms.append((t1 - t0) * 1e3)
    return {"acquire_ms": common.summarize(acquire_ms)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=1000, help="tensor count (default 1000)")
    ap.add_argument("--size-mib", type=int, default=64, help="artifact size in MiB (default 64)")
    ap.add_argument("--processes", type=int, default=9, help="fresh processes for the first acquire (default 9)")
    ap.add_argument("--cycles", type=int, default=200, help="steady acquire+release cycles (default 200)")
    ap.add_argument("--json-out", help="also write the JSON result line to this file")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        result = {"first": worker_first, "steady": worker_steady}[spec["mode"]](spec)
        print(json.dumps(result))
        return

    tensors = artifact(args.tensors, args.size_mib * MiB)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    load_start = os.getloadavg()[0]
    with common.hwrd() as daemon:
        identity = hc.ArtifactIdentity.simple(f"bench/lease-views-{len(tensors)}t-{nbytes}b")
        with hc.connect(daemon.socket) as client:
            key = client.publish(identity, tensors)
        del tensors
        base = {"socket": str(daemon.socket), "key": key}
        firsts = [common.run_worker([THIS, "--worker", json.dumps({**base, "mode": "first"})])
                  for _ in range(args.processes)]
        steady = common.run_worker([THIS, "--worker", json.dumps(
            {**base, "mode": "steady", "warmup": max(10, args.cycles // 10), "cycles": args.cycles})])
    first_ms = [r["acquire_ms"] for r in firsts]
    storages, count = firsts[0]["storages"], firsts[0]["tensors"]
    results = {
        "tensors": count, "bytes": nbytes, "storages": storages,
        "one_storage_per_tensor": storages == count,
        "first_acquire_ms": common.summarize(first_ms),
        "first_connect_ms": common.summarize([r["connect_ms"] for r in firsts]),
        "steady_acquire_ms": steady["acquire_ms"],
        "loadavg": [load_start, os.getloadavg()[0]],
        "torch": torch.__version__,
    }
    print(f"lease views: {count} tensors, {nbytes / MiB:.1f} MiB bf16; load average "
          f"{load_start:.2f} -> {results['loadavg'][1]:.2f}\n")
    print(common.md_table(
        ["row", "median", "p90", "min", "n"],
        [["first acquire in a fresh process (connect excluded)", common.fmt_ms(common.median(first_ms)),
          common.fmt_ms(results["first_acquire_ms"]["p90"]), common.fmt_ms(min(first_ms)), len(first_ms)],
         ["steady acquire, session open, plan cached", common.fmt_ms(steady["acquire_ms"]["p50"]),
          common.fmt_ms(steady["acquire_ms"]["p90"]), common.fmt_ms(steady["acquire_ms"]["min"]),
          steady["acquire_ms"]["n"]]]))
    print(f"\ndistinct storages behind the {count} tensors: {storages} "
          f"({'one per tensor: vLLM-Omni restorer alias rule holds' if storages == count else 'shared'})\n")
    common.json_line(results, args.json_out)


if __name__ == "__main__":
    main()
