"""Rank-local streaming on CPU: bit-identical outputs, two-slot residency, placeholders, teardown."""

from __future__ import annotations

import pytest
import torch
from dlo_fixtures import TinyDiT
from torch import nn

from hwr.dlo_backend import apply_layerwise_offload
from hwr.dlo_backend.lanes import ThreadLane
from hwr.dlo_backend.layout import TensorMeta, plan_block
from hwr.dlo_backend.slots import SlotPair
from hwr.dlo_backend.transfer import StagedTransfer

pytestmark = pytest.mark.timeout(60)


def _probe_residency(model: TinyDiT, handle, seen: list[tuple[list[int], object]]) -> None:
    """Record, inside every block's innermost module, which blocks hold weights and the slots."""

    def record(_module: nn.Module, _args: object) -> None:
        seen.append((handle.backend.materialized_blocks(), handle.slot_state()))

    for block in [*model.blocks, *model.single_blocks]:
        inner = block.norm if hasattr(block, "norm") else block.lin
        inner.register_forward_pre_hook(record)


@pytest.mark.parametrize("zero_copy", [True, False], ids=["bind", "copy"])
@pytest.mark.parametrize(("depth", "single"), [(2, 0), (3, 2), (4, 3), (5, 2), (7, 0)])
def test_outputs_bit_identical_and_at_most_two_blocks_materialized(depth: int, single: int, zero_copy: bool) -> None:
    model = TinyDiT(depth, single)
    inputs = [torch.randn(3, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with torch.no_grad():
        expected = [model(x) for x in inputs]
    handle = apply_layerwise_offload(model, device="cpu", cpu_zero_copy=zero_copy)
    seen: list[tuple[list[int], object]] = []
    _probe_residency(model, handle, seen)
    count = depth + single
    with torch.no_grad():
        for x, want in zip(inputs, expected, strict=True):
            assert torch.equal(model(x), want)
            # Between forwards, no block holds weights: only placeholders are attached.
            assert handle.backend.materialized_blocks() == []
            assert all(p.numel() == 0 for b in model.blocks for p in b.parameters())
    assert len(seen) == 3 * count
    for step, (materialized, slots) in enumerate(seen):
        running = step % count
        assert materialized == [running]  # only the running block is bound
        assert slots.bound == running
        assert running in slots.owners
        # The prefetch of the next block sits in the other slot: two blocks at most on the device.
        assert slots.owners[1 - slots.owners.index(running)] == (running + 1) % count
    handle.close()
    with torch.no_grad():
        assert torch.equal(model(inputs[0]), expected[0])


def test_transposed_weight_keeps_its_stride_while_streamed() -> None:
    model = TinyDiT(3, 0)
    strides: list[tuple[int, ...]] = []
    model.blocks[1].norm.register_forward_pre_hook(lambda *_: strides.append(model.blocks[1].proj_t.stride()))
    handle = apply_layerwise_offload(model, device="cpu", blocks_attr="blocks")
    with torch.no_grad():
        model(torch.randn(2, 16))
    assert strides == [(1, 16)]
    handle.close()
    assert model.blocks[1].proj_t.stride() == (1, 16)


def test_close_reattaches_the_original_tensors_and_is_idempotent() -> None:
    model = TinyDiT(3, 2)
    originals = {name: p.data_ptr() for name, p in model.named_parameters()}
    handle = apply_layerwise_offload(model, device="cpu")
    with torch.no_grad():
        model(torch.randn(2, 16))
    handle.close()
    handle.close()
    assert handle.closed
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == originals
    assert all(not b._forward_pre_hooks and not b._forward_hooks for b in [*model.blocks, *model.single_blocks])


def test_resident_layers_stay_materialized_and_are_not_streamed() -> None:
    model = TinyDiT(4, 0)
    x = torch.randn(2, 16)
    with torch.no_grad():
        want = model(x)
    handle = apply_layerwise_offload(model, device="cpu", blocks_attr="blocks", resident_layers=1)
    assert handle.stats.resident_blocks == 1 and handle.stats.streamed_blocks == 3
    with torch.no_grad():
        assert torch.equal(model(x), want)
        assert torch.equal(model(x), want)
    assert all(p.numel() > 0 for p in model.blocks[0].parameters())
    assert all(p.numel() == 0 for p in model.blocks[1].parameters())
    handle.close()
    with torch.no_grad():
        assert torch.equal(model(x), want)


def test_out_of_order_calls_fall_back_to_on_demand_fetch() -> None:
    """Calls in the order 1, 3, 0: block 3 never follows block 2, so the ring never prefetches
    it and each of its calls must fetch it into a slot on demand (not in a slot before its
    pre-hook, in one while it runs); block 0 follows 3, as the ring predicts, so it runs from
    the prefetch. Outputs stay bit-identical."""
    model = TinyDiT(4, 0)
    x = torch.randn(2, 16)
    with torch.no_grad():
        want = model.blocks[0](model.blocks[3](model.blocks[1](x)))
    handle = apply_layerwise_offload(model, device="cpu", blocks_attr="blocks")
    owners_before: dict[int, tuple[int | None, int | None]] = {}
    calls: list[tuple[int, bool]] = []  # (block, fetched on demand)

    def arriving(i: int) -> None:
        owners_before[i] = handle.backend.slot_state().owners

    def running(i: int) -> None:
        during = handle.backend.slot_state().owners
        assert i in during, f"block {i} runs from no slot: {during}"
        calls.append((i, i not in owners_before[i]))

    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda *_, i=i: arriving(i), prepend=True)  # before the backend's hook
        block.norm.register_forward_pre_hook(lambda *_, i=i: running(i))
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model.blocks[0](model.blocks[3](model.blocks[1](x))), want)
    assert [b for b, _ in calls] == [1, 3, 0] * 2
    assert all(fetched for b, fetched in calls if b == 3), calls
    assert not any(fetched for b, fetched in calls if b == 0), calls  # the check tells the two apart
    handle.close()


def test_a_block_that_raises_does_not_leave_its_weights_bound() -> None:
    model = TinyDiT(3, 0)
    x = torch.randn(2, 16)
    with torch.no_grad():
        want = model(x)
    handle = apply_layerwise_offload(model, device="cpu", blocks_attr="blocks")

    def boom(*_: object) -> None:
        raise RuntimeError("injected")

    hook = model.blocks[1].fc2.register_forward_pre_hook(boom)
    with torch.no_grad(), pytest.raises(RuntimeError, match="injected"):
        model(x)
    hook.remove()
    with torch.no_grad():
        assert torch.equal(model(x), want)
    assert handle.backend.materialized_blocks() == []
    handle.close()


def test_heterogeneous_blocks_share_slots_sized_to_the_largest() -> None:
    model = TinyDiT(3, 2)
    handle = apply_layerwise_offload(model, device="cpu", cpu_zero_copy=False)
    layouts = handle.backend._layouts
    assert len({layout.nbytes for layout in layouts}) > 1
    assert handle.stats.slot_bytes == max(layout.nbytes for layout in layouts)
    handle.close()
    bound = apply_layerwise_offload(TinyDiT(3, 2), device="cpu")
    assert bound.stats.mode == "bind" and bound.stats.slot_bytes == 0  # nothing is copied on a CPU device
    bound.close()


def test_staged_transfer_reuses_a_staging_buffer_only_after_its_copy_finished() -> None:
    metas = [TensorMeta("a", torch.float32, (8, 4), (1, 8)), TensorMeta("b", torch.bfloat16, (5,), (1,))]
    layouts = [plan_block(f"b{i}", metas) for i in range(3)]
    hosts = [[torch.randn(4, 8).t(), torch.randn(5).to(torch.bfloat16)] for _ in range(3)]
    slots = SlotPair(max(layout.nbytes for layout in layouts), torch.device("cpu"))
    lane, packer = ThreadLane("copy"), ThreadLane("pack")
    gate = __import__("threading").Event()
    lane.submit(gate.wait)  # hold the lane: the first two fills stay pending
    transfer = StagedTransfer(hosts, layouts, slots, lane, pin=False, packer=packer)
    transfer.fill(0, 0)
    transfer.fill(1, 1)
    transfer.fill(2, 0)  # returns at once: the packer, not the caller, waits for staging buffer 0
    __import__("time").sleep(0.2)
    assert not slots.ready[0].query()  # staging buffer 0 is still read by the pending copy of block 0
    gate.set()
    slots.ready[0].wait_host()
    packer.drain()
    lane.drain()
    for block, slot in ((1, 1), (2, 0)):
        for index, host in enumerate(hosts[block]):
            view = slots.tensor_view(slot, layouts[block], index)
            assert torch.equal(view, host) and view.stride() == host.stride()
    packer.close()
    lane.close()
