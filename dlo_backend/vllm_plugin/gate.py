"""Which path a DLO load takes when hwrd is configured: a pure verdict, and the loader gate over it.

vLLM-Omni 0.30's ``HWRLoaderMixin._hwr_eligibility_mode`` returns before any lookup when DLO uses
AllGather, even in ``required`` mode, and refuses (``required``) or skips (``preferred``) DiTs
without a final-layout restore contract, which are the ones it loads by direct checkpoint mmap.
With the plugin active and hwrd configured, ``verdict`` decides instead:

    inputs                                                   -> verdict
    mode disabled, or DLO off                                -> UPSTREAM (vLLM-Omni's gate, unchanged)
    load_format / HSDP / quantization / LoRA / no DiT        -> REFUSE (reasons): required fails the
                                                                start naming them; preferred warns
                                                                once and loads as vLLM-Omni would
    every DiT declares the restore contract, rank-local      -> UPSTREAM (its gate admits it)
    every DiT declares the restore contract, AllGather       -> FINAL_LAYOUT (vLLM-Omni's gate run
                                                                as if rank-local: lookup through
                                                                hwrd, restore, carrier to DLO)
    no contract, the pipeline remaps checkpoint keys         -> CHECKPOINT (no final-layout lookup;
      (``_remap_ckpt_key``: loaded by direct checkpoint mmap)   the plan's files are hwrd
                                                                checkpoint leases)
    no contract, no checkpoint remap                         -> REFUSE

``install_gate``/``uninstall_gate`` wrap the mixin's method (idempotent, original kept in
``__wrapped__``). The wrapper reads hwrd's target from the runtime root like ``interception``;
without a target it calls vLLM-Omni's gate unchanged.
"""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass
from typing import Any

from hwr.client.errors import ConfigError
from hwr.dlo_backend.vllm_plugin.config import resolve_target

__all__ = ["GateInputs", "LoadPath", "Verdict", "install_gate", "uninstall_gate", "verdict"]

log = logging.getLogger("hwr.vllm_plugin")
_MARK = "_hwr_vllm_gate"
_lock = threading.Lock()
_warned: set[str] = set()


class LoadPath(enum.Enum):
    UPSTREAM = "upstream"
    FINAL_LAYOUT = "final_layout"
    CHECKPOINT = "checkpoint"
    REFUSE = "refuse"


@dataclass(frozen=True)
class GateInputs:
    mode: str  # "disabled" | "preferred" | "required"
    dist_offload: bool
    use_allgather: bool
    load_format: str
    use_hsdp: bool
    quantized: bool
    lora: bool
    dits: int
    contracts: bool  # every DiT declares host_weight_restore_contract + validate_restored_host_weights
    remaps_checkpoint: bool  # the pipeline class has a callable _remap_ckpt_key


@dataclass(frozen=True)
class Verdict:
    path: LoadPath
    reason: str = ""


def verdict(g: GateInputs) -> Verdict:
    """The path of one load (see the module table); pure."""
    if g.mode == "disabled" or not g.dist_offload:
        return Verdict(LoadPath.UPSTREAM)
    reasons = []
    if g.load_format != "default":
        reasons.append(f"load_format {g.load_format!r} (only 'default')")
    if g.use_hsdp:
        reasons.append("HSDP")
    if g.quantized:
        reasons.append("a quantization config")
    if g.lora:
        reasons.append("LoRA adapters")
    if not g.dits:
        reasons.append("a pipeline without DiT modules")
    if reasons:
        return Verdict(LoadPath.REFUSE, ", ".join(reasons))
    if g.contracts:
        return Verdict(LoadPath.FINAL_LAYOUT if g.use_allgather else LoadPath.UPSTREAM)
    if g.remaps_checkpoint:
        return Verdict(LoadPath.CHECKPOINT)
    return Verdict(LoadPath.REFUSE, "a DiT without a final-layout restore contract that is not loaded by "
                                 "direct checkpoint mmap")


def inputs_of(loader: Any, model: Any, modules: Any, *, dist_offload: bool, use_allgather: bool,
              load_format: str) -> GateInputs:
    """The verdict's inputs, read from vLLM-Omni's loader, pipeline and discovered modules."""
    dits = tuple(getattr(modules, "dits", ()))
    return GateInputs(
        mode=str(getattr(loader.od_config, "host_weight_runtime_mode", "disabled")),
        dist_offload=bool(dist_offload), use_allgather=bool(use_allgather), load_format=str(load_format),
        use_hsdp=bool(getattr(loader.parallel_config, "use_hsdp", False)),
        quantized=loader.quant_config is not None, lora=bool(getattr(loader.od_config, "lora_path", None)),
        dits=len(dits),
        contracts=bool(dits) and all(getattr(d, "host_weight_restore_contract", None) is not None
                                     and callable(getattr(d, "validate_restored_host_weights", None)) for d in dits),
        remaps_checkpoint=callable(getattr(type(model), "_remap_ckpt_key", None)),
    )


def _gated(original: Any, loader: Any, model: Any, modules: Any, *, dist_offload: bool, use_allgather: bool,
           load_format: str) -> Any:
    def upstream(allgather: bool) -> Any:
        return original(loader, model, modules, dist_offload=dist_offload, use_allgather=allgather,
                        load_format=load_format)

    try:
        target = resolve_target(getattr(loader.od_config, "host_weight_runtime_root", None))
    except ConfigError:
        target = None  # the runtime's construction reports a malformed marker (interception)
    if target is None:
        return upstream(use_allgather)
    decision = verdict(inputs_of(loader, model, modules, dist_offload=dist_offload, use_allgather=use_allgather,
                                 load_format=load_format))
    if decision.path is LoadPath.UPSTREAM:
        return upstream(use_allgather)
    if decision.path is LoadPath.FINAL_LAYOUT:
        return upstream(False)  # the same gate and lookup as rank-local; DLO then gathers from the lease
    required = getattr(loader.od_config, "host_weight_runtime_mode", "") == "required"
    if decision.path is LoadPath.CHECKPOINT:
        log.info("Host Weight Runtime: %s loads by direct checkpoint mmap from hwrd checkpoint leases",
                 type(model).__name__)
        return None
    message = f"hwrd at {target.socket} cannot serve {decision.reason}"
    if required:
        raise ValueError(f"required Host Weight Runtime path is ineligible: {message}")
    if message not in _warned:
        _warned.add(message)
        log.warning("Host Weight Runtime: %s; vLLM-Omni's own loading is used", message)
    return None


def install_gate() -> bool:
    """Wrap ``HWRLoaderMixin._hwr_eligibility_mode``; False when already wrapped."""
    from vllm_omni.diffusion.model_loader.host_weight_loader import HWRLoaderMixin

    with _lock:
        original = HWRLoaderMixin.__dict__["_hwr_eligibility_mode"]
        if getattr(original, _MARK, False):
            return False

        def _hwr_eligibility_mode(self: Any, model: Any, modules: Any, *, dist_offload: bool, use_allgather: bool,
                                  load_format: str) -> Any:
            return _gated(original, self, model, modules, dist_offload=dist_offload, use_allgather=use_allgather,
                          load_format=load_format)

        setattr(_hwr_eligibility_mode, _MARK, True)
        _hwr_eligibility_mode.__wrapped__ = original  # type: ignore[attr-defined]
        _hwr_eligibility_mode.__doc__ = original.__doc__
        HWRLoaderMixin._hwr_eligibility_mode = _hwr_eligibility_mode  # type: ignore[method-assign]
        return True


def uninstall_gate() -> bool:
    from vllm_omni.diffusion.model_loader.host_weight_loader import HWRLoaderMixin

    with _lock:
        current = HWRLoaderMixin.__dict__["_hwr_eligibility_mode"]
        if not getattr(current, _MARK, False):
            return False
        HWRLoaderMixin._hwr_eligibility_mode = current.__wrapped__  # type: ignore[method-assign]
        return True
