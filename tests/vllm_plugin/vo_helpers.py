"""Identities, producers and runtime configs for the plugin tests (imports vLLM-Omni)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from vllm_omni.host_weight_runtime import (
    AdaptationIdentity,
    CanonicalJson,
    ComponentIdentity,
    HostWeightRuntime,
    HostWeightRuntimeConfig,
    IntegrityPolicy,
    LookupPhase,
    ProducerIdentity,
    ProductionMetadata,
    ProductionPolicy,
    RuntimeMode,
    RuntimeWeightLayout,
    StorageDomainPolicy,
    TensorKind,
    TensorWriteSpec,
    ValidationLevel,
    WeightArtifactIdentity,
    WeightProductionSpec,
    WeightRepresentation,
    WeightSourceIdentity,
)
from vllm_omni.host_weight_runtime.filesystem import detect_storage_class
from vllm_omni.host_weight_runtime.protocols import ProductionSourceMode

MANIFEST_SCHEMA = "hwr-test-manifest-1"
RESTORER_SCHEMA = "hwr-test-restorer-1"
PRODUCER_ID = "hwr-test-producer"


def identity(model_id: str, *, tp_size: int = 1, tp_rank: int = 0) -> WeightArtifactIdentity:
    return WeightArtifactIdentity(
        schema_version=1,
        source=WeightSourceIdentity(model_id, "main", f"sha256:{hashlib.sha256(model_id.encode()).hexdigest()}"),
        component=ComponentIdentity("transformer", "diffusion-transformer"),
        representation=WeightRepresentation("final-layout", "bfloat16", CanonicalJson.from_value({"q": None})),
        layout=RuntimeWeightLayout("dense", tp_size, tp_rank),
        adaptation=AdaptationIdentity(),
        producer=ProducerIdentity(PRODUCER_ID, "1", "impl-1", MANIFEST_SCHEMA, RESTORER_SCHEMA),
    )


def tensors(seed: int, n: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"blocks.{i}.weight": torch.randn(32, 16, generator=g).to(torch.bfloat16) for i in range(n)}
    out["norm.scale"] = torch.randn(16, generator=g)
    return out


class TensorProducer:
    """A vLLM-Omni producer over fixed tensors: two payload files, whole tensors and rows."""

    def __init__(self, ident: WeightArtifactIdentity, data: dict[str, torch.Tensor], *,
                 phase: LookupPhase = LookupPhase.POST_LOAD_ONLY, format_metadata: object = None,
                 fail: bool = False) -> None:
        self.spec = WeightProductionSpec(PRODUCER_ID, (ident,), ProductionSourceMode.FINALIZED_MODEL,
                                         lookup_phase=phase)
        self.data = data
        self.calls = 0
        self.format_metadata = format_metadata
        self.fail = fail

    def produce(self, writer: object) -> ProductionMetadata:
        self.calls += 1
        if self.fail:
            raise RuntimeError("producer exploded")
        names = sorted(self.data)
        first, second = names[: len(names) // 2], names[len(names) // 2:]
        specs = lambda group: tuple(  # noqa: E731
            TensorWriteSpec(n, tuple(self.data[n].shape), self.data[n].dtype,
                            TensorKind.BUFFER if n.startswith("norm") else TensorKind.PARAMETER) for n in group)
        with writer.open_tensor_file("part-1.safetensors", specs(first), ordered=True) as out:
            for n in first:
                out.write_tensor(n, self.data[n])
        with writer.open_tensor_file("part-2.safetensors", specs(second)) as out:
            for n in second:
                t = self.data[n]
                if t.dim() and t.shape[0] > 1:
                    half = t.shape[0] // 2
                    out.write_rows(n, 0, t[:half])
                    out.write_rows(n, half, t[half:])
                else:
                    out.write_tensor(n, t)
        fm = CanonicalJson.empty() if self.format_metadata is None else CanonicalJson.from_value(self.format_metadata)
        return ProductionMetadata(MANIFEST_SCHEMA, RESTORER_SCHEMA, fm)


def runtime(root: Path, mode: RuntimeMode = RuntimeMode.PREFERRED, *, local_build: bool = False,
            validation: ValidationLevel = ValidationLevel.MANIFEST_AND_METADATA) -> HostWeightRuntime:
    return HostWeightRuntime.from_config(HostWeightRuntimeConfig(
        mode=mode, domain=StorageDomainPolicy(root=root, storage_class=detect_storage_class(root)),
        production=ProductionPolicy(allow_local_build=local_build, allow_post_load_publish=True),
        integrity=IntegrityPolicy(local_lookup=validation)))


def sha256_of(t: torch.Tensor) -> str:
    flat = t.contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"").hexdigest()
