"""The CUDA lanes' stream bookkeeping, with torch.cuda's stream and event objects faked.

No GPU here: ``torch.cuda.Stream``/``Event``/``current_stream``/``stream`` are replaced by
objects that log what would be enqueued (the boundary the lanes call), so the tests check which
streams are synchronized or made to wait, not CUDA itself.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import pytest
import torch

from hwr.dlo_backend.lanes import CudaLane, CurrentStreamLane

pytestmark = pytest.mark.timeout(30)


class FakeStream:
    ids = itertools.count(1)

    def __init__(self, log: list[tuple[str, int]], device: object = None) -> None:
        self.cuda_stream = next(self.ids)
        self.log = log

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.cuda_stream))

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait", self.cuda_stream))


class FakeEvent:
    def __init__(self, log: list[tuple[str, int]]) -> None:
        self.log = log

    def record(self, stream: FakeStream) -> None:
        self.log.append(("record", stream.cuda_stream))

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


@pytest.fixture
def streams(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[list[tuple[str, int]], list[FakeStream]]]:
    log: list[tuple[str, int]] = []
    current = [FakeStream(log)]  # the default stream

    @contextlib.contextmanager
    def use(stream: FakeStream) -> Iterator[None]:
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(log, device))
    monkeypatch.setattr(torch.cuda, "Event", lambda: FakeEvent(log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", use)
    yield log, current


def test_the_compute_lane_drain_synchronizes_every_stream_a_forward_ran_on(streams) -> None:
    log, current = streams
    default = current[0]
    compute = CurrentStreamLane(torch.device("cuda", 0))
    compute.record()  # a forward on the default stream
    side = FakeStream(log)
    with torch.cuda.stream(side):
        compute.record()  # a forward under a non-default stream
    log.clear()
    compute.drain()  # from the default stream again
    assert sorted(s for op, s in log if op == "synchronize") == sorted([default.cuda_stream, side.cuda_stream])


def test_a_copy_lane_made_to_wait_on_the_allocating_stream_waits_on_its_own_stream(streams) -> None:
    log, current = streams
    compute = CurrentStreamLane(torch.device("cuda", 0))
    copy = CudaLane(torch.device("cuda", 0))
    allocated = compute.record()  # what the backend does right after allocating the slots
    copy.wait(allocated)
    assert log == [("record", current[0].cuda_stream), ("wait", copy.stream.cuda_stream)]
