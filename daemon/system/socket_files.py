"""The socket files an hwrd binds: claimed before the bind, released at exit only while still its own.

Several hwrds can run on one host (the node's service, a hand-started one, tests, benchmarks),
and a path such as ``/run/hwrd/metrics.sock`` can be named by more than one of them. Two rules
keep one from breaking another:

1. **Claim** (``claim(path)``), before binding: a path where a live server still accepts
   connections is refused with ``StoreLocked`` ("another daemon is serving on PATH"); a socket
   file nobody answers on (left by a killed daemon) is removed; anything that is not a socket is
   refused, never replaced.
2. **Release** (``release(bound)``), at exit: the file is unlinked only when the path still
   holds the very socket this process bound (same device and inode, recorded by
   ``bound(path)`` right after the bind). A path that another daemon took over since (after
   someone removed ours) is left alone.

Limits: a claim and the bind that follows are two steps, so two daemons started within the
same instant on one free path can both pass the claim (the second bind then replaces the first's
file); the probe waits at most half a second for a listener that does not accept.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from hwr.client.errors import StoreLocked

__all__ = ["BoundSocket", "bound", "claim", "is_same_file", "release"]


@dataclass(frozen=True)
class BoundSocket:
    """A socket file this process bound, as ``lstat`` saw it right after the bind."""

    path: Path
    device: int
    inode: int


def is_same_file(now: os.stat_result, ours: BoundSocket) -> bool:
    """Whether ``now`` (an ``lstat`` of ``ours.path``) is still the socket this process bound."""
    return stat.S_ISSOCK(now.st_mode) and (now.st_dev, now.st_ino) == (ours.device, ours.inode)


def _answers(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def claim(path: Path) -> None:
    """Make ``path`` free to bind (rule 1 of the module docstring); ``StoreLocked`` when a live
    server answers there or the path is not a socket."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise StoreLocked(f"{path} exists and is not a socket; refusing to replace it",
                          details={"socket": str(path)})
    if _answers(path):
        raise StoreLocked(f"another daemon is serving on {path}; refusing to take it over (stop that daemon, "
                          "or give this one another path)", details={"socket": str(path)})
    with contextlib.suppress(FileNotFoundError):  # gone meanwhile: free all the same
        os.unlink(path)


def bound(path: Path) -> BoundSocket:
    """Record the socket file just bound at ``path`` (for ``release``)."""
    info = os.lstat(path)
    return BoundSocket(Path(path), info.st_dev, info.st_ino)


def release(ours: BoundSocket) -> bool:
    """Unlink ``ours.path`` if it is still the socket this process bound (rule 2); True if it did."""
    try:
        now = os.lstat(ours.path)
    except FileNotFoundError:
        return False
    if not is_same_file(now, ours):
        return False
    try:
        os.unlink(ours.path)
    except FileNotFoundError:
        return False
    return True
