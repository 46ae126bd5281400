"""Which tensors of a new revision equal those of the revision a channel points to now.

``unchanged(tensors, base)`` compares each tensor with the base lease's tensor of the same name,
dtype and shape, byte for byte (libc ``memcmp``: vectorized, and it stops at the first
difference, so a changed tensor usually costs a few cache lines). ``client.publish(...,
channel=NAME)`` uses it to let hwrd take the unchanged tensors from the base instead of writing
them again (``hwr.daemon.store.reuse`` says why that is sound).

Limits: equality is of bytes (two NaNs with equal bits are equal, +0.0 and -0.0 are not); only
contiguous CPU tensors are compared (others count as changed).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from hwr.client.lease import Lease

__all__ = ["same_bytes", "unchanged"]

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
_memcmp = _libc.memcmp
_memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memcmp.restype = ctypes.c_int


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same dtype, shape and bytes (contiguous CPU tensors only)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device.type != "cpu" or b.device.type != "cpu":
        return False
    if not (a.is_contiguous() and b.is_contiguous()):
        return False
    nbytes = a.numel() * a.element_size()
    return nbytes == 0 or _memcmp(a.data_ptr(), b.data_ptr(), nbytes) == 0


def unchanged(tensors: Mapping[str, torch.Tensor], base: Lease) -> list[str]:
    """The names whose tensor equals the base lease's tensor of that name, sorted."""
    theirs = base.tensors
    return sorted(name for name, tensor in tensors.items() if name in theirs and same_bytes(tensor, theirs[name]))
