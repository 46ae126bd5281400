"""The swarm with real hwrd nodes in network namespaces: a node still pulling serves what it verified.

Uses ``test_fleet_peers``'s fabric and nodes (``fleet``): the holder ``a`` sits behind a slow
link (80 Mbit/s), so that ``b``'s pull from it is still running when ``c`` begins; ``c`` then
chains behind ``b`` (the latest partial holder that began before it) and reads from ``b``'s
staging only the ranges ``b`` has verified. Then: ``b``'s staging made to lie (its disk), or
``b`` killed, while ``c`` reads it; ``c`` drops it and completes bit-identical. Skipped like
``test_fleet_peers``.
"""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from hwr.daemon.app.launcher import DaemonProcess

from .helpers import MIB, patterned
from .test_fleet_peers import fleet, held, peers_of, publish, pulling, pytestmark, wait_until

__all__ = ["fleet", "pytestmark"]  # the fixture and the skip conditions, shared


def layered(seed: int) -> dict[str, torch.Tensor]:
    """48 MiB in twelve 4 MiB tensors: a partial holder verifies (and serves) one tensor at a time."""
    return {f"layers.{i}.weight": patterned(4 * MIB, seed + i, torch.bfloat16).reshape(-1, 64)
            for i in range(12)}



def partial_record(remote: Path, key: str, node: str) -> bool:
    path = remote / "holders" / key / f"{node}.json"
    try:
        return bool(json.loads(path.read_text()).get("partial"))
    except (OSError, ValueError):
        return False


def verified(node: DaemonProcess) -> int:
    pulls = peers_of(node)["pulls"]
    return int(pulls[0].get("verified_bytes", 0)) if pulls else 0


def start_chain(fleet: dict[str, Any], seed: int) -> tuple[dict[str, DaemonProcess], str, dict[str, torch.Tensor],
                                                            list[BaseException], threading.Thread]:
    """``a`` holds the artifact behind a slow link; ``b`` is pulling it and has verified 8 MiB."""
    nodes = {"a": fleet["make"]("a", rate="80mbit"), "b": fleet["make"]("b"), "c": fleet["make"]("c")}
    tensors = layered(seed)
    key = publish(nodes["a"], tensors)
    wait_until("a's upload and holder record", lambda: held(fleet["remote"], key, "a"))
    errors: list[BaseException] = []
    b_pull = pulling(nodes["b"], key, errors, tensors)
    wait_until("b's partial holder record", lambda: partial_record(fleet["remote"], key, "b"))
    wait_until("b to verify two tensors", lambda: verified(nodes["b"]) >= 8 * MIB)
    return nodes, key, tensors, errors, b_pull


@pytest.mark.timeout(300)
def test_a_node_pulls_part_of_an_artifact_from_a_node_still_pulling_it(fleet: dict[str, Any]) -> None:
    nodes, key, tensors, errors, b_pull = start_chain(fleet, 21)
    assert peers_of(nodes["b"])["pulls"], "b's pull ended before c began: the test proves nothing"
    c_pull = pulling(nodes["c"], key, errors, tensors)
    b_pull.join(240)
    c_pull.join(240)
    assert not b_pull.is_alive() and not c_pull.is_alive() and not errors, errors
    a, b, c = (peers_of(nodes[n]) for n in "abc")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert c["partial_fetched_bytes"] > 0 and c["fallback_bytes"] == 0 and c["lying_peers"] == 0, c
    assert b["staging_served_bytes"] > 0, b
    # The slow holder's link carried about one copy: c read from b, not from a.
    assert total <= a["served_bytes"] < 1.5 * total, a
    wait_until("b's and c's full holder records", lambda: all(
        held(fleet["remote"], key, n) and not partial_record(fleet["remote"], key, n) for n in "bc"))


@pytest.mark.timeout(300)
def test_a_lying_partial_holder_is_refused_and_the_pull_completes(fleet: dict[str, Any]) -> None:
    nodes, key, tensors, _b_errors, b_pull = start_chain(fleet, 31)
    # b's staging now lies about a range it already verified and advertises (its disk went bad).
    staged = [p for p in nodes["b"].root.rglob("model-00001.safetensors") if "artifacts" not in p.parts]
    assert len(staged) == 1, staged
    with open(staged[0], "r+b") as f:
        head = 8 + struct.unpack("<Q", f.read(8))[0]
        f.seek(head + MIB)
        f.write(b"\xff" * 4096)
    assert peers_of(nodes["b"])["pulls"], "b's pull ended before c began: the test proves nothing"
    c_errors: list[BaseException] = []
    c_pull = pulling(nodes["c"], key, c_errors, tensors)
    c_pull.join(240)
    b_pull.join(240)  # what b itself installs is not this test's matter: its disk was made to lie
    assert not c_pull.is_alive() and not b_pull.is_alive() and not c_errors, c_errors  # c: bit-identical
    c = peers_of(nodes["c"])
    assert c["partial_fetched_bytes"] > 0 and c["lying_peers"] == 1, c


@pytest.mark.timeout(300)
def test_a_partial_holder_killed_mid_pull_is_dropped_and_the_pull_completes(fleet: dict[str, Any]) -> None:
    nodes, key, tensors, _b_errors, b_pull = start_chain(fleet, 41)
    assert peers_of(nodes["b"])["pulls"], "b's pull ended before c began: the test proves nothing"
    c_errors: list[BaseException] = []
    c_pull = pulling(nodes["c"], key, c_errors, tensors)
    wait_until("c to read from b", lambda: peers_of(nodes["c"])["partial_fetched_bytes"] > 0)
    assert peers_of(nodes["b"])["pulls"], "b's pull ended before it was killed: the test proves nothing"
    nodes["b"].kill()
    c_pull.join(240)
    b_pull.join(60)
    assert not c_pull.is_alive() and not c_errors, c_errors  # c: bit-identical
    c = peers_of(nodes["c"])
    assert c["failed_peers"] == 1 and c["lying_peers"] == 0, c
