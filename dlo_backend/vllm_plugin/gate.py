"""Which path a DLO load takes when hwrd is configured: a pure decision, and the loader gate over it.

vLLM-Omni 0.30's ``HWRLoaderMixin._hwr_eligibility_mode`` returns before any lookup when DLO uses
AllGather, even in ``required`` mode, and refuses (``required``) or skips (``preferred``) DiTs
without a final-layout restore contract, which are the ones it loads by direct checkpoint mmap.
With the plugin active and hwrd configured, ``decide_load`` decides instead:

    inputs                                                   -> decision
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

**Nested DiTs on the CHECKPOINT path.** vLLM-Omni 0.30's direct-mmap planner
(``host_weight_plan._planned_source_prefixes``) wants one component weight source per DiT name,
but Cosmos3 lists a DiT nested inside another (``_dit_modules = ["transformer.language_model",
"transformer"]``) with one source, prefix ``transformer.``, covering both: the planner refuses
("missing prefixes: ['transformer.language_model.']") and every Cosmos3 DLO load falls back to the
ordinary loader, so there is no plan whose files hwrd could lease. For a load this gate sent down
the CHECKPOINT path only (hwrd configured, a ``_remap_ckpt_key`` pipeline, DLO on), the same
install wraps that function so that a DiT without a source of its own is covered by the source
of a DiT that encloses it (``nested_dits``); a DiT enclosed by none is still refused by
vLLM-Omni's own check, and the rest of the planner (source map through ``_remap_ckpt_key``,
coverage of every DiT tensor, metadata) runs unchanged. Every other load calls the original.
"""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass
from typing import Any

from hwr.client.errors import ConfigError
from hwr.dlo_backend.vllm_plugin.config import resolve_target

__all__ = ["GateInputs", "LoadDecision", "LoadPath", "decide_load", "install_gate", "nested_dits", "uninstall_gate"]

log = logging.getLogger("hwr.vllm_plugin")
_MARK = "_hwr_vllm_gate"
_lock = threading.Lock()
_warned: set[str] = set()
# Whether the load in progress on this thread took the CHECKPOINT path (set by the gate, read by
# the planner wrapper: vLLM-Omni's loader calls both on one thread, the gate first).
_checkpoint_load = threading.local()


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
class LoadDecision:
    """The path one load takes, and why when it is refused."""

    path: LoadPath
    reason: str = ""


def decide_load(g: GateInputs) -> LoadDecision:
    """The path of one load (see the module table); pure."""
    if g.mode == "disabled" or not g.dist_offload:
        return LoadDecision(LoadPath.UPSTREAM)
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
        return LoadDecision(LoadPath.REFUSE, ", ".join(reasons))
    if g.contracts:
        return LoadDecision(LoadPath.FINAL_LAYOUT if g.use_allgather else LoadPath.UPSTREAM)
    if g.remaps_checkpoint:
        return LoadDecision(LoadPath.CHECKPOINT)
    return LoadDecision(LoadPath.REFUSE, "a DiT without a final-layout restore contract that is not loaded by "
                                 "direct checkpoint mmap")


def inputs_of(loader: Any, model: Any, modules: Any, *, dist_offload: bool, use_allgather: bool,
              load_format: str) -> GateInputs:
    """The decision's inputs, read from vLLM-Omni's loader, pipeline and discovered modules."""
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

    _checkpoint_load.active = False
    try:
        target = resolve_target(getattr(loader.od_config, "host_weight_runtime_root", None))
    except ConfigError:
        target = None  # the runtime's construction reports a malformed marker (interception)
    if target is None:
        return upstream(use_allgather)
    decision = decide_load(inputs_of(loader, model, modules, dist_offload=dist_offload, use_allgather=use_allgather,
                                 load_format=load_format))
    if decision.path is LoadPath.UPSTREAM:
        return upstream(use_allgather)
    if decision.path is LoadPath.FINAL_LAYOUT:
        return upstream(False)  # the same gate and lookup as rank-local; DLO then gathers from the lease
    required = getattr(loader.od_config, "host_weight_runtime_mode", "") == "required"
    if decision.path is LoadPath.CHECKPOINT:
        _checkpoint_load.active = True
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


def nested_dits(dit_names: list[str], source_prefixes: set[str]) -> set[str]:
    """The DiTs without a weight source of their own that lie inside a DiT that has one; pure.

    Names are vLLM-Omni's dotted DiT paths (``transformer.language_model``); a source prefix
    ends with a dot (``transformer.``).
    """
    sourced = [name for name in dit_names if f"{name}." in source_prefixes]
    return {name for name in dit_names if f"{name}." not in source_prefixes
            and any(name.startswith(f"{outer}.") for outer in sourced)}


def _planner_wrapper(original: Any) -> Any:
    def _planned_source_prefixes(sources: Any, dit_modules: Any) -> Any:
        if not getattr(_checkpoint_load, "active", False):
            return original(sources, dit_modules)
        names = [name for name, _module in dit_modules]
        nested = nested_dits(names, {getattr(source, "prefix", "") for source in sources})
        # vLLM-Omni's own check over the DiTs that are not nested (a DiT no source covers still fails
        # it); the nested ones are planned with the enclosing DiT's source, as their tensors are its.
        planned = original(sources, [(name, module) for name, module in dit_modules if name not in nested])
        return frozenset(planned) | {f"{name}." for name in nested}

    setattr(_planned_source_prefixes, _MARK, True)
    _planned_source_prefixes.__wrapped__ = original  # type: ignore[attr-defined]
    _planned_source_prefixes.__doc__ = original.__doc__
    return _planned_source_prefixes


def install_gate() -> bool:
    """Wrap ``HWRLoaderMixin._hwr_eligibility_mode`` and the direct-mmap planner's source check
    (see the module docstring); False when already wrapped."""
    import vllm_omni.diffusion.model_loader.host_weight_plan as planning
    from vllm_omni.diffusion.model_loader.host_weight_loader import HWRLoaderMixin

    with _lock:
        if not getattr(planning._planned_source_prefixes, _MARK, False):
            planning._planned_source_prefixes = _planner_wrapper(planning._planned_source_prefixes)
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
    import vllm_omni.diffusion.model_loader.host_weight_plan as planning
    from vllm_omni.diffusion.model_loader.host_weight_loader import HWRLoaderMixin

    with _lock:
        if getattr(planning._planned_source_prefixes, _MARK, False):
            planning._planned_source_prefixes = planning._planned_source_prefixes.__wrapped__
        current = HWRLoaderMixin.__dict__["_hwr_eligibility_mode"]
        if not getattr(current, _MARK, False):
            return False
        HWRLoaderMixin._hwr_eligibility_mode = current.__wrapped__  # type: ignore[method-assign]
        return True
