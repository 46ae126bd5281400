"""The swarm's parts that need no network: tensors reported as verified, partial holders' ranges
and records, and the choice of sources. End to end: ``tests/e2e/test_fleet_swarm.py``."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

from hwr.daemon.fleet.peer_fill import FULL, PeerFill, _Peer
from hwr.daemon.fleet.peer_tier import Holder, Holders, Partial
from hwr.daemon.fleet.remote import open_remote, parse_location
from hwr.daemon.fleet.sink import DownloadSink

KEY = "cd" * 32


def test_each_tensor_is_reported_once_its_bytes_are_hashed_in_order(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)
    path = tmp_path / "f"
    path.write_bytes(data)
    ranges = [("a", 100, 1 << 20), ("b", 1 << 20, 2 << 20), ("c", 2 << 20, 3 << 20)]
    reported: list[tuple[str, str]] = []
    fd = os.open(path, os.O_RDWR)
    try:
        sink = DownloadSink(fd, len(data), ranges, progress=lambda n: None, check=lambda: None,
                            on_tensor=lambda name, digest: reported.append((name, digest)))
        sink.landed(2 << 20, 1 << 20)  # c first: nothing is final before the bytes in front of it
        sink.digests._tensor_pool.submit(lambda: None).result()  # the hashing thread caught up
        assert reported == []
        sink.landed(0, 1 << 20)  # the header and a: a is final
        sink.digests._tensor_pool.submit(lambda: None).result()  # the hashing thread caught up
        assert [name for name, _d in reported] == ["a"]
        sink.landed(1 << 20, 1 << 20)  # b, and c held back until now
        digests = sink.finish()
    finally:
        os.close(fd)
    assert digests is not None
    expected = {name: hashlib.sha256(data[s:e]).hexdigest() for name, s, e in ranges}
    assert reported == [(name, expected[name]) for name in ("a", "b", "c")] and digests[1] == expected


def test_partial_ranges_merge_and_a_repair_withdraws_them() -> None:
    p = Partial({"m.safetensors": ("/staging/m", 1000), "n.safetensors": ("/staging/n", 10)}, since=1.0)
    p.add("m.safetensors", 0, 100)
    p.add("m.safetensors", 300, 400)
    p.add("m.safetensors", 100, 300)
    assert p.ranges() == {"m.safetensors": [[0, 400]], "n.safetensors": []} and p.verified_bytes() == 400
    p.withdraw("m.safetensors")
    assert p.ranges()["m.safetensors"] == []


def test_a_partial_holder_record_names_when_its_pull_began(tmp_path: Path) -> None:
    remote = open_remote(parse_location(f"file://{tmp_path}"))
    a = Holders(remote, "node-a", "10.0.0.1:7461", ttl=30)
    b = Holders(remote, "node-b", "10.0.0.2:7461", ttl=30)
    a.record(KEY, since=123.5)
    found = b.find(KEY)
    assert [(h.node, h.partial, h.since) for h in found] == [("node-a", True, 123.5)]
    a.record(KEY)  # its commit: the same record, full
    assert [(h.node, h.partial) for h in b.find(KEY)] == [("node-a", False)]


def _peer(node: str, order: tuple[float, str], alive: bool = True) -> _Peer:
    holder = Holder(node, "10.0.0.1:1", time.time() + 30, partial=order != FULL, since=order[0])
    fake: Any = None  # the connection is not used by the choice
    return _Peer(holder, fake, fake, node, {}, alive=alive, order=order, full=order == FULL)


def test_the_chain_reads_the_latest_partial_holder_before_it_else_the_full_ones() -> None:
    full1, full2 = _peer("h1", FULL), _peer("h2", FULL)
    early, late = _peer("b", (10.0, "b")), _peer("c", (11.0, "c"))
    assert PeerFill._sources([full1, full2]) == [full1, full2]
    assert PeerFill._sources([full1, early, late]) == [late]
    late.alive = False  # dropped or finished: the one before it, then the full holders
    assert PeerFill._sources([full1, early, late]) == [early]
    early.alive = False
    assert PeerFill._sources([full1, full2, early, late]) == [full1, full2]
    full1.alive = full2.alive = False
    assert PeerFill._sources([full1, full2, early, late]) == []
