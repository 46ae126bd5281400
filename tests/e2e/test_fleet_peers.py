"""The peer tier with real hwrd nodes, each in its own network namespace, on a shared file:// remote.

Every node runs hwrd inside its namespace (``netns.Fabric``: a bridge, a veth pair per node, the
project's own 10.251.x.y addresses); the tests talk to each hwrd over its Unix socket, which is in
the filesystem and so reachable from here. UCX is held to TCP (``fleet_peer_ucx_tls``), so the
bytes cross the veth links (and their rate limits) instead of shared memory.

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2) or where the
``peers`` extra (nixl-cu12) is not installed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_proc import finish_daemon

from hwr.client import ArtifactIdentity, connect
from hwr.daemon.app.launcher import DaemonProcess

from . import netns
from .helpers import MIB, digests, patterned

REASON = netns.available()
pytestmark = [
    pytest.mark.skipif(bool(REASON), reason=REASON or "-"),
    pytest.mark.skipif(__import__("importlib").util.find_spec("nixl_cu12") is None,
                       reason="the peer tier needs the peers extra (nixl-cu12)"),
]

PORT = 7461


class NodeProcess(DaemonProcess):
    """hwrd run inside a node's namespace."""

    def __init__(self, prefix: list[str], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefix = prefix

    def command(self) -> list[str]:
        return [*self.prefix, *super().command()]


def tensors_of(seed: int, nbytes: int) -> dict[str, torch.Tensor]:
    quarter = nbytes // 4
    return {"blocks.0.weight": patterned(2 * quarter, seed, torch.bfloat16).reshape(-1, 64),
            "blocks.1.weight": patterned(quarter, seed + 1, torch.float32).reshape(-1, 16),
            "blocks.1.bias": patterned(quarter, seed + 2, torch.float32)}


@pytest.fixture
def fleet(short_tmp: Path) -> Iterator[dict[str, Any]]:
    """A fabric and a ``make(name, serve=, fetch=, secret=, ttl=)`` for nodes on it."""
    fabric = netns.Fabric(f"hwrt{os.getpid() % 10000}", net=200 + os.getpid() % 50)
    remote = short_tmp / "remote"
    remote.mkdir()
    secrets = {"fleet": short_tmp / "fleet.secret", "other": short_tmp / "other.secret"}
    secrets["fleet"].write_text("fleet-secret-" + "x" * 24)
    secrets["other"].write_text("not-this-fleet-" + "y" * 24)
    for path in secrets.values():
        path.chmod(0o600)
    nodes: dict[str, NodeProcess] = {}

    def make(name: str, *, serve: bool = True, fetch: bool = True, secret: str = "fleet", ttl: float = 30.0,
             rate: str = "") -> NodeProcess:
        address = fabric.add(name)
        if rate:
            fabric.limit(name, rate)
        env = {"HWR_FLEET_PEER_SERVE": str(serve).lower(), "HWR_FLEET_PEER_FETCH": str(fetch).lower(),
               "HWR_FLEET_PEER_LISTEN": f"{address}:{PORT}", "HWR_FLEET_PEER_SECRET_FILE": str(secrets[secret]),
               "HWR_FLEET_PEER_NODE_ID": name, "HWR_FLEET_PEER_HOLDER_TTL_S": str(ttl),
               "HWR_FLEET_PEER_UCX_TLS": "tcp", "HWR_REMOTE_STALL_TIMEOUT_S": "20"}
        node = NodeProcess(fabric.run_in(name), short_tmp / f"{name}-store", short_tmp / f"{name}.sock",
                           "--remote", f"file://{remote}", env=env)
        nodes[name] = node
        return node.start(timeout=90)

    try:
        yield {"make": make, "remote": remote, "fabric": fabric}
    finally:
        failures: list[BaseException] = []
        for name, node in nodes.items():
            try:
                finish_daemon(node)  # SIGTERM must exit 0 (a SIGKILL the test sent is fine), no traceback
            except BaseException as exc:
                failures.append(exc)
            print(f"--- hwrd {name} ---\n{node.log.read_text()[-6000:]}")  # shown when the test fails
        fabric.close()
        if failures:
            raise failures[0]


def publish(node: DaemonProcess, tensors: dict[str, torch.Tensor]) -> str:
    with connect(node.socket) as client:
        return client.publish(ArtifactIdentity.simple("fleet/peers"), tensors)


def wait_until(what: str, check: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def held(remote: Path, key: str, node: str) -> bool:
    return (remote / "holders" / key / f"{node}.json").exists() and (remote / "artifacts" / key / "READY.json").exists()


def peers_of(node: DaemonProcess) -> dict[str, Any]:
    with connect(node.socket) as client:
        return client.status()["remote"]["peers"]


def pull_and_check(node: DaemonProcess, key: str, tensors: dict[str, torch.Tensor]) -> None:
    with connect(node.socket) as client:
        client.pull(key)
        with client.acquire(key) as lease:
            assert digests(lease.tensors) == digests(tensors)  # bit-identical, tensor by tensor


def pulling(node: DaemonProcess, key: str, errors: list[BaseException], tensors: dict[str, torch.Tensor]
            ) -> threading.Thread:
    """``pull_and_check`` on a started thread; what it raises lands in ``errors``."""
    def run() -> None:
        try:
            pull_and_check(node, key, tensors)
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    return worker


@pytest.mark.timeout(300)
def test_a_node_pulls_from_its_peer_bit_identical(fleet: dict[str, Any]) -> None:
    a = fleet["make"]("a")
    b = fleet["make"]("b")
    tensors = tensors_of(11, 24 * MIB)
    key = publish(a, tensors)
    wait_until("a's holder record", lambda: held(fleet["remote"], key, "a"))
    pull_and_check(b, key, tensors)
    got, gave = peers_of(b), peers_of(a)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert got["peer_pulls"] == 1 and got["fetched_bytes"] >= total and got["fallback_bytes"] == 0, got
    assert gave["served_bytes"] >= total and gave["agent_rss_bytes"] > 0, gave
    wait_until("b's holder record", lambda: held(fleet["remote"], key, "b"))  # b serves what it pulled


@pytest.mark.timeout(300)
def test_a_lying_peer_is_dropped_and_the_pull_completes_from_the_store(fleet: dict[str, Any]) -> None:
    a = fleet["make"]("a")
    b = fleet["make"]("b")
    tensors = tensors_of(12, 16 * MIB)
    key = publish(a, tensors)
    wait_until("a's upload and holder record", lambda: held(fleet["remote"], key, "a"))
    payload = a.root / "artifacts" / key / "model-00001.safetensors"
    size = payload.stat().st_size
    with open(payload, "r+b") as f:  # a's disk now lies (hwrd serves what the file holds)
        for offset in range(size // 3, size, size // 7):
            f.seek(offset)
            f.write(b"\xff" * 64)
    pull_and_check(b, key, tensors)
    got = peers_of(b)
    assert got["lying_peers"] == 1 and got["fallback_bytes"] > 0, got


@pytest.mark.timeout(300)
def test_a_peer_killed_mid_pull_costs_a_retry_from_the_store(fleet: dict[str, Any]) -> None:
    a = fleet["make"]("a", rate="40mbit")
    b = fleet["make"]("b")
    tensors = tensors_of(13, 32 * MIB)
    key = publish(a, tensors)
    wait_until("a's upload and holder record", lambda: held(fleet["remote"], key, "a"))
    errors: list[BaseException] = []
    worker = pulling(b, key, errors, tensors)
    wait_until("b's peer pull to move bytes", lambda: peers_of(b)["fetched_bytes"] > 4 * MIB)
    a.kill()
    worker.join(240)
    assert not worker.is_alive() and not errors, errors
    got = peers_of(b)
    assert got["failed_peers"] == 1 and got["fallback_bytes"] > 0, got


@pytest.mark.timeout(300)
def test_an_expired_holder_is_not_asked(fleet: dict[str, Any]) -> None:
    a = fleet["make"]("a", ttl=2.0)
    b = fleet["make"]("b")
    tensors = tensors_of(14, 8 * MIB)
    key = publish(a, tensors)
    wait_until("a's upload and holder record", lambda: held(fleet["remote"], key, "a"))
    a.kill()  # a dead node: its record stays in the remote, and expires
    time.sleep(2.5)
    assert held(fleet["remote"], key, "a")
    pull_and_check(b, key, tensors)
    got = peers_of(b)
    assert got["peer_pulls"] == 0 and got["fetched_bytes"] == 0 and got["failed_peers"] == 0, got


@pytest.mark.timeout(300)
def test_a_node_outside_the_fleet_is_refused(fleet: dict[str, Any]) -> None:
    a = fleet["make"]("a")
    stranger = fleet["make"]("s", serve=False, secret="other")
    tensors = tensors_of(15, 8 * MIB)
    key = publish(a, tensors)
    wait_until("a's upload and holder record", lambda: held(fleet["remote"], key, "a"))
    pull_and_check(stranger, key, tensors)  # from the store: the remote is its to read
    assert peers_of(a)["refused"] == 1 and peers_of(a)["served_bytes"] == 0
    got = peers_of(stranger)
    assert got["fetched_bytes"] == 0 and got["peer_pulls"] == 0, got
