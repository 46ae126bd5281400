"""Sealed memfd staging: small client publications cannot grow by a single byte.

For a client publication whose payload files total at most ``memfd_staging_max_bytes``, the
staging descriptors a client receives are not the staging files but one memfd per file, sized
exactly (``ftruncate``), holding the file's header, and sealed ``F_SEAL_GROW|F_SEAL_SHRINK``:
the kernel refuses every write past the end, ``ftruncate`` and ``fallocate`` beyond the size, so
the publisher can consume nothing beyond its reservation, and the pages it writes are charged to
its own memory cgroup. At commit ``drain`` copies the bytes into the daemon-only staging file
and closes the daemon's memfd; the commit then hashes and installs that copy as for any
staging, so writes the publisher makes afterwards (or during the copy: then the copy holds a
mix of its own bytes, which its ``expected_sha256`` catches) change nothing others are served.
No ``F_SEAL_WRITE`` is needed for that, and adding it can stall for a page still referenced
(the kernel waits for such pins in 100 ms steps).

Limits: the bytes pass through memory (the memfd) and are copied once more into the staging
file, so this is for small publications (churn), not for multi-GiB ones, which keep file
staging with the checks of ``hwr.daemon.store.staging_bounds``. A publisher keeping its memfd
descriptor after the commit keeps that memory, charged to itself. Daemon-side producers
(prewarm) write staging files directly.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from hwr.client.errors import PublicationFailed

if TYPE_CHECKING:
    from hwr.daemon.store.staging import Staging

__all__ = ["MemfdStagings"]

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
