"""Prove that nobody but the daemon still has a staging file open before it is committed.

A publisher writes through a descriptor the daemon passed to it. After commit the file must be
immutable, so no other process may keep a writable descriptor or mapping of it. Linux only grants
a write lease (``F_SETLEASE``/``F_WRLCK``) when no other open file description of the inode
exists in any process (a mapping keeps its file description alive), so taking and dropping one
is an exact, race-free check as long as nobody can open the file again afterwards (the store is
private to the daemon's user and the daemon stops handing out staging descriptors before it
checks). Limit: the daemon must own the file (or hold CAP_LEASE); filesystems without lease
support report ``Unsupported``.

A refusal names the processes seen holding the file (``holder_pids``: a scan of
``/proc/<pid>/fd`` made only on refusal, so it sees the processes whose descriptors the
daemon's user may read, and misses a mapping whose descriptor was closed).

``opened_elsewhere(path)`` is the same check as a question, for eviction: it needs no right on
other processes, so it answers for workers whose ``/proc/<pid>/maps`` a daemon that is not root
may not read.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

from hwr.client.errors import PublicationFailed, Unsupported

__all__ = ["RETRIES", "holders", "open_sole", "opened_elsewhere"]

#: Tries of the write lease before a refusal, the n-th after ``n * RETRY_DELAY_S`` (100 ms in all).
RETRIES = 5
RETRY_DELAY_S = 0.01


def holders(path: Path) -> list[int]:
    """Pids with a descriptor open on ``path`` (those whose ``/proc/<pid>/fd`` can be read)."""
    target = os.fspath(path)
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            links = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in links:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    found.append(int(pid))
                    break
            except OSError:
                continue
    return found


def open_sole(path: Path) -> int:
    """Open ``path`` read-only and prove (a write lease taken and dropped) that no other open
    file description of it exists; returns that descriptor (the caller closes it: the commit
    hashes through it instead of opening the file again). ``PublicationFailed`` when a writer
    still holds it, ``Unsupported`` without lease support.

    A refusal is confirmed over ``RETRIES`` tries about 100 ms apart in all: a reference the
    kernel drops a moment later (the daemon's own just-closed copy, a descriptor still in flight
    on a socket) is not a writer, and a real one is still there at the last try."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for attempt in range(RETRIES):
            try:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EBUSY):
                    raise Unsupported(
                        f"the store filesystem does not support file leases ({errno.errorcode.get(exc.errno)})"
                    ) from None
                if attempt == RETRIES - 1:
                    seen = holders(path)  # this process is among them (``fd``): name it only if alone
                    pids = [pid for pid in seen if pid != os.getpid()] or seen
                    raise PublicationFailed(
                        "a writer still holds the staging file open or mapped; close every descriptor "
                        f"and mapping before committing (held by pids {pids or 'unknown'})",
                        details={"file": path.name, "holder_pids": pids},
                    ) from None
                time.sleep(RETRY_DELAY_S * (attempt + 1))
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def opened_elsewhere(path: str, device: int, inode: int) -> bool | None:
    """Whether an open file description of the file ``(device, inode)`` at ``path`` exists besides
    the one this call opens (a descriptor or a mapping in any process, or a descriptor in flight
    on a socket): True or False, from a write lease taken and dropped at once; None when the file
    cannot be opened, is another file by now, is not this process's user's, or its filesystem
    has no leases (the caller then knows nothing). Exact only while nobody can open the file
    anew meanwhile (the caller stops handing out its descriptors first)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (device, inode):
            return None
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except OSError as exc:
        return True if exc.errno in (errno.EAGAIN, errno.EBUSY) else None
    else:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return False
    finally:
        os.close(fd)
