"""The ``vllm-omni`` prewarm producer: vLLM-Omni's own cold start on the CPU, publishing into hwrd.

Run by hwrd as ``python -m hwr.dlo_backend.vllm_plugin.prewarm`` (``hwr.daemon.producers.vllm_omni``
says why and how: job on stdin, events on stdout, an isolated process the daemon kills on timeout
or cancellation). It builds the exact artifact a ``vllm serve MODEL --omni
--enable-distributed-layerwise-offload --host-weight-runtime-mode required`` worker looks up,
because it *is* vLLM-Omni's loader that computes the identity, loads the DiT and writes the final
layout with its own producer and ``format_metadata``:

1. check every registered file under the checkpoint against its registered fingerprint;
2. give vLLM-Omni the CPU as its device (``cpu_only``: vLLM-Omni has no CPU platform, so the
   device calls a load makes are CPU no-ops, attention layers are built with the SDPA backend, and
   vLLM's CPU build keeps linear weights in the layout its CUDA build uses, which is the layout a
   GPU worker restores; no accelerator is touched, ``CUDA_VISIBLE_DEVICES`` is emptied);
3. one-rank gloo process group and vLLM-Omni's parallel state, its forward context and config;
4. ``DiffusersPipelineLoader.load_model(load_device="cpu")`` with DLO rank-local and the runtime
   in ``preferred`` mode through the hwr plugin against the daemon's socket: a LOCAL_HIT is
   ``already_present``; otherwise the canonical load and vLLM-Omni's post-load publication into
   hwrd (``built``: hwrd holds the key afterwards, whichever publisher of it committed first);
5. check the files again, then report ``{"event": "done", "key", "outcome", ...}``.

The job's ``config`` holds the serving worker's vLLM-Omni config fields that select the pipeline
and its layout (the daemon's allow-list, ``hwr.client.omni_config``); ``model`` is always
the registered checkpoint path, which must then be the path the server is given, and
``trust_remote_code`` is always off (``engine_fields``); the hub is offline in this process. Limits: the DiT is loaded
whole into this process's memory (vLLM-Omni's loader does), so its peak RSS is about the
pipeline's size; parallel sizes other than 1 are refused by the daemon.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["cpu_only", "engine_fields", "main", "run"]

_SDPA = "vllm_omni.diffusion.attention.backends.sdpa.SDPABackend"
_TIB = 1 << 40


def cpu_only() -> None:
    """vLLM-Omni on the CPU for a load (see step 2 of the module docstring); idempotent."""
    import torch
    from vllm.model_executor.layers.linear import LinearBase
    from vllm_omni.platforms import current_omni_platform

    platform = type(current_omni_platform)
    for name, call in {
        "synchronize": lambda cls: None,
        "empty_cache": lambda cls: None,
        "set_device": lambda cls, device: None,
        "get_free_memory": lambda cls, device=None: _TIB,
        "get_device_memory": lambda cls, device=None: (_TIB, _TIB),
        "get_device_total_memory": lambda cls, device_id=0: _TIB,
        "get_torch_device": lambda cls, local_rank=None: torch.device("cpu"),
        "get_device_count": lambda cls: 1,
        "supports_torch_inductor": lambda cls: False,
        "get_diffusion_attn_backend_cls": lambda cls, selected_backend, head_size, allow_trtllm_default=False: _SDPA,
    }.items():
        setattr(platform, name, classmethod(call))
    platform.dist_backend = "gloo"
    # vLLM's CPU build repacks linear weights for oneDNN after loading; its CUDA build leaves them.
    LinearBase.skip_weight_relayout = True


def _check_files(root: Path, files: list[list[Any]]) -> None:
    from hwr.client.errors import CheckpointModified

    for name, fingerprint in files:
        path = root / name if root.is_dir() else root
        try:
            st = os.stat(path)
        except OSError as exc:
            raise CheckpointModified(f"registered file {name!r} is unreadable here: {exc.strerror}") from None
        if [st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns] != list(fingerprint):
            raise CheckpointModified(f"registered file {name!r} changed since registration")


def engine_fields(root: Path, config: object, *, port: int, runtime_root: str) -> dict[str, Any]:
    """The vLLM-Omni config fields of the load: the job's ``config``, checked again against the
    daemon's allow-list (``hwr.client.omni_config``; ``InvalidRequest``), under the
    producer's own fields, which always win: ``model`` is the registered ``root`` and
    ``trust_remote_code`` is off whatever the config says (this process has hwrd's rights)."""
    from hwr.client.omni_config import check_omni_config

    checked = check_omni_config(config)
    return {**checked, "model": str(root), "trust_remote_code": False, "num_gpus": 1, "enforce_eager": True,
            "enable_distributed_layerwise_offload": True, "dlo_use_allgather": False, "pin_cpu_memory": False,
            "master_port": port, "host_weight_runtime_mode": "preferred", "host_weight_runtime_root": runtime_root}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run(job: dict[str, Any]) -> dict[str, Any]:
    """One vLLM-Omni cold start into hwrd (the module docstring's steps); returns the done event."""
    started = time.monotonic()
    root = Path(job["checkpoint"])
    _check_files(root, job["files"])
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["HWR_SOCKET"] = str(job["socket"])
    os.environ.pop("HWR_VLLM_PLUGIN", None)
    # Nothing but the registered files: a component or config that names a hub repository must
    # fail, not download into a process with hwrd's rights.
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    port = _free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import LoadConfig
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.distributed.parallel_state import (
        destroy_distributed_env,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm_omni.diffusion.forward_context import set_forward_context
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader
    from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config
    from vllm_omni.plugins import load_omni_general_plugins

    from hwr.client.errors import ProducerFailed

    cpu_only()
    load_omni_general_plugins()
    import hwr.dlo_backend.vllm_plugin as plugin

    if plugin.state() != "installed":
        raise ProducerFailed(f"the hwr vLLM-Omni plugin is not active in the producer: {plugin.state()}")
    device = torch.device("cpu")
    with tempfile.TemporaryDirectory(prefix="hwr-vllm-omni-") as runtime_root:
        od_config = OmniDiffusionConfig.from_kwargs(**engine_fields(root, job.get("config", {}), port=port,
                                                                    runtime_root=runtime_root))
        od_config.enrich_config()
        vllm_config = create_diffusion_vllm_config(device, od_config)
        with set_forward_context(vllm_config=vllm_config, omni_diffusion_config=od_config), \
                set_current_vllm_config(vllm_config):
            init_distributed_environment(world_size=1, rank=0)
            initialize_model_parallel(data_parallel_size=1)
            try:
                loader = DiffusersPipelineLoader(LoadConfig(), od_config=od_config)
                loader.load_model(load_device="cpu", load_format="default", device=device)
                state = loader._hwr_state or {}  # the loader's own transaction state
                context = state.get("context")
                if context is None:
                    raise ProducerFailed("vLLM-Omni did not resolve this pipeline through the Host Weight Runtime "
                                         "(no final-layout restore contract, or an option it refuses)")
                key = context.identity.key
                outcome = _outcome(str(getattr(state.get("outcome"), "value", "")), key, str(job["socket"]))
                carrier = getattr(loader.take_host_weight_plan(), "lease_carrier", None)
                if carrier is not None:
                    carrier.close()  # a hit's lease: nothing here streams it
            finally:
                destroy_distributed_env()
    _check_files(root, job["files"])
    return {"event": "done", "key": key, "outcome": outcome, "peak_rss_bytes": _peak_rss(),
            "seconds": round(time.monotonic() - started, 3)}


def _outcome(resolution: str, key: str, socket_path: str) -> str:
    """``already_present`` for a hit, else ``built`` once the daemon holds the key."""
    import hwr.client
    from hwr.client.errors import ArtifactNotFound, ProducerFailed

    if resolution == "local_hit":
        return "already_present"
    with hwr.client.connect(socket_path) as client:
        try:
            client.inspect(key)
        except ArtifactNotFound:
            raise ProducerFailed("vLLM-Omni's post-load publication did not reach hwrd (see the producer's "
                                 "log)") from None
    return "built"


def _peak_rss() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    out = sys.stdout
    sys.stdout = sys.stderr  # stdout carries events only; libraries print to stderr
    try:
        job = json.loads(sys.stdin.buffer.read(1 << 20))
        event = run(job)
        code = 0
    except Exception as exc:  # reported as one event, never a traceback on the wire
        from hwr.client.errors import HwrError

        if isinstance(exc, HwrError):
            event = {"event": "error", "code": exc.code, "message": exc.message}
        else:
            event = {"event": "error", "code": "PRODUCER_FAILED", "message": f"{type(exc).__name__}: {exc}"[:2000]}
        code = 1
    out.write(json.dumps(event, separators=(",", ":")) + "\n")
    out.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
