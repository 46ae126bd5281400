"""Which DLO backend vLLM-Omni's startup gets when hwrd is configured: a pure choice, and the hook.

vLLM-Omni's ``enable_offload_backend`` (called by the diffusion model runner after the load)
looks ``get_offload_backend`` up in ``vllm_omni.diffusion.offloader`` at call time; the plugin
wraps that function. The original builds the backend; when it is vLLM-Omni's
``DistributedLayerwiseOffloadBackend`` and hwrd is configured, ``choose`` decides:

    mode disabled / no hwrd target                       -> KEEP (vLLM-Omni's backend)
    no plan, mode required                               -> FAIL: the DiT was loaded canonically,
                                                            nothing came through hwrd
    DiT AllGather (group > 1), any plan or none          -> HWRD: every rank of the group must run
                                                            the same backend, whose rings agree
                                                            on one transport (a cold start's ranks
                                                            race the publication: one may hit
                                                            while another loaded canonically)
    checkpoint_mmap plan (rank-local)                    -> HWRD (checkpoint leases from hwrd)
    otherwise (rank-local)                               -> KEEP (it streams a lease itself; a cold
                                                            start's loader publishes)

``install_factory``/``uninstall_factory`` are idempotent; the original is kept in ``__wrapped__``.
"""

from __future__ import annotations

import enum
import logging
import threading
from typing import Any

from hwr.client.errors import ConfigError
from hwr.dlo_backend.vllm_plugin.config import resolve_target

__all__ = ["Choice", "choose", "install_factory", "uninstall_factory"]

log = logging.getLogger("hwr.vllm_plugin")
_MARK = "_hwr_vllm_factory"
_lock = threading.Lock()


class Choice(enum.Enum):
    KEEP = "keep"
    HWRD = "hwrd"
    FAIL = "fail"


def choose(*, mode: str, configured: bool, backing: str | None, allgather_group: int) -> Choice:
    """The backend for one startup (see the module table); pure."""
    if mode == "disabled" or not configured:
        return Choice.KEEP
    if backing is None and mode == "required":
        return Choice.FAIL
    if allgather_group > 1 or backing == "checkpoint_mmap":
        return Choice.HWRD
    return Choice.KEEP


def _group_size(config: Any) -> int:
    from vllm_omni.diffusion.offloader.config import DIT_COMPONENT

    return int(config.dp_size) if config.uses_allgather(DIT_COMPONENT) else 1


def _wrapped(original: Any, od_config: Any, device: Any = None, host_weight_plan: Any = None) -> Any:
    from vllm_omni.diffusion.offloader.distributed_layerwise_backend import DistributedLayerwiseOffloadBackend

    backend = original(od_config, device=device, host_weight_plan=host_weight_plan)
    if type(backend) is not DistributedLayerwiseOffloadBackend:
        return backend
    mode = str(getattr(od_config, "host_weight_runtime_mode", "disabled"))
    try:
        target = resolve_target(getattr(od_config, "host_weight_runtime_root", None))
    except ConfigError:
        target = None
    backing = getattr(host_weight_plan, "backing_kind", None)
    choice = choose(mode=mode, configured=target is not None, backing=backing,
                    allgather_group=_group_size(backend.config))
    if choice is Choice.KEEP:
        return backend
    assert target is not None
    if choice is Choice.FAIL:
        raise RuntimeError(f"required Host Weight Runtime through hwrd at {target.socket}: vLLM-Omni loaded the DiT "
                           "canonically (no final-layout lease and no direct checkpoint mmap plan; see the loader's "
                           "log for why)")
    from hwr.dlo_backend.vllm_plugin.offload import HwrdOffloadBackend

    return HwrdOffloadBackend(backend.config, backend.device, host_weight_plan, target=target,
                              required=mode == "required")


def install_factory() -> bool:
    """Wrap ``vllm_omni.diffusion.offloader.get_offload_backend``; False when already wrapped."""
    import vllm_omni.diffusion.offloader as offloader

    with _lock:
        original = offloader.get_offload_backend
        if getattr(original, _MARK, False):
            return False

        def get_offload_backend(od_config: Any, device: Any = None, host_weight_plan: Any = None) -> Any:
            return _wrapped(original, od_config, device, host_weight_plan)

        setattr(get_offload_backend, _MARK, True)
        get_offload_backend.__wrapped__ = original  # type: ignore[attr-defined]
        get_offload_backend.__doc__ = original.__doc__
        offloader.get_offload_backend = get_offload_backend
        return True


def uninstall_factory() -> bool:
    import vllm_omni.diffusion.offloader as offloader

    with _lock:
        current = offloader.get_offload_backend
        if not getattr(current, _MARK, False):
            return False
        offloader.get_offload_backend = current.__wrapped__
        return True
