"""Prewarm for vLLM-Omni: the daemon runs vLLM-Omni's own cold start in an isolated producer process.

vLLM-Omni looks a restore-contract DiT up under an identity only its own loader computes (the
pipeline and DiT classes, the model config it derives, the loader's transform contract, the
source files' digests, the parallel semantics) and restores it with ``format_metadata`` only its
own producer writes. Re-deriving either in hwrd would drift from vLLM-Omni at its next release.
So the ``vllm-omni`` producer does not plan tensors in the daemon: ``build_vllm_omni`` starts one
process of ``hwr.dlo_backend.vllm_plugin.prewarm`` (a fresh interpreter, its own session and
process group, killed on timeout or cancellation, exactly like the other producers' processes;
the daemon itself never imports torch or vLLM-Omni) which loads the pipeline from the
registered checkpoint with vLLM-Omni's ``DiffusersPipelineLoader`` on the CPU, in ``preferred``
mode against this daemon: a hit reports ``already_present``, a miss loads canonically and
vLLM-Omni's post-load publication streams the final layout into this daemon, where the one-
publisher-per-identity rule applies as for any worker (``built`` or ``joined``).

Job (JSON on the process's stdin)::

    {"checkpoint": PATH, "socket": HWRD_SOCKET, "config": {vLLM-Omni config fields},
     "files": [[relative name, [size, dev, inode, mtime_ns, ctime_ns]], ...]}

``files`` are the registered fingerprints: the process refuses to run (``CheckpointModified``)
when a file under the registered path is not the registered one, before and after the load.
Events on stdout as the other producers' (``runner``), the final one
``{"event": "done", "key", "outcome", "peak_rss_bytes", "seconds"}``.
Limits: the process reads the checkpoint by path (vLLM-Omni's loader opens files by name), so the
daemon's user needs read access to it; TP, SP, CFG and pipeline parallel sizes other than 1 are
refused (the identity records them and the loader would need those ranks); DP is not part of
the identity, so one prewarm serves every DP size.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hwr.client.errors import InvalidRequest
from hwr.daemon.checkpoints.registry import Checkpoint, Checkpoints
from hwr.daemon.producers.runner import run_job

if TYPE_CHECKING:
    from hwr.daemon.producers.build import BuiltArtifact
    from hwr.daemon.store.root import Store

__all__ = ["PRODUCER", "PROGRAM", "build_vllm_omni", "parse_config"]

PRODUCER = "vllm-omni"
PROGRAM = "hwr.dlo_backend.vllm_plugin.prewarm"
_MAX_CONFIG_BYTES = 64 * 1024
_PARALLEL_ONE = ("tensor_parallel_size", "sequence_parallel_size", "ulysses_degree", "ring_degree",
                 "cfg_parallel_size", "pipeline_parallel_size")
_OUTCOMES = frozenset({"built", "joined", "already_present"})


def parse_config(raw: bytes) -> dict[str, Any]:
    """The producer's vLLM-Omni config (a JSON object), validated as far as the daemon can; pure."""
    if len(raw) > _MAX_CONFIG_BYTES:
        raise InvalidRequest("producer_config is larger than 64 KiB", details={"field": "producer_config"})
    try:
        config = json.loads(raw or b"{}")
    except ValueError as exc:
        raise InvalidRequest(f"producer_config is not JSON: {exc}", details={"field": "producer_config"}) from None
    if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
        raise InvalidRequest("producer_config must be a JSON object", details={"field": "producer_config"})
    parallel = config.get("parallel_config") or {}
    if not isinstance(parallel, dict):
        raise InvalidRequest("parallel_config must be an object", details={"field": "producer_config"})
    for name in _PARALLEL_ONE:
        if int(parallel.get(name, 1) or 1) != 1:
            raise InvalidRequest(f"the vllm-omni producer builds {name} = 1 artifacts only",
                                 details={"field": "producer_config", "name": name})
    for forbidden in ("host_weight_runtime_mode", "host_weight_runtime_root"):
        if forbidden in config:
            raise InvalidRequest(f"{forbidden} is the producer's own (it publishes into this daemon)",
                                 details={"field": "producer_config"})
    return config


async def build_vllm_omni(*, checkpoints: Checkpoints, store: Store, ckpt: Checkpoint, config: dict[str, Any],
                          socket: str, timeout: float,
                          on_progress: Callable[[dict[str, Any]], None] | None = None) -> BuiltArtifact:
    """Run one vLLM-Omni cold start into this daemon (see the module docstring)."""
    from hwr.daemon.producers.build import BuiltArtifact

    started = time.monotonic()
    checkpoints.check(ckpt)
    job = {"checkpoint": str(ckpt.path), "socket": socket, "config": config,
           "files": [[f.name, [f.fingerprint.size, f.fingerprint.device, f.fingerprint.inode,
                               f.fingerprint.mtime_ns, f.fingerprint.ctime_ns]] for f in ckpt.files]}
    done = await run_job(job, [], timeout=timeout, on_progress=on_progress, program=PROGRAM)
    key, outcome = str(done.get("key", "")), str(done.get("outcome", ""))
    if len(key) != 64 or outcome not in _OUTCOMES:
        raise InvalidRequest("the vllm-omni producer reported no artifact", details={"outcome": outcome[:40]})
    record = await asyncio.to_thread(store.records.lookup, key)
    return BuiltArtifact(key, 0, outcome, record.size_bytes, record.manifest.artifact_content_sha256,
                         int(done.get("peak_rss_bytes", 0)), time.monotonic() - started)
