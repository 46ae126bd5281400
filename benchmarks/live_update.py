"""Live weight updates: workers that follow a channel against workers restarted onto each revision.

    .venv/bin/python benchmarks/live_update.py [--size-mib 1024] [--workers 4] [--revisions 4]
                                               [--restarts 2] [--layouts rank_local,allgather_dp2]
                                               [--json-out F]

A DiT of ``--size-mib`` (bf16 final layout) runs in ``--workers`` DLO worker processes
(``tests/e2e/live_worker.py``: restored from a lease acquired through the channel, streamed with
``live_updates=True``, following the channel; one thread each, passes back to back). Two
layouts: every worker rank-local, and AllGather with DP 2 (``workers / 2`` gloo groups of two).
A publisher commits ``--revisions`` revisions (``durable=False``, every tensor changed) to the
channel, one after the other once every worker runs the previous one. Measured:

- **commit to the first pass on it, last worker**: for each revision, the largest delay over
  the workers from the commit (``publish`` returned) to the start of the first pass that ran on
  it; goal: at most one pass plus 50 ms (a pass that had just started when the commit landed
  finishes on the old revision);
- **pass time**: the passes that switched against the others (median);
- **publication**: each revision's ``publish`` against a plain memory copy of its bytes
  (``tensor.clone()``, new pages, as the staging file's are), both in GiB/s; goal: non-durable
  publication at least 50% of the copy's bandwidth. ``benchmarks/live_publication.py`` measures
  publication alone in more detail;
- **aggregate memory**: the store pages the workers map (the revisions' bytes: the distinct
  physical pages behind their mappings, and their summed PSS) plus their slots, sampled every
  0.25 s over the run, against two revisions plus the slots (two per worker);
- **failed passes** (goal: none);
- **baseline**: the same workers restarted onto a new revision through hwrd (killed at the
  commit, started again: connect, acquire through the channel, restore, enable DLO, first pass),
  commit to the first pass in the last worker.

Prints the tables, then one JSON line. What bounds the numbers on a small machine: every worker
computes on the CPU, so a pass of a 1 GiB model takes seconds and the workers share the cores
with hwrd's hashing of each publication.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

from hwr.client import ArtifactIdentity, connect
from hwr.demo_model import DemoConfig, build_skeleton

WORKER = common.REPO / "tests" / "e2e" / "live_worker.py"
MIB = 1 << 20


def config_for(size_mib: float) -> DemoConfig:
    """A DiT whose bf16 final layout is about ``size_mib`` MiB (``for_size`` counts fp32)."""
    return DemoConfig.for_size(size_mib * 2, hidden=1024, heads=16)


def revision_zero(config: DemoConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = build_skeleton(config, device="cpu")
    return {name: t.detach() for name, t in model.state_dict().items()}


def bump(tensors: dict[str, torch.Tensor], step: int) -> None:
    """A new revision in place: one element of every tensor changes (new bytes, new digests)."""
    for t in tensors.values():
        flat = t.view(-1)
        flat[step % flat.numel()] += 1


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def mapped_pss_kib(pid: int, under: Path) -> int:
    """Summed Pss (KiB) of ``pid``'s mappings of files under ``under`` (the store)."""
    prefix = os.path.realpath(under) + "/"
    total, inside = 0, False
    try:
        with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                head = line.split(maxsplit=5)
                if head and "-" in head[0] and ":" not in head[0]:
                    inside = len(head) == 6 and head[5].strip().startswith(prefix)
                elif inside and line.startswith("Pss:"):
                    total += int(line.split()[1])
    except OSError:
        return 0
    return total


class Worker:
    """One ``live_worker.py`` process and its stdout lines."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.proc = subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        self.on: str | None = None
        self.ready = threading.Event()
        self.errors: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=lambda: self.errors.extend(self.proc.stderr), daemon=True).start()  # type: ignore[arg-type]

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            words = line.split()
            if words == ["ready"]:
                self.ready.set()
            elif words[:1] == ["on"]:
                self.on = words[1]

    def stop(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it exited already: its status and stderr say why
        if self.proc.wait(600) != 0:
            raise RuntimeError(f"worker failed:\n{''.join(self.errors)[-3000:]}")
        return json.loads(Path(self.spec["out"]).read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(60)


def start_workers(daemon: common.Daemon, tmp: Path, tag: str, config: DemoConfig, count: int,
                  allgather: bool) -> list[Worker]:
    workers = []
    for index in range(count):
        spec: dict[str, Any] = {"socket": str(daemon.socket), "channel": "bench", "seed": index, "pace_s": 0,
                                "out": str(tmp / f"{tag}-{index}.json"), "threads": 1,
                                "config": {"hidden": config.hidden, "depth": config.depth, "heads": config.heads,
                                           "in_channels": config.in_channels}}
        if allgather:
            spec.update(world=2, rank=index % 2, rdzv=str(tmp / f"{tag}-rdzv{index // 2}"))
        workers.append(Worker(spec))
    for worker in workers:
        if not worker.ready.wait(600):
            raise RuntimeError(f"a worker did not start:\n{''.join(worker.errors)[-3000:]}")
    return workers


def wait_on(workers: list[Worker], key: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(w.on == key for w in workers):
        if time.monotonic() > deadline:
            raise RuntimeError("the workers did not reach the newest revision in time")
        time.sleep(0.02)


def mapped_frames(pid: int, under: Path) -> set[int]:
    """Page frame numbers of the resident pages ``pid`` maps from files under ``under`` (root only:
    ``/proc/PID/pagemap`` shows frame numbers to CAP_SYS_ADMIN; empty otherwise)."""
    prefix = os.path.realpath(under) + "/"
    frames: set[int] = set()
    try:
        with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/pagemap", "rb") as pagemap:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or not fields[5].strip().startswith(prefix):
                    continue
                start, end = (int(v, 16) for v in fields[0].split("-"))
                pagemap.seek(start // common.PAGE * 8)
                raw = pagemap.read((end - start) // common.PAGE * 8)
                for (entry,) in struct.iter_unpack("<Q", raw):
                    if entry >> 63 and entry & _PFN_MASK:
                        frames.add(entry & _PFN_MASK)
    except OSError:
        pass
    return frames


_PFN_MASK = (1 << 55) - 1


class PssSampler:
    """Samples, every ``interval`` seconds, the store pages the workers map.

    Two measures: the summed PSS of the workers' mappings of store files (what ``smaps`` says;
    read process by process, so while a revision is released between two reads its pages count
    twice, and the peak can overstate), and the distinct physical pages behind those mappings
    (the union of their page frames: no page counts twice, however the reads interleave).
    """

    def __init__(self, pids: list[int], root: Path, interval: float = 0.25) -> None:
        self.pss: list[int] = []
        self.distinct: list[int] = []
        self._stop = threading.Event()
        self._pids, self._root, self._interval = pids, root, interval
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.pss.append(sum(mapped_pss_kib(pid, self._root) for pid in self._pids) * 1024)
            frames: set[int] = set()
            for pid in self._pids:
                frames |= mapped_frames(pid, self._root)
            self.distinct.append(len(frames) * common.PAGE)

    def close(self) -> tuple[int, int]:
        """The peaks: (summed PSS, distinct pages), in bytes."""
        self._stop.set()
        self._thread.join()
        return max(self.pss, default=0), max(self.distinct, default=0)


def live_run(daemon: common.Daemon, client: Any, tmp: Path, tensors: dict[str, torch.Tensor], config: DemoConfig,
             args: argparse.Namespace, allgather: bool, step: list[int], log: queue.Queue[str]) -> dict[str, Any]:
    tag = "ag" if allgather else "local"
    workers = start_workers(daemon, tmp, tag, config, args.workers, allgather)
    sampler = PssSampler([w.proc.pid for w in workers], daemon.root)
    commits: dict[str, float] = {}
    publish_s: list[float] = []
    copy_s: list[float] = []
    try:
        time.sleep(1.0)  # a few passes on the first revision
        for _ in range(args.revisions):
            step[0] += 1
            bump(tensors, step[0])
            started = time.perf_counter()
            copies = {n: t.clone() for n, t in tensors.items()}
            copy_s.append(time.perf_counter() - started)
            del copies
            identity = ArtifactIdentity.simple(f"bench/live/{os.getpid()}", revision=f"{tag}-{step[0]}")
            started = time.perf_counter()
            key = client.publish(identity, tensors, channel="bench", durable=False)
            publish_s.append(time.perf_counter() - started)
            commits[key] = time.monotonic()
            log.put(f"  {tag}: revision {step[0]} published in {publish_s[-1] * 1e3:.0f} ms")
            wait_on(workers, key)
        time.sleep(1.0)
        results = [w.stop() for w in workers]
    finally:
        peaks = sampler.close()
        for w in workers:
            w.kill()
    return summarize(results, commits, publish_s, copy_s, peaks, nbytes(tensors))


def summarize(results: list[dict[str, Any]], commits: dict[str, float], publish_s: list[float],
              copy_s: list[float], peaks: tuple[int, int], revision_bytes: int) -> dict[str, Any]:
    latencies, switch_passes, other_passes = [], [], []
    for key, committed in commits.items():
        firsts = []
        for result in results:
            first = next(p for p in result["passes"] if p[0] == key)
            firsts.append(first[2] - committed)
        latencies.append(max(firsts))
    for result in results:
        previous = None
        for key, _, began, ended in result["passes"]:
            (switch_passes if previous is not None and key != previous else other_passes).append(ended - began)
            previous = key
    slots = sum(2 * r.get("slot_bytes", 0) for r in results)  # two slots of slot_bytes each
    pass_s = statistics.median(other_passes)
    return {
        "commit_to_first_pass_s": latencies,
        "commit_to_first_pass_max_s": max(latencies),
        "pass_s": pass_s,
        "switch_pass_s": statistics.median(switch_passes) if switch_passes else None,
        "goal_s": pass_s + 0.05,
        "failed_passes": sum(len(r["failures"]) for r in results),
        "passes": sum(len(r["passes"]) for r in results),
        "publish_s": publish_s,
        "copy_s": copy_s,
        "publish_gib_s": revision_bytes / statistics.median(publish_s) / (1 << 30),
        "copy_gib_s": revision_bytes / statistics.median(copy_s) / (1 << 30),
        "peak_weights_pss_bytes": peaks[0] + slots,
        "peak_distinct_bytes": peaks[1] + slots,
        "slot_bytes": slots,
        "bound_bytes": 2 * revision_bytes + slots,
    }


def restart_run(daemon: common.Daemon, client: Any, tmp: Path, tensors: dict[str, torch.Tensor],
                config: DemoConfig, args: argparse.Namespace, allgather: bool, step: list[int]) -> dict[str, Any]:
    """Baseline: at each commit, every worker is killed and started again onto the new revision."""
    tag = "restart-ag" if allgather else "restart-local"
    workers = start_workers(daemon, tmp, f"{tag}-0", config, args.workers, allgather)
    latencies = []
    try:
        for rep in range(1, args.restarts + 1):
            step[0] += 1
            bump(tensors, step[0])
            identity = ArtifactIdentity.simple(f"bench/live/{os.getpid()}", revision=f"{tag}-{step[0]}")
            key = client.publish(identity, tensors, channel="bench", durable=False)
            committed = time.monotonic()
            for w in workers:
                w.kill()
            workers = start_workers(daemon, tmp, f"{tag}-{rep}", config, args.workers, allgather)
            wait_on(workers, key)
            results = [w.stop() for w in workers]
            latencies.append(max(r["passes"][0][2] - committed for r in results))
            if rep < args.restarts:  # the next commit finds workers running, as the live ones do
                workers = start_workers(daemon, tmp, f"{tag}-{rep}b", config, args.workers, allgather)
    finally:
        for w in workers:
            w.kill()
    return {"commit_to_first_pass_s": latencies, "commit_to_first_pass_max_s": max(latencies, default=0.0)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=float, default=1024)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--revisions", type=int, default=4)
    parser.add_argument("--restarts", type=int, default=2, help="restarts measured for the baseline")
    parser.add_argument("--layouts", default="rank_local,allgather_dp2", help="comma-separated subset")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    if args.workers % 2:
        parser.error("--workers must be even (AllGather runs groups of two)")
    config = config_for(args.size_mib)
    tensors = revision_zero(config)
    size = nbytes(tensors)
    print(f"model: {size / MIB:.0f} MiB bf16, {config.depth} blocks of hidden {config.hidden}; "
          f"{args.workers} workers; load average {os.getloadavg()[0]:.1f}", flush=True)
    log: queue.Queue[str] = queue.Queue()

    def echo() -> None:
        while True:
            print(log.get(), flush=True)

    threading.Thread(target=echo, daemon=True).start()
    out: dict[str, Any] = {"benchmark": "live_update", "size_mib": size / MIB, "workers": args.workers,
                           "revisions": args.revisions, "load_average": os.getloadavg()[0]}
    tmp = common.short_tmpdir("hwl-")
    step = [0]
    with common.hwrd() as daemon, connect(daemon.socket, timeout=600) as client:
        client.publish(ArtifactIdentity.simple(f"bench/live/{os.getpid()}", revision="0"), tensors, channel="bench")
        for name in args.layouts.split(","):
            if name not in ("rank_local", "allgather_dp2"):
                parser.error(f"unknown layout {name!r}")
            allgather = name == "allgather_dp2"
            print(f"{name}: live updates", flush=True)
            out[name] = live_run(daemon, client, tmp, tensors, config, args, allgather, step, log)
            print(f"{name}: restarting the workers", flush=True)
            out[name]["restart"] = restart_run(daemon, client, tmp, tensors, config, args, allgather, step)
    out["load_average_end"] = os.getloadavg()[0]
    rows = []
    for name in args.layouts.split(","):
        r = out[name]
        rows.append([name, f"{r['commit_to_first_pass_max_s'] * 1e3:.0f} ms", f"{r['goal_s'] * 1e3:.0f} ms",
                     f"{r['restart']['commit_to_first_pass_max_s'] * 1e3:.0f} ms", f"{r['pass_s'] * 1e3:.0f} ms",
                     common.fmt_ms(None if r["switch_pass_s"] is None else r["switch_pass_s"] * 1e3, 0),
                     f"{r['failed_passes']} / {r['passes']}",
                     f"{r['publish_gib_s']:.2f} / {r['copy_gib_s']:.2f} GiB/s "
                     f"({r['publish_gib_s'] / r['copy_gib_s']:.0%})",
                     f"{r['peak_distinct_bytes'] / MIB:.0f} MiB (PSS {r['peak_weights_pss_bytes'] / MIB:.0f}; "
                     f"bound {r['bound_bytes'] / MIB:.0f})"])
    print(common.md_table(["layout", "commit -> first pass, last worker", "goal (pass + 50 ms)",
                           "restart baseline", "pass", "switching pass", "failed passes",
                           "non-durable publish / memcpy", "peak store pages + slots"], rows))
    common.json_line(out, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
