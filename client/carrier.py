"""The process-local hand-off of a host-weight lease from the loader to the offload backend.

A ``HostLease`` is anything that owns read-only host tensors backed by mapped memory: an hwrd
artifact or checkpoint lease (``hwr.client.lease.Lease``) or a test double built over real
mapped files. ``LeaseCarrier`` moves ownership exactly once:

    loader ---(restore commit)---> LeaseCarrier ---(take(), once)---> dlo_backend

Contract:
- ``take()`` succeeds once; a second ``take()`` raises ``LeaseClosed``.
- ``close()`` closes the lease only if it was never taken (the taker owns it then).
- A carrier is process-local: it cannot be pickled (a lease is bound to its process's mappings).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

from hwr.client.errors import LeaseClosed

__all__ = ["HostLease", "LeaseCarrier", "MappedRegion"]


@dataclass(frozen=True)
class MappedRegion:
    """One mapped range a GPU transport may register (``cudaHostRegister``).

    ``address`` is page aligned and ``length`` a multiple of the page size; ``file`` names the
    payload file inside the artifact (never a host path a client could open).
    """

    file: str
    address: int
    length: int
    read_only: bool


@runtime_checkable
class HostLease(Protocol):
    """What the offload backend needs from a lease."""

    @property
    def key(self) -> str: ...

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]: ...

    @property
    def mapped_regions(self) -> tuple[MappedRegion, ...]: ...

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...


class LeaseCarrier:
    """Holds a lease between restore commit and the backend's ``take()``."""

    def __init__(self, lease: HostLease) -> None:
        self._lease: HostLease | None = lease
        self._taken = False
        self._lock = threading.Lock()

    @property
    def taken(self) -> bool:
        return self._taken

    def take(self) -> HostLease:
        with self._lock:
            if self._taken or self._lease is None:
                raise LeaseClosed("the lease carrier was already taken or closed")
            lease, self._lease = self._lease, None
            self._taken = True
            return lease

    def close(self) -> None:
        """Close the lease if nobody took it; idempotent."""
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None and not self._taken:
            lease.close()

    def __reduce__(self) -> object:
        raise TypeError("LeaseCarrier is process-local and cannot be pickled")

    def __repr__(self) -> str:
        state = "taken" if self._taken else ("closed" if self._lease is None else "holding")
        return f"LeaseCarrier({state})"
