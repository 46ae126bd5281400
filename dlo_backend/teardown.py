"""The one order in which a backend releases what it holds (failure rollback and ``disable``).

Teardown order (``Teardown._teardown``):

1. drain the copy and communication lanes (every copy, or zero-copy page population, that may
   read mapped memory finishes);
2. remove the hooks and unbind the running block;
3. restore weights: before COMMIT the original tensors are reattached; after it, rank-local
   blocks get their originals (module source) or CPU copies of the lease views, and AllGather
   blocks are gathered one last time into CPU tensors (a collective: call ``disable`` on every
   rank) unless the backend is poisoned; ``disable(restore=False)`` (process shutdown) skips this
   step for committed streamed blocks (no gather-back, no host copies: the model is unusable after);
4. release staging, device slots, shards and lanes; shut DLO's own communicator down;
5. undo ``cudaHostRegister`` (if that fails the lease stays open: unmapping registered memory
   is undefined behaviour);
6. close the lease (and the carrier, in case enable failed before taking it).

Every revision the backend holds is released at steps 5 and 6: the running one, an update still
pending, and any earlier one whose host memory could not be unregistered (``revision``).

CUDA memory rules the teardown keeps: before step 4 releases the slots, the compute lane is
synchronized on every stream a forward ran on (the caching allocator would otherwise hand the
slots' memory to the next allocation on their allocating stream while another stream still
reads it); after it, the host arenas that shards and staging were carved from (``arena``) are
unregistered and unmapped.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from hwr.client.carrier import HostLease, LeaseCarrier
from hwr.dlo_backend.lanes import InlineLane, LaneError

if TYPE_CHECKING:
    from torch import nn

    from hwr.dlo_backend.communicator import DloCommunicator
    from hwr.dlo_backend.hooks import HookRegistry
    from hwr.dlo_backend.lanes import Lane, ThreadLane
    from hwr.dlo_backend.layout import BlockLayout
    from hwr.dlo_backend.revision import Revision
    from hwr.dlo_backend.slots import SlotPair
    from hwr.dlo_backend.sources import BlockSource
    from hwr.dlo_backend.stream import BlockStream
    from hwr.dlo_backend.switch import RevisionSwitch
    from hwr.dlo_backend.transfer import Transfer
    from hwr.dlo_backend.watchdog import CollectiveWatchdog

__all__ = ["Teardown"]

_log = logging.getLogger("hwr.dlo_backend.backend")


class Teardown:
    """The teardown of ``LayerwiseOffloadBackend`` (see the module docstring)."""

    # Owned by ``LayerwiseOffloadBackend`` (set in ``__init__`` and ``enable``).
    model: nn.Module
    _host_source: LeaseCarrier | HostLease | None
    _revision: Revision | None
    _retired: list[Revision]
    _streamed: list[BlockSource]
    _resident: list[BlockSource]
    _installed: list[BlockSource]
    _layouts: list[BlockLayout]
    _switch: RevisionSwitch | None
    _stream: BlockStream | None
    _transfer: Transfer | None
    _slots: SlotPair | None
    _lanes: list[Lane]
    _compute: Lane | InlineLane
    _packer: ThreadLane | None
    _group: DloCommunicator | None
    _hooks: HookRegistry
    _watchdog: CollectiveWatchdog | None
    _committed: bool

    if TYPE_CHECKING:  # the backend's; never defined here, so never shadowed

        def _set(self, ref: Any, value: torch.Tensor) -> None: ...

    def _teardown(self, *, restore: bool = True) -> list[str]:
        errors: list[str] = []
        for lane in self._lanes:  # 1. drain: nothing may still read mapped memory or a slot
            try:
                lane.drain()
            except LaneError as exc:
                errors.append(f"drain: {exc}")
                if self._stream is not None:
                    self._stream.poisoned = True
        if self._stream is not None:  # 2. running block unbound, hooks off
            self._stream.unbind()
        self._hooks.remove()
        try:  # 3. restore weights (a rollback before COMMIT always reattaches the originals)
            if restore or not self._committed:
                self._restore()
        except Exception as exc:
            errors.append(f"restore: {exc}")
            if self._stream is not None:
                self._stream.poisoned = True
        for source in self._resident + self._streamed:
            source.host = []  # lease views must not outlive the lease
        pending = self._switch.close() if self._switch is not None else []
        if self._watchdog is not None:  # every gather (the gather-back's too) has been waited for
            self._watchdog.close()
            self._watchdog = None
        try:  # 4. release, once compute (on every stream a forward used) stopped reading the slots
            self._compute.drain()
        except (LaneError, RuntimeError) as exc:
            errors.append(f"drain compute: {exc}")
        for lane in self._lanes:
            lane.close()
        if self._transfer is not None:
            self._transfer.close()
        if self._stream is not None:
            self._stream.close()  # it held the transfer and the sources: views of the lease
        if self._slots is not None:
            self._slots.release()
        self._transfer, self._lanes, self._installed, self._packer = None, [], [], None
        if self._group is not None:  # after the lanes: no gather may still use it
            failure = self._group.close()
            if failure is not None:
                errors.append(failure)
            self._group = None
        # 5. and 6.: every revision unregisters, unmaps its arenas, then closes its lease.
        held = ([] if self._revision is None else [self._revision]) + pending + self._retired
        self._retired = []
        for revision in held:
            self._release(revision, errors)
        self._close_lease()
        return errors

    def _release(self, revision: Revision, errors: list[str]) -> None:
        """Close ``revision``; one whose host memory stays registered keeps its lease, for a retry."""
        failures = revision.close()
        if failures:
            errors.extend(failures)
            self._retired.append(revision)
            _log.error("host memory still registered; keeping its lease open: %s", failures)

    def _close_lease(self) -> None:
        if isinstance(self._host_source, LeaseCarrier):
            self._host_source.close()  # closes the lease only if enable failed before taking it

    def _restore(self) -> None:
        if not self._committed:
            for source in self._installed:
                for ref in source.refs:
                    if ref.original.is_meta:
                        ref.replace_object(ref.original)
                    else:
                        ref.current().data = ref.backing
            return
        for source in self._resident + (self._streamed if self._group is None else []):
            for ref, host in zip(source.refs, source.host, strict=True):
                self._set(ref, host if host is ref.backing else _host_copy(host))
        if self._group is not None and self._stream is not None and not self._stream.poisoned:
            self._gather_back(self._stream)

    def _gather_back(self, stream: BlockStream) -> None:
        """Rebuild every AllGather block into CPU tensors (a collective on every rank)."""
        assert self._slots is not None
        for block, source in enumerate(self._streamed):
            stream.fill(block, 0)
            stream.wait_ready(0)
            layout = self._layouts[block]
            for index, ref in enumerate(source.refs):
                ref.current().data = _host_copy(self._slots.tensor_view(0, layout, index))
            stream.mark_free(0)  # the next gather overwrites slot 0 only after these copies


def _host_copy(value: torch.Tensor) -> torch.Tensor:
    """A private CPU tensor with ``value``'s shape, stride and bytes."""
    copy = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cpu")
    copy.copy_(value)
    return copy
