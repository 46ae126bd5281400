"""Operating the peer tier with real hwrd nodes in network namespaces: the transfer process
restarted after it dies (a pull in flight completes, verified), and ``hwrctl peers`` on the
records serving nodes write themselves.

Same fabric and skips as ``tests/e2e/test_fleet_peers.py`` (root, iproute2, the ``peers`` extra).
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import pytest

from hwr.client import ArtifactIdentity, connect
from hwr.daemon.ctl import cli as ctl

from . import test_fleet_peers as base
from .helpers import MIB
from .test_fleet_peers import held, peers_of, publish, pull_and_check, pulling, tensors_of, wait_until

pytestmark = base.pytestmark  # its skips: root, iproute2, the peers extra
fleet = base.fleet  # its fixture: the fabric and the nodes on it


def hwrctl_json(capsys: pytest.CaptureFixture[str], node: Any, *argv: str) -> Any:
    code = ctl.main(["--socket", str(node.socket), *argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


@pytest.mark.timeout(300)
def test_a_killed_transfer_process_is_restarted_and_the_pull_in_flight_completes(
        fleet: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    a = fleet["make"]("a", rate="40mbit")
    b = fleet["make"]("b")
    tensors = tensors_of(21, 32 * MIB)
    key = publish(a, tensors)
    wait_until("a's upload and holder record", lambda: held(fleet["remote"], key, "a"))
    errors: list[BaseException] = []
    worker = pulling(b, key, errors, tensors)  # bit-identical, whatever the transfer process did
    wait_until("b's peer pull to move bytes", lambda: peers_of(b)["fetched_bytes"] > 4 * MIB)
    old = peers_of(b)["agent_pid"]
    assert old > 0
    os.kill(old, signal.SIGKILL)
    worker.join(240)
    assert not worker.is_alive() and not errors, errors
    got = wait_until("b's transfer process to be restarted",
                     lambda: (s := peers_of(b))["agent_restarts"] == 1 and s["agent_pid"] and s)
    assert got["agent_pid"] != old and got["agent_rss_bytes"] > 0, got
    assert got["fallback_bytes"] > 0, got  # what the dead process did not deliver came from the store
    assert got["failed_peers"] == 0, got  # the peer is not blamed for this node's own process
    assert f"transfer process (pid {old}) exited" in b.log.read_text()
    assert ctl.main(["--socket", str(b.socket), "status"]) == 0
    assert f"(pid {got['agent_pid']}), 1 restart" in capsys.readouterr().out

    # The new process serves the next pull from the peer, as the first one would have been.
    more = tensors_of(22, 8 * MIB)
    with connect(a.socket) as client:  # another identity: another key
        second = client.publish(ArtifactIdentity.simple("fleet/peers-after-restart"), more)
    wait_until("a's second holder record", lambda: held(fleet["remote"], second, "a"))
    before = peers_of(b)["fetched_bytes"]
    pull_and_check(b, second, more)
    after = peers_of(b)
    assert after["fetched_bytes"] - before >= 8 * MIB and after["agent_restarts"] == 1, after


@pytest.mark.timeout(300)
def test_hwrctl_peers_shows_the_records_nodes_write_and_their_expiry(fleet: dict[str, Any],
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    a = fleet["make"]("a", ttl=3.0)
    b = fleet["make"]("b")
    tensors = tensors_of(23, 4 * MIB)
    key = publish(a, tensors)
    wait_until("a's upload and holder record", lambda: held(fleet["remote"], key, "a"))
    pull_and_check(b, key, tensors)
    wait_until("b's holder record", lambda: held(fleet["remote"], key, "b"))
    listing = hwrctl_json(capsys, b, "peers", key[:12])
    assert listing["node"] == "b"
    records = {h["node"]: h for h in listing["holders"]}
    assert set(records) == {"a", "b"} and all(h["live"] and h["key"] == key for h in records.values()), listing
    assert records["a"]["address"].endswith(":7461") and 0 < records["a"]["recorded_at"] <= listing["now"]
    assert records["a"]["expires_at"] == pytest.approx(records["a"]["recorded_at"] + 3.0)

    a.kill()  # no clean stop: its record stays, and expires
    time.sleep(3.5)
    listing = hwrctl_json(capsys, b, "peers")
    records = {h["node"]: h for h in listing["holders"] if h["key"] == key}
    assert records["a"]["live"] is False and records["b"]["live"] is True, listing


@pytest.mark.timeout(300)
def test_fleet_peer_networks_refuse_and_skip_peers_outside(fleet: dict[str, Any],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    net = fleet["fabric"].net
    monkeypatch.setenv("HWR_FLEET_PEER_NETWORKS", f"10.251.{net}.1/32")  # a admits only itself
    a = fleet["make"]("a")
    monkeypatch.delenv("HWR_FLEET_PEER_NETWORKS")
    b = fleet["make"]("b")
    monkeypatch.setenv("HWR_FLEET_PEER_NETWORKS", "192.0.2.0/24")  # c asks no one on this fabric
    c = fleet["make"]("c", serve=False)
    tensors = tensors_of(24, 4 * MIB)
    key = publish(a, tensors)
    wait_until("a's upload and holder record", lambda: held(fleet["remote"], key, "a"))

    pull_and_check(b, key, tensors)  # a closes b's connection before any proof: from the store
    assert peers_of(a)["refused"] == 1 and peers_of(a)["served_bytes"] == 0
    assert peers_of(b)["peer_pulls"] == 0 and peers_of(b)["fetched_bytes"] == 0
    assert "outside fleet_peer_networks" in a.log.read_text()

    pull_and_check(c, key, tensors)  # a's and b's records name addresses outside c's networks
    assert peers_of(c)["peer_pulls"] == 0 and peers_of(a)["refused"] == 1 and peers_of(b)["refused"] == 0
