"""AllGather beside the model's and the caller's collectives on the same ranks; shards from the lease.

Real gloo groups in real spawned processes. A deadlock (DLO's gather and another collective
issued in different orders on different ranks) makes the ranks miss the harness deadline: the
test fails instead of hanging.
"""

from __future__ import annotations

from pathlib import Path

import dlo_collective_ranks
import dlo_ranks
import pytest
import torch
from dlo_fixtures import SafetensorsLease, TinyDiT


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("world", "depth", "layout", "as_sp"),
    [(2, 3, "world", True), (2, 4, "world", False), (4, 4, "world", True), (4, 5, "pairs", False)],
    ids=["2-ranks-odd-sp", "2-ranks-even-dp", "4-ranks-even-sp", "4-ranks-odd-dp-pairs"],
)
def test_blocks_that_all_reduce_and_caller_barriers_run_bit_identical(
    tmp_path: Path, world: int, depth: int, layout: str, as_sp: bool
) -> None:
    results = dlo_ranks.run_ranks(
        dlo_collective_ranks.beside_model_collectives, world, tmp_path, depth, layout, as_sp, deadline=120
    )
    for result in results:
        assert result["mode"] == "allgather"
        assert result["world"] == (2 if layout == "pairs" else world)
        # 3 passes x (output, caller's all-reduce of it), every one bit-identical to the unhooked model.
        assert result["equal"] == [True] * 6
        assert result["after_close"]
        assert result["barriers"] == 3 * len(range(0, depth, 2))


def _wide_lease(path: Path, depth: int, dim: int) -> None:
    torch.manual_seed(3)
    SafetensorsLease.write(path, dlo_collective_ranks.WideStack(depth, dim).state_dict()).close()


@pytest.fixture
def live_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks return freed blocks to the OS: a fixed glibc mmap threshold (no dynamic raise), so
    the probe measures live private memory, not the allocator's cache of freed gloo temporaries."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.usefixtures("live_memory")
def test_shards_are_read_from_the_lease_without_a_private_copy(tmp_path: Path, world: int) -> None:
    depth, dim = 6, 1024  # 8 MiB blocks, a 48 MiB lease
    lease_path = tmp_path / "wide.safetensors"
    _wide_lease(lease_path, depth, dim)
    results = dlo_ranks.run_ranks(
        dlo_collective_ranks.lease_private_memory, world, tmp_path, str(lease_path), depth, dim, False, deadline=90
    )
    for result in results:
        assert result["equal"] and result["lease_closed"]
        assert result["shard_source"] == "lease" and result["host_shard_bytes"] == 0
        # Its shard bytes are read from the mapping: every piece is a view inside the lease.
        assert result["pieces"] > 0 and result["pieces_in_lease"]
        assert result["piece_bytes"] <= result["lease_bytes"] / world + result["block_bytes"]
        # Private memory beyond the two slots (the CPU "device" memory) stays below one block.
        beyond_slots = result["private_growth_bytes"] - result["slot_bytes"]
        assert beyond_slots < result["block_bytes"], result
        # Only its own pages were faulted: about 1/world of the lease, not all of it.
        # The kernel maps whole page-cache folios (up to 2 MiB) around a fault, so allow one folio
        # on each side of every piece; a rank that read everything would map the whole lease.
        rss = result["lease_rss_bytes"]
        assert rss <= result["lease_bytes"] / world + 2 * result["pieces"] * (2 << 20), result
        assert rss < 0.6 * result["lease_bytes"], result


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("live_memory")
def test_the_private_shard_path_stays_selectable_and_the_memory_probe_sees_it(tmp_path: Path) -> None:
    depth, dim, world = 6, 1024, 2
    lease_path = tmp_path / "wide.safetensors"
    _wide_lease(lease_path, depth, dim)
    results = dlo_ranks.run_ranks(
        dlo_collective_ranks.lease_private_memory, world, tmp_path, str(lease_path), depth, dim, True, deadline=90
    )
    for result in results:
        assert result["equal"] and result["lease_closed"]
        assert result["shard_source"] == "private"
        shards = result["host_shard_bytes"]
        assert shards >= depth * result["block_bytes"] / world * 0.95
        # The same probe that bounds the lease path counts these private shards.
        assert result["private_growth_bytes"] - result["slot_bytes"] >= shards * 0.9, result


@pytest.mark.timeout(150)
def test_a_failure_at_any_allgather_step_rolls_back_closes_the_lease_and_destroys_the_group(tmp_path: Path) -> None:
    lease_path = tmp_path / "model.safetensors"
    SafetensorsLease.write(lease_path, TinyDiT(3, 2, seed=0).state_dict()).close()
    results = dlo_ranks.run_ranks(dlo_collective_ranks.rollback_every_step, 2, tmp_path, str(lease_path), deadline=120)
    for result in results:
        *failures, success = result["attempts"]
        for attempt in failures:
            assert attempt["entered"], attempt  # every step of the AllGather path is reached
            assert attempt["error"] in ("OffloadError", "CollectiveStateError"), attempt
            assert attempt["usable"] and attempt["lease_closes"] == 1, attempt
            assert attempt["groups_left"] == 0, attempt  # DLO's own communicator closed on rollback
            # It exists from OPEN_GROUP on (OPEN_GROUP itself fails before creating it).
            assert attempt["groups_opened"] == (0 if attempt["step"] in ("take_lease", "open_group") else 1), attempt
        assert success["error"] is None and success["ok"] and success["usable"]
        assert success["groups_during"] == 1 and success["groups_left"] == 0
        assert success["lease_closes"] == 1


@pytest.mark.timeout(120)
def test_two_backends_on_the_same_ranks_each_get_their_own_communicator(tmp_path: Path) -> None:
    results = dlo_ranks.run_ranks(dlo_collective_ranks.two_backends, 2, tmp_path, deadline=90)
    for result in results:
        assert result["equal"] == [True] * 4
        assert result["distinct"] and result["closed"]
