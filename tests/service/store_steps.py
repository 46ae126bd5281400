"""Steps of the store's use-case tests in tests/service, done against a ``ServiceGraph`` the way
the transports do them (``tests/service_graph.py`` builds the graph):

``publish_floats`` publishes one float32 tensor ``w`` as a client does (begin, write the staging
descriptors off the loop as a client process would, commit); ``begin_floats`` only stages it;
``acquire`` is the peer socket's acquire (``grant_now``, else ``await grant``) followed by what a
client does with the lease (reads the tensor through the descriptors) and its release. The
graph's background tasks run with ``service_graph.running``.
"""

from __future__ import annotations

import asyncio
import os

import torch
from safetensors.torch import load
from service_graph import read_all

from hwr.client.identity import ArtifactIdentity
from hwr.daemon.app.graph import ServiceGraph
from hwr.daemon.service.publishing import Publication
from hwr.daemon.service.sessions import Session
from hwr.daemon.store.staging import StagedTensor

__all__ = ["MIB", "acquire", "begin_floats", "commit", "keys", "publish_floats", "write_floats"]

MIB = 1 << 20


def _specs(elements: int) -> list[StagedTensor]:
    return [StagedTensor("w", torch.float32, (elements,))]


async def begin_floats(graph: ServiceGraph, session: Session, name: str, elements: int, *,
                       wait_timeout: float = 5.0) -> Publication:
    """A staged publication of ``name`` (one float32 tensor of ``elements``); raises what begin
    raises (``ActiveBuildTimeout``, ``StoreLimitExceeded``, ...)."""
    begun = await graph.publications.begin(session, ArtifactIdentity.simple(name), _specs(elements),
                                           wait_timeout=wait_timeout)
    assert begun.outcome == "staged" and begun.publication is not None, begun
    return begun.publication


async def write_floats(graph: ServiceGraph, session: Session, pub: Publication, value: float) -> None:
    """Fill the staged tensor with ``value`` through its staging descriptors, in a worker thread
    (a client process writes while the daemon serves others)."""
    fds = graph.publications.staging_descriptors(session, pub.publication_id, pub.token)
    _file, offset, nbytes = pub.staging.placements["w"]
    data = torch.full((nbytes // 4,), value, dtype=torch.float32).numpy().tobytes()
    try:
        await asyncio.to_thread(os.pwrite, fds[0], data, offset)
    finally:
        for fd in fds:
            os.close(fd)


async def commit(graph: ServiceGraph, session: Session, pub: Publication) -> str:
    record, _existed = await graph.publications.commit(session, pub.publication_id, {})
    return record.key


async def publish_floats(graph: ServiceGraph, session: Session, name: str, elements: int, value: float, *,
                         wait_timeout: float = 5.0) -> str:
    """One publication of ``name``, a float32 tensor of ``elements`` times ``value``: its key
    (as a client's ``publish``: an identity already present, or built meanwhile by another
    publisher, is answered with its key and nothing is written)."""
    begun = await graph.publications.begin(session, ArtifactIdentity.simple(name), _specs(elements),
                                           wait_timeout=wait_timeout)
    if begun.publication is None:
        assert begun.outcome in ("already_present", "joined"), begun
        return begun.key
    await write_floats(graph, session, begun.publication, value)
    return await commit(graph, session, begun.publication)


async def acquire(graph: ServiceGraph, session: Session, key: str) -> torch.Tensor:
    """Lease ``key`` as the peer socket does, read its tensor ``w`` through the descriptors (in a
    worker thread, as a client would map them) and release the lease; raises what an acquire
    raises (``ArtifactNotFound``, ``ArtifactDenied``, ...)."""
    grant = graph.leasing.grant_now(session, key)
    if grant is None:
        grant = await graph.leasing.grant(session, key)
    try:
        data = await asyncio.to_thread(read_all, grant.fds)
        return load(data)["w"]
    finally:
        graph.leasing.release(session, grant.lease_id)


async def keys(graph: ServiceGraph) -> set[str]:
    """The keys of the artifacts the store lists (validated, not denied)."""
    return {r.key for r in await graph.catalog.records()}


