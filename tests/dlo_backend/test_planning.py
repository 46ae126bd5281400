"""Pure planning: slot layout, shards, manifest digest, and the ring's slot decisions."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hwr.dlo_backend.layout import TENSOR_ALIGN_BYTES, TensorMeta, manifest_digest, plan_block, shard_pieces
from hwr.dlo_backend.ring import plan_step
from hwr.dlo_backend.shards import build_shard, flat_span

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int64]


@st.composite
def tensors(draw: st.DrawFn) -> list[torch.Tensor]:
    out = []
    for i in range(draw(st.integers(1, 6))):
        dtype = draw(st.sampled_from(DTYPES))
        rows, cols = draw(st.integers(1, 9)), draw(st.integers(1, 9))
        base = torch.arange(rows * cols, dtype=torch.float32).add(i * 100).to(dtype).view(rows, cols)
        out.append(base.t() if draw(st.booleans()) else base)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).view(torch.uint8)


def _metas(ts: list[torch.Tensor]) -> list[TensorMeta]:
    return [TensorMeta(f"t{i}", t.dtype, tuple(t.shape), tuple(t.stride())) for i, t in enumerate(ts)]


@settings(max_examples=60, deadline=None)
@given(tensors(), st.integers(1, 5))
def test_shards_of_all_ranks_rebuild_every_tensor_with_its_stride(ts: list[torch.Tensor], world: int) -> None:
    layout = plan_block("b", _metas(ts), world)
    shards = [build_shard(layout, ts, rank, pin=False) for rank in range(world)]
    slot = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for g, group in enumerate(layout.groups):
        assert group.numel == group.shard_numel * world
        assert group.shard_numel == math.ceil(group.numel / world)
        assert group.byte_offset % 256 == 0
        whole = slot[group.byte_offset : group.byte_offset + group.nbytes].view(group.dtype)
        whole.view(torch.uint8).copy_(torch.cat([shards[r][g].view(torch.uint8) for r in range(world)]))
    for index, (placed, t) in enumerate(zip(layout.tensors, ts, strict=True)):
        group = layout.groups[placed.group]
        assert (placed.offset * group.itemsize) % TENSOR_ALIGN_BYTES == 0
        region = slot[group.byte_offset : group.byte_offset + group.nbytes].view(group.dtype)
        view = torch.as_strided(region, t.shape, t.stride(), region.storage_offset() + placed.offset)
        # Bytes, not values: float8 overflow gives NaN, which never compares equal.
        assert torch.equal(_bytes(view), _bytes(t)), index
        assert view.stride() == t.stride()


@given(tensors(), st.integers(1, 5))
def test_shard_pieces_cover_each_span_exactly_once(ts: list[torch.Tensor], world: int) -> None:
    layout = plan_block("b", _metas(ts), world)
    covered = [0] * len(ts)
    for g in range(len(layout.groups)):
        for rank in range(world):
            for piece in shard_pieces(layout, g, rank):
                covered[piece.tensor] += piece.length
                assert piece.target >= 0 and piece.target + piece.length <= layout.groups[g].shard_numel
    assert covered == [flat_span(t).numel() for t in ts]


def test_manifest_digest_changes_with_any_shape_dtype_stride_or_name() -> None:
    base = [TensorMeta("w", torch.float32, (4, 8), (8, 1))]
    digest = manifest_digest([plan_block("b", base, 2)])
    assert digest == manifest_digest([plan_block("b", base, 2)])
    for other in (
        [TensorMeta("w", torch.float32, (4, 8), (1, 4))],
        [TensorMeta("w", torch.bfloat16, (4, 8), (8, 1))],
        [TensorMeta("w", torch.float32, (8, 4), (4, 1))],
        [TensorMeta("v", torch.float32, (4, 8), (8, 1))],
    ):
        assert manifest_digest([plan_block("b", other, 2)]) != digest
    assert manifest_digest([plan_block("b", base, 4)]) != digest


def _simulate(order: list[int], count: int) -> tuple[int, int]:
    """Run the policy over a call order; return (on-demand fetches, prefetches)."""
    owners: list[int | None] = [0, None]  # enable prefetches block 0 into slot 0
    last: int | None = None
    fetches = prefetches = 0
    for block in order:
        step = plan_step(block, (owners[0], owners[1]), last, count)
        if step.fetch:
            fetches += 1
            owners[step.slot] = block
        assert owners[step.slot] == block  # the block runs from the slot that holds it
        if step.prefetch is not None:
            assert step.prefetch_slot != step.slot  # never overwrite the running block
            owners[step.prefetch_slot] = step.prefetch
            prefetches += 1
        last = step.slot
    return fetches, prefetches


@pytest.mark.parametrize("count", [2, 3, 4, 5, 6, 7, 72])
def test_in_order_passes_never_fetch_on_demand_for_odd_and_even_counts(count: int) -> None:
    passes = 5
    fetches, prefetches = _simulate(list(range(count)) * passes, count)
    assert fetches == 0
    # Two blocks fit the two slots: after the first pass nothing moves at all.
    assert prefetches == (count * passes if count > 2 else 1)


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 9), st.randoms(use_true_random=False))
def test_any_call_order_runs_each_block_from_its_own_slot(count: int, rnd: random.Random) -> None:
    order = [rnd.randrange(count) for _ in range(30)]
    _simulate(order, count)


def test_plan_step_rejects_a_ring_of_one() -> None:
    with pytest.raises(ValueError):
        plan_step(0, (None, None), None, 1)
