"""Live updates, rollbacks, rank-local: an update to the running revision cancels a pending one.

Revisions are real read-only mappings of safetensors files (``SafetensorsLease``); every pass's
output is compared with a fresh, unhooked model of the revision it should have run on.
(AllGather ranks and a real hwrd channel: ``tests/e2e/test_live_rollback.py``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dlo_fixtures import SafetensorsLease, TinyDiT

from hwr.dlo_backend import apply_layerwise_offload

pytestmark = pytest.mark.timeout(60)

X = torch.randn(4, 16, generator=torch.Generator().manual_seed(11))


def _revision(tmp: Path, seed: int, name: str = "") -> SafetensorsLease:
    return SafetensorsLease.write(tmp / f"r{seed}{name}.safetensors", TinyDiT(3, 2, seed=seed).state_dict(),
                                  key=f"{seed:064x}")


def _want(seed: int) -> torch.Tensor:
    with torch.no_grad():
        return TinyDiT(3, 2, seed=seed)(X)


def _run(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(X)


def test_a_return_to_the_running_revision_cancels_the_pending_one(tmp_path: Path) -> None:
    first = _revision(tmp_path, 0)
    model = TinyDiT(3, 2, seed=0)
    handle = apply_layerwise_offload(model, device="cpu", host_source=first, live_updates=True)
    assert torch.equal(_run(model), _want(0))
    pending = _revision(tmp_path, 1)
    handle.update(pending)
    assert handle.revision.pending == f"{1:064x}"
    again = _revision(tmp_path, 0, "-again")  # a new lease of the running key: the rollback
    handle.update(again)
    # B is dropped (its lease closed: hwrd may evict it), the new lease of A is not needed.
    assert handle.revision.pending is None and pending.close_calls == 1 and again.close_calls == 1
    for _ in range(3):
        assert torch.equal(_run(model), _want(0))
    assert handle.revision.key == f"{0:064x}" and handle.revision.switches == 0
    assert first.close_calls == 0  # still running
    handle.close()
    assert first.close_calls == 1


def test_without_a_pending_revision_an_update_to_the_running_one_changes_nothing(tmp_path: Path) -> None:
    first = _revision(tmp_path, 0)
    model = TinyDiT(3, 2, seed=0)
    handle = apply_layerwise_offload(model, device="cpu", host_source=first, live_updates=True)
    again = _revision(tmp_path, 0, "-again")
    handle.update(again)
    assert again.close_calls == 1 and handle.revision.pending is None
    assert torch.equal(_run(model), _want(0)) and handle.revision.switches == 0
    handle.close()
