"""Listings too long for one gRPC message come in pages: 10^4 leases (``hwrctl leases``) and
70,000 keys in a ``file://`` remote (``hwrctl remote ls``), each past gRPC's default 4 MiB
(the whole list in one reply failed with RESOURCE_EXHAUSTED). Real daemons, real hwrctl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.daemon.app.launcher import DaemonProcess
from hwr.protos.hwr.v1 import hwr_pb2 as pb


def _hwrctl(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hwr.daemon.ctl.cli", "--socket", str(daemon.socket), *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ten_thousand_leases_are_listed_in_pages(spawn_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = spawn_daemon("--max-leases-per-session", "20000")
    count = 10_000
    with connect(daemon.socket, client_name="\U0001f980" * 128) as client:  # 512 bytes of name per lease
        key = client.publish(ArtifactIdentity.simple("pages/leases"), {"w": torch.ones(4)})
        reply, fds, _tail = client._connection.exchange({"op": "acquire", "key": key}, want_fds=True)
        for fd in fds:
            os.close(fd)
        held = {reply["lease_id"]}
        while len(held) < count:  # raw acquires: the descriptors are closed at once
            reply, fds, _tail = client._connection.exchange(
                {"op": "acquire", "key": key, "have": reply["manifest_sha256"]}, want_fds=True)
            for fd in fds:
                os.close(fd)
            held.add(reply["lease_id"])
        out = _hwrctl(daemon, "leases", "--json")
        assert out.returncode == 0, out.stderr
        listed = json.loads(out.stdout)
        assert {x["lease_id"] for x in listed} == held and len(listed) == count
        # The pages themselves: sorted, each after the last, none bigger than asked.
        first = client._connection.call("ListLeases", pb.ListLeasesRequest(paged=True, limit=3))
        second = client._connection.call("ListLeases", pb.ListLeasesRequest(paged=True, after=first.next_after,
                                                                             limit=3))
        ids = [x.lease_id for x in (*first.leases, *second.leases)]
        assert ids == sorted(held)[:6] and first.total == count and second.next_after == ids[-1]


@pytest.fixture
def remote_dir(short_tmp: Path) -> Iterator[Path]:
    """A directory for a ``file://`` remote of 70,000 keys: on tmpfs when there is one (tens of
    thousands of directories are made and removed an order of magnitude faster there)."""
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(prefix="hwr-remote-", dir=shm if shm.is_dir() else short_tmp) as d:
        yield Path(d)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_seventy_thousand_remote_keys_are_listed_in_pages(remote_dir: Path,
                                                          spawn_daemon: Callable[..., DaemonProcess]) -> None:
    shared = remote_dir / "artifacts"
    shared.mkdir()
    keys = sorted(f"{i:064x}" for i in range(70_000))
    for key in keys:
        (shared / key).mkdir()
        (shared / key / "READY.json").touch()
    daemon = spawn_daemon("--remote", f"file://{remote_dir}", "--remote-push", "false")
    out = _hwrctl(daemon, "remote", "ls", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    listed = json.loads(out.stdout)
    assert [x["key"] for x in listed] == keys
    assert all(x["state"] == "complete" and not x["local"] for x in listed)
