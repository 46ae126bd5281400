"""vLLM-Omni's final-layout restorer plans and commits a restore from an hwrd lease, called directly.

In this process, with no distributed setup: vLLM-Omni's own identity builder
(``build_final_layout_identity``), BF16 producer, runtime (with hwr's plugin installed, so the
store is hwrd) and ``FinalLayoutTensorRestorer``, over a small DiT of plain torch modules that
declares vLLM-Omni's restore contract. The restorer refuses any two lease tensors that share a
storage (``(untyped_storage().data_ptr(), nbytes)``), so this is the unit-level proof that a
lease's tensors are acceptable to it; ``test_omni_warm_start`` proves the same through the whole
loader with a real vLLM-Omni DiT.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm_omni")

import torch
from safetensors.torch import save_file
from torch import nn
from vllm_omni.diffusion.model_loader.host_weights import (
    FINAL_LAYOUT_BF16_POLICY,
    FinalLayoutBF16Producer,
    FinalLayoutLoaderIdentity,
    FinalLayoutRequest,
    FinalLayoutTensorRestorer,
    ImplementationIdentity,
    PreparedWeightSource,
    build_final_layout_identity,
)
from vllm_omni.diffusion.models.host_weight_contract import FinalLayoutModelContract
from vllm_omni.host_weight_runtime import PostLoadPublicationOutcome, ResolutionOutcome
from vo_helpers import runtime


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(24)
        self.qkv = nn.Linear(24, 72)
        self.out = nn.Linear(24, 24, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        return x + self.out(torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v)


class SmallDiT(nn.Module):
    host_weight_restore_contract = FinalLayoutModelContract(implementation_id="hwr-test-small-dit", version="1")

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 24)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(24, 8)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def validate_restored_host_weights(self) -> None:
        if len(self.blocks) != 3:
            raise ValueError("incomplete block stack")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) * self.scale


class SmallPipeline(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = SmallDiT()


def _context(pipeline: SmallPipeline, checkpoint: Path):
    loader = FinalLayoutLoaderIdentity(
        implementation=ImplementationIdentity("hwr-test-loader", "1", "fingerprint-1"),
        model_config_fingerprint="config-1", weight_transform_fingerprint="transform-1")
    source = PreparedWeightSource(
        model_or_path=str(checkpoint), subfolder="transformer", requested_revision=None, prefix="transformer.",
        resolved_root=checkpoint / "transformer", weight_files=(checkpoint / "transformer" / "model.safetensors",),
        use_safetensors=True)
    return build_final_layout_identity(
        pipeline, dit_modules=(("transformer", pipeline.transformer),), prepared_sources=(source,),
        request=FinalLayoutRequest(model_id=str(checkpoint), loader=loader), policy=FINAL_LAYOUT_BF16_POLICY)


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("plugin")
def test_the_restorer_plans_and_commits_a_restore_from_an_hwrd_lease(
        vo_hwrd, runtime_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HWR_SOCKET", str(vo_hwrd.socket))
    torch.manual_seed(3)
    canonical = SmallPipeline().to(torch.bfloat16).eval()
    (tmp_path / "transformer").mkdir()
    save_file({n: t.contiguous() for n, t in canonical.transformer.state_dict().items()},
              str(tmp_path / "transformer" / "model.safetensors"))
    context = _context(canonical, tmp_path)
    dits = (("transformer", canonical.transformer),)
    rt = runtime(runtime_root)
    assert rt.resolve(context.identity).report.outcome is ResolutionOutcome.CANONICAL_FALLBACK
    published = rt.publish_after_load(context.identity, producer=FinalLayoutBF16Producer(context, canonical, dits))
    assert published.outcome is PostLoadPublicationOutcome.PUBLISHED, published

    warm = rt.resolve(context.identity)
    assert warm.report.outcome is ResolutionOutcome.LOCAL_HIT
    lease = warm.lease
    with torch.device("meta"):
        restored = SmallPipeline().to(torch.bfloat16).eval()
    plan = FinalLayoutTensorRestorer(context).plan_restore(restored, lease)  # refuses aliasing storages
    plan.commit()

    regions = [(r.address, r.address + r.length) for r in lease.mapped_regions]
    for name, tensor in restored.state_dict().items():
        assert not tensor.is_meta and torch.equal(tensor, canonical.state_dict()[name]), name
        assert any(lo <= tensor.data_ptr() < hi for lo, hi in regions), f"{name} is not a view of the lease"
    x = torch.randn(2, 5, 8).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(restored.transformer(x), canonical.transformer(x))
    lease.close()
