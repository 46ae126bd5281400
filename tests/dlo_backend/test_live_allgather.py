"""Live updates with AllGather: every rank switches at the same pass, or none does."""

from __future__ import annotations

from pathlib import Path

import dlo_live_ranks
import dlo_ranks
import pytest
from dlo_fixtures import SafetensorsLease, TinyDiT


@pytest.mark.timeout(180)
def test_ranks_switch_at_the_same_pass_and_one_rank_refusing_keeps_all_on_the_old_revision(tmp_path: Path) -> None:
    files = {}
    for name, seed in (("r0", 0), ("r1", 1), ("r2", 2), ("r3", 3), ("bad2", 9)):
        state = dict(TinyDiT(3, 2, seed=seed).state_dict())
        if name.startswith("bad"):
            state["blocks.1.fc2.weight"] = state["blocks.1.fc2.weight"][:, :8].contiguous()  # another shape
        path = tmp_path / f"{name}.safetensors"
        SafetensorsLease.write(path, state).close()
        files[name] = str(path)
    plan = {
        "0": {"2": "r1", "6": "r2", "8": "r2", "9": "r3"},  # rank 0 hears of each first (r2 twice)
        "1": {"4": "r1", "7": "bad2", "10": "r3"},  # rank 1 later; its copy of r2 breaks the contract
    }
    results = dlo_ranks.run_ranks(dlo_live_ranks.switch_together, 2, tmp_path, files, plan, deadline=150)
    for rank, result in enumerate(results):
        assert all(p["equal"] for p in result["passes"]), (rank, result["passes"])  # no pass mixed revisions
    keys = [[p["key"] for p in result["passes"]] for result in results]
    assert keys[0] == keys[1]  # the same revision at every pass on both ranks
    # r1 once both held it (pass 4); r2 never (rank 1 refused it); r3 once both held it (pass 10).
    assert keys[0] == ["r0"] * 4 + ["r1"] * 6 + ["r3"] * 2
    assert results[1]["errors"] == [[7, "RevisionMismatch"]]
    assert results[0]["errors"] == [[8, "RevisionMismatch"]]  # the group refused r2: refused on arrival
    # Rank 0 learnt of rank 1's refusal at the boundary of pass 7, and refused r2 itself at pass 8.
    (seven, kind, details), (eight, _, again) = results[0]["noted"]
    assert (seven, kind, details["refused_by"]) == (7, "RevisionMismatch", "1")
    assert eight == 8 and again["key"] == details["key"]
