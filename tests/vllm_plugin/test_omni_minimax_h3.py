"""MiniMax-H3 through vLLM-Omni's own loader and DLO, warm from hwrd (``omni_harness``).

The second DiT of vLLM-Omni 0.30 that declares the final-layout restore contract. A tiny FL2VA
partition (T2VA task, no local text encoder: ``model_loaded.text_encoder=false``) is written at
test time: the DiT's native checkpoint laid out by vLLM-Omni's own ``MiniMaxH3DiTModel``, and
tiny VAE modeling code of its own where the real checkpoint ships its VAEs as remote code
(``omni_pipelines``). The DiT runs one T2VA denoise step whose inputs vLLM-Omni's own packing
builds (``minimax_h3_packed_sequence``, ``MiniMaxH3DenoiseBranch``). Cold ``preferred`` in one
process, warm ``required`` in a fresh one; fakes only at the accelerator boundary.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm_omni")

from omni_harness import Start, WorkerResult, run

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def h3(vo_hwrd, omni_zygote, tmp_path_factory: pytest.TempPathFactory) -> tuple[WorkerResult, WorkerResult]:
    base = tmp_path_factory.mktemp("minimax-h3")
    (base / "runtime").mkdir()
    common = {"pipeline": "minimax-h3", "checkpoint": base / "checkpoint", "runtime_root": base / "runtime",
              "zygote": omni_zygote}
    socket = str(vo_hwrd.socket)
    cold = run(**common, out=base / "cold", write_checkpoint=True, starts=[Start("cold", socket=socket)])[0]
    warm = run(**common, out=base / "warm", starts=[
        Start("warm-required", mode="required", socket=socket, registration="registered")])[0]
    return cold, warm


def test_minimax_h3_cold_then_warm_required_in_a_fresh_process(h3, vo_hwrd) -> None:
    cold, warm = h3
    reference = cold["cold"].expect_ok()
    assert reference.outcome == "canonical_fallback" and reference.plan is None
    start = warm["warm-required"].expect_ok()
    assert start.outcome == "local_hit" and start.plan == "host_weight_runtime"
    (held,) = start.raw["leases_during"]
    assert held["pid"] == warm.pid != cold.pid
    homes = start.raw["dit_homes"]
    store = Path(vo_hwrd.root) / "artifacts" / held["key"]
    assert homes["not_file_backed"] == [] and homes["file_mappings"]
    assert all(home.startswith("r--s ") and Path(home[5:]).parent == store for home in homes["file_mappings"])
    offload = start.raw["offload"]
    assert offload["carrier_taken"] and offload["carrier_closed"] and start.raw["leases_after"] == []
    assert start.raw["registration"]["registered"]


def test_minimax_h3_warm_outputs_are_bit_identical_to_the_cold_ones(h3) -> None:
    cold, warm = h3
    reference = cold["cold"].expect_ok()
    start = warm["warm-required"].expect_ok()
    assert reference.offloaded == [reference.straight] * 2
    assert start.straight == reference.straight and start.offloaded == [reference.straight] * 2
    output = reference.tensor()
    assert output.isfinite().all() and output.abs().sum() > 0
