"""What an operator sees of careless or hostile clients, and small contracts of the client.

Against a real hwrd, with ``hwrctl`` run as a real process: denied artifacts stay visible to
``ls``/``show``/``verify`` and come back at once after ``allow``; ``show`` of an artifact with
10^5 tensors (a manifest past gRPC's 4 MiB message limit); client-supplied strings with
terminal escape sequences printed escaped; KeepAlive's publication count; a closed lease's
regions; a request that meets an out-of-descriptors daemon fails alone, not its session.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import HwrError
from hwr.client.publisher import specs_for
from hwr.daemon.app.launcher import DaemonProcess

ESC = "\x1b[2J\x1b[31m"


def hwrctl(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hwr.daemon.ctl.cli", "--socket", str(daemon.socket), *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(120)
def test_denied_artifacts_stay_visible_and_allow_brings_them_back(
        spawn_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = spawn_daemon()
    with connect(daemon.socket) as client:
        key = client.publish(ArtifactIdentity.simple("operator/denied"), {"w": torch.arange(256.0)})
    denied = hwrctl(daemon, "deny", key[:12], "--reason", "suspected bad weights")
    assert denied.returncode == 0, denied.stderr

    listed = {a["key"]: a for a in json.loads(hwrctl(daemon, "ls", "--json").stdout)}
    assert listed[key]["state"] == "denied" and listed[key]["deny_reason"] == "OPERATOR_DENIED", listed
    table = hwrctl(daemon, "ls").stdout
    assert key[:16] in table and "denied" in table
    shown = hwrctl(daemon, "show", key[:12])
    assert shown.returncode == 0, shown.stderr
    assert "state:      denied (OPERATOR_DENIED)" in shown.stdout
    verified = hwrctl(daemon, "verify", key[:12])  # intact bytes: verified, still denied
    assert verified.returncode == 0, verified.stderr
    with connect(daemon.socket) as client:
        assert client.list_artifacts() == []  # not served
        assert client.inspect(key)["state"] == "denied"

    allowed = hwrctl(daemon, "allow", key[:12])
    assert allowed.returncode == 0, allowed.stderr
    listed = {a["key"]: a for a in json.loads(hwrctl(daemon, "ls", "--json").stdout)}
    assert listed[key]["state"] == "ready", listed  # before anyone acquired it
    assert json.loads(hwrctl(daemon, "status", "--json").stdout)["artifacts"] == 1
    log = daemon.log.read_text()
    assert any("WARNING" in line and f"artifact {key} denied" in line for line in log.splitlines()), log[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_show_of_an_artifact_with_a_hundred_thousand_tensors(spawn_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = spawn_daemon()
    count = 100_000
    with connect(daemon.socket, timeout=120) as client:
        key = client.publish(ArtifactIdentity.simple("operator/many-tensors"),
                             {f"layer.{i}.weight": torch.full((1,), float(i)) for i in range(count)})
    shown = hwrctl(daemon, "show", key[:12], "--json")
    assert shown.returncode == 0, shown.stderr[-2000:]
    info = json.loads(shown.stdout)
    assert len(info["tensors"]) == count
    assert len({t["name"] for t in info["tensors"]}) == count
    text = hwrctl(daemon, "show", key[:12])
    assert text.returncode == 0 and f"tensors:    {count}" in text.stdout, text.stderr[-2000:]


@pytest.mark.timeout(120)
def test_client_strings_with_escape_sequences_are_printed_escaped(
        spawn_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = spawn_daemon()
    with connect(daemon.socket, client_name=f"evil{ESC}name") as client:
        key = client.publish(ArtifactIdentity.simple(f"model{ESC}id"), {"w": torch.ones(16)})
        with client.acquire(key):
            outputs = {name: hwrctl(daemon, *args) for name, args in
                       (("leases", ["leases"]), ("ls", ["ls"]), ("show", ["show", key[:12]]))}
            as_json = json.loads(hwrctl(daemon, "leases", "--json").stdout)
    for name, out in outputs.items():
        assert out.returncode == 0, out.stderr
        assert "\x1b" not in out.stdout, f"hwrctl {name} printed a raw escape sequence"
    assert "evil\\x1b[2J\\x1b[31mname" in outputs["leases"].stdout
    assert "model\\x1b[2J\\x1b[31mid" in outputs["ls"].stdout + outputs["show"].stdout
    assert as_json[0]["client_name"] == f"evil{ESC}name"  # --json stays JSON, with the real value


@pytest.mark.timeout(120)
def test_keepalive_counts_only_publications_in_flight(spawn_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = spawn_daemon()
    with connect(daemon.socket) as client:
        for i in range(3):
            client.publish(ArtifactIdentity.simple(f"operator/keepalive-{i}"), {"w": torch.ones(8) * i})
        assert client.keepalive()["publication_count"] == 0
        with client.publisher(ArtifactIdentity.simple("operator/keepalive-open"),
                              specs_for({"w": torch.ones(8)})) as pub:
            assert client.keepalive()["publication_count"] == 1
            pub.write("w", torch.ones(8))
            pub.commit()
        assert client.keepalive()["publication_count"] == 0


@pytest.mark.timeout(60)
def test_mapped_regions_are_empty_after_close(spawn_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = spawn_daemon()
    with connect(daemon.socket) as client:
        key = client.publish(ArtifactIdentity.simple("operator/regions"), {"w": torch.ones(4096)})
        lease = client.acquire(key)
        assert lease.mapped_regions and lease.mapped_regions[0].length >= 4096 * 4
        lease.close()
        assert lease.mapped_regions == ()


@pytest.mark.timeout(120)
def test_out_of_descriptors_during_a_request_keeps_the_session(spawn_daemon: Callable[..., DaemonProcess]) -> None:
    """EMFILE while the daemon serves an acquire (its open-files limit lowered to what it holds):
    that request gets a typed error; the session and its other leases stay."""
    daemon = spawn_daemon()
    with connect(daemon.socket) as client:
        first = client.publish(ArtifactIdentity.simple("operator/emfile-1"), {"w": torch.ones(64)})
        second = client.publish(ArtifactIdentity.simple("operator/emfile-2"), {"w": torch.ones(64) * 2})
        held = client.acquire(first)
        session = client.keepalive()["session_id"]
        limit = resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE)
        try:
            resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (len(os.listdir(f"/proc/{daemon.pid}/fd")), limit[1]))
            failures = []
            for _ in range(3):
                try:
                    client.acquire(second).close()
                except HwrError as exc:
                    failures.append(exc)
        finally:
            resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, limit)
        assert failures, "the daemon still had descriptors: the test proves nothing"
        assert all(exc.code != "DAEMON_UNAVAILABLE" for exc in failures), failures
        assert client.keepalive()["session_id"] == session
        assert [x["lease_id"] for x in client.leases()] == [held.lease_id]
        assert float(held.tensors["w"][0]) == 1.0
        with client.acquire(second) as again:
            assert float(again.tensors["w"][0]) == 2.0
        held.close()
