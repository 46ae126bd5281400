"""Warm starts and node memory through vLLM-Omni 0.30's own loader: canonical, its own store, hwrd.

Every start is a fresh worker process of the test harness (``tests/vllm_plugin/omni_harness``:
vLLM-Omni's own ``DiffusersPipelineLoader.load_model``, its pipeline classes and DLO over gloo;
fakes only at the accelerator boundary, which on a CPU machine makes the "device" host memory
too). The DiT is vLLM-Omni's FLUX.2-klein ``Flux2Transformer2DModel`` with a fixed block count
(4 double + 12 single blocks: the same tensors at every size) whose width sets its bytes, so
metadata costs are equal across sizes and only the bytes grow.

Section ``warm`` (DP 1, rank-local DLO), per DiT size, interleaved and best of ``--rounds``:

- ``canonical``: ``preferred`` with hwrd down (a socket nobody listens on): vLLM-Omni's canonical
  load from the checkpoint (the page cache holds it: it was just written and read);
- ``own store warm``: ``preferred`` without hwrd: a LOCAL_HIT from vLLM-Omni's own filesystem
  store in the runtime root (published by a cold start before the rounds);
- ``hwrd warm``: ``required`` through hwrd: a LOCAL_HIT leased from hwrd (published likewise).

Columns: ``load_model`` seconds (the call ``DiffusionModelRunner`` makes) and seconds from the
worker's spawn to its first DLO forward (imports and distributed setup included).

Section ``node`` (DP 4, DLO AllGather): the node's memory as it feels it. Before each run the page
cache of the checkpoint's and hwrd's weight files is dropped (``posix_fadvise(DONTNEED)``: only
those files); the drop of ``MemAvailable`` from just before the ranks start to their first forward
(page cache, hwrd's share and every process included) is measured beside the ranks' aggregate
PSS. Each path runs with a tiny DiT and with the ``--node-gib`` DiT; the node memory for the DiT is
the difference of the two drops (what the ranks' own runtime costs cancels). Paths: ``vllm-omni``
(no hwrd: with AllGather vLLM-Omni skips its runtime and loads canonically on every rank, then
copies each rank's shard into private memory) and ``hwrd`` (``required``: a LOCAL_HIT on every
rank, hwr's rings gather from the shared mapping). Other processes on the node move
``MemAvailable`` too: run it on a quiet machine. Beside it, a figure other processes cannot move:
the ranks' (and hwrd's) aggregate PSS plus the page cache of the weight files that no process
maps at the first forward (``mincore``; the checkpoint a canonical load read), with the same
tiny-DiT difference.

    .venv/bin/python benchmarks/vllm_omni_warm.py [--sizes-mib 64,1024,2048] [--rounds 2]
        [--node-gib 1] [--sections warm,node] [--json-out FILE] [--dry-run]

``--dry-run``: one round at 8 and 32 MiB and a DP 2 node section at 32 MiB (checks the script
works). Prints markdown tables, then one JSON line. Needs the ``vllm`` extra (vLLM-Omni 0.30).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import mmap
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "vllm_plugin"))
sys.path.insert(0, str(HERE.parent / "tests"))

import common  # noqa: E402

GIB, MIB = float(1 << 30), float(1 << 20)
# 4 double + 12 single blocks at 8 heads of 128 (hidden 1024): about 0.545 GiB of bf16; the
# bytes grow with the square of the width.
_BLOCKS = {"num_layers": 4, "num_single_layers": 12, "attention_head_dim": 128, "joint_attention_dim": 1024,
           "mlp_ratio": 3.0, "axes_dims_rope": [32, 32, 32, 32]}
_BASE_HEADS, _BASE_GIB = 8, 0.545


def dit_config(size_mib: float) -> dict[str, Any]:
    """Flux2Transformer2DModel arguments for about ``size_mib`` of weights, fixed block count (pure)."""
    heads = max(1, round(_BASE_HEADS * math.sqrt(size_mib / 1024 / _BASE_GIB)))
    return {**_BLOCKS, "num_attention_heads": heads}


def _mem_available() -> int:
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))


def _pss(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        return next(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Pss:"))


def _evict(*folders: Path) -> None:
    """Drop the page cache of every regular file under ``folders`` (those files only)."""
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file() and not path.is_symlink():
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def _cached(*folders: Path) -> int:
    """Bytes of the files under ``folders`` resident in the page cache (``mincore``)."""
    page = mmap.PAGESIZE
    total = 0
    for folder in folders:
        for path in folder.rglob("*"):
            if not path.is_file() or path.is_symlink() or not path.stat().st_size:
                continue
            size = path.stat().st_size
            fd = os.open(path, os.O_RDONLY)
            try:
                address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if address in (None, ctypes.c_void_p(-1).value):
                    continue
                try:
                    vector = (ctypes.c_ubyte * (-(-size // page)))()
                    if _libc.mincore(address, size, vector) == 0:
                        total += sum(1 for v in vector if v & 1) * page
                finally:
                    _libc.munmap(address, size)
            finally:
                os.close(fd)
    return total


def _dit_bytes(checkpoint: Path) -> int:
    return sum(p.stat().st_size for p in (checkpoint / "transformer").glob("*.safetensors"))


def _first(results: list[Any], name: str) -> dict[str, Any]:
    ranks = [r[name].expect_ok().raw for r in results]
    return {"outcome": ranks[0]["outcome"], "load_s": max(r["load_s"] for r in ranks),
            "start_s": max(r["first_forward"]["seconds_from_start"] for r in ranks),
            "pss": sum(r["first_forward"]["Pss"] for r in ranks),
            "mem_available": min(r["first_forward"]["MemAvailable"] for r in ranks),
            "rings": [ring for r in ranks for ring in r["offload"].get("hwr_rings", [])],
            "equal": all(r["offload"]["outputs"][0]["sha256"] == r["straight"]["sha256"] for r in ranks)}


class Bench:
    def __init__(self, harness: Any, daemon: Any, base: Path) -> None:
        self.harness, self.daemon, self.base = harness, daemon, base
        self.dead = str(base / "no-hwrd.sock")
        self.runs = 0

    def run(self, size_mib: float, start: Any, *, topology: Any = None, write: bool = False) -> list[Any]:
        self.runs += 1
        tag = f"{size_mib:g}"
        out = self.base / f"out-{self.runs}"
        try:
            return self.harness.run(
                "flux2-klein", checkpoint=self.base / f"ckpt-{tag}", runtime_root=self.root(size_mib), out=out,
                topology=topology or self.harness.Topology(), starts=[start], write_checkpoint=write, timeout=3600,
                env={"HWR_BENCH_MEASURE": "1", "HWR_BENCH_FLUX2_DIT": json.dumps(dit_config(size_mib))})
        finally:
            shutil.rmtree(out, ignore_errors=True)

    def root(self, size_mib: float) -> Path:
        root = self.base / f"runtime-{size_mib:g}"
        root.mkdir(exist_ok=True)
        return root

    def checkpoint(self, size_mib: float) -> Path:
        return self.base / f"ckpt-{size_mib:g}"

    # warm ----------------------------------------------------------------------------------
    def warm(self, sizes: list[float], rounds: int) -> dict[str, Any]:
        start = self.harness.Start
        socket = str(self.daemon.socket)
        out: dict[str, Any] = {}
        for size in sizes:  # write the checkpoint, publish into both stores
            self.run(size, start("s", socket=self.dead, forwards=1), write=True)
            self.run(size, start("s", forwards=1))  # own store: cold, publishes into the runtime root
            self.run(size, start("s", socket=socket, forwards=1))  # hwrd: cold, publishes into hwrd
            out[f"{size:g}"] = {"dit_bytes": _dit_bytes(self.checkpoint(size)), "rows": {}}
        paths = (("canonical", {"socket": self.dead}), ("own store warm", {}),
                 ("hwrd warm", {"mode": "required", "socket": socket}))
        for _ in range(rounds):
            for size in sizes:
                for label, kwargs in paths:
                    row = _first(self.run(size, start("s", forwards=1, **kwargs)), "s")
                    best = out[f"{size:g}"]["rows"].setdefault(label, {"load_s": [], "start_s": [], "outcome": set()})
                    best["load_s"].append(row["load_s"])
                    best["start_s"].append(row["start_s"])
                    best["outcome"].add(row["outcome"])
        for entry in out.values():
            for row in entry["rows"].values():
                row["outcome"] = sorted(row["outcome"])
                row["best_load_s"], row["best_start_s"] = min(row["load_s"]), min(row["start_s"])
        return out

    # node ----------------------------------------------------------------------------------
    def node(self, dp: int, tiny_mib: float, size_mib: float) -> dict[str, Any]:
        start = self.harness.Start
        socket = str(self.daemon.socket)
        topology = self.harness.Topology(world_size=dp, data_parallel_size=dp, use_allgather=True)
        for size in (tiny_mib, size_mib):  # checkpoints, and hwrd's artifacts (one serves every DP size)
            if not self.checkpoint(size).exists():
                self.run(size, start("s", socket=self.dead, forwards=1), write=True)
            self.run(size, start("s", socket=socket, forwards=1))
        out: dict[str, Any] = {}
        for size in (tiny_mib, size_mib):
            for label, kwargs in (("vllm-omni", {}), ("hwrd", {"mode": "required", "socket": socket})):
                _evict(self.checkpoint(size), Path(self.daemon.root) / "artifacts")
                time.sleep(1.0)
                before = _mem_available()
                row = _first(self.run(size, start("s", forwards=1, **kwargs), topology=topology), "s")
                row["drop"] = before - row.pop("mem_available")
                if label == "hwrd":
                    row["pss"] += _pss(self.daemon.pid)
                # Page cache the ranks left behind that no process maps (so PSS misses it): the
                # checkpoint a canonical load read. hwrd's artifact files are mapped by every
                # rank at the first forward (in their PSS); the other path's files were evicted.
                row["checkpoint_cache"] = _cached(self.checkpoint(size) / "transformer")
                row["artifact_cache"] = _cached(Path(self.daemon.root) / "artifacts")
                row["pss_plus_cache"] = row["pss"] + row["checkpoint_cache"]
                row["slots"] = sum(2 * ring["slot_bytes"] for ring in row["rings"])
                row["shard_source"] = row["rings"][0]["shard_source"] if row["rings"] else "vllm-omni"
                del row["rings"]
                out.setdefault(f"{size:g}", {"dit_bytes": _dit_bytes(self.checkpoint(size))})[label] = row
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", default="64,1024,2048")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--node-gib", type=float, default=1.0)
    parser.add_argument("--node-dp", type=int, default=4)
    parser.add_argument("--sections", default="warm,node")
    parser.add_argument("--json-out")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    sizes = [8.0, 32.0] if args.dry_run else [float(x) for x in args.sizes_mib.split(",")]
    rounds = 1 if args.dry_run else args.rounds
    node_mib, node_dp = (32.0, 2) if args.dry_run else (args.node_gib * 1024, args.node_dp)
    sections = set(args.sections.split(","))
    import omni_harness

    base = common.short_tmpdir("hwb-omniw-")
    results: dict[str, Any] = {"loadavg_before": Path("/proc/loadavg").read_text().split()[:3]}
    try:
        with common.hwrd() as daemon:
            bench = Bench(omni_harness, daemon, base)
            if "warm" in sections:
                results["warm"] = bench.warm(sizes, rounds)
            if "node" in sections:
                results["node"] = {"dp": node_dp, "sizes": bench.node(node_dp, 1.0, node_mib)}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    results["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    print(f"load average before {' '.join(results['loadavg_before'])}, after {' '.join(results['loadavg_after'])}")
    if "warm" in results:
        _report_warm(results["warm"], rounds)
    if "node" in results:
        _report_node(results["node"])
    common.json_line(results, args.json_out)
    return 0


def _report_warm(warm: dict[str, Any], rounds: int) -> None:
    rows = []
    for entry in warm.values():
        own = entry["rows"]["own store warm"]
        for label, row in entry["rows"].items():
            rows.append([f"{entry['dit_bytes'] / MIB:.0f} MiB", label, "/".join(row["outcome"]),
                         f"{row['best_load_s']:.3f}", " ".join(f"{x:.3f}" for x in row["load_s"]),
                         f"{row['best_start_s']:.1f}", common.fmt_ratio(own["best_load_s"], row["best_load_s"])])
    print(f"\nWarm starts, DP 1, fresh process each (best of {rounds}; load_model speedup vs the own store):")
    print(common.md_table(["DiT", "path", "outcome", "load_model s", "all", "spawn->1st fwd s", "vs own store"], rows))
    entries = list(warm.values())
    small, large = entries[0]["rows"]["hwrd warm"]["best_load_s"], None
    for entry in entries:
        if abs(entry["dit_bytes"] / GIB - 1.0) < 0.2:
            large = entry
    if large is not None:
        hwrd, own = large["rows"]["hwrd warm"]["best_load_s"], large["rows"]["own store warm"]["best_load_s"]
        print(f"Goal, hwrd warm load_model at ~1 GiB <= 1.3x at the smallest: {hwrd:.3f} s vs {small:.3f} s = "
              f"{hwrd / small:.2f}x ({'met' if hwrd <= 1.3 * small else 'not met'})")
        print(f"Goal, >= 3x faster than the own store warm at ~1 GiB: {own / hwrd:.2f}x "
              f"({'met' if own >= 3 * hwrd else 'not met'})")
    never = all(e["rows"]["hwrd warm"]["best_load_s"] <= e["rows"]["own store warm"]["best_load_s"] for e in entries)
    print(f"Goal, hwrd warm never slower than the own store warm: {'met' if never else 'not met'}")


def _report_node(node: dict[str, Any]) -> None:
    sizes = list(node["sizes"].values())
    rows = []
    for entry in sizes:
        for label in ("vllm-omni", "hwrd"):
            row = entry[label]
            rows.append([f"{entry['dit_bytes'] / MIB:.0f} MiB", label, row["outcome"] or "-", row["shard_source"],
                         f"{row['drop'] / GIB:.2f}", f"{row['pss'] / GIB:.2f}",
                         f"{row['checkpoint_cache'] / GIB:.2f}", f"{row['artifact_cache'] / GIB:.2f}",
                         f"{row['pss_plus_cache'] / GIB:.2f}", f"{row['slots'] / GIB:.2f}",
                         f"{row['start_s']:.1f}", row["equal"]])
    print(f"\nDP {node['dp']} AllGather, node memory at the first forward (page cache of the weights dropped before):")
    print(common.md_table(["DiT", "path", "outcome", "shards from", "MemAvailable drop GiB", "aggregate PSS GiB",
                           "checkpoint cache GiB", "artifact cache GiB", "PSS + unmapped cache GiB", "slots GiB",
                           "spawn->1st fwd s", "DLO == loader"], rows))
    tiny, big = sizes[0], sizes[-1]
    artifact = big["dit_bytes"]
    for label in ("vllm-omni", "hwrd"):
        dit = big[label]["drop"] - tiny[label]["drop"]
        node[f"dit_node_bytes_{label}"] = dit
        ratio = dit / (artifact + big[label]["slots"])
        by_pss = big[label]["pss_plus_cache"] - tiny[label]["pss_plus_cache"]
        node[f"dit_pss_cache_bytes_{label}"] = by_pss
        print(f"{label}: node memory for the DiT (drop minus the tiny DiT's drop) {dit / GIB:.2f} GiB = "
              f"{ratio:.2f}x (artifact + slots); by PSS + unmapped cache {by_pss / GIB:.2f} GiB = "
              f"{by_pss / (artifact + big[label]['slots']):.2f}x")
    hwrd, own = node["dit_node_bytes_hwrd"], node["dit_node_bytes_vllm-omni"]
    ratio = hwrd / (artifact + big["hwrd"]["slots"])
    print(f"Goal, hwrd <= 1.15x (artifact + slots) and below vLLM-Omni's own: {ratio:.2f}x, "
          f"{hwrd / GIB:.2f} vs {own / GIB:.2f} GiB ({'met' if ratio <= 1.15 and hwrd < own else 'not met'})")


if __name__ == "__main__":
    sys.exit(main())
