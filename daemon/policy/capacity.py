"""Capacity policy of the store: byte limits, a free-space floor, and reservations.

A publication asks for ``need`` bytes before its staging is created. ``assess`` (pure) compares
the request with the policy and the current usage and answers how many bytes must be freed
first (``shortfall``) or raises the typed error for a request that can never fit:

==========================  ===========================================================
``ArtifactTooLarge``        ``need`` > ``artifact_limit_bytes``
``StoreLimitExceeded``      ``need`` > ``store_limit_bytes`` (even an empty store is too small),
                            or after eviction the committed + reserved bytes still overshoot
``ExceedsFilesystem``       ``need`` + ``min_free_bytes`` > the filesystem's whole capacity
                            (``Usage.filesystem_bytes``; even an empty filesystem is too small)
``InsufficientCapacity``    the filesystem cannot keep ``min_free_bytes`` free after eviction
==========================  ===========================================================

``Reservations`` is the ledger that makes two concurrent publications unable to overshoot
together: a reservation counts against the store limit from ``reserve`` until the publication
commits (then its bytes are counted as committed) or ends. Until its staging has been
preallocated it also counts against free space (after that the filesystem's own free count
already reflects it).

A request that does not fit after eviction while other publications hold reservations is not
refused at once: ``Capacity.reserve`` waits (up to the publication's wait timeout) for a
reservation to end or a lease to be released, evicts again, and only then raises.

Contract: called on the daemon's event loop (no locks). Limits: ``need`` is the payload size
computed from the tensor specs; manifest, marker and directory blocks (a few KiB) are not
counted. Bytes of a cancelled publication whose writer still holds its descriptors return to the
filesystem only when that writer closes them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hwr.client.errors import ArtifactTooLarge, ExceedsFilesystem, InsufficientCapacity, StoreLimitExceeded

__all__ = ["CapacityPolicy", "Reservation", "Reservations", "Usage", "assess"]


@dataclass(frozen=True)
class CapacityPolicy:
    """0 means unlimited for the two limits and no floor for ``min_free_bytes``."""

    store_limit_bytes: int = 0
    artifact_limit_bytes: int = 0
    min_free_bytes: int = 0


@dataclass(frozen=True)
class Usage:
    committed_bytes: int
    reserved_bytes: int
    unallocated_reserved_bytes: int
    free_bytes: int
    #: What the filesystem holds for the store's user when empty (size less root's reserve); 0: unknown.
    filesystem_bytes: int = 0


def assess(policy: CapacityPolicy, usage: Usage, need: int, *, key: str = "") -> int:
    """Bytes that must be evicted before ``need`` fits (0: fits now); raises when it never can."""
    details = {"key": key, "need_bytes": need}
    if policy.artifact_limit_bytes and need > policy.artifact_limit_bytes:
        raise ArtifactTooLarge(
            f"the artifact needs {need} bytes, the per-artifact limit is {policy.artifact_limit_bytes}",
            details={**details, "limit_bytes": policy.artifact_limit_bytes})
    if policy.store_limit_bytes and need > policy.store_limit_bytes:
        raise StoreLimitExceeded(
            f"the artifact needs {need} bytes, the whole store may hold {policy.store_limit_bytes}",
            details={**details, "limit_bytes": policy.store_limit_bytes})
    if usage.filesystem_bytes and need + policy.min_free_bytes > usage.filesystem_bytes:
        raise ExceedsFilesystem(
            f"the artifact needs {need} bytes (and {policy.min_free_bytes} kept free), the store's whole "
            f"filesystem holds {usage.filesystem_bytes}: it can never fit there",
            details={**details, "filesystem_bytes": usage.filesystem_bytes,
                     "min_free_bytes": policy.min_free_bytes})
    over_limit = 0
    if policy.store_limit_bytes:
        over_limit = usage.committed_bytes + usage.reserved_bytes + need - policy.store_limit_bytes
    over_floor = policy.min_free_bytes + usage.unallocated_reserved_bytes + need - usage.free_bytes
    return max(0, over_limit, over_floor)


def shortfall_error(policy: CapacityPolicy, usage: Usage, need: int, key: str) -> Exception:
    """The typed error for a request that still does not fit once nothing more can be evicted."""
    details = {"key": key, "need_bytes": need, "committed_bytes": usage.committed_bytes,
               "reserved_bytes": usage.reserved_bytes, "free_bytes": usage.free_bytes}
    if policy.store_limit_bytes and (
            usage.committed_bytes + usage.reserved_bytes + need > policy.store_limit_bytes):
        return StoreLimitExceeded(
            "the store limit would be exceeded and nothing more can be evicted (in use, pinned or "
            "reserved by running publications)", details={**details, "limit_bytes": policy.store_limit_bytes})
    return InsufficientCapacity(
        "not enough free space on the store's filesystem and nothing more can be evicted",
        details={**details, "min_free_bytes": policy.min_free_bytes})


@dataclass
class Reservation:
    reservation_id: int
    key: str
    nbytes: int
    allocated: bool = False


class Reservations:
    """The ledger of bytes promised to publications in flight."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._live: dict[int, Reservation] = {}
        self._per_key: dict[str, int] = {}
        self._reserved = 0  # running sums over _live: read under the capacity lock per admission
        self._unallocated = 0

    def add(self, key: str, nbytes: int) -> Reservation:
        reservation = Reservation(next(self._ids), key, nbytes)
        self._live[reservation.reservation_id] = reservation
        self._per_key[key] = self._per_key.get(key, 0) + 1
        self._reserved += nbytes
        self._unallocated += nbytes
        return reservation

    def mark_allocated(self, reservation: Reservation) -> None:
        if not reservation.allocated and reservation.reservation_id in self._live:
            self._unallocated -= reservation.nbytes
        reservation.allocated = True

    def drop(self, reservation: Reservation | None) -> None:
        """End a reservation (idempotent)."""
        if reservation is not None and self._live.pop(reservation.reservation_id, None) is not None:
            self._reserved -= reservation.nbytes
            if not reservation.allocated:
                self._unallocated -= reservation.nbytes
            left = self._per_key[reservation.key] - 1
            if left:
                self._per_key[reservation.key] = left
            else:
                del self._per_key[reservation.key]

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    @property
    def unallocated_bytes(self) -> int:
        return self._unallocated

    def holds(self, key: str) -> bool:
        """Whether a reservation for ``key`` is live (O(1))."""
        return key in self._per_key

    def __len__(self) -> int:
        return len(self._live)
