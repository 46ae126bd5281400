"""Streaming from a real mmapped lease: zero host copies, exact binding, ownership and close order."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from dlo_fixtures import SafetensorsLease, TinyDiT

from hwr.client.carrier import LeaseCarrier
from hwr.client.errors import LeaseClosed
from hwr.dlo_backend import HostSourceMismatch, OffloadError, apply_layerwise_offload
from hwr.dlo_backend.transfer import DirectTransfer, HostBindTransfer

pytestmark = pytest.mark.timeout(60)


def _skeleton_like(model: TinyDiT, *, meta: bool) -> TinyDiT:
    """A model whose non-block layers match ``model`` and whose blocks hold other (or no) bytes."""
    with torch.device("meta" if meta else "cpu"):
        other = TinyDiT(len(model.blocks), len(model.single_blocks), seed=99)
    if meta:
        other.embed.to_empty(device="cpu")
        other.out.to_empty(device="cpu")
        for block in other.blocks:
            block.offset = torch.full_like(block.offset, 0.01, device="cpu")  # non-persistent: not leased
    other.embed.load_state_dict(model.embed.state_dict())
    other.out.load_state_dict(model.out.state_dict())
    return other


@pytest.mark.parametrize("meta", [False, True])
def test_lease_backed_outputs_are_bit_identical_and_bind_the_mapping(tmp_path: Path, meta: bool) -> None:
    model = TinyDiT(3, 2)
    x = torch.randn(4, 16)
    with torch.no_grad():
        want = model(x)
    lease = SafetensorsLease.write(tmp_path / "m.safetensors", model.state_dict())
    target = _skeleton_like(model, meta=meta)
    handle = apply_layerwise_offload(target, device="cpu", host_source=LeaseCarrier(lease))
    # The backend streams from the lease's mapped pages themselves: no host copy was made.
    sources = handle.backend._streamed
    persistent = [
        (ref, host) for src in sources for ref, host in zip(src.refs, src.host, strict=True) if ref.persistent
    ]
    assert persistent and all(lease.contains(host) for _, host in persistent)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(target(x), want)
    assert lease.close_calls == 0
    handle.close()
    handle.close()
    assert lease.close_calls == 1 and lease.closed
    # Weights are private CPU copies now: the model outlives the lease.
    assert not any(lease.contains(p) for p in target.parameters())
    with torch.no_grad():
        assert torch.equal(target(x), want)


def test_a_lease_tensor_with_another_stride_is_a_typed_error_and_closes_the_lease(tmp_path: Path) -> None:
    model = TinyDiT(3, 0)
    state = dict(model.state_dict())
    state["blocks.1.proj_t"] = state["blocks.1.proj_t"].contiguous()  # same shape, other stride
    lease = SafetensorsLease.write(tmp_path / "m.safetensors", state)
    with pytest.raises(HostSourceMismatch, match=r"blocks\.1\.proj_t"):
        apply_layerwise_offload(model, device="cpu", blocks_attr="blocks", host_source=LeaseCarrier(lease))
    assert lease.close_calls == 1


def test_a_missing_lease_tensor_is_a_typed_error(tmp_path: Path) -> None:
    model = TinyDiT(3, 0)
    state = {k: v for k, v in model.state_dict().items() if k != "blocks.2.fc1.bias"}
    lease = SafetensorsLease.write(tmp_path / "m.safetensors", state)
    with pytest.raises(HostSourceMismatch, match=r"blocks\.2\.fc1\.bias"):
        apply_layerwise_offload(model, device="cpu", blocks_attr="blocks", host_source=lease)
    assert lease.closed


def test_the_carrier_is_taken_exactly_once(tmp_path: Path) -> None:
    model = TinyDiT(3, 0)
    lease = SafetensorsLease.write(tmp_path / "m.safetensors", model.state_dict())
    carrier = LeaseCarrier(lease)
    handle = apply_layerwise_offload(model, device="cpu", blocks_attr="blocks", host_source=carrier)
    assert carrier.taken
    with pytest.raises(LeaseClosed):
        apply_layerwise_offload(TinyDiT(3, 0), device="cpu", blocks_attr="blocks", host_source=carrier)
    handle.close()
    assert lease.close_calls == 1


@pytest.mark.parametrize("zero_copy", [False, True])
@pytest.mark.parametrize("fail", [False, True])
def test_the_lease_is_never_closed_while_a_copy_from_it_is_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: bool, zero_copy: bool
) -> None:
    """Copy lane work that reads the mapping (a slot copy, or the zero-copy path's page
    population) finishes before the lease closes, whether enable fails or close runs."""
    log: list[str] = []
    model = TinyDiT(3, 0)
    lease = SafetensorsLease.write(tmp_path / "m.safetensors", model.state_dict(), log=log)
    if zero_copy:
        real_populate = HostBindTransfer._populate_block

        def slow_populate(self: HostBindTransfer, block: int) -> None:
            log.append(f"copy {block} start")
            time.sleep(0.3)
            real_populate(self, block)
            log.append(f"copy {block} done")

        monkeypatch.setattr(HostBindTransfer, "_populate_block", slow_populate)
    else:
        real_copy = DirectTransfer._copy_block

        def slow_copy(self: DirectTransfer, block: int, slot: int) -> None:
            log.append(f"copy {block} start")
            time.sleep(0.3)  # the initial prefetch is still running when enable fails / close starts
            real_copy(self, block, slot)
            log.append(f"copy {block} done")

        monkeypatch.setattr(DirectTransfer, "_copy_block", slow_copy)
    options = {"blocks_attr": "blocks", "host_source": lease, "cpu_zero_copy": zero_copy}
    if fail:
        from hwr.dlo_backend import EnableStep, LayerwiseOffloadBackend

        real_enter = LayerwiseOffloadBackend._enter

        def enter(self: LayerwiseOffloadBackend, step: EnableStep) -> None:
            real_enter(self, step)
            if step is EnableStep.COMMIT:
                raise OSError("injected")

        monkeypatch.setattr(LayerwiseOffloadBackend, "_enter", enter)
        with pytest.raises(OffloadError, match="commit") as failure:
            apply_layerwise_offload(model, device="cpu", **options)
        assert isinstance(failure.value.__cause__, OSError)
    else:
        apply_layerwise_offload(model, device="cpu", **options).close()
    assert log == ["copy 0 start", "copy 0 done", "close"]
