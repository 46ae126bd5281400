"""Rank programs: AllGather beside the model's and the caller's own collectives, shards from the lease.

Run in separate processes over a real gloo group (see ``dlo_ranks.run_ranks``); each writes
``<outdir>/rank<r>.json``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dlo_ranks import init_gloo, write_result
from torch import nn


class ReducingBlock(nn.Module):
    """A block that all-reduces its activations on ``group``, as SP attention does."""

    def __init__(self, dim: int, group: Any) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, dim, dtype=torch.bfloat16)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        dist.all_reduce(h, group=self.group)  # the model's own collective, on the DLO ranks
        return x + h / dist.get_world_size(self.group) + 0.1 * self.gate(x.to(torch.bfloat16)).float()


class ReducingStack(nn.Module):
    def __init__(self, depth: int, dim: int, group: Any) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.blocks = nn.ModuleList(ReducingBlock(dim, group) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _groups(world: int, layout: str) -> tuple[Any, Any]:
    """(the group DLO shards over and the model reduces on, the group the caller barriers on)."""
    if layout == "pairs":  # DP pairs {0,1},{2,3}: every rank creates every group, in order
        pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
        return pairs[dist.get_rank() // 2], dist.group.WORLD
    return dist.group.WORLD, dist.group.WORLD


def _run_passes(model: nn.Module, inputs: list[torch.Tensor], caller: Any) -> list[torch.Tensor]:
    outs = []
    for x in inputs:
        outs.append(model(x))
        dist.barrier(group=caller)  # a caller's collective between forwards
        total = outs[-1].detach().clone()
        dist.all_reduce(total, group=caller)  # and one that carries data
        outs.append(total)
    return outs


def beside_model_collectives(
    rank: int, world: int, rdzv: str, outdir: str, depth: int, layout: str, as_sp: bool
) -> None:
    """Blocks all-reduce on the DLO ranks, the caller barriers between forwards and in a hook."""
    from hwr.dlo_backend import apply_layerwise_offload

    init_gloo(rank, world, rdzv, 20)
    group, caller = _groups(world, layout)
    model = ReducingStack(depth, 16, group)
    inputs = [torch.randn(3, 16, generator=torch.Generator().manual_seed(100 * rank + i)) for i in range(3)]
    with torch.no_grad():
        want = _run_passes(model, inputs, caller)
    groups = {"sp_group": group} if as_sp else {"dp_group": group}
    handle = apply_layerwise_offload(model, device="cpu", use_allgather=True, **groups)
    barriers: list[int] = []

    def barrier_hook(_module: nn.Module, _args: object) -> None:
        # Runs after DLO's pre-hook, i.e. right after it submitted the next block's gather.
        dist.barrier(group=caller)
        barriers.append(1)

    hooks = [block.register_forward_pre_hook(barrier_hook) for block in model.blocks[::2]]
    with torch.no_grad():
        got = _run_passes(model, inputs, caller)
    for hook in hooks:
        hook.remove()
    stats = handle.stats
    handle.close()
    with torch.no_grad():
        after = _run_passes(model, inputs, caller)
    write_result(
        outdir,
        rank,
        {
            "equal": [bool(torch.equal(a, b)) for a, b in zip(got, want, strict=True)],
            "after_close": all(torch.equal(a, b) for a, b in zip(after, want, strict=True)),
            "mode": stats.mode,
            "world": stats.world,
            "barriers": len(barriers),
        },
    )
    dist.destroy_process_group()


def _anonymous_kib() -> int:
    """Private anonymous memory of this process (``Private_Dirty`` would also count file pages
    of a freshly written lease that only this process maps, which are shared, not private)."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1])
    raise RuntimeError("no Anonymous in smaps_rollup")


def _mapping_rss_kib(lo: int, hi: int) -> int:
    """Resident KiB of the mappings that lie inside ``[lo, hi)`` (the lease's file mapping)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(v, 16) for v in head.split("-"))
                inside = start < hi and end > lo
            elif inside and head == "Rss:":
                rss += int(line.split()[1])
    return rss


class WideBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class WideStack(nn.Module):
    def __init__(self, depth: int, dim: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(WideBlock(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def lease_private_memory(
    rank: int, world: int, rdzv: str, outdir: str, lease_path: str, depth: int, dim: int, host_copy: bool
) -> None:
    """Private memory and lease pages touched by one rank streaming a lease with AllGather."""
    from dlo_fixtures import SafetensorsLease

    from hwr.dlo_backend import apply_layerwise_offload

    init_gloo(rank, world, rdzv, 20)
    with torch.device("meta"):
        model = WideStack(depth, dim)  # a skeleton: the weights exist only in the lease
    x = torch.randn(4, dim, generator=torch.Generator().manual_seed(rank))
    lease = SafetensorsLease(Path(lease_path))
    dist.barrier()
    before = _anonymous_kib()
    start = time.monotonic()
    handle = apply_layerwise_offload(
        model, device="cpu", host_source=lease, use_allgather=True, group=dist.group.WORLD,
        allgather_host_copy=host_copy,
    )
    with torch.no_grad():
        outs = [model(x) for _ in range(2)]
    seconds = time.monotonic() - start
    for lane in handle.backend._runtime.lanes:
        lane.drain()  # the next pass's prefetch has finished: no gather temporary is alive
    grown = _anonymous_kib() - before
    rss = _mapping_rss_kib(lease.base, lease.base + lease.size)
    backend = handle.backend
    source = backend._runtime.transfer.source
    pieces = getattr(source, "pieces", [])
    stats = handle.stats
    block_bytes = max(layout.nbytes for layout in backend._layouts)
    result = {
        "private_growth_bytes": grown * 1024,
        "slot_bytes": 2 * stats.slot_bytes,
        "gather_input_bytes": backend._runtime.transfer.input_bytes,
        "block_bytes": block_bytes,
        "lease_bytes": lease.size,
        "lease_rss_bytes": rss * 1024,
        "pieces": sum(len(block) for block in pieces),
        "pieces_in_lease": all(lease.contains(p.source) for block in pieces for p in block),
        "piece_bytes": sum(p.source.numel() for block in pieces for p in block),
        "host_shard_bytes": stats.host_shard_bytes,
        "shard_source": stats.shard_source,
        "seconds": seconds,
    }
    handle.close()
    # Reference: the same weights loaded privately, run unhooked (after the measurement).
    reference = WideStack(depth, dim)
    reference.load_state_dict({k: v.clone() for k, v in SafetensorsLease(Path(lease_path)).tensors.items()})
    with torch.no_grad():
        want = reference(x)
    result["equal"] = all(bool(torch.equal(out, want)) for out in outs)
    result["lease_closed"] = lease.closed
    write_result(outdir, rank, result)
    dist.destroy_process_group()


def rollback_every_step(rank: int, world: int, rdzv: str, outdir: str, lease_path: str) -> None:
    """Every rank fails at each enable step in turn: rolled back, lease closed, DLO group gone."""
    from dlo_fixtures import SafetensorsLease, TinyDiT

    from hwr.client.carrier import LeaseCarrier
    from hwr.dlo_backend import EnableStep, LayerwiseOffloadBackend, apply_layerwise_offload
    from hwr.dlo_backend import backend as backend_module

    init_gloo(rank, world, rdzv, 20)
    opened: list[Any] = []  # probe: every DLO communicator the backends create (calls through)
    real_open = backend_module.open_dlo_group

    def recording_open(chosen: Any, device: torch.device) -> Any:
        opened.append(real_open(chosen, device))
        return opened[-1]

    backend_module.open_dlo_group = recording_open  # type: ignore[assignment]
    model = TinyDiT(3, 2, seed=0)
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        want = model(x)
    real = LayerwiseOffloadBackend._enter
    attempts: list[dict[str, Any]] = []
    for failing in [*EnableStep, None]:
        entered: list[str] = []

        def enter(
            self: LayerwiseOffloadBackend,
            step: EnableStep,
            failing: EnableStep | None = failing,
            entered: list[str] = entered,
        ) -> None:
            real(self, step)
            entered.append(step.value)
            if step is failing:
                raise MemoryError(f"injected at {step.value}")

        LayerwiseOffloadBackend._enter = enter  # type: ignore[method-assign]
        lease = SafetensorsLease(Path(lease_path))
        groups_during, before = 0, len(opened)
        try:
            handle = apply_layerwise_offload(
                model, device="cpu", host_source=LeaseCarrier(lease), use_allgather=True, group=dist.group.WORLD
            )
            groups_during = sum(not c.closed for c in opened)
            with torch.no_grad():
                ok = bool(torch.equal(model(x), want))
            handle.close()
            error = None
        except Exception as exc:
            ok, error = False, type(exc).__name__
        with torch.no_grad():
            usable = bool(torch.equal(model(x), want))
        attempts.append(
            {
                "step": None if failing is None else failing.value,
                "entered": failing is None or (failing.value in entered),
                "error": error,
                "ok": ok,
                "usable": usable,
                "lease_closes": lease.close_calls,
                "groups_opened": len(opened) - before,
                "groups_left": sum(not c.closed for c in opened),
                "groups_during": groups_during,
            }
        )
    LayerwiseOffloadBackend._enter = real  # type: ignore[method-assign]
    write_result(outdir, rank, {"attempts": attempts})
    dist.destroy_process_group()


def two_backends(rank: int, world: int, rdzv: str, outdir: str) -> None:
    """Two models offloaded with AllGather on the same ranks at once, run interleaved."""
    from dlo_fixtures import TinyDiT

    from hwr.dlo_backend import apply_layerwise_offload

    init_gloo(rank, world, rdzv, 20)
    first, second = TinyDiT(3, 2, seed=0), TinyDiT(4, 1, seed=1)
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        want = [first(x), second(x)]
    handles = [
        apply_layerwise_offload(model, device="cpu", use_allgather=True, group=dist.group.WORLD)
        for model in (first, second)
    ]
    with torch.no_grad():
        got = [[first(x), second(x)] for _ in range(2)]
    communicators = [h.backend._group for h in handles]
    distinct = communicators[0] is not communicators[1] and communicators[0].prefix != communicators[1].prefix
    for handle in reversed(handles):
        handle.close()
    write_result(
        outdir,
        rank,
        {
            "equal": [bool(torch.equal(g, w)) for pair in got for g, w in zip(pair, want, strict=True)],
            "distinct": distinct,
            "closed": all(c.closed for c in communicators),
        },
    )
    dist.destroy_process_group()
