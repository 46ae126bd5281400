"""FLUX.2-klein through vLLM-Omni's own loader and DLO, warm from hwrd (``omni_harness``).

Two fresh worker processes against one real hwrd, as ``vllm serve MODEL --omni
--enable-distributed-layerwise-offload --dlo-no-use-allgather --host-weight-runtime-mode ...``
would start them:

- the first writes a tiny random FLUX.2-klein checkpoint in the diffusers layout, then starts
  five times: ``preferred`` and ``required`` with the daemon down (``HWR_SOCKET`` names a socket
  no daemon listens on); with ``HWR_SOCKET`` unset (the plugin leaves vLLM-Omni's own filesystem
  store in the runtime root) a cold start, then a warm one from that store; then ``preferred``
  with hwrd up (cold: canonical loading, the final layout published into hwrd after load);
- the second starts ``preferred`` (host registration of the lease's mappings accepted), then
  ``required`` (registration refused: DLO's bounded staging fallback).

Every start that runs the DiT runs it once straight from the loader and through DLO
(rank-local), twice unless it says otherwise.

A warm start through hwrd costs metadata, not bytes: vLLM-Omni 0.30's loader snapshots every
restored final-layout tensor (SHA-256 of its bytes) after a warm restore and again after the
shared warm finalization. With the plugin, tensors that are still the lease's read-only views are
proven unchanged from metadata (``unchanged``); everything else keeps vLLM-Omni's hash. With
``hashlib.sha256`` audited during ``load_model`` (every buffer hashed, by address):

- vLLM-Omni's own filesystem store, warm: its restored tensors are hashed, twice (the control: the
  audit sees vLLM-Omni's hashing);
- hwrd, warm, in the fresh process: no byte of a restored tensor is hashed, every snapshot entry
  is a metadata proof, and a restored tensor replaced by a private copy after the snapshot is
  still reported changed by vLLM-Omni's check; outputs equal the own store's bit for bit.

What is faked is the accelerator boundary only (``omni_accelerator``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm_omni")

from omni_harness import Start, WorkerResult, run

import hwr.client

pytestmark = pytest.mark.timeout(1800)


@dataclass
class Runs:
    cold: WorkerResult
    warm: WorkerResult
    down_socket: str


@pytest.fixture(scope="module")
def flux2(vo_hwrd, omni_zygote, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    base = tmp_path_factory.mktemp("flux2-klein")
    socket, down = str(vo_hwrd.socket), str(base / "no-hwrd.sock")
    common = {"pipeline": "flux2-klein", "checkpoint": base / "checkpoint", "runtime_root": base / "runtime",
              "zygote": omni_zygote}
    (base / "runtime").mkdir()
    cold = run(**common, out=base / "cold", write_checkpoint=True, starts=[
        Start("down-preferred", socket=down),
        Start("down-required", mode="required", socket=down, straight=False, forwards=0),
        # No socket: the plugin leaves vLLM-Omni's own filesystem store in the runtime root.
        Start("own-cold", forwards=0, straight=False),
        Start("own-warm", forwards=1, audit_hashing=True),
        Start("cold", socket=socket),
    ])[0]
    warm = run(**common, out=base / "warm", starts=[
        Start("warm", socket=socket, registration="registered", audit_hashing=True),
        Start("warm-required", mode="required", socket=socket, registration="refused", audit_hashing=True),
    ])[0]
    return Runs(cold, warm, down)


def _artifacts(vo_hwrd) -> list[dict]:
    with hwr.client.connect(vo_hwrd.socket) as client:
        return client.list_artifacts()


def test_the_plugin_is_loaded_by_vllm_omni_in_each_worker(flux2: Runs) -> None:
    assert [flux2.cold.plugin, flux2.warm.plugin] == ["installed", "installed"]


def test_a_cold_preferred_start_loads_canonically_and_publishes_into_hwrd(flux2: Runs, vo_hwrd) -> None:
    cold, warm = flux2.cold, flux2.warm
    start = cold["cold"].expect_ok()
    assert start.outcome == "canonical_fallback" and start.plan is None
    assert not any("publication failed" in line for line in start.logs), start.logs
    keys = {a["key"] for a in _artifacts(vo_hwrd)}
    assert warm["warm"].raw["leases_during"][0]["key"] in keys  # what the warm start leased is what was published


def test_a_warm_start_in_a_fresh_process_is_a_local_hit_leased_from_hwrd(flux2: Runs, vo_hwrd) -> None:
    cold, warm = flux2.cold, flux2.warm
    assert warm.pid != cold.pid
    start = warm["warm"].expect_ok()
    assert start.outcome == "local_hit" and start.plan == "host_weight_runtime"
    assert not any("falling back" in line or "retrying" in line for line in start.logs), start.logs
    # hwrctl (a real process) lists the worker's lease, held by the worker's pid.
    (held,) = start.raw["leases_during"]
    assert held["pid"] == warm.pid
    # Every DiT tensor lies in a read-only shared mapping of that artifact's files in hwrd's store.
    homes = start.raw["dit_homes"]
    assert homes["not_file_backed"] == []
    store = Path(vo_hwrd.root) / "artifacts" / held["key"]
    assert homes["file_mappings"] and all(
        home.startswith("r--s ") and Path(home[5:]).parent == store for home in homes["file_mappings"])
    # DLO took the lease from the loader's carrier, registered its mapped regions for direct
    # H2D, and teardown unregistered them and closed the lease.
    offload = start.raw["offload"]
    assert offload["backend"] == "DistributedLayerwiseOffloadBackend" and not offload["fresh_model"]
    assert offload["carrier_taken"] and offload["carrier_closed"]
    registration = start.raw["registration"]
    assert registration["registered"] and registration["unregistered"] == len(registration["registered"])
    assert any("Registered" in line and "HWR mmap" in line for line in start.logs), start.logs
    assert start.raw["leases_after"] == []


def test_a_required_warm_start_works_and_falls_back_to_staging_when_registration_is_refused(flux2: Runs) -> None:
    warm = flux2.warm
    start = warm["warm-required"].expect_ok()
    assert start.outcome == "local_hit" and start.plan == "host_weight_runtime"
    assert start.raw["leases_during"][0]["pid"] == warm.pid
    assert start.raw["registration"]["refused"] == 1
    assert any("using bounded host staging" in line for line in start.logs), start.logs
    assert start.raw["offload"]["carrier_taken"] and start.raw["leases_after"] == []


def test_warm_outputs_are_bit_identical_to_the_cold_ones_from_the_loader_and_through_dlo(flux2: Runs) -> None:
    cold, warm = flux2.cold, flux2.warm
    reference = cold["cold"].expect_ok()
    assert reference.offloaded == [reference.straight] * 2
    for name in ("warm", "warm-required"):
        start = warm[name].expect_ok()
        assert start.straight == reference.straight, name
        assert start.offloaded == [reference.straight] * 2, name
    assert reference.tensor().abs().sum() > 0  # a real output, not an empty or zero tensor


def test_with_the_daemon_down_preferred_falls_back_and_required_fails_naming_the_socket(flux2: Runs) -> None:
    cold = flux2.cold
    preferred = cold["down-preferred"].expect_ok()
    assert preferred.outcome == "canonical_fallback"
    assert preferred.straight == cold["cold"].straight and preferred.offloaded == cold["cold"].offloaded
    required = cold["down-required"]
    assert required.error is not None and required.error["type"] == "RuntimeError"
    assert flux2.down_socket in required.error["message"], required.error


def test_the_audit_sees_vllm_omnis_own_store_hash_every_restored_tensor_twice(flux2: Runs) -> None:
    warm = flux2.cold["own-warm"].expect_ok()
    assert warm.outcome == "local_hit", warm.raw
    hashing = warm.raw["hashing"]
    assert hashing["dit_bytes"] > 0
    assert hashing["restored_bytes"] >= 2 * hashing["dit_bytes"], hashing
    assert hashing["snapshots"]["proven"] == 0, hashing  # not an hwrd lease: vLLM-Omni's check


@pytest.mark.parametrize("name", ["warm", "warm-required"])
def test_an_hwrd_warm_start_hashes_no_restored_byte(flux2: Runs, name: str) -> None:
    warm = flux2.warm[name].expect_ok()
    assert flux2.warm.pid != flux2.cold.pid  # a fresh process
    assert warm.outcome == "local_hit" and warm.plan == "host_weight_runtime", warm.raw
    hashing = warm.raw["hashing"]
    assert hashing["restored_bytes"] == 0, hashing
    # Both snapshots (after the restore, after the warm finalization) proved every tensor.
    snapshots = hashing["snapshots"]
    assert snapshots["hashed"] == 0 and snapshots["proven"] > 0 and snapshots["proven"] % 2 == 0, snapshots
    # What is hashed at all is metadata: what vLLM-Omni's own warm start hashes besides the
    # restored tensors (identities, source records), plus hwrd's manifest (a few KiB).
    own = flux2.cold["own-warm"].expect_ok().raw["hashing"]
    assert hashing["total_bytes"] < own["total_bytes"] - own["restored_bytes"] + 64 * 1024, (hashing, own)
    # A restored tensor replaced by a private copy after the snapshot is still reported changed.
    assert hashing["replaced_tensor_detected"] is True


def test_the_hwrd_warm_outputs_equal_the_own_stores(flux2: Runs) -> None:
    own = flux2.cold["own-warm"].expect_ok()
    assert own.offloaded == [own.straight]
    for name in ("warm", "warm-required"):
        hwrd = flux2.warm[name].expect_ok()
        assert hwrd.straight == own.straight and hwrd.offloaded == [own.straight] * 2, name
