"""Peer pull: a pull's payload bytes from the fleet's nodes that hold the artifact, over NIXL.

Called by ``hwr.daemon.fleet.pull.Puller`` in its step 5 (the documents, the plan, admission and
the staging are the object-store pull's, unchanged), when ``fleet_peer_fetch`` is on:

1. ``Holders.find``: the live holders of the key recorded in the remote. None: ``NOT_SERVED``,
   and the pull goes to the store as before.
2. Up to ``fleet_peer_max_sources`` holders are connected at once: membership proofs both ways
   (``peer_wire``), ``open`` the key (the peer's files must be the plan's names and sizes), and
   the peer's NIXL metadata loaded into this node's transfer process.
3. Chunks: every payload file is cut into ``units`` (its header, each tensor, any padding) and
   the units into chunks of at most ``peer_agent.CHUNK`` bytes that never straddle a unit
   boundary unless the units are whole (small tensors travel together). Each peer runs
   ``DEPTH`` workers that take the next chunk, ask the peer for a grant (when it caps its
   serving; else they report the chunk after), and have the transfer
   process READ it from the peer into the staging file; the chunk is then hashed through the
   file's ``DownloadSink.landed`` (the same in-order digests as an object-store pull). A peer
   that fails, or does not deliver a chunk within the chunk timeout, is dropped and its chunk
   goes back to the queue; chunks no live peer can take come from the store (a ranged copy of
   the object through the same sink).
4. Verification, per file, before anything is committed: the header must be the planned one
   byte for byte, every tensor's SHA-256 and the file's must be the manifest's. Every peer that
   served a chunk of a failing unit is dropped for this pull (counted as lying) and those units
   are fetched again from the other peers or the store, then the file is re-hashed from disk.
   After ``ROUNDS`` rounds a file that still fails ends the pull with ``ChecksumMismatch``.
   The commit then checks the tensor digests against the manifest once more (``pull.py`` step 6).

A lying or broken peer therefore costs the chunks it served, never a wrong byte installed.

The swarm: a node that pulls also serves (when ``fleet_peer_serve`` is on) what it has verified
so far. Before it looks for holders it records itself as a partial holder (``since``: when its
pull began) and registers a ``peer_tier.Partial``; each tensor is advertised once the in-order
digests (``InOrderDigests``'s ``on_tensor``) found its manifest SHA-256, the header once it is
the planned one byte for byte, a whole file once its SHA-256 checks (which covers padding).
Pullers that begin at the same moment form a chain through these records: each reads from the
latest partial holder that began before it (which reads from the one before, the first from the
full holders), asking it with ``have`` which ranges it may read, in file order. One holder's
link then carries one copy whatever K is, and the time grows by about one tensor's transfer per
link of the chain instead of K-fold. The holders are listed again every ``DISCOVER_EVERY``
seconds (pulls that start together may miss each other's first record). A partial source that
dies, stalls (no new verified range within the chunk timeout) or serves bytes that fail the
digests is dropped like a full one; the next source is the partial before it, then the full
holders, then the store. A partial source is trusted no more than a full one: its bytes are
verified here like any peer's. Reads from a partial source each take a ``grant`` and are
reported ``done``; when its pull ends it answers ``reopen``: this node stops reading it (not
counted as a failure; the next source takes over) and connects to it again, as a full holder,
once the listing shows its commit (a fresh connection and a fresh load of its NIXL metadata).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hwr.client.errors import ChecksumMismatch, HwrError
from hwr.daemon.fleet import peer_wire
from hwr.daemon.fleet.peer_agent import CHUNK
from hwr.daemon.fleet.peer_tier import AgentError, AgentGone, Holder, Partial, parse_address
from hwr.daemon.fleet.sink import DownloadSink, InOrderDigests
from hwr.daemon.store.staging import ProducerDigests

if TYPE_CHECKING:
    from hwr.daemon.fleet.peer_tier import Peers
    from hwr.daemon.fleet.progress import PullProgress
    from hwr.daemon.fleet.pull import RemotePlan
    from hwr.daemon.service.publishing import Publication

__all__ = ["DEPTH", "DISCOVER_EVERY", "NOT_SERVED", "ROUNDS", "PeerFill"]

log = logging.getLogger("hwrd.peers")

#: Chunks each peer has in flight at once (one waits for its grant while the other moves).
DEPTH = 4
#: Verification rounds per pull (the first transfer, then repairs of what failed).
ROUNDS = 3
#: Seconds between listings of the holders during a pull (new partial holders join the chain).
DISCOVER_EVERY = 1.0
#: Seconds between ``have`` questions to a partial source that has nothing new for this node.
HAVE_EVERY = 0.05
#: Partial holders that began before this node connected at once (the latest is the source).
PARTIAL_SOURCES = 2
#: The order of full holders: before every partial one.
FULL = (0.0, "")
NOT_SERVED = object()
StoreCopy = Callable[[str, Any], None]  # (file name, sink) -> the store's bytes of that object


class _Dropped(Exception):
    """A peer could not be used (connection, proofs, wrong files)."""


class _Reopen(Exception):
    """A partial source's pull ended: its staging is no longer read; open the key there again."""


@dataclass
class _PullFile:
    name: str
    path: str
    size: int
    head: bytes
    ranges: list[tuple[str, int, int]]  # (tensor, absolute start, absolute end)
    fd: int = -1
    sink: DownloadSink | None = None
    units: list[tuple[int, int, str]] = field(default_factory=list)  # (start, end, tensor | "" header | "~" gap)
    fresh: bool = True  # every byte landed once, in the sink's digests


@dataclass
class _Chunk:
    file: _PullFile
    start: int
    end: int
    source: str = ""  # the node that served it, "store" for the store


@dataclass(eq=False)
class _Peer:
    holder: Holder
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    agent: str
    addrs: dict[str, int]
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    alive: bool = True
    moved: int = 0
    capped: bool = True  # the peer caps its serving: a grant before every chunk
    order: tuple[float, str] = FULL  # (since, node) of a partial holder; FULL for a full one
    full: bool = True  # holds the whole artifact (a partial one turns full when it committed)
    staging: bool = False  # reads its staging: a grant before and ``done`` after every read
    retired: bool = False  # its pull ended: not read any more; a full record of it may be used anew
    reading: int = 0  # reads from it in flight in the transfer process
    have: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # verified ranges while partial
    asked_at: float = 0.0
    grew_at: float = field(default_factory=time.monotonic)

    def holds(self, chunk: _Chunk) -> bool:
        return self.full or any(s <= chunk.start and chunk.end <= e for s, e in self.have.get(chunk.file.name, ()))


def units_of(head_len: int, size: int, ranges: Sequence[tuple[str, int, int]]) -> list[tuple[int, int, str]]:
    """The file cut at the header's end and at every tensor's boundaries (gaps named ``~``)."""
    units = [(0, head_len, "")] if head_len else []
    at = head_len
    for name, start, end in sorted(ranges, key=lambda r: r[1]):
        if start > at:
            units.append((at, start, "~"))
        if end > start:
            units.append((start, end, name))
        at = max(at, end)
    if at < size:
        units.append((at, size, "~"))
    return units


def chunks_of(file: _PullFile, limit: int = CHUNK) -> list[_Chunk]:
    """Whole units packed up to ``limit`` bytes; a larger unit split in ``limit``-byte pieces."""
    out: list[_Chunk] = []
    start = end = 0
    for u_start, u_end, _name in file.units:
        if u_end - u_start > limit:
            if end > start:
                out.append(_Chunk(file, start, end))
            out.extend(_Chunk(file, s, min(s + limit, u_end)) for s in range(u_start, u_end, limit))
            start = end = u_end
        elif u_end - start > limit:
            out.append(_Chunk(file, start, end))
            start, end = u_start, u_end
        else:
            end = u_end
    if end > start:
        out.append(_Chunk(file, start, end))
    return out


class _RangeSink:
    """A ``PayloadSink`` over a whole store object that keeps only the ``wanted`` ranges."""

    def __init__(self, sink: DownloadSink, wanted: list[tuple[int, int]], moved: Callable[[int], None]) -> None:
        self.sink = sink
        self.size = sink.size
        self.written = 0
        self.wanted = wanted
        self.moved = moved

    def write(self, offset: int, data: bytes | memoryview) -> None:
        self.sink.check()
        n = len(data)
        self.written += n
        view = memoryview(data)
        for start, end in self.wanted:
            lo, hi = max(start, offset), min(end, offset + n)
            if lo < hi:
                self.sink.write(lo, bytes(view[lo - offset:hi - offset]))
                self.moved(hi - lo)

    def check(self) -> None:
        self.sink.check()


def _hash_from_disk(file: _PullFile) -> tuple[str, dict[str, str]] | None:
    digests = InOrderDigests(file.fd, file.size, file.ranges)
    offset = 0
    while offset < file.size:
        data = os.pread(file.fd, min(8 << 20, file.size - offset), offset)
        if not data:
            digests.close()
            return None
        digests.feed(offset, data)
        offset += len(data)
    return digests.finish()


class PeerFill:
    """One daemon's peer pulls (the module docstring gives the order)."""

    def __init__(self, peers: Peers) -> None:
        self.peers = peers
        self.max_sources = peers.config.fleet_peer_max_sources

    async def download(self, progress: PullProgress, plan: RemotePlan, pub: Publication,
                       store_copy: StoreCopy) -> ProducerDigests | object | None:
        """The verified digests of every file, or ``NOT_SERVED`` when no peer could serve."""
        key = progress.key
        files = self._files(pub)
        me = (time.time(), self.peers.node)
        partial = Partial({f.name: (f.path, f.size) for f in files}, me[0])
        served: ProducerDigests | object | None = NOT_SERVED
        try:
            await self.peers.begin_partial(key, partial)  # recorded before the holders are listed
            served = await self._download(progress, plan, files, partial, me, store_copy)
            return served
        finally:  # the commit refuses staging mapped elsewhere; a store pull that follows is not served
            await self.peers.release_partial(key, partial, failed=served is NOT_SERVED)

    def _eligible(self, holders: list[Holder], me: tuple[float, str]) -> list[Holder]:
        """The full holders (up to ``max_sources``), then the latest partial ones that began before ``me``."""
        full = [h for h in holders if not h.partial][:self.max_sources]
        before = sorted((h for h in holders if h.partial and (h.since, h.node) < me), key=lambda h: (h.since, h.node))
        return full + before[-PARTIAL_SOURCES:]

    async def _download(self, progress: PullProgress, plan: RemotePlan, files: list[_PullFile], partial: Partial,
                        me: tuple[float, str], store_copy: StoreCopy) -> ProducerDigests | object | None:
        key = progress.key
        try:
            holders = self._eligible(await asyncio.to_thread(self.peers.holders.find, key), me)
        except HwrError as exc:
            log.warning("peer pull of %s: holders unknown (%s); from the store", key[:16], exc.message)
            return NOT_SERVED
        if not holders:
            return NOT_SERVED
        sizes = dict(plan.files)
        connected = await asyncio.gather(*(self._connect(h, key, sizes) for h in holders), return_exceptions=True)
        peers = [p for p in connected if isinstance(p, _Peer)]
        for holder, result in zip(holders, connected, strict=False):
            if isinstance(result, BaseException):
                log.warning("peer pull of %s: %s (%s) not used: %s", key[:16], holder.node, holder.address, result)
        if not peers:
            return NOT_SERVED
        self.peers.counters.peer_pulls += 1
        state = {"key": key, "peers": [p.holder.node for p in peers], "done_bytes": 0,
                 "total_bytes": plan.size_bytes, "started_at": time.time(), "from_store_bytes": 0,
                 "verified_bytes": 0}
        self.peers.counters.active[key] = state
        tried: dict[str, _Peer | None] = {h.node: None for h in holders}
        for p in peers:
            tried[p.holder.node] = p

        async def discover(spawn: Callable[[_Peer], None]) -> None:
            while True:
                await asyncio.sleep(DISCOVER_EVERY)
                with contextlib.suppress(HwrError):
                    found = self._eligible(await asyncio.to_thread(self.peers.holders.find, key), me)
                    for h in found:
                        known = tried.get(h.node, False)
                        if known is not False and not (known is not None and known.retired and not h.partial):
                            continue  # connected already, or failed; a retired partial one comes back when full
                        tried[h.node] = None
                        try:
                            peer = await self._connect(h, key, sizes)
                        except Exception as exc:
                            log.warning("peer pull of %s: %s (%s) not used: %s", key[:16], h.node, h.address, exc)
                            continue
                        tried[h.node] = peer
                        peers.append(peer)
                        if h.node not in state["peers"]:
                            state["peers"].append(h.node)
                        spawn(peer)

        try:
            return await self._pull(progress, plan, files, peers, state, store_copy, partial, discover)
        finally:
            self.peers.counters.active.pop(key, None)
            for p in peers:
                p.writer.close()
            for f in files:
                if f.sink is not None:
                    f.sink.close()
                if f.fd >= 0:
                    os.close(f.fd)
                with contextlib.suppress(HwrError):
                    await self.peers.agent.request("close", path=f.path)

    def _files(self, pub: Publication) -> list[_PullFile]:
        staging = pub.staging
        heads = {p.name: p.head for p in staging.plans}
        entries = {p.name: p.entries for p in staging.plans}
        files = []
        for name, path, size in staging.files:
            head = heads[name]
            ranges = [(e.name, len(head) + e.begin, len(head) + e.end) for e in entries[name]]
            f = _PullFile(name, str(path), size, head, ranges)
            f.units = units_of(len(head), size, ranges)
            files.append(f)
        return files

    async def _pull(self, progress: PullProgress, plan: RemotePlan, files: list[_PullFile], peers: list[_Peer],
                    state: dict[str, Any], store_copy: StoreCopy, partial: Partial,
                    discover: Callable[[Callable[[_Peer], None]], Any]) -> ProducerDigests:
        expected_tensors = {t.name: t.sha256 for t in plan.manifest.tensors}
        expected_files = {f.name: f.sha256 for f in plan.manifest.files}

        def moved(n: int) -> None:
            state["done_bytes"] += n

        def advertiser(f: _PullFile) -> Callable[[str, str], None]:
            spans = {name: (start, end) for start, end, name in f.units if name not in ("", "~")}

            def verified(name: str, digest: str) -> None:  # on the hashing thread
                if name in spans and digest == expected_tensors.get(name):
                    partial.add(f.name, *spans[name])
                    state["verified_bytes"] = partial.verified_bytes()
            return verified

        for f in files:
            f.fd = os.open(f.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            f.sink = DownloadSink(f.fd, f.size, f.ranges, progress=lambda n: (progress.add(n), moved(n)),
                                  check=progress.check, on_tensor=advertiser(f))
        queue = collections.deque(c for f in files for c in chunks_of(f))
        chunks = list(queue)
        result_files: dict[str, str] = {}
        result_tensors: dict[str, str] = {}
        for round_no in range(ROUNDS):
            await self._transfer(queue, peers, state, store_copy, partial, discover)
            bad_chunks: list[_Chunk] = []
            for f in files:
                if f.name in result_files:
                    continue
                digests = await asyncio.to_thread(self._digests, f)
                bad = self._bad_units(f, digests, expected_tensors, expected_files)
                if not bad:
                    assert digests is not None
                    result_files[f.name] = digests[0]
                    result_tensors.update(digests[1])
                    partial.add(f.name, 0, f.size)  # every byte checked, the padding too
                    continue
                for c in chunks:
                    if c.file is f and any(c.start < e and s < c.end for s, e, _n in bad):
                        bad_chunks.append(c)
            if not bad_chunks:
                return ProducerDigests(result_files, result_tensors)
            liars = {c.source for c in bad_chunks}
            log.warning("peer pull of %s: %d chunks fail verification (%s)", progress.key[:16], len(bad_chunks),
                        ", ".join(f"{c.file.name}[{c.start}:{c.end}] from {c.source}" for c in bad_chunks[:8]))
            for p in peers:
                if p.alive and p.holder.node in liars:
                    p.alive = False
                    self.peers.counters.lying_peers += 1
                    log.error("peer pull of %s: %s (%s) served bytes that fail the manifest's digests; dropped "
                              "for this pull", progress.key[:16], p.holder.node, p.holder.address)
            if "store" in liars and round_no == ROUNDS - 1:
                break
            for c in bad_chunks:
                c.source = ""
                c.file.fresh = False
                partial.withdraw(c.file.name)  # not served while the repair rewrites it
            queue.extend(bad_chunks)
        raise ChecksumMismatch(f"peer pull of {progress.key[:16]}: bytes still fail the manifest after {ROUNDS} "
                               "rounds (peers and the store)", details={"key": progress.key})

    @staticmethod
    def _digests(f: _PullFile) -> tuple[str, dict[str, str]] | None:
        assert f.sink is not None
        if f.fresh:
            f.fresh = False
            digests = f.sink.finish()
            if digests is not None:
                return digests
        return _hash_from_disk(f)

    @staticmethod
    def _bad_units(f: _PullFile, digests: tuple[str, dict[str, str]] | None, tensors: dict[str, str],
                   files: dict[str, str]) -> list[tuple[int, int, str]]:
        if digests is None:
            return list(f.units)
        bad = [u for u in f.units if u[2] not in ("", "~") and digests[1].get(u[2]) != tensors.get(u[2])]
        if f.head and os.pread(f.fd, len(f.head), 0) != f.head:
            bad += [u for u in f.units if u[2] == ""]
        if not bad and digests[0] != files.get(f.name):
            bad = [u for u in f.units if u[2] == "~"] or list(f.units)
        return bad

    async def _transfer(self, queue: collections.deque[_Chunk], peers: list[_Peer], state: dict[str, Any],
                        store_copy: StoreCopy, partial: Partial,
                        discover: Callable[[Callable[[_Peer], None]], Any]) -> None:
        loop = asyncio.get_running_loop()
        workers: set[asyncio.Task[None]] = set()

        def spawn(peer: _Peer) -> None:
            if queue:
                workers.update(loop.create_task(self._worker(peer, peers, queue, state, partial))
                               for _ in range(DEPTH))

        for p in peers:
            if p.alive:
                spawn(p)
        finder = loop.create_task(discover(spawn))
        try:
            while workers:
                done, _ = await asyncio.wait(set(workers), return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    workers.discard(task)
                    task.result()  # the pull's own error (stopped, a refused chunk): raised here
        finally:  # on any error no worker outlives this pull's staging
            finder.cancel()
            for task in workers:
                task.cancel()
            await asyncio.gather(finder, *workers, return_exceptions=True)
        if queue:
            await self._from_store(list(queue), state, store_copy)
            queue.clear()

    @staticmethod
    def _sources(peers: list[_Peer]) -> list[_Peer]:
        """Whom this node reads from now: the latest live partial holder that began before it
        (the chain), else every live full holder."""
        alive = [p for p in peers if p.alive]
        if not alive:
            return []
        top = max(alive, key=lambda p: p.order)
        return [p for p in alive if p.order == FULL] if top.order == FULL else [top]

    @staticmethod
    def _take(peer: _Peer, queue: collections.deque[_Chunk]) -> _Chunk | None:
        """The first queued chunk ``peer`` holds verified (file order: it verifies in order too)."""
        if peer.full:
            return queue.popleft()
        for i, chunk in enumerate(queue):
            if peer.holds(chunk):
                del queue[i]
                return chunk
        return None

    async def _ask_have(self, peer: _Peer, key: str) -> None:
        """Refresh a partial source's verified ranges (one question per ``HAVE_EVERY``): retired
        when its pull ended (``reopen``), ``_Dropped`` when it stalled (nothing new verified within
        the chunk timeout)."""
        now = time.monotonic()
        if now - peer.asked_at < HAVE_EVERY or peer.lock.locked():
            await asyncio.sleep(HAVE_EVERY)
            return
        peer.asked_at = now
        async with asyncio.timeout(self.peers.chunk_timeout), peer.lock:
            await peer_wire.write_frame(peer.writer, {"have": key})
            reply = await peer_wire.read_frame(peer.reader)
        if "error" in reply or reply.get("reopen"):
            self._retire(peer)
            return
        before = sum(e - s for have in peer.have.values() for s, e in have)
        peer.have = {str(name): [(int(s), int(e)) for s, e in have] for name, have in dict(reply["have"]).items()}
        if sum(e - s for have in peer.have.values() for s, e in have) > before:
            peer.grew_at = now
        elif now - peer.grew_at > self.peers.chunk_timeout:
            raise _Dropped(f"it verified nothing new in {self.peers.chunk_timeout:.0f} s")

    def _retire(self, peer: _Peer) -> None:
        """A partial source's pull ended: it is not read any more (nor counted as failed); the
        listing brings it back as a full holder once its record says it committed."""
        if peer.alive:
            peer.alive = False
            peer.retired = True
            if not peer.reading:  # else the last read in flight forgets it (no metadata removed under a read)
                self._forget_agent(peer.agent)
            log.info("peer pull: %s (%s) finished its own pull; its staging is no longer read",
                     peer.holder.node, peer.holder.address)

    async def _worker(self, peer: _Peer, peers: list[_Peer], queue: collections.deque[_Chunk],
                      state: dict[str, Any], partial: Partial) -> None:
        agent = self.peers.agent
        while peer.alive and queue:
            sources = self._sources(peers)
            if peer not in sources:
                if not sources:
                    return  # nobody left: the store serves the rest
                await asyncio.sleep(HAVE_EVERY)  # the source may be dropped: then this peer's turn
                continue
            chunk = self._take(peer, queue)
            if chunk is None:
                try:
                    await self._ask_have(peer, state["key"])
                except (AgentError, TimeoutError, ConnectionError, asyncio.IncompleteReadError, peer_wire.FrameError,
                        _Dropped, KeyError, TypeError, ValueError) as exc:
                    self._drop(peer, exc)
                    return
                continue
            n = chunk.end - chunk.start
            try:
                async with asyncio.timeout(self.peers.chunk_timeout):
                    staging = peer.staging
                    if peer.capped or staging:
                        async with peer.lock:  # one request-reply at a time on the control connection
                            await peer_wire.write_frame(peer.writer, {"grant": n})
                            reply = await peer_wire.read_frame(peer.reader)
                        if reply.get("reopen") and staging:
                            raise _Reopen
                        if reply.get("granted") != n:
                            raise _Dropped(f"grant refused: {reply}")
                    peer.reading += 1
                    try:
                        await agent.request("read", agent=peer.agent, addr=peer.addrs[chunk.file.name] + chunk.start,
                                            length=n, path=chunk.file.path, offset=chunk.start)
                    finally:
                        peer.reading -= 1
                        if peer.retired and not peer.reading:
                            self._forget_agent(peer.agent)
                        if staging:  # the staging read ended, however: the peer may unmap
                            async with peer.lock:
                                await peer_wire.write_frame(peer.writer, {"done": n})
                    if not peer.capped and not staging:
                        async with peer.lock:
                            await peer_wire.write_frame(peer.writer, {"served": n})
            except _Reopen:
                queue.appendleft(chunk)
                self._retire(peer)
                return
            except (AgentError, TimeoutError, ConnectionError, asyncio.IncompleteReadError, peer_wire.FrameError,
                    _Dropped) as exc:
                queue.appendleft(chunk)
                self._drop(peer, exc)
                return
            f = chunk.file
            assert f.sink is not None
            await asyncio.to_thread(f.sink.landed, chunk.start, n)
            chunk.source = peer.holder.node
            peer.moved += n
            self.peers.counters.fetched_bytes += n
            if peer.order != FULL:
                self.peers.counters.partial_fetched_bytes += n
            if chunk.start == 0 and f.head and chunk.end >= len(f.head) and \
                    os.pread(f.fd, len(f.head), 0) == f.head:
                partial.add(f.name, 0, len(f.head))  # the planned header, byte for byte

    def _drop(self, peer: _Peer, exc: BaseException) -> None:
        if peer.alive:
            peer.alive = False
            if not isinstance(exc, AgentGone):  # this node's transfer process died: not the peer's fault
                self.peers.counters.failed_peers += 1
            self._forget_agent(peer.agent)
            log.warning("peer pull: %s (%s) dropped: %s", peer.holder.node, peer.holder.address,
                        exc or type(exc).__name__)

    async def _from_store(self, chunks: list[_Chunk], state: dict[str, Any], store_copy: StoreCopy) -> None:
        by_file: dict[str, list[_Chunk]] = {}
        for c in chunks:
            by_file.setdefault(c.file.name, []).append(c)

        def moved(n: int) -> None:
            self.peers.counters.fallback_bytes += n
            state["from_store_bytes"] += n

        for name, group in by_file.items():
            f = group[0].file
            assert f.sink is not None
            wanted = sorted((c.start, c.end) for c in group)
            log.info("peer pull: %d bytes of %s from the store", sum(e - s for s, e in wanted), name)
            await asyncio.to_thread(store_copy, name, _RangeSink(f.sink, wanted, moved))
            for c in group:
                c.source = "store"

    def _forget_agent(self, agent: str) -> None:
        task = asyncio.get_running_loop().create_task(self.peers.agent.request("disconnect", agent=agent))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _connect(self, holder: Holder, key: str, sizes: dict[str, int]) -> _Peer:
        host, port = parse_address(holder.address, "holder address")
        timeout = self.peers.connect_timeout
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=peer_wire.MAX_FRAME + 8),
                                                timeout)
        try:
            async with asyncio.timeout(timeout):
                hello = await peer_wire.read_frame(reader)
                challenge = str(hello.get("challenge", ""))
                nonce = secrets.token_hex(16)
                secret = self.peers.secret
                await peer_wire.write_frame(writer, {"node": self.peers.node, "nonce": nonce,
                                                     "proof": peer_wire.ask_proof(secret, challenge, nonce,
                                                                                  self.peers.node)})
                proof = await peer_wire.read_frame(reader)
                if "error" in proof:
                    raise _Dropped(f"it refused this node: {proof['error']}")
                if len(challenge) < 32 or not peer_wire.same(proof.get("proof"),
                                                             peer_wire.serve_proof(secret, challenge, nonce)):
                    raise _Dropped("it is not a member of this fleet (its proof does not check)")
                await peer_wire.write_frame(writer, {"open": key})
                opened = await peer_wire.read_frame(reader)
            if "error" in opened:
                raise _Dropped(f"it does not serve the key: {opened['error']}")
            files = {str(f["name"]): (int(f["size"]), int(f["addr"])) for f in opened["files"]}
            if {n: s for n, (s, _a) in files.items()} != sizes:
                raise _Dropped("its files are not the manifest's")
            # Loaded every time: a peer's metadata grows with each file it exposes (a reload updates it).
            agent = str((await self.peers.agent.request("connect", metadata=opened["metadata"]))["agent"])
            peer = _Peer(holder, reader, writer, agent, {n: a for n, (_s, a) in files.items()},
                         capped=opened.get("cap", 1) != 0, full=not opened.get("partial", False),
                         order=(holder.since, holder.node) if holder.partial else FULL)
            if not peer.full:
                peer.staging = True
                peer.have = {str(name): [(int(s), int(e)) for s, e in have]
                             for name, have in dict(opened.get("have", {})).items()}
            return peer
        except BaseException:
            writer.close()
            raise
