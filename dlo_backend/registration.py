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

CUDA registers host memory for the *current* device's context (CUDA Runtime API,
``cudaHostRegister``: "the memory ... will be considered as pinned memory by all CUDA contexts"
only with ``cudaHostRegisterPortable``). The backend's device need not be the current one, so
both registration and unregistration run under ``on_device(device)`` and the flags are
``Portable`` (plus ``ReadOnly`` for read-only mappings). Large regions are registered in
``CHUNK_BYTES`` pieces, each unregistered by its own base address.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from hwr.client.carrier import MappedRegion
from hwr.dlo_backend.cudart import HOST_REGISTER_READ_ONLY_SUPPORTED, HOST_REGISTER_SUPPORTED, CudaRuntime

__all__ = ["CHUNK_BYTES", "Chunk", "HostRegistration", "chunks", "register_regions"]

_log = logging.getLogger(__name__)

# cudaHostRegisterPortable: every CUDA context sees the pages as pinned, not only the current
# device's (without it a copy to another device reads them as pageable memory).
_PORTABLE = 0x01
# cudaHostRegisterReadOnly: the mapping is PROT_READ, so the driver must not ask for write access.
_READ_ONLY = 0x08
_GIB = 1 << 30
# One cudaHostRegister call covers at most this much: single registrations of hundreds of GiB
# are reported failing on some drivers. A copy whose source spans two chunks is still correct
# (the driver then treats it as pageable memory, a synchronous copy); with 32 GiB chunks that
# concerns at most one tensor per 32 GiB.
CHUNK_BYTES = 32 * _GIB


@dataclass(frozen=True)
class Chunk:
    """One ``cudaHostRegister``-ed range (page aligned)."""

    address: int
    length: int


def chunks(region: MappedRegion, size: int = CHUNK_BYTES) -> list[Chunk]:
    """``region`` cut into consecutive chunks of at most ``size`` bytes (a multiple of pages)."""
    return [
        Chunk(region.address + offset, min(size, region.length - offset)) for offset in range(0, region.length, size)
    ]


class HostRegistration:
    """Chunks registered with CUDA on ``device``; ``close`` unregisters them and is idempotent.

    Registration and unregistration both run with ``device`` current: CUDA registers host
    memory in the current device's context, and ``cudaHostUnregister`` from another current
    device can fail, which would keep the lease open for good (see the module docstring).
    """

    def __init__(self, runtime: CudaRuntime, device: int, registered: Sequence[Chunk] = ()) -> None:
        self._runtime = runtime
        self.device = device
        self._chunks = list(registered)
        self.complete = True

    @property
    def nbytes(self) -> int:
        return sum(chunk.length for chunk in self._chunks)

    def close(self) -> list[str]:
        """Unregister every chunk; return the failures (empty when all succeeded)."""
        failures: list[str] = []
        remaining: list[Chunk] = []
        with self._runtime.on_device(self.device):
            for chunk in self._chunks:
                try:
                    error = self._runtime.host_unregister(chunk.address)
                except Exception as exc:  # keep going: every chunk must get its chance
                    error, detail = -1, str(exc)
                else:
                    detail = f"cuda error {error}"
                if error != 0:
                    self._runtime.clear_last_error()
                    failures.append(f"cudaHostUnregister({chunk.address:#x}): {detail}")
                    remaining.append(chunk)
        self._chunks = remaining
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
    regions: Sequence[MappedRegion],
    limit_gib: float,
    *,
    device: int | None = None,
    runtime: CudaRuntime | None = None,
) -> HostRegistration | None:
    """Register every region (in ``CHUNK_BYTES`` chunks, ``Portable``, ``ReadOnly`` for read-only
    mappings, with CUDA ``device`` current), or none of them (rollback) and return ``None``.

    If the rollback itself fails the partial registration is returned with ``complete=False``:
    the caller must not rely on it for copies but must ``close`` it before closing the lease.
    ``device`` defaults to the current CUDA device; ``runtime`` to the process's CUDA runtime
    (``cudart.TorchCudaRuntime``).
    """
    if not regions or not within_budget(regions, limit_gib):
        return None
    runtime = runtime if runtime is not None else _torch_runtime()
    if runtime is None:
        return None
    if device is None:
        device = runtime.current_device()
    reason = unsupported(runtime, device, regions)
    if reason is not None:
        _log.info("host registration skipped: %s; using staging", reason)
        return None
    done = HostRegistration(runtime, device)
    with runtime.on_device(device):
        failure = _register_all(runtime, regions, done)
    if failure is None:
        return done
    leftovers = done.close()
    _log.warning("%s; rolled back, using staging", failure)
    if leftovers:
        _log.error("host registration rollback incomplete: %s", leftovers)
        done.complete = False  # partly registered: copy through staging, still close it later
        return done
    return None


def _register_all(runtime: CudaRuntime, regions: Sequence[MappedRegion], done: HostRegistration) -> str | None:
    """Register every chunk of ``regions`` into ``done``; the first failure's text, else ``None``."""
    for region in regions:
        flags = _PORTABLE | (_READ_ONLY if region.read_only else 0)
        for chunk in chunks(region):
            try:
                error = runtime.host_register(chunk.address, chunk.length, flags)
            except Exception as exc:
                error, detail = -1, str(exc)
            else:
                detail = f"cuda error {error}"
            if error != 0:
                if not runtime.clear_last_error():
                    _log.error("the CUDA error of a failed cudaHostRegister could not be cleared")
                return f"cudaHostRegister({chunk.address:#x}, {chunk.length}) failed ({detail})"
            done._chunks.append(chunk)
    return None
