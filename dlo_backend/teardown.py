"""The one order in which a backend releases what it holds (failure rollback and ``disable``).

Teardown order (``teardown``, over the backend's parts):

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

Each part releases its own state through its interface (``installation.Installation``: hooks
and weights; ``runtime.StreamingRuntime``: lanes, slots, transfer, ring; ``live.LiveUpdates``:
the pending update; ``held.HeldRevisions``: the revisions); the order lives here alone.

CUDA memory rules the teardown keeps: before step 4 releases the slots, the compute lane is
synchronized on every stream a forward ran on (the caching allocator would otherwise hand the
slots' memory to the next allocation on their allocating stream while another stream still
reads it); after it, the host arenas that shards and staging were carved from (``arena``) are
unregistered and unmapped.
"""

from __future__ import annotations

from collections.abc import Sequence

from hwr.client.carrier import HostLease, LeaseCarrier
from hwr.dlo_backend.communicator import DloCommunicator
from hwr.dlo_backend.held import HeldRevisions
from hwr.dlo_backend.installation import Installation
from hwr.dlo_backend.live import LiveUpdates
from hwr.dlo_backend.runtime import StreamingRuntime
from hwr.dlo_backend.sources import BlockSource

__all__ = ["teardown"]


def teardown(
    *,
    installation: Installation,
    runtime: StreamingRuntime,
    live: LiveUpdates | None,
    revisions: HeldRevisions,
    resident: Sequence[BlockSource],
    streamed: Sequence[BlockSource],
    group: DloCommunicator | None,
    host_source: LeaseCarrier | HostLease | None,
    restore: bool = True,
) -> list[str]:
    """Release everything in the module docstring's order; returns what failed (never raises).

    ``group`` (DLO's communicator) is shut down here: the caller drops its reference. With
    ``restore=False`` committed streamed blocks keep their placeholders (step 3 skipped).
    """
    errors: list[str] = []
    runtime.drain(errors)  # 1. nothing may still read mapped memory or a slot
    runtime.unbind()  # 2. running block unbound, hooks off
    installation.remove_hooks()
    try:  # 3. restore weights (a rollback before COMMIT always reattaches the originals)
        if restore or not installation.committed:
            installation.restore(resident, streamed, allgather=group is not None)
            if installation.committed and group is not None and runtime.stream is not None and not runtime.poisoned:
                runtime.gather_back()
    except Exception as exc:
        errors.append(f"restore: {exc}")
        runtime.poison()
    for source in list(resident) + list(streamed):
        source.host = []  # lease views must not outlive the lease
    pending = live.close() if live is not None else []
    runtime.close(errors)  # 4. once compute (on every stream a forward used) stopped reading the slots
    installation.forget()
    if group is not None:  # after the lanes: no gather may still use it
        failure = group.close()
        if failure is not None:
            errors.append(failure)
    # 5. and 6.: every revision unregisters, unmaps its arenas, then closes its lease.
    revisions.release_all(pending, errors)
    if isinstance(host_source, LeaseCarrier):
        host_source.close()  # closes the lease only if enable failed before taking it
    return errors
