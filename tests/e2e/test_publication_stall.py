"""The publication stall timeout cuts only publications that stopped moving.

A real hwrd with a short ``publication_stall_timeout_s``; a writer that keeps writing (one tensor
every half timeout, for more than two timeouts in all) commits, with memfd and with file staging: each write
changes the staging's marks (``Publishing.progress_marks``), which restarts the timeout. (A
writer that stops is cut: ``tests/faults/test_hostile_sessions_relay.py``.)
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.publisher import TensorSpec
from hwr.daemon.app.launcher import DaemonProcess
from hwr.daemon.policy.deadline import overdue, progressed

STALL_TIMEOUT_S = 1.5
TENSORS = 5
PAUSE_S = 0.75  # between two writes: half the timeout, while the whole staging lasts 2.5 of them


def test_progress_restarts_the_stall_clock() -> None:
    assert progressed((1, 2), None, 10.0, 0.0) == (True, 10.0)  # first look: counts as progress
    assert progressed((1, 2), (1, 2), 15.0, 10.0) == (False, 10.0)
    assert progressed((1, 3), (1, 2), 15.0, 10.0) == (True, 15.0)
    assert overdue([("a", 10.0), ("b", 14.0)], 15.5, 2.0) == ["a"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("staging", ["memfd", "files"])
def test_a_slow_writer_that_keeps_writing_is_not_cut(spawn_daemon: Callable[..., DaemonProcess], staging: str) -> None:
    flags = ["--publication-stall-timeout-s", str(STALL_TIMEOUT_S), "--housekeeping-interval-s", "0.2"]
    if staging == "files":
        flags += ["--memfd-staging-max-bytes", "0"]
    daemon = spawn_daemon(*flags)
    specs = [TensorSpec(f"t{i}", torch.float32, (64 * 1024,)) for i in range(TENSORS)]
    with connect(daemon.socket) as client:
        began = time.monotonic()
        pub = client.publisher(ArtifactIdentity.simple(f"stall/slow-{staging}"), specs)
        for i in range(TENSORS):
            time.sleep(PAUSE_S)
            pub.write(f"t{i}", torch.full((64 * 1024,), float(i)))
        key = pub.commit()
        took = time.monotonic() - began
        assert took > 2 * STALL_TIMEOUT_S  # the staging outlived the timeout several times over
        with client.acquire(key) as lease:
            assert float(lease.tensors[f"t{TENSORS - 1}"][0]) == TENSORS - 1
