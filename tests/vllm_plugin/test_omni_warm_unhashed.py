"""A warm start through hwrd costs metadata, not bytes: vLLM-Omni's loader does not hash the lease.

vLLM-Omni 0.30's loader snapshots every restored final-layout tensor (SHA-256 of its bytes) after
a warm restore and again after the shared warm finalization. With the plugin, tensors that are
still the lease's read-only views are proven unchanged from metadata (``unchanged``); everything
else keeps vLLM-Omni's hash. Through vLLM-Omni's own loader (``omni_harness``: real FLUX.2-klein
classes, real hwrd, fresh processes), with ``hashlib.sha256`` audited during ``load_model``
(every buffer hashed, by address):

- vLLM-Omni's own filesystem store, warm: its restored tensors are hashed, twice (the control: the
  audit sees vLLM-Omni's hashing);
- hwrd, warm, in a fresh process: no byte of a restored tensor is hashed, every snapshot entry is
  a metadata proof, and a restored tensor replaced by a private copy after the snapshot is still
  reported changed by vLLM-Omni's check; outputs equal the own store's bit for bit.

Faked: the accelerator boundary only (``omni_accelerator``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

pytest.importorskip("vllm_omni")

from omni_harness import Start, WorkerResult, run

pytestmark = pytest.mark.timeout(1800)


@dataclass
class Runs:
    own: WorkerResult
    hwrd: WorkerResult


@pytest.fixture(scope="module")
def runs(vo_hwrd, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    base = tmp_path_factory.mktemp("flux2-unhashed")
    socket = str(vo_hwrd.socket)
    common = {"pipeline": "flux2-klein", "checkpoint": base / "checkpoint", "runtime_root": base / "runtime"}
    (base / "runtime").mkdir()
    # No socket: the plugin leaves vLLM-Omni's own filesystem store in the runtime root.
    own = run(**common, out=base / "own", write_checkpoint=True, starts=[
        Start("own-cold", forwards=0, straight=False),
        Start("own-warm", forwards=1, audit_hashing=True),
        Start("hwrd-cold", socket=socket, forwards=0, straight=False),
    ])[0]
    hwrd = run(**common, out=base / "hwrd", starts=[
        Start("hwrd-warm", mode="required", socket=socket, forwards=1, audit_hashing=True)])[0]
    return Runs(own, hwrd)


def test_the_audit_sees_vllm_omnis_own_store_hash_every_restored_tensor_twice(runs: Runs) -> None:
    warm = runs.own["own-warm"].expect_ok()
    assert warm.outcome == "local_hit", warm.raw
    hashing = warm.raw["hashing"]
    assert hashing["dit_bytes"] > 0
    assert hashing["restored_bytes"] >= 2 * hashing["dit_bytes"], hashing
    assert hashing["snapshots"]["proven"] == 0, hashing  # not an hwrd lease: vLLM-Omni's check


def test_an_hwrd_warm_start_hashes_no_restored_byte(runs: Runs) -> None:
    warm = runs.hwrd["hwrd-warm"].expect_ok()
    assert runs.hwrd.pid != runs.own.pid  # a fresh process
    assert warm.outcome == "local_hit" and warm.plan == "host_weight_runtime", warm.raw
    hashing = warm.raw["hashing"]
    assert hashing["restored_bytes"] == 0, hashing
    # Both snapshots (after the restore, after the warm finalization) proved every tensor.
    snapshots = hashing["snapshots"]
    assert snapshots["hashed"] == 0 and snapshots["proven"] > 0 and snapshots["proven"] % 2 == 0, snapshots
    # What is hashed at all is metadata: what vLLM-Omni's own warm start hashes besides the
    # restored tensors (identities, source records), plus hwrd's manifest (a few KiB).
    own = runs.own["own-warm"].expect_ok().raw["hashing"]
    assert hashing["total_bytes"] < own["total_bytes"] - own["restored_bytes"] + 64 * 1024, (hashing, own)


def test_a_restored_tensor_replaced_after_the_snapshot_is_still_reported_changed(runs: Runs) -> None:
    assert runs.hwrd["hwrd-warm"].raw["hashing"]["replaced_tensor_detected"] is True


def test_the_hwrd_warm_outputs_equal_the_own_stores(runs: Runs) -> None:
    own, hwrd = runs.own["own-warm"], runs.hwrd["hwrd-warm"]
    assert hwrd.straight == own.straight and hwrd.offloaded == own.offloaded == [own.straight]
