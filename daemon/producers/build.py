"""Prewarm builds: from a registered checkpoint to committed artifacts, one producer process per
artifact (one per TP rank).

For each rank: check the checkpoint (``CheckpointModified`` refuses a changed one), plan the
outputs, compute the identity, then ``Publishing.begin`` with no session: the build takes the
identity's slot in the one-publisher-per-identity table, so a worker publishing the same identity
meanwhile waits and joins it, and a build finding the identity committed (or finishing a wait on
another publisher) reports ``already_present``/``joined`` without running anything. The producer
process writes into the staging through passed descriptors and reports the SHA-256 digests of
what it wrote; after its clean exit the daemon commits (validate headers, fsync, rename) with
those digests instead of re-hashing every byte (``ProducerDigests`` states why that is sound).
Every failure, timeout or cancellation kills the process first and then aborts the staging: no
artifact, no staging left.

States of one rank's build::

    PLANNED --begin--> STAGED --producer exit 0--> COMMITTING --> COMMITTED
      |                  `--error | timeout | cancel--> ABORTED (process reaped, staging removed)
      `--identity present / joined another publisher--> DONE (nothing run)
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hwr.client.identity import ArtifactIdentity, SourceIdentity
from hwr.client.wire import close_fds
from hwr.daemon.checkpoints.registry import Checkpoint, Checkpoints
from hwr.daemon.producers import ArtifactProducer, SourceTensor
from hwr.daemon.producers.runner import run_job
from hwr.daemon.store.staging import ProducerDigests, StagedTensor, Staging

if TYPE_CHECKING:
    from hwr.daemon.service.catalog import Catalog
    from hwr.daemon.service.publishing import Publishing

__all__ = ["BuiltArtifact", "build_rank", "checkpoint_identity", "source_identity"]


@dataclass(frozen=True)
class BuiltArtifact:
    key: str
    rank: int
    outcome: str  # "built" | "already_present" | "joined"
    size_bytes: int
    content_sha256: str
    peak_rss_bytes: int = 0
    seconds: float = 0.0


def source_identity(ckpt: Checkpoint) -> SourceIdentity:
    """The artifact identity's source for a registered checkpoint (content-addressed)."""
    return SourceIdentity(ckpt.model_id, ckpt.revision, f"hwr-checkpoint:{ckpt.checkpoint_id}")


def checkpoint_identity(ckpt: Checkpoint, producer: ArtifactProducer, rank: int) -> ArtifactIdentity:
    return producer.identity(source_identity(ckpt), rank)


def source_tensors(ckpt: Checkpoint) -> list[SourceTensor]:
    return [SourceTensor(e.name, e.dtype, e.shape) for _i, e in ckpt.tensors.values()]


async def build_rank(
    *,
    checkpoints: Checkpoints,
    publications: Publishing,
    catalog: Catalog,
    ckpt: Checkpoint,
    producer: ArtifactProducer,
    rank: int,
    timeout: float,
    wait_timeout: float,
    throttle_s: float = 0.0,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    prepare_next: bool = False,
) -> BuiltArtifact:
    """Build one rank (see the module docstring); ``prepare_next``: another rank follows, so start
    its producer process (``runner.ensure_spare``) while this one runs."""
    started = time.monotonic()
    checkpoints.check(ckpt)
    outputs = producer.plan(source_tensors(ckpt), rank)
    identity = checkpoint_identity(ckpt, producer, rank)
    specs = [StagedTensor(o.name, o.dtype, o.shape, kind=o.kind, role=o.role) for o in outputs]  # type: ignore[arg-type]
    begun = await publications.begin(None, identity, specs, wait_timeout=wait_timeout)
    if begun.publication is None:
        record = await asyncio.to_thread(catalog.record_blocking, begun.key)
        return BuiltArtifact(begun.key, rank, begun.outcome, record.size_bytes,
                             record.manifest.artifact_content_sha256)
    pub = begun.publication
    fds: list[int] = []
    try:
        job, fds = _job(checkpoints, ckpt, producer, rank, pub.staging, throttle_s)
        try:
            done = await run_job(job, fds, timeout=timeout, on_progress=on_progress, then_spare=prepare_next)
        finally:
            close_fds(fds)
            fds = []
        # The producer's digests (trusted: daemon-owned code, see ProducerDigests) spare the
        # commit a second read and hash of every byte; without them the commit hashes.
        record, _existed = await publications.commit_publication(
            pub, {}, trusted_digests=ProducerDigests.parse(done.get("digests")))
    except BaseException:
        close_fds(fds)
        # shield: a cancelled build still removes its staging before the cancellation propagates.
        await asyncio.shield(publications.abort_publication(pub))
        raise
    return BuiltArtifact(record.key, rank, "built", record.size_bytes, record.manifest.artifact_content_sha256,
                         int(done.get("peak_rss_bytes", 0)), time.monotonic() - started)


def _job(checkpoints: Checkpoints, ckpt: Checkpoint, producer: ArtifactProducer, rank: int, staging: Staging,
         throttle_s: float) -> tuple[dict[str, Any], list[int]]:
    fds: list[int] = []
    try:
        source_fds = checkpoints.open_fds(ckpt)
        fds.extend(source_fds)
        by_file: dict[str, int] = {}
        for name, path, _size in staging.files:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            fds.append(fd)
            by_file[name] = fd
        job = {
            "producer": producer.name, "options": producer.options(), "rank": rank, "throttle_s": throttle_s,
            "sources": [{"fd": fd, "fingerprint": _fp(f.fingerprint)}
                        for fd, f in zip(source_fds, ckpt.files, strict=True)],
            "outputs": {name: [by_file[fname], offset, nbytes]
                        for name, (fname, offset, nbytes) in staging.placements.items()},
            "files": [[by_file[name], name, size] for name, _path, size in staging.files],
        }
        return job, fds
    except BaseException:
        close_fds(fds)
        raise


def _fp(fp: Any) -> list[int]:
    return [fp.size, fp.device, fp.inode, fp.mtime_ns, fp.ctime_ns]


