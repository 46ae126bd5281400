"""Rank programs for the AllGather tests, run in separate processes over a real gloo group.

Each program writes ``<outdir>/rank<r>.json`` with what it observed; the test asserts on it.
Ranks are forked from the tests' zygote (``zygote.start_call``: torch and hwr imported once for
the session, nothing else done there) and run their program as a spawned process would; where
the zygote cannot serve they are fresh interpreters.
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from zygote import start_call


def init_gloo(rank: int, world: int, rdzv: str, timeout_s: float) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )


def write_result(outdir: str, rank: int, result: dict[str, Any]) -> None:
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(result))


_init, _write = init_gloo, write_result


def run_ranks(
    program: Callable[..., None], world: int, tmp: Path, *args: Any, deadline: float = 60, wait_for: int | None = None
) -> list[dict[str, Any]]:
    """Run ``program`` on ``world`` ranks, all started at once (``zygote.start_call``); kill
    whatever is left after ``deadline`` (only the first ``wait_for`` ranks are waited for).

    A rank that hangs (a deadlocked collective) is killed at the deadline and the caller's
    assertion that every rank wrote its result fails, so a hang fails a test instead of
    blocking the suite.
    """
    procs = [start_call(program, rank, world, str(tmp / "rdzv"), str(tmp), *args) for rank in range(world)]
    end = time.monotonic() + deadline
    waited = procs if wait_for is None else procs[:wait_for]
    for proc in waited:
        with contextlib.suppress(subprocess.TimeoutExpired):  # killed below: its missing result fails
            proc.wait(max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    results = []
    for rank in range(world):
        path = tmp / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no result (exit code {procs[rank].returncode})"
        results.append(json.loads(path.read_text()))
    return results


def parity(rank: int, world: int, rdzv: str, outdir: str, lease_path: str | None, host_copy: bool = False) -> None:
    """Same outputs as the unhooked model, for a shared input and for per-rank inputs."""
    from dlo_fixtures import SafetensorsLease, TinyDiT

    from hwr.dlo_backend import apply_layerwise_offload

    _init(rank, world, rdzv, 10)
    model = TinyDiT(3, 2, seed=0)
    shared = torch.randn(3, 16, generator=torch.Generator().manual_seed(123))
    mine = torch.randn(3, 16, generator=torch.Generator().manual_seed(1000 + rank))  # DP: own request
    with torch.no_grad():
        want_shared, want_mine = model(shared), model(mine)
    lease = SafetensorsLease(Path(lease_path)) if lease_path else None
    seen: list[int] = []
    in_slots: list[bool] = []
    handle = apply_layerwise_offload(
        model,
        device="cpu",
        host_source=lease,
        use_allgather=True,
        group="auto",
        dp_group=dist.group.WORLD,
        allgather_host_copy=host_copy,
    )

    def slot_bound(block: torch.nn.Module) -> bool:
        """Even on a CPU device each rank holds a shard: weights must be gathered into a slot."""
        slots = handle.backend._runtime.slots.buffers
        ranges = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in slots]
        return all(any(lo <= p.data_ptr() < hi for lo, hi in ranges) for p in block.parameters())

    def probe(block: torch.nn.Module, *_: object) -> None:  # returns None: the inputs stay as they are
        seen.append(len(handle.backend.materialized_blocks()))
        in_slots.append(slot_bound(block))

    probes = [
        block.norm.register_forward_pre_hook(lambda _module, _args, block=block: probe(block))
        for block in model.blocks
    ]
    stats = handle.stats
    layouts = handle.backend._layouts
    expected_shard = shard_bytes_by_the_documented_layout(TinyDiT(3, 2, seed=0), world)  # a fresh twin's shapes
    equal = []
    with torch.no_grad():
        for _ in range(3):
            equal.append(bool(torch.equal(model(shared), want_shared)))
            equal.append(bool(torch.equal(model(mine), want_mine)))
    dropped = all(source.host == [] for source in handle.backend._streamed)
    for probe in probes:
        probe.remove()
    handle.close()
    with torch.no_grad():
        after = bool(torch.equal(model(shared), want_shared)) and bool(torch.equal(model(mine), want_mine))
    _write(
        outdir,
        rank,
        {
            "equal": equal,
            "after_close": after,
            "mode": stats.mode,
            "world": stats.world,
            "shard_bytes": stats.host_shard_bytes,
            "shard_source": stats.shard_source,
            "expected_shard_bytes": expected_shard,
            "block_bytes": stats.block_bytes,
            "payload_bytes": sum(layout.payload_nbytes for layout in layouts),
            "max_materialized": max(seen),
            "bound_in_slots": bool(in_slots) and all(in_slots),
            "slot_bytes": stats.slot_bytes,
            "originals_dropped": dropped,
            "lease_closed": None if lease is None else lease.close_calls,
        },
    )
    dist.destroy_process_group()


def mismatch(rank: int, world: int, rdzv: str, outdir: str) -> None:
    """Rank 1 loads a model of another shape: every rank gets ManifestMismatch, models usable."""
    from dlo_fixtures import TinyDiT

    from hwr.dlo_backend import apply_layerwise_offload

    _init(rank, world, rdzv, 10)
    model = TinyDiT(3, 2, dim=16 if rank == 0 else 8)
    start = time.monotonic()
    try:
        apply_layerwise_offload(model, device="cpu", use_allgather=True, group=dist.group.WORLD)
        error = None
    except Exception as exc:
        error = type(exc).__name__
    hooks = sum(len(m._forward_pre_hooks) for m in model.modules())
    _write(outdir, rank, {"error": error, "seconds": time.monotonic() - start, "hooks": hooks})
    dist.destroy_process_group()


def enable_failures(rank: int, world: int, rdzv: str, outdir: str) -> None:
    """Rank 1 fails at VALIDATE, then at SHARD; every rank fails promptly; then both succeed."""
    from dlo_fixtures import TinyDiT

    from hwr.dlo_backend import EnableStep, LayerwiseOffloadBackend, apply_layerwise_offload

    _init(rank, world, rdzv, 10)
    model = TinyDiT(3, 0)
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        want = model(x)
    real = LayerwiseOffloadBackend._enter
    attempts: list[dict[str, Any]] = []
    for failing in (EnableStep.VALIDATE, EnableStep.SHARD, None):

        def enter(self: LayerwiseOffloadBackend, step: EnableStep, failing: EnableStep | None = failing) -> None:
            real(self, step)
            if rank == 1 and step is failing:
                raise MemoryError("injected")

        LayerwiseOffloadBackend._enter = enter  # type: ignore[method-assign]
        start = time.monotonic()
        try:
            handle = apply_layerwise_offload(model, device="cpu", use_allgather=True, group=dist.group.WORLD)
            with torch.no_grad():
                ok = bool(torch.equal(model(x), want))
            handle.close()
            error = None
        except Exception as exc:
            ok, error = False, type(exc).__name__
        with torch.no_grad():
            usable = bool(torch.equal(model(x), want))
        attempts.append({"error": error, "ok": ok, "usable": usable, "seconds": time.monotonic() - start})
    _write(outdir, rank, {"attempts": attempts})
    dist.destroy_process_group()


def early_stop(rank: int, world: int, rdzv: str, outdir: str, timeout_s: float) -> None:
    """Rank 1 stops after one forward (alive, silent); the others fail within the group timeout."""
    from dlo_fixtures import TinyDiT

    from hwr.dlo_backend import apply_layerwise_offload

    _init(rank, world, rdzv, timeout_s)
    model = TinyDiT(3, 0)
    x = torch.randn(2, 16)
    handle = apply_layerwise_offload(model, device="cpu", use_allgather=True, group=dist.group.WORLD)
    with torch.no_grad():
        model(x)
    if rank == 1:
        _write(outdir, rank, {"stopped": True})
        time.sleep(120)  # the parent kills this process
        return
    start = time.monotonic()
    errors = []
    for _ in range(2):
        try:
            with torch.no_grad():
                model(x)
            errors.append(None)
        except Exception as exc:
            errors.append([type(exc).__name__, str(exc)])
    failed_after = time.monotonic() - start
    handle.close()
    _write(outdir, rank, {"errors": errors, "seconds": failed_after, "state": handle.backend.state.value})


def shard_bytes_by_the_documented_layout(model: torch.nn.Module, world: int) -> int:
    """Host bytes one rank keeps for every block of ``model``, from the slot layout as
    ``hwr.dlo_backend.layout`` documents it, computed here without the backend's planner: per
    block, its parameters and buffers (non-persistent ones too: they are streamed) module by
    module, grouped by dtype in first-appearance order, each tensor's storage span
    starting on a 64-byte boundary inside its group, and each rank keeping
    ``ceil(group elements / world)`` elements of every group."""
    total = 0
    stacks = [getattr(model, attr) for attr in model._layerwise_offload_blocks_attrs]
    for block in (b for stack in stacks for b in stack):
        ends: dict[torch.dtype, int] = {}
        itemsize: dict[torch.dtype, int] = {}
        tensors = [t for module in block.modules()
                   for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]]
        for tensor in tensors:
            itemsize[tensor.dtype] = tensor.element_size()
            align = max(1, 64 // tensor.element_size())
            start = -(-ends.get(tensor.dtype, 0) // align) * align
            span = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
            ends[tensor.dtype] = start + (span if tensor.numel() else 0)
        total += sum(math.ceil(end / world) * itemsize[dtype] for dtype, end in ends.items())
    return total
