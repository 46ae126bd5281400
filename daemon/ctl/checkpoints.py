"""hwrctl subcommands for checkpoints and prewarm.

- ``hwrctl checkpoints [--json]``: registered checkpoints (``--json``: array of objects with
  ``checkpoint_id``, ``path``, ``model_id``, ``revision``, ``files``, ``tensors``, ``size_bytes``,
  ``source_kind``, ``state``, ``leases``).
- ``hwrctl checkpoints add PATH [--json]``: register a directory (or HF snapshot), or one
  ``.safetensors`` file as a one-file checkpoint, on the daemon's host; prints its id.
- ``hwrctl prewarm CHECKPOINT --producer NAME [--dtype bf16] [--keep-fp32 PATTERN]...
  [--tp-size N --tp-plan FILE [--tp-rank R]...] [--omni-config JSON|FILE] [--timeout S] [--json]``:
  build artifacts in the
  daemon with a progress bar on stderr. CHECKPOINT is an id, a unique id prefix, or a registered
  path, relative ones taken from the current directory (``checkpoint_ref``). ``--json`` prints
  ``{"checkpoint", "producer", "keys", "artifacts"}``. Ctrl-C cancels the build (the daemon kills
  the producer and discards its staging) and exits 1 with ``BUILD_CANCELLED``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hwr.client.client import Client
from hwr.client.errors import BuildCancelled, InvalidRequest
from hwr.daemon.ctl.cli import ago, register, table
from hwr.daemon.ctl.progress import ProgressBar, human_bytes

__all__ = ["cmd_checkpoints", "cmd_prewarm"]


def _checkpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=("add",), help="add: register PATH")
    p.add_argument("path", nargs="?", help="checkpoint directory or one .safetensors file (for add)")


@register("checkpoints", "list registered checkpoints, or `checkpoints add PATH` to register one",
          _checkpoint_args)
def cmd_checkpoints(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    if args.action == "add":
        if not args.path:
            raise InvalidRequest("checkpoints add needs a PATH")
        info = client.add_checkpoint(Path(args.path).absolute())
        verb = "registered" if info["added"] else "already registered"
        return info, (f"{verb} {info['checkpoint_id']}\n  {info['model_id']}@{info['revision']}: "
                      f"{info['files']} files, {info['tensors']} tensors, {human_bytes(info['size_bytes'])}, "
                      f"{info['source_kind']}")
    if args.path:
        raise InvalidRequest("unexpected PATH (did you mean `checkpoints add PATH`?)")
    items = client.list_checkpoints()
    rows = [[c["checkpoint_id"][:16], c["model_id"], c["revision"][:12], c["files"], c["tensors"],
             human_bytes(c["size_bytes"]), c["source_kind"], c["state"], c["leases"], ago(c["registered_at"])]
            for c in items]
    text = table(["CHECKPOINT", "MODEL", "REVISION", "FILES", "TENSORS", "SIZE", "SOURCE", "STATE", "LEASES",
                  "ADDED"], rows)
    return items, text if items else text + "\n(no checkpoints)"


def _prewarm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="checkpoint id (or unique prefix) or registered path (a relative one is "
                   "taken from the current directory; name a hex-named directory as ./NAME)")
    p.add_argument("--producer", required=True, help="cast, tp-slice, fp8-per-tensor or vllm-omni")
    p.add_argument("--omni-config", default="", metavar="JSON|FILE",
                   help="vllm-omni: the serving worker's vLLM-Omni config fields as a JSON object (model, "
                        "model_class_name, dtype, ...) or a file holding one")
    p.add_argument("--dtype", default="", help="bf16 or fp16 (cast default bf16)")
    p.add_argument("--keep-fp32", action="append", default=[], metavar="PATTERN",
                   help="tensors (fnmatch) the cast keeps in fp32; repeatable")
    p.add_argument("--tp-size", type=int, default=0, help="tensor-parallel size (tp-slice)")
    p.add_argument("--tp-plan", type=Path, help="TP plan file, JSON or TOML (tp-slice)")
    p.add_argument("--tp-rank", type=int, action="append", default=[], help="build only these ranks")
    p.add_argument("--timeout", dest="build_timeout", type=float, default=0.0,
                   help="producer time limit in seconds (default: the daemon's)")


@register("prewarm", "build artifacts from a registered checkpoint in the daemon (Ctrl-C cancels)",
          _prewarm_args)
def cmd_prewarm(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    plan = b""
    if args.tp_plan is not None:
        try:
            plan = args.tp_plan.read_bytes()
        except OSError as exc:
            raise InvalidRequest(f"cannot read the TP plan {args.tp_plan}: {exc.strerror}") from None
    if args.tp_size < 0 or any(r < 0 for r in args.tp_rank):
        raise InvalidRequest("--tp-size and --tp-rank must not be negative")
    omni_config = _omni_config(args.omni_config)
    if omni_config and args.producer != "vllm-omni":
        raise InvalidRequest("--omni-config applies to --producer vllm-omni only")
    # One bar, restarted on a new line for each TP rank (the daemon builds them one after another).
    with ProgressBar("rank 0", unit="bytes") as bar:
        def on_progress(p: dict[str, Any]) -> None:
            bar.update(p["done_bytes"], p["total_bytes"], label=f"rank {p['tp_rank']}", suffix=p["tensor"][:40])

        try:
            artifacts = client.prewarm(
                args.checkpoint, args.producer, dtype=args.dtype, keep_fp32=args.keep_fp32,
                tp_size=args.tp_size, tp_plan=plan, tp_ranks=args.tp_rank, timeout_s=args.build_timeout,
                on_progress=on_progress, producer_config=omni_config)
        except KeyboardInterrupt:  # the bar's line is ended on the way out, before the error line
            raise BuildCancelled("cancelled: the daemon kills the producer and discards its staging") from None
    document = {"checkpoint": args.checkpoint, "producer": args.producer,
                "keys": [a["key"] for a in artifacts], "artifacts": artifacts}
    rows = [[a["tp_rank"], a["key"][:16], a["outcome"], human_bytes(a["size_bytes"]),
             f"{a['build_seconds']:.1f}s", human_bytes(a["producer_peak_rss_bytes"])] for a in artifacts]
    return document, table(["RANK", "KEY", "OUTCOME", "SIZE", "TIME", "PEAK RSS"], rows)


def _omni_config(value: str) -> bytes:
    """``--omni-config``: a JSON object given inline, or the path of a file holding one."""
    if not value:
        return b""
    text = value
    if value.lstrip()[:1] not in ("{", "["):  # inline JSON, else a file name
        try:
            text = Path(value).read_text()
        except OSError as exc:
            raise InvalidRequest(f"cannot read --omni-config {value}: {exc.strerror}") from None
    try:
        parsed = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"--omni-config is not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise InvalidRequest("--omni-config must be a JSON object")
    return json.dumps(parsed, sort_keys=True).encode()
