"""FLUX.2-klein with DLO AllGather through hwrd, by vLLM-Omni's own loader and DLO (``omni_harness``).

As ``vllm serve MODEL --omni --enable-distributed-layerwise-offload --host-weight-runtime-mode
...`` (AllGather is DLO's default) would start its workers, over real gloo, against one hwrd:

- DP 2, fresh processes, in turn: with the daemon down, ``preferred`` falls back to canonical
  loading and ``required`` fails naming the socket; against the running but empty hwrd,
  ``required`` fails on every rank naming hwrd, its socket and ``hwrctl prewarm``; then a cold
  ``preferred`` start with rank 1 reaching its lookup 15 s after rank 0 (far longer than rank 0's
  canonical load and publication of this tiny DiT): both ranks load canonically and the final
  layout is published once. Without the ranks' agreement (``agree``) rank 1 would find rank 0's
  publication and lease it while rank 0 loaded canonically; the group would mix paths;
- DP 4, fresh processes: ``required`` warm starts are LOCAL_HIT leases (DP ranks share one
  artifact: the identity has no DP rank), restored by vLLM-Omni's restorer, whose DiT rings then
  gather from every rank's pieces of the lease (no private shard).

Different inputs per DP rank; every output equals the same rank's unhooked forward straight from
the loader, warm equals cold (DP rank r has the same input at DP 2 and DP 4). Warm AllGather over
two ranks runs through the same loader at SP 2 (``test_omni_sp``) and, with the private-memory
bound, on a smaller pipeline (``test_allgather_lease``). What is faked is the accelerator boundary
only (``omni_accelerator``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

pytest.importorskip("vllm_omni")

from omni_harness import Start, Topology, WorkerResult, run

import hwr.client
from hwr.dlo_backend.vllm_plugin.agree import FAILED, HIT, MISS, decide

pytestmark = pytest.mark.timeout(2400)


@dataclass
class Runs:
    cold: list[WorkerResult]
    warm4: list[WorkerResult]
    down: str


@pytest.fixture(scope="module")
def runs(vo_hwrd, omni_zygote, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    base = tmp_path_factory.mktemp("flux2-allgather")
    socket, down = str(vo_hwrd.socket), str(base / "no-hwrd.sock")
    common = {"pipeline": "flux2-klein", "checkpoint": base / "checkpoint", "runtime_root": base / "runtime",
              "zygote": omni_zygote}
    (base / "runtime").mkdir()
    dp2 = Topology(world_size=2, data_parallel_size=2, use_allgather=True)
    cold = run(**common, out=base / "cold", topology=dp2, write_checkpoint=True, starts=[
        Start("down-preferred", socket=down, forwards=1),
        Start("down-required", mode="required", socket=down, straight=False, forwards=0),
        Start("required-empty", mode="required", socket=socket, straight=False, forwards=0),
        Start("cold", socket=socket, stagger_s=15.0),
    ])
    dp4 = Topology(world_size=4, data_parallel_size=4, use_allgather=True)
    warm4 = run(**common, out=base / "warm4", topology=dp4, starts=[
        Start("warm", mode="required", socket=socket, forwards=1)])
    return Runs(cold, warm4, down)


def test_a_cold_dp2_start_takes_one_outcome_on_every_rank_and_publishes_once(runs: Runs, vo_hwrd) -> None:
    starts = [rank["cold"].expect_ok() for rank in runs.cold]
    # Rank 1 looked up 15 s after rank 0 had published: it still loaded canonically, as rank 0 did.
    assert [s.outcome for s in starts] == ["canonical_fallback", "canonical_fallback"], [s.raw for s in starts]
    for start in starts:
        assert start.plan is None
        # Their DiT rings agree on vLLM-Omni's own AllGather for this start (not every rank had a lease).
        assert start.raw["offload"]["backend"] == "HwrdOffloadBackend", start.raw["offload"]
        assert start.raw["offload"]["hwr_rings"] == [], start.raw["offload"]
        assert start.offloaded == [start.straight, start.straight]
    with hwr.client.connect(vo_hwrd.socket) as client:
        assert len(client.list_artifacts()) == 1  # published once; the other rank joined or found it


def test_a_required_start_against_an_empty_hwrd_names_hwrd_its_socket_and_prewarm(runs: Runs, vo_hwrd) -> None:
    for rank in runs.cold:
        error = rank["required-empty"].error
        assert error is not None, rank["required-empty"].raw
        message = error["message"]
        assert "hwrd" in message and str(vo_hwrd.socket) in message, message
        assert "hwrctl" in message and "prewarm" in message, message


def test_the_agreed_outcome_is_the_lowest_rank_outcome() -> None:
    assert decide([HIT, HIT]) == (HIT, [])
    assert decide([HIT, MISS, HIT]) == (MISS, [1])
    assert decide([MISS, FAILED]) == (FAILED, [0, 1])


def test_warm_dp4_starts_are_local_hits_gathering_from_the_lease(runs: Runs) -> None:
    ranks = runs.warm4
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
    # DP ranks 0 and 1 get the same input at DP 4 as at DP 2 (``omni_harness``: seed + 1000 * rank).
    for cold, warm in zip(runs.cold, runs.warm4[:2], strict=True):
        assert warm["warm"].straight == cold["cold"].straight
        assert warm["warm"].offloaded == cold["cold"].offloaded[:1]


def test_with_the_daemon_down_preferred_falls_back_and_required_fails_naming_the_socket(runs: Runs) -> None:
    for rank in runs.cold:
        preferred = rank["down-preferred"].expect_ok()
        assert preferred.outcome == "canonical_fallback" and preferred.plan is None
        required = rank["down-required"]
        assert required.error is not None and runs.down in required.error["message"], required.raw
