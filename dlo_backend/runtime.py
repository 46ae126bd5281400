"""The device side of streaming: lanes, the two slots, the transfer, the ring and its watchdog.

``StreamingRuntime`` owns what a forward's block hooks use: the copy and communication lanes
(plus the packing thread of a staged transfer), the compute lane, the ``slots.SlotPair``, the
``transfer.Transfer`` that writes the slots, the ``stream.BlockStream`` that runs the ring, and
with a group the ``watchdog.CollectiveWatchdog`` that turns a gather no peer joins into a typed
error. It borrows DLO's communicator; the backend opens and closes that.

Lifecycle, in call order:

- created empty with the backend; ``allocate`` (enable's ALLOCATE step) builds all of it;
- a live update swaps the transfer between two passes: ``begin_switch`` (unbind, drain, build
  the new transfer) then ``restart`` (the ring starts over on it);
- the teardown calls ``drain`` (its step 1), ``unbind`` (step 2), ``gather_back`` (step 3,
  AllGather only) and ``close`` (step 4), in that order (see ``teardown``).

Every method copes with a runtime ``allocate`` never reached or left half-built (a failed
enable is torn down the same way).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from hwr.client.errors import HwrError
from hwr.dlo_backend import revision as revisions
from hwr.dlo_backend.communicator import DloCommunicator
from hwr.dlo_backend.lanes import CudaLane, CurrentStreamLane, InlineLane, Lane, LaneError, ThreadLane
from hwr.dlo_backend.layout import BlockLayout
from hwr.dlo_backend.revision import Revision, RevisionContext, TransferKind
from hwr.dlo_backend.slots import SlotPair, SlotState
from hwr.dlo_backend.sources import BlockSource, host_copy
from hwr.dlo_backend.stream import BlockStream
from hwr.dlo_backend.transfer import AllGatherTransfer, DirectTransfer, HostBindTransfer, StagedTransfer, Transfer
from hwr.dlo_backend.watchdog import CollectiveWatchdog, abort_group, watchdog_timeout_s

__all__ = ["StreamingRuntime"]

# The backend's logger: an operator filters one name for everything the offload backend reports.
_log = logging.getLogger("hwr.dlo_backend.backend")


class StreamingRuntime:
    """Two-slot streaming on one device (see the module docstring).

    ``poison_error`` makes the error every call raises once the stream is poisoned (a
    ``CollectiveStateError`` with a group); it is the backend's, which knows the world size.
    """

    def __init__(self, device: torch.device, poison_error: Callable[[str], HwrError]) -> None:
        self.device = device
        self._poison_error = poison_error
        self._group: DloCommunicator | None = None
        self._context: RevisionContext | None = None
        self._sources: Sequence[BlockSource] = ()
        self._layouts: Sequence[BlockLayout] = ()
        self._lanes: list[Lane] = []
        self._compute: Lane = InlineLane()
        self._packer: ThreadLane | None = None
        self._watchdog: CollectiveWatchdog | None = None
        self.slots: SlotPair | None = None
        self.transfer: Transfer | None = None
        self.stream: BlockStream | None = None

    # ----------------------------------------------------------------- observation
    @property
    def lanes(self) -> tuple[Lane, ...]:
        """The lanes that write the slots (packing, copy, communication), in drain order."""
        return tuple(self._lanes)

    @property
    def poisoned(self) -> bool:
        return self.stream is not None and self.stream.poisoned

    @property
    def gathered(self) -> bool:
        """Whether a collective gather was ever issued (the group's state then depends on it)."""
        return self.stream is not None and self.stream.gathered

    def poison(self) -> None:
        """Refuse every later forward (a failure left the slots or the group in an unknown state)."""
        if self.stream is not None:
            self.stream.poisoned = True

    def slot_state(self) -> SlotState:
        return SlotState((None, None), None) if self.stream is None else self.stream.slot_state()

    # ------------------------------------------------------------------ enable
    def allocate(
        self,
        context: RevisionContext,
        revision: Revision,
        sources: Sequence[BlockSource],
        layouts: Sequence[BlockLayout],
        group: DloCommunicator | None,
    ) -> BlockStream:
        """Lanes, slots, the transfer for ``revision`` and the ring over ``sources`` (ALLOCATE)."""
        self._context, self._sources, self._layouts, self._group = context, sources, layouts, group
        device = self.device
        if device.type == "cuda":
            self._lanes = [CudaLane(device), CudaLane(device)]
            self._compute = CurrentStreamLane(device)
        else:
            self._lanes = [ThreadLane("copy"), ThreadLane("comm")]
            self._compute = InlineLane()
        kind, _ = revisions.transfer_kind(context, revision)
        # Bound host tensors need no slot bytes; every other transfer writes the largest block.
        nbytes = 0 if kind is TransferKind.BIND else max(layout.nbytes for layout in layouts)
        self.slots = SlotPair(nbytes, device)
        self.transfer = self.transfer_for(revision)
        # The caching allocator handed the slot (and shard) buffers out on the current stream,
        # where blocks freed earlier may still be read by queued kernels: reuse is ordered only
        # on that stream. The lanes write these buffers first, so they start after it.
        allocated = self._compute.record()
        for lane in self._lanes:
            lane.wait(allocated)
        self.stream = BlockStream(
            sources,
            layouts,
            self.slots,
            self.transfer,
            self._compute,
            device,
            collective=group is not None,
            poison_error=self._poison_error,
            watchdog=self._start_watchdog(),
        )
        return self.stream

    def transfer_for(self, revision: Revision, reuse: Transfer | None = None) -> Transfer:
        """The transfer that streams ``revision`` (``revision.transfer_kind``) over these lanes and
        slots; ``reuse``: the transfer it replaces, whose device buffers it keeps."""
        assert self._context is not None and self.slots is not None
        device = self.device
        copy_lane, comm_lane = self._lanes[-2:]
        kind, _ = revisions.transfer_kind(self._context, revision)
        arena = revision.staging
        if kind is TransferKind.BIND:
            # The "device" is the host: copying a block into a slot would only duplicate bytes
            # compute can read where they are. The ring, prefetch order and slot ownership stay.
            return HostBindTransfer(revision.hosts, self.slots, copy_lane)
        if kind is TransferKind.ALLGATHER:
            # Each rank holds only a shard, so even on a CPU device the block must be gathered.
            assert revision.shards is not None and self._group is not None
            return AllGatherTransfer(
                revision.shards,
                self._layouts,
                self.slots,
                copy_lane,
                comm_lane,
                self._group,
                device,
                inputs=2 if device.type == "cuda" else 1,
                staging=arena is not None,
                arena=arena,
                buffers=reuse.inputs if isinstance(reuse, AllGatherTransfer) else None,
            )
        if kind is TransferKind.DIRECT:
            return DirectTransfer(revision.hosts, self._layouts, self.slots, copy_lane)
        # Host memory the device cannot read asynchronously goes through pinned staging.
        return StagedTransfer(
            revision.hosts, self._layouts, self.slots, copy_lane, pin=True, packer=self._packer_lane(), arena=arena
        )

    def _packer_lane(self) -> ThreadLane:
        """The staged transfer's packing thread; drained first at teardown (it feeds the copy lane)."""
        if self._packer is None:
            self._packer = ThreadLane("pack")
            self._lanes.insert(0, self._packer)
        return self._packer

    def _start_watchdog(self) -> CollectiveWatchdog | None:
        """With a group: the watchdog that turns a gather no peer joins into a typed error."""
        if self._group is None:
            return None
        self._watchdog = CollectiveWatchdog(watchdog_timeout_s(self._group, self.device), self._stuck)
        return self._watchdog

    def _stuck(self, reason: str) -> None:
        """Watchdog thread: a gather is stuck; poison the stream and abort the group (NCCL)."""
        if self.stream is not None:
            self.stream.poison(f"{reason}; a peer died, hung or skipped a forward")
        failure = abort_group(self._group, self.device)
        if failure is not None:
            _log.warning("AllGather group not aborted: %s", failure)

    # ------------------------------------------------------------------ passes
    def exchange(self, work: Callable[[], None], what: str) -> None:
        """Run ``work`` (a collective) on the communication lane, ordered with the block gathers
        on every rank, watched like a gather, and wait for it on the host.

        Raises ``LaneError`` or ``RuntimeError`` when it fails; the caller poisons the stream.
        """
        comm = self._lanes[-1]
        comm.submit(work)
        done = comm.record()
        if self._watchdog is not None:
            self._watchdog.watch(done, what)
        done.wait_host()

    def begin_switch(self, revision: Revision) -> Transfer:
        """Between two passes: release the running block, let the old revision's last reads (the
        first block's prefetch) end, and build ``revision``'s transfer, reusing device buffers."""
        assert self.stream is not None and self.transfer is not None
        self.stream.unbind()  # a forward that raised left its block bound
        for lane in self._lanes:
            lane.drain()
        return self.transfer_for(revision, reuse=self.transfer)

    def restart(self, transfer: Transfer) -> Transfer:
        """Stream through ``transfer`` from now on (the ring starts over); returns the transfer it
        replaced, for the caller to close once nothing refers to the old revision."""
        assert self.stream is not None and self.transfer is not None
        replaced, self.transfer = self.transfer, transfer
        self.stream.restart(transfer)
        return replaced

    # ------------------------------------------------------------------ teardown
    def drain(self, errors: list[str]) -> None:
        """Teardown step 1: every copy, or page population, that may read mapped memory ends."""
        for lane in self._lanes:
            try:
                lane.drain()
            except LaneError as exc:
                errors.append(f"drain: {exc}")
                self.poison()

    def unbind(self) -> None:
        """Teardown step 2 (with the hooks' removal): the running block gets its placeholders."""
        if self.stream is not None:
            self.stream.unbind()

    def gather_back(self) -> None:
        """Rebuild every AllGather block into CPU tensors (a collective on every rank)."""
        stream, slots = self.stream, self.slots
        assert stream is not None and slots is not None
        for block, source in enumerate(self._sources):
            stream.fill(block, 0)
            stream.wait_ready(0)
            layout = self._layouts[block]
            for index, ref in enumerate(source.refs):
                ref.current().data = host_copy(slots.tensor_view(0, layout, index))
            stream.mark_free(0)  # the next gather overwrites slot 0 only after these copies

    def close(self, errors: list[str]) -> None:
        """Teardown step 4: release lanes, transfer, ring and slots; failures go to ``errors``.

        Every gather has been waited for (the gather-back's too), so the watchdog stops first.
        The slots are released only once compute, on every stream a forward ran on, stopped
        reading them: the caching allocator would otherwise hand their memory to the next
        allocation on their allocating stream while another stream still reads it.
        """
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None
        try:
            self._compute.drain()
        except (LaneError, RuntimeError) as exc:
            errors.append(f"drain compute: {exc}")
        for lane in self._lanes:
            lane.close()
        if self.transfer is not None:
            self.transfer.close()
        if self.stream is not None:
            self.stream.close()  # it held the transfer and the sources: views of the lease
        if self.slots is not None:
            self.slots.release()
        self.transfer, self._lanes, self._packer, self._sources = None, [], None, ()
        self._group = None  # the backend shuts the communicator down after this
