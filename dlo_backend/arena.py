"""One exact-size host allocation that pinned buffers (shards, staging) are carved from.

Why not ``torch.empty(..., pin_memory=True)`` per buffer: torch's pinned host allocator
(``CachingHostAllocator``) rounds every request up to the next power of two
(``c10::llvm::PowerOf2Ceil(size)`` in ``ATen/core/CachingHostAllocator.h``, documented with
``torch.cuda.host_memory_stats``) and keeps freed blocks cached until
``torch._C._host_emptyCache()``. One pinned tensor per (block, dtype group) therefore pins up
to twice the bytes asked for, for the life of the process.

``HostArena`` maps exactly the bytes it needs (anonymous memory, rounded to whole pages) and, for
a CUDA device, pins them with one ``cudaHostRegister`` (``registration.register_regions``:
``Portable``, on the target device, chunked), so asynchronous H2D copies from it are allowed
(registered memory is page-locked exactly like ``cudaHostAlloc`` memory; CUDA Runtime API,
``cudaHostRegister``). ``take`` hands out views aligned to ``TENSOR_ALIGN_BYTES``. If
registration fails the arena stays usable as pageable memory (``pinned`` is False): copies from
it are then synchronous but still correct.

``close`` unregisters before the memory is unmapped; the caller first drops every view and
drains every copy that reads them. If unregistration fails the mapping is kept (unmapping
registered memory is undefined behaviour) and the failures are returned.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
from collections.abc import Iterable

import torch

from hwr.client.carrier import MappedRegion
from hwr.dlo_backend.cudart import CudaRuntime
from hwr.dlo_backend.layout import TENSOR_ALIGN_BYTES
from hwr.dlo_backend.registration import HostRegistration, register_regions

__all__ = ["HostArena", "arena_bytes"]

_log = logging.getLogger(__name__)


def _align(value: int, to: int = TENSOR_ALIGN_BYTES) -> int:
    return -(-value // to) * to


def arena_bytes(sizes: Iterable[int]) -> int:
    """Bytes an arena needs to hand out buffers of ``sizes`` (each start aligned)."""
    return sum(_align(size) for size in sizes)


class HostArena:
    """``nbytes`` (page-rounded) of host memory; pinned by registration for a CUDA ``device``."""

    def __init__(
        self, nbytes: int, *, device: torch.device | None = None, runtime: CudaRuntime | None = None
    ) -> None:
        self.capacity = max(mmap.PAGESIZE, _align(nbytes, mmap.PAGESIZE))
        # Private anonymous memory (what malloc returns): counted as the process's own, not
        # shared with a forked child.
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        self._map: mmap.mmap | None = mmap.mmap(-1, self.capacity, flags=flags)
        # Through a memoryview: mmap.close() then refuses (BufferError) while a view is alive.
        self._base: torch.Tensor | None = torch.frombuffer(memoryview(self._map), dtype=torch.uint8)
        self._cursor = 0
        self.registration: HostRegistration | None = None
        if device is not None and device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            region = MappedRegion("arena", self._base.data_ptr(), self.capacity, False)
            registration = register_regions([region], 0, device=index, runtime=runtime)
            if registration is not None and not registration.complete:
                registration.close()
                registration = None
            if registration is None:
                _log.warning("pinning a %d-byte host arena failed; its copies will be synchronous", self.capacity)
            self.registration = registration

    @property
    def pinned(self) -> bool:
        return self.registration is not None

    @property
    def address_range(self) -> tuple[int, int]:
        """``(start, end)`` host addresses of the arena's memory (for checks of where buffers lie)."""
        if self._base is None:
            raise RuntimeError("the host arena is closed")
        start = self._base.data_ptr()
        return start, start + self.capacity

    @property
    def used(self) -> int:
        return self._cursor

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D ``dtype`` view of ``numel`` elements, zeroed (fresh anonymous memory)."""
        if self._base is None:
            raise RuntimeError("the host arena is closed")
        itemsize = torch.empty(0, dtype=dtype).element_size()
        start = _align(self._cursor)
        end = start + numel * itemsize
        if end > self.capacity:
            raise ValueError(f"host arena of {self.capacity} bytes cannot hold {numel * itemsize} more at {start}")
        self._cursor = end
        return self._base[start:end].view(dtype)

    def close(self) -> list[str]:
        """Unregister, then unmap (once the views are gone); the unregister failures."""
        if self.registration is not None:
            failures = self.registration.close()
            if failures:
                _log.error("host arena still registered; keeping it mapped: %s", failures)
                return failures
            self.registration = None
        self._base = None
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still alive: unmapped when it dies
                self._map.close()
            self._map = None
        return []
