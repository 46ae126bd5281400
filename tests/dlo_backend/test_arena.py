"""Host arenas: exact-size memory for shards and staging, pinned by one registration.

The CUDA runtime is ``cuda_fake.FakeCudaRuntime`` (the boundary ``registration`` calls); the
memory itself is real (an anonymous mapping), so views, alignment and unmapping are real too.
"""

from __future__ import annotations

import mmap

import pytest
import torch
from cuda_fake import PORTABLE, READ_ONLY, FakeCudaRuntime

from hwr.dlo_backend.arena import HostArena, arena_bytes
from hwr.dlo_backend.layout import TENSOR_ALIGN_BYTES, TensorMeta, plan_block
from hwr.dlo_backend.shards import build_shard

pytestmark = pytest.mark.timeout(30)


def test_an_arena_holds_exactly_what_it_was_sized_for_with_aligned_views() -> None:
    sizes = [1000, 3 * 4, 70_001]
    arena = HostArena(arena_bytes(sizes))
    # Page-rounded exact size, where the pinned allocator would round 71,013 bytes up to 131,072.
    assert arena.capacity == -(-arena_bytes(sizes) // mmap.PAGESIZE) * mmap.PAGESIZE < 131_072
    views = [arena.take(1000, torch.uint8), arena.take(3, torch.float32), arena.take(70_001, torch.uint8)]
    assert [v.nbytes for v in views] == sizes
    assert all(v.data_ptr() % TENSOR_ALIGN_BYTES == 0 for v in views)
    assert all(int(v.count_nonzero()) == 0 for v in views)
    views[1].fill_(1.5)
    assert int(views[0].count_nonzero()) == 0 and int(views[2].count_nonzero()) == 0  # no overlap
    with pytest.raises(ValueError, match="cannot hold"):
        arena.take(arena.capacity, torch.uint8)
    del views
    assert arena.close() == [] and arena.close() == []


def test_a_cuda_arena_is_registered_once_portable_on_its_device_and_unregistered_at_close() -> None:
    runtime = FakeCudaRuntime(current=0)
    arena = HostArena(5 * mmap.PAGESIZE, device=torch.device("cuda", 2), runtime=runtime)
    assert arena.pinned
    [registered] = runtime.registered
    assert registered.length == arena.capacity and registered.device == 2
    assert registered.flags == PORTABLE and not registered.flags & READ_ONLY  # private, writable memory
    assert arena.close() == [] and runtime.registered == []


def test_an_arena_whose_registration_fails_stays_usable_as_pageable_memory() -> None:
    runtime = FakeCudaRuntime(fail_register_at={0})
    arena = HostArena(mmap.PAGESIZE, device=torch.device("cuda", 0), runtime=runtime)
    assert not arena.pinned and runtime.registered == []
    runtime.launch()  # the failure's CUDA error was cleared
    arena.take(16, torch.float32).fill_(2.0)
    assert arena.close() == []


def test_an_arena_that_cannot_be_unregistered_is_kept_mapped_and_reported() -> None:
    runtime = FakeCudaRuntime()
    arena = HostArena(mmap.PAGESIZE, device=torch.device("cuda", 0), runtime=runtime)
    runtime.fail_unregister = {runtime.registered[0].address}
    failures = arena.close()
    assert failures and arena.pinned
    arena.take(4, torch.uint8)  # still mapped
    runtime.fail_unregister = set()
    assert arena.close() == [] and not arena.pinned


def test_shards_carved_from_an_arena_equal_private_ones() -> None:
    torch.manual_seed(0)
    host = [torch.randn(7, 5), torch.randn(5, 3).t(), torch.randn(11).to(torch.bfloat16)]
    layout = plan_block("b", [TensorMeta(f"t{i}", t.dtype, tuple(t.shape), tuple(t.stride())) for i, t in
                              enumerate(host)], world=3)
    arena = HostArena(arena_bytes(g.shard_nbytes for g in layout.groups) * 3)
    for rank in range(3):
        private = build_shard(layout, host, rank, pin=False)
        carved = build_shard(layout, host, rank, pin=False, arena=arena)
        assert len(private) == len(carved) and all(torch.equal(a, b) for a, b in zip(private, carved, strict=True))
