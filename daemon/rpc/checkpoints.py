"""gRPC handlers for checkpoints and prewarm (a mixin of ``hwr.daemon.rpc.servicer.Servicer``).

``AddCheckpoint``/``ListCheckpoints`` adapt ``hwr.daemon.checkpoints.registry``; ``Acquire`` with a
``CheckpointRef`` is routed here by ``Servicer.Acquire`` and leases a checkpoint's original
files; ``Prewarm`` is server-streaming: it runs ``hwr.daemon.producers.build`` per TP rank in a
task, yields its progress events, then one result. When the client cancels the call the handler's
task is cancelled, which cancels the build: the producer process is killed and its
staging removed before the cancellation completes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from hwr.client.errors import HwrError, InvalidRequest
from hwr.daemon.rpc.collaborators import Ctx, Handlers
from hwr.daemon.rpc.support import abort_with, rpc
from hwr.daemon.service.leasing import CHECKPOINT_LEASE_PREFIX as LEASE_PREFIX
from hwr.daemon.service.roles import OPERATOR
from hwr.protos.hwr.v1 import hwr_pb2 as pb

if TYPE_CHECKING:
    from hwr.daemon.checkpoints.registry import Checkpoint, Checkpoints
    from hwr.daemon.producers import ArtifactProducer
    from hwr.daemon.producers.build import BuiltArtifact

__all__ = ["CheckpointsMixin"]
VLLM_OMNI = "vllm-omni"  # hwr.daemon.producers.vllm_omni.PRODUCER (that package is imported lazily)
_OUTCOMES = {"built": pb.PREWARM_OUTCOME_BUILT, "already_present": pb.PREWARM_OUTCOME_ALREADY_PRESENT,
             "joined": pb.PREWARM_OUTCOME_JOINED}


class CheckpointsMixin(Handlers):
    def _checkpoint_info(self, ckpt: Checkpoint) -> pb.CheckpointInfo:
        return pb.CheckpointInfo(
            checkpoint_id=ckpt.checkpoint_id, path=str(ckpt.path), model_id=ckpt.model_id,
            revision=ckpt.revision, file_count=len(ckpt.files), tensor_count=len(ckpt.tensors),
            size_bytes=ckpt.size_bytes, source_kind=ckpt.source_kind,
            state="modified" if ckpt.modified else "ready",
            leases=self.c.registry.lease_count(LEASE_PREFIX + ckpt.checkpoint_id),
            registered_at=ckpt.registered_at)

    @rpc
    async def AddCheckpoint(self, request: pb.AddCheckpointRequest, context: Ctx) -> pb.AddCheckpointResponse:
        session = self._authorize(context, OPERATOR, "checkpoints add")
        if not request.path.startswith("/") or len(request.path) > 4096 or "\0" in request.path:
            raise InvalidRequest("path must be an absolute path on the daemon's host", details={"field": "path"})
        from pathlib import Path

        from hwr.daemon.producers.runner import ensure_spare

        ensure_spare()  # a registration announces prewarms: their producer process starts now
        # With the caller's rights (hwr.daemon.checkpoints.caller_access), never the daemon's own.
        ckpt, added = await asyncio.to_thread(self.c.checkpoints.add, Path(request.path), cred=session.cred)
        return pb.AddCheckpointResponse(checkpoint=self._checkpoint_info(ckpt), added=added)

    @rpc
    async def ListCheckpoints(self, request: pb.ListCheckpointsRequest, context: Ctx) -> pb.ListCheckpointsResponse:
        self._session(context)
        checkpoints = self.c.checkpoints
        listed = checkpoints.list()

        def check_all() -> None:  # refreshes each "modified" state; one thread hop for the lot
            for ckpt in listed:
                with contextlib.suppress(HwrError):
                    checkpoints.check(ckpt)

        await asyncio.to_thread(check_all)
        return pb.ListCheckpointsResponse(checkpoints=[self._checkpoint_info(ckpt) for ckpt in listed])

    async def acquire_checkpoint(self, request: pb.AcquireRequest, context: Ctx) -> pb.AcquireResponse:
        """``Acquire`` of a ``CheckpointRef`` (called by ``Servicer.Acquire``, whose ``@rpc`` maps errors)."""
        session = self._session(context)
        lease, ckpt = await self.c.leasing.grant_checkpoint(session, request.artifact.checkpoint.checkpoint_id)
        return pb.AcquireResponse(
            lease_id=lease.lease_id, lease_token=lease.token, key=ckpt.checkpoint_id, manifest_json=b"",
            files=[pb.PayloadFile(name=f.name, size=f.fingerprint.size) for f in ckpt.files])

    async def Prewarm(self, request: pb.PrewarmRequest, context: Ctx) -> AsyncIterator[pb.PrewarmResponse]:
        queue: asyncio.Queue[pb.PrewarmResponse] = asyncio.Queue()
        task: asyncio.Task[list[BuiltArtifact]] | None = None
        try:
            self._authorize(context, OPERATOR, "prewarm")
            if request.producer == VLLM_OMNI:
                task = asyncio.get_running_loop().create_task(self._prewarm_vllm_omni(request, queue))
            else:
                ckpt, producer, ranks = _prewarm_args(self.c.checkpoints, request)
                task = asyncio.get_running_loop().create_task(self._prewarm(request, ckpt, producer, ranks, queue))
            while True:
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield getter.result()
                    continue
                getter.cancel()
                while not queue.empty():
                    yield queue.get_nowait()
                built = task.result()
                yield pb.PrewarmResponse(result=pb.PrewarmResult(artifacts=[
                    pb.PrewarmArtifact(key=b.key, tp_rank=b.rank, outcome=_OUTCOMES[b.outcome],
                                       size_bytes=b.size_bytes, content_sha256=b.content_sha256,
                                       producer_peak_rss_bytes=b.peak_rss_bytes, build_seconds=b.seconds)
                    for b in built]))
                return
        except HwrError as exc:
            await abort_with(context, exc)
        finally:
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def _prewarm_vllm_omni(self, request: pb.PrewarmRequest,
                                 queue: asyncio.Queue[pb.PrewarmResponse]) -> list[BuiltArtifact]:
        """``--producer vllm-omni``: vLLM-Omni's own cold start into this daemon (``producers.vllm_omni``)."""
        from hwr.daemon.producers.vllm_omni import build_vllm_omni, parse_config

        if not request.checkpoint or len(request.checkpoint) > 4096:
            raise InvalidRequest("checkpoint is required", details={"field": "checkpoint"})
        if request.tp_size > 1 or request.tp_plan or request.tp_ranks or request.keep_fp32:
            raise InvalidRequest("tp and keep_fp32 options do not apply to the vllm-omni producer",
                                 details={"field": "producer"})
        config = parse_config(bytes(request.producer_config), dtype=request.dtype)
        ckpt = self.c.checkpoints.get(request.checkpoint)
        settings = self.c.settings.config
        timeout = request.timeout_ms / 1000.0 if request.timeout_ms else settings.producer_timeout_s

        def progress(event: dict[str, Any]) -> None:
            queue.put_nowait(pb.PrewarmResponse(progress=pb.PrewarmProgress(
                tp_rank=0, done_bytes=int(event.get("done", 0)), total_bytes=int(event.get("total", 0)),
                tensor=str(event.get("tensor", ""))[:1024])))

        built = await build_vllm_omni(checkpoints=self.c.checkpoints, catalog=self.c.catalog, ckpt=ckpt, config=config,
                                      socket=str(settings.socket), timeout=max(0.001, timeout),
                                      on_progress=progress)
        return [built]

    async def _prewarm(self, request: pb.PrewarmRequest, ckpt: Checkpoint, producer: ArtifactProducer, ranks: list[int],
                       queue: asyncio.Queue[pb.PrewarmResponse]) -> list[BuiltArtifact]:
        from hwr.daemon.producers.build import build_rank

        config = self.c.settings.config
        timeout = request.timeout_ms / 1000.0 if request.timeout_ms else config.producer_timeout_s
        wait = request.wait_timeout_ms / 1000.0 if request.wait_timeout_ms else config.publication_wait_timeout_s
        results = []
        for rank in ranks:
            def progress(event: dict[str, Any], rank: int = rank) -> None:
                queue.put_nowait(pb.PrewarmResponse(progress=pb.PrewarmProgress(
                    tp_rank=rank, done_bytes=int(event.get("done", 0)), total_bytes=int(event.get("total", 0)),
                    tensor=str(event.get("tensor", ""))[:1024])))

            built = await build_rank(
                checkpoints=self.c.checkpoints, publications=self.c.publications, catalog=self.c.catalog,
                ckpt=ckpt, producer=producer, rank=rank, timeout=max(0.001, timeout), wait_timeout=wait,
                throttle_s=config.producer_throttle_s, on_progress=progress, prepare_next=rank != ranks[-1])
            results.append(built)
        return results


def _prewarm_args(checkpoints: Checkpoints,
                  request: pb.PrewarmRequest) -> tuple[Checkpoint, ArtifactProducer, list[int]]:
    from hwr.daemon.producers import make_producer

    if not request.checkpoint or len(request.checkpoint) > 4096:
        raise InvalidRequest("checkpoint is required", details={"field": "checkpoint"})
    ckpt = checkpoints.get(request.checkpoint)
    options: dict[str, Any] = {"dtype": request.dtype or None, "keep_fp32": list(request.keep_fp32)}
    if request.producer == "tp-slice":
        options = {"tp_size": request.tp_size, "plan": bytes(request.tp_plan), "dtype": request.dtype or None}
        if not request.tp_plan:
            raise InvalidRequest("tp-slice needs a plan (--tp-plan FILE)", details={"field": "tp_plan"})
    elif request.tp_size > 1 or request.tp_plan:
        raise InvalidRequest("tp_size/tp_plan apply to the tp-slice producer only", details={"field": "tp_size"})
    producer = make_producer(request.producer, options)
    size = getattr(producer, "tp_size", 1)
    ranks = sorted(set(request.tp_ranks)) if request.tp_ranks else list(range(size))
    if any(r >= size for r in ranks):
        raise InvalidRequest("tp_ranks out of range", details={"field": "tp_ranks"})
    return ckpt, producer, ranks
