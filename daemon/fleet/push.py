"""Push after publish: upload committed artifacts to the remote in the background.

Every artifact committed on this node by a publication (a client's, a post-load publication, a
prewarm build; never a pull) gets a durable to-push record ``<root>/remote/push/<key>`` (an empty
file, created and its directory fsynced before the upload starts), then one upload::

    1. skip when the key is denied here, gone from the store, or complete in the remote already
    2. each payload file, read through descriptors the read API checked (``Catalog.open_payloads``)
    3. manifest.json (the artifact's own canonical bytes)
    4. READY.json last: only now does the artifact exist for readers of the remote
    5. the to-push record is removed

A daemon killed during 2-4 leaves objects without ``READY.json`` (invisible to pulls, shown as
``incomplete`` by ``hwrctl remote ls``) and its to-push record, so the next start uploads the
key again from 1 (objects are replaced whole). An unreachable remote keeps the record and is
retried with a backoff (``RETRY_S`` doubling up to ``RETRY_MAX_S``).

Limits: one upload at a time (each one is parallel inside: multipart parts for S3); a daemon
killed between a commit and the creation of its to-push record (one small file write) does not
push that artifact (``hwrctl push KEY`` does); an artifact evicted before its turn is not pushed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hwr.client.errors import ArtifactDenied, ArtifactNotFound, HwrError, RemoteUnavailable
from hwr.client.identity import is_key
from hwr.client.manifest import MANIFEST_FILE, READY_FILE, ReadyMarker
from hwr.daemon.fleet.remote import RemoteStore
from hwr.daemon.store import fileio as store_io

if TYPE_CHECKING:
    from hwr.daemon.service.catalog import Catalog

__all__ = ["Pusher"]

log = logging.getLogger("hwrd.remote")


class Pusher:
    RETRY_S = 1.0
    RETRY_MAX_S = 60.0

    def __init__(self, remote: RemoteStore, catalog: Catalog, root: Path, *,
                 on_outcome: Callable[[str, int], None] | None = None) -> None:
        self.remote = remote
        self.catalog = catalog  # the read API: denied or not, the record, checked descriptors
        self.dir = root / "remote" / "push"
        self.on_outcome = on_outcome  # (outcome word, bytes pushed) for the metrics
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()
        self._active: dict[str, asyncio.Task[str]] = {}
        self._worker: asyncio.Task[None] | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="hwr-push")
        self.pushed_bytes_in_flight = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Create the record directory and queue every key a previous run left unpushed."""
        def scan() -> list[str]:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            return sorted(n for n in os.listdir(self.dir) if is_key(n))

        for key in await asyncio.to_thread(scan):
            self._enqueue(key)
        if self._queued:
            log.info("resuming %d unfinished uploads to %s", len(self._queued), self.remote.location.display)
        self._worker = asyncio.get_running_loop().create_task(self._work())

    async def stop(self) -> None:
        tasks = [t for t in (self._worker, *self._active.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._pool.shutdown(wait=False, cancel_futures=True)

    def pending(self) -> list[str]:
        return sorted(self._queued | set(self._active))

    def is_pending(self, key: str) -> bool:
        return key in self._queued or key in self._active

    # ------------------------------------------------------------------ requests
    async def committed(self, key: str) -> None:
        """A local publication of ``key`` committed: record it durably, then queue the upload."""
        try:
            await asyncio.to_thread(self._record, key)
        except OSError as exc:  # the upload still runs; only a crash before it would lose it
            log.error("cannot write the to-push record of %s: %s", key[:16], exc)
        self._enqueue(key)

    async def push(self, key: str) -> str:
        """Upload ``key`` now (joining an upload in flight): ``"pushed"``, ``"already_present"``;
        a typed error otherwise (``ArtifactNotFound``, ``ArtifactDenied``, ``RemoteUnavailable``)."""
        await asyncio.to_thread(self._record, key)
        return await asyncio.shield(self._ensure(key))

    def _enqueue(self, key: str) -> None:
        if key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    def _ensure(self, key: str) -> asyncio.Task[str]:
        task = self._active.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._upload(key))
            self._active[key] = task
            task.add_done_callback(lambda t: self._active.pop(key, None) if self._active.get(key) is t else None)
        return task

    async def _work(self) -> None:
        delay = self.RETRY_S
        while True:
            key = await self._queue.get()
            try:
                await asyncio.shield(self._ensure(key))
                delay = self.RETRY_S
            except RemoteUnavailable as exc:
                log.warning("upload of %s postponed %.0f s: %s", key[:16], delay, exc.message)
                await asyncio.sleep(delay)
                delay = min(self.RETRY_MAX_S, delay * 2)
                self._queue.put_nowait(key)  # still in _queued: retried after the others
                continue
            except (ArtifactNotFound, ArtifactDenied) as exc:  # evicted or denied since: nothing to do
                log.info("upload of %s skipped: %s", key[:16], exc.message)
            except HwrError as exc:
                log.error("upload of %s failed: %s", key[:16], exc.message)
            except Exception:
                log.exception("upload of %s failed", key[:16])
            self._queued.discard(key)

    # ------------------------------------------------------------------ the upload
    def _record(self, key: str) -> None:
        path = self.dir / key
        if not is_key(key):
            raise ValueError("not a key")
        if path.exists():
            return
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        store_io.fsync_dir(self.dir)

    def _drop(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.dir / key).unlink()

    async def _upload(self, key: str) -> str:
        loop = asyncio.get_running_loop()
        try:
            outcome, nbytes = await loop.run_in_executor(self._pool, self._upload_sync, key)
        except (ArtifactNotFound, ArtifactDenied):
            await asyncio.to_thread(self._drop, key)
            self._count("skipped")
            raise
        except RemoteUnavailable:
            self._count("unavailable")
            raise
        except HwrError:
            await asyncio.to_thread(self._drop, key)  # corrupt here: verify/scrub deal with it
            self._count("failed")
            raise
        self._count(outcome, nbytes)
        return outcome

    def _count(self, outcome: str, nbytes: int = 0) -> None:
        if self.on_outcome is not None:
            self.on_outcome(outcome, nbytes)

    def _upload_sync(self, key: str) -> tuple[str, int]:
        if self.catalog.deny_reason(key) is not None:
            raise ArtifactDenied(f"artifact {key[:16]} is denied on this node; it is not pushed",
                                 details={"key": key})
        record = self.catalog.record_blocking(key)
        name = self.remote.location.object_name
        if self.remote.exists(name(key, READY_FILE)):
            self._drop(key)
            return "already_present", 0
        manifest_bytes = record.manifest.to_json()
        sizes = {f.name: f.size for f in record.manifest.files}
        opened = self.catalog.open_payloads(record)  # in manifest file order
        fds = [fd for _name, fd in opened]
        total = 0
        try:
            for file, fd in opened:
                self.remote.put_file(name(key, file), fd, sizes[file])
                total += sizes[file]
        finally:
            for fd in fds:
                os.close(fd)
        self.remote.put_bytes(name(key, MANIFEST_FILE), manifest_bytes)
        marker = ReadyMarker.for_manifest(manifest_bytes, record.manifest, uuid.uuid4().hex)
        self.remote.put_bytes(name(key, READY_FILE), marker.to_json())  # last: now it exists
        self._drop(key)
        log.info("pushed %s (%d bytes) to %s", key[:16], total, self.remote.location.display)
        return "pushed", total
