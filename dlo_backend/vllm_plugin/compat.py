"""Is this vLLM-Omni one the plugin knows? A pure check of the version and every attribute used.

The plugin replaces the store behind ``HostWeightRuntime.from_config`` and builds vLLM-Omni's own
``HostWeightLease``/``StoreResult`` objects, so it depends on private-ish shapes of vLLM-Omni
0.30. ``check()`` verifies each of them before anything is patched; a single mismatch disables
the plugin (the caller logs the report once) instead of failing a serving process halfway.

Beyond the runtime's names it checks (``dlo_problems``) every loader and DLO symbol the loader
gate, the backend factory, the backend subclass and the loader's "unchanged" snapshot
(``unchanged``) wrap, override or read: signatures with the
parameters passed, dataclass fields, and the private attributes vLLM-Omni's backend constructor
must still set.

Contract: ``check()`` never raises; it imports ``vllm_omni.host_weight_runtime`` and the diffusion
loader and offloader (torch, no GPU) and returns a ``CompatReport``. Limits: it checks names and
signatures, not behaviour; the test suite covers behaviour for the supported versions.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

__all__ = ["SUPPORTED_SERIES", "CompatReport", "check"]

#: vLLM-Omni major.minor series this plugin was written and tested against.
SUPPORTED_SERIES = ("0.30",)

_RUNTIME_NAMES = (
    "AttemptResult", "HostWeightResolution", "ResolutionAction", "ResolutionAttempt", "ResolutionOutcome",
    "ResolutionReport", "BuildRequest", "CanonicalJson", "CoordinationScope", "FailureCode", "HostWeightFailure",
    "HostWeightLease", "HostWeightRuntime", "LeaseProvenance", "MappedHostRegion", "ProductionMetadata",
    "ResolutionStage", "RuntimeMode", "StoreResult", "StoreStatus", "TensorKind", "TensorWriteSpec",
    "ValidationLevel", "WeightArtifactIdentity", "WeightManifest",
)
_ENUM_MEMBERS = {
    "StoreStatus": ("HIT", "MISS", "BUILT", "JOINED", "INVALID", "TIMEOUT", "FAILED"),
    "ValidationLevel": ("MANIFEST_AND_METADATA", "FULL_CHECKSUM", "FS_VERITY"),
    "RuntimeMode": ("DISABLED", "PREFERRED", "REQUIRED"),
    "CoordinationScope": ("SINGLE_PROCESS",),
    "ResolutionOutcome": ("LOCAL_HIT", "CANONICAL_FALLBACK", "FAILED"),
    "AttemptResult": ("SKIPPED",),
    "ResolutionAction": ("CANONICAL_FALLBACK", "FAIL_STARTUP"),
    "ResolutionStage": ("CONFIGURATION", "DOMAIN", "LOOKUP", "VALIDATION", "PRODUCTION", "CAPACITY", "LIFECYCLE"),
    "FailureCode": ("INVALID_CONFIG", "DOMAIN_UNAVAILABLE", "ARTIFACT_DENIED", "ACTIVE_BUILD_TIMEOUT",
                    "MANIFEST_INCOMPATIBLE", "MANIFEST_CORRUPT", "CHECKSUM_MISMATCH", "IDENTITY_COLLISION",
                    "PRODUCER_UNAVAILABLE", "PRODUCER_UNSUPPORTED", "PRODUCER_FAILED", "PUBLICATION_FAILED",
                    "UNSUPPORTED"),
}
_SIGNATURES = {
    ("HostWeightRuntime", "__init__"): ("config", "store", "observer", "publication_observer",
                                        "_initialization_failure"),
    ("HostWeightRuntime", "from_config"): ("config", "observer", "publication_observer"),
    ("HostWeightRuntime", "resolve"): ("identity", "producer"),
    ("HostWeightLease", "__init__"): ("identity", "manifest", "tensors", "mapped_regions", "provenance",
                                      "resource_closers", "release_artifact_lock"),
}
_DATACLASS_FIELDS = {
    "LeaseProvenance": ("resolution_id", "identity_digest", "artifact_content_sha256", "domain_uuid",
                        "publication_id", "resolution_source", "artifact_origin", "producer_id", "provider_id",
                        "validation_level", "backing_fingerprint"),
    "MappedHostRegion": ("file_name", "address", "length", "read_only"),
    "HostWeightResolution": ("report", "lease"),
    "ResolutionReport": ("resolution_id", "outcome", "attempts", "elapsed_seconds"),
    "ResolutionAttempt": ("stage", "result", "action", "elapsed_seconds", "failure"),
    "ProductionMetadata": ("producer_schema", "restorer_schema", "format_metadata"),
    "TensorWriteSpec": ("name", "shape", "dtype", "kind", "role"),
}


@dataclass(frozen=True)
class CompatReport:
    ok: bool
    version: str
    problems: tuple[str, ...]

    def summary(self) -> str:
        return f"vLLM-Omni {self.version}: " + ("compatible" if self.ok else "; ".join(self.problems))


def _series(version: str) -> str:
    return ".".join(version.split(".")[:2])


def check() -> CompatReport:
    problems: list[str] = []
    try:
        vllm_omni = importlib.import_module("vllm_omni")
        version = str(getattr(vllm_omni, "__version__", "unknown"))
    except Exception as exc:  # any import failure means: do nothing
        return CompatReport(False, "not importable", (f"import vllm_omni failed: {exc}",))
    if _series(version) not in SUPPORTED_SERIES:
        problems.append(f"version {version} is not in the supported series {', '.join(SUPPORTED_SERIES)}")
    try:
        hwr_module = importlib.import_module("vllm_omni.host_weight_runtime")
        importlib.import_module("vllm_omni.plugins")
    except Exception as exc:
        return CompatReport(False, version, (*problems, f"import vllm_omni.host_weight_runtime failed: {exc}"))
    found: dict[str, Any] = {}
    for name in _RUNTIME_NAMES:
        if hasattr(hwr_module, name):
            found[name] = getattr(hwr_module, name)
        else:
            problems.append(f"vllm_omni.host_weight_runtime.{name} is missing")
    for cls_name, members in _ENUM_MEMBERS.items():
        enum = found.get(cls_name)
        problems.extend(f"{cls_name}.{m} is missing" for m in members
                        if enum is not None and not hasattr(enum, m))
    for (cls_name, attr), params in _SIGNATURES.items():
        problems.extend(_signature_problems(found.get(cls_name), cls_name, attr, params))
    runtime = found.get("HostWeightRuntime")
    if runtime is not None and not isinstance(runtime.__dict__.get("from_config"), classmethod):
        problems.append("HostWeightRuntime.from_config is not a classmethod")
    for cls_name, names in _DATACLASS_FIELDS.items():
        cls = found.get(cls_name)
        if cls is None:
            continue
        have = {f.name for f in fields(cls)} if is_dataclass(cls) else set()
        problems.extend(f"{cls_name}.{n} field is missing" for n in names if n not in have)
    manifest = found.get("WeightManifest")
    if manifest is not None and not callable(getattr(manifest, "from_dict", None)):
        problems.append("WeightManifest.from_dict is missing")
    problems.extend(dlo_problems())
    return CompatReport(not problems, version, tuple(problems))


# The loader gate, the DLO backend factory and the backend subclass (``gate``, ``factory``,
# ``offload``, ``checkpoints``): every function they wrap or override with the parameters they
# pass, every attribute they read, and every private attribute the subclass relies on
# vLLM-Omni's ``__init__`` to set.
_LOADER = "vllm_omni.diffusion.model_loader.host_weight_loader"
_PLAN = "vllm_omni.diffusion.model_loader.host_weight_plan"
_OFFLOADER = "vllm_omni.diffusion.offloader"
_BACKEND = "vllm_omni.diffusion.offloader.distributed_layerwise_backend"
_DLO_SIGNATURES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (_LOADER, "HWRLoaderMixin._hwr_eligibility_mode", ("model", "modules", "dist_offload", "use_allgather",
                                                       "load_format")),
    (_LOADER, "HWRLoaderMixin._snapshot_final_layout_tensors", ("model", "names")),
    (_LOADER, "HWRLoaderMixin._assert_final_layout_tensors_unchanged", ("model", "snapshot")),
    (_OFFLOADER, "get_offload_backend", ("od_config", "device", "host_weight_plan")),
    (_PLAN, "_planned_source_prefixes", ("sources", "dit_modules")),
    (_OFFLOADER, "enable_offload_backend", ("od_config", "pipeline", "device")),
    (_BACKEND, "DistributedLayerwiseOffloadBackend.__init__", ("config", "device", "host_weight_plan")),
    (_BACKEND, "DistributedLayerwiseOffloadBackend._enable", ("pipeline",)),
    (_BACKEND, "DistributedLayerwiseOffloadBackend._install_hook_group", ("blocks", "component", "use_dit_mmap")),
    (_BACKEND, "DistributedLayerwiseOffloadBackend._component_transport", ("component",)),
    (_BACKEND, "DistributedLayerwiseOffloadBackend._load_weights_via_mmap", ("pipeline", "dits", "plan")),
    (_BACKEND, "DistributedLayerwiseOffloadBackend._release_mmap_handles", ()),
    (_BACKEND, "DistributedLayerwiseOffloadBackend._disable", ("restore_allgather_weights",)),
    (_BACKEND, "DistributedLayerwiseOffloadBackend.disable", ()),
    (_BACKEND, "DistributedLayerwiseOffloadBackend.shutdown", ()),
)
_DLO_ATTRIBUTES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("vllm_omni.diffusion.offloader.base", "OffloadConfig",
     ("dp_size", "dlo_host_registration_limit_gib", "pin_cpu_memory", "uses_allgather")),
    ("vllm_omni.diffusion.offloader.config", "DIT_COMPONENT", ()),
    (_PLAN, "HostWeightPlan", ("backing_kind", "bindings", "lease_carrier")),
    (_PLAN, "TensorBinding", ("checkpoint_key", "file_path", "transform")),
    ("vllm_omni.host_weight_runtime", "HostWeightLease", ("closed", "close")),
    ("vllm_omni.host_weight_runtime.manifest", "TensorManifestEntry", ("name", "sha256")),
    ("vllm_omni.diffusion.model_loader.diffusers_loader", "DiffusersPipelineLoader",
     ("load_model", "take_host_weight_plan")),
)
# Set by HostWeightLease.__init__ (instance attributes) and read by the backend subclass.
_LEASE_STATE = ("identity", "tensors", "mapped_regions")
# Set by DistributedLayerwiseOffloadBackend.__init__ and read or set by the subclass.
_BACKEND_STATE = ("config", "device", "enabled", "dp_group", "host_weight_plan", "_host_weight_lease",
                  "_using_rank_local_mmap", "_mmap_transforms_by_tensor_id", "_poisoned_reason")


def _resolve(module: str, qualname: str) -> Any:
    node: Any = importlib.import_module(module)
    for part in qualname.split("."):
        node = getattr(node, part)
    return node


def _global_names(code: Any) -> set[str]:
    """Names a function's code (and the code of functions nested in it) looks up."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _global_names(const)
    return names


def dlo_problems() -> list[str]:
    """Problems with the loader and DLO symbols the plugin touches (empty when all are there)."""
    problems: list[str] = []
    for module, qualname, params in _DLO_SIGNATURES:
        try:
            have = set(inspect.signature(_resolve(module, qualname)).parameters)
        except Exception as exc:  # import error, missing name, no signature: all mean "do nothing"
            problems.append(f"{module}.{qualname} is unavailable ({type(exc).__name__})")
            continue
        problems.extend(f"{qualname} lacks parameter {p!r}" for p in params if p not in have)
    for module, qualname, attrs in _DLO_ATTRIBUTES:
        try:
            obj = _resolve(module, qualname)
        except Exception as exc:
            problems.append(f"{module}.{qualname} is unavailable ({type(exc).__name__})")
            continue
        names = {f.name for f in fields(obj)} if is_dataclass(obj) else set()
        problems.extend(f"{qualname}.{a} is missing" for a in attrs if not hasattr(obj, a) and a not in names)
    try:
        backend = _resolve(_BACKEND, "DistributedLayerwiseOffloadBackend")
        assigned = set(backend.__init__.__code__.co_names) | set(
            _resolve("vllm_omni.diffusion.offloader.base", "OffloadBackend").__init__.__code__.co_names)
        problems.extend(f"DistributedLayerwiseOffloadBackend no longer sets {a}" for a in _BACKEND_STATE
                        if a not in assigned)
        lease_init = _resolve("vllm_omni.host_weight_runtime", "HostWeightLease").__init__.__code__.co_names
        problems.extend(f"HostWeightLease no longer sets {a}" for a in _LEASE_STATE if a not in lease_init)
        problems.extend(_snapshot_problems())
        enable = _resolve(_OFFLOADER, "enable_offload_backend")
        if "get_offload_backend" not in _global_names(enable.__code__):
            problems.append("enable_offload_backend no longer looks get_offload_backend up at call time")
    except Exception as exc:
        problems.append(f"the DLO backend cannot be inspected ({type(exc).__name__})")
    return problems


def _snapshot_problems() -> list[str]:
    """``unchanged`` replaces the loader's snapshot function: it must still be a static method
    that both snapshots (after the restore, after the warm finalization) look up at call time,
    and whose entries nothing but the equality check reads."""
    mixin = _resolve(_LOADER, "HWRLoaderMixin")
    problems = []
    if not isinstance(mixin.__dict__.get("_snapshot_final_layout_tensors"), staticmethod):
        problems.append("HWRLoaderMixin._snapshot_final_layout_tensors is not a staticmethod")
    for caller in ("_resolve_hwr", "_assert_final_layout_tensors_unchanged"):
        code = getattr(mixin.__dict__.get(caller), "__func__", mixin.__dict__.get(caller))
        if code is None or "_snapshot_final_layout_tensors" not in _global_names(code.__code__):
            problems.append(f"HWRLoaderMixin.{caller} no longer takes its snapshot through "
                            "_snapshot_final_layout_tensors")
    return problems


def _signature_problems(cls: Any, cls_name: str, attr: str, params: tuple[str, ...]) -> list[str]:
    if cls is None:
        return []
    try:
        have = set(inspect.signature(getattr(cls, attr)).parameters)
    except (AttributeError, TypeError, ValueError):
        return [f"{cls_name}.{attr} has no inspectable signature"]
    return [f"{cls_name}.{attr} lacks parameter {p!r}" for p in params if p not in have]
