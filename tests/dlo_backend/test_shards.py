"""Shard sources: the lease's pieces rebuild the same bytes as private shards; registration ranges."""

from __future__ import annotations

import mmap

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_planning import _bytes, _metas, tensors

from hwr.client.carrier import MappedRegion
from hwr.dlo_backend.layout import BlockLayout, plan_block
from hwr.dlo_backend.shards import LeaseShards, PrivateShards, build_shard, input_nbytes, merge_ranges, shard_offsets


def _gathered(layout: BlockLayout, inputs: list[torch.Tensor]) -> torch.Tensor:
    """What all_gather builds in a slot from every rank's gather input (done by hand)."""
    slot = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for group, offset in zip(layout.groups, shard_offsets(layout), strict=True):
        chunks = [inputs[r][offset : offset + group.shard_nbytes] for r in range(layout.world)]
        slot[group.byte_offset : group.byte_offset + group.nbytes].copy_(torch.cat(chunks))
    return slot


@settings(max_examples=60, deadline=None)
@given(tensors(), st.integers(1, 5))
def test_lease_pieces_and_private_shards_gather_to_the_same_tensors(ts: list[torch.Tensor], world: int) -> None:
    layout = plan_block("b", _metas(ts), world)
    lease_inputs, private_inputs = [], []
    for rank in range(world):
        for source, inputs in (
            (LeaseShards([layout], [ts], rank), lease_inputs),
            (PrivateShards([build_shard(layout, ts, rank, pin=False)], [layout]), private_inputs),
        ):
            target = torch.full((input_nbytes(layout),), 0xAB, dtype=torch.uint8)  # gaps: unspecified
            source.copy_into(0, target)
            inputs.append(target)
    from_lease, from_private = _gathered(layout, lease_inputs), _gathered(layout, private_inputs)
    for placed, t in zip(layout.tensors, ts, strict=True):
        group = layout.groups[placed.group]
        for slot in (from_lease, from_private):
            region = slot[group.byte_offset : group.byte_offset + group.nbytes].view(group.dtype)
            view = torch.as_strided(region, t.shape, t.stride(), region.storage_offset() + placed.offset)
            assert torch.equal(_bytes(view), _bytes(t))


def test_a_rank_reads_only_its_own_share_of_every_block() -> None:
    ts = [torch.randn(64, 64), torch.randn(64)]
    layout = plan_block("b", _metas(ts), 4)
    sources = [LeaseShards([layout], [ts], rank) for rank in range(4)]
    assert all(s.host_bytes == 0 for s in sources)
    read = [s.piece_bytes for s in sources]
    assert sum(read) == sum(t.numel() * t.element_size() for t in ts)  # every byte read by exactly one rank
    assert max(read) <= layout.shard_nbytes
    spans = [(p.source.data_ptr(), p.source.numel()) for s in sources for p in s.pieces[0]]
    for i, (a, la) in enumerate(spans):  # no two ranks read the same byte
        assert all(a + la <= b or b + lb <= a for b, lb in spans[i + 1 :])


def test_merge_ranges_sorts_and_merges_overlapping_and_touching_ranges() -> None:
    assert merge_ranges([(100, 10), (0, 10), (10, 5), (105, 20), (200, 0)]) == [(0, 15), (100, 25)]
    assert merge_ranges([]) == []


def test_registration_ranges_are_page_aligned_inside_the_mapping_and_cover_every_piece() -> None:
    page = mmap.PAGESIZE
    raw = torch.zeros(64 * page + 100, dtype=torch.uint8)  # stands in for a mapping
    base = raw.data_ptr()
    ts = [raw[8 : 8 + 16 * page].view(torch.float32), raw[20 * page : 40 * page].view(torch.float32)]
    layout = plan_block("b", _metas(ts), 2)
    mapped = (MappedRegion("model.safetensors", base - base % page, 66 * page, True),)
    for rank in range(2):
        source = LeaseShards([layout], [ts], rank)
        regions = source.regions(mapped)
        assert regions and all(r.read_only and r.file == "model.safetensors" for r in regions)
        assert all(r.address % page == 0 and r.length % page == 0 for r in regions)
        for piece in source.pieces[0]:
            lo, hi = piece.source.data_ptr(), piece.source.data_ptr() + piece.source.numel()
            assert any(r.address <= lo and hi <= r.address + r.length for r in regions)
        # Only its own ranges: about half of the 36 pages of weights, never the whole mapping.
        assert sum(r.length for r in regions) <= 20 * page
    outside = (MappedRegion("other", base + 1000 * page, page, True),)
    assert LeaseShards([layout], [ts], 0).regions(outside) == ()
