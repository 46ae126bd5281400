"""DP 2 cold starts through vLLM-Omni's own loader: the ranks take one outcome, and an empty hwrd
fails a ``required`` start with a message that says how to fill it (``omni_harness``).

Two fresh worker processes (DLO AllGather, gloo, vLLM-Omni's own loader and DLO) against a real
hwrd that holds nothing:

- ``required``: every rank fails, naming hwrd, its socket and ``hwrctl prewarm``;
- ``preferred``, with rank 1 reaching its lookup 15 s after rank 0 (far longer than rank 0's
  canonical load and publication of this tiny DiT): both ranks load canonically. Without the
  agreement (``agree``) rank 1 would find rank 0's publication and lease it while rank 0 loaded
  canonically; the group would mix paths.

Faked: the accelerator boundary only (``omni_accelerator``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm_omni")

from omni_harness import Start, Topology, WorkerResult, run

import hwr.client
from hwr.dlo_backend.vllm_plugin.agree import FAILED, HIT, MISS, decide

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def ranks(vo_hwrd, tmp_path_factory: pytest.TempPathFactory) -> list[WorkerResult]:
    base = tmp_path_factory.mktemp("flux2-agree")
    (base / "runtime").mkdir()
    socket = str(vo_hwrd.socket)
    return run("flux2-klein", checkpoint=base / "checkpoint", runtime_root=base / "runtime", out=base / "out",
               topology=Topology(world_size=2, data_parallel_size=2, use_allgather=True), write_checkpoint=True,
               timeout=900, starts=[
                   Start("required-empty", mode="required", socket=socket, straight=False, forwards=0),
                   Start("cold", socket=socket, forwards=1, stagger_s=15.0),
               ])


def test_a_required_start_against_an_empty_hwrd_names_hwrd_its_socket_and_prewarm(ranks, vo_hwrd) -> None:
    for rank in ranks:
        error = rank["required-empty"].error
        assert error is not None, rank["required-empty"].raw
        message = error["message"]
        assert "hwrd" in message and str(vo_hwrd.socket) in message, message
        assert "hwrctl" in message and "prewarm" in message, message


def test_a_cold_dp2_start_takes_one_outcome_on_every_rank(ranks, vo_hwrd) -> None:
    starts = [rank["cold"].expect_ok() for rank in ranks]
    assert [s.outcome for s in starts] == ["canonical_fallback", "canonical_fallback"], [s.raw for s in starts]
    assert all(s.plan is None for s in starts)
    for start in starts:
        assert start.offloaded == [start.straight]
    with hwr.client.connect(vo_hwrd.socket) as client:
        assert len(client.list_artifacts()) == 1  # published once; the other rank joined or found it


def test_the_agreed_outcome_is_the_lowest_rank_outcome() -> None:
    assert decide([HIT, HIT]) == (HIT, [])
    assert decide([HIT, MISS, HIT]) == (MISS, [1])
    assert decide([MISS, FAILED]) == (FAILED, [0, 1])
