"""FLUX.2-klein at sequence parallel 2 (Ulysses), DP 1, through vLLM-Omni's own loader and DLO with hwrd.

As ``vllm serve MODEL --omni --ulysses-degree 2 --enable-distributed-layerwise-offload
--host-weight-runtime-mode ...`` starts its two diffusion workers (``omni_harness``: fresh
processes, real gloo, vLLM-Omni's ``_sp_plan`` hooks splitting the sequence and its Ulysses
all-to-all inside attention), on a tiny random FLUX.2-klein checkpoint:

- **without hwrd** (``HWR_VLLM_PLUGIN=0``): vLLM-Omni's own load and DLO AllGather (its group is
  the SP group at DP 1): the reference;
- **cold**, fresh processes, ``preferred``: canonical load, the final layout published into hwrd
  (the two SP ranks race the publication; whichever loses may already find it);
- **warm**, fresh processes, ``required``: LOCAL_HIT leases on both ranks; DLO AllGather over the
  SP ranks from the lease (hwr's rings, on their own communicator over the same two ranks as the
  model's Ulysses all-to-all, so the two kinds of collectives never interleave on one group),
  then a rank-local start (DLO without AllGather) from the lease in the same processes.

Every output is bit-identical to vLLM-Omni's own without hwrd, on both ranks (SP gathers the
full output on each rank). Faked: only the accelerator boundary (``omni_accelerator``); the
"device" is the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

pytest.importorskip("vllm_omni")

from omni_harness import Start, Topology, WorkerResult, run

pytestmark = pytest.mark.timeout(2400)
SP2 = Topology(world_size=2, sequence_parallel_size=2, ulysses_degree=2, use_allgather=True)


@dataclass
class Runs:
    own: list[WorkerResult]
    cold: list[WorkerResult]
    warm: list[WorkerResult]


@pytest.fixture(scope="module")
def sp2(vo_hwrd, omni_zygote, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    base = tmp_path_factory.mktemp("flux2-sp2")
    socket = str(vo_hwrd.socket)
    common = {"pipeline": "flux2-klein", "checkpoint": base / "checkpoint", "runtime_root": base / "runtime",
              "topology": SP2, "timeout": 1200, "zygote": omni_zygote}
    (base / "runtime").mkdir()
    own = run(**common, out=base / "own", write_checkpoint=True, env={"HWR_VLLM_PLUGIN": "0"},
              starts=[Start("own", mode="disabled")])
    cold = run(**common, out=base / "cold", starts=[Start("cold", socket=socket)])
    warm = run(**common, out=base / "warm", starts=[
        Start("warm", mode="required", socket=socket),
        Start("warm-rank-local", mode="required", socket=socket, allgather=False, forwards=1),
    ])
    return Runs(own, cold, warm)


def test_vllm_omni_alone_at_sp2_gives_each_rank_the_whole_output(sp2: Runs) -> None:
    starts = [rank["own"].expect_ok() for rank in sp2.own]
    assert {start.straight for start in starts} == {starts[0].straight}  # both ranks: one full output
    for start in starts:
        assert start.offloaded == [start.straight] * 2
        assert start.tensor().abs().sum() > 0


def test_a_cold_sp2_start_publishes_and_equals_vllm_omni_alone(sp2: Runs) -> None:
    starts = [rank["cold"].expect_ok() for rank in sp2.cold]
    outcomes = [start.outcome for start in starts]
    assert "canonical_fallback" in outcomes and set(outcomes) <= {"canonical_fallback", "local_hit"}, outcomes
    for start, own in zip(starts, sp2.own, strict=True):
        assert not any("publication failed" in line for line in start.logs), start.logs
        assert start.straight == own["own"].straight and start.offloaded == own["own"].offloaded


def test_a_warm_sp2_start_gathers_over_the_sp_ranks_from_the_lease(sp2: Runs) -> None:
    pids = {rank.pid for rank in sp2.warm}
    assert not pids & {rank.pid for rank in sp2.cold}  # fresh processes
    for rank, own in zip(sp2.warm, sp2.own, strict=True):
        start = rank["warm"].expect_ok()
        assert start.outcome == "local_hit" and start.plan == "host_weight_runtime", start.raw
        offload = start.raw["offload"]
        assert offload["backend"] == "HwrdOffloadBackend" and offload["carrier_taken"], offload
        rings = offload["hwr_rings"]
        assert rings and all(r["world"] == 2 and r["shard_source"] == "lease" and r["host_shard_bytes"] == 0
                             for r in rings), rings
        homes = start.raw["dit_homes"]
        assert not homes["not_file_backed"] and all(h.startswith("r") for h in homes["file_mappings"]), homes
        assert rank.pid in {lease["pid"] for lease in start.raw["leases_during"]}
        assert offload["carrier_closed"] and not [x for x in start.raw["leases_after"] if x["pid"] == rank.pid]
        assert start.straight == own["own"].straight and start.offloaded == own["own"].offloaded


def test_a_warm_sp2_rank_local_start_streams_the_lease_as_vllm_omni_alone(sp2: Runs) -> None:
    for rank, own in zip(sp2.warm, sp2.own, strict=True):
        start = rank["warm-rank-local"].expect_ok()
        assert start.outcome == "local_hit" and start.plan == "host_weight_runtime", start.raw
        assert start.raw["offload"]["hwr_rings"] == [] and start.raw["offload"]["carrier_taken"]
        assert start.straight == own["own"].straight and start.offloaded == [own["own"].straight]
