"""Prewarm vs. the usual load-cast-save: throughput and the producer's peak memory.

Generates a float32 safetensors checkpoint of ``--size-gib`` GiB (default 4; ``--quick``: 0.25),
registers it with a real hwrd (``hwrctl checkpoints add``'s RPC; content SHA-256, timed
separately), then, in the same run:

- **prewarm**: ``client.prewarm(checkpoint, "cast", dtype="bf16")``: wall time from the request
  to the committed artifact (streaming cast in the producer process, which hashes what it writes
  and starts its writeback; header validation, fsync, atomic rename in the daemon) and the
  producer's VmHWM (read by the producer from ``/proc/self/status`` at its end and returned in
  the result);
- **baseline**: in a fresh process, ``safetensors.torch.load_file`` of every file, ``.to(bf16)``,
  ``save_file`` (no hashing, no fsync), and that process's VmHWM (its timer starts after its
  imports; prewarm's producer process is started when the checkpoint is registered, see
  ``hwr.daemon.producers.runner``);
- **durable baseline**: the same plus what a store must also do: SHA-256 of every output tensor
  and file, and ``fsync``.

``os.sync()`` runs before every timed path so none inherits another's writeback; ``--repeats N``
interleaves N runs of each path (the artifact is evicted between prewarm runs) and reports the
medians. Besides wall time it reports CPU seconds (prewarm: the daemon's and its producer
process's, sampled from /proc, the spare's imports excluded; baselines: their own process time):
on a shared, busy machine wall time measures the other load as much as the path. Acceptance:
producer VmHWM < 1 GiB; goal: prewarm throughput >= the plain baseline.
Prints a markdown table then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
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


def baseline_worker(src: str, dst: str, durable: bool = False) -> None:
    """``load_file`` + ``.to(bf16)`` + ``save_file`` per file; ``durable`` adds what a store must
    also do: SHA-256 of every output tensor and of every output file, and ``fsync``."""
    import hashlib

    from safetensors.torch import load_file

    started = time.perf_counter()
    cpu_started = time.process_time()
    Path(dst).mkdir(parents=True, exist_ok=True)
    for file in sorted(Path(src).glob("*.safetensors")):
        tensors = {k: v.to(torch.bfloat16) for k, v in load_file(file).items()}
        save_file(tensors, Path(dst) / file.name)
        if durable:
            for tensor in tensors.values():
                hashlib.sha256(tensor.view(torch.uint8).numpy()).hexdigest()
            with open(Path(dst) / file.name, "rb") as fh:
                hashlib.file_digest(fh, "sha256").hexdigest()
                os.fsync(fh.fileno())
        del tensors
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    hwm = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
    print(json.dumps({"seconds": seconds, "cpu_s": cpu, "peak_rss_bytes": hwm}))


def _producer_pids(daemon_pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == daemon_pid
                        and b"producers.worker" in (entry / "cmdline").read_bytes()):
                    out.append(int(entry.name))
            except (OSError, ValueError):
                continue
    return out


def _cpu_ticks(pid: int) -> int:
    """utime + stime of ``pid`` in clock ticks (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


class CpuMeter:
    """CPU seconds used by the daemon and its producer processes while it runs (sampled from
    /proc every 20 ms; a producer's last < 20 ms are missed). On a shared, busy machine wall
    time mostly measures the other load; CPU time is what each path costs."""

    def __init__(self, daemon_pid: int) -> None:
        import threading

        self.daemon_pid = daemon_pid
        self.children: dict[int, int] = {}
        self._daemon_start = _cpu_ticks(daemon_pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    stat = (entry / "stat").read_text()
                    cmdline = (entry / "cmdline").read_bytes()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == self.daemon_pid and b"producers.worker" in cmdline:
                    pid = int(entry.name)
                    self.children[pid] = max(self.children.get(pid, 0), _cpu_ticks(pid))

    def stop(self, exclude: set[int] = frozenset()) -> float:  # type: ignore[assignment]
        self._stop.set()
        self._thread.join()
        ticks = _cpu_ticks(self.daemon_pid) - self._daemon_start
        ticks += sum(t for pid, t in self.children.items() if pid not in exclude)
        return ticks / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=4.0)
    parser.add_argument("--quick", action="store_true", help="0.25 GiB checkpoint")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved runs of every path (medians)")
    parser.add_argument("--json-out")
    parser.add_argument("--baseline-worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline_worker:
        baseline_worker(args.baseline_worker[0], args.baseline_worker[1], args.baseline_worker[2] == "durable")
        return 0
    size = int((0.25 if args.quick else args.size_gib) * GIB)
    work = short_tmpdir("hwrp-")
    runs: dict[str, list[float]] = {"prewarm": [], "baseline": [], "baseline_durable": []}
    peaks: dict[str, int] = {"prewarm": 0, "baseline": 0, "baseline_durable": 0}
    cpu: dict[str, list[float]] = {"prewarm": [], "baseline": [], "baseline_durable": []}
    try:
        source_bytes = generate(work / "ckpt", size)
        with hwrd(work / "store") as daemon, hc.connect(daemon.socket, timeout=3600) as client:
            t0 = time.perf_counter()
            info = client.add_checkpoint(work / "ckpt")
            register_s = time.perf_counter() - t0
            for rep in range(args.repeats):
                for mode in ("plain", "durable"):
                    os.sync()  # nobody inherits another path's writeback
                    result = run_worker([__file__, "--baseline-worker", str(work / "ckpt"), str(work / "baseline"),
                                         mode], timeout=3600)
                    shutil.rmtree(work / "baseline", ignore_errors=True)
                    name = "baseline" if mode == "plain" else "baseline_durable"
                    runs[name].append(result["seconds"])
                    cpu[name].append(result["cpu_s"])
                    peaks[name] = max(peaks[name], result["peak_rss_bytes"])
                if rep:  # a registration (here a no-op one) starts the next build's producer process
                    client.add_checkpoint(work / "ckpt")
                    time.sleep(3)
                os.sync()
                # The spare's CPU before the job (its imports) is not the build's: counted apart.
                before = {pid: _cpu_ticks(pid) for pid in _producer_pids(daemon.pid)}
                meter = CpuMeter(daemon.pid)
                t0 = time.perf_counter()
                [built] = client.prewarm(info["checkpoint_id"], "cast", dtype="bf16")
                runs["prewarm"].append(time.perf_counter() - t0)
                cpu["prewarm"].append(meter.stop() - sum(before.values()) / os.sysconf("SC_CLK_TCK"))
                peaks["prewarm"] = max(peaks["prewarm"], built["producer_peak_rss_bytes"])
                if rep + 1 < args.repeats:
                    client.evict(built["key"])
        gib = source_bytes / GIB
        med = {name: statistics.median(v) for name, v in runs.items()}
        labels = {"prewarm": "prewarm (hwrd cast bf16: hashed, fsynced)",
                  "baseline": "load_file + cast + save_file",
                  "baseline_durable": "same + sha256 (files, tensors) + fsync"}
        cpu_med = {name: statistics.median(v) for name, v in cpu.items()}
        rows = [[labels[name], f"{med[name]:.2f}", f"{min(runs[name]):.2f}", f"{gib / med[name]:.2f}",
                 f"{cpu_med[name]:.2f}", f"{peaks[name] / (1 << 20):.0f}"]
                for name in ("prewarm", "baseline", "baseline_durable")]
        print(f"checkpoint: {gib:.2f} GiB float32, {info['files']} files, {info['tensors']} tensors; "
              f"registration (content SHA-256): {register_s:.2f} s; {args.repeats} interleaved run(s)\n")
        print(md_table(["path", "median s", "min s", "GiB/s (source)", "CPU s (median)", "peak RSS MiB"], rows))
        print()
        json_line({"benchmark": "prewarm", "source_gib": round(gib, 3), "register_s": round(register_s, 3),
                   "repeats": args.repeats, "prewarm_s": round(med["prewarm"], 3),
                   "baseline_s": round(med["baseline"], 3), "baseline_durable_s": round(med["baseline_durable"], 3),
                   "runs_s": {k: [round(x, 3) for x in v] for k, v in runs.items()},
                   "cpu_s": {k: [round(x, 3) for x in v] for k, v in cpu.items()},
                   "producer_peak_rss_bytes": peaks["prewarm"], "baseline_peak_rss_bytes": peaks["baseline"],
                   "peak_rss_under_1gib": peaks["prewarm"] < GIB,
                   "prewarm_at_least_as_fast": med["prewarm"] <= med["baseline"],
                   "prewarm_at_least_as_fast_as_durable_baseline": med["prewarm"] <= med["baseline_durable"],
                   "key": built["key"]}, args.json_out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
