"""Live updates of a running backend: the host source switches to a new lease between passes.

``LiveUpdates`` is the part of ``LayerwiseOffloadBackend`` that exists when the offload was
enabled with ``live_updates=True``. It owns the ``switch.RevisionSwitch`` and is the switch's
``switch.RevisionTarget``; it works through the backend's other parts, each by its interface:
the revisions it holds (``held.HeldRevisions``), the device side (``runtime.StreamingRuntime``)
and the model's tensors (``installation.bind``).

- ``update(lease)`` (any thread) hands the lease to the switch, which checks it against the
  model's ``contract.TensorContract`` and builds its host side with the functions ``enable()``
  ran (``revision``: views, AllGather shard source, ``cudaHostRegister`` of the ranges this
  rank reads with enable's fallback to pinned staging, staging arena) and maps the pages this
  rank will read (``revision.prefault``), so the first pass on it takes no page faults. Nothing
  the running passes use is touched.
- A forward pre-hook on the model (installed at INSTALL_HOOKS, before every block hook) is the
  pass boundary. With AllGather it first runs ``agree``: one all-gather of 33 bytes per rank
  on DLO's own communicator, submitted to the communication lane so that it is ordered with the
  block gathers identically on every rank (never on the model's group), and waited for by the
  host. That is the cost of live updates with AllGather: one small collective per pass and, on
  CUDA, the host waits for the communication stream at each pass start (the prefetch of the
  first block, issued at the end of the previous pass).
- ``apply`` (compute thread, at the boundary): unbind a block a failed forward left
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

from collections.abc import Callable, Sequence

import torch

from hwr.client.carrier import HostLease, MappedRegion
from hwr.client.errors import HwrError, LeaseClosed
from hwr.dlo_backend import revision as revisions
from hwr.dlo_backend.agreement import PROPOSAL_BYTES, Proposal, decode, encode
from hwr.dlo_backend.communicator import DloCommunicator
from hwr.dlo_backend.contract import ModelTensor, TensorContract
from hwr.dlo_backend.group import all_gather_bytes
from hwr.dlo_backend.held import HeldRevisions
from hwr.dlo_backend.installation import bind
from hwr.dlo_backend.lanes import LaneError
from hwr.dlo_backend.revision import Revision, RevisionContext
from hwr.dlo_backend.runtime import StreamingRuntime
from hwr.dlo_backend.sources import BlockSource
from hwr.dlo_backend.switch import RevisionStatus, RevisionSwitch

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
    """``update`` and the pass boundary of a running backend (see the module docstring).

    Made at INSTALL_HOOKS from what ``enable`` established: the streamed and resident blocks,
    the model's other tensors (``rest``) and the ``contract`` every revision must match, the
    ``context`` revisions are built in, and DLO's communicator (``group``; ``None``: rank-local).
    ``poison_error`` is the backend's error for a poisoned stream. The caller attaches
    ``boundary`` to the model and calls ``close`` in its teardown.
    """

    def __init__(
        self,
        *,
        streamed: Sequence[BlockSource],
        resident: Sequence[BlockSource],
        rest: Sequence[ModelTensor],
        contract: TensorContract,
        context: RevisionContext,
        group: DloCommunicator | None,
        revisions: HeldRevisions,
        runtime: StreamingRuntime,
        poison_error: Callable[[str], HwrError],
    ) -> None:
        self._streamed, self._resident, self._rest = streamed, resident, rest
        self._contract, self._context, self._group = contract, context, group
        self._revisions, self._runtime, self._poison_error = revisions, runtime, poison_error
        self._switch = RevisionSwitch(self, current=revisions.key)

    # ------------------------------------------------------------------ the backend's
    def update(self, lease: HostLease) -> None:
        """Stage ``lease`` for the next pass boundary (``LayerwiseOffloadBackend.update``)."""
        if self._runtime.poisoned:
            lease.close()
            raise self._poison_error("the offload backend is poisoned; it takes no update")
        self._switch.update(lease)

    @property
    def status(self) -> RevisionStatus:
        return self._switch.status

    def boundary(self) -> None:
        """The model's forward pre-hook: a pass starts (compute thread)."""
        self._switch.boundary()

    def close(self) -> list[Revision]:
        """No more updates; returns the revision still pending, for the teardown to release."""
        return self._switch.close()

    # ------------------------------------------------------------------ switch.RevisionTarget
    @property
    def collective(self) -> bool:
        return self._group is not None

    def prepare(self, lease: HostLease) -> Revision:
        """Check ``lease`` and build its host side (enable's steps); closes it on failure."""
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
            self.discard(revision)
            raise
        return revision

    def discard(self, revision: Revision) -> None:
        """Close a revision no pass uses (any more); kept for a retry if it stays registered."""
        self._revisions.release(revision, [])

    def agree(self, proposal: Proposal) -> list[Proposal]:
        """Every rank's proposal, gathered on DLO's communicator through the communication lane."""
        group, device = self._group, self._context.device
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
            self._runtime.exchange(exchange, "the revision agreement")
        except (LaneError, RuntimeError) as exc:
            self._runtime.poison()
            # With a group this is a ``CollectiveStateError``: the group's state is unknown.
            raise self._poison_error(f"the revision agreement at a pass boundary failed ({exc})") from exc
        return decode(gathered[0], world)

    def apply(self, revision: Revision) -> None:
        """Switch every tensor to ``revision`` (a pass boundary; see the module docstring)."""
        runtime, old = self._runtime, self._revisions.running
        try:
            transfer = runtime.begin_switch(revision)
        except Exception as exc:
            self.discard(revision)
            runtime.poison()
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
            for source in list(self._resident) + list(self._streamed):
                for ref in source.refs:
                    if ref.persistent:  # the bytes from before enable: no rollback target any more
                        ref.backing = _empty(ref.backing.dtype)
            self._revisions.running = revision
            replaced = runtime.restart(transfer)
        except Exception as exc:
            runtime.poison()
            if self._revisions.running is not revision:
                self.discard(revision)
            raise self._poison_error(f"switching to revision {revision.key} failed ({exc})") from exc
        replaced.close()
        if old is not None:
            self.discard(old)

    def _switch_rest(self, revision: Revision, old: Revision | None) -> None:
        """The model's non-block tensors: views of the old lease are rebound to the new lease's,
        the model's own memory (device, or private host tensors) gets the new bytes in place."""
        regions = () if old is None or old.lease is None else old.lease.mapped_regions
        for ref in self._rest:
            view = revision.rest[ref.name]
            current = ref.current()
            if current.is_meta or _inside(current, regions):
                bind(ref, view)
            else:
                current.copy_(view)


def _inside(tensor: torch.Tensor, regions: Sequence[MappedRegion]) -> bool:
    """Whether ``tensor``'s data lies in one of the mapped ``regions`` (a view of that lease)."""
    if tensor.device.type != "cpu":
        return False
    address = tensor.data_ptr()
    return any(region.address <= address < region.address + region.length for region in regions)
