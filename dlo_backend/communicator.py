"""DLO's own communicator: AllGather collectives that never interleave with anyone else's.

Why a dedicated group
---------------------
Collectives on one process group must be issued in the same order on every rank. DLO issues
its gathers from the communication lane (a worker thread on CPU, a side stream on CUDA) while
the thread that runs the model may issue its own collectives: sequence parallelism all-reduces
or all-to-alls inside attention on the SP group (which is the DLO group when DP = 1), a caller
may ``barrier()`` between requests or inside a forward hook. On a shared group the relative
order of "gather of block i + 1" and "the model's all-reduce in block i" depends on thread
timing, differs between ranks, and the ranks then wait for each other in different collectives
for good (or, worse, exchange the wrong bytes).

``open_dlo_group`` therefore creates, at ``enable()``, a communicator of its own over exactly the
ranks of the chosen DP/SP group, with the same backend and timeout. Every DLO collective (the
manifest agreement, every block gather, the gather-back at ``close()``) runs on it and on
nothing else, and nothing but DLO ever sees it. Within it the order is deterministic: the
manifest agreement runs on the caller's thread before any lane exists, then every gather is
submitted to the single communication lane in ``fill`` order, which is the ring order every
rank follows (the ring's contract: every rank runs the same blocks in the same order). The
model's and the caller's collectives stay on their own groups, each consistently ordered by
its own thread, so the two streams of collectives are independent and cannot deadlock each
other.

How it is made: a torch backend object (``ProcessGroupGloo`` / ``ProcessGroupNCCL``) built on
a ``PrefixStore`` of the job's default store, under a prefix no earlier communicator used. The
ranks agree on that prefix with one broadcast of 16 random bytes over the chosen group, issued
from the caller's thread inside ``enable()`` (so it is ordered like any caller collective). Not
``dist.new_group``: with ``use_local_synchronization=True`` (needed when only the DLO ranks call
``enable()``) torch names the group after its ranks and the number of groups the process holds,
so a second ``enable()`` after a ``close()`` reuses the name, finds the previous group's
rendezvous keys in the store and fails to connect; without it every rank of the job would have
to take part. The communicator is not registered with ``torch.distributed`` (no
``dist.*(group=...)`` call can reach it by accident); DLO calls its ``_allgather_base`` directly,
the primitive ``all_gather_into_tensor`` dispatches to.

Backends:

- gloo (CPU): each process group owns its connections (its own store prefix, its own pairs) and
  its own work queue, so a gather on the DLO group and an all-reduce on the SP group proceed in
  parallel from two threads.
- NCCL (CUDA): a separate communicator. NCCL's guide warns that concurrent operations on two
  communicators can deadlock if the GPU cannot run both kernels at once and ranks launch them in
  different orders; DLO's gather (a few CTAs) beside the model's collectives is the same
  pattern as FSDP/Megatron overlapping DP and TP/SP communicators, and relies on the same
  fact (NCCL kernels occupy few SMs, so two communicators' kernels run side by side). That is a
  property of the hardware and NCCL, not something hwr can enforce; it is not exercised on CPU.

Teardown: ``DloCommunicator.close`` shuts the backend down (``shutdown()``, local: no
collective, so a rank whose peer died can still tear down), after the lanes are drained and
closed; the offload backend calls it from ``close()`` and from every rollback of a failed
``enable()`` that got as far as creating it. Idempotent.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hwr.dlo_backend.errors import CollectiveStateError

__all__ = ["DloCommunicator", "group_timeout", "open_dlo_group"]

_log = logging.getLogger(__name__)
_NONCE_BYTES = 16


def group_timeout(group: Any, device: torch.device) -> timedelta | None:
    """The collective timeout of ``group``'s backend for ``device`` (``None`` when unknown)."""
    try:
        return group._get_backend(device).options._timeout
    except Exception:  # private in torch; fall back to the backend's default timeout
        return None


class DloCommunicator:
    """DLO's own communicator over ``ranks`` (global ranks); this process is group rank ``rank``."""

    def __init__(self, backend: Any, ranks: list[int], rank: int, prefix: str, timeout: timedelta) -> None:
        self._backend: Any = backend
        self.ranks, self.rank, self.prefix, self.timeout = ranks, rank, prefix, timeout
        self.kind = type(backend).__name__  # ProcessGroupGloo / ProcessGroupNCCL

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def closed(self) -> bool:
        return self._backend is None

    def all_gather(self, output: torch.Tensor, local: torch.Tensor) -> None:
        """Every rank's ``local`` into ``output`` in rank order (on CUDA: ordered on the current stream)."""
        if self._backend is None:
            raise CollectiveStateError("the DLO communicator is closed")
        self._backend._allgather_base(output, local).wait()

    def abort(self) -> str | None:
        """Abort outstanding collectives (NCCL: ``ncclCommAbort``); ``None``, or why it could not.

        For a watchdog that found a gather no peer joins: gloo collectives raise by themselves at
        the timeout, an NCCL kernel waits for good unless its communicator is aborted.
        """
        backend = self._backend
        abort = getattr(backend, "abort", None)
        if abort is None:
            return "closed" if backend is None else f"{self.kind} has no abort"
        try:
            abort()
        except Exception as exc:
            return f"abort failed: {exc}"
        return None

    def close(self) -> str | None:
        """Shut the backend down; return the failure (``None`` when it worked). Idempotent."""
        backend, self._backend = self._backend, None
        if backend is None:
            return None
        try:
            shutdown = getattr(backend, "shutdown", None)
            if shutdown is not None:
                shutdown()
        except Exception as exc:  # teardown goes on: the lease must still be closed
            _log.error("shutting the DLO communicator down failed: %s", exc)
            return f"shut down DLO communicator: {exc}"
        return None

    def __repr__(self) -> str:
        return f"DloCommunicator(ranks={self.ranks}, rank={self.rank}, closed={self.closed})"


def _agree_prefix(chosen: Any, device: torch.device) -> str:
    """A store prefix no earlier communicator used, the same on every rank (a broadcast on ``chosen``)."""
    nonce = torch.tensor(list(os.urandom(_NONCE_BYTES)), dtype=torch.uint8, device=device)
    dist.broadcast(nonce, group_src=0, group=chosen)
    return "hwr-dlo/" + bytes(nonce.cpu().tolist()).hex()


def _make_backend(chosen: Any, store: Any, rank: int, size: int, device: torch.device, timeout: timedelta) -> Any:
    name = dist.get_backend(chosen)
    if device.type == "cuda" and "nccl" in name:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def open_dlo_group(chosen: Any, device: torch.device) -> DloCommunicator:
    """A new communicator over the ranks of ``chosen``, same backend kind and timeout (collective).

    Every rank of ``chosen`` must call it at the same point of its program (``enable()``). The
    caller owns the result and closes it. Raises ``CollectiveStateError`` when the agreement or
    the connection fails (a peer did not call ``enable()`` within the timeout).
    """
    ranks = list(dist.get_process_group_ranks(chosen))
    rank = int(dist.get_rank(chosen))
    try:
        prefix = _agree_prefix(chosen, device)
        store = dist.PrefixStore(prefix + "/", dist.distributed_c10d._get_default_store())
        timeout = group_timeout(chosen, device) or timedelta(minutes=30)
        backend = _make_backend(chosen, store, rank, len(ranks), device, timeout)
    except Exception as exc:
        raise CollectiveStateError(
            f"creating the DLO communicator over ranks {ranks} failed ({exc}); a peer did not call enable()"
        ) from exc
    return DloCommunicator(backend, ranks, rank, prefix, timeout)
