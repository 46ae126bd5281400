"""``hwrctl peers``: the peer tier's holder records in the remote, read through a real hwrd.

The records are written here as the peer tier writes them (``PREFIX/holders/<key>/<node>.json``,
``hwr.daemon.fleet.peer_tier.Holders``) into a ``file://`` remote; the hwrd that lists them has
its own peer tier off (listing needs neither NIXL nor the tier), so these run anywhere. The
records a serving node writes itself, and their expiry after a kill, are covered with NIXL in
``tests/e2e/test_fleet_peer_ops.py``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.daemon.ctl import cli as ctl

from .fleet_fixtures import node

pytestmark = pytest.mark.timeout(180)
KEY_A = "a" * 64
KEY_B = "b" * 64


def write_record(shared: Path, key: str, name: str, body: Any) -> None:
    directory = shared / "holders" / key
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.json").write_text(body if isinstance(body, str) else json.dumps(body))


@pytest.fixture
def lister(short_tmp: Path) -> Iterator[tuple[Any, Path]]:
    shared = short_tmp / "shared"
    shared.mkdir()
    proc = node(short_tmp, "l", f"file://{shared}", "--remote-push", "false").start()
    yield proc, shared
    if proc.proc is not None and proc.proc.poll() is None:
        proc.stop()


def hwrctl(capsys: pytest.CaptureFixture[str], daemon: Any, *argv: str) -> tuple[int, str, str]:
    code = ctl.main(["--socket", str(daemon.socket), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_hwrctl_peers_lists_live_and_expired_holders_per_key(lister: tuple[Any, Path],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    proc, shared = lister
    now = time.time()
    write_record(shared, KEY_A, "gpu-01", {"node": "gpu-01", "address": "10.0.3.17:7461",
                                           "recorded_at": now - 5, "expires_at": now + 25})
    write_record(shared, KEY_A, "gpu-02", {"node": "gpu-02", "address": "10.0.3.18:7461",
                                           "recorded_at": now - 95, "expires_at": now - 65})
    write_record(shared, KEY_A, "liar", {"node": "someone-else", "address": "10.0.9.9:7461",
                                         "expires_at": now + 25})  # its name is not its node: skipped
    write_record(shared, KEY_A, "broken", "{not json")  # malformed: skipped, never an error
    write_record(shared, KEY_B, "old", {"node": "old", "address": "10.0.3.19:7461", "expires_at": now + 25})

    code, out, err = hwrctl(capsys, proc, "peers", KEY_A, "--json")
    assert code == 0, err
    listing = json.loads(out)
    assert listing["node"] == "" and abs(listing["now"] - time.time()) < 60  # this node's tier is off
    by_node = {h["node"]: h for h in listing["holders"]}
    assert set(by_node) == {"gpu-01", "gpu-02"}, listing
    live, dead = by_node["gpu-01"], by_node["gpu-02"]
    assert live == {"key": KEY_A, "node": "gpu-01", "address": "10.0.3.17:7461",
                    "recorded_at": pytest.approx(now - 5), "expires_at": pytest.approx(now + 25), "live": True}
    assert dead["live"] is False and dead["expires_at"] < listing["now"]

    code, text, _ = hwrctl(capsys, proc, "peers", KEY_B)  # a record without recorded_at
    assert code == 0
    lines = text.splitlines()
    assert lines[0].split() == ["KEY", "NODE", "ADDRESS", "RECORDED", "EXPIRES", "LIVE"]
    assert len(lines) == 2 and lines[1].split()[:4] == [KEY_B[:16], "old", "10.0.3.19:7461", "-"]
    assert lines[1].split()[-1] == "yes"

    code, text, _ = hwrctl(capsys, proc, "peers", KEY_A)
    assert code == 0 and "gpu-01" in text and "expired 1m ago" in text and re.search(r" in 2\ds ", text)
    # A prefix resolves among the remote's and this node's artifacts: records alone name none.
    code, _, err = hwrctl(capsys, proc, "peers", KEY_A[:8])
    assert code == 1 and "LOCAL_MISS" in err and err[-1] == "\n" and err.count("\n") == 1


def test_hwrctl_peers_covers_the_remotes_and_this_nodes_artifacts(lister: tuple[Any, Path],
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    proc, shared = lister
    with connect(proc.socket) as client:  # a local artifact (remote_push is off: not in the remote)
        key = client.publish(ArtifactIdentity.simple("fleet/holders"), {"w": torch.arange(64, dtype=torch.float32)})
    code, out, _ = hwrctl(capsys, proc, "peers", "--json")
    assert code == 0 and json.loads(out)["holders"] == []
    code, text, _ = hwrctl(capsys, proc, "peers")
    assert code == 0 and text.rstrip().endswith("(no holder records)")

    now = time.time()
    write_record(shared, KEY_A, "gpu-01", {"node": "gpu-01", "address": "10.0.3.17:7461", "expires_at": now + 30})
    write_record(shared, key, "gpu-07", {"node": "gpu-07", "address": "[fd00::7]:7461", "recorded_at": now,
                                         "expires_at": now + 30})
    # Found through this node's own key; KEY_A is no artifact of the remote or of this node.
    code, out, _ = hwrctl(capsys, proc, "peers", "--json")
    assert code == 0 and [(h["key"], h["node"], h["live"]) for h in json.loads(out)["holders"]] == [
        (key, "gpu-07", True)]
    code, out, _ = hwrctl(capsys, proc, "peers", key[:12], "--json")
    assert code == 0 and json.loads(out)["holders"][0]["address"] == "[fd00::7]:7461"
