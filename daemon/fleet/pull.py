"""Pull on miss: fetch a key from the remote into staging, verify it, commit it like a publication.

Order for one key (one fetch at a time per key; every concurrent caller awaits the same task)::

    1. refuse a locally denied key (deny markers never leave or enter through the remote)
    2. GET READY.json (absent: a plain miss) and parse it strictly
    3. GET manifest.json; its SHA-256 must be the one READY.json names (a swapped manifest is
       refused), it must parse strictly and its identity must hash to the key asked for
    4. re-plan the payload layout from the manifest's tensors: it must give exactly the files
       (names, sizes) the manifest lists, i.e. a layout this daemon itself writes (one file, or
       the several files of a publication hashed while written: ``staging.overlap_file_bytes``)
    5. ``Publishing.begin`` (one publisher per identity, admission, capacity reservation and
       LRU eviction exactly as for a client publication; a local publisher of the same key is
       joined instead), then each payload goes from the backend into a ``DownloadSink``
       (``hwr.daemon.fleet.sink``): written into its staging file, sizes checked before and
       during the transfer, and hashed in the same pass (file and tensor SHA-256s). With the
       peer tier fetching (``hwr.daemon.fleet.peer_fill``), the payloads come from the fleet's
       nodes that hold the key first, through the same sinks and digests, and each file is
       verified against the manifest before this step ends (a peer's bad range is fetched again
       from others or the remote); the remote serves what no peer does
    6. ``Publishing.commit_publication`` with the manifest's tensor digests as the expected
       ones and the digests computed in step 5 (``ProducerDigests``: this daemon's own code
       hashed the bytes it wrote, so the store does not re-read them): the store re-reads the
       headers (they must be the planned ones), compares every tensor digest with the
       manifest's and fsyncs; any difference fails the commit and removes the staging. When
       step 5 could not hash in order (a misbehaving server), the store hashes the staging from
       disk as for any publication.

A daemon killed at any step leaves only ``tmp/`` staging, which the next start wipes: nothing is
committed that was not verified. The remote is never trusted: every refusal is a typed error
(``RemoteObjectInvalid``, a ``ManifestCorrupt``; ``ChecksumMismatch``) carrying
``details["remote"]``, and is remembered for ``INVALID_TTL_S`` so a storm of acquires does not
re-download a bad artifact. An unreachable remote is ``RemoteUnavailable`` (a miss that names the
remote), remembered for ``DOWN_TTL_S``; a key the remote does not have is remembered for
``MISS_TTL_S`` (repeated acquires of an absent key cost one remote request per key and TTL).

Stalls: a pull is bounded by ``stall_timeout`` (config ``remote_stall_timeout_s``), never by a
total time: in the remote's phases (``hwr.daemon.fleet.progress.REMOTE_PHASES``), no byte for
that long stops the pull (every transfer thread raises at its next piece), aborts its staging
and fails every waiter with ``RemoteUnavailable`` (``details["reason"] = "STALLED"``, naming the
remote). Acquirers wait for a pull as long as it advances (``hwr.daemon.fleet.tier``).

Limits: a thread blocked inside a remote read (a hung filesystem, a socket before the S3
client's read timeout) stays blocked after its pull was stopped; the pull's waiters are answered
at once and the thread ends when the read returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hwr.client.errors import (
    ArtifactDenied,
    ArtifactNotFound,
    ChecksumMismatch,
    HwrError,
    ManifestCorrupt,
    RemoteUnavailable,
)
from hwr.client.manifest import MANIFEST_FILE, READY_FILE, Manifest, ReadyMarker
from hwr.daemon.fleet.progress import PullProgress
from hwr.daemon.fleet.remote import PayloadSink, RemoteObjectInvalid, RemoteStore
from hwr.daemon.fleet.sink import DownloadSink
from hwr.daemon.store.staging import ProducerDigests, StagedTensor, overlap_file_bytes, plan_payloads

if TYPE_CHECKING:
    from hwr.daemon.fleet.peer_fill import PeerFill
    from hwr.daemon.service.catalog import ArtifactRecord, Catalog
    from hwr.daemon.service.publishing import Publication, Publishing

__all__ = ["PullProgress", "Puller", "RemotePlan", "plan_from_documents"]

log = logging.getLogger("hwrd.remote")


@dataclass(frozen=True)
class RemotePlan:
    """What step 4 accepted: the manifest, the specs that re-plan its layout, the files to fetch."""

    manifest: Manifest
    specs: tuple[StagedTensor, ...]
    files: tuple[tuple[str, int], ...]  # (name, size) in the manifest's order
    format_metadata: dict[str, Any]
    overlap: bool = False  # laid out in several files (``staging.overlap_file_bytes``)

    @property
    def size_bytes(self) -> int:
        return sum(size for _, size in self.files)


def plan_from_documents(key: str, ready: bytes, manifest_bytes: bytes | None, remote: str) -> RemotePlan:
    """Steps 2-4 as a pure function of the two documents; ``RemoteObjectInvalid`` when refused."""
    details = {"key": key, "remote": remote}

    def refuse(why: str) -> RemoteObjectInvalid:
        return RemoteObjectInvalid(f"remote {remote}: artifact {key[:16]} refused: {why}", details=details)

    try:
        marker = ReadyMarker.from_json(ready)
    except ManifestCorrupt as exc:
        raise refuse(f"READY.json is invalid ({exc.message})") from None
    if manifest_bytes is None:
        raise refuse("manifest.json is missing")
    if hashlib.sha256(manifest_bytes).hexdigest() != marker.manifest_sha256:
        raise refuse("manifest.json is not the one READY.json names")
    try:
        manifest = Manifest.from_json(manifest_bytes)
    except ManifestCorrupt as exc:
        raise refuse(f"manifest.json is invalid ({exc.message})") from None
    if manifest.key != key:
        raise refuse(f"its manifest names another identity ({manifest.key[:16]})")
    if manifest.artifact_content_sha256 != marker.artifact_content_sha256:
        raise refuse("READY.json and manifest.json disagree on the content digest")
    specs = tuple(StagedTensor(t.name, t.dtype, tuple(t.shape), kind=t.kind, role=t.role)  # type: ignore[arg-type]
                  for t in manifest.tensors)
    total = sum(t.nbytes for t in manifest.tensors)
    for overlap in (False, True):
        try:
            plans = plan_payloads(list(specs), overlap_file_bytes(total) if overlap else None)
        except HwrError as exc:
            raise refuse(f"its tensors cannot be laid out ({exc.message})") from None
        where = {e.name: p.name for p in plans for e in p.entries}
        if [(p.name, p.size) for p in plans] == [(f.name, f.size) for f in manifest.files] and all(
                where.get(t.name) == t.file and t.storage_key == t.name for t in manifest.tensors):
            break
    else:
        raise refuse("its file layout is not one hwrd writes")
    metadata = json.loads(manifest.format_metadata)
    return RemotePlan(manifest, specs, tuple((f.name, f.size) for f in manifest.files), metadata, overlap)


class Puller:
    """Pull on miss for one daemon. ``pull`` and ``start`` are called on the event loop."""

    INVALID_TTL_S = 30.0
    DOWN_TTL_S = 2.0
    MISS_TTL_S = 5.0
    #: Remembered misses and refusals are dropped whole past this many keys.
    MEMORY_KEYS = 4096

    def __init__(self, remote: RemoteStore, catalog: Catalog, publications: Publishing, *, wait_timeout: float,
                 stall_timeout: float = 60.0, on_outcome: Callable[[str, int], None] | None = None) -> None:
        self.remote = remote
        self.catalog = catalog  # the read API: the deny state, a record present already
        self.publications = publications
        self.wait_timeout = wait_timeout
        self.stall_timeout = stall_timeout
        self.on_outcome = on_outcome  # (outcome word, bytes pulled) for the metrics
        self.in_flight: dict[str, PullProgress] = {}
        self.committing: set[str] = set()  # keys a pull commits now (the pusher skips them)
        self.peer_fill: PeerFill | None = None  # set by the fleet when the peer tier fetches
        self._refused: dict[str, tuple[float, HwrError]] = {}
        self._missing: dict[str, float] = {}  # key -> when the remote last said it has no such key
        self._down_until = 0.0
        self._down_error: HwrError | None = None
        # Remote I/O off the loop and off its default executor (which acquires' lookups use).
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="hwr-pull")

    def close(self) -> None:
        for progress in self.in_flight.values():
            progress.stop(RemoteUnavailable(f"remote {self.remote.location.display}: hwrd is stopping",
                                            details={"remote": self.remote.location.display}))
            if progress.task is not None:
                progress.task.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def forget_miss(self, key: str) -> None:
        """The remote has ``key`` now (this node pushed it): the next acquire asks again."""
        self._missing.pop(key, None)

    async def pull(self, key: str, *, fresh: bool = False) -> tuple[ArtifactRecord, str]:
        """The committed record and ``"pulled"`` or ``"already_present"``; a typed error otherwise
        (``ArtifactNotFound`` when the remote does not have it). ``fresh`` skips the remembered
        refusals and misses (an operator's ``hwrctl pull`` retries for real)."""
        progress = await self.start(key, fresh=fresh)
        return await self.join(progress)

    @staticmethod
    async def join(progress: PullProgress) -> tuple[ArtifactRecord, str]:
        """Wait for ``progress``'s pull. Shielded: a waiter that gives up (its connection closed)
        must not cancel the pull the others wait for."""
        assert progress.task is not None
        return await asyncio.shield(progress.task)

    async def start(self, key: str, *, fresh: bool = False) -> PullProgress:
        """The pull of ``key`` in flight, started if none is (for callers that watch progress)."""
        current = self.in_flight.get(key)
        if current is not None:
            return current
        now = time.monotonic()
        remote = self.remote.location.display
        if not fresh:
            refused = self._refused.get(key)
            if refused is not None and now - refused[0] < self.INVALID_TTL_S:
                raise type(refused[1])(refused[1].message, details=refused[1].details)
            if self._down_error is not None and now < self._down_until:
                # the same type: a remote that refused the credentials stays REMOTE_DENIED
                raise type(self._down_error)(self._down_error.message, details=self._down_error.details)
            missing = self._missing.get(key)
            if missing is not None and now - missing < self.MISS_TTL_S:
                raise _absent(key, remote)
        progress = PullProgress(key, remote)
        progress.task = asyncio.get_running_loop().create_task(self._run(progress))
        self.in_flight[key] = progress
        progress.task.add_done_callback(lambda _t: self._done(key, progress))
        return progress

    def _done(self, key: str, progress: PullProgress) -> None:
        if self.in_flight.get(key) is progress:
            del self.in_flight[key]
        task = progress.task
        if task is not None and not task.cancelled():
            task.exception()  # retrieved: the awaiting callers got it; no "never retrieved" log

    async def _io(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _run(self, progress: PullProgress) -> tuple[ArtifactRecord, str]:
        key = progress.key
        try:
            result = await self._watched(progress)
        except RemoteUnavailable as exc:
            self._down_until, self._down_error = time.monotonic() + self.DOWN_TTL_S, exc
            self._count("unavailable")
            log.warning("pull of %s: %s", key[:16], exc.message)
            raise
        except (ManifestCorrupt, ChecksumMismatch) as exc:
            self._remember(self._refused, key, (time.monotonic(), exc))
            self._count("invalid")
            log.error("pull of %s refused: %s", key[:16], exc.message)
            raise
        except ArtifactDenied:
            self._count("denied")
            raise
        except ArtifactNotFound:
            self._remember(self._missing, key, time.monotonic())
            self._count("miss")
            raise
        except HwrError:
            self._count("failed")
            raise
        self._down_error = None
        self._refused.pop(key, None)
        self._missing.pop(key, None)
        self._count(result[1], progress.done_bytes if result[1] == "pulled" else 0)
        return result

    def _remember(self, table: dict[str, Any], key: str, value: Any) -> None:
        if len(table) > self.MEMORY_KEYS:
            table.clear()
        table[key] = value

    async def _watched(self, progress: PullProgress) -> tuple[ArtifactRecord, str]:
        """``_fetch`` under the stall watch (module docstring: Stalls)."""
        fetch = asyncio.get_running_loop().create_task(self._fetch(progress))
        tick = max(0.05, min(1.0, self.stall_timeout / 4))
        try:
            while True:
                done, _ = await asyncio.wait({fetch}, timeout=tick)
                if done:
                    return fetch.result()
                if progress.stalled_for() > self.stall_timeout:
                    break
        except asyncio.CancelledError:  # hwrd stops: the transfers stop at their next piece
            progress.stop(RemoteUnavailable(f"remote {progress.remote}: hwrd is stopping",
                                            details={"remote": progress.remote}))
            fetch.cancel()
            raise
        error = RemoteUnavailable(
            f"remote {progress.remote} stalled: no bytes for {self.stall_timeout:g} s while pulling "
            f"{progress.key[:16]} ({progress.describe()}); the pull was stopped",
            details={"remote": progress.remote, "key": progress.key, "reason": "STALLED",
                     "done_bytes": progress.done_bytes, "total_bytes": progress.total_bytes})
        progress.stop(error)
        fetch.cancel()
        with contextlib.suppress(BaseException):
            await fetch  # its staging is aborted before the waiters hear of the stall
        raise error

    def _count(self, outcome: str, nbytes: int = 0) -> None:
        if self.on_outcome is not None:
            self.on_outcome(outcome, nbytes)

    async def _fetch(self, progress: PullProgress) -> tuple[ArtifactRecord, str]:
        key = progress.key
        remote = progress.remote
        if self.catalog.deny_reason(key) is not None:
            raise ArtifactDenied(f"artifact {key[:16]} is denied on this node; it is not pulled",
                                 details={"key": key})
        name = self.remote.location.object_name
        ready = await self._io(self.remote.get_bytes, name(key, READY_FILE))
        if ready is None:
            raise _absent(key, remote)
        manifest_bytes = await self._io(self.remote.get_bytes, name(key, MANIFEST_FILE))
        plan = plan_from_documents(key, ready, manifest_bytes, remote)
        progress.total_bytes = plan.size_bytes
        progress.enter("admission")
        begun = await self.publications.begin(None, plan.manifest.identity, list(plan.specs),
                                              wait_timeout=self.wait_timeout,
                                              format_metadata=plan.format_metadata or None, overlap=plan.overlap)
        if begun.publication is None:  # present already, or a local publisher committed it first
            return await asyncio.to_thread(self.catalog.record_blocking, key), "already_present"
        pub = begun.publication
        progress.enter("download")
        try:
            digests = await self._download_all(pub, plan, progress)
        except BaseException:
            await self.publications.abort_publication(pub)
            raise
        progress.enter("commit")
        expected = {t.name: t.sha256 for t in plan.manifest.tensors}
        self.committing.add(key)
        try:
            record, _existed = await self.publications.commit_publication(pub, expected, trusted_digests=digests)
        except ChecksumMismatch as exc:
            raise ChecksumMismatch(f"remote {remote}: artifact {key[:16]} refused: its bytes do not match "
                                   "its manifest", details={**exc.details, "key": key, "remote": remote}) from None
        except ManifestCorrupt as exc:
            raise RemoteObjectInvalid(f"remote {remote}: artifact {key[:16]} refused: {exc.message}",
                                      details={**exc.details, "key": key, "remote": remote}) from None
        finally:
            self.committing.discard(key)
        # Belt and braces: the headers are the planned ones and every tensor hashed as expected,
        # so the files (header + contiguous tensors) hash as the remote manifest says.
        if record.manifest.files != plan.manifest.files:
            self.catalog.deny_permanently(key, "pulled bytes differ from the remote manifest's file digests")
            raise ChecksumMismatch(f"remote {remote}: artifact {key[:16]} refused: file digests differ",
                                   details={"key": key, "remote": remote})
        log.info("pulled %s (%d bytes) from %s", key[:16], plan.size_bytes, remote)
        return record, "pulled"

    async def _download_all(self, pub: Publication, plan: RemotePlan,
                            progress: PullProgress) -> ProducerDigests | None:
        """Step 5: every payload into its staging file; the digests computed on the way, or
        None when some file could not be hashed in order (the commit then re-hashes)."""
        if self.peer_fill is not None:  # the fleet's nodes first (hwr.daemon.fleet.peer_fill)
            from hwr.daemon.fleet.peer_fill import NOT_SERVED

            def store_copy(file: str, sink: PayloadSink) -> None:
                self.remote.get_into(self.remote.location.object_name(progress.key, file), sink)

            served = await self.peer_fill.download(progress, plan, pub, store_copy)
            if served is not NOT_SERVED:
                return served  # type: ignore[return-value]
        staging = pub.staging
        paths = {n: p for n, p, _s in staging.files}
        heads = {p.name: len(p.head) for p in staging.plans}
        ranges: dict[str, list[tuple[str, int, int]]] = {name: [] for name in paths}
        for p in staging.plans:
            ranges[p.name] = [(e.name, heads[p.name] + e.begin, heads[p.name] + e.end) for e in p.entries]
        files: dict[str, str] = {}
        tensors: dict[str, str] = {}
        complete = True
        for file, size in plan.files:
            digests = await self._io(self._download, self.remote.location.object_name(progress.key, file),
                                     paths[file], size, ranges[file], progress)
            if digests is None:
                complete = False
            else:
                files[file] = digests[0]
                tensors.update(digests[1])
        return ProducerDigests(files, tensors) if complete else None

    def _download(self, name: str, path: os.PathLike[str], size: int, ranges: list[tuple[str, int, int]],
                  progress: PullProgress) -> tuple[str, dict[str, str]] | None:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)  # RDWR: spilled pieces are re-read
        try:
            sink = DownloadSink(fd, size, ranges, progress=progress.add, check=progress.check)
            try:
                self.remote.get_into(name, sink)
            except BaseException:
                sink.close()
                raise
            return sink.finish()
        finally:
            os.close(fd)


def _absent(key: str, remote: str) -> ArtifactNotFound:
    return ArtifactNotFound(f"no artifact with that key here or in remote {remote}",
                            details={"key": key, "remote": remote})
