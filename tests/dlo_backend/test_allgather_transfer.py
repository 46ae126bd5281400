"""AllGatherTransfer's own ordering, in one process: two ranks as threads over a real gloo pair.

Each rank thread owns a real ``ProcessGroupGloo`` (one ``HashStore`` between them, TCP loopback),
wrapped in the ``DloCommunicator`` the backend uses, its own copy and communication lanes and
slots. Blocks are filled with a prefetch one ahead, as the ring does, through every input
configuration: one or two gather inputs, and the pinned-staging path CUDA falls back to when the
lease's ranges cannot be registered (plain memory on CPU, same ordering).
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hwr.dlo_backend.arena import HostArena, arena_bytes
from hwr.dlo_backend.communicator import DloCommunicator
from hwr.dlo_backend.lanes import ThreadLane, completed_signal
from hwr.dlo_backend.layout import TensorMeta, plan_block
from hwr.dlo_backend.shards import LeaseShards, input_nbytes
from hwr.dlo_backend.slots import SlotPair
from hwr.dlo_backend.transfer import AllGatherTransfer

WORLD = 2


def _blocks() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(5):  # odd depth, heterogeneous sizes, two dtypes, a transposed tensor
        w = torch.randn(8 + 4 * i, 12, generator=g)
        out.append([w, torch.randn(12, 16, generator=g).t(), torch.randn(7, generator=g).to(torch.bfloat16)])
    return out


def _rank(
    rank: int, store: dist.Store, inputs: int, staging: bool, failures: list[str], use_arena: bool = False
) -> None:
    hosts = _blocks()
    layouts = [
        plan_block(f"b{i}", [TensorMeta(f"t{j}", t.dtype, tuple(t.shape), tuple(t.stride())) for j, t in enumerate(h)],
                   WORLD)
        for i, h in enumerate(hosts)
    ]
    backend = dist.ProcessGroupGloo(dist.PrefixStore("t/", store), rank, WORLD, timedelta(seconds=20))
    comm = DloCommunicator(backend, [0, 1], rank, "t", timedelta(seconds=20))
    lanes = [ThreadLane("copy"), ThreadLane("comm")]
    slots = SlotPair(max(layout.nbytes for layout in layouts), torch.device("cpu"))
    size = max(input_nbytes(layout) for layout in layouts)
    arena = HostArena(arena_bytes([size] * 2)) if use_arena else None
    transfer = AllGatherTransfer(
        LeaseShards(layouts, hosts, rank), layouts, slots, *lanes, comm, torch.device("cpu"),
        inputs=inputs, staging=staging, arena=arena,
    )
    if arena is not None:
        # The staging buffers are carved from the arena (one exact-size registration on CUDA).
        start, end = arena.address_range
        for buffer in transfer.staging:
            if start > buffer.data_ptr() or buffer.data_ptr() + buffer.nbytes > end:
                failures.append(f"rank {rank}: a staging buffer lies outside the arena")
        if arena.used < 2 * size:
            failures.append(f"rank {rank}: the arena handed out {arena.used} bytes, not two staging buffers")
    try:
        for _ in range(2):  # two passes over the ring
            transfer.fill(0, 0)
            for block in range(len(hosts)):
                slot = block % 2
                slots.ready[slot].wait_host()
                if block + 1 < len(hosts):
                    transfer.fill(block + 1, 1 - slot)  # prefetch while this block is "computed"
                for index, host in enumerate(hosts[block]):
                    got = transfer.tensor(block, slot, index)
                    if got.stride() != host.stride() or not torch.equal(got, host):
                        failures.append(f"rank {rank} block {block} tensor {index}")
                slots.free[slot] = completed_signal()
            for lane in lanes:
                lane.drain()
    except Exception as exc:  # reported to the test thread
        failures.append(f"rank {rank}: {exc!r}")
    finally:
        for lane in lanes:
            lane.close()
        comm.close()
        if arena is not None:
            del transfer
            arena.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("inputs", "staging"), [(1, False), (2, False), (1, True), (2, True)])
def test_every_block_is_rebuilt_bit_exact_through_every_input_configuration(inputs: int, staging: bool) -> None:
    store = dist.HashStore()
    failures: list[str] = []
    threads = [threading.Thread(target=_rank, args=(r, store, inputs, staging, failures)) for r in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(50)
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    assert failures == []


@pytest.mark.timeout(60)
def test_staging_carved_from_a_host_arena_rebuilds_every_block() -> None:
    store = dist.HashStore()
    failures: list[str] = []
    threads = [threading.Thread(target=_rank, args=(r, store, 2, True, failures, True)) for r in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(50)
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    assert failures == []
