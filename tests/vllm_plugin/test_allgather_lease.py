"""AllGather DLO through hwrd, started by vLLM-Omni's own ``enable_offload_backend``, over real gloo.

A final-layout artifact is published into hwrd by a cold process; then every rank of a DP (or SP,
with DP = 1) group resolves it through vLLM-Omni's runtime (the plugin's store), binds the lease
the way the restore commit does, and hands the carrier to vLLM-Omni's DLO startup. With the
plugin, the backend factory returns ``HwrdOffloadBackend`` and the DiT ring gathers each block
from every rank's pieces of the shared mapping: no private shard. What is faked is written in
``omni_ag_ranks``'s docstring (the accelerator boundary only).

Matrix (CI time): SP 2 with DP 1 only, blocks all-reduce on the SP group inside forward (the DLO
gathers run beside the model's own collectives), with the private-memory bound. DP 2 and DP 4
run through vLLM-Omni's own loader on FLUX.2-klein (``test_omni_allgather``: DP 2 cold, DP 4 warm).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm_omni")

import omni_ag_ranks
from vo_helpers import identity


def _publish(tmp: Path, socket: str, root: Path, ident_json: str, sp: bool) -> None:
    proc = omni_ag_ranks.processes().Process(target=omni_ag_ranks.publish, args=(socket, str(root), ident_json, sp))
    proc.start()
    proc.join(240)
    if proc.is_alive():
        proc.kill()
        proc.join()
    assert proc.exitcode == 0, "the cold publication failed"


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("dp", "sp"), [(1, 2)], ids=["sp2"])
def test_allgather_reads_each_rank_s_pieces_from_the_hwrd_lease(vo_hwrd, short_tmp: Path, dp: int, sp: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # Ranks return freed blocks to the OS (a fixed glibc mmap threshold), so the probe measures
    # live private memory, not the allocator's cache of freed gloo temporaries.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    root = short_tmp / "runtime"
    root.mkdir(mode=0o700)
    ident = identity(f"allgather/tiny-dit-dp{dp}-sp{sp}")
    ident_json = json.dumps(ident.to_dict())
    _publish(short_tmp, str(vo_hwrd.socket), root, ident_json, sp > 1)
    world = dp * sp
    results = omni_ag_ranks.run_ranks(omni_ag_ranks.allgather_from_lease, world, short_tmp, str(vo_hwrd.socket),
                                      str(root), dp, sp, "required", ident_json, deadline=420)
    pids = sorted(r["pid"] for r in results)
    for r in results:
        assert r["outcome"] == "local_hit", r
        assert r["hwrd_backend"] and r["taken"], r
        assert r["world"] == world and r["shard_source"] == "lease" and r["host_shard_bytes"] == 0, r
        assert r["equal"] == [True, True] and r["equal_after_disable"], r
        # Private memory beyond the two slots (the CPU "device") stays below one block.
        assert r["private_growth_bytes"] - r["slot_bytes"] < r["block_bytes"], r
        # Every rank holds its own lease while it runs; all are released after teardown.
        assert r["leases_while_running"] >= 1 and r["lease_closed"] and r["leases_after"] == 0, r
        assert set(r["lease_pids"]) <= set(pids)
