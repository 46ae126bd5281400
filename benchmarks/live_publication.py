"""Publishing a revision for a live update, against a plain memory copy of the same bytes.

    .venv/bin/python benchmarks/live_publication.py [--size-mib 1024] [--tensors 64] [--repeats 3]
                                                    [--unchanged 0.5] [--json-out F]

A trainer that updates running workers publishes a new revision of the same tensors every few
steps: ``client.publish(identity, tensors, channel=NAME, durable=False)``. Its cost is judged
against copying those bytes into memory once. Each repetition publishes a new revision (every
tensor changed by one element: a new identity, new bytes), and the rows are interleaved (rep 1 of
every path, then rep 2, ...), so load drifts over all paths alike; median and min per row:

- ``memory copy (new buffers)``: ``tensor.clone()`` of every tensor: allocating the pages and
  copying into them, which is what "copying the bytes into memory once" costs, and the
  comparison the goal is judged by (the page cache pages of a staging file are new pages too);
- ``memory copy (into touched buffers)``: ``copy_`` into buffers already faulted in: the pure
  copy bandwidth, shown for honesty (no publication can allocate nothing);
- ``publish, durable``: hashed, fsynced, renamed (what any publication does);
- ``publish, non-durable``: the same without any fsync (``durable=False``);
- ``publish, non-durable, X% unchanged``: that fraction of the tensors equal to the channel's
  current revision (``--unchanged``): hwrd takes their bytes and digests from that revision
  instead of the publisher writing and hwrd hashing them again.

Also measured (``watch_latency``): how long after a commit request a watcher in another process
hears of the new revision (``client.watch_channel``), for small non-durable revisions: the part
of "commit to the first pass on the new revision" that hwrd owns.

Goal: non-durable publication at least 50% of the memory copy's bandwidth. Prints markdown
tables, then one JSON line. ``publication_vs_memcpy`` and ``watch_latency`` are the
measurements as functions (for ``benchmarks/live_update.py`` and others that hold their own
client and tensors).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

import hwr.client as hc

MIB = 1 << 20


def make_tensors(total_bytes: int, count: int) -> dict[str, torch.Tensor]:
    """``count`` bf16 tensors of ``total_bytes`` in all, named like a DiT's blocks, non-constant."""
    per = max(4, total_bytes // count // 4 * 4)  # bytes per tensor
    out = {}
    for i in range(count):
        words = torch.arange(i * per, i * per + per // 4, dtype=torch.int32)
        out[f"blocks.{i:03d}.weight"] = words.mul_(2654435761).view(torch.bfloat16)
    return out


def _bump(tensors: Mapping[str, torch.Tensor], names: list[str], step: int) -> None:
    """A new revision: one element of each named tensor changed (cheap, and every byte range
    that the tensor covers is now another tensor's)."""
    for name in names:
        flat = tensors[name].view(-1).view(torch.int16)
        flat[step % flat.numel()] += 1


def publication_vs_memcpy(client: hc.Client, tensors: dict[str, torch.Tensor], *, repeats: int = 3,
                          channel: str = "live-publication", unchanged: float = 0.5,
                          log: Callable[[str], None] = print) -> dict[str, Any]:
    """Time each path ``repeats`` times on ``tensors`` (mutated in place between revisions);
    returns per path the seconds of every repetition, the median/min and the bandwidth."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    names = sorted(tensors)
    keep = set(names[: int(len(names) * unchanged)])
    touched = {n: torch.empty_like(t).fill_(1) for n, t in tensors.items()}
    times: dict[str, list[float]] = {}
    model = f"live-publication/{os.getpid()}-{time.monotonic_ns()}"

    def record(path: str, seconds: float) -> None:
        times.setdefault(path, []).append(seconds)
        log(f"  {path}: {seconds * 1e3:.0f} ms")

    published: list[str] = []

    def publish(rep: int, path: str, durable: bool) -> None:
        identity = hc.ArtifactIdentity.simple(f"{model}/{path}/{rep}")
        started = time.perf_counter()
        published.append(client.publish(identity, tensors, channel=channel, durable=durable))
        record(path, time.perf_counter() - started)
        for key in published[:-1]:  # superseded revisions go, as a long run's eviction would do it
            try:
                client.evict(key)
                published.remove(key)
            except hc.HwrError:  # the channel's durable fallback (or an operator-less client)
                pass

    step = 0
    for rep in range(repeats):
        log(f"repetition {rep + 1}/{repeats}")
        started = time.perf_counter()
        copies = {n: t.clone() for n, t in tensors.items()}
        record("memory copy (new buffers)", time.perf_counter() - started)
        del copies
        started = time.perf_counter()
        for n, t in tensors.items():
            touched[n].copy_(t)
        record("memory copy (into touched buffers)", time.perf_counter() - started)
        for path, durable in (("publish, durable", True), ("publish, non-durable", False)):
            step += 1
            _bump(tensors, names, step)  # every tensor changes
            publish(rep, path, durable)
        if keep:
            step += 1
            _bump(tensors, [n for n in names if n not in keep], step)  # only the others change
            publish(rep, f"publish, non-durable, {len(keep) * 100 // len(names)}% unchanged", False)
    rows = {}
    for path, seconds in times.items():
        median = statistics.median(seconds)
        rows[path] = {"seconds": seconds, "median_s": median, "min_s": min(seconds),
                      "gib_per_s": nbytes / median / (1 << 30)}
    base = rows["memory copy (new buffers)"]["gib_per_s"]
    for row in rows.values():
        row["vs_memory_copy"] = row["gib_per_s"] / base
    return {"bytes": nbytes, "tensors": len(tensors), "repeats": repeats, "unchanged": len(keep) / len(names),
            "paths": rows}


_WATCHER = """
import sys, time
from hwr.client import connect
with connect(sys.argv[1]) as client, client.watch_channel(sys.argv[2]) as watch:
    print("ready", flush=True)
    while True:
        update = watch.wait(60)
        if update is None:
            break
        print(update.generation, time.monotonic(), flush=True)
"""


def watch_latency(client: hc.Client, socket: str | os.PathLike[str], *, revisions: int = 20,
                  channel: str = "live-watch-latency") -> dict[str, Any]:
    """Commit ``revisions`` small non-durable revisions to ``channel`` while a watcher process
    reads it; per revision, the milliseconds from the commit request to the commit's answer and
    to the watcher's ``wait`` returning it (CLOCK_MONOTONIC is one clock for every process)."""
    from hwr.client.publisher import specs_for

    tensors = {"w": torch.zeros(4096)}
    client.publish(hc.ArtifactIdentity.simple(f"{channel}/0"), tensors, channel=channel, durable=False)
    watcher = subprocess.Popen([sys.executable, "-c", _WATCHER, str(socket), channel], stdout=subprocess.PIPE,
                               text=True, bufsize=1)
    assert watcher.stdout is not None
    try:
        assert watcher.stdout.readline().strip() == "ready"
        watcher.stdout.readline()  # the state at subscription
        commits, heard = [], []
        for i in range(1, revisions + 1):
            tensors["w"][0] = i
            pub = client.publisher(hc.ArtifactIdentity.simple(f"{channel}/{i}-{time.monotonic_ns()}"),
                                   specs_for(tensors), channel=channel, durable=False)
            pub.write("w", tensors["w"])
            started = time.monotonic()
            pub.commit()
            commits.append((time.monotonic() - started) * 1e3)
            generation = client.inspect_channel(channel)["generation"]
            while True:
                got, at = watcher.stdout.readline().split()
                if int(got) >= generation:
                    heard.append((float(at) - started) * 1e3)
                    break
            time.sleep(0.05)  # a trainer's step apart, roughly: not back to back
    finally:
        watcher.kill()
        watcher.wait()
    return {"revisions": revisions, "commit_ms": commits, "heard_ms": heard,
            "commit_ms_median": statistics.median(commits), "heard_ms_median": statistics.median(heard),
            "heard_ms_max": max(heard)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--unchanged", type=float, default=0.5, help="fraction of tensors kept in the last row")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    tensors = make_tensors(args.size_mib * MIB, args.tensors)
    load = os.getloadavg()
    with common.hwrd() as daemon, hc.connect(daemon.socket) as client:
        result = publication_vs_memcpy(client, tensors, repeats=args.repeats, unchanged=args.unchanged,
                                       log=lambda line: print(line, file=sys.stderr))
        result["watch"] = watch_latency(client, daemon.socket)
    result["loadavg_before"] = list(load)
    result["loadavg_after"] = list(os.getloadavg())
    rows = [[path, common.fmt_ms(r["median_s"] * 1e3), common.fmt_ms(r["min_s"] * 1e3),
             f"{r['gib_per_s']:.2f} GiB/s", f"{r['vs_memory_copy'] * 100:.0f}%"]
            for path, r in result["paths"].items()]
    print(f"\nPublishing a revision of {args.size_mib} MiB ({args.tensors} bf16 tensors), {args.repeats} repeats; "
          f"load average before {load[0]:.1f}\n")
    print(common.md_table(["path", "median", "min", "bandwidth (median)", "vs memory copy"], rows))
    watch = result["watch"]
    print(f"\nA watcher in another process hears of a small non-durable revision ({watch['revisions']} revisions)\n")
    print(common.md_table(["from the commit request to", "median", "max"], [
        ["the commit's answer", common.fmt_ms(watch["commit_ms_median"]), common.fmt_ms(max(watch["commit_ms"]))],
        ["the watcher's wait() returning it", common.fmt_ms(watch["heard_ms_median"]),
         common.fmt_ms(watch["heard_ms_max"])]]))
    common.json_line({"benchmark": "live_publication", **result}, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
