"""A publication that needs room while every artifact is leased and nothing else is in flight
waits briefly (``LEASE_GRACE_S``) for a lease to be released, instead of failing at once.

In-process (``tests/service_graph.py``): the lease is held and released through ``Leasing`` as
the transports do, the publication begins through ``Publishing``. That an artifact released by
another uid's process is evictable by a daemon that is not root (the write-lease probe) is
proven against such a daemon in tests/e2e/test_unprivileged_eviction.py.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from service_graph import run, service, session_of
from store_steps import acquire, keys, publish_floats

from hwr.client.errors import StoreLimitExceeded
from hwr.daemon.app.graph import ServiceGraph
from hwr.daemon.service.capacity import LEASE_GRACE_S
from hwr.daemon.service.leasing import Grant
from hwr.daemon.service.sessions import Session

pytestmark = pytest.mark.timeout(60)

ELEMENTS = 1 << 18  # one 256Ki-float32 tensor
ART = ELEMENTS * 4 + 136  # plus its safetensors header: room for exactly one


async def hold_the_only_artifact(graph: ServiceGraph) -> tuple[Session, Session, str, Grant]:
    """A store with room for one artifact, full: (holder, publisher, its key, the holder's lease)."""
    holder, publisher = session_of(graph), session_of(graph)
    first = await publish_floats(graph, holder, "first", ELEMENTS, 1.0)
    return holder, publisher, first, await graph.leasing.grant(holder, first)


def test_a_lease_released_during_the_grace_makes_room(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with service(tmp_path / "root", store_limit_bytes=ART) as graph:
            holder, publisher, first, lease = await hold_the_only_artifact(graph)

            def release() -> None:
                graph.leasing.release(holder, lease.lease_id)
                for fd in lease.fds:
                    os.close(fd)

            asyncio.get_running_loop().call_later(0.3, release)  # the last lease goes during the grace
            started = time.monotonic()
            second = await publish_floats(graph, publisher, "second", ELEMENTS, 2.0, wait_timeout=30)
            waited = time.monotonic() - started
            assert 0.25 <= waited < LEASE_GRACE_S + 5
            assert float((await acquire(graph, publisher, second))[0]) == 2.0
            assert first not in await keys(graph)  # evicted to make room

    run(scenario)


def test_a_lease_held_past_the_grace_is_the_typed_error_after_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with service(tmp_path / "root", store_limit_bytes=ART) as graph:
            holder, publisher, _first, lease = await hold_the_only_artifact(graph)
            try:
                started = time.monotonic()
                with pytest.raises(StoreLimitExceeded):
                    await publish_floats(graph, publisher, "second", ELEMENTS, 2.0, wait_timeout=30)
                waited = time.monotonic() - started
                assert LEASE_GRACE_S * 0.9 <= waited < LEASE_GRACE_S + 5  # the grace, not the 30 s
                with pytest.raises(StoreLimitExceeded):  # wait_timeout 0: no grace at all
                    await publish_floats(graph, publisher, "third", ELEMENTS, 3.0, wait_timeout=0)
            finally:
                graph.leasing.release(holder, lease.lease_id)
                for fd in lease.fds:
                    os.close(fd)

    run(scenario)


def test_the_grace_is_a_time_not_one_wake_up(tmp_path: Path) -> None:
    """A release wakes the waiting publication, but another client leases that artifact again
    before the retry: the publication keeps waiting out the rest of the grace (it used to fail at
    that retry, so a publication under acquire churn failed on a lease's round trip), and the
    next release within the grace makes room."""
    async def scenario() -> None:
        async with service(tmp_path / "root", store_limit_bytes=2 * ART) as graph:
            holder, other, publisher = session_of(graph), session_of(graph), session_of(graph)
            first = await publish_floats(graph, holder, "first", ELEMENTS, 1.0)
            second = await publish_floats(graph, holder, "second", ELEMENTS, 2.0)
            leases = [await graph.leasing.grant(holder, key, descriptors=False) for key in (first, second)]
            taken_again: list[Grant] = []

            def release_and_lease_again() -> None:  # in one step: the woken retry finds it leased
                graph.leasing.release(holder, leases[0].lease_id)
                again = graph.leasing.grant_now(other, first, descriptors=False)
                assert again is not None
                taken_again.append(again)

            loop = asyncio.get_running_loop()
            loop.call_later(0.2, release_and_lease_again)
            loop.call_later(0.2 + LEASE_GRACE_S / 2, graph.leasing.release, holder, leases[1].lease_id)
            started = time.monotonic()
            third = await publish_floats(graph, publisher, "third", ELEMENTS, 3.0, wait_timeout=30)
            waited = time.monotonic() - started
            assert taken_again and 0.2 + LEASE_GRACE_S / 2 - 0.05 <= waited < LEASE_GRACE_S + 5
            assert await keys(graph) == {first, third}  # the released one made room; the leased one stays
            graph.leasing.release(other, taken_again[0].lease_id)

    run(scenario)
