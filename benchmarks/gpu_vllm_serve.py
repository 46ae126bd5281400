"""GPU check of the vLLM-Omni plugin: ``vllm serve --omni`` twice (cold, then warm) through hwrd.

For a CUDA machine with vLLM-Omni 0.30 (+ CUDA vLLM 0.30), hwr installed in the same
environment (so the ``vllm_omni.general_plugins`` entry point is registered) and the model's
weights already on local disk (the GPU machines reach no network: pass a local path or a model
id present in the Hugging Face cache, and keep ``HF_HUB_OFFLINE=1``).

Steps:
1. start hwrd on ``--hwrd-root`` (or use a running one with ``--socket``);
2. write ``<runtime root>/hwrd.json`` naming hwrd's socket (the operator's marker);
3. run ``vllm serve MODEL --omni`` with distributed layerwise offload, AllGather off and
   ``--host-weight-runtime-mode preferred``: wait for ``/health``, generate one image with a
   fixed seed through ``/v1/images/generations``, record the startup time, the PNG's SHA-256,
   the plugin/HWR log lines and ``hwrctl ls``; stop the server;
4. repeat (the warm run): same command, same request.

Expected: the cold run falls back to canonical loading and publishes the DiT's final layout to
hwrd; the warm run logs ``DLO consuming final-layout Host Weight Runtime lease`` and starts
faster; both images hash the same. The report says which of these held. Known limit: hwrd's
publication does not record ``format_metadata`` yet, and vLLM-Omni's final-layout producer
writes some, so until hwrd accepts it the cold run logs a PUBLICATION_FAILED and the warm run is
canonical again (the script reports exactly that). Prewarming by adoption works meanwhile: run
the cold start once with the plugin disabled (``HWR_VLLM_PLUGIN=0``, vLLM-Omni's own store in
the runtime root), then start hwrd with ``--adopt true --root <runtime root>``.

    python benchmarks/gpu_vllm_serve.py --model black-forest-labs/FLUX.2-klein-4B [--dry-run]
    python benchmarks/gpu_vllm_serve.py --recipe allgather --dp 2 --model black-forest-labs/FLUX.2-klein-4B
    python benchmarks/gpu_vllm_serve.py --recipe checkpoint-mmap --dp 2 --model /models/Cosmos3-Nano

Recipes (``--recipe``): ``rank-local`` (the steps above), ``allgather`` (the same with
``--dlo-use-allgather`` over ``--dp`` ranks, or the SP group with ``--dp 1 --ulysses N``; the warm
run logs ``streams from hwrd``: each rank gathers its own pieces of the lease), and
``checkpoint-mmap`` (a DiT vLLM-Omni loads by direct checkpoint mmap, e.g. Cosmos3: the model
directory is registered with ``hwrctl checkpoints add`` first and both runs log ``direct
checkpoint mmap from hwrd checkpoint lease``; there is no cold/warm difference in what is read,
only in the page cache).

``--dry-run`` prints every command and the marker, then exits. Output: a markdown table, then
one JSON line.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HWR_LOG_MARKERS = (
    "Host Weight Runtime",  # vLLM-Omni's HWR lines (resolution, ineligible, publication failures)
    "DLO consuming final-layout Host Weight Runtime lease",  # a warm start
    "streams from hwrd",  # an AllGather ring reading the lease in place
    "checkpoint lease",  # a direct checkpoint mmap plan served by hwrd
    "hwrd",  # the plugin's lines ("resolves through hwrd at ...")
)


#: ``--recipe``: how DLO runs and where the DiT's host weights come from through hwrd.
#: rank-local: every rank streams the final-layout lease (restore-contract DiTs: FLUX.2-klein,
#: MiniMax-H3); allgather: the same lease, each rank gathering its own pieces of every block from
#: the shared mapping over the DP group (``--dp``) or, with ``--dp 1``, the SP group
#: (``--ulysses``); checkpoint-mmap: a DiT vLLM-Omni loads by direct checkpoint mmap (Cosmos3,
#: MAGI-2), its files leased from hwrd (registered first with ``hwrctl checkpoints add``), AllGather.
RECIPES = ("rank-local", "allgather", "checkpoint-mmap")
WARM_MARKERS = {
    "rank-local": "DLO consuming final-layout Host Weight Runtime lease",
    "allgather": "streams from hwrd",  # hwr's rings: "DLO AllGather of ... streams from hwrd (...)"
    "checkpoint-mmap": "direct checkpoint mmap from hwrd checkpoint lease",
}


def serve_command(args: argparse.Namespace) -> list[str]:
    transfer = ["--dlo-no-use-allgather"] if args.recipe == "rank-local" else ["--dlo-use-allgather"]
    parallel = []
    if args.recipe != "rank-local":
        parallel = ["--data-parallel-size", str(args.dp)] if args.dp > 1 else ["--ulysses-degree", str(args.ulysses)]
    return [args.vllm, "serve", args.model, "--omni", "--port", str(args.port),
            "--enable-distributed-layerwise-offload", *transfer, *parallel,
            "--host-weight-runtime-mode", args.mode, "--host-weight-runtime-root", str(args.runtime_root),
            *shlex.split(args.extra_serve_args)]


def register_command(args: argparse.Namespace) -> list[str]:
    """checkpoint-mmap: register the model directory so hwrd can lease its files."""
    return [sys.executable, "-m", "hwr.daemon.ctl.cli", "--socket", str(args.socket), "checkpoints", "add",
            str(args.model)]


def hwrd_command(args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "hwr.daemon.app.main", "--root", str(args.hwrd_root), "--socket", str(args.socket)]


def request_body(args: argparse.Namespace) -> dict[str, Any]:
    return {"prompt": args.prompt, "size": args.size, "n": 1, "seed": args.seed,
            "num_inference_steps": args.steps, "response_format": "b64_json"}


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, b""


def hwrctl_ls(socket: Path) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "hwr.daemon.ctl.cli", "--socket", str(socket), "ls", "--json"],
                         capture_output=True, text=True, timeout=60, check=False)
    try:
        return json.loads(out.stdout)
    except ValueError:
        return [{"error": out.stderr.strip()[-300:]}]


def one_run(name: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    log_path = log_dir / f"vllm-serve-{name}.log"
    base = f"http://127.0.0.1:{args.port}"
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(serve_command(args), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        result: dict[str, Any] = {"run": name, "log": str(log_path)}
        try:
            while time.monotonic() - started < args.timeout:
                if proc.poll() is not None:
                    raise RuntimeError(f"vllm serve exited with {proc.returncode}; see {log_path}")
                if http(f"{base}/health", timeout=2)[0] == 200:
                    break
                time.sleep(1)
            else:
                raise TimeoutError(f"vllm serve not healthy after {args.timeout}s; see {log_path}")
            result["startup_s"] = round(time.monotonic() - started, 2)
            t0 = time.monotonic()
            status, payload = http(f"{base}/v1/images/generations", request_body(args), timeout=args.timeout)
            result["request_s"] = round(time.monotonic() - t0, 2)
            if status != 200:
                raise RuntimeError(f"image request failed with {status}: {payload[:300]!r}")
            image = base64.b64decode(json.loads(payload)["data"][0]["b64_json"])
            (log_dir / f"{name}.png").write_bytes(image)
            result["image_sha256"] = hashlib.sha256(image).hexdigest()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = log_path.read_text(errors="replace")
    result["hwr_log"] = [line.strip()[-300:] for line in text.splitlines()
                         if any(m in line for m in HWR_LOG_MARKERS)][-20:]
    result["warm_lease_consumed"] = WARM_MARKERS[args.recipe] in text
    result["publication_failed"] = "post-load publication failed" in text
    result["hwrd_artifacts"] = hwrctl_ls(args.socket)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="black-forest-labs/FLUX.2-klein-4B",
                    help="a DiT with host_weight_restore_contract (Flux2-Klein or MiniMax-H3 in 0.30)")
    ap.add_argument("--vllm", default="vllm", help="the vllm executable")
    ap.add_argument("--port", type=int, default=8091)
    ap.add_argument("--mode", default="preferred", choices=("preferred", "required"))
    ap.add_argument("--recipe", default="rank-local", choices=RECIPES,
                    help="rank-local | allgather (--dp N, or --dp 1 --ulysses N) | checkpoint-mmap "
                         "(a Cosmos3/MAGI-2 directory as --model)")
    ap.add_argument("--dp", type=int, default=2, help="data-parallel size (allgather, checkpoint-mmap)")
    ap.add_argument("--ulysses", type=int, default=2, help="SP degree when --dp 1 (allgather, checkpoint-mmap)")
    ap.add_argument("--work-dir", type=Path, default=Path("/var/tmp/hwr-gpu-serve"))
    ap.add_argument("--socket", type=Path, help="use this running hwrd instead of starting one")
    ap.add_argument("--prompt", default="a lighthouse on a cliff at dawn, photorealistic")
    ap.add_argument("--size", default="512x512")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--extra-serve-args", default="", help="appended to both vllm serve command lines")
    ap.add_argument("--json-out")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    args = ap.parse_args()
    args.runtime_root = args.work_dir / "runtime-root"
    args.hwrd_root = args.work_dir / "hwrd-root"
    own_daemon = args.socket is None
    if own_daemon:
        args.socket = args.work_dir / "hwrd.sock"
    marker = {"socket": str(args.socket)}

    if args.dry_run:
        if own_daemon:
            print("# 1. hwrd\n" + shlex.join(hwrd_command(args)))
        print(f"# 2. marker {args.runtime_root / 'hwrd.json'}\n{json.dumps(marker)}")
        if args.recipe == "checkpoint-mmap":
            print("# 2b. register the checkpoint\n" + shlex.join(register_command(args)))
        print("# 3./4. cold run, then warm run (same command)\n" + shlex.join(serve_command(args)))
        body = shlex.quote(json.dumps(request_body(args)))
        print(f"# request (after GET /health answers 200)\ncurl -s http://127.0.0.1:{args.port}/v1/images/generations "
              f"-H 'Content-Type: application/json' -d {body}")
        print("# artifacts\n" + shlex.join([sys.executable, "-m", "hwr.daemon.ctl.cli", "--socket", str(args.socket),
                                           "ls", "--json"]))
        return 0

    args.work_dir.mkdir(parents=True, exist_ok=True)
    args.runtime_root.mkdir(mode=0o700, exist_ok=True)
    (args.runtime_root / "hwrd.json").write_text(json.dumps(marker))
    daemon = None
    if own_daemon:
        daemon = subprocess.Popen(hwrd_command(args), stdout=open(args.work_dir / "hwrd.log", "ab"),  # noqa: SIM115
                                  stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not Path(f"{args.socket}.peer").exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"hwrd did not start; see {args.work_dir / 'hwrd.log'}")
            time.sleep(0.2)
    try:
        if args.recipe == "checkpoint-mmap":
            subprocess.run(register_command(args), check=True, timeout=3600)
        runs = [one_run("cold", args, args.work_dir), one_run("warm", args, args.work_dir)]
    finally:
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
    cold, warm = runs
    print("| run | startup | image request | warm lease consumed | publication failed | hwrd artifacts | "
          "image sha256 |\n| --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        print(f"| {r['run']} | {r.get('startup_s')} s | {r.get('request_s')} s | {r['warm_lease_consumed']} | "
              f"{r['publication_failed']} | {len(r['hwrd_artifacts'])} | {r.get('image_sha256', '-')[:16]} |")
    summary = {"model": args.model, "mode": args.mode, "recipe": args.recipe, "runs": runs,
               "same_image": cold.get("image_sha256") == warm.get("image_sha256"),
               "warm_speedup": round(cold["startup_s"] / warm["startup_s"], 3) if warm.get("startup_s") else None}
    line = json.dumps(summary, separators=(",", ":"), sort_keys=True)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    print(line)
    return 0 if summary["same_image"] else 1


if __name__ == "__main__":
    sys.exit(main())
