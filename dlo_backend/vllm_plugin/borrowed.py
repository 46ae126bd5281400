"""A borrowed view of leased host tensors, handed to ``hwr.dlo_backend`` without giving it the lease.

vLLM-Omni's DLO backend owns the lease it took from the loader's carrier (or, for a checkpoint
plan, the plugin's checkpoint leases) and closes it in its own teardown order, after every
transfer has drained and every host registration is undone. The DiT rings that stream through
``hwr.dlo_backend`` read the same mappings, so they get a ``BorrowedLease``: the
``hwr.client.carrier.HostLease`` shape over a name -> tensor mapping and the mapped regions, whose
``close()`` only ends the borrow (it never releases the real lease).

Contract: ``closed`` is True once the borrow ended or the owner's lease was closed (``owner_closed``
says so), so a borrower never reads unmapped memory through it. ``tensors`` raises
``LeaseClosed`` once closed. Not thread-safe beyond that flag; one borrower per instance.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from hwr.client.carrier import MappedRegion
from hwr.client.errors import LeaseClosed

if TYPE_CHECKING:
    import torch

__all__ = ["BorrowedLease", "regions_of"]


class BorrowedLease:
    """``HostLease`` over tensors owned by someone else (see the module contract)."""

    def __init__(self, key: str, tensors: Mapping[str, torch.Tensor], regions: tuple[MappedRegion, ...],
                 owner_closed: Callable[[], bool]) -> None:
        self._key = key
        self._tensors = MappingProxyType(dict(tensors))
        self._regions = regions
        self._owner_closed = owner_closed
        self._ended = False

    @property
    def key(self) -> str:
        return self._key

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        if self.closed:
            raise LeaseClosed(f"the borrowed view of {self._key} has ended")
        return self._tensors

    @property
    def mapped_regions(self) -> tuple[MappedRegion, ...]:
        return () if self.closed else self._regions

    @property
    def closed(self) -> bool:
        return self._ended or self._owner_closed()

    def close(self) -> None:
        """End the borrow (drop the views); the owner's lease stays open."""
        self._ended = True
        self._tensors = MappingProxyType({})

    def __repr__(self) -> str:
        return f"BorrowedLease(key={self._key!r}, tensors={len(self._tensors)}, closed={self.closed})"


def regions_of(regions: object) -> tuple[MappedRegion, ...]:
    """hwr ``MappedRegion``s from vLLM-Omni's ``MappedHostRegion``s (``file_name``) or hwr's own."""
    out: list[MappedRegion] = []
    for region in regions:  # type: ignore[attr-defined]
        name = getattr(region, "file_name", None) or getattr(region, "file", "")
        out.append(MappedRegion(str(name), int(region.address), int(region.length), bool(region.read_only)))
    return tuple(out)
