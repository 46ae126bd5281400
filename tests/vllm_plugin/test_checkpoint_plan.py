"""DiTs loaded by direct checkpoint mmap: the plan's files come from hwrd checkpoint leases.

A pipeline with ``_remap_ckpt_key`` (the hook vLLM-Omni's direct-mmap planner looks up, as on
Cosmos3 and MAGI-2) is planned by vLLM-Omni's own ``build_checkpoint_mmap_plan`` and started by
its ``enable_offload_backend``; with the plugin the backend binds the planned tensors to views of
the checkpoint registered with hwrd (``hwrctl checkpoints add``), rank-local (vLLM-Omni's rings
keep the views) and AllGather at DP 2 (hwr's rings read each rank's pieces). What is faked, and
the one planner function answered directly because of torchvision, is in ``omni_ag_ranks``.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest

pytest.importorskip("vllm_omni")

import omni_ag_ranks

import hwr.client


@pytest.fixture
def checkpoint(vo_hwrd, short_tmp: Path, request: pytest.FixtureRequest) -> Path:
    folder = short_tmp / "ckpt"
    omni_ag_ranks.write_checkpoint(str(folder), seed=zlib.crc32(request.node.name.encode()) % 10_000)
    with hwr.client.connect(vo_hwrd.socket) as c:
        c.add_checkpoint(folder)
    return folder


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dp", [1, 2], ids=["rank-local", "allgather-dp2"])
def test_a_checkpoint_plan_streams_from_hwrd_checkpoint_leases(vo_hwrd, short_tmp: Path, checkpoint: Path, dp: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    results = omni_ag_ranks.run_ranks(omni_ag_ranks.checkpoint_plan, dp, short_tmp, str(vo_hwrd.socket),
                                      str(checkpoint), dp, "required", deadline=420)
    for r in results:
        assert r["plan"] == "checkpoint_mmap" and "error" not in r, r
    pids = {r["pid"] for r in results}
    for r in results:
        assert r["backend"] == "HwrdOffloadBackend" and r["from_hwrd"], r
        assert r["equal"] == [True, True] and r["equal_after_disable"], r
        assert r["non_block_views_of_lease"], r  # no private copy of what vLLM-Omni keeps resident
        assert r["leases_while_running"] >= 1 and set(r["lease_pids"]) <= pids, r
        assert r["closed"] and r["leases_after"] == 0, r
        if dp > 1:
            assert r["hwr_rings"] == 1 and r["shard_source"] == "lease", r
            assert r["private_growth_bytes"] - r["slot_bytes"] < r["block_bytes"], r
        else:
            assert r["hwr_rings"] == 0, r  # rank-local: vLLM-Omni's own rings over the leased views


@pytest.mark.timeout(600)
def test_daemon_down_preferred_maps_the_files_itself_required_names_the_socket(short_tmp: Path) -> None:
    folder = short_tmp / "ckpt"
    omni_ag_ranks.write_checkpoint(str(folder), seed=3)
    gone = str(short_tmp / "no-hwrd.sock")
    preferred, = omni_ag_ranks.run_ranks(omni_ag_ranks.checkpoint_plan, 1, short_tmp, gone, str(folder), 1,
                                         "preferred", deadline=300)
    assert preferred["equal"] == [True, True] and not preferred["from_hwrd"], preferred
    required, = omni_ag_ranks.run_ranks(omni_ag_ranks.checkpoint_plan, 1, short_tmp, gone, str(folder), 1,
                                        "required", deadline=300)
    assert "error" in required and gone in required["error"], required
