"""A DLO worker process following an hwrd channel, for the live-update tests and benchmark.

``python live_worker.py CONFIG_JSON`` with ``socket``, ``channel``, ``config`` (a ``DemoConfig``
as a dict), ``seed`` (this worker's input), ``out`` (the result file), optional ``world``,
``rank``, ``rdzv`` (AllGather over a gloo group of ``world`` workers, initialised from the file
``rdzv``), ``hold_switch`` (block for good inside that switch, after the lanes were drained:
how a test kills a worker mid-switch), ``pace_s`` (pause between passes) and ``threads``.

The worker acquires through the channel, restores the model from the lease (non-block tensors
bound to the lease's views, blocks streamed by DLO with ``live_updates=True``), follows the
channel, and runs passes until it reads ``stop`` on stdin (AllGather ranks agree on the stop
with an all-reduce on the model's own group after each pass, so they run the same passes).
Stdout lines: ``ready``, ``on KEY`` when passes start running on another revision,
``refused KEY`` for every refusal, ``holding``. The result file lists every pass as ``[key,
sha256 of the output, time.monotonic() before and after it]`` (one clock for every process on
Linux) plus the failures and switch counts. ``benchmarks/live_update.py`` runs this worker too.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hwr.client import connect
from hwr.demo_model import DemoConfig, build_skeleton
from hwr.dlo_backend import apply_layerwise_offload
from hwr.dlo_backend.live import LiveUpdates

NON_BLOCK = ("x_embed.weight", "x_embed.bias", "final.weight", "final.bias")


def inputs(config: DemoConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The request a worker with ``seed`` runs at every pass (every process builds the same)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, 4, config.in_channels, generator=gen), torch.tensor([0.25 * (seed % 4)])


def digest(out: torch.Tensor) -> str:
    return hashlib.sha256(out.float().contiguous().numpy().tobytes()).hexdigest()


def bind_rest(model: nn.Module, tensors: Any) -> None:
    """What a restore from the lease does for the non-block layers: bind them to its views."""
    for name in NON_BLOCK:
        module_name, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(module_name), attr, nn.Parameter(tensors[name], requires_grad=False))


def hold_at(switch: int) -> None:
    """Block for good inside the ``switch``-th switch, after the old revision's reads drained."""
    real = LiveUpdates._switch_rest
    count = [0]

    def held(self: LiveUpdates, *args: Any) -> None:
        count[0] += 1
        if count[0] == switch:
            print("holding", flush=True)
            time.sleep(3600)
        real(self, *args)

    LiveUpdates._switch_rest = held  # type: ignore[method-assign]


def main(spec: dict[str, Any]) -> int:
    torch.set_num_threads(int(spec.get("threads", 1)))
    config = DemoConfig(**spec["config"])
    world = int(spec.get("world", 1))
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{spec['rdzv']}", rank=int(spec["rank"]),
                                world_size=world, timeout=timedelta(seconds=60))
    if spec.get("hold_switch"):
        hold_at(int(spec["hold_switch"]))
    stop = threading.Event()

    def read_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        stop.set()

    threading.Thread(target=read_stdin, daemon=True).start()
    x, t = inputs(config, int(spec["seed"]))
    client = connect(spec["socket"], timeout=30)
    lease = client.acquire_channel(spec["channel"])
    model = build_skeleton(config)
    bind_rest(model, lease.tensors)
    group = {"use_allgather": True, "dp_group": dist.group.WORLD} if world > 1 else {}
    handle = apply_layerwise_offload(model, device="cpu", host_source=lease, live_updates=True, **group)
    follower = handle.follow(client, spec["channel"])
    print("ready", flush=True)
    passes: list[list[Any]] = []
    failures: list[str] = []
    refused: list[str] = []
    seen_error: object = None
    pace = float(spec.get("pace_s", 0.01))
    while True:
        began = time.monotonic()
        try:
            with torch.no_grad():
                out = model(x, t)
        except Exception as exc:  # a failed pass is a finding: record it and stop
            failures.append(f"{type(exc).__name__}: {exc}")
            break
        status = handle.revision
        if not passes or passes[-1][0] != status.key:
            print("on", status.key, flush=True)
        passes.append([status.key, digest(out), began, time.monotonic()])
        error = status.last_error
        if error is not None and error is not seen_error:
            seen_error = error
            refused.append(str(error.details.get("key")))
            print("refused", error.details.get("key"), flush=True)
        done = stop.is_set()
        if world > 1:  # every rank runs the same passes: stop when any rank was told to
            flag = torch.tensor([1 if done else 0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            done = bool(flag.item())
        if done:
            break
        time.sleep(pace)
    final = handle.revision
    follower.close()
    result = {"passes": passes, "failures": failures, "refused": refused, "switches": final.switches,
              "key": final.key, "watches": follower.watches, "updates": follower.updates,
              "slot_bytes": handle.stats.slot_bytes}
    handle.close()
    client.close()
    with open(spec["out"], "w") as f:
        json.dump(result, f)
    if world > 1:
        dist.destroy_process_group()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
