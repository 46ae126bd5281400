"""Pull wait, in-process: acquires of a key the node does not have, while the remote tier pulls it.

Two service graphs built as hwrd builds them (``service_graph.service``) on one real S3 server
(moto's, a process: ``e2e.fleet_fixtures.S3Server``): node A publishes and pushes, node B reaches
the server through ``SlowLink`` (a throttled TCP relay: a slow network, or a stalled one when
paused). The remote, its endpoint and the stall timeout are hwrd's own config keys; the
credentials come from the standard chain's environment variables, as for hwrd. No daemon process
and no transport: a grant is ``Leasing.grant``, progress is what ``Leasing.pulling`` and the
status RPC's ``remote_status`` read. What needs a process stays in tests/e2e/test_fleet_wait.py:
the role check by peer credentials, and progress frames reaching a real client.

Use cases: a waiter gets its lease after a slow pull and sees its progress; a stalled pull fails
every waiter with a typed error naming the remote after the stall timeout and leaves nothing
behind; a caller that does not wait misses at once while the pull goes on; a caller without the
publish role may not start a pull but may wait for one; misses of an absent key are remembered;
and a pull verifies what it fetches: a tampered remote artifact is refused with a typed error
naming the remote, the refusal is remembered, and nothing is committed or left in staging.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2e import fleet_fixtures
from e2e.fleet_fixtures import S3_ENV, S3Server, SlowLink, artifact_dirs, staging_dirs
from service_graph import publish, read_all, run, running, service, session_of, until

from hwr.client.errors import (
    ArtifactNotFound,
    ChecksumMismatch,
    HwrError,
    ManifestCorrupt,
    PermissionDeniedError,
    RemoteUnavailable,
)
from hwr.daemon.app.graph import ServiceGraph
from hwr.daemon.fleet.pull import Puller
from hwr.daemon.rpc.remote import remote_status
from hwr.daemon.service.catalog import Waiter
from hwr.daemon.system.peercred import PeerCred

pytestmark = pytest.mark.timeout(120)

s3_server = fleet_fixtures.s3_server  # the session's S3 server process (a fixture)
MIB = 1 << 20
SIZE = 3 * MIB  # one part (under the S3 tier's 16 MiB part size): one connection through the link
RATE = 2 * MIB  # bytes/s through the slow link: a pull of SIZE takes ~1.5 s
STALL_S = 1.0  # remote_stall_timeout_s of the stalled node (hwrd's default is 60 s)
NOBODY = 65534
HOUSEKEEPING_S = 0.5  # housekeeping_interval_s (hwrd's default is 2 s): held staging is swept this often


@dataclass
class FleetEnv:
    """A fresh bucket on the session's S3 server, a slow link to it, and where nodes live."""

    server: S3Server
    remote: str
    link: SlowLink
    base: Path


@pytest.fixture
def fleet(s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FleetEnv]:
    for name, value in S3_ENV.items():  # hwrd's S3 client reads the standard credential chain
        monkeypatch.setenv(name, value)
    link = SlowLink(s3_server.port, RATE)
    try:
        yield FleetEnv(s3_server, f"s3://{s3_server.new_bucket()}/fleet/v1", link, tmp_path)
    finally:
        link.resume()
        link.close()


@contextlib.asynccontextmanager
async def node(root: Path, fleet: FleetEnv, *, slow: bool = True, **config: object) -> AsyncIterator[ServiceGraph]:
    """A node's service graph on ``fleet``'s remote, through the slow link unless ``slow`` is
    False, with its remote tier started (as hwrd's start does) and stopped after."""
    endpoint = fleet.link.endpoint if slow else fleet.server.endpoint
    config.setdefault("housekeeping_interval_s", HOUSEKEEPING_S)
    async with service(root, remote=fleet.remote, remote_endpoint_url=endpoint, **config) as graph:
        assert graph.fleet is not None
        # The node service's own tasks, as hwrd runs them: housekeeping reclaims the staging a
        # stopped pull's transfer thread still held when the pull was aborted.
        async with running(graph):
            await graph.fleet.start()
            try:
                yield graph
            finally:
                fleet.link.resume()  # a test that failed while the link was paused ends without its stall
                await graph.fleet.stop()


async def published(fleet: FleetEnv, name: str, fill: int, nbytes: int = SIZE) -> tuple[str, str]:
    """An artifact node A published and pushed to the remote: (key, SHA-256 of its payload bytes)."""
    return (await published_all(fleet, [(name, fill)], nbytes))[0]


async def published_all(fleet: FleetEnv, artifacts: list[tuple[str, int]], nbytes: int) -> list[tuple[str, str]]:
    """``published`` for several (name, fill) artifacts, all pushed before it returns."""
    out = []
    async with node(fleet.base / "a", fleet, slow=False) as origin:
        session = session_of(origin)
        for name, fill in artifacts:
            key = await publish(origin, session, name, fill=fill, elements=nbytes // 4)
            grant = origin.leasing.grant_now(session, key)
            assert grant is not None
            out.append((key, digest(grant.fds)))
        await until(lambda: origin.fleet is not None and origin.fleet.pushes["pushed"] == len(artifacts), 60)
        origin.leasing.end_session(session)
    return out


def digest(fds: list[int]) -> str:
    return hashlib.sha256(read_all(fds)).hexdigest()


def test_a_waiter_gets_its_lease_after_a_slow_pull_and_sees_its_progress(fleet: FleetEnv) -> None:
    async def scenario() -> None:
        key, payload = await published(fleet, "wait/slow", 51)
        async with node(fleet.base / "b", fleet) as b:
            assert b.fleet is not None
            session = session_of(b)
            assert b.leasing.grant_now(session, key) is None  # not here: the grant must wait
            acquiring = asyncio.ensure_future(b.leasing.grant(session, key))
            seen: list[tuple[str, int, int]] = []
            waiters: list[Waiter] = []
            status = None
            while not acquiring.done():  # what the transports' progress frames and status read
                progress = b.leasing.pulling(key)
                if progress is not None:
                    seen.append((progress.phase, progress.done_bytes, progress.total_bytes))
                    if status is None and progress.waiters:
                        waiters = list(progress.waiters.values())
                        status = await remote_status(b.fleet)  # hwrctl status's "remote" part
                await asyncio.wait({acquiring}, timeout=0.05)
            grant = await acquiring
            assert digest(grant.fds) == payload  # bit-identical to what A published
            done = [d for _phase, d, _total in seen]
            assert done == sorted(done), done  # progress only goes forward
            assert any(p == "download" and 0 < d < t for p, d, t in seen), seen  # seen mid-transfer
            assert seen[-1][2] >= SIZE, seen
            assert [(w.session_id, w.pid, w.uid) for w in waiters] == [(session.session_id, os.getpid(), os.getuid())]
            assert status is not None and [p.key for p in status.pulls] == [key], status
            assert [w.pid for w in status.pulls[0].waiters] == [os.getpid()], status
            assert b.leasing.pulling(key) is None and b.fleet.pulls["pulled"] == 1 and b.fleet.bytes_pulled >= SIZE
            assert artifact_dirs(b.store.root) == [key] and staging_dirs(b.store.root) == []
            b.leasing.end_session(session)

    run(scenario)


def test_a_stalled_pull_fails_every_waiter_naming_the_remote_and_leaves_nothing(fleet: FleetEnv) -> None:
    async def scenario() -> None:
        key, payload = await published(fleet, "wait/stalled", 61)
        async with node(fleet.base / "b", fleet, remote_stall_timeout_s=STALL_S) as b:
            assert b.fleet is not None
            sessions = [session_of(b) for _ in range(2)]
            started = time.monotonic()
            waiting = [asyncio.ensure_future(b.leasing.grant(s, key)) for s in sessions]
            await asyncio.to_thread(fleet.link.wait_bytes, "down", SIZE // 8)
            fleet.link.pause()  # the remote stops sending: no byte moves any more
            stalled_at = time.monotonic()
            errors = await asyncio.gather(*waiting, return_exceptions=True)
            took = time.monotonic() - started
            assert len(errors) == 2, errors
            for exc in errors:
                assert isinstance(exc, RemoteUnavailable), exc
                assert exc.details.get("reason") == "STALLED" and exc.details.get("remote") == fleet.remote
                assert fleet.remote in exc.message and "stalled" in exc.message
            # after the stall timeout (not before), and soon after it
            assert time.monotonic() - stalled_at > 0.9 * STALL_S and took < 20, took
            await until(lambda: staging_dirs(b.store.root) == [], 30)  # the stopped pull's staging is gone
            assert artifact_dirs(b.store.root) == [] and b.catalog.record_now(key) is None
            assert b.leasing.pulling(key) is None and b.fleet.pulls["unavailable"] == 1
            fleet.link.resume()
            await asyncio.sleep(Puller.DOWN_TTL_S + 0.2)  # past the time a down remote is remembered
            grant = await b.leasing.grant(sessions[0], key)  # the next acquire pulls it afresh
            assert digest(grant.fds) == payload and b.fleet.pulls["pulled"] == 1
            for s in sessions:
                b.leasing.end_session(s)

    run(scenario)


def test_a_caller_that_does_not_wait_misses_at_once_and_the_pull_goes_on(fleet: FleetEnv) -> None:
    async def scenario() -> None:
        key, payload = await published(fleet, "wait/fallback", 71, nbytes=2 * MIB)
        async with node(fleet.base / "b", fleet) as b:
            assert b.fleet is not None
            session = session_of(b)
            fleet.link.pause()  # the pull cannot end while the callers below ask
            started = time.monotonic()
            with pytest.raises(ArtifactNotFound) as info:
                await b.leasing.grant(session, key, wait=False)
            assert time.monotonic() - started < 3  # at once
            assert info.value.details.get("pulling") is True and info.value.details.get("remote") == fleet.remote
            pull = b.leasing.pulling(key)
            assert pull is not None and list(b.fleet.puller.in_flight) == [key]  # left running
            with pytest.raises(ArtifactNotFound):  # a second caller that does not wait joins nothing
                await b.leasing.grant(session, key, wait=False)
            assert b.leasing.pulling(key) is pull and not pull.waiters  # still the one pull, nobody waiting
            assert session.leases == {}
            fleet.link.resume()
            grant = await b.leasing.grant(session, key)  # a caller that waits gets that pull's result
            assert digest(grant.fds) == payload
            assert b.fleet.pulls["pulled"] == 1 and fleet.link.sent["down"] < 2 * 2 * MIB  # one pull for all
            b.leasing.end_session(session)

    run(scenario)


def test_a_caller_without_the_publish_role_may_not_start_a_pull_but_may_wait_for_one(fleet: FleetEnv) -> None:
    async def scenario() -> None:
        key, payload = await published(fleet, "wait/roles", 81, nbytes=2 * MIB)
        async with node(fleet.base / "b", fleet, publish_uids=(0,)) as b:
            assert b.fleet is not None
            nobody = b.registry.open_session(PeerCred(pid=os.getpid(), uid=NOBODY, gid=NOBODY))
            root = session_of(b)
            assert not b.leasing.miss_policy(nobody).start and b.leasing.miss_policy(root).start
            with pytest.raises(PermissionDeniedError) as info:  # acquire role only: may not make hwrd stage
                await b.leasing.grant(nobody, key)
            assert info.value.details.get("role") == "publish" and info.value.details.get("uid") == NOBODY
            assert info.value.details.get("remote") == fleet.remote and info.value.details.get("key") == key
            assert "publish role" in info.value.message
            assert fleet.link.sent["down"] == 0  # nothing was asked of the remote
            assert artifact_dirs(b.store.root) == [] and staging_dirs(b.store.root) == []
            fleet.link.pause()  # the pull root starts below cannot end before nobody joins it
            with pytest.raises(ArtifactNotFound):  # root starts the pull and does not wait ...
                await b.leasing.grant(root, key, wait=False)
            joining = asyncio.ensure_future(b.leasing.grant(nobody, key))  # ... nobody may wait for it
            pull = b.leasing.pulling(key)
            assert pull is not None
            await until(lambda: [w.uid for w in pull.waiters.values()] == [NOBODY], 10)
            fleet.link.resume()
            grant = await joining
            assert digest(grant.fds) == payload and grant.key == key
            absent = secrets.token_hex(32)  # a key no pull fetches: refused without asking the remote
            before = dict(fleet.link.sent)
            with pytest.raises(PermissionDeniedError) as info:
                await b.leasing.grant(nobody, absent)
            assert info.value.details.get("role") == "publish" and info.value.details.get("key") == absent
            assert fleet.link.sent == before and absent not in fleet.server.log.read_text(errors="replace")
            assert artifact_dirs(b.store.root) == [key]
            b.leasing.end_session(nobody)
            b.leasing.end_session(root)

    run(scenario)


def test_misses_of_an_absent_key_are_remembered(fleet: FleetEnv) -> None:
    absent = secrets.token_hex(32)  # the server's log is shared by the session's tests

    def asked() -> int:
        return fleet.server.log.read_text(errors="replace").count(f"/artifacts/{absent}/READY.json")

    async def scenario() -> None:
        async with node(fleet.base / "b", fleet, slow=False) as b:
            assert b.fleet is not None
            session = session_of(b)
            for _ in range(40):
                with pytest.raises(ArtifactNotFound) as info:
                    await b.leasing.grant(session, absent)
                assert not isinstance(info.value, RemoteUnavailable)
            await until(lambda: asked() >= 1, 10)
            assert asked() == 1, asked()  # one remote request, not forty
            assert b.fleet.pulls["miss"] == 1
            await asyncio.sleep(Puller.MISS_TTL_S + 0.5)  # the miss is remembered that long, then asked again
            with pytest.raises(ArtifactNotFound):
                await b.leasing.grant(session, absent)
            await until(lambda: asked() >= 2, 10)
            assert asked() == 2 and b.fleet.pulls["miss"] == 2
            assert session.leases == {} and artifact_dirs(b.store.root) == []

    run(scenario)


# --- a pull verifies what it fetches ------------------------------------------------------------
def object_name(fleet: FleetEnv, key: str, file: str) -> tuple[str, str]:
    """(bucket, object key) of ``file`` of ``key`` in ``fleet``'s remote."""
    bucket, prefix = fleet.remote.removeprefix("s3://").split("/", 1)
    return bucket, f"{prefix}/artifacts/{key}/{file}"


@pytest.mark.parametrize("case", ["flipped_byte", "truncated", "swapped_manifest", "wrong_identity"])
def test_a_tampered_remote_artifact_is_refused_remembered_and_leaves_nothing(fleet: FleetEnv, case: str) -> None:
    async def scenario() -> None:
        (key, _), (other, _) = await published_all(fleet, [(f"tamper/{case}", 21), (f"tamper/{case}-other", 22)],
                                                   nbytes=256 << 10)
        s3 = fleet.server.client()

        def get(of: str, file: str) -> bytes:
            bucket, name = object_name(fleet, of, file)
            return bytes(s3.get_object(Bucket=bucket, Key=name)["Body"].read())

        def put(file: str, body: bytes) -> None:
            bucket, name = object_name(fleet, key, file)
            s3.put_object(Bucket=bucket, Key=name, Body=body)

        data = get(key, "model-00001.safetensors")
        expected: type[HwrError] = ManifestCorrupt
        if case == "flipped_byte":
            flipped = bytearray(data)
            flipped[len(flipped) // 2] ^= 0x01
            put("model-00001.safetensors", bytes(flipped))
            expected = ChecksumMismatch
        elif case == "truncated":
            put("model-00001.safetensors", data[: len(data) - 4096])
        elif case == "swapped_manifest":  # another artifact's manifest under this key's READY.json
            put("manifest.json", get(other, "manifest.json"))
        else:  # another artifact's complete set of documents under this key: names another identity
            for file in ("manifest.json", "READY.json"):
                put(file, get(other, file))
        async with node(fleet.base / "b", fleet, slow=False) as b:
            assert b.fleet is not None
            session = session_of(b)
            with pytest.raises(expected) as info:
                await b.leasing.grant(session, key)
            assert info.value.details.get("remote") == fleet.remote
            assert fleet.remote in str(info.value)
            # nothing was committed or left in staging
            await until(lambda: staging_dirs(b.store.root) == [], 30)
            assert artifact_dirs(b.store.root) == [] and await b.catalog.records() == []
            assert b.fleet.pulls["invalid"] == 1
            with pytest.raises(expected):  # remembered: the next acquire does not fetch it again
                await b.leasing.grant(session, key)
            assert b.fleet.pulls["invalid"] == 1 and session.leases == {}

    run(scenario)
