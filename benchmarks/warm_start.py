"""Warm start: time until every tensor of one ~2 GiB artifact is usable by a fresh worker.

Compared on the same tensor bytes, page cache warm for all (the warm-start scenario: the node
already served this model, so the bytes sit in the page cache; nothing here measures disk):

(a)  hwrd lease: ``connect()`` + ``acquire(key)`` -> read-only shared-mapping views
(a') the same with ``populate=True`` (MAP_POPULATE pre-faults the page tables)
(b)  ``safetensors.torch.load_file`` (in safetensors 0.8 its default ``backend="mmap"`` returns
     lazy mmap-backed tensors, like (c))
(b') ``load_file(backend="pread")``: the copying load (what ``load_file`` did before 0.8)
(c)  ``safetensors.safe_open`` + ``get_tensor`` for every name (mmap views)
(d)  vLLM-Omni 0.30's in-process ``FilesystemHostWeightStore.lookup`` (metadata level and full
     checksum), when ``vllm_omni.host_weight_runtime`` imports (or ``--vllm-omni-src`` points at
     a source tree, e.g. an unpacked ``vllm-omni==0.30.0`` wheel: only that subpackage is loaded).

Every run is a fresh process that imports torch, safetensors and hwr's client (and vLLM-Omni's
runtime for (d)) and collects its startup garbage (``gc.collect(); gc.freeze()``) *before* its
timer starts; "usable" stops when every tensor exists, "+touch" after reading one
byte of every 4 KiB page of every tensor as well. Median and min over ``--repeats`` runs, the
modes interleaved. A run of each mode before the timed ones warms the page cache and checks that
all modes see the same bytes.

Also: a breakdown of the hwrd lease path (connect, Acquire RPC, descriptor passing, mapping,
header parse and validation, views), and lease acquire/release latency with 1 and 32 concurrent
client processes (each its own session) on a small artifact and on the big one.

Goals: hwrd lease "usable" <= 50 ms and >= 20x faster than the copying load (b') (safetensors
0.8's (b) is itself a lazy mmap, so its ratio is reported, not judged); acquire/release p99 < 5 ms
with 32 clients paced at 10 cycles/s each. The closed-loop rows are reported against Little's law
(with N clients always in flight the mean latency is N / throughput), not judged.

    .venv/bin/python benchmarks/warm_start.py                 # full: 2 GiB, ~200 tensors
    .venv/bin/python benchmarks/warm_start.py --quick         # smoke run
    .venv/bin/python benchmarks/warm_start.py --vllm-omni-src /tmp/vo/src --json-out ws.json

The last line of the output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import hwr
import hwr.client as hc

THIS = str(Path(__file__).resolve())
GiB = 1 << 30
MiB = 1 << 20


# --- tensors ---------------------------------------------------------------------------------
def dit_shapes(target_bytes: int, n_tensors: int, itemsize: int = 2) -> dict[str, tuple[int, ...]]:
    """DiT-like names and shapes: per block adaLN, qkv, proj, MLP (weights + biases) and norms.

    12 tensors per block plus 8 embedding/head tensors; the hidden size is chosen so the total
    comes close to ``target_bytes``.
    """
    n_blocks = max(1, (n_tensors - 8) // 12)
    params = target_bytes // itemsize
    # per block: 18 H^2 weights; embeddings/head ~ 2 H^2 + small terms
    hidden = int(math.sqrt(params / (18 * n_blocks + 2)))
    hidden = max(64, hidden // 64 * 64)
    h = hidden
    shapes: dict[str, tuple[int, ...]] = {
        "x_embedder.proj.weight": (h, 64),
        "x_embedder.proj.bias": (h,),
        "t_embedder.mlp.0.weight": (h, 256),
        "t_embedder.mlp.0.bias": (h,),
        "t_embedder.mlp.2.weight": (h, h),
        "t_embedder.mlp.2.bias": (h,),
        "final_layer.linear.weight": (64, h),
        "final_layer.adaLN_modulation.weight": (2 * h, h),
    }
    for i in range(n_blocks):
        p = f"blocks.{i}."
        shapes |= {
            p + "adaLN_modulation.weight": (6 * h, h), p + "adaLN_modulation.bias": (6 * h,),
            p + "attn.qkv.weight": (3 * h, h), p + "attn.qkv.bias": (3 * h,),
            p + "attn.proj.weight": (h, h), p + "attn.proj.bias": (h,),
            p + "attn.norm_q.weight": (h // 16,), p + "attn.norm_k.weight": (h // 16,),
            p + "mlp.fc1.weight": (4 * h, h), p + "mlp.fc1.bias": (4 * h,),
            p + "mlp.fc2.weight": (h, 4 * h), p + "mlp.fc2.bias": (h,),
        }
    return shapes


def make_tensors(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, dtype=torch.bfloat16, generator=gen) for name, shape in shapes.items()}


def small_tensors() -> dict[str, torch.Tensor]:
    """The small artifact of the latency section: 8 bf16 tensors, 1 MiB in all."""
    gen = torch.Generator().manual_seed(1)
    return {f"w{i}": torch.randn(256, 256, dtype=torch.bfloat16, generator=gen) for i in range(8)}


# --- vLLM-Omni (optional) --------------------------------------------------------------------
def import_upstream(src: str | None) -> tuple[types.ModuleType | None, str]:
    """vLLM-Omni's ``host_weight_runtime`` package, and how it was found.

    Only that subpackage is loaded (it needs torch and safetensors, not vLLM): a bare
    ``vllm_omni`` package object stands in for ``vllm_omni/__init__.py``, which imports all of
    vLLM (about 15 s per fresh process here; the timed code is the same either way). The package
    comes from the installed ``vllm-omni`` distribution, else from ``src`` (a directory holding
    ``vllm_omni/``, e.g. an unpacked wheel); there, when the ``regex`` package is missing, the
    stdlib ``re`` stands in for it (upstream only compiles ``[0-9a-f]{64}`` with it).
    """
    loaded = sys.modules.get("vllm_omni.host_weight_runtime")
    if loaded is not None:
        return loaded, "installed"
    spec = None
    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec("vllm_omni")  # finds, does not run, the package
    if spec is not None and spec.submodule_search_locations:
        pkg_dir, how = Path(next(iter(spec.submodule_search_locations))), "installed"
    elif src:
        pkg_dir, how = Path(src) / "vllm_omni", f"source tree {src}"
    else:
        return None, "not installed"
    if not (pkg_dir / "host_weight_runtime" / "__init__.py").is_file():
        return None, f"not installed (no host_weight_runtime under {pkg_dir})"
    if "vllm_omni" not in sys.modules:
        stub = types.ModuleType("vllm_omni")
        stub.__path__ = [str(pkg_dir)]
        sys.modules["vllm_omni"] = stub
    try:
        importlib.import_module("regex")
    except ImportError:
        sys.modules["regex"] = re
        how += ", stdlib re as regex"
    try:
        return importlib.import_module("vllm_omni.host_weight_runtime"), how
    except ImportError as exc:
        return None, f"not importable from {pkg_dir} ({exc})"


def upstream_identity(vo: types.ModuleType, ident: hc.ArtifactIdentity) -> Any:
    # Same field names and nesting (ARCHITECTURE.md): the keys must agree.
    uid = vo.WeightArtifactIdentity.from_dict(json.loads(ident.canonical_bytes))
    if uid.key != ident.key:
        raise RuntimeError(f"identity keys differ: hwr {ident.key} vs vLLM-Omni {uid.key}")
    return uid


def upstream_store(vo: types.ModuleType, root: str, level: str) -> Any:
    from vllm_omni.host_weight_runtime.filesystem import FilesystemHostWeightStore

    return FilesystemHostWeightStore(vo.StorageDomainPolicy(root=Path(root)), vo.CapacityPolicy(),
                                     vo.IntegrityPolicy(local_lookup=vo.ValidationLevel(level)))


# --- workers (each runs in a fresh process) ---------------------------------------------------
def _result(t0: float, t_usable: float, tensors: Any, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    checksum = common.touch_pages(tensors)
    t_touch = time.perf_counter()
    return {"usable_ms": (t_usable - t0) * 1e3, "touch_ms": (t_touch - t0) * 1e3,
            "tensors": len(tensors), "checksum": checksum, "mem_kib": common.pss_kib(), **(extra or {})}


def preload_client() -> float:
    """Import the client's modules before any timer (``hwr.client`` resolves names lazily, so
    the first ``connect`` would otherwise import grpc and the stubs); returns the import's ms."""
    t0 = time.perf_counter()
    for module in ("hwr.client.client", "hwr.client.lease", "hwr.client.manifest", "hwr.client.artifact"):
        importlib.import_module(module)
    _ = hc.connect, hc.Lease
    return (time.perf_counter() - t0) * 1e3


def worker_hwr(spec: dict[str, Any]) -> dict[str, Any]:
    import_ms = preload_client()
    settle()
    t0 = time.perf_counter()
    client = hc.connect(spec["socket"])
    t_conn = time.perf_counter()
    lease = client.acquire(spec["key"], populate=spec.get("populate", False))
    tensors = lease.tensors
    t1 = time.perf_counter()
    out = _result(t0, t1, tensors, {"connect_ms": (t_conn - t0) * 1e3, "acquire_ms": (t1 - t_conn) * 1e3,
                                    "client_import_ms": import_ms})
    lease.close()
    client.close()
    return out


def worker_hwr_breakdown(spec: dict[str, Any]) -> dict[str, Any]:
    """The lease path step by step, through the client's internals (names may drift)."""
    import mmap

    from hwr.client.artifact import tensor_views, validate_payload_header
    from hwr.client.lease import Lease
    from hwr.client.manifest import Manifest
    from hwr.client.safetensors_header import read_header

    preload_client()
    settle()
    ms: dict[str, float] = {}
    t = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        ms[name] = ms.get(name, 0.0) + (now - t) * 1e3
        t = now

    connect_steps(spec["socket"], lap)
    t = time.perf_counter()
    client = hc.connect(spec["socket"])
    lap("connect() as a whole (after the above)")
    reply, fds, tail = client._connection.exchange({"op": "acquire", "key": spec["key"]}, want_fds=True)
    lap("peer acquire: lease + descriptors + manifest bytes (one exchange)")
    manifest = Manifest.from_json(tail)
    lap("manifest parse + validation (first time in a process; cached after)")
    # The Lease constructor's steps, on duplicates of the descriptors, timed one by one.
    maps = []
    views = 0
    for record, fd in zip(manifest.files, fds, strict=True):
        dup = os.dup(fd)
        os.fstat(dup)
        header = read_header(dup)
        lap("lease: read_header (first time; cached after)")
        pairs = validate_payload_header(header, manifest, record)
        lap("lease: validate_payload_header (first time; cached after)")
        mapped = mmap.mmap(dup, record.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        os.close(dup)
        maps.append(mapped)
        lap("lease: mmap")
        views += len(tensor_views(mapped, header, [r for r, _ in pairs]))
        lap("lease: tensor_views (frombuffer per tensor; Lease uses cached plans)")
    del maps
    t = time.perf_counter()
    lease = Lease(lease_id=reply["lease_id"], key=reply["key"], manifest=manifest, fds=fds,
                  release=client._acquirer.release)
    lap("Lease() as a whole (after the above)")
    t_rel = time.perf_counter()
    lease.close()
    ms["release (peer) + unmap"] = (time.perf_counter() - t_rel) * 1e3
    t = time.perf_counter()
    second = client.acquire(spec["key"])
    lap("second acquire() on the warm session")
    second.close()
    client.close()
    return {"steps_ms": ms, "views": views, "files": len(manifest.files)}


def connect_steps(socket: str, lap: Any) -> None:
    """What ``Client.__init__`` does, step by step (private names: may drift). No gRPC: the
    client opens its channel lazily, on the first call that needs it."""
    from hwr.client.connection import open_peer
    from hwr.client.wire import recv_frame, send_frame

    peer = open_peer(Path(socket), 30.0)
    lap("connect: peer socket connect")
    recv_frame(peer)
    lap("connect: peer greeting (daemon: SO_PEERCRED, session)")
    send_frame(peer, {"op": "hello", "client_name": "bench", "client_version": hwr.__version__})
    recv_frame(peer)
    lap("connect: peer hello (names the session)")
    peer.close()


def worker_load_file(spec: dict[str, Any]) -> dict[str, Any]:
    settle()
    t0 = time.perf_counter()
    tensors = load_file(spec["path"], backend=spec.get("backend", "mmap"))
    return _result(t0, time.perf_counter(), tensors)


def worker_safe_open(spec: dict[str, Any]) -> dict[str, Any]:
    settle()
    t0 = time.perf_counter()
    with safe_open(spec["path"], framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not a dict
        t1 = time.perf_counter()
        return _result(t0, t1, tensors)


def worker_upstream(spec: dict[str, Any]) -> dict[str, Any]:
    vo, how = import_upstream(spec.get("vllm_omni_src"))
    if vo is None:
        raise RuntimeError(how)
    identity = upstream_identity(vo, hc.ArtifactIdentity.from_dict(spec["identity"]))
    level = vo.ValidationLevel(spec["level"])
    settle()
    t0 = time.perf_counter()
    store = upstream_store(vo, spec["root"], spec["level"])
    t_store = time.perf_counter()
    result = store.lookup(identity, validation=level)
    if result.lease is None:
        raise RuntimeError(f"vLLM-Omni lookup did not hit: {result.status} {result.failure}")
    tensors = result.lease.tensors
    t1 = time.perf_counter()
    out = _result(t0, t1, tensors, {"store_open_ms": (t_store - t0) * 1e3, "lookup_ms": (t1 - t_store) * 1e3})
    result.lease.close()
    return out


def worker_upstream_publish(spec: dict[str, Any]) -> dict[str, Any]:
    """Publish the safetensors file's tensors into a vLLM-Omni store (through its producer API)."""
    vo, how = import_upstream(spec.get("vllm_omni_src"))
    if vo is None:
        raise RuntimeError(how)
    identity = upstream_identity(vo, hc.ArtifactIdentity.from_dict(spec["identity"]))
    path = spec["path"]

    class Producer:
        spec = vo.WeightProductionSpec(producer_id=identity.producer.producer_id, outputs=(identity,),
                                       source_mode=vo.ProductionSourceMode.FINALIZED_MODEL)

        def produce(self, writer: Any) -> Any:
            with safe_open(path, framework="pt") as f:
                names = list(f.keys())
                specs = []
                for name in names:
                    sl = f.get_slice(name)
                    specs.append(vo.TensorWriteSpec(name=name, shape=tuple(sl.get_shape()),
                                                    dtype=torch.bfloat16))
                with writer.open_tensor_file("model.safetensors", tuple(specs)) as out:
                    for name in names:
                        out.write_tensor(name, f.get_tensor(name))
            return vo.ProductionMetadata(producer_schema=identity.producer.manifest_schema,
                                         restorer_schema=identity.producer.restorer_schema)

    store = upstream_store(vo, spec["root"], "manifest_and_metadata")
    t0 = time.perf_counter()
    result = store.get_or_build(vo.BuildRequest(identity), Producer(),
                                validation=vo.ValidationLevel.MANIFEST_AND_METADATA,
                                deadline=time.monotonic() + 600)
    elapsed = time.perf_counter() - t0
    if result.lease is None:
        raise RuntimeError(f"vLLM-Omni publication failed: {result.status} {result.failure}")
    result.lease.close()
    return {"publish_s": elapsed, "status": str(result.status.value), "how": how}


def worker_lease_pool(spec: dict[str, Any]) -> dict[str, Any]:
    """One client of the latency test; serves phases the driver sends on stdin, one JSON line each.

    Per phase: read the phase, warm up, print ``armed``, read ``GO_AT OFFSET``, sleep until the
    start (a barrier across clients), run the cycles, print the latencies. ``quit`` (or EOF) ends.
    """
    preload_client()
    client = hc.connect(spec["socket"])
    settle()
    print("ready", flush=True)
    clock = time.perf_counter_ns
    while True:
        line = sys.stdin.readline()
        if not line or line.strip() == "quit":
            break
        phase = json.loads(line)
        key, interval = phase["key"], phase.get("interval_ms", 0) / 1e3
        for _ in range(phase["warmup"]):
            client.acquire(key).close()
        print("armed", flush=True)
        go_at, offset = (float(x) for x in sys.stdin.readline().split())
        common.wait_until(go_at + offset * interval)
        acquire_us: list[float] = []
        release_us: list[float] = []
        start = time.monotonic()
        ping = phase.get("op") == "ping"
        for i in range(phase["cycles"]):
            if interval:  # paced (open loop): cycle i starts at its slot, or at once when late
                common.wait_until(start + i * interval)
            t0 = clock()
            if ping:  # the floor: one bare round trip on the same socket, answered inline
                client._connection.exchange({"op": "ping"}, want_fds=False)
                t1 = t2 = clock()
            else:
                lease = client.acquire(key)
                t1 = clock()
                lease.close()
                t2 = clock()
            acquire_us.append(round((t1 - t0) / 1e3, 1))
            release_us.append(round((t2 - t1) / 1e3, 1))
        end = time.monotonic()
        print(json.dumps({"acquire_us": acquire_us, "release_us": release_us, "start": start, "end": end}),
              flush=True)
    client.close()
    return {"done": True}


WORKERS = {"hwr": worker_hwr, "hwr-breakdown": worker_hwr_breakdown, "load_file": worker_load_file,
           "safe_open": worker_safe_open, "upstream": worker_upstream,
           "upstream-publish": worker_upstream_publish, "lease-pool": worker_lease_pool}


def settle() -> None:
    """``common.freeze_startup_heap``; every mode gets the same treatment."""
    common.freeze_startup_heap()


def worker_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    result = WORKERS[spec["mode"]](spec)
    print(json.dumps(result, separators=(",", ":")), flush=True)


# --- driver ----------------------------------------------------------------------------------
def run(spec: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    return common.run_worker([THIS, "--worker", json.dumps(spec)], timeout=timeout)


class ClientPool:
    """``n`` client processes, each with its own hwrd session, driven phase by phase.

    Processes start in batches of ``batch`` (each imports torch: staggered CPU and memory) and
    are reused by every phase; a phase with ``clients`` < ``n`` uses the first ``clients``.
    """

    def __init__(self, socket: str, n: int, batch: int = 4) -> None:
        spec = json.dumps({"mode": "lease-pool", "socket": socket})
        self.procs: list[subprocess.Popen[str]] = []
        try:
            for i in range(0, n, batch):
                started = [subprocess.Popen([sys.executable, THIS, "--worker", spec], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                           for _ in range(min(batch, n - i))]
                self.procs += started
                for proc in started:
                    self._expect(proc, "ready")
        except BaseException:
            self.close()
            raise

    def _expect(self, proc: subprocess.Popen[str], word: str) -> str:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line or (word and line.strip() != word):
            proc.kill()
            err = proc.stderr.read() if proc.stderr else ""
            raise RuntimeError(f"latency client said {line!r} instead of {word!r}: {err[-3000:]}")
        return line

    def _send(self, proc: subprocess.Popen[str], text: str) -> None:
        assert proc.stdin is not None
        proc.stdin.write(text + "\n")
        proc.stdin.flush()

    def phase(self, key: str, clients: int, cycles: int, warmup: int, interval_ms: float = 0.0,
              op: str = "lease") -> dict[str, Any]:
        """All of the first ``clients`` processes do ``cycles`` acquire+close cycles from one instant.

        Closed loop (back to back) by default; with ``interval_ms`` each client starts a cycle
        every interval, the clients' phases spread evenly over it. ``op="ping"``: a bare peer
        round trip instead (no lease work on either side: the floor the machine sets for any
        request/reply at that load; its "acquire" columns are the round trip).
        """
        procs = self.procs[:clients]
        command = json.dumps({"key": key, "cycles": cycles, "warmup": warmup, "interval_ms": interval_ms,
                              "op": op})
        for proc in procs:
            self._send(proc, command)
        for proc in procs:
            self._expect(proc, "armed")
        go_at = time.monotonic() + 0.25
        for i, proc in enumerate(procs):
            self._send(proc, f"{go_at} {i / clients}")
        results = [json.loads(self._expect(proc, "")) for proc in procs]
        acquire = [v / 1e3 for r in results for v in r["acquire_us"]]
        release = [v / 1e3 for r in results for v in r["release_us"]]
        span = max(r["end"] for r in results) - min(r["start"] for r in results)
        return {"clients": clients, "cycles_per_client": cycles, "interval_ms": interval_ms, "op": op,
                "acquire_ms": common.summarize(acquire), "release_ms": common.summarize(release),
                "cycle_ms": common.summarize([a + b for a, b in zip(acquire, release, strict=True)]),
                "cycles_per_s": len(acquire) / span if span > 0 else None, "span_s": span}

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    self._send(proc, "quit")
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=2.0, help="artifact size (default 2.0)")
    ap.add_argument("--tensors", type=int, default=200, help="tensor count, DiT-like shapes (default 200)")
    ap.add_argument("--repeats", type=int, default=5, help="fresh-process runs per mode (default 5)")
    ap.add_argument("--workdir", help="where the safetensors file and the stores go (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 128 MiB, 64 tensors, 2 repeats, 1 and 4 clients")
    ap.add_argument("--clients", default=None, help="comma-separated client counts for the latency test (default 1,32)")
    ap.add_argument("--cycles", type=int, default=None, help="acquire+release cycles per client (default 200)")
    ap.add_argument("--big-cycles", type=int, default=None,
                    help="cycles per client on the big artifact (default 20; 0 skips it)")
    ap.add_argument("--paced-hz", type=float, default=10.0,
                    help="also run the largest client count paced at this many cycles/s per client (0: skip)")
    ap.add_argument("--vllm-omni-src", default=os.environ.get("HWR_BENCH_VLLM_OMNI_SRC"),
                    help="a directory holding vllm_omni/ (source tree or unpacked wheel) when vLLM-Omni "
                         "is not installed; env HWR_BENCH_VLLM_OMNI_SRC")
    ap.add_argument("--latency-only", action="store_true",
                    help="only the acquire/release latency phases (no warm-start comparison)")
    ap.add_argument("--keep", action="store_true", help="keep the workdir and hwrd's log")
    ap.add_argument("--json-out", help="also write the JSON result line to this file")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return 0
    if args.quick:
        args.size_gib = min(args.size_gib, 0.125)
        args.tensors = min(args.tensors, 64)
        args.repeats = min(args.repeats, 2)
    clients = [int(c) for c in (args.clients or ("1,4" if args.quick else "1,32")).split(",") if c]
    cycles = args.cycles or (50 if args.quick else 200)
    big_cycles = args.big_cycles if args.big_cycles is not None else (5 if args.quick else 20)

    started = time.perf_counter()
    base = Path(args.workdir) if args.workdir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="hwb-warm-start-", dir=base))
    results: dict[str, Any] = {
        "benchmark": "warm_start", "hwr_version": hwr.__version__, "torch": torch.__version__,
        "safetensors": safetensors.__version__, "python": platform.python_version(),
        "cpus": os.cpu_count(), "machine": platform.machine(), "page_cache": "warm",
        "repeats": args.repeats, "quick": args.quick, "loadavg_start": os.getloadavg(),
    }
    if os.getloadavg()[0] > (os.cpu_count() or 1) / 2:
        print(f"WARNING: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs: other work "
              "competes for the CPU and the timings will be noisy", flush=True)
    try:
        run_all(args, work, results, clients, cycles, big_cycles)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    results["wall_s"] = round(time.perf_counter() - started, 1)
    results["loadavg_end"] = os.getloadavg()
    print(f"\n(total {results['wall_s']} s)\n")
    common.json_line(results, args.json_out)
    return 0


def run_all(args: argparse.Namespace, work: Path, results: dict[str, Any], clients: list[int],
            cycles: int, big_cycles: int) -> None:
    t_run = time.perf_counter()

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - t_run:6.1f} s] {text}", flush=True)

    shapes = dit_shapes(int(args.size_gib * GiB), args.tensors)
    t = time.perf_counter()
    tensors = make_tensors(shapes)
    nbytes = sum(x.nbytes for x in tensors.values())
    results |= {"artifact_bytes": nbytes, "tensor_count": len(tensors),
                "hidden": shapes["x_embedder.proj.bias"][0], "dtype": "bfloat16"}
    print(f"# warm start: {nbytes / GiB:.2f} GiB, {len(tensors)} bf16 tensors (hidden "
          f"{results['hidden']}), {args.repeats} fresh-process runs per mode, page cache warm")
    say(f"generated in {time.perf_counter() - t:.1f} s; workdir {work}")

    st_path = work / "model.safetensors"
    t = time.perf_counter()
    save_file(tensors, str(st_path))
    publish: dict[str, Any] = {"safetensors_save_file_s": time.perf_counter() - t}

    identity = hc.ArtifactIdentity.simple(f"bench/warm-start-dit-{nbytes}b-{len(tensors)}t")
    small_identity = hc.ArtifactIdentity.simple("bench/warm-start-small")
    vo, how = import_upstream(args.vllm_omni_src)
    results["vllm_omni"] = how
    with common.hwrd(work / "hwrd-root", keep=args.keep) as daemon:
        sock = str(daemon.socket)
        with hc.connect(sock) as client:
            t = time.perf_counter()
            key = client.publish(identity, tensors)
            publish["hwrd_publish_s"] = time.perf_counter() - t
            small_key = client.publish(small_identity, small_tensors())
        del tensors
        gc.collect()
        results["key"] = key

        modes: dict[str, dict[str, Any]] = {
            "hwr": {"mode": "hwr", "socket": sock, "key": key},
            "hwr-populate": {"mode": "hwr", "socket": sock, "key": key, "populate": True},
            "load_file": {"mode": "load_file", "path": str(st_path)},
            "load_file-pread": {"mode": "load_file", "path": str(st_path), "backend": "pread"},
            "safe_open": {"mode": "safe_open", "path": str(st_path)},
        }
        if vo is not None:
            vo_root = work / "vllm-omni-store"
            vo_root.mkdir(mode=0o700)
            pub = run({"mode": "upstream-publish", "root": str(vo_root), "path": str(st_path),
                       "identity": json.loads(identity.canonical_bytes),
                       "vllm_omni_src": args.vllm_omni_src}, timeout=900)
            publish["vllm_omni_publish_s"] = pub["publish_s"]
            for level in ("manifest_and_metadata", "full_checksum"):
                modes[f"vllm-omni-{level}"] = {
                    "mode": "upstream", "root": str(vo_root), "level": level,
                    "identity": json.loads(identity.canonical_bytes), "vllm_omni_src": args.vllm_omni_src}
        results["publish"] = publish
        say("publish: " + ", ".join(f"{k} {v:.2f} s" for k, v in publish.items()))

        if not args.latency_only:
            warm_start_runs(modes, sock, key, args.repeats, results, say)
        latency = []
        small, big = "small (8 tensors, 1 MiB)", f"big ({nbytes / GiB:.2f} GiB, {len(shapes)} tensors)"
        pool = ClientPool(sock, max(clients))
        try:
            for n in clients:
                latency.append({"artifact": small, **pool.phase(small_key, n, cycles, warmup=5)})
            if args.paced_hz:
                # The paced lease phase between two paced bare round trips (the floor), so that
                # the machine's wake-up and scheduling tail at this load is measured beside it.
                paced = {"cycles": max(10, cycles // 2), "warmup": 2, "interval_ms": 1e3 / args.paced_hz}
                floor = "bare round trip (peer ping)"
                latency.append({"artifact": floor, **pool.phase(small_key, max(clients), **paced, op="ping")})
                latency.append({"artifact": small, **pool.phase(small_key, max(clients), **paced)})
                latency.append({"artifact": floor, **pool.phase(small_key, max(clients), **paced, op="ping")})
            if big_cycles:
                for n in clients:
                    latency.append({"artifact": big, **pool.phase(key, n, big_cycles, warmup=2)})
        finally:
            pool.close()
        say("latency runs done")
        results["lease_latency"] = latency
        results["daemon_pss_kib"] = common.pss_kib(daemon.pid)

    print_report(results, vo is not None, how)


def warm_start_runs(modes: dict[str, dict[str, Any]], sock: str, key: str, repeats: int,
                    results: dict[str, Any], say: Any) -> None:
    # Warm the page cache (and check every mode sees the same bytes), then the timed runs.
    say("warming the page cache")
    checksums = {name: run(spec)["checksum"] for name, spec in modes.items()}
    if len(set(checksums.values())) != 1:
        raise RuntimeError(f"modes disagree on the bytes: {checksums}")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in modes}
    breakdowns: list[dict[str, Any]] = []
    for _ in range(repeats):
        for name, spec in modes.items():
            runs[name].append(run(spec))
        try:
            breakdowns.append(run({"mode": "hwr-breakdown", "socket": sock, "key": key}))
        except RuntimeError as exc:  # the client's internals moved: report, do not fail
            say(f"(breakdown skipped: {str(exc).splitlines()[-1]})")
    say("warm-start runs done")
    results["warm_start"] = summarize_runs(runs)
    results["warm_start_breakdown_ms"] = summarize_breakdown(breakdowns)


def summarize_runs(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, samples in runs.items():
        entry: dict[str, Any] = {}
        for field in ("usable_ms", "touch_ms", "connect_ms", "acquire_ms", "client_import_ms", "store_open_ms",
                      "lookup_ms"):
            values = [s[field] for s in samples if field in s]
            if values:
                entry[field] = {"median": common.median(values), "min": min(values),
                                "max": max(values), "runs": [round(v, 3) for v in values]}
        entry["pss_mib_after_touch"] = common.median([s["mem_kib"].get("Pss", 0) / 1024 for s in samples])
        entry["anon_mib_after_touch"] = common.median([s["mem_kib"].get("Anonymous", 0) / 1024
                                                       for s in samples])
        out[name] = entry
    return out


def summarize_breakdown(breakdowns: list[dict[str, Any]]) -> dict[str, float]:
    if not breakdowns:
        return {}
    steps = list(breakdowns[0]["steps_ms"])
    return {step: common.median([b["steps_ms"].get(step, 0.0) for b in breakdowns]) for step in steps}


LABELS = {
    "hwr": "(a) hwrd lease: connect + acquire",
    "hwr-populate": "(a') hwrd lease, populate=True (MAP_POPULATE)",
    "load_file": "(b) safetensors load_file (0.8 default backend=mmap: lazy views)",
    "load_file-pread": "(b') safetensors load_file(backend=\"pread\") (copy)",
    "safe_open": "(c) safetensors safe_open + get_tensor (mmap views)",
    "vllm-omni-manifest_and_metadata": "(d) vLLM-Omni 0.30 store.lookup, metadata validation (default)",
    "vllm-omni-full_checksum": "(d') vLLM-Omni 0.30 store.lookup, full checksum",
}


def print_report(results: dict[str, Any], have_vo: bool, how: str) -> None:
    results.setdefault("goals", {})
    if "warm_start" in results:
        print_warm_start(results, have_vo, how)
    print_latency(results)


def print_warm_start(results: dict[str, Any], have_vo: bool, how: str) -> None:
    ws = results["warm_start"]
    base, copy = ws["load_file"], ws["load_file-pread"]

    def ratios(ref: dict[str, Any], e: dict[str, Any]) -> str:
        return (f"{common.fmt_ratio(ref['usable_ms']['median'], e['usable_ms']['median'])} / "
                f"{common.fmt_ratio(ref['touch_ms']['median'], e['touch_ms']['median'])}")

    rows = []
    for name, label in LABELS.items():
        if name not in ws:
            if name.startswith("vllm-omni") and not have_vo:
                rows.append([label, f"not installed ({how.split('(')[0].strip()})", "", "", "", "", "", ""])
            continue
        e = ws[name]
        u, tch = e["usable_ms"], e["touch_ms"]
        rows.append([label, common.fmt_ms(u["median"]), common.fmt_ms(u["min"]), common.fmt_ms(tch["median"]),
                     common.fmt_ms(tch["min"]), ratios(base, e), ratios(copy, e),
                     f"{e['pss_mib_after_touch']:,.0f} / {e['anon_mib_after_touch']:,.0f}"])
    print(f"\n## Warm start: {results['artifact_bytes'] / GiB:.2f} GiB, {results['tensor_count']} bf16 tensors, "
          f"fresh process per run, page cache warm (median / min of {results['repeats']})\n")
    print(common.md_table(["path", "usable (median)", "usable (min)", "+touch (median)", "+touch (min)",
                           "x faster than (b) load_file, usable / +touch",
                           "x faster than (b') load_file pread copy, usable / +touch",
                           "worker PSS / anon MiB after touch"], rows))
    print("\n\"usable\": every tensor exists (for (a): connect + acquire, views made); \"+touch\": also one "
          "byte of every 4 KiB page read. Each run is a fresh process with torch, safetensors and hwr imported "
          "before the timer. Note: in safetensors 0.8 `load_file` defaults to backend=\"mmap\" and returns "
          "lazy mmap-backed tensors like (c); (b') is the copying load.")
    if have_vo:
        print(f"\nvLLM-Omni: {how}")
    a = ws["hwr"]
    am = a["usable_ms"]["median"]
    x_b, x_copy = base["usable_ms"]["median"] / am, copy["usable_ms"]["median"] / am
    print(f"\nGoal (a) usable <= 50 ms: {'met' if am <= 50 else 'MISSED'} ({am:.1f} ms). "
          f">= 20x faster than (b') the copying load_file: {'met' if x_copy >= 20 else 'MISSED'} ({x_copy:.1f}x). "
          f"Against (b), itself a lazy mmap: {x_b:.2f}x (reported, not judged).")
    results["goals"] = {"usable_le_50ms": am <= 50, "x_vs_load_file": x_b, "x_vs_load_file_copy": x_copy}
    extra = [["(a) import of the client's grpc stack (before the timer: hwr.client is lazy)",
              common.fmt_ms(a["client_import_ms"]["median"])],
             ["(a) connect()", common.fmt_ms(a["connect_ms"]["median"])],
             ["(a) acquire() incl. views", common.fmt_ms(a["acquire_ms"]["median"])]]
    for name, e in ws.items():
        if name.startswith("vllm-omni"):
            extra += [[f"({name}) store open", common.fmt_ms(e["store_open_ms"]["median"])],
                      [f"({name}) lookup", common.fmt_ms(e["lookup_ms"]["median"])]]
    for step, value in results.get("warm_start_breakdown_ms", {}).items():
        extra.append([f"breakdown: {step}", common.fmt_ms(value)])
    print("\n## Where the time goes (median)\n")
    print(common.md_table(["step", "time"], extra))
    publish = results.get("publish", {})
    if publish:
        print("\n## Publication of the same bytes (one run, informative)\n")
        print(common.md_table(["path", "seconds"], [[k, f"{v:.2f} s"] for k, v in publish.items()]))



def print_latency(results: dict[str, Any]) -> None:
    print("\n## Lease acquire/release latency (each client its own process and session; closed loop: back to "
          "back cycles; paced: one cycle per interval per client)\n")
    rows = []
    for r in results["lease_latency"]:
        acq, rel = r["acquire_ms"], r["release_ms"]
        loop = f"paced {1e3 / r['interval_ms']:g}/s each" if r["interval_ms"] else "closed"
        rows.append([r["artifact"], r["clients"], loop, r["clients"] * r["cycles_per_client"],
                     common.fmt_ms(acq["p50"]), common.fmt_ms(acq["p99"]), common.fmt_ms(acq["max"]),
                     common.fmt_ms(rel["p50"]), common.fmt_ms(rel["p99"]), common.fmt_ms(rel["max"]),
                     f"{r['cycles_per_s']:,.0f}" if r["cycles_per_s"] else "-"])
    print(common.md_table(["artifact", "clients", "loop", "cycles", "acquire p50", "acquire p99", "acquire max",
                           "release p50", "release p99", "release max", "cycles/s"], rows))
    floors = [r for r in results["lease_latency"] if r.get("op") == "ping"]
    if floors:
        worst = max(r["acquire_ms"]["p99"] for r in floors)
        results["paced_floor_p99_ms"] = worst
        print(f"\nFloor: a bare peer round trip (``ping``, no lease work) paced like the leases has p99 up to "
              f"{worst:.2f} ms on this machine at this load; the lease p99 below is measured between them.")
    for r in results["lease_latency"]:
        if r["clients"] >= 32 and r["artifact"].startswith("small"):
            p99 = max(r["acquire_ms"]["p99"], r["release_ms"]["p99"])
            loop = "paced" if r["interval_ms"] else "closed loop"
            results["goals"][f"p99_lt_5ms_{r['clients']}_clients_{loop.replace(' ', '_')}"] = p99 < 5
            if r["interval_ms"]:
                print(f"\nGoal p99 < 5 ms with {r['clients']} clients (small artifact, {loop}): "
                      f"{'met' if p99 < 5 else 'MISSED'} (worst of acquire/release p99: {p99:.2f} ms).")
            else:  # closed loop: the mean latency is set by throughput (Little's law), not judged
                rate = r["cycles_per_s"] or 0.0
                little = f"{r['clients'] / rate * 1e3:.2f} ms" if rate else "-"
                print(f"\nClosed loop, {r['clients']} clients (small artifact): worst of acquire/release p99 "
                      f"{p99:.2f} ms; Little's law puts the mean cycle at {r['clients']} / "
                      f"{rate:,.0f} cycles/s = {little} (reported, not judged).")
    daemon = results.get("daemon_pss_kib") or {}
    if daemon:
        print(f"\nhwrd PSS at the end: {daemon.get('Pss', 0) / 1024:,.0f} MiB "
              f"(Rss {daemon.get('Rss', 0) / 1024:,.0f} MiB)")


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
