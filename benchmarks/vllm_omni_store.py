"""vLLM-Omni's own filesystem store vs the hwrd-backed store, on the same artifact, warm lookups.

Both sides are driven through vLLM-Omni's own ``HostWeightRuntime.resolve`` (a warm LOCAL_HIT;
the lease is closed after each one and that close is timed apart), at the runtime's default validation level
(``manifest_and_metadata``) and at ``full_checksum``, with 1 and with N concurrent worker
processes (default 4). The artifact (``--size-mib`` of bf16 in ``--tensors`` tensors) is
published once into each store with ``publish_after_load`` and the same bytes; the page cache is
warm. Workers are forked after the imports, build their runtime, run ``--warmup`` untimed
lookups, meet at a barrier, then time ``--cycles`` lookups each.

What differs: vLLM-Omni's store opens and validates the artifact directory at every lookup (and
re-hashes every payload byte at ``full_checksum``); hwrd validated the bytes once at publication,
keeps them immutable, and a lookup is an ``Acquire`` RPC plus descriptor passing and mmap.

    .venv/bin/python benchmarks/vllm_omni_store.py [--size-mib 256] [--tensors 64] [--cycles 15]
        [--warmup 3] [--workers 1,4] [--json-out FILE]

Prints a markdown table (p50/p90 per store, level and concurrency; ratio = filesystem p50 /
hwrd p50) then one JSON line. Needs the ``vllm`` extra (vLLM-Omni 0.30) installed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import torch

LEVELS = ("manifest_and_metadata", "full_checksum")
STORES = ("vllm-omni-fs", "hwrd")


def make_tensors(size_mib: int, n: int) -> dict[str, torch.Tensor]:
    per = max(1, (size_mib << 20) // (2 * n))
    cols = 1024
    rows = max(1, per // cols)
    g = torch.Generator().manual_seed(0)
    return {f"blocks.{i:03d}.weight": torch.randn(rows, cols, generator=g).to(torch.bfloat16) for i in range(n)}


def identity(size_mib: int, n: int) -> Any:
    from vllm_omni.host_weight_runtime import (
        AdaptationIdentity,
        ComponentIdentity,
        ProducerIdentity,
        RuntimeWeightLayout,
        WeightArtifactIdentity,
        WeightRepresentation,
        WeightSourceIdentity,
    )

    return WeightArtifactIdentity(
        1, WeightSourceIdentity("bench/vllm-omni-store", "main", f"synthetic:{size_mib}MiB:{n}"),
        ComponentIdentity("transformer", "diffusion-transformer"), WeightRepresentation("final-layout", "bfloat16"),
        RuntimeWeightLayout("dense"), AdaptationIdentity(),
        ProducerIdentity("bench-producer", "1", "bench", "bench-manifest-1", "bench-restorer-1"))


class Producer:
    def __init__(self, ident: Any, tensors: dict[str, torch.Tensor]) -> None:
        from vllm_omni.host_weight_runtime import LookupPhase, WeightProductionSpec
        from vllm_omni.host_weight_runtime.protocols import ProductionSourceMode

        self.spec = WeightProductionSpec("bench-producer", (ident,), ProductionSourceMode.FINALIZED_MODEL,
                                         lookup_phase=LookupPhase.POST_LOAD_ONLY)
        self.tensors = tensors

    def produce(self, writer: Any) -> Any:
        from vllm_omni.host_weight_runtime import ProductionMetadata, TensorWriteSpec

        specs = tuple(TensorWriteSpec(n, tuple(t.shape), t.dtype) for n, t in sorted(self.tensors.items()))
        with writer.open_tensor_file("model-00001-of-00001.safetensors", specs, ordered=True) as out:
            for name, _ in sorted(self.tensors.items()):
                out.write_tensor(name, self.tensors[name])
        return ProductionMetadata("bench-manifest-1", "bench-restorer-1")


def runtime(store: str, level: str, root: Path, socket: Path) -> Any:
    from vllm_omni.host_weight_runtime import (
        HostWeightRuntime,
        HostWeightRuntimeConfig,
        IntegrityPolicy,
        ProductionPolicy,
        RuntimeMode,
        StorageDomainPolicy,
        ValidationLevel,
    )
    from vllm_omni.host_weight_runtime.filesystem import detect_storage_class

    from hwr.dlo_backend.vllm_plugin.config import DaemonTarget
    from hwr.dlo_backend.vllm_plugin.store import HwrdHostWeightStore

    config = HostWeightRuntimeConfig(
        mode=RuntimeMode.PREFERRED, domain=StorageDomainPolicy(root=root, storage_class=detect_storage_class(root)),
        production=ProductionPolicy(allow_local_build=False, allow_post_load_publish=True),
        integrity=IntegrityPolicy(local_lookup=ValidationLevel(level)))
    if store == "hwrd":
        return HostWeightRuntime(config, HwrdHostWeightStore(DaemonTarget(socket, "benchmark")))
    return HostWeightRuntime.from_config(config)  # vLLM-Omni's filesystem store (plugin not installed)


def worker(index: int, spec: dict[str, Any], barrier: Any, queue: Any) -> None:
    try:
        from vllm_omni.host_weight_runtime import ResolutionOutcome

        ident = identity(spec["size_mib"], spec["tensors"])
        for store in STORES:
            for level in LEVELS:
                rt = runtime(store, level, Path(spec["root"]), Path(spec["socket"]))
                for _ in range(spec["warmup"]):
                    rt.resolve(ident).lease.close()
                barrier.wait(timeout=600)
                samples, closes = [], []
                for _ in range(spec["cycles"]):
                    t0 = time.perf_counter()
                    result = rt.resolve(ident)
                    t1 = time.perf_counter()
                    assert result.report.outcome is ResolutionOutcome.LOCAL_HIT, result.report
                    result.lease.close()
                    samples.append((t1 - t0) * 1000)
                    closes.append((time.perf_counter() - t1) * 1000)
                queue.put({"worker": index, "store": store, "level": level, "samples": samples, "closes": closes})
                closer = getattr(rt.store, "close", None)
                if closer is not None:
                    closer()
                barrier.wait(timeout=600)
    except BaseException as exc:
        queue.put({"worker": index, "error": repr(exc)})
        barrier.abort()
        raise


def measure(spec: dict[str, Any], workers: int) -> dict[tuple[str, str, str], list[float]]:
    ctx = mp.get_context("fork")  # the parent already imported vLLM-Omni: don't pay it per worker
    barrier, queue = ctx.Barrier(workers), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(i, spec, barrier, queue)) for i in range(workers)]
    for p in procs:
        p.start()
    out: dict[tuple[str, str, str], list[float]] = {}
    for _ in range(workers * len(STORES) * len(LEVELS)):
        item = queue.get(timeout=1800)
        if "error" in item:
            raise RuntimeError(f"worker {item['worker']} failed: {item['error']}")
        out.setdefault((item["store"], item["level"], "resolve"), []).extend(item["samples"])
        out.setdefault((item["store"], item["level"], "close"), []).extend(item["closes"])
    for p in procs:
        p.join(60)
    return out


def publish(size_mib: int, n: int, root: Path, socket: Path) -> int:
    from vllm_omni.host_weight_runtime import PostLoadPublicationOutcome

    tensors = make_tensors(size_mib, n)
    ident = identity(size_mib, n)
    for store in STORES:
        rt = runtime(store, LEVELS[0], root, socket)
        report = rt.publish_after_load(ident, producer=Producer(ident, tensors))
        if report.outcome not in (PostLoadPublicationOutcome.PUBLISHED, PostLoadPublicationOutcome.ALREADY_PRESENT):
            raise RuntimeError(f"publication into {store} failed: {report.failure}")
        closer = getattr(rt.store, "close", None)
        if closer is not None:
            closer()
    return sum(t.numel() * t.element_size() for t in tensors.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--cycles", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--workers", default="1,4", help="comma-separated concurrency levels")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    import vllm_omni  # noqa: F401  (imported once, before the workers fork)

    tmp = common.short_tmpdir("hwrvo-")
    try:
        root = tmp / "vllm-omni-root"
        root.mkdir(mode=0o700)
        with common.hwrd() as daemon:
            nbytes = publish(args.size_mib, args.tensors, root, daemon.socket)
            spec = {"size_mib": args.size_mib, "tensors": args.tensors, "cycles": args.cycles,
                    "warmup": args.warmup, "root": str(root), "socket": str(daemon.socket)}
            results: dict[str, Any] = {"bytes": nbytes, "tensors": args.tensors, "cycles": args.cycles,
                                       "cpus": os.cpu_count(), "rows": []}
            rows = []
            for workers in [int(w) for w in args.workers.split(",")]:
                samples = measure(spec, workers)
                for level in LEVELS:
                    fs, hw = (common.summarize(samples[(s, level, "resolve")]) for s in STORES)
                    fs_close, hw_close = (common.summarize(samples[(s, level, "close")]) for s in STORES)
                    rows.append([level, workers, common.fmt_ms(fs["p50"]), common.fmt_ms(fs["p90"]),
                                 common.fmt_ms(hw["p50"]), common.fmt_ms(hw["p90"]),
                                 common.fmt_ratio(fs["p50"], hw["p50"]),
                                 common.fmt_ms(fs_close["p50"]), common.fmt_ms(hw_close["p50"])])
                    results["rows"].append({"level": level, "workers": workers, "vllm_omni_fs_ms": fs,
                                            "hwrd_ms": hw, "vllm_omni_fs_close_ms": fs_close,
                                            "hwrd_close_ms": hw_close, "hwrd_faster": hw["p50"] < fs["p50"]})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nWarm lookup = vLLM-Omni's HostWeightRuntime.resolve (LOCAL_HIT); lease close timed apart, "
          f"{nbytes / 2**20:.0f} MiB in {args.tensors} tensors, {args.cycles} lookups per worker\n")
    print(common.md_table(["validation", "workers", "vLLM-Omni fs p50", "fs p90", "hwrd p50", "hwrd p90",
                           "hwrd faster by", "fs close p50", "hwrd close p50"], rows))
    results["hwrd_faster_everywhere"] = all(r["hwrd_faster"] for r in results["rows"])
    print()
    common.json_line(results, args.json_out)


if __name__ == "__main__":
    main()
