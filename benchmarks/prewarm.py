"""Prewarm vs. the usual load-cast-save: throughput and the producer's peak memory.

Generates a float32 safetensors checkpoint of ``--size-gib`` GiB (default 4; ``--quick``: 0.25),
registers it with a real hwrd (``hwrctl checkpoints add``'s RPC; content SHA-256, timed
separately), then, in the same run:

- **prewarm**: ``client.prewarm(checkpoint, "cast", dtype="bf16")``: wall time from the request
  to the committed artifact (producer process start, streaming cast, daemon-side validation,
  hashing, fsync, atomic rename) and the producer's VmHWM (read by the producer from
  ``/proc/self/status`` at its end and returned in the result);
- **baseline**: in a fresh process, ``safetensors.torch.load_file`` of every file, ``.to(bf16)``,
  ``save_file`` (no hashing, no fsync), and that process's VmHWM.

Acceptance: producer VmHWM < 1 GiB; goal: prewarm throughput >= baseline. Prints a markdown table
then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hwrd, json_line, md_table, run_worker, short_tmpdir

import hwr.client as hc

GIB = 1 << 30
TENSOR_BYTES = 64 << 20  # 4096 x 4096 float32
FILE_BYTES = 1 << 30


def generate(path: Path, size_bytes: int) -> int:
    """Write a checkpoint of float32 4096-wide tensors, ~1 GiB per file; returns its tensor bytes."""
    path.mkdir(parents=True)
    rows = 4096
    n_tensors = max(1, size_bytes // TENSOR_BYTES)
    per_file = max(1, FILE_BYTES // TENSOR_BYTES)
    total = 0
    base = torch.linspace(-3.0, 3.0, rows * 4096, dtype=torch.float32).reshape(rows, 4096)
    for start in range(0, n_tensors, per_file):
        tensors = {}
        for i in range(start, min(n_tensors, start + per_file)):
            tensors[f"blocks.{i}.linear.weight"] = base * (1.0 + i / 97.0)
            tensors[f"blocks.{i}.norm.weight"] = torch.ones(4096) * (i + 1)
        total += sum(t.numel() * 4 for t in tensors.values())
        save_file(tensors, path / f"model-{start // per_file + 1:05d}.safetensors")
    return total


def baseline_worker(src: str, dst: str) -> None:
    from safetensors.torch import load_file

    started = time.perf_counter()
    Path(dst).mkdir(parents=True, exist_ok=True)
    for file in sorted(Path(src).glob("*.safetensors")):
        tensors = {k: v.to(torch.bfloat16) for k, v in load_file(file).items()}
        save_file(tensors, Path(dst) / file.name)
        del tensors
    seconds = time.perf_counter() - started
    hwm = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
    print(json.dumps({"seconds": seconds, "peak_rss_bytes": hwm}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=4.0)
    parser.add_argument("--quick", action="store_true", help="0.25 GiB checkpoint")
    parser.add_argument("--json-out")
    parser.add_argument("--baseline-worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline_worker:
        baseline_worker(*args.baseline_worker)
        return 0
    size = int((0.25 if args.quick else args.size_gib) * GIB)
    work = short_tmpdir("hwrp-")
    try:
        source_bytes = generate(work / "ckpt", size)
        with hwrd(work / "store") as daemon, hc.connect(daemon.socket, timeout=3600) as client:
            t0 = time.perf_counter()
            info = client.add_checkpoint(work / "ckpt")
            register_s = time.perf_counter() - t0
            baseline = run_worker([__file__, "--baseline-worker", str(work / "ckpt"), str(work / "baseline")],
                                  timeout=3600)
            t0 = time.perf_counter()
            [built] = client.prewarm(info["checkpoint_id"], "cast", dtype="bf16")
            prewarm_s = time.perf_counter() - t0
        gib = source_bytes / GIB
        peak = built["producer_peak_rss_bytes"]
        rows = [
            ["prewarm (hwrd cast bf16)", f"{prewarm_s:.2f}", f"{gib / prewarm_s:.2f}", f"{peak / (1 << 20):.0f}"],
            ["load_file + cast + save_file", f"{baseline['seconds']:.2f}", f"{gib / baseline['seconds']:.2f}",
             f"{baseline['peak_rss_bytes'] / (1 << 20):.0f}"],
        ]
        print(f"checkpoint: {gib:.2f} GiB float32, {info['files']} files, {info['tensors']} tensors; "
              f"registration (content SHA-256): {register_s:.2f} s\n")
        print(md_table(["path", "seconds", "GiB/s (source)", "peak RSS MiB"], rows))
        print()
        json_line({"benchmark": "prewarm", "source_gib": round(gib, 3), "register_s": round(register_s, 3),
                   "prewarm_s": round(prewarm_s, 3), "baseline_s": round(baseline["seconds"], 3),
                   "producer_peak_rss_bytes": peak, "baseline_peak_rss_bytes": baseline["peak_rss_bytes"],
                   "peak_rss_under_1gib": peak < GIB, "prewarm_at_least_as_fast": prewarm_s <= baseline["seconds"],
                   "key": built["key"]}, args.json_out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
