"""The plugin's pure decisions for the AllGather and checkpoint paths, and its compat check of them.

``gate.decide_load`` (which path a load takes), ``factory.choose`` (which DLO backend a startup gets),
``offload.block_paths`` (which module lists a DiT ring is), ``checkpoints.relative_in`` (a plan
file under a registered checkpoint), ``BorrowedLease`` (a lease view lent without ownership) and
``compat.dlo_problems`` (every vLLM-Omni symbol the new hooks touch).
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm_omni")

import torch
from torch import nn

from hwr.client.carrier import MappedRegion
from hwr.client.errors import LeaseClosed
from hwr.dlo_backend.vllm_plugin import compat
from hwr.dlo_backend.vllm_plugin.borrowed import BorrowedLease, regions_of
from hwr.dlo_backend.vllm_plugin.checkpoints import relative_in
from hwr.dlo_backend.vllm_plugin.factory import Choice, choose
from hwr.dlo_backend.vllm_plugin.gate import GateInputs, LoadPath, decide_load
from hwr.dlo_backend.vllm_plugin.offload import block_paths

BASE = GateInputs(mode="required", dist_offload=True, use_allgather=True, load_format="default", use_hsdp=False,
                  quantized=False, lora=False, dits=1, contracts=True, remaps_checkpoint=False)


def test_allgather_restore_contract_dits_resolve_their_final_layout_through_hwrd() -> None:
    assert decide_load(BASE).path is LoadPath.FINAL_LAYOUT
    # Rank-local is vLLM-Omni's own gate, unchanged (it already resolves through the runtime).
    assert decide_load(dataclasses.replace(BASE, use_allgather=False)).path is LoadPath.UPSTREAM


def test_disabled_mode_or_no_dlo_leaves_vllm_omni_untouched() -> None:
    assert decide_load(dataclasses.replace(BASE, mode="disabled")).path is LoadPath.UPSTREAM
    assert decide_load(dataclasses.replace(BASE, dist_offload=False)).path is LoadPath.UPSTREAM


def test_checkpoint_remapping_pipelines_take_the_checkpoint_path_on_both_transports() -> None:
    for allgather in (True, False):
        g = dataclasses.replace(BASE, contracts=False, remaps_checkpoint=True, use_allgather=allgather)
        assert decide_load(g).path is LoadPath.CHECKPOINT


@pytest.mark.parametrize(("change", "named"), [
    ({"load_format": "diffusers"}, "load_format"), ({"use_hsdp": True}, "HSDP"),
    ({"quantized": True}, "quantization"), ({"lora": True}, "LoRA"), ({"dits": 0}, "without DiT"),
    ({"contracts": False}, "restore contract"),
])
def test_what_hwrd_cannot_serve_is_refused_by_name(change: dict[str, object], named: str) -> None:
    decision = decide_load(dataclasses.replace(BASE, **change))  # type: ignore[arg-type]
    assert decision.path is LoadPath.REFUSE and named in decision.reason


def test_backend_choice() -> None:
    assert choose(mode="required", configured=True, backing="host_weight_runtime", allgather_group=2) is Choice.HWRD
    assert choose(mode="required", configured=True, backing="host_weight_runtime", allgather_group=1) is Choice.KEEP
    assert choose(mode="preferred", configured=True, backing="checkpoint_mmap", allgather_group=1) is Choice.HWRD
    assert choose(mode="required", configured=True, backing=None, allgather_group=4) is Choice.FAIL
    # A cold AllGather start: its ranks must all run the backend whose rings agree on a transport.
    assert choose(mode="preferred", configured=True, backing=None, allgather_group=4) is Choice.HWRD
    assert choose(mode="preferred", configured=True, backing=None, allgather_group=1) is Choice.KEEP
    assert choose(mode="required", configured=False, backing="checkpoint_mmap", allgather_group=2) is Choice.KEEP
    assert choose(mode="disabled", configured=True, backing="checkpoint_mmap", allgather_group=2) is Choice.KEEP


class _Dit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dual = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
        self.single = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))


def test_block_paths_name_whole_module_lists_in_ring_order() -> None:
    pipe = nn.Module()
    pipe.transformer = _Dit()
    t = pipe.transformer
    assert block_paths(pipe, [*t.dual, *t.single]) == ["transformer.dual", "transformer.single"]
    assert block_paths(pipe, list(t.single)) == ["transformer.single"]
    assert block_paths(pipe, list(t.single)[1:]) is None  # a resident head: not a whole list
    assert block_paths(pipe, [nn.Linear(2, 2), nn.Linear(2, 2)]) is None  # not in the pipeline


def test_relative_in_matches_files_under_a_registered_directory_or_the_file_itself() -> None:
    assert relative_in("/m/snap/transformer/a.safetensors", "/m/snap") == "transformer/a.safetensors"
    assert relative_in("/m/snap/transformer/a.safetensors", "/m/snap/") == "transformer/a.safetensors"
    assert relative_in("/m/snap/a.safetensors", "/m/snap/a.safetensors") == "a.safetensors"
    assert relative_in("/m/snapshot/a.safetensors", "/m/snap") is None
    assert relative_in("/other/a.safetensors", "/m/snap") is None


def test_a_borrowed_lease_never_closes_its_owner_and_ends_with_it() -> None:
    owner_closed = [False]
    t = {"w": torch.zeros(2)}
    borrowed = BorrowedLease("k", t, (MappedRegion("f", 4096, 4096, True),), lambda: owner_closed[0])
    assert borrowed.tensors["w"] is t["w"] and borrowed.mapped_regions and not borrowed.closed
    owner_closed[0] = True
    assert borrowed.closed and borrowed.mapped_regions == ()
    with pytest.raises(LeaseClosed):
        borrowed.tensors  # noqa: B018
    owner_closed[0] = False
    borrowed.close()
    assert borrowed.closed


def test_regions_of_takes_vllm_omni_regions() -> None:
    from vllm_omni.host_weight_runtime import MappedHostRegion

    got = regions_of((MappedHostRegion(file_name="part-1.safetensors", address=8192, length=4096, read_only=True),))
    assert got == (MappedRegion("part-1.safetensors", 8192, 4096, True),)


def test_compat_checks_every_dlo_symbol_and_names_a_missing_one(monkeypatch: pytest.MonkeyPatch) -> None:
    assert compat.dlo_problems() == []
    from vllm_omni.diffusion.offloader.distributed_layerwise_backend import DistributedLayerwiseOffloadBackend

    monkeypatch.delattr(DistributedLayerwiseOffloadBackend, "_install_hook_group")
    problems = compat.dlo_problems()
    assert any("_install_hook_group" in p for p in problems), problems
    report = compat.check()
    assert not report.ok and any("_install_hook_group" in p for p in report.problems)


def test_compat_names_a_changed_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_omni.diffusion.model_loader.host_weight_loader import HWRLoaderMixin

    def renamed(self: object, model: object, modules: object, *, dist_offload: bool, allgather: bool,
                load_format: str) -> None:
        return None

    monkeypatch.setattr(HWRLoaderMixin, "_hwr_eligibility_mode", renamed)
    assert any("use_allgather" in p for p in compat.dlo_problems())
