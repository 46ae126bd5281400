"""The peer tier's parts that need no network: chunking, the secret, the proofs, discovery records.

The end-to-end behaviour (real hwrd nodes in network namespaces, NIXL transfers) is in
``tests/e2e/test_fleet_peers.py``; these run everywhere, without root or the peers extra.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest

from hwr.client.errors import ConfigError
from hwr.daemon.fleet import peer_wire
from hwr.daemon.fleet.peer_fill import _PullFile, chunks_of, units_of
from hwr.daemon.fleet.peer_tier import Holders, TokenBucket, parse_address
from hwr.daemon.fleet.remote import open_remote, parse_location
from hwr.daemon.system.config import DaemonConfig

KEY = "ab" * 32


def test_units_cover_the_file_and_chunks_respect_unit_boundaries() -> None:
    ranges = [("a", 100, 100 + 10_000), ("b", 10_100, 10_100 + 50), ("c", 10_160, 40_000)]  # a gap at 10_150
    units = units_of(100, 40_100, ranges)
    assert units[0] == (0, 100, "") and units[-1] == (40_000, 40_100, "~")
    assert all(a[1] == b[0] for a, b in itertools.pairwise(units))  # contiguous, no overlap
    assert (10_150, 10_160, "~") in units
    f = _PullFile("model-00001.safetensors", "/dev/null", 40_100, b"h" * 100, ranges, units=units)
    chunks = chunks_of(f, limit=8_000)
    assert chunks[0].start == 0 and chunks[-1].end == 40_100
    assert all(a.end == b.start for a, b in itertools.pairwise(chunks))
    assert all(c.end - c.start <= 8_000 for c in chunks)
    starts = {u[0] for u in units}
    for c in chunks:  # a chunk starts at a unit boundary unless it continues a unit larger than the limit
        big = [u for u in units if u[0] < c.start < u[1]]
        assert c.start in starts or (big and big[0][1] - big[0][0] > 8_000)


def test_the_secret_file_is_checked(tmp_path: Path) -> None:
    good = tmp_path / "fleet.secret"
    good.write_text("s" * 32 + "\n")
    good.chmod(0o600)
    assert peer_wire.load_secret(str(good)) == b"s" * 32
    good.chmod(0o604)
    with pytest.raises(ConfigError, match="readable by others"):
        peer_wire.load_secret(str(good))
    short = tmp_path / "short.secret"
    short.write_text("tiny")
    short.chmod(0o600)
    with pytest.raises(ConfigError, match="at least 16"):
        peer_wire.load_secret(str(short))
    with pytest.raises(ConfigError, match="cannot be opened"):
        peer_wire.load_secret(str(tmp_path / "missing"))


def test_proofs_bind_the_secret_the_nonces_and_the_node() -> None:
    proof = peer_wire.ask_proof(b"k" * 16, "c" * 32, "n" * 32, "node-a")
    assert peer_wire.same(proof, peer_wire.ask_proof(b"k" * 16, "c" * 32, "n" * 32, "node-a"))
    assert not peer_wire.same(proof, peer_wire.ask_proof(b"x" * 16, "c" * 32, "n" * 32, "node-a"))
    assert not peer_wire.same(proof, peer_wire.ask_proof(b"k" * 16, "c" * 32, "n" * 32, "node-b"))
    assert not peer_wire.same(proof, peer_wire.serve_proof(b"k" * 16, "c" * 32, "n" * 32))
    assert not peer_wire.same(None, proof)


def test_holder_records_expire_and_skip_this_node_and_malformed_ones(tmp_path: Path) -> None:
    remote = open_remote(parse_location(f"file://{tmp_path}"))
    a = Holders(remote, "node-a", "10.0.0.1:7461", ttl=0.5)
    b = Holders(remote, "node-b", "10.0.0.2:7461", ttl=30)
    a.record(KEY)
    b.record(KEY)
    assert [h.node for h in b.find(KEY)] == ["node-a"]  # never itself
    assert [h.address for h in a.find(KEY)] == ["10.0.0.2:7461"]
    (tmp_path / "holders" / KEY / "node-x.json").write_text("{not json")
    (tmp_path / "holders" / KEY / "node-y.json").write_text(json.dumps(
        {"node": "node-z", "address": "10.0.0.9:1", "expires_at": time.time() + 60}))  # names another node
    time.sleep(0.6)
    assert b.find(KEY) == []  # a's record expired; x is malformed; y lies about its name
    b.forget(KEY)
    assert not (tmp_path / "holders" / KEY / "node-b.json").exists()
    assert a.find("cd" * 32) == []


@pytest.mark.timeout(10)
def test_the_token_bucket_paces_to_its_rate() -> None:
    import asyncio

    async def run() -> float:
        bucket = TokenBucket(1000)
        started = time.monotonic()
        for _ in range(3):
            await bucket.take(500)  # 1000 of burst, then 500 more at 1000/s
        return time.monotonic() - started

    assert 0.4 <= asyncio.run(run()) < 2.0


def test_config_needs_a_remote_a_secret_and_an_address(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs a remote"):
        DaemonConfig(root="/r", socket="/s", fleet_peer_fetch=True)
    with pytest.raises(ConfigError, match="fleet_peer_secret_file"):
        DaemonConfig(root="/r", socket="/s", fleet_peer_fetch=True, remote=f"file://{tmp_path}")
    with pytest.raises(ConfigError, match="HOST:PORT"):
        DaemonConfig(root="/r", socket="/s", fleet_peer_serve=True, remote=f"file://{tmp_path}",
                     fleet_peer_secret_file="/x", fleet_peer_listen="nowhere")
    with pytest.raises(ConfigError, match="must not be negative"):
        DaemonConfig(root="/r", socket="/s", fleet_peer_serve_max_bytes_per_s=-1)
    assert parse_address("[fd00::1]:7461", "k") == ("fd00::1", 7461)
