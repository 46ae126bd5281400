"""A revision's host side as a live update builds it, and the pure decisions around it.

The CUDA cases replace the CUDA runtime that ``registration`` and ``arena`` call with
``cuda_fake.FakeCudaRuntime`` (the accelerator boundary: registration calls, their errors and
the thread's last error); everything else is real: mapped safetensors files, layouts, shards,
arenas. No GPU is used, so these check the host side of the CUDA path (what is registered,
which transfer and staging a revision gets, the release order), not CUDA copies.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cuda_fake import FakeCudaRuntime
from dlo_fixtures import SafetensorsLease, TinyDiT
from hypothesis import given
from hypothesis import strategies as st

from hwr.dlo_backend import registration
from hwr.dlo_backend.agreement import Offer, Proposal, decide, decode, encode
from hwr.dlo_backend.contract import TensorContract, collect_rest, mismatches
from hwr.dlo_backend.errors import RevisionMismatch
from hwr.dlo_backend.layout import TensorMeta, plan_block
from hwr.dlo_backend.revision import (
    Revision,
    RevisionContext,
    TransferKind,
    lease_hosts,
    register_host,
    shard,
    stage,
    transfer_kind,
)
from hwr.dlo_backend.shards import LeaseShards
from hwr.dlo_backend.sources import collect_blocks

pytestmark = pytest.mark.timeout(60)

CUDA = torch.device("cuda", 0)
DIGESTS = [bytes([i]) * 32 for i in range(3)]


# --------------------------------------------------------------------------- agreement
def test_all_ranks_switch_only_when_every_one_holds_the_same_revision() -> None:
    a, b = DIGESTS[1], DIGESTS[2]
    assert decide([Proposal(Offer.READY, a)] * 2).switch == a
    assert decide([Proposal(Offer.READY, a), Proposal()]).switch is None  # rank 1 has nothing yet
    assert decide([Proposal(Offer.READY, a), Proposal(Offer.READY, b)]).switch is None  # ranks disagree
    refused = decide([Proposal(Offer.READY, a), Proposal(Offer.REFUSED, a)])
    assert refused.switch is None and refused.refused == {a: (1,)}


@given(st.lists(st.tuples(st.sampled_from(list(Offer)), st.sampled_from(DIGESTS)), min_size=1, max_size=8))
def test_the_verdict_is_a_unanimous_ready_or_nothing(rows: list[tuple[Offer, bytes]]) -> None:
    proposals = [Proposal(offer, digest) for offer, digest in rows]
    verdict = decide(proposals)
    unanimous = all(p.offer is Offer.READY for p in proposals) and len({p.digest for p in proposals}) == 1
    assert (verdict.switch is not None) == unanimous
    assert set(verdict.refused) == {p.digest for p in proposals if p.offer is Offer.REFUSED}
    wire = b"".join(encode(p) for p in proposals)
    assert decode(wire, len(proposals)) == proposals  # what every rank decodes from the gather


# --------------------------------------------------------------------------- contract
def test_contract_mismatches_name_each_tensor() -> None:
    want = {"a": TensorMeta("a", torch.float32, (2, 3), (3, 1)), "b": TensorMeta("b", torch.bfloat16, (4,), (1,))}
    same = dict(want)
    assert mismatches(want, same) == []
    assert mismatches(want, {**same, "extra": TensorMeta("extra", torch.int8, (1,), (1,))}) == []
    assert mismatches(want, {"a": want["a"]}) == ["b: missing"]
    transposed = TensorMeta("a", torch.float32, (2, 3), (1, 2))
    assert mismatches(want, {**same, "a": transposed})[0].startswith("a: torch.float32 [2, 3] stride [1, 2]")


def test_the_contract_covers_blocks_and_the_rest_of_the_model(tmp_path: Path) -> None:
    model = TinyDiT(3, 2)
    blocks = [*model.blocks, *model.single_blocks]
    contract = TensorContract.of(collect_blocks(model, blocks), collect_rest(model, blocks))
    assert set(contract.metas) == set(model.state_dict())  # every persistent tensor, nothing else
    state = dict(TinyDiT(3, 2, seed=4).state_dict())
    contract.check(state, "k")
    del state["embed.bias"]
    with pytest.raises(RevisionMismatch, match=r"embed\.bias: missing"):
        contract.check(state, "k")


# --------------------------------------------------------------------------- CUDA host side (faked runtime)
class _OrderedLease(SafetensorsLease):
    """Fails the test if it is closed while CUDA still has any of its pages registered."""

    runtime: FakeCudaRuntime

    def close(self) -> None:
        base, end = self.base, self.base + self.size
        assert not any(r.address < end and base < r.address + r.length for r in self.runtime.registered)
        super().close()


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> FakeCudaRuntime:
    fake = FakeCudaRuntime()
    monkeypatch.setattr(registration, "_torch_runtime", lambda: fake)
    return fake


def _built(
    tmp_path: Path, runtime: FakeCudaRuntime, *, world: int = 1, rank: int = 0, dim: int = 16
) -> tuple[RevisionContext, Revision]:
    model = TinyDiT(3, 2, dim=dim)
    sources = collect_blocks(model, [*model.blocks, *model.single_blocks])
    state = TinyDiT(3, 2, dim=dim, seed=3).state_dict()
    lease = _OrderedLease.write(tmp_path / f"r{world}{rank}.safetensors", state)
    lease.runtime = runtime
    hosts = lease_hosts(sources, lease.tensors)
    layouts = tuple(
        plan_block(src.name, tuple(TensorMeta(r.name, h.dtype, tuple(h.shape), tuple(h.stride()))
                                   for r, h in zip(src.refs, host, strict=True)), world)
        for src, host in zip(sources, hosts, strict=True)
    )
    ctx = RevisionContext(device=CUDA, layouts=layouts, world=world, rank=rank, allgather=world > 1)
    revision = Revision(lease, hosts=hosts)
    shard(revision, ctx)
    register_host(revision, ctx, 0)
    stage(revision, ctx)
    return ctx, revision


def test_a_rank_local_revision_registers_its_mapping_and_streams_direct(
    tmp_path: Path, runtime: FakeCudaRuntime
) -> None:
    ctx, revision = _built(tmp_path, runtime)
    assert revision.registered and transfer_kind(ctx, revision) == (TransferKind.DIRECT, False)
    assert revision.staging is None
    lease = revision.lease
    assert lease is not None
    region = lease.mapped_regions[0]
    assert runtime.pinned_for(0, region.address, region.length)
    assert revision.close() == [] and runtime.registered == [] and lease.closed
    runtime.launch()


def test_a_revision_whose_mapping_cannot_be_registered_gets_pinned_staging(
    tmp_path: Path, runtime: FakeCudaRuntime
) -> None:
    runtime.fail_register_at = {0}  # the lease's registration fails; the staging arena's works
    ctx, revision = _built(tmp_path, runtime)
    assert not revision.registered
    assert transfer_kind(ctx, revision) == (TransferKind.STAGED, True)
    assert revision.staging is not None and revision.staging.pinned
    runtime.launch()  # the failed registration's error was cleared
    assert revision.close() == [] and runtime.registered == []


def test_an_allgather_revision_registers_only_this_ranks_pieces(tmp_path: Path, runtime: FakeCudaRuntime) -> None:
    ctx, revision = _built(tmp_path, runtime, world=2, rank=1, dim=128)  # tensors of many pages
    assert isinstance(revision.shards, LeaseShards)
    lease = revision.lease
    assert lease is not None and revision.registered
    registered = sum(r.length for r in runtime.registered)
    assert 0 < registered < 0.75 * lease.mapped_regions[0].length  # about half: not the other rank's pages
    assert transfer_kind(ctx, revision) == (TransferKind.ALLGATHER, False)
    assert revision.close() == [] and lease.closed


def test_a_revision_that_stays_registered_keeps_its_lease_until_a_retry_works(
    tmp_path: Path, runtime: FakeCudaRuntime
) -> None:
    _, revision = _built(tmp_path, runtime)
    lease = revision.lease
    assert lease is not None
    runtime.fail_unregister = {r.address for r in runtime.registered}
    failures = revision.close()
    assert failures and not lease.closed and not revision.closed  # unmapping registered memory: never
    runtime.launch()
    runtime.fail_unregister = set()
    assert revision.close() == [] and lease.closed and revision.closed
