"""Bounds on what a writer of staging descriptors can consume beyond its reservation.

A publisher writes its payloads through descriptors the daemon hands over; this module bounds
what it can take, one way per kind of descriptor:

Sealed memfds (``MemfdStagings``), for a client publication whose payload files total at most
``memfd_staging_max_bytes``: the staging descriptors a client receives are not the staging files
but one memfd per file, sized exactly (``ftruncate``), holding the file's header, and sealed
``F_SEAL_GROW|F_SEAL_SHRINK``: the kernel refuses every write past the end, ``ftruncate`` and
``fallocate`` beyond the size, so the publisher can consume nothing beyond its reservation, and
the pages it writes are charged to its own memory cgroup. At commit ``drain`` copies the bytes
into the daemon-only staging file and closes the daemon's memfd; the commit then hashes and
installs that copy as for any staging, so writes the publisher makes afterwards (or during the
copy: then the copy holds a mix of its own bytes, which its ``expected_sha256`` catches) change
nothing others are served. No ``F_SEAL_WRITE`` is needed for that, and adding it can stall for a
page still referenced (the kernel waits for such pins in 100 ms steps).

Staging files, for the others (and for daemon-side producers, prewarm, which write staging
files directly): the kernel lets the holder of an ``O_RDWR`` descriptor grow the file (writes
past the end, ``ftruncate``) or allocate blocks past its end (``fallocate(FALLOC_FL_KEEP_SIZE)``),
and an unlinked file keeps its blocks while any descriptor is open. Sealing is not available for
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

Limits: memfd bytes pass through memory and are copied once more into the staging file, so
memfds are for small publications (churn), not for multi-GiB ones; a publisher keeping its memfd
descriptor after the commit keeps that memory, charged to itself. Between two housekeeping
rounds a hostile file writer can still allocate as fast as the disk takes it; filesystem project
quotas on ``tmp/`` (an operator's choice) are the hard bound. A descriptor held across a daemon
restart refers to a file the restart's wipe truncated the same way, then unlinked (no sweep
follows for it).
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

from hwr.client.errors import PublicationFailed
from hwr.daemon.store import fileio as store_io

if TYPE_CHECKING:
    from hwr.daemon.store.staging import Staging

__all__ = ["SLACK_BYTES", "MemfdStagings", "StagingReaper", "allocation_ok", "overgrown", "truncate_tree"]

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


_GROW_SHRINK = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK
_COPY_CHUNK = 4 << 20


class MemfdStagings:
    """The memfds of staged client publications, by publication id (thread-safe)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._by_pub: dict[str, list[int]] = {}

    def eligible(self, staging: Staging) -> bool:
        return self.max_bytes > 0 and sum(size for _n, _p, size in staging.files) <= self.max_bytes

    def descriptors(self, publication_id: str, staging: Staging) -> list[int]:
        """New descriptors (the caller sends and closes them) of the publication's memfds,
        created, filled with the staging files' headers and sealed on first use."""
        with self._lock:
            memfds = self._by_pub.get(publication_id)
            if memfds is None:
                memfds = _create(staging)
                self._by_pub[publication_id] = memfds
            return [os.dup(fd) for fd in memfds]

    def drain(self, publication_id: str, staging: Staging) -> None:
        """Copy the memfds into the staging files and close them; a no-op for a publication
        that never got memfds. The copy is the daemon's own file: whatever the publisher
        writes to its memfd afterwards changes nothing that is hashed or served."""
        with self._lock:
            memfds = self._by_pub.get(publication_id)
        if memfds is None:
            return
        for fd, (name, path, size) in zip(memfds, staging.files, strict=True):
            try:
                _copy(fd, path, size)
            except OSError as exc:
                raise PublicationFailed(f"cannot copy the staging of {name}: {exc.strerror}",
                                        details={"file": name}) from None
        self.discard(publication_id)

    def progress_marks(self, publication_id: str) -> list[int]:
        """Size, blocks and modification time of each memfd of the publication (none before its
        writer asked for its descriptors): they change as the writer writes."""
        with self._lock:
            memfds = list(self._by_pub.get(publication_id, ()))
        marks: list[int] = []
        for fd in memfds:
            try:
                st = os.fstat(fd)
            except OSError:  # discarded meanwhile
                continue
            marks += [st.st_size, st.st_blocks, st.st_mtime_ns]
        return marks

    def discard(self, publication_id: str) -> None:
        with self._lock:
            memfds = self._by_pub.pop(publication_id, [])
        for fd in memfds:
            os.close(fd)


def _create(staging: Staging) -> list[int]:
    heads = {plan.name: plan.head for plan in staging.plans}
    made: list[int] = []
    try:
        for name, _path, size in staging.files:
            fd = os.memfd_create(f"hwr-staging-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            made.append(fd)
            os.ftruncate(fd, size)
            os.pwrite(fd, heads[name], 0)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _GROW_SHRINK)
    except BaseException:
        for fd in made:
            os.close(fd)
        raise
    return made


def _copy(memfd: int, path: str | Path, size: int) -> None:
    """Copy ``size`` bytes of a frozen memfd into the daemon's staging file at ``path``."""
    out = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        offset = 0
        while offset < size:
            chunk = os.pread(memfd, min(_COPY_CHUNK, size - offset), offset)
            if not chunk:
                raise PublicationFailed("a staging memfd came up short", details={"file": os.path.basename(path)})
            view = memoryview(chunk)
            while view:
                written = os.pwrite(out, view, offset)
                offset += written
                view = view[written:]
    finally:
        os.close(out)
