"""Cosmos3 through vLLM-Omni's own loader, its direct checkpoint mmap plan served by hwrd checkpoint leases.

As ``vllm serve MODEL --omni --enable-distributed-layerwise-offload ...`` starts its diffusion
workers (``omni_harness``: fresh processes, real gloo), on a tiny random Cosmos3 checkpoint
(``omni_cosmos3``: Qwen3-VL text config, local tokenizer, Wan VAE, UniPC scheduler, the DiT's
source checkpoint in two shards), with vLLM-Omni's real ``Cosmos3OmniDiffusersPipeline`` and
``Cosmos3VFMTransformer``: ``DiffusersPipelineLoader.load_model`` builds the pipeline, finds no
Host Weight Runtime path (Cosmos3 declares no restore contract) and plans a direct checkpoint
mmap through vLLM-Omni's own Cosmos3 adapter and the pipeline's real ``_remap_ckpt_key``;
``enable_offload_backend`` realizes the plan, and DLO streams the UND and GEN rings.

- **Without hwrd** (``HWR_VLLM_PLUGIN=0``: vLLM-Omni alone), two fresh processes at DP 2: the
  reference outputs with DLO AllGather, then rank-local (rank 0's input is a DP 1 run's).
  vLLM-Omni 0.30's planner refuses Cosmos3 a plan (it wants a weight source per DiT name;
  Cosmos3 nests ``transformer.language_model`` inside ``transformer`` with one source), so
  vLLM-Omni alone loads it with the ordinary loader; with hwrd the plugin's gate covers the
  nested DiT by its parent's source (``gate.nested_dits``) and the plan is built by vLLM-Omni's
  own planner;
- **not registered yet** (hwrd up, a fresh process): ``preferred`` realizes the same plan with
  vLLM-Omni's own mappings (one warning naming ``hwrctl checkpoints add``), ``required`` fails
  saying so;
- the checkpoint is then registered with hwrd (``hwrctl checkpoints add``'s RPC);
- **cold**: the first fresh process after registration, ``preferred``: the plan's files are
  leased from hwrd (the daemon opens and maps the registered files for the first time);
- **warm**: another fresh process, ``required``, pinned host memory on: the same leases (DLO
  copies through vLLM-Omni's bounded pinned staging, as on its own rank-local mmap path);
- **AllGather DP 2**, fresh processes, ``required``: both rings gather from each rank's pieces of
  the checkpoint leases (hwr's rings, no private shard).

Every output is bit-identical to vLLM-Omni's own without hwrd, rank by rank. Faked: only the
accelerator boundary (``omni_accelerator``: platform device calls, attention backend choice,
vLLM's CPU linear relayout, pinned memory and ``cudaHostRegister``); the "device" is the CPU.

Needs the CUDA-wheel environment (``scripts/setup-vllm-cuda.sh``): Cosmos3's module imports
torchvision and torchaudio. Elsewhere the module skips saying so, unless
``HWR_REQUIRE_VLLM_CUDA=1`` (CI's step for that environment), where it fails instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

pytest.importorskip("vllm_omni")

import omni_accelerator
from omni_harness import Start, Topology, WorkerResult, run

import hwr.client

if not omni_accelerator.cosmos3_importable():
    reason = ("vLLM-Omni's Cosmos3 module does not import here (it needs torchvision and torchaudio: "
              "build the CUDA-wheel environment with scripts/setup-vllm-cuda.sh and run "
              ".venv-cuda/bin/python -m pytest)")
    if os.environ.get("HWR_REQUIRE_VLLM_CUDA") == "1":
        raise RuntimeError(reason)
    pytest.skip(reason, allow_module_level=True)

pytestmark = pytest.mark.timeout(2400)
OWN = {"HWR_VLLM_PLUGIN": "0"}  # vLLM-Omni alone: the plugin is not installed in the worker


@dataclass
class Runs:
    own: list[WorkerResult]  # DP 2: "own" with AllGather, then "own-rank-local"
    unregistered: WorkerResult
    cold: WorkerResult
    warm: WorkerResult
    dp2: list[WorkerResult]
    registered: dict


@pytest.fixture(scope="module")
def cosmos3(vo_hwrd, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    base = tmp_path_factory.mktemp("cosmos3")
    socket = str(vo_hwrd.socket)
    checkpoint = base / "checkpoint"
    common = {"pipeline": "cosmos3", "checkpoint": checkpoint, "runtime_root": base / "runtime"}
    (base / "runtime").mkdir()
    dp2 = Topology(world_size=2, data_parallel_size=2, use_allgather=True)
    # straight=False: a checkpoint plan leaves the loader's DiT on meta until DLO binds it. Rank 0
    # of a DP 2 run gets the input seed a DP 1 run gets: its rank-local output is the DP 1 reference.
    own = run(**common, out=base / "own", topology=dp2, write_checkpoint=True, env=OWN, timeout=1200, starts=[
        Start("own", mode="disabled", straight=False),
        Start("own-rank-local", mode="disabled", straight=False, allgather=False)])
    unregistered = run(**common, out=base / "unregistered", timeout=1200, starts=[
        Start("preferred", socket=socket, straight=False, allgather=False, forwards=1),
        Start("required", mode="required", socket=socket, straight=False, allgather=False, forwards=1)])[0]
    with hwr.client.connect(socket) as client:
        registered = client.add_checkpoint(checkpoint / "transformer")
    cold = run(**common, out=base / "cold", timeout=1200,
               starts=[Start("cold", socket=socket, straight=False, allgather=False)])[0]
    warm = run(**common, out=base / "warm", timeout=1200, starts=[
        Start("warm", mode="required", socket=socket, straight=False, allgather=False, registration="registered")])[0]
    dp2_runs = run(**common, out=base / "dp2", topology=dp2, timeout=1200,
                   starts=[Start("warm", mode="required", socket=socket, straight=False)])
    return Runs(own, unregistered, cold, warm, dp2_runs, registered)


def _checkpoint_leases(start, registered: dict) -> list[dict]:
    """The checkpoint's leases ``hwrctl leases`` listed while DLO ran (DLO's enable takes them)."""
    key = f"checkpoint:{registered['checkpoint_id']}"
    return [lease for lease in start.raw["offload"].get("leases") or [] if lease["key"] == key]


def test_vllm_omni_alone_refuses_cosmos3_a_checkpoint_plan_and_loads_it_ordinarily(cosmos3: Runs) -> None:
    # vLLM-Omni 0.30's planner wants a weight source per DiT name, and Cosmos3 nests one DiT
    # (transformer.language_model) in another with one source: no plan, the ordinary loader.
    assert all(rank.plugin.startswith("disabled") for rank in cosmos3.own)
    for start in [rank[name] for rank in cosmos3.own for name in ("own", "own-rank-local")]:
        start.expect_ok()
        assert start.plan is None, start.raw
        assert any("missing prefixes: ['transformer.language_model.']" in line for line in start.logs), start.logs
        assert start.raw["offload"]["backend"] == "DistributedLayerwiseOffloadBackend", start.raw["offload"]
        out = start.tensor("0")
        assert out.abs().sum() > 0 and bool(out.isfinite().all())  # a real output, not zeros or NaN
        assert len(set(start.offloaded)) == 1  # every DLO forward gives the same bytes


def test_before_registration_preferred_maps_the_plan_itself_and_required_fails_naming_registration(
        cosmos3: Runs) -> None:
    preferred = cosmos3.unregistered["preferred"].expect_ok()
    assert preferred.plan == "checkpoint_mmap" and preferred.raw["offload"]["backend"] == "HwrdOffloadBackend"
    assert any("hwrctl checkpoints add" in line and "WARNING" in line for line in preferred.logs), preferred.logs
    assert any("Realized" in line and "mmap views" in line for line in preferred.logs), preferred.logs
    assert preferred.offloaded == cosmos3.own[0]["own-rank-local"].offloaded[:1]
    required = cosmos3.unregistered["required"]
    assert required.error is not None and "hwrctl checkpoints add" in required.error["message"], required.raw
    assert required.raw["leases_after"] == []


def test_a_cold_start_leases_the_registered_checkpoint_and_equals_vllm_omni_alone(cosmos3: Runs) -> None:
    start = cosmos3.cold["cold"].expect_ok()
    assert cosmos3.cold.plugin == "installed" and cosmos3.cold.pid not in {rank.pid for rank in cosmos3.own}
    assert start.plan == "checkpoint_mmap", start.raw
    assert start.raw["offload"]["backend"] == "HwrdOffloadBackend", start.raw["offload"]
    assert any("from hwrd checkpoint lease" in line for line in start.logs), start.logs
    assert not any("cannot serve" in line for line in start.logs), start.logs
    assert {lease["pid"] for lease in _checkpoint_leases(start, cosmos3.registered)} == {cosmos3.cold.pid}, start.raw
    assert start.offloaded == cosmos3.own[0]["own-rank-local"].offloaded
    assert start.raw["offload"]["carrier_closed"] is None  # no runtime lease: the plan is the checkpoint's
    assert start.raw["leases_after"] == []  # teardown released the checkpoint leases


def test_a_warm_required_start_in_a_fresh_process_streams_from_the_leases(cosmos3: Runs) -> None:
    warm = cosmos3.warm
    start = warm["warm"].expect_ok()
    assert warm.pid not in {cosmos3.cold.pid, *(rank.pid for rank in cosmos3.own)}
    assert start.plan == "checkpoint_mmap" and start.raw["offload"]["backend"] == "HwrdOffloadBackend"
    held = _checkpoint_leases(start, cosmos3.registered)
    assert held and {lease["pid"] for lease in held} == {warm.pid}, start.raw["offload"]
    # Pinning on: vLLM-Omni's rank-local checkpoint-mmap path copies through its bounded pinned host
    # staging (it registers only final-layout leases for direct H2D), as it does with its own mappings.
    assert start.raw["registration"]["registered"] == []
    assert any("host staging buffers for rank-local mmap" in line and "pinned=True" in line
               for line in start.logs), start.logs
    assert start.offloaded == cosmos3.own[0]["own-rank-local"].offloaded
    assert start.raw["leases_after"] == []


def test_allgather_at_dp2_gathers_from_the_checkpoint_leases_rank_by_rank_as_vllm_omni_alone(cosmos3: Runs) -> None:
    pids = {r.pid for r in cosmos3.dp2}
    outputs = set()
    for rank, own in zip(cosmos3.dp2, cosmos3.own, strict=True):
        start = rank["warm"].expect_ok()
        assert start.plan == "checkpoint_mmap", start.raw
        offload = start.raw["offload"]
        assert offload["backend"] == "HwrdOffloadBackend", offload
        rings = offload["hwr_rings"]
        # Two rings (UND language_model.layers, GEN gen_layers), each over both DP ranks, reading
        # every rank's pieces from the checkpoint leases.
        assert len(rings) == 2 and all(r["world"] == 2 and r["shard_source"] == "lease" and r["host_shard_bytes"] == 0
                                       for r in rings), rings
        held = {lease["pid"] for lease in _checkpoint_leases(start, cosmos3.registered)}
        assert rank.pid in held and held <= pids, start.raw["offload"]
        assert start.offloaded == own["own"].offloaded, rank.rank
        outputs.add(start.offloaded[0])
    assert len(outputs) == 2  # each DP rank ran its own input
