"""Whether and when a publication may begin, in-process: one publisher per identity on the node
(a second one with no wait is told to come back; one that waits joins the first's artifact), and
a publication that can never fit is refused before anything is evicted.

The graph is built as hwrd builds it (``tests/service_graph.py``). What the transport adds stays
in tests/e2e/test_publication.py: the gRPC status and error trailer of a zero-wait refusal, and a
client that waits longer than its own per-call timeout.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from service_graph import run, service, session_of
from store_steps import acquire, begin_floats, commit, keys, publish_floats, write_floats

from hwr.client.errors import ActiveBuildTimeout, HwrError
from hwr.client.identity import ArtifactIdentity
from hwr.daemon.store.staging import StagedTensor

pytestmark = pytest.mark.timeout(60)


def test_second_publisher_with_zero_wait_is_told_to_come_back(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with service(tmp_path / "root") as graph:
            first, second = session_of(graph), session_of(graph)
            pub = await begin_floats(graph, first, "busy", 16)
            with pytest.raises(ActiveBuildTimeout) as refused:
                await graph.publications.begin(second, ArtifactIdentity.simple("busy"),
                                               [StagedTensor("w", torch.float32, (16,))], wait_timeout=0)
            assert refused.value.code == "ACTIVE_BUILD_TIMEOUT" and refused.value.details["key"] == pub.key
            await write_floats(graph, first, pub, 1.0)
            key = await commit(graph, first, pub)
            # Once the first committed, the identity is simply present.
            again = await graph.publications.begin(second, ArtifactIdentity.simple("busy"),
                                                   [StagedTensor("w", torch.float32, (16,))], wait_timeout=0)
            assert (again.outcome, again.key, again.publication) == ("already_present", key, None)

    run(scenario)


def test_waiting_publisher_joins_when_the_first_commits(tmp_path: Path) -> None:
    """A second publisher waits for the first as long as its ``wait_timeout`` says and is answered
    JOINED with the first's key."""
    hold_s = 0.5

    async def scenario() -> None:
        async with service(tmp_path / "root") as graph:
            first, second = session_of(graph), session_of(graph)
            pub = await begin_floats(graph, first, "slow-first", 1024)
            started = time.monotonic()
            waiter = asyncio.ensure_future(graph.publications.begin(
                second, ArtifactIdentity.simple("slow-first"), [StagedTensor("w", torch.float32, (1024,))],
                wait_timeout=30.0))
            await write_floats(graph, first, pub, 1.0)
            await asyncio.sleep(hold_s)  # a slow writer
            assert not waiter.done()
            key = await commit(graph, first, pub)
            joined = await asyncio.wait_for(waiter, 30)
            assert (joined.outcome, joined.key, joined.publication) == ("joined", key, None)
            assert time.monotonic() - started >= hold_s
            assert key in await keys(graph)

    run(scenario)


def test_publication_that_can_never_fit_evicts_nothing(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with service(tmp_path / "root") as graph:
            session = session_of(graph)
            key = await publish_floats(graph, session, "bystander", 4096, 5.0)
            huge = [StagedTensor("w", torch.float32, (1 << 40,))]  # 4 TiB: more than the filesystem holds
            with pytest.raises(HwrError) as caught:
                await graph.publications.begin(session, ArtifactIdentity.simple("too-big"), huge, wait_timeout=0)
            # Larger than the whole filesystem: refused at once, not retryable, before any eviction.
            assert caught.value.code == "EXCEEDS_FILESYSTEM" and not caught.value.retryable
            assert key in await keys(graph), "an unleased bystander was evicted"
            assert graph.capacity.evictor.evictions == 0
            assert torch.equal(await acquire(graph, session, key), torch.full((4096,), 5.0))

    run(scenario)
