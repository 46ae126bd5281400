"""vLLM-Omni 0.30's own DLO against vLLM-Omni + hwrd, on the same DiT class, rank-local and AllGather.

The DiT is vLLM-Omni's FLUX.2-klein pipeline (``Flux2KleinPipeline`` with its
``Flux2Transformer2DModel``), scaled to ``--size-gib`` (default ~1.09 GiB of bf16: 8 double + 24
single blocks, hidden 1024), written once in the diffusers layout. Every configuration starts
real worker processes through the test harness (``tests/vllm_plugin/omni_harness``: vLLM-Omni's
own loader, pipeline classes and ``enable_offload_backend`` over gloo; fakes only at the
accelerator boundary, which on this CPU machine makes the "device" host memory too), one process
per rank, and measures at the first DLO forward:

- ``pss_gib``: the sum of the ranks' PSS (taken between two barriers, so every rank maps what it
  shares), plus hwrd's PSS for the hwrd rows; ``private_dirty_gib``: the ranks' Private_Dirty;
- ``start_s``: from the worker's spawn to its first DLO forward (slowest rank);
- goal columns: PSS / (artifact + slots) for AllGather DP 4 (goal <= 1.15), and warm start
  against vLLM-Omni's own start (page cache warm: the checkpoint was just written and read).

Rows per DP size: ``vllm-omni`` (runtime disabled: vLLM-Omni's canonical load, its own DLO:
rank-local streams the loaded tensors, AllGather copies each rank's shard into private memory),
``hwrd cold`` (``preferred``, a miss: canonical load plus the publication into hwrd), ``hwrd
warm`` (``required``, a hit: restore from the lease, hwr's rings gather from the shared mapping).
DP 1 is rank-local; DP 2 and 4 use AllGather (DLO's default).

    .venv/bin/python benchmarks/vllm_omni_dlo.py [--size-gib 1] [--dp 1,2,4] [--json-out FILE]
        [--dry-run]

``--dry-run`` runs DP 1 and 2 at a tiny size (the CI check that the script works). Prints a
markdown table, then one JSON line. Needs the ``vllm`` extra (vLLM-Omni 0.30).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "vllm_plugin"))
sys.path.insert(0, str(HERE.parent / "tests"))

import common  # noqa: E402

GIB = float(1 << 30)
# Flux2Transformer2DModel arguments: ~0.545 GiB of bf16 per (4 double + 12 single) blocks at hidden 1024.
_BASE = {"attention_head_dim": 128, "num_attention_heads": 8, "joint_attention_dim": 1024, "mlp_ratio": 3.0,
         "axes_dims_rope": [32, 32, 32, 32]}
_TINY = {"num_layers": 2, "num_single_layers": 2}


def dit_config(size_gib: float, dry_run: bool) -> dict[str, Any]:
    """The DiT's arguments for about ``size_gib`` of weights (pure)."""
    if dry_run:
        return dict(_TINY)
    units = max(1, round(size_gib / 0.545))
    return {**_BASE, "num_layers": 4 * units, "num_single_layers": 12 * units}


def _pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        return next(int(line.split()[1]) for line in rollup if line.startswith("Pss:"))


def measure(results: list[Any], name: str) -> dict[str, Any]:
    """Per-start figures summed over the ranks (the harness's ``first_forward`` records)."""
    ranks = [r[name].expect_ok().raw for r in results]
    first = [r["first_forward"] for r in ranks]
    rings = [ring for r in ranks for ring in r["offload"].get("hwr_rings", [])]
    return {
        "outcome": ranks[0]["outcome"], "backend": ranks[0]["offload"]["backend"],
        "pss_bytes": sum(f["Pss"] for f in first), "private_dirty_bytes": sum(f["Private_Dirty"] for f in first),
        "start_s": max(f["seconds_from_start"] for f in first), "load_s": max(r["load_s"] for r in ranks),
        "shard_source": rings[0]["shard_source"] if rings else "vllm-omni",
        "slots_bytes": sum(2 * ring["slot_bytes"] for ring in rings),  # every rank's two slots (host memory here)
        "equal": all(r["offload"]["outputs"][0]["sha256"] == r["straight"]["sha256"] for r in ranks),
    }


def run_config(harness: Any, daemon: Any, base: Path, checkpoint: Path, dp: int) -> dict[str, Any]:
    topology = harness.Topology(world_size=dp, data_parallel_size=dp, use_allgather=dp > 1)
    socket = str(daemon.socket)
    out: dict[str, Any] = {}
    for label, start in (("vllm-omni", harness.Start("s", mode="disabled", forwards=1)),
                         ("hwrd cold", harness.Start("s", mode="preferred", socket=socket, forwards=1)),
                         ("hwrd warm", harness.Start("s", mode="required", socket=socket, forwards=1))):
        root = base / f"runtime-{dp}-{label.replace(' ', '-')}"
        root.mkdir()
        results = harness.run("flux2-klein", checkpoint=checkpoint, runtime_root=root, out=base / f"out-{dp}",
                              topology=topology, starts=[start], timeout=3600,
                              env={"HWR_BENCH_MEASURE": "1"})
        row = measure(results, "s")
        if label != "vllm-omni":
            row["pss_bytes"] += _pss_kib(daemon.pid) * 1024  # the daemon's share counts too
        out[label] = row
        shutil.rmtree(base / f"out-{dp}", ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--dp", default="1,2,4")
    parser.add_argument("--json-out")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    sizes = [1, 2] if args.dry_run else [int(x) for x in args.dp.split(",")]
    os.environ["HWR_BENCH_FLUX2_DIT"] = json.dumps(dit_config(args.size_gib, args.dry_run))
    import omni_harness
    from omni_pipelines import PIPELINES

    base = common.short_tmpdir("hwb-omni-")
    rows: list[list[object]] = []
    results: dict[str, Any] = {"dit": json.loads(os.environ["HWR_BENCH_FLUX2_DIT"]),
                               "loadavg_before": Path("/proc/loadavg").read_text().split()[:3], "configs": {}}
    try:
        checkpoint = base / "checkpoint"
        PIPELINES["flux2-klein"].write_checkpoint(checkpoint, 5)
        artifact = sum(p.stat().st_size for p in (checkpoint / "transformer").glob("*.safetensors"))
        results["artifact_bytes"] = artifact
        for dp in sizes:
            # A fresh hwrd per DP size: DP ranks share one artifact (the identity has no DP rank),
            # so a daemon that served the previous size would turn this size's cold start warm.
            with common.hwrd() as daemon:
                config = run_config(omni_harness, daemon, base, checkpoint, dp)
            results["configs"][str(dp)] = config
            own = config["vllm-omni"]
            for label, row in config.items():
                rows.append([dp, "AllGather" if dp > 1 else "rank-local", label, row["outcome"] or "-",
                             row["shard_source"], f"{row['pss_bytes'] / GIB:.2f}",
                             f"{row['private_dirty_bytes'] / GIB:.2f}", f"{row['start_s']:.1f}",
                             common.fmt_ratio(own["start_s"], row["start_s"]), row["equal"]])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    results["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    print(f"artifact (DiT safetensors): {artifact / GIB:.2f} GiB; load average before "
          f"{' '.join(results['loadavg_before'])}, after {' '.join(results['loadavg_after'])}")
    print(common.md_table(["DP", "transfer", "path", "outcome", "shards from", "PSS GiB", "Private_Dirty GiB",
                           "start->1st fwd s", "vs vLLM-Omni", "DLO == loader"], rows))
    dp4 = results["configs"].get("4") or results["configs"].get(str(max(sizes)))
    if dp4 and max(sizes) > 1:
        warm = dp4["hwrd warm"]
        ratio = warm["pss_bytes"] / (artifact + warm["slots_bytes"]) if warm["slots_bytes"] else None
        results["goal_pss_ratio"] = ratio
        print(f"Goal, AllGather DP {max(sizes)} through hwrd: aggregate PSS {warm['pss_bytes'] / GIB:.2f} GiB = "
              f"{ratio:.2f}x (artifact + slots) (goal <= 1.15); vLLM-Omni's own: "
              f"{dp4['vllm-omni']['pss_bytes'] / GIB:.2f} GiB" if ratio else "Goal: no hwr rings ran")
    for dp, config in results["configs"].items():
        own, warm = config["vllm-omni"]["start_s"], config["hwrd warm"]["start_s"]
        print(f"Goal, DP {dp}: warm start to first forward {warm:.1f} s vs vLLM-Omni's own {own:.1f} s: "
              f"{'met' if warm < own else 'not met'}")
    common.json_line(results, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
