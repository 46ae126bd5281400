"""Acquires that meet a pull in progress, through a real hwrd and real clients: two hwrd nodes on
one real S3 server (moto's), node B reaching it through ``SlowLink`` (a throttled TCP relay that a
test can pause: a stalled network).

What needs the daemon process is tested here: a client that waits for a pull gets hwrd's
progress frames on the peer socket and its lease after the pull, while an operator sees the
waiter (``hwrctl status``, ``hwrctl leases``), a caller that does not wait gets the typed miss at
once, and a gRPC ``Acquire`` waits for the same pull; and the publish role, decided by the peer
credentials of a client running as another uid: a uid with only the acquire role cannot start a
pull but may wait for one that runs. The pull-wait use cases themselves (progress, stalls, the
caller that does not wait, remembered misses) are tested in-process in
tests/service/test_pull_wait.py.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from daemon_proc import HWRD, RunAs, requested_user

from hwr.client import connect
from hwr.client.errors import ArtifactNotFound, PermissionDeniedError
from hwr.protos.hwr.v1 import hwr_pb2 as pb

from . import fleet_fixtures
from .fleet_fixtures import S3Server, SlowLink, artifact_dirs, node, staging_dirs
from .helpers import MIB, digests, wait_until
from .test_fleet import PREFIX, publish_on, tensors_of, wait_ready

if TYPE_CHECKING:
    from hwr.client.acquisition import PullReport

s3_server = fleet_fixtures.s3_server  # the session's S3 server process (a fixture)
SIZE = 8 * MIB  # one part (under the S3 tier's 16 MiB part size): one connection through the link
RATE = 4 * MIB  # bytes/s through the slow link: a pull takes ~2 s unless the link holds it
NOBODY = 65534
WORKER = Path(__file__).with_name("fleet_worker.py")
HWRCTL = [sys.executable, "-c", "import sys; from hwr.daemon.ctl.cli import main; sys.exit(main())"]


@pytest.fixture
def slow_fleet(s3_server: S3Server, short_tmp: Path, request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """Node A on the server directly; node B (not started) behind a slow link, as the test's
    ``daemon_user`` when it asks for one (root, or the unit's unprivileged user)."""
    user = requested_user(request)
    bucket = s3_server.new_bucket()
    remote = f"s3://{bucket}/{PREFIX}"
    link = SlowLink(s3_server.port, RATE)
    started: list[Any] = []

    def start_b(*extra: str) -> Any:
        proc = node(short_tmp, "b", remote, *extra, endpoint=link.endpoint, user=user)
        started.append(proc)
        return proc.start()

    a = node(short_tmp, "a", remote, endpoint=s3_server.endpoint, user=user)
    started.append(a)
    env = {"bucket": bucket, "remote": remote, "s3": s3_server.client(), "link": link, "a": a.start(),
           "start_b": start_b, "server": s3_server, "base": short_tmp}
    yield env
    link.resume()
    for proc in started:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.stop()
    link.close()


def published(env: dict[str, Any], model: str, seed: int, nbytes: int = SIZE) -> tuple[str, dict[str, Any]]:
    tensors = tensors_of(seed, nbytes)
    key = publish_on(env["a"], model, tensors)
    wait_ready(env["s3"], env["bucket"], key)
    return key, digests(tensors)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_client_waits_for_a_pull_over_the_transport_with_progress(slow_fleet: dict[str, Any]) -> None:
    env = slow_fleet
    key, expected = published(env, "wait/slow", 51)
    b = env["start_b"]()
    link = env["link"]
    with connect(b.socket) as client:
        started = time.monotonic()
        with pytest.raises(ArtifactNotFound) as info:  # a caller that does not wait starts the pull ...
            client.acquire(key, timeout=30, wait_for_pull=False)
        assert time.monotonic() - started < 3  # at once, not after the pull
        assert info.value.details.get("pulling") is True and info.value.details.get("remote") == env["remote"]
        assert [p["key"] for p in client.status()["remote"]["pulls"]] == [key]  # ... and leaves it running
        with pytest.raises(ArtifactNotFound):  # a second caller that does not wait joins nothing
            client.acquire(key, timeout=30, wait_for_pull=False)
    reports: list[PullReport] = []
    outcome: dict[str, Any] = {}

    def acquire() -> None:  # waits with an acquire timeout far shorter than the pull (as long as frames come)
        began = time.monotonic()
        with connect(b.socket) as client, client.acquire(key, timeout=2, on_pull=reports.append) as lease:
            outcome["waited"] = time.monotonic() - began
            outcome["digests"] = digests(lease.tensors)

    def acquire_grpc() -> None:  # gRPC waits too
        with connect(b.socket) as client:
            call = client._connection.call
            granted = call("Acquire", pb.AcquireRequest(artifact=pb.ArtifactRef(key=key)), 60)
            released = call("Release", pb.ReleaseRequest(lease_id=granted.lease_id)).released
            outcome["grpc"] = (granted.key, bool(granted.lease_id), released)

    waiter = threading.Thread(target=acquire)
    waiter.start()
    waiter_started = time.monotonic()
    link.wait_bytes("down", MIB)  # into the payload's download ...
    link.pause(after=MIB // 2)  # ... then held (hwrctl status still reaches the remote): the pull
    # cannot end while the operator looks and the others join
    grpc_waiter = threading.Thread(target=acquire_grpc)
    grpc_waiter.start()
    with connect(b.socket) as admin:  # what an operator sees meanwhile (hwrctl status --json, hwrctl leases)
        wait_until(lambda: len(admin.status()["remote"]["pulls"][0]["waiters"]) == 2, 60)
        seen = admin.status()["remote"]["pulls"][0]
    table = subprocess.run([*HWRCTL, "--socket", str(b.socket), "leases"], capture_output=True, text=True,
                           timeout=60, check=True).stdout
    time.sleep(max(0.0, 2.5 - (time.monotonic() - waiter_started)))  # held past the acquire's own timeout
    link.resume()
    waiter.join(60)
    grpc_waiter.join(60)
    assert outcome.get("digests") == expected, outcome
    assert outcome["waited"] > 2, outcome  # longer than the acquire's own timeout: it waited for the pull
    assert outcome.get("grpc") == (key, True, True), outcome
    assert reports and all(r.key == key and r.remote == env["remote"] for r in reports)
    done = [r.done_bytes for r in reports]
    assert done == sorted(done) and reports[-1].total_bytes >= SIZE, done
    assert seen["key"] == key and [w["pid"] for w in seen["waiters"]] == [os.getpid()] * 2, seen
    waiting = [line for line in table.splitlines() if "(waiting: pull" in line]
    assert len(waiting) == 2 and all(key[:16] in line and str(os.getpid()) in line for line in waiting), table
    assert link.sent["down"] < 2 * SIZE  # one pull for every acquire
    assert artifact_dirs(b.root) == [key]


def as_nobody(socket: Path, *keys: str) -> list[dict[str, Any]]:
    """One acquire of each key in turn by a client process running as ``NOBODY``: its reports."""
    done = subprocess.run([sys.executable, str(WORKER), str(NOBODY), str(socket), *keys], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(line) for line in done.stdout.strip().splitlines()[-len(keys):]]
    assert len(reports) == len(keys), done.stdout
    return reports


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the acquire-only caller runs as another uid (needs root)")
# hwrd as the unit's unprivileged user only: the role is decided by the caller's credentials, the
# same rule whatever hwrd's uid, and this is the pull that hwrd stages and commits as that user
# on an S3 remote (its own staging and artifact files).
@pytest.mark.parametrize("daemon_user", [HWRD], ids=["unprivileged"])
@pytest.mark.timeout(180)
def test_only_the_publish_role_starts_a_pull_but_anyone_may_wait_for_one(slow_fleet: dict[str, Any],
                                                                         daemon_user: RunAs) -> None:
    env = slow_fleet
    env["base"].chmod(0o755)
    key, expected = published(env, "wait/roles", 81, 2 * MIB)
    b = env["start_b"]("--socket-mode", "666", "--allow-uid", str(NOBODY), "--publish-uids", "0")
    absent = secrets.token_hex(32)
    # acquire role only: may not make hwrd stage anything; and a key no pull fetches is refused
    # without asking the remote
    refused, other = as_nobody(b.socket, key, absent)
    assert (refused["ok"], refused["code"], refused["role"]) == (False, "PERMISSION_DENIED", "publish"), refused
    assert refused["details"]["remote"] == env["remote"] and refused["details"]["key"] == key
    assert (other["code"], other["role"]) == (PermissionDeniedError.code, "publish"), other
    assert absent not in env["server"].log.read_text(errors="replace")
    assert env["link"].sent["down"] == 0 and artifact_dirs(b.root) == [] and staging_dirs(b.root) == []
    env["link"].pause(after=256 << 10)  # the pull root starts cannot end before the acquire-only uid joins it
    with connect(b.socket) as client:  # root starts the pull (and does not wait for it) ...
        with pytest.raises(ArtifactNotFound):
            client.acquire(key, timeout=30, wait_for_pull=False)
        joining: dict[str, Any] = {}
        joiner = threading.Thread(target=lambda: joining.update(as_nobody(b.socket, key)[0]))
        joiner.start()  # ... which the acquire-only uid may wait for
        wait_until(lambda: [w["uid"] for p in client.status()["remote"]["pulls"] for w in p["waiters"]] == [NOBODY],
                   120)
        env["link"].resume()
        joiner.join(120)
        joined = joining
        assert joined.get("ok"), joined
        assert joined["digests"] == {name: d["sha256"] for name, d in expected.items()}
    assert absent not in env["server"].log.read_text(errors="replace")  # nor later
    assert artifact_dirs(b.root) == [key]
