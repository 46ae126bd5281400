"""``cudaHostRegister`` of a lease's mapped regions, so H2D copies read the mapping directly.

Registration is an optimisation with a strict fallback: ``register_regions`` returns ``None``
(and leaves nothing registered) when CUDA is absent, the regions exceed the byte budget, or
any call fails; the caller then copies through pinned staging. A returned ``HostRegistration``
must be closed (unregistered) *before* the lease is closed; if unregistration fails the lease
must stay open (unmapping registered memory is undefined behaviour), which ``close`` reports
by returning the failures.

A failed CUDA call leaves the thread's "last error" set, and torch's next kernel launch check
would raise it as an unrelated error (see ``cudart``): every non-zero return here is followed
by ``clear_last_error``. Before any call the device is asked whether it can register read-only
host memory at all (``cudaDevAttrHostRegisterReadOnlySupported``); when it cannot, nothing is
attempted. ``cudaErrorHostMemoryAlreadyRegistered`` (another user registered the same pages)
is such a failure too: the caller falls back to staging.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from hwr.client.carrier import MappedRegion
from hwr.dlo_backend.cudart import HOST_REGISTER_READ_ONLY_SUPPORTED, HOST_REGISTER_SUPPORTED, CudaRuntime

__all__ = ["HostRegistration", "register_regions"]

_log = logging.getLogger(__name__)

# cudaHostRegisterReadOnly: the mapping is PROT_READ, so the driver must not ask for write access.
_READ_ONLY = 0x08
_GIB = 1 << 30


class HostRegistration:
    """Regions registered with CUDA; ``close`` unregisters them and is idempotent."""

    def __init__(self, runtime: CudaRuntime, regions: Sequence[MappedRegion]) -> None:
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
                error = self._runtime.host_unregister(region.address)
            except Exception as exc:  # keep going: every region must get its chance
                error, detail = -1, str(exc)
            else:
                detail = f"cuda error {error}"
            if error != 0:
                self._runtime.clear_last_error()
                failures.append(f"cudaHostUnregister({region.address:#x}): {detail}")
                remaining.append(region)
        self._regions = remaining
        return failures


def within_budget(regions: Sequence[MappedRegion], limit_gib: float) -> bool:
    """True when the regions fit the budget (``limit_gib == 0`` means unlimited)."""
    return limit_gib == 0 or sum(region.length for region in regions) <= limit_gib * _GIB


def _torch_runtime() -> CudaRuntime | None:
    try:
        from hwr.dlo_backend.cudart import TorchCudaRuntime

        return TorchCudaRuntime()
    except Exception as exc:
        _log.info("host registration unavailable (%s); using staging", exc)
        return None


def unsupported(runtime: CudaRuntime, device: int, regions: Sequence[MappedRegion]) -> str | None:
    """Why ``device`` cannot register ``regions`` (a device attribute says so), else ``None``.

    An attribute that cannot be read counts as supported: the registration is tried and its
    failure (cleared) falls back like any other.
    """
    if runtime.attribute(HOST_REGISTER_SUPPORTED, device) == 0:
        return "the device does not support cudaHostRegister"
    if any(r.read_only for r in regions) and runtime.attribute(HOST_REGISTER_READ_ONLY_SUPPORTED, device) == 0:
        return "the device does not support cudaHostRegisterReadOnly (needed for read-only mappings)"
    return None


def register_regions(
    regions: Sequence[MappedRegion], limit_gib: float, *, device: int = 0, runtime: CudaRuntime | None = None
) -> HostRegistration | None:
    """Register every region read-only, or none of them (rollback) and return ``None``.

    If the rollback itself fails the partial registration is returned with ``complete=False``:
    the caller must not rely on it for copies but must ``close`` it before closing the lease.
    ``runtime`` defaults to the process's CUDA runtime (``cudart.TorchCudaRuntime``).
    """
    if not regions or not within_budget(regions, limit_gib):
        return None
    runtime = runtime if runtime is not None else _torch_runtime()
    if runtime is None:
        return None
    reason = unsupported(runtime, device, regions)
    if reason is not None:
        _log.info("host registration skipped: %s; using staging", reason)
        return None
    done = HostRegistration(runtime, [])
    for region in regions:
        try:
            error = runtime.host_register(region.address, region.length, _READ_ONLY)
        except Exception as exc:
            error, detail = -1, str(exc)
        else:
            detail = f"cuda error {error}"
        if error != 0:
            if not runtime.clear_last_error():
                _log.error("the CUDA error of a failed cudaHostRegister could not be cleared")
            leftovers = done.close()
            _log.warning("cudaHostRegister(%#x) failed (%s); rolled back, using staging", region.address, detail)
            if leftovers:
                _log.error("host registration rollback incomplete: %s", leftovers)
                done.complete = False  # partly registered: copy through staging, still close it later
                return done
            return None
        done._regions.append(region)
    return done
