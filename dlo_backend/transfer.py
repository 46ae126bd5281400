"""Transfers: how a block's bytes get from the host into a device slot, on which lane.

Four strategies share two calls: ``fill(block, slot)`` submits the work and sets
``slots.ready[slot]`` (it never blocks on the device except where staging reuse requires it),
and ``tensor(block, slot, index)`` is what compute binds for tensor ``index`` of ``block`` once
``slot`` is ready.

- ``HostBindTransfer`` (CPU device, rank-local): the "device" is the host, so compute binds the
  host tensors themselves (the lease's mapped views or the module's own tensors); nothing is
  copied and the slots hold no bytes. ``fill`` only populates the block's page tables on the
  copy lane (``paging.populate``) so a fresh lease's first-touch faults run ahead of compute.
  The ring, prefetch order and slot ownership are those of the copying transfers.

- ``DirectTransfer``: copy each tensor's storage span host -> slot on the copy lane. Used when
  the device can read the host memory asynchronously (pinned module tensors, or a lease whose
  mappings are ``cudaHostRegister``-ed; on a CPU device only when zero-copy is turned off).
- ``StagedTransfer``: pack the block into one of two bounded host staging buffers (pinned on
  CUDA), then one H2D copy. A staging buffer is reused only after the copy that last read it
  finished (host wait on its signal).
- ``AllGatherTransfer``: write this rank's shard (pre-built private shards, or its pieces read
  straight from the lease mapping, see ``shards``) into a device gather input on the copy lane,
  then ``all_gather`` it into the slot on the communication lane (bytes, so any dtype works on
  gloo and NCCL), on DLO's own communicator (see ``communicator``). Every rank must call
  ``fill`` in the same order.

Every writer first waits on ``slots.free[slot]`` (compute may still read the slot's previous
block) and, for AllGather, on the last gather that read the gather input it is about to
overwrite. ``HostBindTransfer`` writes nothing, so it waits on neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from hwr.dlo_backend import lanes
from hwr.dlo_backend.arena import HostArena
from hwr.dlo_backend.group import all_gather_bytes
from hwr.dlo_backend.lanes import Lane, Signal, completed_signal
from hwr.dlo_backend.layout import BlockLayout
from hwr.dlo_backend.paging import populate
from hwr.dlo_backend.shards import ShardSource, flat_span, input_nbytes, shard_offsets
from hwr.dlo_backend.slots import SlotPair

__all__ = ["AllGatherTransfer", "DirectTransfer", "HostBindTransfer", "StagedTransfer", "Transfer"]


class Transfer(Protocol):
    mode: str

    def fill(self, block: int, slot: int) -> None: ...

    def tensor(self, block: int, slot: int, index: int) -> torch.Tensor: ...

    def close(self) -> None:
        """Drop every host tensor held (the lease's views among them), so that closing the lease
        unmaps it at once instead of when the garbage collector gets to it."""
        ...


class _SlotViews:
    """Compute reads the slot: tensor ``index`` rebuilt over the slot bytes (zero copy)."""

    _slots: SlotPair
    _layouts: Sequence[BlockLayout]

    def tensor(self, block: int, slot: int, index: int) -> torch.Tensor:
        return self._slots.tensor_view(slot, self._layouts[block], index)


class HostBindTransfer:
    """CPU device, rank-local: compute binds the host tensors; ``fill`` only pre-faults pages.

    Same contract as the copying transfers from the stream's point of view (``fill`` sets
    ``ready``; compute waits on it before binding), so the ring and its tests are unchanged.
    Limits: the bound tensors are the lease's read-only mappings, so a model that writes into
    its weights during forward faults (SIGSEGV) instead of writing a private slot copy; such a
    model must use ``cpu_zero_copy=False``. The slots stay empty (``slot_bytes == 0``).
    """

    mode = "bind"

    def __init__(self, hosts: Sequence[list[torch.Tensor]], slots: SlotPair, lane: Lane) -> None:
        self._hosts, self._slots, self._lane = hosts, slots, lane

    def _populate_block(self, block: int) -> None:
        for host in self._hosts[block]:
            populate(host)

    def fill(self, block: int, slot: int) -> None:
        # No wait on ``free``: nothing is written into the slot, so compute reading the slot's
        # previous block cannot be disturbed. Compute still waits on ``ready`` (the pre-fault),
        # which keeps every ordering rule of the copying transfers (and the lane's errors).
        self._lane.submit(lambda: self._populate_block(block))
        self._slots.ready[slot] = self._lane.record()

    def tensor(self, block: int, slot: int, index: int) -> torch.Tensor:
        return self._hosts[block][index]

    def close(self) -> None:
        self._hosts = []  # lease views: the mapping must not outlive the lease's close


class DirectTransfer(_SlotViews):
    """Host tensors -> slot, one copy per tensor span, on the copy lane."""

    mode = "direct"

    def __init__(
        self, hosts: Sequence[list[torch.Tensor]], layouts: Sequence[BlockLayout], slots: SlotPair, lane: Lane
    ) -> None:
        self._hosts, self._layouts, self._slots, self._lane = hosts, layouts, slots, lane

    def _copy_block(self, block: int, slot: int) -> None:
        layout = self._layouts[block]
        for index, host in enumerate(self._hosts[block]):
            # non_blocking: the source is pinned/registered or the device is the CPU itself.
            self._slots.span_view(slot, layout, index).copy_(flat_span(host), non_blocking=True)

    def fill(self, block: int, slot: int) -> None:
        # Wait: the slot's previous block may still be read by compute.
        self._lane.wait(self._slots.free[slot])
        self._lane.submit(lambda: self._copy_block(block, slot))
        self._slots.ready[slot] = self._lane.record()

    def close(self) -> None:
        self._hosts = []  # lease views: the mapping must not outlive the lease's close


class StagedTransfer(_SlotViews):
    """Host tensors -> bounded staging buffer (host memcpy) -> slot (one H2D copy).

    The host memcpy (the pack) runs on ``packer`` (a worker thread), not in the forward hook
    that calls ``fill``: the hook returns at once, and compute's kernels are enqueued while the
    next block is packed (torch's CPU copy releases the GIL). The packer then enqueues the H2D
    on the copy lane itself and resolves the slot's ``ready`` (a ``DeferredSignal``). At most
    two blocks are packed ahead: staging buffer ``k`` is repacked only after the H2D that last
    read it finished (the packer waits on its signal). A failed pack fails that block's
    ``ready`` and every later one (compute then raises ``LaneError``); the packer never stops
    on an error, so no ``ready`` is left unresolved.
    """

    mode = "staged"

    def __init__(
        self,
        hosts: Sequence[list[torch.Tensor]],
        layouts: Sequence[BlockLayout],
        slots: SlotPair,
        lane: Lane,
        *,
        pin: bool,
        packer: Lane,
        arena: HostArena | None = None,
    ) -> None:
        self._hosts, self._layouts, self._slots, self._lane = hosts, layouts, slots, lane
        self._packer = packer
        if arena is not None:  # exact sizes, one registration (see ``arena``)
            self.staging = [arena.take(slots.nbytes, torch.uint8) for _ in range(2)]
        else:
            self.staging = [torch.empty(slots.nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self._done: list[Signal] = [completed_signal(), completed_signal()]
        self._next = 0
        self._failed: BaseException | None = None

    def _pack(self, block: int, staging: torch.Tensor) -> None:
        layout = self._layouts[block]
        for index, host in enumerate(self._hosts[block]):
            placed = layout.tensors[index]
            group = layout.groups[placed.group]
            region = staging[group.byte_offset : group.byte_offset + group.nbytes].view(group.dtype)
            region[placed.offset : placed.offset + placed.meta.span].copy_(flat_span(host))

    def _pack_and_copy(
        self, block: int, slot: int, index: int, previous: Signal, free: Signal | None, ready: lanes.DeferredSignal
    ) -> None:
        """Packer thread: wait for the staging buffer, pack, enqueue the H2D, resolve ``ready``."""
        try:
            if self._failed is not None:
                raise lanes.LaneError(f"an earlier staged pack failed ({self._failed})") from self._failed
            # Host wait: the copy that last read this staging buffer must finish before we overwrite it.
            previous.wait_host()
            staging = self.staging[index]
            self._pack(block, staging)
            nbytes = self._layouts[block].nbytes
            target = self._slots.buffers[slot]
            # Wait: the slot's previous block may still be read by compute.
            self._lane.wait(free)
            self._lane.submit(lambda: target[:nbytes].copy_(staging[:nbytes], non_blocking=True))
            ready.resolve(self._lane.record())
        except BaseException as exc:
            self._failed = self._failed or exc
            ready.fail(exc)

    def fill(self, block: int, slot: int) -> None:
        index = self._next
        self._next = 1 - index
        previous, free, ready = self._done[index], self._slots.free[slot], lanes.DeferredSignal()
        self._packer.submit(lambda: self._pack_and_copy(block, slot, index, previous, free, ready))
        self._done[index] = ready
        self._slots.ready[slot] = ready

    def close(self) -> None:
        self.staging = []
        self._hosts = []  # lease views: the mapping must not outlive the lease's close


class AllGatherTransfer(_SlotViews):
    """Shard -> gather input (copy lane) -> all_gather into the slot (comm lane, DLO group only).

    ``source`` writes this rank's shard (private copies or the lease's pieces, see ``shards``).
    ``inputs`` gather inputs live on the device (one per gather that may be in flight: 2 on CUDA,
    where the H2D of block ``i + 1`` may overlap the gather of block ``i``; 1 on CPU, where the
    host waits for a block's gather before it submits the next fill, so a second input would
    only cost memory). With ``staging``, a CUDA source that cannot be read asynchronously (the
    lease's pieces when registration failed) is packed on the host into one of two bounded
    pinned staging buffers first, then copied with one H2D. ``buffers``: gather inputs to reuse
    (those of the transfer this one replaces at a live update).
    """

    mode = "allgather"

    def __init__(
        self,
        source: ShardSource,
        layouts: Sequence[BlockLayout],
        slots: SlotPair,
        copy_lane: Lane,
        comm_lane: Lane,
        group: Any,
        device: torch.device,
        *,
        inputs: int,
        staging: bool = False,
        arena: HostArena | None = None,
        buffers: Sequence[torch.Tensor] | None = None,
    ) -> None:
        self.source, self._layouts, self._slots = source, layouts, slots
        self._copy, self._comm, self._group = copy_lane, comm_lane, group
        self._offsets = [shard_offsets(layout) for layout in layouts]
        self._sizes = [input_nbytes(layout) for layout in layouts]
        size = max(self._sizes)
        if buffers is not None and len(buffers) == inputs and all(int(b.numel()) >= size for b in buffers):
            # A live update keeps the replaced transfer's gather inputs: no device allocation at
            # the switch, and the lanes' order already covers their last readers (drained).
            self.inputs = list(buffers)
        else:
            self.inputs = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(inputs)]
        count = 2 if staging else 0
        if arena is not None:  # exact sizes, one registration (see ``arena``)
            self.staging = [arena.take(size, torch.uint8) for _ in range(count)]
        else:
            pin = device.type == "cuda"  # staging exists for CUDA; on CPU (tests) it is plain memory
            self.staging = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(count)]
        self._read: list[Signal] = [completed_signal() for _ in self.inputs]  # last gather reading input k
        self._staged: list[Signal] = [completed_signal() for _ in self.staging]  # last H2D reading staging k
        self._fills = 0

    @property
    def input_bytes(self) -> int:
        return sum(int(t.nbytes) for t in self.inputs) + sum(int(t.nbytes) for t in self.staging)

    def _gather(self, block: int, slot: int, gathered: torch.Tensor) -> None:
        layout = self._layouts[block]
        for group, offset in enumerate(self._offsets[block]):
            nbytes = layout.groups[group].shard_nbytes
            whole = self._slots.group_view(slot, layout, group).view(torch.uint8)
            all_gather_bytes(whole, gathered[offset : offset + nbytes], self._group)

    def fill(self, block: int, slot: int) -> None:
        index = self._fills % len(self.inputs)
        self._fills += 1
        target = self.inputs[index]
        # Wait: the previous gather from this input must have read it before it is overwritten.
        self._copy.wait(self._read[index])
        if self.staging:
            stage = self._fills % 2
            staging, nbytes = self.staging[stage], self._sizes[block]
            # Host wait: the H2D that last read this staging buffer must finish before we repack it.
            self._staged[stage].wait_host()
            self.source.copy_into(block, staging)
            self._copy.submit(lambda: target[:nbytes].copy_(staging[:nbytes], non_blocking=True))
            self._staged[stage] = self._copy.record()
        else:
            self._copy.submit(lambda: self.source.copy_into(block, target))
        copied = self._copy.record()
        # Wait: the gather reads the input the copy lane just wrote.
        self._comm.wait(copied)
        # Wait: the gather overwrites the slot, whose previous block compute may still read.
        self._comm.wait(self._slots.free[slot])
        self._comm.submit(lambda: self._gather(block, slot, target))
        gathered = self._comm.record()
        self._read[index] = gathered
        self._slots.ready[slot] = gathered

    def close(self) -> None:
        self.inputs, self.staging = [], []
        close = getattr(self.source, "close", None)
        if close is not None:
            close()
