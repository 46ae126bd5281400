"""The main job: hwrd on a local store, a generated DiT-shaped checkpoint, N workers sharing it.

``python -m hwr.demo [--workers 4] [--size-mb 320] [--workdir ./demo-store]``

1. starts ``hwrd`` on ``<workdir>/store`` with its socket under /tmp (no systemd, no root);
2. generates a DiT-shaped fp32 checkpoint (``<workdir>/checkpoint/model.safetensors``) unless it
   exists, loads it canonically, casts it to the bf16 final layout and publishes that to hwrd
   (the cold start);
3. starts N worker processes that each lease the artifact and touch every page, holding it while
   their PSS is read from ``/proc/PID/smaps_rollup`` (the warm start);
4. repeats 3 with workers that do what a worker does without hwrd: load the canonical checkpoint
   (``safetensors.torch.load_file``, mmap) and cast it to the final layout in private memory;
5. prints a table (time to usable tensors, aggregate PSS) and a JSON line, then stops hwrd.

Limits: the worker PSS includes each Python+torch interpreter (~220 MiB); the table shows the
interpreter baseline separately so the weight memory is visible.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["dit_state_dict", "main"]

MiB = 1 << 20


def dit_state_dict(hidden: int, depth: int, *, seed: int = 0) -> dict[str, object]:
    """Tensors of a DiT-shaped transformer: patch embed, ``depth`` blocks, final layer (fp32)."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    tensors: dict[str, object] = {"x_embed.weight": rand(hidden, 64), "x_embed.bias": rand(hidden)}
    for i in range(depth):
        p = f"blocks.{i}."
        tensors.update({
            p + "adaln.weight": rand(6 * hidden, hidden), p + "adaln.bias": rand(6 * hidden),
            p + "attn.qkv.weight": rand(3 * hidden, hidden), p + "attn.qkv.bias": rand(3 * hidden),
            p + "attn.proj.weight": rand(hidden, hidden), p + "attn.proj.bias": rand(hidden),
            p + "mlp.fc1.weight": rand(4 * hidden, hidden), p + "mlp.fc1.bias": rand(4 * hidden),
            p + "mlp.fc2.weight": rand(hidden, 4 * hidden), p + "mlp.fc2.bias": rand(hidden),
        })
    tensors.update({"final.weight": rand(64, hidden), "final.bias": rand(64)})
    return tensors


def to_final_layout(tensors: dict[str, object]) -> dict[str, object]:
    """The demo's final-layout transform: cast every floating tensor to bf16 (private memory)."""
    import torch

    return {name: t.to(torch.bfloat16) if t.is_floating_point() else t  # type: ignore[union-attr]
            for name, t in tensors.items()}


def _depth_for(size_mb: int, hidden: int) -> int:
    per_block = (18 * hidden * hidden + 15 * hidden) * 4
    return max(2, round(size_mb * MiB / per_block))


def _pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise RuntimeError(f"no Pss for pid {pid}")


# worker -------------------------------------------------------------------------------------------
def _touch(tensors: dict[str, object]) -> None:
    import torch

    for t in tensors.values():
        assert isinstance(t, torch.Tensor)
        flat = t.reshape(-1).view(torch.uint8) if t.is_contiguous() else t.contiguous().view(torch.uint8)
        flat[::4096].sum()  # one byte per page: the page becomes resident in this process


def _worker(args: argparse.Namespace) -> int:
    import torch  # noqa: F401 - imported before the timer, as a real worker would have

    from hwr.client import connect

    baseline = _pss_kib(os.getpid())
    started = time.perf_counter()
    lease = client = None
    if args.mode == "lease":
        client = connect(args.socket, client_name="demo-worker")
        lease = client.acquire(args.key)
        tensors = dict(lease.tensors)
    else:
        from safetensors.torch import load_file

        tensors = to_final_layout(load_file(args.checkpoint))
    usable = time.perf_counter() - started
    _touch(tensors)
    touched = time.perf_counter() - started
    print("READY " + json.dumps({"usable_s": usable, "touched_s": touched, "baseline_kib": baseline,
                                 "tensors": len(tensors)}), flush=True)
    sys.stdin.readline()  # hold the weights until the parent has read our PSS
    if lease is not None:
        lease.close()
    if client is not None:
        client.close()
    return 0


def _run_workers(mode: str, n: int, *, socket: Path, key: str, checkpoint: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "hwr.demo", "worker", "--mode", mode, "--socket", str(socket),
           "--key", key, "--checkpoint", str(checkpoint)]
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(n)]
    reports = []
    try:
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.startswith("READY "):
                raise RuntimeError(f"worker failed: {line!r}")
            reports.append(json.loads(line[6:]))
        pss = [_pss_kib(p.pid) for p in procs]
    finally:
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.write("\n")
                proc.stdin.close()
        for proc in procs:
            proc.wait(60)
    baseline = sum(r["baseline_kib"] for r in reports)
    return {
        "workers": n,
        "usable_ms_median": statistics.median(r["usable_s"] for r in reports) * 1e3,
        "touched_ms_median": statistics.median(r["touched_s"] for r in reports) * 1e3,
        "aggregate_pss_mib": sum(pss) / 1024,
        "interpreter_pss_mib": baseline / 1024,
        "weights_pss_mib": (sum(pss) - baseline) / 1024,
    }


# main ---------------------------------------------------------------------------------------------
def _demo(args: argparse.Namespace) -> int:
    from safetensors.torch import load_file, save_file

    from hwr.client import ArtifactIdentity, connect
    from hwr.daemon.launcher import DaemonProcess

    workdir = Path(args.workdir).resolve()
    checkpoint = workdir / "checkpoint" / "model.safetensors"
    depth = _depth_for(args.size_mb, args.hidden)
    if not checkpoint.exists():
        print(f"[1/5] generating a DiT-shaped checkpoint: hidden={args.hidden}, depth={depth} ...", flush=True)
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        save_file(dit_state_dict(args.hidden, depth), str(checkpoint))  # type: ignore[arg-type]
    size = checkpoint.stat().st_size
    print(f"[1/5] checkpoint: {checkpoint} ({size / MiB:.0f} MiB fp32; final layout bf16)", flush=True)
    sockdir = Path(tempfile.mkdtemp(prefix="hwrd-demo-"))
    daemon = DaemonProcess(workdir / "store", sockdir / "hwrd.sock")
    daemon.start()
    print(f"[2/5] hwrd running: pid {daemon.pid}, socket {daemon.socket}, store {workdir / 'store'}", flush=True)
    try:
        identity = ArtifactIdentity.simple("hwr-demo/dit", revision=f"h{args.hidden}-d{depth}",
                                           fingerprint=f"demo-seed0-h{args.hidden}-d{depth}")
        t0 = time.perf_counter()
        tensors = to_final_layout(load_file(str(checkpoint)))
        loaded = time.perf_counter() - t0
        with connect(daemon.socket, client_name="demo-publisher") as client:
            t1 = time.perf_counter()
            key = client.publish(identity, tensors)
            published = time.perf_counter() - t1
        del tensors
        print(f"[3/5] cold start: canonical load + cast {loaded * 1e3:.0f} ms, publish {published * 1e3:.0f} ms "
              f"-> artifact {key[:16]}", flush=True)
        print(f"[4/5] {args.workers} workers lease the artifact ...", flush=True)
        lease = _run_workers("lease", args.workers, socket=daemon.socket, key=key, checkpoint=checkpoint)
        print(f"[5/5] {args.workers} workers load the checkpoint privately ...", flush=True)
        private = _run_workers("load", args.workers, socket=daemon.socket, key=key, checkpoint=checkpoint)
    finally:
        daemon.stop()
    model_mib = size / 2 / MiB  # the bf16 final layout is half the fp32 checkpoint
    rows = [("hwrd lease of the final layout", lease), ("load_file + cast (no hwrd)", private)]
    print()
    print(f"| {args.workers} workers, {model_mib:.0f} MiB bf16 model | time to usable (median) | + touch every page "
          f"| aggregate PSS | of which weights | weights / one copy |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in rows:
        print(f"| {name} | {r['usable_ms_median']:.1f} ms | {r['touched_ms_median']:.1f} ms "
              f"| {r['aggregate_pss_mib']:.0f} MiB | {r['weights_pss_mib']:.0f} MiB "
              f"| {r['weights_pss_mib'] / model_mib:.2f}x |")
    speedup = private["usable_ms_median"] / max(lease["usable_ms_median"], 1e-9)
    saving = private["weights_pss_mib"] / max(lease["weights_pss_mib"], 1e-9)
    print(f"\nwarm start: a lease is usable {speedup:.0f}x sooner than loading the checkpoint; "
          f"{args.workers} leasing workers hold {saving:.1f}x less weight memory than private copies.")
    print(json.dumps({"demo": "hwr", "model_mib": model_mib, "workers": args.workers, "lease": lease,
                      "load_file": private, "speedup_usable": speedup, "memory_saving": saving}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hwr.demo", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--size-mb", type=int, default=512, help="canonical fp32 checkpoint size")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--workdir", default="demo-store")
    w = sub.add_parser("worker")
    w.add_argument("--mode", choices=("lease", "load"), required=True)
    w.add_argument("--socket", required=True)
    w.add_argument("--key", required=True)
    w.add_argument("--checkpoint", required=True)
    args = parser.parse_args(argv)
    return _worker(args) if args.cmd == "worker" else _demo(args)


if __name__ == "__main__":
    sys.exit(main())
