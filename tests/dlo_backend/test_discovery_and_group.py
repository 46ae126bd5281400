"""Block discovery, AllGather group selection and lanes."""

from __future__ import annotations

import threading

import pytest
import torch
from dlo_fixtures import Block, TinyDiT
from torch import nn

from hwr.client.errors import InvalidRequest
from hwr.dlo_backend.discovery import find_block_stacks
from hwr.dlo_backend.group import select_group
from hwr.dlo_backend.lanes import LaneError, ThreadLane


def test_declared_stacks_are_found_in_order() -> None:
    model = TinyDiT(3, 2)
    stacks = find_block_stacks(model)
    assert [s.attr for s in stacks] == ["blocks", "single_blocks"]
    assert [len(s.blocks) for s in stacks] == [3, 2]


def test_explicit_and_dotted_attributes() -> None:
    outer = nn.Module()
    outer.transformer = TinyDiT(2, 0)
    stacks = find_block_stacks(outer, ["transformer.blocks", "transformer.out"])
    assert [len(s.blocks) for s in stacks] == [2, 1]
    with pytest.raises(InvalidRequest, match="nope"):
        find_block_stacks(outer, "transformer.nope")


def test_fallback_scan_finds_lists_of_same_class_blocks_only() -> None:
    model = nn.Module()
    model.layers = nn.ModuleList(Block(8, 16) for _ in range(3))
    model.heads = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])  # mixed classes: not a stack
    model.extra = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    stacks = find_block_stacks(model)
    assert [s.attr for s in stacks] == ["layers", "extra"]


def test_a_block_in_two_stacks_is_rejected() -> None:
    model = TinyDiT(2, 0)
    with pytest.raises(InvalidRequest, match="twice"):
        find_block_stacks(model, ["blocks", "blocks"])


class _FakeGroupSize:
    """Stands in for a process group in the pure selection rule (sizes only)."""


def test_group_selection_prefers_dp_then_sp(monkeypatch: pytest.MonkeyPatch) -> None:
    dp, sp = _FakeGroupSize(), _FakeGroupSize()
    sizes = {id(dp): 1, id(sp): 4}
    monkeypatch.setattr("hwr.dlo_backend.group.group_size", lambda g: 1 if g is None else sizes[id(g)])
    assert select_group(use_allgather=True, dp_group=dp, sp_group=sp) is sp
    sizes[id(dp)] = 2
    assert select_group(use_allgather=True, group="auto", dp_group=dp, sp_group=sp) is dp
    sizes[id(dp)] = sizes[id(sp)] = 1
    assert select_group(use_allgather=True, dp_group=dp, sp_group=sp) is None
    assert select_group(use_allgather=False, dp_group=dp, sp_group=sp) is None
    with pytest.raises(InvalidRequest):
        select_group(use_allgather=False, group=dp)


def test_thread_lane_orders_work_and_a_failure_is_sticky() -> None:
    lane = ThreadLane("t")
    seen: list[int] = []
    gate = threading.Event()
    lane.submit(gate.wait)
    lane.submit(lambda: seen.append(1))
    signal = lane.record()
    assert not signal.query()
    gate.set()
    signal.wait_host()
    assert seen == [1]
    lane.submit(lambda: (_ for _ in ()).throw(OSError("boom")))
    lane.submit(lambda: seen.append(2))  # skipped: the lane failed before it
    with pytest.raises(LaneError, match="boom"):
        lane.drain()
    assert seen == [1]
    lane.close()
    lane.close()


def test_a_waiting_lane_does_not_run_before_its_signal() -> None:
    first, second = ThreadLane("a"), ThreadLane("b")
    gate = threading.Event()
    first.submit(gate.wait)
    ready = first.record()
    out = torch.zeros(1)
    second.wait(ready)
    second.submit(lambda: out.fill_(1))
    done = second.record()
    assert not done.query() and out.item() == 0
    gate.set()
    done.wait_host()
    assert out.item() == 1
    first.close()
    second.close()
