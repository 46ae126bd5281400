"""Start writeback of freshly written bytes early: ``sync_file_range(SYNC_FILE_RANGE_WRITE)``.

A publication must be durable before it becomes visible, so the daemon ``fsync``s every payload
at commit. If nothing was written back before that, the whole artifact goes to disk inside the
commit, after the writer finished. Asking the kernel to start writing each range right after it
was written overlaps the disk with the rest of the writing (and with the daemon's hashing), so the
final ``fsync`` is short.

Contract: a hint only. It never makes data durable (only ``fsync`` does), never raises, and
is a no-op where ``sync_file_range`` is missing (non-Linux, or a libc without it). Limits: the
kernel may block the call while the device queue is full (then the writer simply runs at disk
speed, as it would under dirty-page throttling anyway); on filesystems without writeback (tmpfs)
it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["start_writeback"]

SYNC_FILE_RANGE_WRITE = 2


def _load() -> object | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        function = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    function.restype = ctypes.c_int
    return function


_SYNC_FILE_RANGE = _load() if os.name == "posix" else None


def start_writeback(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of ``fd`` (0: to the end)."""
    function = _SYNC_FILE_RANGE
    if function is not None and fd >= 0 and offset >= 0 and nbytes >= 0:
        function(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)  # type: ignore[operator]
