"""FLUX.2-klein with DLO AllGather through hwrd, by vLLM-Omni's own loader and DLO (``omni_harness``).

As ``vllm serve MODEL --omni --enable-distributed-layerwise-offload --host-weight-runtime-mode
...`` (AllGather is DLO's default) would start its workers, over real gloo, against one hwrd:

- DP 2, fresh processes: with the daemon down, ``preferred`` falls back to canonical loading and
  ``required`` fails naming the socket; then a cold ``preferred`` start loads canonically and
  publishes the final layout into hwrd;
- DP 2 and DP 4, fresh processes: ``required`` warm starts are LOCAL_HIT leases (DP ranks share one
  artifact: the identity has no DP rank), restored by vLLM-Omni's restorer, whose DiT rings then
  gather from every rank's pieces of the lease (no private shard).

Different inputs per DP rank; every output equals the same rank's unhooked forward straight from
the loader, warm equals cold. The SP path (DP 1, gathers beside the model's SP collectives) and
the private-memory bound are proven on a smaller pipeline in ``test_allgather_lease``. What is
faked is the accelerator boundary only (``omni_accelerator``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

pytest.importorskip("vllm_omni")

from omni_harness import Start, Topology, WorkerResult, run

pytestmark = pytest.mark.timeout(2400)


@dataclass
class Runs:
    cold: list[WorkerResult]
    warm2: list[WorkerResult]
    warm4: list[WorkerResult]
    down: str


@pytest.fixture(scope="module")
def runs(vo_hwrd, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    base = tmp_path_factory.mktemp("flux2-allgather")
    socket, down = str(vo_hwrd.socket), str(base / "no-hwrd.sock")
    common = {"pipeline": "flux2-klein", "checkpoint": base / "checkpoint", "runtime_root": base / "runtime"}
    (base / "runtime").mkdir()
    dp2 = Topology(world_size=2, data_parallel_size=2, use_allgather=True)
    cold = run(**common, out=base / "cold", topology=dp2, write_checkpoint=True, starts=[
        Start("down-preferred", socket=down, forwards=1),
        Start("down-required", mode="required", socket=down, straight=False, forwards=0),
        Start("cold", socket=socket),
    ])
    warm2 = run(**common, out=base / "warm2", topology=dp2, starts=[Start("warm", mode="required", socket=socket)])
    dp4 = Topology(world_size=4, data_parallel_size=4, use_allgather=True)
    warm4 = run(**common, out=base / "warm4", topology=dp4, starts=[
        Start("warm", mode="required", socket=socket, forwards=1)])
    return Runs(cold, warm2, warm4, down)


def test_cold_allgather_starts_load_canonically_and_publish(runs: Runs) -> None:
    starts = [rank["cold"].expect_ok() for rank in runs.cold]
    # The ranks race the publication: the first loads canonically and publishes; another may
    # already find it. Their DiT rings then agree on vLLM-Omni's own AllGather for this start.
    outcomes = [start.outcome for start in starts]
    assert "canonical_fallback" in outcomes and set(outcomes) <= {"canonical_fallback", "local_hit"}, outcomes
    for start in starts:
        assert start.raw["offload"]["backend"] == "HwrdOffloadBackend", start.raw["offload"]
        assert start.raw["offload"]["hwr_rings"] == [], start.raw["offload"]  # not every rank had a lease
        assert start.offloaded == [start.straight, start.straight]


@pytest.mark.parametrize("which", ["warm2", "warm4"])
def test_warm_allgather_starts_are_local_hits_gathering_from_the_lease(runs: Runs, which: str) -> None:
    ranks: list[WorkerResult] = getattr(runs, which)
    cold_pids = {r.pid for r in runs.cold}
    straights = set()
    for rank in ranks:
        assert rank.pid not in cold_pids  # fresh processes
        start = rank["warm"].expect_ok()
        assert start.outcome == "local_hit" and start.plan == "host_weight_runtime", start.raw
        offload = start.raw["offload"]
        assert offload["backend"] == "HwrdOffloadBackend" and offload["carrier_taken"], offload
        rings = offload["hwr_rings"]
        assert rings and all(r["shard_source"] == "lease" and r["host_shard_bytes"] == 0 for r in rings), rings
        assert all(r["world"] == len(ranks) for r in rings), rings
        # The DiT's tensors are views of hwrd's read-only artifact files, not private copies.
        homes = start.raw["dit_homes"]
        assert not homes["not_file_backed"] and all(h.startswith("r") for h in homes["file_mappings"]), homes
        during = start.raw["leases_during"]
        assert rank.pid in {lease["pid"] for lease in during}, during
        assert offload["carrier_closed"] and not [x for x in start.raw["leases_after"] if x["pid"] == rank.pid]
        assert set(start.offloaded) == {start.straight}  # through DLO == straight from the loader
        straights.add(start.straight)
    assert len(straights) == len(ranks)  # each DP rank ran its own input


def test_warm_outputs_equal_the_cold_ones_rank_by_rank(runs: Runs) -> None:
    for cold, warm in zip(runs.cold, runs.warm2, strict=True):
        assert warm["warm"].straight == cold["cold"].straight
        assert warm["warm"].offloaded == cold["cold"].offloaded


def test_with_the_daemon_down_preferred_falls_back_and_required_fails_naming_the_socket(runs: Runs) -> None:
    for rank in runs.cold:
        preferred = rank["down-preferred"].expect_ok()
        assert preferred.outcome == "canonical_fallback" and preferred.plan is None
        required = rank["down-required"]
        assert required.error is not None and runs.down in required.error["message"], required.raw
