"""Bounds on the disk a publisher can consume beyond its reservation.

A publisher writes through ``O_RDWR`` descriptors of its staging files (``hwr.daemon.
store_staging``). The kernel lets the holder of such a descriptor grow the file (writes past the
end, ``ftruncate``) or allocate blocks past its end (``fallocate(FALLOC_FL_KEEP_SIZE)``), and an
unlinked file keeps its blocks while any descriptor is open. Sealing is not available for
regular files (only for memfds), so the daemon bounds the damage instead:

- ``allocation_ok``: a staging file may hold at most its planned size rounded up to the
  filesystem block, plus ``SLACK_BYTES`` (metadata blocks), in allocated blocks
  (``st_blocks``). The commit checks it together with the exact size (past the commit nobody
  can write: ``hwr.daemon.system.exclusive``); the housekeeping round checks every staged publication
  and cancels the ones that grew (``overgrown``), so what a publisher holds beyond its
  reservation is bounded by what it can write in one round (``housekeeping_interval_s``).
- ``StagingReaper``: an aborted or cancelled staging is not just unlinked. Each file is first
  truncated to 0 by the daemon (that frees its blocks even while the publisher keeps its
  descriptor) and unlinked only once nobody else holds it open (a write lease taken and dropped,
  as ``exclusive.open_sole``); until then it stays in the daemon's private ``tmp/`` and every
  sweep truncates it again, so a publisher that keeps writing after its cancellation gets its
  blocks taken back each round and cannot keep an unlinked file growing outside any accounting.

Limits: between two rounds a hostile publisher can still allocate as fast as the disk takes it;
filesystem project quotas on ``tmp/`` (an operator's choice) are the hard bound. A descriptor
held across a daemon restart refers to a file the restart's wipe truncated the same way, then
unlinked (no sweep follows for it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from hwr.daemon.store import fileio as store_io

if TYPE_CHECKING:
    from hwr.daemon.store.staging import Staging

__all__ = ["SLACK_BYTES", "StagingReaper", "allocation_ok", "overgrown", "truncate_tree"]

log = logging.getLogger("hwrd.staging")
SLACK_BYTES = 1 << 20


def allocation_ok(st: os.stat_result, planned: int) -> bool:
    """Pure: whether a staging file's size and allocated blocks stay within its plan."""
    block = max(st.st_blksize, 4096)
    limit = -(-planned // block) * block + SLACK_BYTES
    return st.st_size == planned and st.st_blocks * 512 <= limit


def overgrown(staged: Iterable[tuple[str, Staging]]) -> list[str]:
    """Of ``(publication id, staging)`` pairs of staged publications, the ids whose staging
    outgrew its plan."""
    found = []
    for publication_id, staging in staged:
        for _name, path, size in staging.files:
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not allocation_ok(st, size):
                found.append(publication_id)
                break
    return found


def _truncate_and_release(path: Path) -> bool:
    """Truncate ``path`` to 0 and unlink it when no other open file description exists; True
    when it is gone."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError:  # not a regular file we can open: nothing a writer could hold
        store_io.remove_tree(path)
        return True
    try:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EBUSY):
                return False  # a writer still holds it: keep it linked, truncate again later
            # No lease support: nothing proves who holds it; unlinking is all that is left.
        else:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return True
    finally:
        os.close(fd)


def truncate_tree(path: Path) -> bool:
    """Truncate every file of a staging directory, remove those nobody holds, and the directory
    once empty; True when it is gone."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    if not stat.S_ISDIR(st.st_mode):
        return _truncate_and_release(path)
    try:
        names = os.listdir(path)
    except OSError:
        store_io.remove_tree(path)
        return True
    held = [name for name in names if not _truncate_and_release(path / name)]
    if held:
        return False
    store_io.remove_tree(path)
    return True


class StagingReaper:
    """Staging directories whose files a writer still held when they were discarded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[Path] = set()

    @property
    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def discard(self, path: Path) -> None:
        """Reclaim ``path`` now; keep it for later sweeps if a writer still holds a file."""
        if not truncate_tree(path):
            with self._lock:
                self._held.add(path)
            log.warning("a writer still holds discarded staging %s; truncated, reclaimed again "
                        "at each housekeeping round until it lets go", path.name)

    def sweep(self) -> int:
        """Truncate again what is still held, remove what is no longer held; returns how many
        directories were removed."""
        with self._lock:
            pending = sorted(self._held)
        removed = 0
        for path in pending:
            if truncate_tree(path):
                removed += 1
                with self._lock:
                    self._held.discard(path)
        return removed
