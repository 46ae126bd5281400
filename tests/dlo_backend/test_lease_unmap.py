"""Closing an offload handle unmaps a real hwrd lease at once, not when the GC gets to it.

The lease's views are the only thing keeping the mapping alive after ``Lease.close`` (the
mmap refuses to close while views exist; it is unmapped when the last one dies). The backend
must therefore drop every view it held (sources, transfer, stream) before closing the lease,
so that ``/proc/self/maps`` shows no mapping of the store once ``close`` returns. The garbage
collector is disabled while this is checked: reference counting alone must free them.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import hwr.client as hc
from hwr.dlo_backend import apply_layerwise_offload

pytestmark = pytest.mark.timeout(120)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x)))


class Stack(nn.Module):
    def __init__(self, depth: int = 4, dim: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _mappings_under(root: Path) -> int:
    prefix = os.path.realpath(root) + "/"
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
        return sum(1 for line in fh if line.rstrip().split(maxsplit=5)[-1].startswith(prefix))


@pytest.mark.parametrize("zero_copy", [True, False], ids=["bind", "copy"])
def test_closing_the_handle_unmaps_the_lease_without_the_garbage_collector(hwrd, zero_copy: bool) -> None:
    torch.manual_seed(0)
    model = Stack().eval()
    x = torch.randn(3, 32)
    with torch.no_grad():
        want = model(x)
    with hc.connect(str(hwrd.socket)) as client:
        key = client.publish(hc.ArtifactIdentity.simple("test/lease-unmap"), model.state_dict())
        target = Stack().eval()
        lease = client.acquire(key)
        assert _mappings_under(hwrd.root) > 0
        gc.disable()
        try:
            handle = apply_layerwise_offload(target, device="cpu", host_source=lease, cpu_zero_copy=zero_copy)
            with torch.no_grad():
                assert torch.equal(target(x), want)
            handle.close()
            assert lease.closed
            assert _mappings_under(hwrd.root) == 0, "a view of the lease outlived its close"
        finally:
            gc.enable()
        with torch.no_grad():
            assert torch.equal(target(x), want)  # private copies now
