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


class _WeightWithLoader(torch.nn.Parameter):
    """A parameter subclass that only adds Python behaviour (like vLLM's ModelWeightParameter)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return super().__torch_function__(func, types, args, kwargs or {})


class _Wrapper(torch.Tensor):
    """A dispatch-level wrapper: its bytes are not its storage's (like DTensor or quantized tensors)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def test_plain_parameter_subclasses_stream_and_dispatch_wrappers_are_refused() -> None:
    from hwr.dlo_backend.sources import unsupported_reason

    loader_param = torch.Tensor._make_subclass(_WeightWithLoader, torch.zeros(2, 2), False)
    assert unsupported_reason(loader_param, allgather=True) is None
    wrapper = torch.Tensor._make_subclass(_Wrapper, torch.zeros(2, 2), False)
    assert "tensor subclass _Wrapper" in (unsupported_reason(wrapper, allgather=True) or "")
