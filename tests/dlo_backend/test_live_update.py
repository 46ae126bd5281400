"""Live updates, rank-local: a new revision runs from the next pass on, never inside a pass.

Revisions are real read-only mappings of safetensors files (``SafetensorsLease``); every pass's
output is compared with a fresh, unhooked model loaded with the revision it should have run on.
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path

import pytest
import torch
from dlo_fixtures import SafetensorsLease, TinyDiT

from hwr.client.errors import InvalidRequest
from hwr.dlo_backend import HostSourceMismatch, RevisionMismatch, apply_layerwise_offload
from hwr.dlo_backend.transfer import DirectTransfer, HostBindTransfer

pytestmark = pytest.mark.timeout(60)

X = torch.randn(4, 16, generator=torch.Generator().manual_seed(7))


def _key(seed: int) -> str:
    return f"{seed:064x}"


def _revision(tmp: Path, seed: int, log: list[str] | None = None) -> SafetensorsLease:
    """Revision ``seed``: every tensor of ``TinyDiT(seed=seed)`` (blocks and the rest) in one file."""
    return SafetensorsLease.write(tmp / f"r{seed}.safetensors", TinyDiT(3, 2, seed=seed).state_dict(),
                                  key=_key(seed), log=log)


def _want(seed: int, x: torch.Tensor = X) -> torch.Tensor:
    with torch.no_grad():
        return TinyDiT(3, 2, seed=seed)(x)


def _run(model: torch.nn.Module, x: torch.Tensor = X) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize(
    ("zero_copy", "resident"),
    [(True, 0), (False, 0), (False, 1), (True, 1)],
    ids=["bind", "copy", "resident", "bind-resident"],
)
def test_each_pass_runs_one_revision_and_the_old_lease_is_released_at_the_switch(
    tmp_path: Path, zero_copy: bool, resident: int
) -> None:
    first = _revision(tmp_path, 0)
    model = TinyDiT(3, 2, seed=0)
    handle = apply_layerwise_offload(model, device="cpu", host_source=first, live_updates=True,
                                     cpu_zero_copy=zero_copy, resident_layers=resident)
    assert torch.equal(_run(model), _want(0))
    assert handle.revision.key == _key(0) and handle.revision.switches == 0
    second = _revision(tmp_path, 1)
    handle.update(second)
    # Staged, not taken: the switch waits for the next pass boundary.
    assert handle.revision.pending == _key(1) and first.close_calls == 0
    assert torch.equal(_run(model), _want(1))  # the model's embed/out switched with the blocks
    assert handle.revision.key == _key(1) and handle.revision.pending is None and handle.revision.switches == 1
    assert first.close_calls == 1 and second.close_calls == 0
    # Nothing of the old mapping is referenced any more; the new one backs the blocks.
    persistent = [host for src in handle.backend._streamed for ref, host in zip(src.refs, src.host, strict=True)
                  if ref.persistent]
    assert persistent and all(second.contains(h) for h in persistent)
    assert torch.equal(_run(model), _want(1))
    handle.close()
    assert second.close_calls == 1
    assert torch.equal(_run(model), _want(1))  # after close the model keeps the last revision


def test_an_update_during_a_pass_is_taken_at_the_next_one(tmp_path: Path) -> None:
    model = TinyDiT(3, 2, seed=0)
    handle = apply_layerwise_offload(model, device="cpu", host_source=_revision(tmp_path, 0), live_updates=True)
    second = _revision(tmp_path, 1)
    # Arrives while block 1 of the first pass runs, from another thread (as a follower's would).
    arrived = threading.Event()

    def mid_pass(*_: object) -> None:
        if not arrived.is_set():
            worker = threading.Thread(target=handle.update, args=(second,))
            worker.start()
            worker.join()
            arrived.set()

    hook = model.blocks[1].register_forward_pre_hook(mid_pass)
    assert torch.equal(_run(model), _want(0))  # the whole pass on the old revision
    assert arrived.is_set() and handle.revision.pending == _key(1)
    assert torch.equal(_run(model), _want(1))
    hook.remove()
    handle.close()


def test_a_revision_that_breaks_the_contract_is_refused_and_the_old_one_keeps_serving(tmp_path: Path) -> None:
    model = TinyDiT(3, 2, seed=0)
    handle = apply_layerwise_offload(model, device="cpu", host_source=_revision(tmp_path, 0), live_updates=True)
    cases = {
        "shape": {"blocks.1.fc1.weight": torch.zeros(5, 16)},
        "dtype": {"blocks.0.gate.weight": torch.zeros(16, 16)},  # fp32 where the model runs bf16
        "stride": {"blocks.2.proj_t": torch.zeros(16, 16)},  # contiguous where the model's is transposed
        "missing": {"out.bias": None},  # a non-block tensor is part of the contract too
    }
    for index, (case, change) in enumerate(cases.items()):
        state = dict(TinyDiT(3, 2, seed=5).state_dict())
        for name, value in change.items():
            if value is None:
                del state[name]
            else:
                state[name] = value
        bad = SafetensorsLease.write(tmp_path / f"bad{index}.safetensors", state, key=_key(100 + index))
        view = weakref.ref(bad.tensors["blocks.0.fc1.weight"])
        with pytest.raises(RevisionMismatch, match=next(iter(change))) as refused:
            handle.update(bad)
        assert isinstance(refused.value, HostSourceMismatch), case
        assert refused.value.details["key"] == _key(100 + index)
        assert bad.close_calls == 1, case
        # Nothing keeps the refused lease's views alive, not even the error the caller holds.
        assert view() is None, case
        last = handle.revision.last_error
        assert isinstance(last, RevisionMismatch) and last.details == refused.value.details
        assert torch.equal(_run(model), _want(0)), case
        assert handle.revision.key == _key(0) and handle.revision.switches == 0
    handle.close()


def test_the_newest_update_wins_and_a_replaced_one_is_released_at_once(tmp_path: Path) -> None:
    model = TinyDiT(3, 2, seed=0)
    handle = apply_layerwise_offload(model, device="cpu", host_source=_revision(tmp_path, 0), live_updates=True)
    second, third = _revision(tmp_path, 1), _revision(tmp_path, 2)
    handle.update(second)
    handle.update(third)
    assert second.close_calls == 1 and handle.revision.pending == _key(2)
    assert torch.equal(_run(model), _want(2)) and handle.revision.switches == 1
    again = _revision(tmp_path, 2)  # the revision already running: nothing to do
    handle.update(again)
    assert again.close_calls == 1 and handle.revision.pending is None
    handle.close()
    assert third.close_calls == 1


def test_non_block_views_of_the_old_lease_are_rebound_to_the_new_one(tmp_path: Path) -> None:
    """A model restored from a lease reads its embedding and output layers from the mapping too."""
    first = _revision(tmp_path, 0)
    model = TinyDiT(3, 2, seed=9)
    for name in ("embed.weight", "embed.bias", "out.weight", "out.bias"):
        module, attr = getattr(model, name.split(".")[0]), name.split(".")[1]
        getattr(module, attr).data = first.tensors[name]
    handle = apply_layerwise_offload(model, device="cpu", host_source=first, live_updates=True)
    assert torch.equal(_run(model), _want(0))
    second = _revision(tmp_path, 1)
    handle.update(second)
    assert torch.equal(_run(model), _want(1))
    assert second.contains(model.embed.weight) and second.contains(model.out.bias)
    assert first.close_calls == 1
    handle.close()


def test_a_model_that_started_on_its_own_tensors_can_move_to_a_lease(tmp_path: Path) -> None:
    model = TinyDiT(3, 2, seed=0)
    handle = apply_layerwise_offload(model, device="cpu", live_updates=True)
    assert handle.revision.key is None
    handle.update(_revision(tmp_path, 1))
    assert torch.equal(_run(model), _want(1)) and handle.revision.key == _key(1)
    handle.close()
    assert torch.equal(_run(model), _want(1))


@pytest.mark.parametrize("zero_copy", [True, False])
def test_the_old_lease_is_closed_only_after_the_prefetch_that_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, zero_copy: bool
) -> None:
    """The last pass on the old revision prefetched the first block from the old mapping; the
    switch waits for that read before it releases the lease."""
    log: list[str] = []
    first = _revision(tmp_path, 0, log=log)
    model = TinyDiT(3, 2, seed=0)
    handle = apply_layerwise_offload(model, device="cpu", host_source=first, live_updates=True, cpu_zero_copy=zero_copy)
    release = threading.Event()
    cls = HostBindTransfer if zero_copy else DirectTransfer
    name = "_populate_block" if zero_copy else "_copy_block"
    real = getattr(cls, name)

    def held(self: object, block: int, *rest: int) -> None:
        if block == 0 and not release.is_set():  # the tail's prefetch of the head, for the next pass
            release.wait(30)
            log.append("read done")
        real(self, block, *rest)

    for lane in handle.backend._runtime.lanes:  # enable's own fetch of block 0 is not the one to hold
        lane.drain()
    monkeypatch.setattr(cls, name, held)
    assert torch.equal(_run(model), _want(0))  # its tail prefetch of block 0 is now held on the lane
    handle.update(_revision(tmp_path, 1))

    def next_pass(*_: object) -> None:
        log.append("next pass")
        threading.Timer(0.2, release.set).start()  # the read ends only after the boundary began

    model.register_forward_pre_hook(next_pass, prepend=True)
    assert torch.equal(_run(model), _want(1))
    assert log.index("next pass") < log.index("read done") < log.index("close")
    handle.close()


def test_update_needs_live_updates_and_an_open_handle(tmp_path: Path) -> None:
    model = TinyDiT(3, 2, seed=0)
    handle = apply_layerwise_offload(model, device="cpu", host_source=_revision(tmp_path, 0))
    lease = _revision(tmp_path, 1)
    with pytest.raises(InvalidRequest, match="live_updates"):
        handle.update(lease)
    assert lease.close_calls == 1
    handle.close()
    live = apply_layerwise_offload(TinyDiT(3, 2, seed=0), device="cpu", live_updates=True)
    live.close()
    late = _revision(tmp_path, 2)
    with pytest.raises(InvalidRequest):
        live.update(late)
    assert late.close_calls == 1


def test_close_releases_a_pending_update(tmp_path: Path) -> None:
    model = TinyDiT(3, 2, seed=0)
    handle = apply_layerwise_offload(model, device="cpu", host_source=_revision(tmp_path, 0), live_updates=True)
    pending = _revision(tmp_path, 1)
    handle.update(pending)
    handle.close()
    assert pending.close_calls == 1
    assert torch.equal(_run(model), _want(0))
