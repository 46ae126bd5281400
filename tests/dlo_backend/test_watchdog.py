"""The AllGather watchdog: a gather that never completes becomes a typed error, not a hang.

NCCL reports nothing to Python when a peer never joins a collective; the watchdog polls the
gathers' completion signals instead. Unit tests drive it with real lane signals; the backend
test stalls a real gloo gather (the one fault injected, at the collective boundary) on a
one-rank group forced onto the AllGather path.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dlo_fixtures import TinyDiT

from hwr.client.errors import HwrError
from hwr.dlo_backend import apply_layerwise_offload
from hwr.dlo_backend import group as groups
from hwr.dlo_backend import runtime as runtime_module
from hwr.dlo_backend.lanes import ThreadLane, completed_signal
from hwr.dlo_backend.transfer import AllGatherTransfer
from hwr.dlo_backend.watchdog import CollectiveWatchdog, abort_group, watchdog_timeout_s

pytestmark = pytest.mark.timeout(60)


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_a_gather_pending_past_the_timeout_expires_once_and_names_it() -> None:
    calls: list[str] = []
    lane, gate = ThreadLane("comm"), threading.Event()
    lane.submit(gate.wait)  # a gather no peer joins
    watchdog = CollectiveWatchdog(0.2, calls.append, poll_s=0.02)
    try:
        watchdog.watch(completed_signal(), "the gather of block 0")
        watchdog.watch(lane.record(), "the gather of block 1")
        assert _wait_for(lambda: bool(calls))
        time.sleep(0.2)
        assert calls == ["the gather of block 1 did not complete within 0.2 s"]
    finally:
        gate.set()
        watchdog.close()
        lane.close()


def test_gathers_that_complete_in_time_never_expire() -> None:
    calls: list[str] = []
    lane = ThreadLane("comm")
    watchdog = CollectiveWatchdog(0.3, calls.append, poll_s=0.02)
    try:
        for block in range(20):
            lane.submit(lambda: time.sleep(0.01))
            watchdog.watch(lane.record(), f"the gather of block {block}")
        lane.drain()
        time.sleep(0.5)
        assert calls == [] and watchdog.expired is None
    finally:
        watchdog.close()
        lane.close()


@pytest.fixture
def one_rank_gloo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    world = dist.group.WORLD
    # A one-rank group streams rank-locally; force it so the gathers (and the watchdog) run.
    monkeypatch.setattr(groups, "select_group", lambda *, use_allgather, **_: world if use_allgather else None)
    try:
        yield world
    finally:
        dist.destroy_process_group()


def test_a_stuck_gather_poisons_the_backend_with_a_typed_error(one_rank_gloo, monkeypatch) -> None:
    assert watchdog_timeout_s(one_rank_gloo, torch.device("cpu")) > 1  # 90% of the group's timeout
    assert "not aborted" in (abort_group(one_rank_gloo, torch.device("cpu")) or "")  # gloo raises by itself
    monkeypatch.setattr(runtime_module, "watchdog_timeout_s", lambda group, device: 0.3)
    stall, stalled = threading.Event(), threading.Event()
    gather = AllGatherTransfer._gather

    def stuck_gather(self, block, *args):  # the peer never joins the gather of block 1
        if block == 1 and not stall.is_set():
            stalled.set()
            stall.wait(30)
        return gather(self, block, *args)

    monkeypatch.setattr(AllGatherTransfer, "_gather", stuck_gather)
    model = TinyDiT(3, 2)
    x = torch.randn(4, 16)
    handle = apply_layerwise_offload(model, device="cpu", use_allgather=True, group=one_rank_gloo)
    stream = handle.backend._runtime.stream
    releaser = threading.Thread(target=lambda: _wait_for(lambda: stream.poisoned, 20) and stall.set())
    releaser.start()
    try:
        # Blocks on block 1 until the watchdog poisoned the stream; the next block then refuses.
        with pytest.raises(HwrError, match=r"gather of block 1 did not complete within 0\.3 s"), torch.no_grad():
            model(x)
        assert stalled.is_set() and stream.poisoned
        with pytest.raises(HwrError, match=r"gather of block 1 did not complete within 0\.3 s"), torch.no_grad():
            model(x)  # and every later call
    finally:
        stall.set()
        releaser.join()
        handle.close()
    assert handle.closed


def test_a_communicator_object_supplies_its_own_timeout_and_abort() -> None:
    class Communicator:  # the shape of a DLO-owned communicator wrapper: timeout and abort()
        timeout = timedelta(seconds=10)
        aborted = 0

        def abort(self) -> str | None:
            self.aborted += 1
            return None

    communicator = Communicator()
    assert watchdog_timeout_s(communicator, torch.device("cpu")) == pytest.approx(9.0)
    assert abort_group(communicator, torch.device("cpu")) is None and communicator.aborted == 1
