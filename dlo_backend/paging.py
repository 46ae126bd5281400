"""Page-table population of host tensors: first-touch faults ahead of compute, off its thread.

On a CPU device the zero-copy transfer (``transfer.HostBindTransfer``) copies nothing, so the
only host-side work left per block is the first touch of a freshly mapped lease: one minor page
fault per page (or per fault-around batch) taken by whichever thread reads it first. ``populate``
asks the kernel to map a tensor's pages in one call (``madvise(MADV_POPULATE_READ)``, Linux
5.14+), so the copy lane can take those faults for block ``i + 1`` while compute runs block ``i``.

Contract and limits:
- Read-only and side-effect free for the caller: it never writes, never allocates tensor memory
  and never changes the tensor; pages already mapped cost a page-table walk.
- Best effort: when the kernel (or platform) lacks ``MADV_POPULATE_READ`` the first call reports
  ``False`` and every later call is a no-op (compute then takes the faults itself, as before).
  Other ``madvise`` failures (``EFAULT``/``ENOMEM`` for an unmapped range) are returned as
  ``False`` too, never raised: a fault here must not turn into an offload failure, and a range
  that is really unmapped fails loudly when compute reads it.
- The caller keeps the memory mapped until the call returns (the backend drains the copy lane
  before closing a lease).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import sys

import torch

__all__ = ["page_range", "populate"]

_MADV_POPULATE_READ = 22  # include/uapi/asm-generic/mman-common.h (Linux 5.14)
_PAGE = mmap.PAGESIZE


def page_range(address: int, nbytes: int, page: int = _PAGE) -> tuple[int, int]:
    """The page-aligned ``(start, length)`` covering ``[address, address + nbytes)`` (pure)."""
    if nbytes <= 0:
        return address - address % page, 0
    start = address - address % page
    end = -(-(address + nbytes) // page) * page
    return start, end - start


class _Madvise:
    """``madvise`` through libc, disabled for good after the kernel says it is unsupported."""

    def __init__(self) -> None:
        self.supported = sys.platform.startswith("linux")
        self._fn = None
        if self.supported:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            self._fn = libc.madvise
            self._fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            self._fn.restype = ctypes.c_int

    def populate(self, start: int, length: int) -> bool:
        if not self.supported or self._fn is None or length == 0:
            return False
        if self._fn(start, length, _MADV_POPULATE_READ) == 0:
            return True
        if ctypes.get_errno() == errno.EINVAL:  # kernel older than 5.14: stop trying
            self.supported = False
        return False


_madvise = _Madvise()


def populate(tensor: torch.Tensor) -> bool:
    """Map the pages under ``tensor``'s storage span for reading; True if the kernel did."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return False
    span = 1 + sum((size - 1) * step for size, step in zip(tensor.shape, tensor.stride(), strict=True))
    start, length = page_range(tensor.data_ptr(), span * tensor.element_size())
    return _madvise.populate(start, length)
