"""The staged transfer packs on a worker thread, at most two blocks ahead, and never hangs.

CPU lanes (worker threads) stand in for the CUDA copy stream: the ordering rules are the same
(see ``lanes``). A slow pack is injected by wrapping ``StagedTransfer._pack`` (the host memcpy).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hwr.dlo_backend.lanes import LaneError, ThreadLane
from hwr.dlo_backend.layout import TensorMeta, plan_block
from hwr.dlo_backend.slots import SlotPair
from hwr.dlo_backend.transfer import StagedTransfer

pytestmark = pytest.mark.timeout(60)


def _blocks(count: int) -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    return [
        [torch.randn(8, 16), torch.randn(16, 8).t(), torch.randn(5).to(torch.bfloat16)] for _ in range(count)
    ]


def _transfer(hosts: list[list[torch.Tensor]]) -> tuple[StagedTransfer, list[ThreadLane]]:
    layouts = [
        plan_block(f"b{i}", [TensorMeta(f"b{i}.{j}", t.dtype, tuple(t.shape), tuple(t.stride())) for j, t in
                             enumerate(ts)])
        for i, ts in enumerate(hosts)
    ]
    slots = SlotPair(max(layout.nbytes for layout in layouts), torch.device("cpu"))
    copy, packer = ThreadLane("copy"), ThreadLane("pack")
    return StagedTransfer(hosts, layouts, slots, copy, pin=False, packer=packer), [packer, copy]


def _close(lanes: list[ThreadLane]) -> None:
    for lane in lanes:
        lane.close()


def test_fill_returns_before_the_pack_and_the_slot_then_holds_the_block(monkeypatch) -> None:
    pack = StagedTransfer._pack
    monkeypatch.setattr(StagedTransfer, "_pack", lambda self, b, s: (time.sleep(0.3), pack(self, b, s)))
    hosts = _blocks(2)
    transfer, lanes = _transfer(hosts)
    try:
        start = time.monotonic()
        transfer.fill(0, 0)
        transfer.fill(1, 1)
        assert time.monotonic() - start < 0.2  # the hook is not blocked by two 0.3 s packs
        for block in (0, 1):
            transfer._slots.ready[block].wait_host()
            for index, host in enumerate(hosts[block]):
                assert torch.equal(transfer.tensor(block, block, index), host)
    finally:
        _close(lanes)


def test_at_most_two_blocks_are_packed_ahead_of_their_copies(monkeypatch) -> None:
    events: list[str] = []
    pack = StagedTransfer._pack
    monkeypatch.setattr(StagedTransfer, "_pack", lambda self, b, s: (events.append(f"pack {b}"), pack(self, b, s)))
    hosts = _blocks(3)
    transfer, lanes = _transfer(hosts)
    gate = threading.Event()
    try:
        copy = lanes[1]
        copy.submit(gate.wait)  # the copy lane is busy: no H2D finishes yet
        for block in range(3):
            transfer.fill(block, block % 2)
        time.sleep(0.3)
        assert events == ["pack 0", "pack 1"]  # block 2 needs staging buffer 0, still read by block 0's H2D
        gate.set()  # block 0's H2D runs, which frees staging buffer 0 for block 2
        transfer._slots.ready[0].wait_host()
        assert events == ["pack 0", "pack 1", "pack 2"]
        for index, host in enumerate(hosts[2]):
            assert torch.equal(transfer.tensor(2, 0, index), host)
    finally:
        gate.set()
        _close(lanes)


def test_a_failed_pack_fails_its_block_and_every_later_one_without_hanging(monkeypatch) -> None:
    pack = StagedTransfer._pack

    def failing(self, block, staging):
        if block == 1:
            raise OSError("bus error reading the mapping")
        pack(self, block, staging)

    monkeypatch.setattr(StagedTransfer, "_pack", failing)
    transfer, lanes = _transfer(_blocks(3))
    try:
        for block in range(3):
            transfer.fill(block, block % 2)
        ready = transfer._slots.ready
        with pytest.raises(LaneError, match="bus error"):
            ready[1].wait_host()
        with pytest.raises(LaneError, match="earlier staged pack failed"):
            ready[0].wait_host()  # block 2, packed after the failure
    finally:
        _close(lanes)
