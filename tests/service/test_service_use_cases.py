"""The node service's use cases, in-process: grant, publish, evict, pin, channel set/watch, pull wait.

Each test builds the service exactly as hwrd does (``hwr.daemon.app.graph.ServiceGraph.build``)
over a real store on a temporary root, and calls the use cases directly: real files, real
descriptors, real lease journal; no daemon process, no transport. The transports' own behaviour
(framing, descriptor passing, peer credentials, crashes, signals) is tested against a real hwrd
elsewhere (tests/e2e, tests/daemon).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from service_graph import publish, read_all, run, service, session_of, until

from hwr.client.errors import ActiveLease, ArtifactNotFound, ChannelNotFound, SessionInvalid
from hwr.client.identity import ArtifactIdentity
from hwr.daemon.service.catalog import MissPolicy
from hwr.daemon.service.leasing import CHECKPOINT_LEASE_PREFIX, ArtifactRef
from hwr.daemon.store.staging import StagedTensor

pytestmark = pytest.mark.timeout(60)


# --- grant ------------------------------------------------------------------------------------------
def test_a_grant_leases_journals_and_hands_out_the_payloads(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with service(tmp_path / "root") as graph:
            session = session_of(graph)
            key = await publish(graph, session, "m", fill=7)
            grant = graph.leasing.grant_now(session, key)  # cached and not being evicted: no await
            assert grant is not None and grant.key == key and graph.registry.lease_count(key) == 1
            assert set(read_all(grant.fds)) >= {7}
            again = await graph.leasing.grant(session, key, have=grant.manifest_sha256, descriptors=False)
            assert again.manifest == b"" and again.fds == []  # the caller holds the manifest already
            assert [h.key for h in graph.lease_holds.journal.live()] == [key, key]
            assert graph.leasing.release(session, grant.lease_id) is True
            assert graph.leasing.release(session, grant.lease_id) is False  # released once only
            assert graph.registry.lease_count(key) == 1
            assert graph.leasing.end_session(session) and graph.registry.lease_count(key) == 0
            assert graph.lease_holds.journal.live() == []

    run(scenario)


def test_a_grant_of_a_missing_key_is_a_typed_miss(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with service(tmp_path / "root") as graph:
            session = session_of(graph)
            missing = ArtifactIdentity.simple("nothing").key
            assert graph.leasing.grant_now(session, missing) is None
            with pytest.raises(ArtifactNotFound):
                await graph.leasing.grant(session, missing)
            assert graph.registry.lease_count() == 0

    run(scenario)


def test_a_checkpoint_lease_is_granted_and_journaled_by_leasing(tmp_path: Path) -> None:
    async def scenario() -> None:
        checkpoint = tmp_path / "ckpt"
        checkpoint.mkdir()
        save_file({"w": torch.arange(16, dtype=torch.float32)}, checkpoint / "model.safetensors")
        async with service(tmp_path / "root") as graph:
            session = session_of(graph)
            ckpt, added = graph.checkpoints.add(checkpoint)
            assert added
            lease, granted = await graph.leasing.grant_checkpoint(session, ckpt.checkpoint_id)
            assert granted.checkpoint_id == ckpt.checkpoint_id
            assert lease.key == CHECKPOINT_LEASE_PREFIX + ckpt.checkpoint_id
            assert [h.key for h in graph.lease_holds.journal.live()] == [lease.key]
            data = read_all(graph.leasing.lease_fds(session, lease.lease_id, lease.token))
            assert data == (checkpoint / "model.safetensors").read_bytes()
            assert graph.leasing.release(session, lease.lease_id)
            assert graph.lease_holds.journal.live() == []

    run(scenario)


# --- channels -----------------------------------------------------------------------------------------
def test_a_channel_reference_resolves_to_the_key_it_points_to_now(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with service(tmp_path / "root") as graph:
            session = session_of(graph)
            first, second = await publish(graph, session, "a", 1), await publish(graph, session, "b", 2)
            with pytest.raises(ChannelNotFound):
                graph.leasing.key_for(ArtifactRef(channel="prod"))
            await graph.channels.set("prod", first, set_by="test")
            assert graph.leasing.key_for(ArtifactRef(channel="prod")) == first
            await graph.channels.set("prod", second, set_by="test")
            grant = await graph.leasing.grant(session, graph.leasing.key_for(ArtifactRef(channel="prod")))
            assert grant.key == second and set(read_all(grant.fds)) >= {2}
            graph.leasing.release(session, grant.lease_id)
            with pytest.raises(ActiveLease) as refused:  # a channel's key is never evicted
                await graph.capacity.evict(second)
            assert refused.value.details["reason"] == "channel"

    run(scenario)


def test_a_watch_sees_each_newer_state_and_ends_with_its_session(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with service(tmp_path / "root") as graph:
            session = session_of(graph)
            first, second = await publish(graph, session, "a", 1), await publish(graph, session, "b", 2)
            watch = graph.channels.watch(session.session_id, "prod")
            states = watch.states()
            assert await anext(states) is None  # no such channel yet
            await graph.channels.set("prod", first, set_by="test")
            assert (await asyncio.wait_for(anext(states), 5)).key == first
            await graph.channels.set("prod", second, set_by="publication")
            assert (await asyncio.wait_for(anext(states), 5)).key == second
            graph.channels.session_ended(session.session_id)
            with pytest.raises(SessionInvalid):
                await asyncio.wait_for(anext(states), 5)

    run(scenario)


def test_a_publication_that_names_a_channel_points_it_at_its_commit(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with service(tmp_path / "root") as graph:
            session = session_of(graph)
            begun = await graph.publications.begin(session, ArtifactIdentity.simple("c"),
                                                   [StagedTensor("w", torch.float32, (8,))], wait_timeout=5,
                                                   channel="live")
            pub = begun.publication
            assert pub is not None
            for fd in graph.publications.staging_descriptors(session, pub.publication_id, pub.token):
                os.close(fd)  # zeros are bytes like any other
            record, _ = await graph.publications.commit(session, pub.publication_id, {})
            assert graph.channels.resolve("live") == record.key

    run(scenario)


# --- publish, evict, pin -------------------------------------------------------------------------------
def test_publishing_an_identity_twice_answers_already_present(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with service(tmp_path / "root") as graph:
            session = session_of(graph)
            key = await publish(graph, session, "m")
            again = await graph.publications.begin(session, ArtifactIdentity.simple("m"),
                                                   [StagedTensor("w", torch.float32, (256,))], wait_timeout=5)
            assert (again.outcome, again.key, again.publication) == ("already_present", key, None)
            assert [r.key for r in await graph.catalog.records()] == [key]

    run(scenario)


def test_eviction_by_hand_refuses_a_leased_key_and_removes_a_free_one(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with service(tmp_path / "root") as graph:
            session = session_of(graph)
            key = await publish(graph, session, "m")
            grant = await graph.leasing.grant(session, key, descriptors=False)
            with pytest.raises(ActiveLease) as refused:
                await graph.capacity.evict(key)
            assert refused.value.details["reason"] == "leased"
            graph.leasing.release(session, grant.lease_id)
            assert await graph.capacity.evict(key) > 0
            with pytest.raises(ArtifactNotFound):
                await graph.catalog.record_settled(key)

    run(scenario)


def test_a_full_store_evicts_the_least_recently_used_artifact_to_admit_a_publication(tmp_path: Path) -> None:
    async def scenario() -> None:
        elements = 64 << 10  # 256 KiB each
        async with service(tmp_path / "root", store_limit_bytes=(3 * elements * 4) // 2) as graph:
            session = session_of(graph)
            old = await publish(graph, session, "old", elements=elements)
            new = await publish(graph, session, "new", elements=elements)  # no room for both: old goes
            assert [r.key for r in await graph.catalog.records()] == [new]
            assert old != new and graph.capacity.evictor.evictions == 1

    run(scenario)


def test_a_publication_waiting_for_room_gets_it_when_the_last_lease_is_released(tmp_path: Path) -> None:
    async def scenario() -> None:
        elements = 64 << 10  # 256 KiB each; room for one
        async with service(tmp_path / "root", store_limit_bytes=(3 * elements * 4) // 2) as graph:
            session = session_of(graph)
            held = await publish(graph, session, "held", elements=elements)
            grant = await graph.leasing.grant(session, held, descriptors=False)
            waiting = asyncio.ensure_future(publish(graph, session_of(graph), "next", elements=elements))
            await asyncio.sleep(0.3)
            assert not waiting.done()  # the leased artifact cannot be evicted
            graph.leasing.release(session, grant.lease_id)  # the key's last lease: the room queue wakes
            new = await asyncio.wait_for(waiting, 10)
            assert [r.key for r in await graph.catalog.records()] == [new]

    run(scenario)


def test_a_pinned_key_is_kept_from_eviction_until_unpinned(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with service(tmp_path / "root") as graph:
            session = session_of(graph)
            key = await publish(graph, session, "m")
            already, size, _locked, _residency = await graph.pinning.pin(key)
            assert not already and size > 0 and key in graph.pins
            with pytest.raises(ActiveLease) as refused:
                await graph.capacity.evict(key)
            assert refused.value.details["reason"] == "pinned"
            assert await graph.pinning.unpin(key)
            assert await graph.capacity.evict(key) > 0

    run(scenario)


# --- pull wait --------------------------------------------------------------------------------------------
def test_an_acquire_of_a_miss_waits_for_the_pull_from_the_remote_tier(tmp_path: Path) -> None:
    async def scenario() -> None:
        remote = f"file://{tmp_path / 'remote'}"
        (tmp_path / "remote").mkdir()
        async with service(tmp_path / "a", remote=remote) as origin:
            assert origin.fleet is not None
            await origin.fleet.start()
            try:
                key = await publish(origin, session_of(origin), "shared", fill=9)
                fleet = origin.fleet
                await until(lambda: fleet.pushes["pushed"] > 0, 10)  # the push after publish runs in the background
                assert origin.fleet.pushes["pushed"] == 1
            finally:
                await origin.fleet.stop()
        async with service(tmp_path / "b", remote=remote) as other:
            assert other.fleet is not None
            session = session_of(other)
            assert other.leasing.grant_now(session, key) is None  # not here: the grant must wait
            grant = await other.leasing.grant(session, key)  # waits for the pull, then leases
            assert set(read_all(grant.fds)) >= {9} and other.fleet.pulls["pulled"] == 1
            assert other.leasing.pulling(key) is None
            miss = ArtifactIdentity.simple("nowhere").key
            with pytest.raises(ArtifactNotFound):
                await other.catalog.record_or_pull(miss, how=MissPolicy(wait=True))
            await other.fleet.stop()

    run(scenario)
