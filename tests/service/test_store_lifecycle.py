"""An artifact's life in the store, in-process: LRU eviction that never touches a leased, pinned
or mapped artifact (even one whose mapping process's session ended), concurrent publications
under a store limit, the stalled publisher's deadline, verification and quarantine.

Each test builds the node service as hwrd does (``tests/service_graph.py``) over a real store and
drives it as the transports do (``store_steps``); the mapping is a real child process that maps
a lease's descriptors, found by the /proc scan as a daemon running as root finds it. What needs a
daemon process stays in tests/e2e: restarts and lease reattachment, the journal across a
SIGKILL, hwrctl (tests/e2e/test_store_lifecycle.py), and a daemon that is not root, which cannot
read other uids' maps and proves "nobody maps it" with a write-lease probe instead
(tests/e2e/test_unprivileged_eviction.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from e2e.helpers import rot_a_byte
from service_graph import run, running, service, session_of, until
from store_steps import acquire, begin_floats, keys, publish_floats

from hwr.client.errors import ActiveLease, ArtifactDenied, HwrError, StoreLimitExceeded
from hwr.daemon.app.graph import ServiceGraph
from hwr.daemon.service.sessions import Session

pytestmark = pytest.mark.timeout(120)

ELEMENTS = 1 << 18  # one 256Ki-float32 tensor
ART = ELEMENTS * 4 + 136  # plus its safetensors header, as the store lays it out
CLIENT_WAIT_S = 600.0  # a client's default publication wait (hwr.client.Client.publish)

# A client process that mapped a lease's payloads and keeps them mapped (its session is gone).
MAPPER = """
import mmap, os, sys
maps = [mmap.mmap(int(fd), 0, prot=mmap.PROT_READ) for fd in sys.argv[1:]]
for fd in sys.argv[1:]:
    os.close(int(fd))
print("ready", flush=True)
sys.stdin.read()
"""


async def _publish(graph: ServiceGraph, session: Session, name: str, seed: int) -> str:
    key = await publish_floats(graph, session, name, ELEMENTS, float(seed), wait_timeout=CLIENT_WAIT_S)
    await asyncio.sleep(0.02)  # distinct LRU timestamps
    return key


def test_eviction_is_lru_and_spares_leased_pinned_and_mapped(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with service(tmp_path / "root", store_limit_bytes=4 * ART) as graph:
            session = session_of(graph)
            mapped, leased, pinned, old = [await _publish(graph, session, n, i) for i, n in
                                           enumerate(["mapped", "leased", "pinned", "old"])]
            mapper_session = session_of(graph)
            grant = await graph.leasing.grant(mapper_session, mapped)
            mapper = subprocess.Popen([sys.executable, "-c", MAPPER, *map(str, grant.fds)], pass_fds=grant.fds,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for fd in grant.fds:
                os.close(fd)
            try:
                assert mapper.stdout is not None and mapper.stdout.readline().strip() == "ready"
                graph.leasing.end_session(mapper_session)  # its connection closed; the mapping stays
                assert graph.registry.leases() == []  # the mapper's session is gone: only its mapping remains
                lease = await graph.leasing.grant(session, leased, descriptors=False)
                await graph.pinning.pin(pinned)
                await acquire(graph, session, old)  # touch "old" after the others: it becomes the most recent
                # The store is full: the next publication must evict exactly one unused artifact.
                # LRU order is mapped < leased < pinned < old, and the first three are in use.
                newer = await _publish(graph, session, "newer", 9)
                assert await keys(graph) == {mapped, leased, pinned, newer}
                with pytest.raises(ActiveLease) as refused:
                    await graph.capacity.evict(mapped)
                assert refused.value.details["reason"] == "mapped"
                assert str(mapper.pid) in refused.value.details["pids"]
                with pytest.raises(ActiveLease, match="leased"):
                    await graph.capacity.evict(leased)
                with pytest.raises(ActiveLease, match="pinned"):
                    await graph.capacity.evict(pinned)
                report, _after, _target, _staging = await graph.capacity.collect_garbage(0)
                assert report.evicted == [newer]
                assert {reason for _key, reason in report.skipped} == {"mapped", "leased", "pinned"}
                # Nothing evictable left: a publication that needs room gets a typed error.
                with pytest.raises(StoreLimitExceeded):
                    await publish_floats(graph, session, "x", 4 << 18, 0.0, wait_timeout=CLIENT_WAIT_S)
                with pytest.raises(StoreLimitExceeded):
                    await publish_floats(graph, session, "too-big", 5 << 18, 0.0, wait_timeout=CLIENT_WAIT_S)
            finally:
                mapper.kill()
                mapper.wait()
            assert await graph.capacity.evict(mapped) == ART  # the mapping is gone with its process
            graph.leasing.release(session, lease.lease_id)

    run(scenario)


def test_concurrent_publications_never_exceed_the_store_limit(tmp_path: Path) -> None:
    root = tmp_path / "root"
    limit = 3 * ART
    peak = [0]
    stop = threading.Event()

    def listing() -> tuple[list[str], list[str]]:
        return sorted(os.listdir(root / "artifacts")), sorted(os.listdir(root / "tmp"))

    def watch() -> None:
        # What is really on disk: committed payloads plus preallocated staging payloads. A sample
        # counts only when the directory listings did not change while it was taken (a walk is
        # not atomic: it could see an evicted artifact and the staging that replaced it).
        while not stop.is_set():
            before = listing()
            total = 0
            for sub in ("artifacts", "tmp"):
                for dirpath, _dirs, files in os.walk(root / sub):
                    for name in files:
                        if name.endswith(".safetensors") and ".removed." not in dirpath:
                            with contextlib.suppress(FileNotFoundError):
                                total += os.lstat(os.path.join(dirpath, name)).st_size
            if listing() == before:
                peak[0] = max(peak[0], total)

    async def scenario() -> None:
        errors: list[BaseException] = []
        published: list[str] = []
        async with service(root, store_limit_bytes=limit) as graph:

            async def publisher(n: int) -> None:
                session = session_of(graph)
                for i in range(4):
                    try:
                        published.append(await _publish(graph, session, f"c{n}-{i}", n * 10 + i))
                    except Exception as exc:  # collected and asserted below
                        errors.append(exc)

            watcher = threading.Thread(target=watch)
            watcher.start()
            try:
                await asyncio.gather(*(publisher(n) for n in range(6)))
            finally:
                stop.set()
                watcher.join()
            # Several reservations at once may fill the limit: the others are refused, typed, never overshoot.
            assert all(isinstance(e, StoreLimitExceeded) for e in errors), errors
            assert len(published) >= 6
            usage = await graph.capacity.usage()
            assert usage.committed_bytes <= limit and usage.reserved_bytes == 0
            assert graph.capacity.evictor.evictions >= len(published) - 3
            assert peak[0] <= limit
            assert os.listdir(root / "tmp") == []

    run(scenario)


def test_stalled_publisher_is_cancelled_at_its_deadline(tmp_path: Path) -> None:
    root = tmp_path / "root"

    async def scenario() -> None:
        async with service(root, publication_deadline_s=1.0, housekeeping_interval_s=0.2) as graph, running(graph):
            session = session_of(graph)
            pub = await begin_floats(graph, session, "stalled-model", 1024)
            fds = graph.publications.staging_descriptors(session, pub.publication_id, pub.token)
            try:  # the writer holds its staging descriptors and never writes
                await until(lambda: not graph.publications.active(), 15)
                assert graph.publications.active() == []
                assert (await graph.capacity.usage()).reserved_bytes == 0
                assert os.listdir(root / "tmp") == []
                # The writer wakes up: its write lands nowhere, its commit is refused, typed.
                os.pwrite(fds[0], bytes(4096), 0)
                with pytest.raises(HwrError) as refused:
                    await graph.publications.commit(session, pub.publication_id, {})
                assert refused.value.code == "PUBLICATION_FAILED"
            finally:
                for fd in fds:
                    os.close(fd)

    run(scenario)


def test_verify_catches_a_flipped_byte_and_stops_handing_it_out(tmp_path: Path) -> None:
    root = tmp_path / "root"

    async def scenario() -> None:
        async with service(root) as graph:
            key = await _publish(graph, session_of(graph), "victim", 3)
            seen: list[tuple[int, int]] = []
            record = await graph.catalog.verify(await graph.catalog.resolve(key[:8]), lambda d, t: seen.append((d, t)))
            assert record.key == key and seen and seen[-1][0] == seen[-1][1]
        # Bit rot: one byte flips on disk, sizes and timestamps stay (metadata checks cannot see it).
        rot_a_byte(root / "artifacts" / key / "model-00001.safetensors", 4096)
        async with service(root) as graph:
            session = session_of(graph)
            lease = await graph.leasing.grant(session, key, descriptors=False)  # metadata still validates
            with pytest.raises(HwrError) as verdict:
                await graph.catalog.verify(key)
            assert verdict.value.code == "CHECKSUM_MISMATCH"
            assert [x.lease_id for x in graph.registry.leases() if x.key == key] == [lease.lease_id]
            with pytest.raises(ArtifactDenied):
                await graph.leasing.grant(session, key)
            assert any(e.startswith(key) for e in os.listdir(root / "quarantine"))
            assert not (root / "artifacts" / key).exists()
            graph.leasing.release(session, lease.lease_id)

    run(scenario)
