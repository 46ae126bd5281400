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
The config is an allow-list (``omni_config``): the producer runs with hwrd's rights, so it loads
the registered checkpoint and nothing else (``model`` is always the registered path; no key may
name a path, a repository, a tokenizer or code; ``trust_remote_code`` stays off).
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
from hwr.client.omni_config import check_omni_config
from hwr.daemon.checkpoints.registry import Checkpoint, Checkpoints
from hwr.daemon.producers.runner import run_job

if TYPE_CHECKING:
    from hwr.daemon.producers.build import BuiltArtifact
    from hwr.daemon.service.catalog import Catalog

__all__ = ["PRODUCER", "PROGRAM", "build_vllm_omni", "parse_config"]

PRODUCER = "vllm-omni"
PROGRAM = "hwr.dlo_backend.vllm_plugin.prewarm"
_MAX_CONFIG_BYTES = 64 * 1024
_OUTCOMES = frozenset({"built", "joined", "already_present"})


def parse_config(raw: bytes, *, dtype: str = "") -> dict[str, Any]:
    """The producer's vLLM-Omni config (a JSON object) checked against the allow-list
    (``omni_config.check_omni_config``: ``INVALID_ARGUMENT`` naming the key); ``dtype``: the
    request's ``--dtype``, the default for the config's; pure."""
    if len(raw) > _MAX_CONFIG_BYTES:
        raise InvalidRequest("producer_config is larger than 64 KiB", details={"field": "producer_config"})
    try:
        config = json.loads(raw or b"{}")
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"producer_config is not JSON: {exc}", details={"field": "producer_config"}) from None
    if isinstance(config, dict) and dtype:
        config.setdefault("dtype", dtype)
    return check_omni_config(config)


async def build_vllm_omni(*, checkpoints: Checkpoints, catalog: Catalog, ckpt: Checkpoint, config: dict[str, Any],
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
    record = await asyncio.to_thread(catalog.record_blocking, key)
    return BuiltArtifact(key, 0, outcome, record.size_bytes, record.manifest.artifact_content_sha256,
                         int(done.get("peak_rss_bytes", 0)), time.monotonic() - started)
