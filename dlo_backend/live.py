"""Live updates of a running backend: the host source switches to a new lease between passes.

``LiveUpdates`` is the part of ``LayerwiseOffloadBackend`` that a ``switch.RevisionSwitch``
drives when the offload was enabled with ``live_updates=True``:

- ``update(lease)`` (any thread) hands the lease to the switch, which checks it against the
  model's ``contract.TensorContract`` and builds its host side with the functions ``enable()``
  ran (``revision``: views, AllGather shard source, ``cudaHostRegister`` of the ranges this
  rank reads with enable's fallback to pinned staging, staging arena) and maps the pages this
  rank will read (``revision.prefault``), so the first pass on it takes no page faults. Nothing
  the running passes use is touched.
- A forward pre-hook on the model (installed at INSTALL_HOOKS, before every block hook) is the
  pass boundary. With AllGather it first runs ``_agree``: one all-gather of 33 bytes per rank
  on DLO's own communicator, submitted to the communication lane so that it is ordered with the
  block gathers identically on every rank (never on the model's group), and waited for by the
  host. That is the cost of live updates with AllGather: one small collective per pass and, on
  CUDA, the host waits for the communication stream at each pass start (the prefetch of the
  first block, issued at the end of the previous pass).
- ``_apply_revision`` (compute thread, at the boundary): unbind a block a failed forward left
  bound; drain every lane (the previous pass's prefetch of the first block may still read the
  old mapping); build the new transfer (no device allocation: an AllGather transfer keeps the
  gather inputs of the one it replaces); point every tensor at the new revision: streamed
  blocks' host sources, resident blocks (copied into their device tensors in place), the
  model's other tensors (rebound to the new views where they were views of the old lease,
  copied in place into the model's own memory otherwise); restart the ring (the first block is
  fetched again from the new revision); close the old transfer and the old revision, which
  releases the old lease (or keeps it, when its host memory could not be unregistered, and
  retries at ``disable``).

Limits: the pass boundary is a call of the model's own ``forward``. A caller that runs the
blocks without calling the model (a pipeline that calls ``model.blocks[i]`` itself) never
reaches a boundary, and an update then stays pending. Non-block tensors are switched on the
compute thread with a plain copy (synchronous from mapped memory on CUDA): they are expected to
be small next to the blocks.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from hwr.client.carrier import HostLease, LeaseCarrier, MappedRegion
from hwr.client.errors import HwrError, InvalidRequest, LeaseClosed
from hwr.dlo_backend import revision as revisions
from hwr.dlo_backend.agreement import PROPOSAL_BYTES, Proposal, decode, encode
from hwr.dlo_backend.group import all_gather_bytes
from hwr.dlo_backend.lanes import LaneError
from hwr.dlo_backend.revision import Revision
from hwr.dlo_backend.switch import RevisionStatus, RevisionSwitch

if TYPE_CHECKING:
    from torch import nn

    from hwr.dlo_backend.communicator import DloCommunicator
    from hwr.dlo_backend.contract import ModelTensor, TensorContract
    from hwr.dlo_backend.hooks import HookRegistry
    from hwr.dlo_backend.lanes import Lane
    from hwr.dlo_backend.revision import RevisionContext
    from hwr.dlo_backend.sources import BlockSource
    from hwr.dlo_backend.stream import BlockStream
    from hwr.dlo_backend.transfer import Transfer
    from hwr.dlo_backend.watchdog import CollectiveWatchdog

__all__ = ["LiveUpdates"]

_EMPTY: dict[torch.dtype, torch.Tensor] = {}


def _empty(dtype: torch.dtype) -> torch.Tensor:
    """What a block tensor's ``backing`` becomes once a switch made it useless: holding the bytes
    the model had before ``enable()`` (a lease's views, or the module's own memory) would keep
    them alive, and keep an old lease mapped and unevictable."""
    if dtype not in _EMPTY:
        _EMPTY[dtype] = torch.empty(0, dtype=dtype)
    return _EMPTY[dtype]


class LiveUpdates:
    """``update`` and the pass boundary of ``LayerwiseOffloadBackend`` (see the module docstring)."""

    # Owned by ``LayerwiseOffloadBackend`` (set in ``__init__`` and ``enable``).
    model: nn.Module
    options: Any
    _revision: Revision | None
    _retired: list[Revision]
    _streamed: list[BlockSource]
    _resident: list[BlockSource]
    _rest: list[ModelTensor]
    _context: RevisionContext | None
    _contract: TensorContract | None
    _switch: RevisionSwitch | None
    _stream: BlockStream | None
    _transfer: Transfer | None
    _lanes: list[Lane]
    _group: DloCommunicator | None
    _hooks: HookRegistry
    _watchdog: CollectiveWatchdog | None

    if TYPE_CHECKING:  # the backend's (or ``Teardown``'s); never defined here, so never shadowed

        def _make_transfer(self, revision: Revision, reuse: Transfer | None = None) -> Transfer: ...
        def _poison_error(self, message: str) -> HwrError: ...
        def _release(self, revision: Revision, errors: list[str]) -> None: ...
        def _set(self, ref: Any, value: torch.Tensor) -> None: ...

    # ------------------------------------------------------------------ public
    def update(self, lease: HostLease | LeaseCarrier) -> None:
        """Run ``lease``'s revision from the next pass boundary on; the backend owns the lease.

        Raises ``RevisionMismatch`` (the lease closed, nothing changed) when the revision does
        not match the model's tensor contract; ``InvalidRequest`` without ``live_updates`` or
        once closed. With AllGather the switch waits until every rank holds the revision; a
        peer's refusal shows in ``revision_status().last_error``.
        """
        if isinstance(lease, LeaseCarrier):
            lease = lease.take()
        if not isinstance(lease, HostLease):
            raise InvalidRequest("update() takes a lease (a HostLease or a LeaseCarrier)")
        switch = self._switch
        if switch is None:
            lease.close()
            if not self.options.live_updates:
                raise InvalidRequest(
                    "live updates need apply_layerwise_offload(..., live_updates=True)",
                    details={"field": "live_updates"},
                )
            raise InvalidRequest("update() needs an enabled offload")
        if self._stream is not None and self._stream.poisoned:
            lease.close()
            raise self._poison_error("the offload backend is poisoned; it takes no update")
        switch.update(lease)

    def revision_status(self) -> RevisionStatus:
        """The revision passes run on, switches so far, a pending update, the last refusal."""
        if self._switch is None:
            key = None if self._revision is None else self._revision.key
            return RevisionStatus(key, 0, None, None)
        return self._switch.status

    # ------------------------------------------------------------------ enable
    def _install_switch(self) -> None:
        self._retire_lock = threading.Lock()
        self._switch = RevisionSwitch(
            current=None if self._revision is None else self._revision.key,
            prepare=self._prepare_revision,
            apply=self._apply_revision,
            discard=self._discard_revision,
            agree=self._agree if self._group is not None else None,
        )
        # First of the model's pre-hooks: nothing of the pass has run when the revision changes.
        self._hooks.attach_pre(self.model, self._switch.boundary)

    # ------------------------------------------------------------------ any thread
    def _prepare_revision(self, lease: HostLease) -> Revision:
        """Check ``lease`` and build its host side (enable's steps); closes it on failure."""
        assert self._contract is not None and self._context is not None
        tensors = None
        try:
            if lease.closed:
                raise LeaseClosed(f"lease {lease.key} is already closed")
            tensors = lease.tensors
            self._contract.check(tensors, lease.key)
            revision = Revision(
                lease,
                hosts=revisions.lease_hosts(self._streamed, tensors),
                resident=revisions.lease_hosts(self._resident, tensors),
                rest=revisions.rest_views(self._rest, tensors),
            )
        except BaseException:
            lease.close()
            raise
        finally:
            tensors = None  # a traceback keeps this frame: it must not keep the views mapped
        try:
            ctx = self._context
            revisions.shard(revision, ctx)
            if ctx.cuda:
                index = ctx.device.index if ctx.device.index is not None else torch.cuda.current_device()
                revisions.register_host(revision, ctx, index)
            revisions.stage(revision, ctx)
            revisions.prefault(revision)
        except BaseException:
            self._discard_revision(revision)
            raise
        return revision

    def _discard_revision(self, revision: Revision) -> None:
        """Close a revision no pass uses (any more); keep it for a retry if it stays registered."""
        with self._retire_lock:
            self._release(revision, [])

    # ------------------------------------------------------------------ compute thread
    def _agree(self, proposal: Proposal) -> list[Proposal]:
        """Every rank's proposal, gathered on DLO's communicator through the communication lane."""
        group, device, comm = self._group, self.options.device, self._lanes[-1]
        assert group is not None
        world = group.size
        gathered: list[bytes] = []

        def exchange() -> None:
            # Built on the lane (the CUDA side stream): ordered after the gathers before it,
            # allocated on the stream that uses it, read back before the lane moves on.
            mine = torch.tensor(list(encode(proposal)), dtype=torch.uint8, device=device)
            everyone = torch.empty(world * PROPOSAL_BYTES, dtype=torch.uint8, device=device)
            all_gather_bytes(everyone, mine, group)
            gathered.append(bytes(everyone.cpu().tolist()))

        try:
            comm.submit(exchange)
            done = comm.record()
            if self._watchdog is not None:
                self._watchdog.watch(done, "the revision agreement")
            done.wait_host()
        except (LaneError, RuntimeError) as exc:
            assert self._stream is not None
            self._stream.poisoned = True
            # With a group this is a ``CollectiveStateError``: the group's state is unknown.
            raise self._poison_error(f"the revision agreement at a pass boundary failed ({exc})") from exc
        return decode(gathered[0], world)

    def _apply_revision(self, revision: Revision) -> None:
        """Switch every tensor to ``revision`` (a pass boundary; see the module docstring)."""
        stream, old = self._stream, self._revision
        assert stream is not None and self._transfer is not None
        try:
            stream.unbind()  # a forward that raised left its block bound
            for lane in self._lanes:  # the old revision's last reads (the first block's prefetch) end
                lane.drain()
            transfer = self._make_transfer(revision, reuse=self._transfer)
        except Exception as exc:
            self._discard_revision(revision)
            stream.poisoned = True
            raise self._poison_error(f"switching to revision {revision.key} failed ({exc})") from exc
        try:
            with torch.no_grad():
                self._switch_rest(revision, old)
                for source, hosts in zip(self._resident, revision.resident, strict=True):
                    for ref, host in zip(source.refs, hosts, strict=True):
                        ref.current().copy_(host)  # the resident device copy, in place
                    source.host = hosts
            allgather = self._group is not None
            for source, hosts in zip(self._streamed, revision.hosts, strict=True):
                source.host = [] if allgather else hosts  # AllGather ranks read their shards only
            for source in self._resident + self._streamed:
                for ref in source.refs:
                    if ref.persistent:  # the bytes from before enable: no rollback target any more
                        ref.backing = _empty(ref.backing.dtype)
            replaced, self._transfer, self._revision = self._transfer, transfer, revision
            stream.restart(transfer)
        except Exception as exc:
            stream.poisoned = True
            if self._revision is not revision:
                self._discard_revision(revision)
            raise self._poison_error(f"switching to revision {revision.key} failed ({exc})") from exc
        replaced.close()
        if old is not None:
            self._discard_revision(old)

    def _switch_rest(self, revision: Revision, old: Revision | None) -> None:
        """The model's non-block tensors: views of the old lease are rebound to the new lease's,
        the model's own memory (device, or private host tensors) gets the new bytes in place."""
        regions = () if old is None or old.lease is None else old.lease.mapped_regions
        for ref in self._rest:
            view = revision.rest[ref.name]
            current = ref.current()
            if current.is_meta or _inside(current, regions):
                self._set(ref, view)
            else:
                current.copy_(view)


def _inside(tensor: torch.Tensor, regions: Sequence[MappedRegion]) -> bool:
    """Whether ``tensor``'s data lies in one of the mapped ``regions`` (a view of that lease)."""
    if tensor.device.type != "cpu":
        return False
    address = tensor.data_ptr()
    return any(region.address <= address < region.address + region.length for region in regions)
