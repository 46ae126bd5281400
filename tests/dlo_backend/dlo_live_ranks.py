"""Rank programs for the AllGather live-update tests (separate processes, real gloo groups).

Every rank runs the same passes on its own input; updates reach the ranks at different passes
(as separate watchers would deliver them). Each rank writes, per pass, the revision key it ran
on and whether its output equals a fresh, unhooked model of that revision on its input.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from dlo_ranks import init_gloo, write_result


def switch_together(rank: int, world: int, rdzv: str, outdir: str, revisions: dict[str, str],
                    plan: dict[str, dict[str, str]]) -> None:
    """``plan[str(rank)][str(pass)] = name``: before that pass this rank calls ``update`` with
    revision ``name`` (``revisions[name]``: the file). ``bad<i>`` has the key of ``r<i>`` but
    tensors that break the contract: the same revision, broken on this rank only."""
    from dlo_fixtures import SafetensorsLease, TinyDiT

    from hwr.client.errors import HwrError
    from hwr.dlo_backend import apply_layerwise_offload

    init_gloo(rank, world, rdzv, 20)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1000 + rank))  # DP: its own request
    wants = {}
    with torch.no_grad():
        for name in revisions:
            if not name.startswith("bad"):
                wants[name] = TinyDiT(3, 2, seed=int(name[1:]))(x)

    def lease(name: str) -> SafetensorsLease:
        key = "r" + name.removeprefix("bad") if name.startswith("bad") else name
        return SafetensorsLease(Path(revisions[name]), key=key.ljust(64, "0"))

    keys = {lease_name.ljust(64, "0"): lease_name for lease_name in revisions if not lease_name.startswith("bad")}
    model = TinyDiT(3, 2, seed=0)
    handle = apply_layerwise_offload(model, device="cpu", host_source=lease("r0"), use_allgather=True,
                                     dp_group=dist.group.WORLD, live_updates=True)
    passes, errors, noted = [], [], []
    seen: object = None
    mine = plan.get(str(rank), {})
    for index in range(12):
        if str(index) in mine:
            try:
                handle.update(lease(mine[str(index)]))
            except HwrError as exc:
                errors.append([index, type(exc).__name__])
        with torch.no_grad():
            out = model(x)
            # The caller's own collective on the same ranks, between DLO's gathers and agreements.
            dist.all_reduce(torch.ones(1))
        status = handle.revision
        name = keys[status.key]
        passes.append({"key": name, "equal": bool(torch.equal(out, wants[name]))})
        if status.last_error is not None and status.last_error is not seen:
            seen = status.last_error
            noted.append([index, type(seen).__name__, dict(seen.details)])
    handle.close()
    write_result(outdir, rank, {"passes": passes, "errors": errors, "noted": noted})
    dist.destroy_process_group()
