"""hwrd against every loader installed here, on the same bytes: one table, ratios to hwrd.

One DiT-shaped bf16 safetensors file (``--size-mib``, ``--tensors``; the shapes and bytes of
``warm_start.py``) is published to a real hwrd (and, when vLLM-Omni 0.30 imports, into its
in-process filesystem store); then each mode runs ``--repeats`` times in a fresh process, the
modes interleaved, page cache warm:

- ``hwrd``: ``connect()`` + ``acquire(key)`` (read-only shared-mapping views);
- ``safe_open``: ``safetensors.safe_open`` + ``get_tensor`` for every name (mmap views);
- ``load_file``: ``safetensors.torch.load_file(p)`` (0.8: safe_open mmap underneath);
- ``load_file pread``: ``load_file(p, backend="pread")`` (the copying path);
- ``runai``: Run:ai Model Streamer 0.17 ``SafetensorsStreamer().stream_file(p)`` +
  ``get_tensors()`` on CPU, with ``RUNAI_STREAMER_CONCURRENCY`` and
  ``RUNAI_STREAMER_MEMORY_LIMIT`` pinned (unless set in the environment) so runs are comparable;
- ``fastsafetensors``: 0.5 ``fastsafe_open(p, device="cpu", nogds=True)`` + ``get_tensor``
  (its defaults: O_DIRECT on local disks, so a warm page cache does not help it);
- ``vllm-omni``: vLLM-Omni 0.30 ``FilesystemHostWeightStore.lookup`` at its default validation
  level (``manifest_and_metadata``).

Imports (torch, safetensors, hwr with the gRPC modules its ``connect()`` loads lazily, the
peer's package) happen before the timer; "usable" stops
when every tensor exists, "+touch" after one byte of every 4 KiB page was read too (the
checksums of all modes must agree, which also proves the same bytes were served). A peer that is
not installed is listed as such, never silently dropped.

    .venv/bin/python benchmarks/peers.py [--size-mib 256] [--tensors 100] [--repeats 5] [--json-out F]

Prints a markdown table, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import warm_start as ws
from safetensors.torch import save_file

import hwr.client as hc

THIS = str(Path(__file__).resolve())
MiB = 1 << 20
# Pinned for comparable runs (the streamer is noisy here with its defaults): one reader per core
# and no memory cap (the whole file in one buffer, so the yielded tensors stay valid).
RUNAI_ENV = {"RUNAI_STREAMER_CONCURRENCY": str(os.cpu_count() or 2), "RUNAI_STREAMER_MEMORY_LIMIT": "-1"}


def worker_runai(spec: dict[str, Any]) -> dict[str, Any]:
    from runai_model_streamer import SafetensorsStreamer

    t0 = time.perf_counter()
    with SafetensorsStreamer() as streamer:
        streamer.stream_file(spec["path"])
        tensors = dict(streamer.get_tensors())
        t1 = time.perf_counter()
        return ws._result(t0, t1, tensors)


def worker_fastsafetensors(spec: dict[str, Any]) -> dict[str, Any]:
    from fastsafetensors import fastsafe_open

    t0 = time.perf_counter()
    with fastsafe_open(spec["path"], device="cpu", nogds=True) as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not a dict
        t1 = time.perf_counter()
        return ws._result(t0, t1, tensors)  # inside: the tensors live in the loader's buffer


def preimport_hwr() -> None:
    """Import what ``hwr.client.connect`` loads lazily (the client, lease, gRPC channel modules).

    Every mode imports its libraries before its timer; without this the hwrd mode alone would
    time about 130 ms of imports (gRPC) inside ``connect()``. A worker that has not yet imported
    them pays that once per process: warm_start.py's breakdown shows it.
    """
    import importlib

    for name in ("hwr.client.client", "hwr.client.lease", "grpc", "grpc._channel"):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


WORKERS = {**ws.WORKERS, "runai": worker_runai, "fastsafetensors": worker_fastsafetensors}


def run(spec: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    env = RUNAI_ENV if spec["mode"] == "runai" else None
    return common.run_worker([THIS, "--worker", json.dumps(spec)], timeout=timeout,
                             env={k: os.environ.get(k, v) for k, v in (env or {}).items()})


def installed(module: str) -> str | None:
    """The version of an installed peer package, or None."""
    if importlib.util.find_spec(module) is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    dist = {"runai_model_streamer": "runai-model-streamer"}.get(module, module)
    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


LABELS = {
    "hwrd": "hwrd lease (connect + acquire)",
    "safe_open": "safetensors safe_open + get_tensor (mmap)",
    "load_file": "safetensors load_file (0.8: mmap)",
    "load_file-pread": "safetensors load_file(backend=\"pread\") (copy)",
    "runai": "Run:ai Model Streamer stream_file + get_tensors",
    "fastsafetensors": "fastsafetensors fastsafe_open(nogds) + get_tensor",
    "vllm-omni": "vLLM-Omni 0.30 FilesystemHostWeightStore.lookup (metadata)",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json-out")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        if spec["mode"] == "hwr":
            preimport_hwr()
        print(json.dumps(WORKERS[spec["mode"]](spec), separators=(",", ":")), flush=True)
        return 0

    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="hwr-peers-"))
    versions = {m: installed(m) for m in ("runai_model_streamer", "fastsafetensors")}
    vo, how = ws.import_upstream(None)
    results: dict[str, Any] = {"benchmark": "peers", "versions": versions, "vllm_omni": how,
                               "runai_env": {k: os.environ.get(k, v) for k, v in RUNAI_ENV.items()},
                               "repeats": args.repeats, "loadavg_start": os.getloadavg()}
    try:
        tensors = ws.make_tensors(ws.dit_shapes(args.size_mib * MiB, args.tensors))
        nbytes = sum(t.nbytes for t in tensors.values())
        results |= {"artifact_bytes": nbytes, "tensor_count": len(tensors)}
        path = work / "model.safetensors"
        save_file(tensors, str(path))
        identity = hc.ArtifactIdentity.simple(f"bench/peers-{nbytes}b-{len(tensors)}t")
        with common.hwrd(work / "hwrd-root") as daemon:
            with hc.connect(str(daemon.socket)) as client:
                key = client.publish(identity, tensors)
            del tensors
            gc.collect()
            modes: dict[str, dict[str, Any]] = {
                "hwrd": {"mode": "hwr", "socket": str(daemon.socket), "key": key},
                "safe_open": {"mode": "safe_open", "path": str(path)},
                "load_file": {"mode": "load_file", "path": str(path)},
                "load_file-pread": {"mode": "load_file", "path": str(path), "backend": "pread"},
            }
            if versions["runai_model_streamer"]:
                modes["runai"] = {"mode": "runai", "path": str(path)}
            if versions["fastsafetensors"]:
                modes["fastsafetensors"] = {"mode": "fastsafetensors", "path": str(path)}
            if vo is not None:
                root = work / "vllm-omni-store"
                root.mkdir(mode=0o700)
                ident = json.loads(identity.canonical_bytes)
                run({"mode": "upstream-publish", "root": str(root), "path": str(path), "identity": ident})
                modes["vllm-omni"] = {"mode": "upstream", "root": str(root), "level": "manifest_and_metadata",
                                      "identity": ident}
            checksums = {name: run(spec)["checksum"] for name, spec in modes.items()}  # warms the cache
            if len(set(checksums.values())) != 1:
                raise RuntimeError(f"loaders disagree on the bytes: {checksums}")
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in modes}
            for _ in range(args.repeats):
                for name, spec in modes.items():
                    runs[name].append(run(spec))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = ws.summarize_runs(runs)
    results["modes"] = summary
    results["wall_s"] = round(time.perf_counter() - started, 1)
    results["loadavg_end"] = os.getloadavg()
    report(results, versions, how)
    common.json_line(results, args.json_out)
    return 0


def report(results: dict[str, Any], versions: dict[str, str | None], how: str) -> None:
    modes = results["modes"]
    ref = modes["hwrd"]
    rows = []
    for name, label in LABELS.items():
        if name not in modes:
            why = {"runai": "runai-model-streamer", "fastsafetensors": "fastsafetensors"}.get(name, how)
            rows.append([label, f"not installed ({why})", "", "", "", ""])
            continue
        e = modes[name]
        u, t = e["usable_ms"]["median"], e["touch_ms"]["median"]
        rows.append([label, common.fmt_ms(u), common.fmt_ms(t),
                     common.fmt_ratio(u, ref["usable_ms"]["median"]),
                     common.fmt_ratio(t, ref["touch_ms"]["median"]),
                     f"{e['pss_mib_after_touch']:,.0f} / {e['anon_mib_after_touch']:,.0f}"])
        if name == "hwrd":  # the same runs without connect(): a worker that already has a session
            conn = e["connect_ms"]["median"]
            rows.append(["hwrd lease, session already open (acquire only, same runs)",
                         common.fmt_ms(e["acquire_ms"]["median"]), common.fmt_ms(t - conn), "", "", ""])
    print(f"\n## Peers on the same bytes: {results['artifact_bytes'] / MiB:.0f} MiB, {results['tensor_count']} "
          f"bf16 tensors, fresh process per run, page cache warm (median of {results['repeats']})\n")
    print(common.md_table(["loader", "usable", "+touch", "hwrd x faster (usable)", "hwrd x faster (+touch)",
                           "worker PSS / anon MiB"], rows))
    print(f"\nversions: {json.dumps(versions)}; vLLM-Omni: {how}; Run:ai env {json.dumps(results['runai_env'])}")
    copying = [n for n in ("load_file-pread", "runai", "fastsafetensors") if n in modes]
    if copying:
        best = min(copying, key=lambda n: modes[n]["touch_ms"]["median"])
        x = modes[best]["touch_ms"]["median"] / ref["touch_ms"]["median"]
        print(f"\nhwrd (+touch) vs the fastest copying loader ({best}): {x:.1f}x faster.")
        results["hwrd_x_vs_fastest_copying_touch"] = x


if __name__ == "__main__":
    sys.exit(main())
