"""DLO AllGather on CPU with gloo: rank-local vs private shards vs shards read from the lease.

    .venv/bin/python benchmarks/allgather.py                      # 1 GiB bf16, 16 blocks, DP 1,2,4
    .venv/bin/python benchmarks/allgather.py --quick              # 64 MiB, DP 1,2 (smoke)

Every rank is a fresh process (``python benchmarks/allgather.py --rank-worker SPEC``) in a real
gloo group. The artifact is a safetensors file written once (streamed, fsynced, page cache
warm); each rank maps it read-only and shared (``MAP_SHARED``, ``PROT_READ``), exactly the
mapping a worker gets from an hwrd lease (the daemon is left out of the loop so the artifact's
pages are counted once, in the ranks; its own mapping would take a share of their PSS). The
model is a skeleton on the meta device: the weights exist only in the mapping. Modes:

- (a) ``rank-local``: no AllGather; on a CPU device each rank binds the lease views (zero copy);
- (b) ``allgather-private``: AllGather with private host shards built at enable
  (``allgather_host_copy=True``; upstream's layout: page cache + a private shard per rank);
- (c) ``allgather-lease``: AllGather whose ranks read their own pieces of every block from the
  lease mapping into one gather input (no private shard).

With DP 1 a group of one streams rank-locally, so (b) and (c) are only run for DP >= 2.
Measured per run: aggregate PSS growth of all ranks after the first forward (sum over ranks of
``smaps_rollup`` Pss minus the rank's Pss before it mapped the lease; taken after a barrier so
every rank has mapped what it maps), the ranks' aggregate private memory growth (Private_Dirty
and Anonymous), time from process start (the driver's ``Popen``) to the end of the first
forward, the part of it after imports and process-group setup (``enable`` + first forward), and
the steady per-pass time (median over ``--passes`` passes after a barrier; one compute thread
per rank). Processes exit after measuring (the OS unmaps; ``close()`` and its gather-back are not
measured).

Limits of the CPU numbers: PSS is read with no gather in flight; during a gather torch's gloo
backend holds a transient copy of the gathered dtype group (one block, per rank), and with blocks
under glibc's 32 MiB mmap threshold the allocator keeps those freed copies cached, which shows
in the private columns of small (``--quick``) runs of both AllGather modes. Process start is
dominated by ``import torch`` and gloo setup, common to every mode; "enable -> 1st forward" is
the part the backend controls.

Goals at DP 4: (c) aggregate PSS growth <= 1.15 x artifact + 2 slots per rank; (c) start to
first forward >= 3 x faster than (b); (c) steady per-pass time <= 1.1 x (b). vLLM-Omni's own DLO
AllGather backend is listed with the reason it is not measured when it cannot run here. Prints
a markdown table, the goal lines, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import json_line, md_table

THIS = str(Path(__file__).resolve())
MiB = 1 << 20
MODES = {
    "rank-local": "(a) rank-local",
    "allgather-private": "(b) AllGather, private shards",
    "allgather-lease": "(c) AllGather from the lease",
}


# --- the artifact ------------------------------------------------------------------------------
def dims(size_mib: int, depth: int) -> tuple[int, int]:
    """(dim, hidden = 4 dim) so that ``depth`` blocks of two bf16 linears weigh ``size_mib``."""
    block = size_mib * MiB / depth
    dim = max(64, int(math.sqrt(block / 16)) // 64 * 64)  # 2 * dim * 4 dim * 2 bytes = 16 dim^2
    return dim, 4 * dim


def write_artifact(path: Path, depth: int, dim: int, hidden: int) -> int:
    """Stream a bf16 safetensors file tensor by tensor (never the whole model in memory); fsync."""
    import torch

    shapes = {}
    for i in range(depth):
        shapes[f"blocks.{i}.fc1.weight"] = (hidden, dim)
        shapes[f"blocks.{i}.fc2.weight"] = (dim, hidden)
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in shapes.items():
        nbytes = shape[0] * shape[1] * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 64)
    generator = torch.Generator().manual_seed(0)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for shape in shapes.values():
            tensor = (torch.randn(shape, generator=generator) / math.sqrt(shape[1])).to(torch.bfloat16)
            f.write(tensor.view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())  # clean pages: Private_Dirty then counts private memory only
    path.read_bytes()  # warm the page cache: measure memory, not the disk
    return offset


# --- one rank (a fresh process) ----------------------------------------------------------------
def _smaps() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("Pss", "Private_Dirty", "Anonymous"):
                out[name] = int(rest.split()[0]) * 1024
    return out


def rank_worker(spec: dict[str, Any]) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch import nn

    from hwr.dlo_backend import apply_layerwise_offload
    from hwr.dlo_backend.file_lease import FileLease

    imported = time.time()
    rank, world = spec["rank"], spec["world"]
    # One compute thread per rank: runs with different DP sizes get the same per-rank compute, and
    # OpenMP threads of ranks sharing few cores do not spin against each other.
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{spec['rdzv']}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    dist.barrier()
    ready = time.time()
    before = _smaps()

    class Block(nn.Module):
        def __init__(self, dim: int, hidden: int) -> None:
            super().__init__()
            self.fc1 = nn.Linear(dim, hidden, bias=False, dtype=torch.bfloat16)
            self.fc2 = nn.Linear(hidden, dim, bias=False, dtype=torch.bfloat16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    class Stack(nn.Module):
        def __init__(self, depth: int, dim: int, hidden: int) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(depth))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    with torch.device("meta"):
        model = Stack(spec["depth"], spec["dim"], spec["hidden"])
    x = torch.randn(spec["tokens"], spec["dim"], generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    mode = spec["mode"]
    handle = apply_layerwise_offload(
        model,
        device="cpu",
        host_source=FileLease(spec["path"], key="bench-allgather"),
        use_allgather=mode != "rank-local",
        group=dist.group.WORLD if mode != "rank-local" else None,
        allgather_host_copy=mode == "allgather-private",
    )
    with torch.no_grad():
        model(x)
    first = time.time()
    for lane in handle.backend._runtime.lanes:
        lane.drain()  # probe: no gather in flight, so gloo's transient output copy is not counted
    dist.barrier()  # every rank has mapped what it maps: PSS shares are final
    after = _smaps()
    dist.barrier()
    passes = []
    with torch.no_grad():
        for _ in range(spec["passes"]):
            start = time.perf_counter()
            model(x)
            passes.append(time.perf_counter() - start)
    stats = handle.stats
    report = {
        "rank": rank,
        "imported": imported,
        "ready": ready,
        "first_forward": first,
        "pss_growth": after["Pss"] - before["Pss"],
        "private_dirty_growth": after["Private_Dirty"] - before["Private_Dirty"],
        "anonymous_growth": after["Anonymous"] - before["Anonymous"],
        "pass_s": statistics.median(passes),
        "offload_mode": stats.mode,
        "shard_source": stats.shard_source,
        "slot_bytes": stats.slot_bytes,
        "host_shard_bytes": stats.host_shard_bytes,
    }
    print("REPORT " + json.dumps(report), flush=True)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # measured: leave without close() (its AllGather gather-back would copy the model)


# --- driver ------------------------------------------------------------------------------------
def run(mode: str, world: int, base: dict[str, Any], work: Path, timeout: float) -> dict[str, Any]:
    rdzv = work / f"rdzv-{mode}-{world}"
    rdzv.unlink(missing_ok=True)
    procs = []
    started = time.time()
    for rank in range(world):
        spec = {**base, "mode": mode, "rank": rank, "world": world, "rdzv": str(rdzv)}
        argv = [sys.executable, THIS, "--rank-worker", json.dumps(spec)]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True))
    reports = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            line = next((ln for ln in out.splitlines() if ln.startswith("REPORT ")), None)
            if proc.returncode != 0 or line is None:
                raise RuntimeError(f"{mode} DP{world}: a rank failed (exit {proc.returncode})")
            reports.append(json.loads(line[len("REPORT ") :]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    artifact = base["artifact_bytes"]
    pss = sum(r["pss_growth"] for r in reports)
    slots = sum(r["slot_bytes"] * 2 for r in reports)
    return {
        "mode": mode,
        "dp": world,
        "offload_mode": sorted({r["offload_mode"] for r in reports}),
        "shard_source": sorted({r["shard_source"] for r in reports}),
        "pss_growth_mib": pss / MiB,
        "pss_vs_artifact": pss / artifact,
        "slots_mib": slots / MiB,
        "pss_budget_mib": (1.15 * artifact + slots) / MiB,
        "private_dirty_mib": sum(r["private_dirty_growth"] for r in reports) / MiB,
        "anonymous_mib": sum(r["anonymous_growth"] for r in reports) / MiB,
        "host_shard_mib": sum(r["host_shard_bytes"] for r in reports) / MiB,
        "start_to_first_forward_s": max(r["first_forward"] for r in reports) - started,
        "enable_to_first_forward_s": max(r["first_forward"] - r["ready"] for r in reports),
        "pass_s": max(r["pass_s"] for r in reports),
    }


def vllm_omni_reason() -> str | None:
    """Why vLLM-Omni's own DLO AllGather backend is not measured here (None: it could be)."""
    try:
        import vllm_omni  # noqa: F401
    except Exception as exc:
        return (
            f"not measured: vLLM-Omni is not installed ({type(exc).__name__}); install the vllm extra with "
            "scripts/setup-vllm.sh (about 3 min, 4.4 GB) to add it"
        )
    return (
        "not measured: vLLM-Omni's DistributedLayerwiseOffloadBackend takes a diffusion pipeline resolved by its "
        "own offload planner, its diffusion parallel state for the DP group and its own lease type (HostWeightPlan); "
        "this benchmark has no harness that builds those around the same bytes yet"
    )


def report(results: dict[str, Any]) -> None:
    rows = []
    for r in results["runs"]:
        rows.append(
            [
                MODES[r["mode"]],
                r["dp"],
                f"{r['pss_growth_mib']:.0f} MiB = {r['pss_vs_artifact']:.2f}x",
                f"{r['pss_budget_mib']:.0f} MiB",
                f"{r['private_dirty_mib']:.0f} / {r['anonymous_mib']:.0f} MiB",
                f"{r['host_shard_mib']:.0f} MiB",
                f"{r['start_to_first_forward_s']:.2f} s",
                f"{r['enable_to_first_forward_s']:.2f} s",
                f"{r['pass_s'] * 1e3:.0f} ms",
            ]
        )
    rows.append(["vLLM-Omni 0.30 DLO AllGather", "-", results["vllm_omni"], "", "", "", "", "", ""])
    print(
        md_table(
            [
                "mode",
                "DP",
                "aggregate PSS growth (x artifact)",
                "budget 1.15x + 2 slots/rank",
                "private dirty / anonymous growth",
                "private shards",
                "start -> 1st forward",
                "enable -> 1st forward",
                "steady pass",
            ],
            rows,
        )
    )
    for line in results["goals"]:
        print(line)


def goals(runs: list[dict[str, Any]]) -> tuple[list[str], dict[str, bool | None]]:
    top = max(r["dp"] for r in runs)
    by = {(r["mode"], r["dp"]): r for r in runs}
    b, c = by.get(("allgather-private", top)), by.get(("allgather-lease", top))
    if top < 2 or b is None or c is None:
        return [f"Goals: need DP >= 2 runs of (b) and (c); largest DP was {top}"], {}
    pss_ok = c["pss_growth_mib"] <= c["pss_budget_mib"]
    speed = b["start_to_first_forward_s"] / c["start_to_first_forward_s"]
    enable_speed = b["enable_to_first_forward_s"] / c["enable_to_first_forward_s"]
    steady = c["pass_s"] / b["pass_s"]
    lines = [
        f"Goal (c) DP{top} aggregate PSS growth <= 1.15x artifact + 2 slots/rank: {c['pss_growth_mib']:.0f} MiB "
        f"vs {c['pss_budget_mib']:.0f} MiB: {'met' if pss_ok else 'NOT met'}",
        f"Goal (c) DP{top} start to first forward >= 3x faster than (b): {speed:.2f}x "
        f"({'met' if speed >= 3 else 'NOT met'}; enable -> first forward alone: {enable_speed:.2f}x)",
        f"Goal (c) DP{top} steady pass within 1.1x of (b): {steady:.2f}x: {'met' if steady <= 1.1 else 'NOT met'}",
    ]
    return lines, {"pss": pss_ok, "start_3x": speed >= 3, "steady_1_1x": steady <= 1.1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=None, help="bf16 artifact size (default 1024; --quick 64)")
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--dp", default=None, help="comma-separated DP sizes (default 1,2,4; --quick 1,2)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--passes", type=int, default=None, help="steady passes per run (default 3; --quick 2)")
    ap.add_argument("--quick", action="store_true", help="smoke size: 64 MiB, DP 1,2, 2 passes")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run before its ranks are killed")
    ap.add_argument("--rank-worker", help=argparse.SUPPRESS)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if args.rank_worker:
        rank_worker(json.loads(args.rank_worker))
        return
    size = args.size_mib or (64 if args.quick else 1024)
    dps = [int(v) for v in (args.dp or ("1,2" if args.quick else "1,2,4")).split(",") if v]
    passes = args.passes or (2 if args.quick else 3)
    dim, hidden = dims(size, args.depth)
    work = Path(tempfile.mkdtemp(prefix="hwr-allgather-"))
    results: dict[str, Any] = {"benchmark": "allgather", "loadavg_start": os.getloadavg(), "dp": dps}
    try:
        path = work / "model.safetensors"
        artifact = write_artifact(path, args.depth, dim, hidden)
        base = {"path": str(path), "depth": args.depth, "dim": dim, "hidden": hidden, "tokens": args.tokens,
                "passes": passes, "artifact_bytes": artifact}
        results |= {"artifact_mib": artifact / MiB, "depth": args.depth, "dim": dim, "hidden": hidden,
                    "block_mib": artifact / args.depth / MiB, "cores": os.cpu_count()}
        print(f"artifact: {artifact / MiB:.0f} MiB bf16, {args.depth} blocks of {artifact / args.depth / MiB:.1f} MiB "
              f"(dim {dim}, hidden {hidden}); DP {dps}; {passes} steady passes; {os.cpu_count()} cores", flush=True)
        runs = []
        for world in dps:
            for mode in MODES:
                if world == 1 and mode != "rank-local":
                    continue  # a group of one streams rank-locally: (b) and (c) would be (a)
                runs.append(run(mode, world, base, work, args.timeout))
                print(f"done: {mode} DP{world}", flush=True)
        results["runs"] = runs
        results["goals"], results["goals_met"] = goals(runs)
        results["vllm_omni"] = vllm_omni_reason() or "measured"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["loadavg_end"] = os.getloadavg()
    report(results)
    json_line(results, args.json_out)


if __name__ == "__main__":
    main()
