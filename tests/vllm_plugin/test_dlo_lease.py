"""vLLM-Omni's own DLO backend (DistributedLayerwiseOffloadBackend) on CPU, fed by an hwrd lease.

Cold start: canonical weights, post-load publication through hwrd. Warm start: the model is built
on ``meta`` (no canonical materialization), the lease's read-only tensors are bound into it the
way vLLM-Omni's final-layout restorer commits them, and DLO takes the lease from a
``HostWeightLeaseCarrier`` and streams it. The output must equal the unhooked model's, and
disabling DLO must close the lease (the daemon then holds none).

vLLM-Omni has no CPU OmniPlatform; the ``cpu_platform`` fixture gives its unspecified platform the
few device calls DLO makes (synchronize, empty_cache, memory queries) as CPU no-ops. That is the
accelerator boundary, the only fake here.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm_omni")

import torch
from torch import nn
from vllm_omni.host_weight_runtime import (
    HostWeightLeaseCarrier,
    PostLoadPublicationOutcome,
    ResolutionOutcome,
)
from vo_helpers import TensorProducer, identity, runtime

import hwr.client


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.lin = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x)))


class TinyDiT(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self) -> None:
        super().__init__()
        self.proj_in = nn.Linear(32, 32)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.proj_out = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x)
        return self.proj_out(x)


class TinyPipeline(nn.Module):
    _dit_modules = ["transformer"]
    _encoder_modules: list[str] = []
    _vae_modules: list[str] = []
    _resident_modules: list[str] = []

    def __init__(self, transformer: TinyDiT) -> None:
        super().__init__()
        self.transformer = transformer


@pytest.fixture
def cpu_platform(monkeypatch):
    from vllm_omni.platforms import current_omni_platform

    platform = type(current_omni_platform)
    for name, fn in {
        "synchronize": lambda cls: None,
        "empty_cache": lambda cls: None,
        "get_free_memory": lambda cls, device=None: 1 << 40,
        "get_device_memory": lambda cls, device=None: (1 << 40, 1 << 40),
        "get_torch_device": lambda cls, local_rank=None: torch.device("cpu"),
        "get_device_count": lambda cls: 1,
    }.items():
        monkeypatch.setattr(platform, name, classmethod(fn), raising=False)


def _bind_lease(model: nn.Module, tensors) -> None:
    """What vLLM-Omni's final-layout restore commit does for meta targets."""
    for name, source in tensors.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        assert parent._parameters[leaf].is_meta
        parent._parameters[leaf] = nn.Parameter(source, requires_grad=False)


def _dlo(plan=None):
    from vllm_omni.diffusion.offloader.base import OffloadConfig
    from vllm_omni.diffusion.offloader.config import OffloadStrategy
    from vllm_omni.diffusion.offloader.distributed_layerwise_backend import DistributedLayerwiseOffloadBackend

    config = OffloadConfig(strategy=OffloadStrategy.DISTRIBUTED_LAYER_WISE, pin_cpu_memory=False,
                           dlo_use_allgather=False)
    return DistributedLayerwiseOffloadBackend(config, torch.device("cpu"), host_weight_plan=plan)


@pytest.mark.usefixtures("plugin", "cpu_platform")
def test_dlo_consumes_an_hwrd_lease_and_matches_the_unhooked_model(vo_hwrd, runtime_root, monkeypatch):
    from vllm_omni.diffusion.model_loader.host_weight_plan import HostWeightPlan

    monkeypatch.setenv("HWR_SOCKET", str(vo_hwrd.socket))
    torch.manual_seed(0)
    canonical = TinyDiT().eval()
    x = torch.randn(3, 32)
    with torch.no_grad():
        expected = canonical(x)
    ident = identity("dlo/tiny-dit")
    weights = {n: p.detach().clone() for n, p in canonical.state_dict().items()}

    rt = runtime(runtime_root)
    assert rt.resolve(ident).report.outcome is ResolutionOutcome.CANONICAL_FALLBACK
    assert rt.publish_after_load(ident, producer=TensorProducer(ident, weights)).outcome is (
        PostLoadPublicationOutcome.PUBLISHED)

    # Warm start: no canonical materialization at all.
    warm = rt.resolve(ident)
    assert warm.report.outcome is ResolutionOutcome.LOCAL_HIT
    with torch.device("meta"):
        model = TinyDiT().eval()
    _bind_lease(model, warm.lease.tensors)
    lease_ptrs = {t.data_ptr() for t in warm.lease.tensors.values()}
    assert {p.data_ptr() for p in model.parameters()} == lease_ptrs  # views of the shared pages, no copy
    carrier = HostWeightLeaseCarrier(warm.lease)
    backend = _dlo(HostWeightPlan(backing_kind="host_weight_runtime", bindings={}, lease_carrier=carrier))
    backend.enable(TinyPipeline(model))
    assert carrier.taken and backend.enabled
    # Streamed blocks hold placeholders between forwards: their bytes come from the lease per step.
    assert all(p.numel() == 0 for block in model.blocks[1:] for p in block.parameters())
    with torch.no_grad():
        first, second = model(x), model(x)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    with hwr.client.connect(vo_hwrd.socket) as c:
        assert [x["key"] for x in c.leases()] == [ident.key]

    backend.disable()
    assert warm.lease.closed
    with hwr.client.connect(vo_hwrd.socket) as c:
        assert c.leases() == []

    # The same backend without a lease (ordinary loader path) on the canonical model: same output.
    plain = _dlo()
    plain.enable(TinyPipeline(canonical))
    with torch.no_grad():
        assert torch.equal(canonical(x), expected)
    plain.disable()
