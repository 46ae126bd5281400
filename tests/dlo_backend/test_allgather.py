"""AllGather mode over real gloo groups in real processes (2 and 4 ranks)."""

from __future__ import annotations

from pathlib import Path

import dlo_ranks
import pytest
from dlo_fixtures import SafetensorsLease, TinyDiT

_run = dlo_ranks.run_ranks


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("world", "lease_backed", "host_copy"),
    [(2, True, False), (2, True, True), (4, False, False)],
    ids=["2-ranks-lease", "2-ranks-lease-host-copy", "4-ranks"],
)
def test_allgather_reproduces_outputs_with_one_shard_per_rank(
    tmp_path: Path, world: int, lease_backed: bool, host_copy: bool
) -> None:
    lease_path = None
    if lease_backed:
        lease_path = tmp_path / "model.safetensors"
        SafetensorsLease.write(lease_path, TinyDiT(3, 2, seed=0).state_dict()).close()
    results = _run(dlo_ranks.parity, world, tmp_path, str(lease_path) if lease_path else None, host_copy)
    for result in results:
        assert result["equal"] == [True] * 6  # 3 passes x (shared input, this rank's own input)
        assert result["after_close"]
        assert result["mode"] == "allgather" and result["world"] == world
        # CPU zero-copy binding is rank-local only: a shard must be gathered into a real slot.
        assert result["bound_in_slots"] and result["slot_bytes"] > 0
        if lease_backed and not host_copy:
            # Read in place: each rank's pieces come from the lease mapping, no private shard.
            assert result["shard_source"] == "lease" and result["shard_bytes"] == 0
        else:
            # Each rank keeps ceil(1/world) of every block: about block_bytes / world on the host.
            assert result["shard_source"] == "private"
            assert result["shard_bytes"] == result["expected_shard_bytes"]
            assert result["shard_bytes"] * world - result["block_bytes"] < world * 64
            assert result["shard_bytes"] < result["payload_bytes"] / world * 1.25
        assert result["originals_dropped"]
        assert result["max_materialized"] == 1
        if lease_backed:
            assert result["lease_closed"] == 1


@pytest.mark.timeout(90)
def test_ranks_that_disagree_on_the_manifest_all_fail_before_gathering(tmp_path: Path) -> None:
    results = _run(dlo_ranks.mismatch, 2, tmp_path)
    assert [r["error"] for r in results] == ["ManifestMismatch", "ManifestMismatch"]
    assert all(r["hooks"] == 0 and r["seconds"] < 5 for r in results)


@pytest.mark.timeout(90)
def test_an_enable_failure_on_one_rank_fails_every_rank_promptly(tmp_path: Path) -> None:
    results = _run(dlo_ranks.enable_failures, 2, tmp_path)
    peer, failing = results[0]["attempts"], results[1]["attempts"]
    assert [a["error"] for a in failing] == ["OffloadError", "OffloadError", None]
    assert [a["error"] for a in peer] == ["OffloadError", "OffloadError", None]
    assert all(a["usable"] for a in peer + failing)
    assert peer[2]["ok"] and failing[2]["ok"]
    assert all(a["seconds"] < 5 for a in peer[:2])  # not the 10 s group timeout


@pytest.mark.timeout(90)
def test_a_rank_that_stops_early_makes_the_others_fail_within_the_group_timeout(tmp_path: Path) -> None:
    timeout_s = 3.0
    results = _run(dlo_ranks.early_stop, 2, tmp_path, timeout_s, deadline=40, wait_for=1)
    first, second = results[0]["errors"]
    assert first is not None and first[0] == "CollectiveStateError"
    assert "recreate the backend" in first[1]
    assert second is not None and second[0] == "CollectiveStateError"  # poisoned: refuses further use
    assert results[0]["seconds"] < timeout_s + 5
    assert results[0]["state"] == "closed"
