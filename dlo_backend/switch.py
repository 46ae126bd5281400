"""Live updates: a new revision is taken between two passes, never inside one.

``RevisionSwitch`` sits between ``update(lease)`` (any thread: the caller's, or a channel
follower's) and the *pass boundary*, a forward pre-hook on the model the offload was applied
to (the compute thread, before the model's first layer runs):

    update(lease) --check + prepare--> pending --boundary (agreed with the group)--> running
         |                               |                                            |
         +- mismatch: RevisionMismatch,  +- replaced by a newer update: closed        +- the old
            lease closed, nothing        +- refused by a peer rank: closed,              revision is
            changes                         ``last_error``                               closed

- ``update`` checks the tensor contract and builds the revision's host side (views, shards,
  ``cudaHostRegister``, staging) off the compute thread; a failure leaves everything as it was.
  The newest update wins: a pending revision not yet taken is closed when a newer one arrives,
  and an update to the revision that runs (a rollback) closes the pending one and changes
  nothing else. A rollback that arrives while the group agrees on the pending revision is
  staged as a revision of its own (the boundary may still switch; the next one switches back).
- At the boundary, rank-local: the pending revision (if any) is applied. With AllGather, every
  rank first gathers every rank's ``agreement.Proposal`` and applies ``agreement.decide``:
  all ranks switch at the same pass, or none does. A pass therefore runs entirely on one
  revision on every rank.
- Applying (``RevisionTarget.apply``: the backend's ``live.LiveUpdates``) drains the copy and
  communication lanes (the previous pass's prefetch may still read the old mapping), rebinds
  every tensor to the new revision, and closes the old revision: its lease is released as soon
  as no pass can use it.

A pending revision being agreed on is never closed under the boundary: ``update`` leaves that
one to the boundary, which closes it if it was not taken. ``close`` closes what is pending.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from hwr.client.carrier import HostLease
from hwr.client.errors import HwrError, InvalidRequest
from hwr.dlo_backend.agreement import Offer, Proposal, decide
from hwr.dlo_backend.errors import OffloadError, RevisionMismatch
from hwr.dlo_backend.revision import Revision, key_digest

__all__ = ["RevisionStatus", "RevisionSwitch", "RevisionTarget", "detached"]

_log = logging.getLogger(__name__)

# Digests the group refused, remembered so that a rank the revision reaches late refuses it at
# once instead of offering it again (a refused revision never becomes acceptable).
_REMEMBERED_REFUSALS = 64


def detached(error: HwrError) -> HwrError:
    """A copy of ``error`` without its traceback, to keep: the traceback's frames hold the
    refused lease's views, which would keep its mapping alive (and the artifact unevictable)."""
    return type(error)(error.message, details=dict(error.details))


@dataclass(frozen=True)
class RevisionStatus:
    """Where a handle stands: the revision passes run on and what is in flight.

    ``key``: the lease key passes run on (``None``: the module's own tensors). ``switches``:
    how many times it changed. ``pending``: an update waiting for the next pass boundary (with
    AllGather: for every rank to hold it too). ``last_error``: the latest refusal, local or by
    a peer rank (``RevisionMismatch``), or a failure to prepare one (``OffloadError``).
    """

    key: str | None
    switches: int
    pending: str | None
    last_error: HwrError | None


class RevisionTarget(Protocol):
    """What a ``RevisionSwitch`` switches: the revisions of one running backend.

    The switch calls, in this order for one revision: ``prepare`` (the updating thread),
    ``agree`` (the compute thread, at every boundary, only when ``collective``), then either
    ``apply`` (the boundary took it) or ``discard`` (it never ran, or was replaced). A revision
    the switch hands to ``apply`` or ``discard`` belongs to the target from then on.
    """

    @property
    def collective(self) -> bool:
        """Whether the ranks of a group must agree on every switch (AllGather: ``agree`` runs)."""
        ...

    def prepare(self, lease: HostLease) -> Revision:
        """Check ``lease`` against the model and build its revision's host side. Closes the lease
        when it raises (``RevisionMismatch``: the lease does not fit the model)."""
        ...

    def agree(self, proposal: Proposal) -> Sequence[Proposal]:
        """Every rank's proposal, in rank order (a collective; raises when it fails)."""
        ...

    def apply(self, revision: Revision) -> None:
        """Run ``revision`` from this pass on, closing the old one; raises only when the backend
        is poisoned by the failure."""
        ...

    def discard(self, revision: Revision) -> None:
        """Close ``revision``, which no pass runs on (any more)."""
        ...


class RevisionSwitch:
    """Pending updates and the pass-boundary decision for ``target`` (see the module docstring).

    ``current``: the key of the revision passes run on when the switch is made.
    """

    def __init__(self, target: RevisionTarget, *, current: str | None) -> None:
        self._target = target
        self._lock = threading.Lock()
        self._current = current
        self._switches = 0
        self._pending: Revision | None = None
        self._offered: Revision | None = None
        self._proposal = Proposal()
        self._refused: deque[bytes] = deque(maxlen=_REMEMBERED_REFUSALS)
        self._error: HwrError | None = None
        self._closed = False

    @property
    def status(self) -> RevisionStatus:
        with self._lock:
            pending = None if self._pending is None else self._pending.key
            return RevisionStatus(self._current, self._switches, pending, self._error)

    # ------------------------------------------------------------------ any thread
    def update(self, lease: HostLease) -> None:
        """Stage ``lease`` for the next pass boundary (see the module docstring)."""
        key = lease.key
        cancelled: Revision | None = None
        with self._lock:
            closed = self._closed
            same = key == self._current and self._pending is None
            same = same or (self._pending is not None and key == self._pending.key)
            if not closed and key == self._current and self._pending is not None and self._pending is not self._offered:
                # A return to the running revision (a rollback): the pending one is abandoned,
                # so its lease is released now instead of running at the next boundary.
                cancelled, self._pending, same = self._pending, None, True
                if self._proposal.digest == cancelled.digest:
                    self._proposal = Proposal()
            known_bad = key_digest(key) in self._refused
        if cancelled is not None:
            self._target.discard(cancelled)
        if closed or same or known_bad:
            lease.close()
            if closed:
                raise InvalidRequest("the offload handle is closed; it takes no update")
            if known_bad:
                error = RevisionMismatch(
                    f"revision {key} was refused by the AllGather group before", details={"key": key}
                )
                self._refused_locally(key, error)
                raise error
            return
        refused: HwrError | None = None
        try:
            revision = self._target.prepare(lease)  # closes the lease when it raises
        except RevisionMismatch as exc:
            refused = detached(exc)
        except Exception as exc:
            error = exc if isinstance(exc, HwrError) else OffloadError(f"preparing revision {key} failed: {exc}")
            self._refused_locally(key, error)
            if error is exc:
                raise
            raise error from exc
        if refused is not None:
            # Raised outside the ``except``: neither a traceback nor a context of the original
            # refers to the frames that held the refused lease's views (its mapping).
            self._refused_locally(key, refused)
            raise refused
        with self._lock:
            if self._closed:
                replaced: Revision | None = revision
            else:
                replaced, self._pending = self._pending, revision
                self._proposal = Proposal(Offer.READY, revision.digest)
            if replaced is self._offered:
                replaced = None  # the boundary agreeing on it closes it if it is not taken
        if replaced is not None:
            self._target.discard(replaced)
        if replaced is revision:
            raise InvalidRequest("the offload handle was closed during the update")

    def _refused_locally(self, key: str, error: HwrError) -> None:
        """This rank cannot take ``key``: it says so at the next boundaries, the newest update
        wins, so an older pending revision is dropped too."""
        with self._lock:
            self._error = detached(error)
            self._proposal = Proposal(Offer.REFUSED, key_digest(key))
            dropped, self._pending = self._pending, None
            if dropped is self._offered:
                dropped = None
        if dropped is not None:
            self._target.discard(dropped)

    # ------------------------------------------------------------------ compute thread
    def boundary(self) -> None:
        """At a pass boundary: switch if this rank (rank-local) or every rank (AllGather) may."""
        with self._lock:
            offer = self._offered = self._pending
            proposal = self._proposal
        taken = False  # once True, ``offer`` belongs to the backend (applied, or closed at teardown)
        try:
            if not self._target.collective:
                taken = offer is not None
            else:
                decision = decide(self._target.agree(proposal))  # a collective: raises when it fails
                taken = offer is not None and decision.switch == offer.digest
                self._remember(decision.refused, offer)
            if taken:
                assert offer is not None
                self._target.apply(offer)  # raises only when the backend is poisoned
                with self._lock:
                    self._current, self._switches = offer.key, self._switches + 1
        finally:
            with self._lock:
                self._offered = None
                if taken and self._pending is offer:
                    self._pending = None
                if taken and self._proposal.digest == offer.digest:  # type: ignore[union-attr]
                    self._proposal = Proposal()
                stale = offer is not None and not taken and self._pending is not offer
            if stale:  # replaced by a newer update, or refused by a peer: never ran
                assert offer is not None
                self._target.discard(offer)

    def _remember(self, refused: dict[bytes, tuple[int, ...]], offer: Revision | None) -> None:
        """Every rank learns the group's refusals; a pending revision some rank refused is dropped."""
        if not refused:
            return
        with self._lock:
            for digest in refused:
                if digest not in self._refused:
                    self._refused.append(digest)
            if offer is not None and offer.digest in refused and self._pending is offer:
                self._pending = None  # the boundary discards it: not taken and no longer pending
                ranks = refused[offer.digest]
                self._error = RevisionMismatch(
                    f"revision {offer.key} was refused by rank(s) {list(ranks)} of the AllGather group; every rank "
                    "keeps the revision it runs",
                    details={"key": offer.key, "refused_by": ",".join(map(str, ranks))},
                )
                self._proposal = Proposal()

    def close(self) -> list[Revision]:
        """No more updates; returns the revision still pending (the caller closes it)."""
        with self._lock:
            self._closed = True
            pending, self._pending = self._pending, None
        return [] if pending is None else [pending]
