"""``disable(restore=False)``: the shutdown teardown (no restore of streamed blocks, lease closed)."""

from __future__ import annotations

from pathlib import Path

import torch
from dlo_fixtures import SafetensorsLease, TinyDiT

from hwr.client.carrier import LeaseCarrier
from hwr.dlo_backend import apply_layerwise_offload


def test_shutdown_leaves_streamed_blocks_empty_and_closes_the_lease(tmp_path: Path) -> None:
    model = TinyDiT(3, 2)
    lease = SafetensorsLease.write(tmp_path / "m.safetensors", model.state_dict())
    handle = apply_layerwise_offload(model, device="cpu", host_source=LeaseCarrier(lease), cpu_zero_copy=False)
    with torch.no_grad():
        model(torch.randn(2, 16))
    handle.backend.disable(restore=False)
    assert handle.closed and lease.closed and lease.close_calls == 1
    streamed = [p for stack in (model.blocks, model.single_blocks) for block in stack for p in block.parameters()]
    assert streamed and all(p.numel() == 0 for p in streamed)  # no host copies were made


def test_a_default_disable_still_restores_host_copies(tmp_path: Path) -> None:
    model = TinyDiT(3, 2)
    x = torch.randn(2, 16)
    with torch.no_grad():
        want = model(x)
    lease = SafetensorsLease.write(tmp_path / "m.safetensors", model.state_dict())
    handle = apply_layerwise_offload(model, device="cpu", host_source=LeaseCarrier(lease), cpu_zero_copy=False)
    handle.backend.disable()
    assert lease.closed
    with torch.no_grad():
        assert torch.equal(model(x), want)
