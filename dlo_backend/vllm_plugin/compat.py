"""Is this vLLM-Omni one the plugin knows? A pure check of the version and every attribute used.

The plugin replaces the store behind ``HostWeightRuntime.from_config`` and builds vLLM-Omni's own
``HostWeightLease``/``StoreResult`` objects, so it depends on private-ish shapes of vLLM-Omni
0.30. ``check()`` verifies each of them before anything is patched; a single mismatch disables
the plugin (the caller logs the report once) instead of failing a serving process halfway.

Contract: ``check()`` never raises; it imports ``vllm_omni.host_weight_runtime`` (torch, no GPU)
and returns a ``CompatReport``. Limits: it checks names and signatures, not behaviour; the test
suite covers behaviour for the supported versions.
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
    "BuildRequest", "CanonicalJson", "CoordinationScope", "FailureCode", "HostWeightFailure",
    "HostWeightLease", "HostWeightRuntime", "LeaseProvenance", "MappedHostRegion", "ProductionMetadata",
    "ResolutionStage", "RuntimeMode", "StoreResult", "StoreStatus", "TensorKind", "TensorWriteSpec",
    "ValidationLevel", "WeightArtifactIdentity", "WeightManifest",
)
_ENUM_MEMBERS = {
    "StoreStatus": ("HIT", "MISS", "BUILT", "JOINED", "INVALID", "TIMEOUT", "FAILED"),
    "ValidationLevel": ("MANIFEST_AND_METADATA", "FULL_CHECKSUM", "FS_VERITY"),
    "RuntimeMode": ("DISABLED", "PREFERRED", "REQUIRED"),
    "CoordinationScope": ("SINGLE_PROCESS",),
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
    ("HostWeightLease", "__init__"): ("identity", "manifest", "tensors", "mapped_regions", "provenance",
                                      "resource_closers", "release_artifact_lock"),
}
_DATACLASS_FIELDS = {
    "LeaseProvenance": ("resolution_id", "identity_digest", "artifact_content_sha256", "domain_uuid",
                        "publication_id", "resolution_source", "artifact_origin", "producer_id", "provider_id",
                        "validation_level", "backing_fingerprint"),
    "MappedHostRegion": ("file_name", "address", "length", "read_only"),
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
    return CompatReport(not problems, version, tuple(problems))


def _signature_problems(cls: Any, cls_name: str, attr: str, params: tuple[str, ...]) -> list[str]:
    if cls is None:
        return []
    try:
        have = set(inspect.signature(getattr(cls, attr)).parameters)
    except (AttributeError, TypeError, ValueError):
        return [f"{cls_name}.{attr} has no inspectable signature"]
    return [f"{cls_name}.{attr} lacks parameter {p!r}" for p in params if p not in have]
