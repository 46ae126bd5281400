"""The main job: hwrd on a local store, a generated DiT-shaped checkpoint, workers sharing it.

``python -m hwr.demo [--workers 4] [--size-mb 512] [--workdir ./demo-store]``

1. generates a DiT-shaped fp32 checkpoint (``hwr.demo_model``) unless it exists;
2. starts ``hwrd`` on ``<workdir>/store`` with its socket under /tmp (no systemd, no root);
3. cold start: one worker in ``preferred`` mode misses, loads canonically (read + cast to the
   bf16 final layout), serves its first forward with layerwise offload, and publishes the final
   layout to hwrd in the background;
4. warm start: a worker in ``preferred`` mode gets a lease, restores the model from it (zero
   canonical loads) and runs the same forward with layerwise offload; the outputs must be
   bit-identical to the cold start's;
5. N warm workers vs N workers without hwrd (mode ``disabled``) run at the same time; their
   aggregate PSS (``/proc/PID/smaps_rollup``) is read while all of them hold their weights.
   These run without offload, so the comparison is about the weights alone (who holds a copy);
   on a CPU device DLO binds the lease views zero-copy and adds no weight memory either
   (``benchmarks/startup.py`` measures both);
6. prints a table and a JSON line, then stops hwrd.

Limits: each worker's PSS includes its Python+torch interpreter (~220 MiB, with every module the
worker uses imported before it is read), shown separately ("interpreter") so the weight memory is
visible; the rest ("weights") also holds the forward's activations and allocator caches.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hwr.client.errors import HwrError

__all__ = ["DemoFailed", "demo_identity", "main", "run_workers", "summarize", "worker_threads"]

MiB = 1 << 20


def _pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise RuntimeError(f"no Pss for pid {pid}")


# worker -------------------------------------------------------------------------------------------
def _worker(args: argparse.Namespace) -> int:
    import torch

    # Every module a worker runs is imported before the clock and the PSS baseline start, as in a
    # serving process that imports its stack once at boot: hwr.client imports grpc lazily, which
    # would otherwise put ~0.15 s of imports and ~10 MiB of interpreter memory into "startup"
    # and "weights" of both the cold and the warm start.
    import hwr.client.client  # noqa: F401
    from hwr.demo_model import DemoConfig, build_skeleton, load_canonical
    from hwr.dlo_backend.loader import start_worker

    if args.threads:
        # N workers on C cores: C // N compute threads each, so OpenMP threads don't spin against
        # each other (the same setting for the cold and the warm start).
        torch.set_num_threads(args.threads)
    cfg = DemoConfig(hidden=args.hidden, depth=args.depth, heads=args.heads)
    identity = demo_identity(cfg)
    checkpoint = Path(args.checkpoint)
    # A short sequence: the first forward proves the weights are usable; its compute is not the
    # host side's business (on CPU, bf16 matmuls of a long sequence would dominate the time).
    x = torch.randn(1, 4, cfg.in_channels, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([500.0])
    baseline = _pss_kib(os.getpid())
    started = time.perf_counter()
    worker = start_worker(identity=identity, build_skeleton=lambda: build_skeleton(cfg),
                          load_canonical=lambda: load_canonical(cfg, checkpoint), mode=args.mode,
                          socket=args.socket, offload=not args.no_offload)
    ready = time.perf_counter() - started
    with torch.inference_mode():
        out = worker.model(x, t)
    first_forward = time.perf_counter() - started
    publication = None
    if worker.publication is not None:
        report = worker.publication.result(600)
        publication = {"outcome": report.outcome.value, "elapsed_s": report.elapsed_s}
    # The same forward again, once nothing else runs in this worker: the compute both starts pay.
    again = time.perf_counter()
    with torch.inference_mode():
        second = worker.model(x, t)
    second_forward = time.perf_counter() - again
    print("READY " + json.dumps({
        "outcome": worker.outcome.value, "startup_s": ready, "first_forward_s": first_forward,
        "second_forward_s": second_forward, "threads": torch.get_num_threads(),
        "offload_mode": worker.offload.stats.mode if hasattr(worker.offload, "stats") else "none",
        "baseline_kib": baseline, "output_sha256": hashlib.sha256(out.float().numpy().tobytes()).hexdigest(),
        "repeatable": bool(torch.equal(out, second)), "publication": publication}), flush=True)
    sys.stdin.readline()  # hold the weights until the parent has read our PSS
    worker.close()
    return 0


def demo_identity(cfg: Any) -> Any:
    from hwr.client import ArtifactIdentity

    tag = f"h{cfg.hidden}-d{cfg.depth}-n{cfg.heads}"
    return ArtifactIdentity.simple("hwr-demo/dit", revision=tag, fingerprint=f"demo-seed0-{tag}", dtype="bfloat16")


def worker_threads(n: int) -> int:
    """Compute threads per worker when ``n`` workers share this machine's cores."""
    return max(1, (os.cpu_count() or 1) // n)


def run_workers(mode: str, n: int, args: argparse.Namespace, socket: Path, checkpoint: Path,
                 cfg: Any, *, offload: bool = True, threads: int | None = None) -> list[dict[str, Any]]:
    threads = worker_threads(n) if threads is None else threads
    cmd = [sys.executable, "-m", "hwr.demo", "worker", "--mode", mode, "--socket", str(socket),
           "--checkpoint", str(checkpoint), "--hidden", str(cfg.hidden), "--depth", str(cfg.depth),
           "--heads", str(cfg.heads), "--threads", str(threads), *([] if offload else ["--no-offload"])]
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(n)]
    reports: list[dict[str, Any]] = []
    try:
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.startswith("READY "):
                raise DemoFailed(f"a {mode} worker failed before it was ready (its error is printed above)")
            reports.append(json.loads(line[6:]))
        for proc, report in zip(procs, reports, strict=True):
            report["pss_kib"] = _pss_kib(proc.pid)
    finally:
        for proc in procs:
            if proc.stdin is not None:
                with contextlib.suppress(BrokenPipeError):  # a worker that died early
                    proc.stdin.write("\n")
                    proc.stdin.close()
        for proc in procs:
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                # Its numbers are already read; a worker slow to exit (a loaded machine) must not
                # lose the run. Killing it ends its hwrd session, which releases its lease.
                print(f"worker {proc.pid} did not exit within 120 s; killed", file=sys.stderr)
                proc.kill()
                proc.wait()
    return reports


def summarize(reports: list[dict[str, Any]]) -> dict[str, Any]:
    pss = sum(r["pss_kib"] for r in reports) / 1024
    interp = sum(r["baseline_kib"] for r in reports) / 1024
    return {"workers": len(reports), "outcomes": sorted({r["outcome"] for r in reports}),
            "startup_ms_median": statistics.median(r["startup_s"] for r in reports) * 1e3,
            "first_forward_ms_median": statistics.median(r["first_forward_s"] for r in reports) * 1e3,
            "aggregate_pss_mib": pss, "interpreter_pss_mib": interp, "weights_pss_mib": pss - interp}


# main ---------------------------------------------------------------------------------------------
def _demo(args: argparse.Namespace) -> int:
    from hwr.daemon.app.launcher import DaemonProcess
    from hwr.demo_model import DemoConfig, canonical_checkpoint

    cfg = DemoConfig.for_size(args.size_mb, hidden=args.hidden, heads=16)
    workdir = Path(args.workdir).resolve()
    checkpoint = workdir / "checkpoint" / f"dit-h{cfg.hidden}-d{cfg.depth}.safetensors"
    if not checkpoint.exists():
        print(f"[1/6] generating a DiT-shaped fp32 checkpoint (hidden {cfg.hidden}, {cfg.depth} blocks) ...",
              flush=True)
        canonical_checkpoint(cfg, checkpoint)
    size = checkpoint.stat().st_size
    model_mib = size / 2 / MiB  # the bf16 final layout is half the fp32 checkpoint
    print(f"[1/6] checkpoint {checkpoint} ({size / MiB:.0f} MiB fp32; final layout {model_mib:.0f} MiB bf16)",
          flush=True)
    sockdir = Path(tempfile.mkdtemp(prefix="hwrd-demo-"))
    daemon = DaemonProcess(workdir / "store", sockdir / "hwrd.sock")
    try:
        daemon.start()
    except (RuntimeError, TimeoutError) as exc:
        raise DemoFailed(f"hwrd did not start on {workdir / 'store'} (its log: {daemon.log}); "
                         f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}") from None
    print(f"[2/6] hwrd running: pid {daemon.pid}, socket {daemon.socket}, store {workdir / 'store'}", flush=True)
    try:
        from hwr.client import connect

        with connect(daemon.socket) as client:  # a cold start needs no artifact from an earlier run
            if demo_identity(cfg).key in {a["key"] for a in client.list_artifacts()}:
                client.evict(demo_identity(cfg).key)
                print("      (evicted the artifact an earlier run published, so the next start is cold)",
                      flush=True)
        cold = run_workers("preferred", 1, args, daemon.socket, checkpoint, cfg)[0]
        print(f"[3/6] cold start: {cold['outcome']}, first forward after {cold['first_forward_s'] * 1e3:.0f} ms, "
              f"publication {cold['publication']}", flush=True)
        warm = run_workers("preferred", 1, args, daemon.socket, checkpoint, cfg)[0]
        same = warm["output_sha256"] == cold["output_sha256"]
        print(f"[4/6] warm start: {warm['outcome']}, first forward after {warm['first_forward_s'] * 1e3:.0f} ms, "
              f"output bit-identical to the cold start: {same}", flush=True)
        print(f"[5/6] {args.workers} warm workers and {args.workers} workers without hwrd hold their weights ...",
              flush=True)
        leased = summarize(run_workers("preferred", args.workers, args, daemon.socket, checkpoint, cfg,
                                       offload=False))
        private = summarize(run_workers("disabled", args.workers, args, daemon.socket, checkpoint, cfg,
                                        offload=False))
    finally:
        daemon.stop()
    print("[6/6] hwrd stopped\n")
    print(f"| {model_mib:.0f} MiB bf16 DiT, {cfg.depth} blocks | outcome | startup | first forward "
          f"| aggregate PSS | weights PSS | weights / one copy |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in (("cold start (canonical + publish)", cold), ("warm start (lease + restore + DLO)", warm)):
        print(f"| {name} | {r['outcome']} | {r['startup_s'] * 1e3:.0f} ms | {r['first_forward_s'] * 1e3:.0f} ms "
              f"| | | |")
    for name, r in ((f"{args.workers} workers with hwrd (no DLO)", leased),
                    (f"{args.workers} workers without hwrd (no DLO)", private)):
        print(f"| {name} | {','.join(r['outcomes'])} | {r['startup_ms_median']:.0f} ms | "
              f"{r['first_forward_ms_median']:.0f} ms | {r['aggregate_pss_mib']:.0f} MiB "
              f"| {r['weights_pss_mib']:.0f} MiB | {r['weights_pss_mib'] / model_mib:.2f}x |")
    speedup = cold["first_forward_s"] / max(warm["first_forward_s"], 1e-9)
    saving = private["weights_pss_mib"] / max(leased["weights_pss_mib"], 1e-9)
    print(f"\nwarm start reaches its first forward {speedup:.1f}x sooner than the cold start "
          f"(bit-identical: {same}); {args.workers} workers with hwrd hold {saving:.1f}x less weight memory.")
    print(json.dumps({"demo": "hwr", "model_mib": model_mib, "depth": cfg.depth, "cold": cold, "warm": warm,
                      "bit_identical": same, "with_hwrd": leased, "without_hwrd": private,
                      "warm_speedup": speedup, "memory_saving": saving}))
    return 0 if same and warm["outcome"] == "local_hit" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hwr.demo", description="hwr end-to-end demo")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--size-mb", type=int, default=512, help="fp32 checkpoint size (final layout is half)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--workdir", default="demo-store")
    sub = parser.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    w.add_argument("--mode", choices=("disabled", "preferred", "required"), required=True)
    w.add_argument("--socket", required=True)
    w.add_argument("--checkpoint", required=True)
    w.add_argument("--hidden", type=int, required=True)
    w.add_argument("--depth", type=int, required=True)
    w.add_argument("--heads", type=int, required=True)
    w.add_argument("--no-offload", action="store_true", help="serve from host tensors without DLO")
    w.add_argument("--threads", type=int, default=0, help="torch compute threads (0: torch's default)")
    args = parser.parse_args(argv)
    try:
        return _worker(args) if args.cmd == "worker" else _demo(args)
    except DemoFailed as exc:
        return _fail(str(exc))
    except ModuleNotFoundError as exc:
        # A venv made by hand or half-installed: name the package, not the import chain.
        return _fail(f"the Python package {exc.name!r} is missing from {sys.prefix}; install hwr with its "
                     "dependencies: `bash scripts/setup.sh` (or `pip install -e .` in this venv)")
    except HwrError as exc:
        return _fail(f"{exc.code}: {exc}")


class DemoFailed(Exception):
    """A step of the demo failed; the message is one line saying which and where to look."""


def _fail(message: str) -> int:
    print(f"hwr.demo: {message}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
