"""The node service built in-process, as hwrd builds it, for the use-case tests in tests/service.

``service(root, **config)`` builds ``hwr.daemon.app.graph.ServiceGraph`` over a real store at
``root`` (config keys override hwrd's defaults, as its TOML would) and closes it after; the other
helpers do what a client does through a transport, directly against the graph: open a session,
publish an artifact through begin / staging descriptors / commit, read leased descriptors, poll for
an event on the loop (``until``), and run the graph's background tasks (``running``: housekeeping,
scrub, ...) on the test's loop as hwrd does.
No daemon process, no transport: those are tested against a real hwrd in tests/e2e and tests/daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import torch

from hwr.client.identity import ArtifactIdentity
from hwr.daemon.app.graph import ServiceGraph
from hwr.daemon.service.sessions import Session
from hwr.daemon.service.settings import RunningSettings
from hwr.daemon.store.root import Store
from hwr.daemon.store.staging import StagedTensor
from hwr.daemon.system.config import load_config
from hwr.daemon.system.peercred import PeerCred


@contextlib.asynccontextmanager
async def service(root: Path, **config: Any) -> AsyncIterator[ServiceGraph]:
    """The node service over a store at ``root``, built as hwrd builds it, closed after."""
    base = load_config(env={"HWR_ROOT": str(root), "HWR_SOCKET": str(root.parent / "hwrd.sock")})
    settings = RunningSettings(msgspec.structs.replace(base, **config))
    with Store.open(root) as store:
        graph = ServiceGraph.build(settings, store)
        try:
            yield graph
        finally:
            await graph.close()


def session_of(graph: ServiceGraph) -> Session:
    return graph.registry.open_session(PeerCred(pid=os.getpid(), uid=os.getuid(), gid=os.getgid()))


async def publish(graph: ServiceGraph, session: Session, name: str, fill: int = 1, elements: int = 256) -> str:
    """One artifact published as a client does it: begin, write the staging descriptors, commit."""
    begun = await graph.publications.begin(session, ArtifactIdentity.simple(name),
                                           [StagedTensor("w", torch.float32, (elements,))], wait_timeout=5)
    pub = begun.publication
    assert begun.outcome == "staged" and pub is not None
    fds = graph.publications.staging_descriptors(session, pub.publication_id, pub.token)
    try:
        _file, offset, nbytes = pub.staging.placements["w"]
        os.pwrite(fds[0], bytes([fill]) * nbytes, offset)
    finally:
        for fd in fds:
            os.close(fd)
    record, _ = await graph.publications.commit(session, pub.publication_id, {})
    return record.key


def read_all(fds: list[int]) -> bytes:
    try:
        return b"".join(os.pread(fd, os.fstat(fd).st_size, 0) for fd in fds)
    finally:
        for fd in fds:
            os.close(fd)


async def until(condition: Callable[[], bool], timeout: float) -> None:
    """Poll ``condition`` on the loop (other tasks run meanwhile) until it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


@contextlib.asynccontextmanager
async def running(graph: ServiceGraph) -> AsyncIterator[None]:
    """The graph's own background tasks, running on this loop as hwrd runs them; cancelled after."""
    tasks = [asyncio.ensure_future(work) for work in graph.background()]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
