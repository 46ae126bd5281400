"""Fleet tier: pulling an artifact from an S3-compatible remote, and a new node's first start.

    .venv/bin/python benchmarks/remote.py [--size-mib 1024] [--repeats 2] [--quick] [--json-out F]

One S3-compatible server (moto's standalone server, a real HTTP process on 127.0.0.1) and real
hwrd nodes with separate stores:

1. **Pull vs plain download** of one ``--size-mib`` artifact that node A published and pushed:
   (a) boto3's transfer manager downloading the same objects (payload, manifest.json,
   READY.json) to a local file with the transfer settings hwrd uses (``download_file``), and
   (a') the same plus an ``fsync`` (hwrd's commit makes its files durable); (b) ``hwrctl pull``
   on node B with an empty store: parallel ranged GETs into staging, then the store's commit
   (every byte re-hashed against the manifest, fsyncs, atomic rename). Interleaved, ``--repeats``
   times after one uncounted warm-up round (node B's copy evicted in between); medians. Goal: (b) within 1.3x of (a).
2. **New node's first start**: the demo DiT (``hwr.demo``: fp32 checkpoint -> bf16 final layout,
   layerwise offload, one forward) on a node without the fleet tier (cold canonical start in
   ``preferred`` mode, the checkpoint in the page cache) vs the first start on a new node C (empty
   store, ``required`` mode, the artifact in the remote: pull on miss, then a warm start).
   Outputs must be bit-identical. Goal: the new node's first start >= 3x faster.

The machine is shared; the load average is printed. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from common import json_line, md_table

from hwr.client import ArtifactIdentity, connect
from hwr.daemon.app.launcher import DaemonProcess

MiB = 1 << 20
PREFIX = "bench"


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def _tensors(nbytes: int) -> dict[str, Any]:
    import torch

    n = 8
    per = nbytes // n // 4096 * 4096
    out = {}
    for i in range(n):
        words = torch.arange(i, i + per // 8, dtype=torch.int64)
        words.mul_(0x9E3779B97F4A7C15 - (1 << 64)).add_(i)
        out[f"blocks.{i}.weight"] = words.view(torch.bfloat16).reshape(-1, 1024)
    return out


def _wait_ready(s3: Any, bucket: str, key: str, timeout: float = 1800.0) -> None:
    name = f"{PREFIX}/artifacts/{key}/READY.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            s3.head_object(Bucket=bucket, Key=name)
            return
        except Exception:
            time.sleep(0.2)
    raise TimeoutError("the push did not complete")


def _node(base: Path, name: str, remote: str, endpoint: str, *extra: str) -> DaemonProcess:
    from e2e.fleet_fixtures import S3_ENV

    args = ["--remote", remote, "--remote-endpoint-url", endpoint, *extra] if remote else list(extra)
    return DaemonProcess(base / f"{name}-store", base / f"{name}.sock", *args, env=S3_ENV)


def _drop_cache(path: Path) -> None:
    """Drop one file's pages (the downloaded copy must not sit in memory for the next run)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def pull_vs_download(s3: Any, bucket: str, b: DaemonProcess, key: str, repeats: int,
                     workdir: Path) -> dict[str, Any]:
    from hwr.daemon.fleet.remote_s3 import transfer_config

    config = transfer_config(8)
    objects = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"{PREFIX}/artifacts/{key}/")["Contents"]]
    size = sum(int(o["Size"]) for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"{PREFIX}/artifacts/{key}/")
               ["Contents"])
    runs: dict[str, list[float]] = {"download": [], "download_fsync": [], "pull": []}
    for index in range(repeats + 1):  # the first round warms connections and caches: not counted
        for mode in ("download", "download_fsync"):
            paths = [workdir / f"dl-{i}" for i in range(len(objects))]
            started = time.perf_counter()
            for obj, path in zip(objects, paths, strict=True):
                s3.download_file(bucket, obj, str(path), Config=config)
                if mode == "download_fsync":
                    fd = os.open(path, os.O_RDONLY)
                    os.fsync(fd)
                    os.close(fd)
            if index:
                runs[mode].append(time.perf_counter() - started)
            for path in paths:
                _drop_cache(path)
                path.unlink()
        with connect(b.socket, timeout=3600) as client:
            if key in {a["key"] for a in client.list_artifacts()}:
                client.evict(key)
            started = time.perf_counter()
            result = client.pull(key)
            if index:
                runs["pull"].append(time.perf_counter() - started)
            assert result["outcome"] == "pulled", result
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"size_bytes": size, "runs_s": runs, "median_s": med,
            "throughput_mib_s": {k: size / MiB / v for k, v in med.items()},
            "pull_vs_download": med["pull"] / med["download"],
            "pull_vs_download_fsync": med["pull"] / med["download_fsync"]}


def _start_of(report: dict[str, Any]) -> dict[str, Any]:
    return {k: report[k] for k in ("outcome", "startup_s", "first_forward_s", "output_sha256")}


def new_node_start(base: Path, remote: str, endpoint: str, s3: Any, bucket: str, size_mib: int) -> dict[str, Any]:
    from hwr.demo import demo_identity, run_workers
    from hwr.demo_model import DemoConfig, canonical_checkpoint

    cfg = DemoConfig.for_size(size_mib * 2, hidden=1024, heads=16)
    checkpoint = base / f"dit-h{cfg.hidden}-d{cfg.depth}.safetensors"
    canonical_checkpoint(cfg, checkpoint)
    key = demo_identity(cfg).key
    starts: dict[str, dict[str, Any]] = {}
    # Nodes without the fleet tier: their cold canonical start (checkpoint in the page cache, and
    # dropped from it first: a node that has not read the checkpoint yet).
    for name, drop in (("cold", False), ("cold_uncached", True)):
        plain = _node(base, name, "", "").start()
        try:
            if drop:
                _drop_cache(checkpoint)
            starts[name] = _start_of(run_workers("preferred", 1, None, plain.socket, checkpoint, cfg)[0])
        finally:
            plain.stop()
    # A fleet node builds the artifact (a cold start of its own, not timed) and pushes it to the
    # S3 remote; the same node then pushes it by hand to a file:// remote (a shared directory).
    shared = base / "shared"
    shared.mkdir()
    producer = _node(base, "producer", remote, endpoint).start()
    try:
        run_workers("preferred", 1, None, producer.socket, checkpoint, cfg)
        _wait_ready(s3, bucket, key)
    finally:
        producer.stop()
    producer = _node(base, "producer", f"file://{shared}", "").start()
    try:
        with connect(producer.socket, timeout=3600) as client:
            client.push(key)
    finally:
        producer.stop()
    pulled: dict[str, int] = {}
    failed: dict[str, str] = {}
    prewarm_pull_s: dict[str, float] = {}
    for name, url, ep, prewarm in (("new_node_s3", remote, endpoint, False),
                                   ("new_node_s3_hwrctl_pull_first", remote, endpoint, True),
                                   ("new_node_file", f"file://{shared}", "", False)):
        fresh = _node(base, name, url, ep, "--remote-push", "false").start()
        try:
            if prewarm:  # the operator's path: `hwrctl pull KEY`, then start in required mode
                began = time.perf_counter()
                with connect(fresh.socket, timeout=3600) as client:
                    client.pull(key)
                prewarm_pull_s[name] = time.perf_counter() - began
            try:
                starts[name] = _start_of(run_workers("required", 1, None, fresh.socket, checkpoint, cfg)[0])
            except RuntimeError as exc:  # e.g. the worker's acquire timed out while the pull ran
                failed[name] = f"{exc} (see {fresh.log.name})"
            with connect(fresh.socket) as client:
                pulled[name] = client.status()["remote"]["bytes_pulled"]
        finally:
            fresh.stop()
    cold = starts["cold"]
    return {"depth": cfg.depth, "checkpoint_mib": checkpoint.stat().st_size / MiB, "starts": starts,
            "bytes_pulled": pulled, "failed": failed, "prewarm_pull_s": prewarm_pull_s,
            "speedup_first_forward": {name: cold["first_forward_s"] / max(s["first_forward_s"], 1e-9)
                                      for name, s in starts.items() if name.startswith("new_node")},
            "speedup_first_forward_uncached": {
                name: starts["cold_uncached"]["first_forward_s"] / max(s["first_forward_s"], 1e-9)
                for name, s in starts.items() if name.startswith("new_node")},
            "bit_identical": len({s["output_sha256"] for s in starts.values()}) == 1}


def _print_pull(results: dict[str, Any], load_before: str) -> None:
    p = results["pull"]
    print(f"fleet tier: {p['size_bytes'] / MiB:.0f} MiB artifact, {results['repeats']} repeat(s), "
          f"{os.cpu_count()} CPUs, load average before {load_before}, now {_load()}\n")
    rows = [[name, f"{p['median_s'][k]:.2f} s", f"{p['throughput_mib_s'][k]:.0f} MiB/s",
             f"{p['median_s'][k] / p['median_s']['download']:.2f}x"]
            for name, k in (("boto3 download_file (a)", "download"), ("boto3 download_file + fsync (a')",
                                                                      "download_fsync"),
                            ("hwrctl pull: fetch + verify + commit (b)", "pull"))]
    print(md_table(["transfer", "median", "throughput", "vs (a)"], rows))
    print(f"\ngoal: pull within 1.3x of a plain download: {p['pull_vs_download']:.2f}x "
          f"({'met' if p['pull_vs_download'] <= 1.3 else 'NOT met'})\n", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="artifact size (bf16 final layout)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="64 MiB, 1 repeat")
    parser.add_argument("--skip-start", action="store_true", help="only the pull vs download section")
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_mib, args.repeats = 64, 1
    import importlib.util

    missing = [m for m in ("boto3", "moto") if importlib.util.find_spec(m) is None]
    if missing:  # the s3 and test extras
        print(f"fleet tier benchmark: not run, {' and '.join(missing)} not installed (pip install 'hwr[s3,test]')")
        json_line({"benchmark": "remote", "skipped": f"{','.join(missing)} not installed"}, args.json_out)
        return 0
    from e2e.fleet_fixtures import S3Server

    base = Path(tempfile.mkdtemp(prefix="hwrb-"))
    os.chmod(base, 0o700)
    load_before = _load()
    server = S3Server(base / "moto.log").start()
    results: dict[str, Any] = {"benchmark": "remote", "size_mib": args.size_mib, "repeats": args.repeats,
                               "cpus": os.cpu_count(), "load_before": load_before,
                               "server": "moto standalone server (python -m moto.server), 127.0.0.1"}
    try:
        s3 = server.client()
        bucket = server.new_bucket()
        remote = f"s3://{bucket}/{PREFIX}"
        a = _node(base, "a", remote, server.endpoint).start()
        b = _node(base, "b", remote, server.endpoint, "--remote-push", "false").start()
        try:
            with connect(a.socket, timeout=3600) as client:
                tensors = _tensors(args.size_mib * MiB)
                key = client.publish(ArtifactIdentity.simple(f"bench/remote-{args.size_mib}"), tensors)
                del tensors
            _wait_ready(s3, bucket, key)
            results["pull"] = pull_vs_download(s3, bucket, b, key, args.repeats, base)
        finally:
            a.stop()
            b.stop()
        _print_pull(results, load_before)
        if not args.skip_start:
            results["start"] = new_node_start(base, remote, server.endpoint, s3, bucket, args.size_mib)
    finally:
        server.stop()
    results["load_after"] = _load()
    print(f"load average after: {results['load_after']}\n")
    if "start" in results:
        s = results["start"]
        names = {"cold": "cold canonical start, no fleet tier (preferred; checkpoint in page cache)",
                 "cold_uncached": "cold canonical start, no fleet tier (checkpoint not in page cache)",
                 "new_node_s3": "new node, empty store, required: pull on miss from s3:// (moto)",
                 "new_node_file": "new node, empty store, required: pull on miss from file://"}
        names["new_node_s3_hwrctl_pull_first"] = "new node: `hwrctl pull` first (see below), then required"
        rows = [[names[n], g["outcome"], f"{g['startup_s'] * 1e3:.0f} ms", f"{g['first_forward_s'] * 1e3:.0f} ms",
                 g["output_sha256"][:16]] for n, g in s["starts"].items()]
        rows += [[names[n], "FAILED", why, "", ""] for n, why in s["failed"].items()]
        print(md_table(["first start", "outcome", "startup", "first forward", "output sha256"], rows))
        for n, x in s["speedup_first_forward"].items():
            y = s["speedup_first_forward_uncached"][n]
            if n in s["prewarm_pull_s"]:
                print(f"\n{n} (not the goal's case: its pull ran before the start, "
                      f"{s['prewarm_pull_s'][n]:.1f} s): {x:.1f}x to first forward")
                continue
            print(f"\ngoal: {n}'s first start >= 3x faster than the cold canonical start: {x:.1f}x "
                  f"(vs the uncached cold start: {y:.1f}x) to first forward "
                  f"({'met' if x >= 3 and s['bit_identical'] else 'NOT met'})")
        print(f"outputs bit-identical across the starts that ran: {s['bit_identical']}")
    json_line(results, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
