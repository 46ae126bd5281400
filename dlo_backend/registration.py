"""``cudaHostRegister`` of a lease's mapped regions, so H2D copies read the mapping directly.

Registration is an optimisation with a strict fallback: ``register_regions`` returns ``None``
(and leaves nothing registered) when CUDA is absent, the regions exceed the byte budget, or
any call fails; the caller then copies through pinned staging. A returned ``HostRegistration``
must be closed (unregistered) *before* the lease is closed; if unregistration fails the lease
must stay open (unmapping registered memory is undefined behaviour), which ``close`` reports
by returning the failures.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from hwr.client.carrier import MappedRegion

__all__ = ["HostRegistration", "register_regions"]

_log = logging.getLogger(__name__)

# cudaHostRegisterReadOnly: the mapping is PROT_READ, so the driver must not ask for write access.
_READ_ONLY = 0x08
_GIB = 1 << 30


class HostRegistration:
    """Regions registered with CUDA; ``close`` unregisters them and is idempotent."""

    def __init__(self, runtime: Any, regions: Sequence[MappedRegion]) -> None:
        self._runtime = runtime
        self._regions = list(regions)
        self.complete = True

    @property
    def nbytes(self) -> int:
        return sum(region.length for region in self._regions)

    def close(self) -> list[str]:
        """Unregister every region; return the failures (empty when all succeeded)."""
        failures: list[str] = []
        remaining: list[MappedRegion] = []
        for region in self._regions:
            try:
                error = int(self._runtime.cudaHostUnregister(region.address))
            except Exception as exc:  # keep going: every region must get its chance
                error, detail = -1, str(exc)
            else:
                detail = f"cuda error {error}"
            if error != 0:
                failures.append(f"cudaHostUnregister({region.address:#x}): {detail}")
                remaining.append(region)
        self._regions = remaining
        return failures


def within_budget(regions: Sequence[MappedRegion], limit_gib: float) -> bool:
    """True when the regions fit the budget (``limit_gib == 0`` means unlimited)."""
    return limit_gib == 0 or sum(region.length for region in regions) <= limit_gib * _GIB


def register_regions(regions: Sequence[MappedRegion], limit_gib: float) -> HostRegistration | None:
    """Register every region read-only, or none of them (rollback) and return ``None``.

    If the rollback itself fails the partial registration is returned with ``complete=False``:
    the caller must not rely on it for copies but must ``close`` it before closing the lease.
    """
    if not regions or not within_budget(regions, limit_gib):
        return None
    try:
        import torch

        runtime = torch.cuda.cudart()
    except Exception as exc:
        _log.info("host registration unavailable (%s); using staging", exc)
        return None
    done = HostRegistration(runtime, [])
    for region in regions:
        try:
            error = int(runtime.cudaHostRegister(region.address, region.length, _READ_ONLY))
        except Exception as exc:
            error, detail = -1, str(exc)
        else:
            detail = f"cuda error {error}"
        if error != 0:
            if hasattr(runtime, "cudaGetLastError"):
                runtime.cudaGetLastError()  # clear the sticky last-error so later torch calls don't see it
            leftovers = done.close()
            _log.warning("cudaHostRegister(%#x) failed (%s); rolled back, using staging", region.address, detail)
            if leftovers:
                _log.error("host registration rollback incomplete: %s", leftovers)
                done.complete = False  # partly registered: copy through staging, still close it later
                return done
            return None
        done._regions.append(region)
    return done
