"""Acquires that meet a pull in progress: two hwrd nodes on one real S3 server (moto's), node B
reaching it through ``SlowLink`` (a throttled TCP relay: a slow network, or a stalled one).

A ``required`` acquire whose own timeout is far shorter than the pull waits for it while hwrd
reports progress, and gets its lease; a pull that stops receiving bytes fails every waiter with
a typed error naming the remote after hwrd's stall timeout and leaves nothing behind; a caller
that chooses not to wait misses at once and the pull goes on; absent keys are remembered; and a
uid with only the acquire role cannot start a pull but may wait for one that runs.
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
from daemon_proc import requested_user

from hwr.client import connect
from hwr.client.errors import ArtifactNotFound, HwrError, PermissionDeniedError, RemoteUnavailable
from hwr.protos.hwr.v1 import hwr_pb2 as pb

from . import fleet_fixtures
from .fleet_fixtures import S3Server, SlowLink, artifact_dirs, node, staging_dirs
from .helpers import MIB, digests, wait_until
from .test_fleet import PREFIX, publish_on, tensors_of, wait_ready

if TYPE_CHECKING:
    from hwr.client.acquisition import PullReport

s3_server = fleet_fixtures.s3_server  # the session's S3 server process (a fixture)
SIZE = 24 * MIB
RATE = 4 * MIB  # bytes/s through the slow link: the pull takes ~6 s
STALL_S = 3
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
def test_a_required_acquire_waits_for_a_slow_pull_with_progress(slow_fleet: dict[str, Any]) -> None:
    env = slow_fleet
    key, expected = published(env, "wait/slow", 51)
    b = env["start_b"]()
    reports: list[PullReport] = []
    seen: list[dict[str, Any]] = []

    def watch() -> None:  # what an operator sees meanwhile (hwrctl status --json, hwrctl leases)
        with connect(b.socket) as admin:
            deadline = time.monotonic() + 60
            while not seen and time.monotonic() < deadline:
                pulls = admin.status()["remote"]["pulls"]
                if pulls and pulls[0]["waiters"]:
                    seen.append(pulls[0])
                    table = subprocess.run([*HWRCTL, "--socket", str(b.socket), "leases"], capture_output=True,
                                           text=True, timeout=60, check=True).stdout
                    seen.append({"table": table})
                time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    started = time.monotonic()
    with connect(b.socket) as client, client.acquire(key, timeout=2, on_pull=reports.append) as lease:
        waited = time.monotonic() - started
        assert digests(lease.tensors) == expected
    watcher.join(60)
    assert waited > 2, waited  # longer than the acquire's own timeout: it waited for the pull
    assert reports and all(r.key == key and r.remote == env["remote"] for r in reports)
    done = [r.done_bytes for r in reports]
    assert done == sorted(done) and reports[-1].total_bytes >= SIZE, done
    assert seen and seen[0]["key"] == key and seen[0]["waiters"][0]["pid"] == os.getpid(), seen
    waiting = [line for line in seen[1]["table"].splitlines() if "(waiting: pull" in line]
    assert len(waiting) == 1 and key[:16] in waiting[0] and str(os.getpid()) in waiting[0], seen[1]
    assert artifact_dirs(b.root) == [key]


@pytest.mark.slow
@pytest.mark.usefixtures("daemon_user")
@pytest.mark.timeout(180)
def test_a_stalled_pull_fails_every_waiter_naming_the_remote(slow_fleet: dict[str, Any]) -> None:
    env = slow_fleet
    key, expected = published(env, "wait/stalled", 61)
    b = env["start_b"]("--remote-stall-timeout-s", str(STALL_S))
    errors: list[tuple[HwrError, float]] = []

    def acquire() -> None:
        started = time.monotonic()
        try:
            with connect(b.socket) as client:
                client.acquire(key, timeout=2).close()
        except HwrError as exc:
            errors.append((exc, time.monotonic() - started))

    waiters = [threading.Thread(target=acquire) for _ in range(2)]
    for t in waiters:
        t.start()
    env["link"].wait_bytes("down", 4 * MIB)
    env["link"].pause()  # the remote stops sending: no byte moves any more
    for t in waiters:
        t.join(60)
    assert len(errors) == 2, errors
    for exc, took in errors:
        assert isinstance(exc, RemoteUnavailable), exc
        assert exc.details.get("reason") == "STALLED" and exc.details.get("remote") == env["remote"]
        assert env["remote"] in exc.message and "stalled" in exc.message
        assert took < 40, took
    wait_until(lambda: staging_dirs(b.root) == [], 30)  # the stopped pull's staging is gone
    assert artifact_dirs(b.root) == []
    env["link"].resume()
    time.sleep(2.5)  # past the 2 s a down remote is remembered
    with connect(b.socket) as client, client.acquire(key, timeout=60) as lease:
        assert digests(lease.tensors) == expected  # the next acquire pulls it afresh


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_caller_that_does_not_wait_misses_at_once_and_the_pull_goes_on(slow_fleet: dict[str, Any]) -> None:
    env = slow_fleet
    key, expected = published(env, "wait/fallback", 71)
    b = env["start_b"]()
    with connect(b.socket) as client:
        started = time.monotonic()
        with pytest.raises(ArtifactNotFound) as info:
            client.acquire(key, timeout=30, wait_for_pull=False)
        assert time.monotonic() - started < 3  # at once, not after the ~6 s pull
        assert info.value.details.get("pulling") is True and info.value.details.get("remote") == env["remote"]
        assert [p["key"] for p in client.status()["remote"]["pulls"]] == [key]  # left running
        with pytest.raises(ArtifactNotFound):  # a second caller that does not wait joins nothing
            client.acquire(key, timeout=30, wait_for_pull=False)
        # gRPC waits too
        granted = client._connection.call("Acquire", pb.AcquireRequest(artifact=pb.ArtifactRef(key=key)), 60)
        assert granted.key == key and granted.lease_id
        assert client._connection.call("Release", pb.ReleaseRequest(lease_id=granted.lease_id)).released
        with client.acquire(key, timeout=60) as lease:
            assert digests(lease.tensors) == expected
    assert env["link"].sent["down"] < 2 * SIZE  # one pull for all three acquires


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("daemon_user")
def test_misses_of_an_absent_key_are_remembered(slow_fleet: dict[str, Any]) -> None:
    env = slow_fleet
    b = env["start_b"]()
    absent = secrets.token_hex(32)  # the server's log is shared by the session's tests
    log = env["server"].log

    def asked() -> int:
        return log.read_text(errors="replace").count(f"/artifacts/{absent}/READY.json")

    with connect(b.socket) as client:
        for _ in range(40):
            with pytest.raises(ArtifactNotFound) as info:
                client.acquire(absent, timeout=30)
            assert not isinstance(info.value, RemoteUnavailable)
        wait_until(lambda: asked() >= 1, 10)
        assert asked() == 1, asked()  # one remote request, not forty
        time.sleep(5.5)  # the miss is remembered for 5 s, then asked again
        with pytest.raises(ArtifactNotFound):
            client.acquire(absent, timeout=30)
        wait_until(lambda: asked() >= 2, 10)
        assert asked() == 2


def as_nobody(socket: Path, key: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(WORKER), str(NOBODY), str(socket), key], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the acquire-only caller runs as another uid (needs root)")
@pytest.mark.usefixtures("daemon_user")
@pytest.mark.timeout(180)
def test_only_the_publish_role_starts_a_pull_but_anyone_may_wait_for_one(slow_fleet: dict[str, Any]) -> None:
    env = slow_fleet
    env["base"].chmod(0o755)
    key, expected = published(env, "wait/roles", 81)
    b = env["start_b"]("--socket-mode", "666", "--allow-uid", str(NOBODY), "--publish-uids", "0")
    refused = as_nobody(b.socket, key)  # acquire role only: may not make hwrd stage anything
    assert (refused["ok"], refused["code"], refused["role"]) == (False, "PERMISSION_DENIED", "publish"), refused
    assert refused["details"]["remote"] == env["remote"] and refused["details"]["key"] == key
    assert env["link"].sent["down"] == 0 and artifact_dirs(b.root) == [] and staging_dirs(b.root) == []
    with connect(b.socket) as client:  # root starts the pull (and does not wait for it) ...
        with pytest.raises(ArtifactNotFound):
            client.acquire(key, timeout=30, wait_for_pull=False)
        joined = as_nobody(b.socket, key)  # ... which the acquire-only uid may wait for
        assert joined["ok"], joined
        assert joined["digests"] == {name: d["sha256"] for name, d in expected.items()}
    absent = secrets.token_hex(32)
    other = as_nobody(b.socket, absent)  # a key no pull fetches: refused without asking the remote
    assert (other["code"], other["role"]) == (PermissionDeniedError.code, "publish"), other
    assert absent not in env["server"].log.read_text(errors="replace")
    assert artifact_dirs(b.root) == [key]
