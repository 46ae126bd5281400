"""Who maps an artifact: a scan of ``/proc/<pid>/maps`` for its payload files' dev:inode.

The lease table says who *asked*; the kernel says who *maps*. A worker that mapped an artifact
and whose session then died (crash of the peer connection, daemon restart, a leaked view) still
has the pages mapped, so eviction must look at every process's mappings. Files are matched by
(device, inode), never by path: a mapping keeps showing the inode after a rename or unlink, and
paths differ across mount namespaces.

``scan(targets)`` returns the pids that map each target and the processes whose maps could not
be read. Reading another process's maps needs ptrace read access (same uid, or
``CAP_SYS_PTRACE``/root). Policy for an unreadable process (decided by the caller,
``hwr.daemon.service.mapping_scan``): it counts as *possibly mapping* every artifact that was ever
leased to a session of its uid (the daemon's store is private, so bytes reach another uid only
through a lease; the journal keeps those uids across restarts), except that an unreadable
process of the daemon's own uid is more privileged than a worker (non-dumpable, another user
namespace, a container's init) and counts only if the journal holds a lease of its pid. That
makes a non-dumpable worker of the daemon's own uid invisible (limit). A daemon that is not root
reads no other uid's maps at all, so the caller clears that suspicion with a write-lease probe
of the payloads (``hwr.daemon.system.exclusive.opened_elsewhere``: no open file description of
them anywhere means nobody maps them). Processes hidden entirely (``/proc`` mounted with
``hidepid``) cannot be seen at all: then the lease journal is the only protection, so run hwrd as
root or with ``CAP_SYS_PTRACE`` on such nodes.

Limits: a scan is a snapshot (the caller blocks new leases on the keys first); a process that
holds a descriptor without mapping it (not something ``hwr.client`` does beyond the instant
between receiving and mapping) is not seen; the daemon's own pid is skipped (pins and
verification map artifacts in the daemon itself, and pins are accounted separately).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

__all__ = ["FileId", "ScanResult", "file_id", "scan"]

FileId = tuple[int, int]  # (st_dev, st_ino)


def file_id(st: os.stat_result) -> FileId:
    return (st.st_dev, st.st_ino)


@dataclass
class ScanResult:
    mapped: dict[FileId, set[int]] = field(default_factory=dict)
    unreadable: dict[int, int | None] = field(default_factory=dict)  # pid -> uid (None: unknown)
    processes: int = 0


def read_maps(pid: int) -> bytes:
    """One-line adapter (tests replace it to inject EACCES)."""
    with open(f"/proc/{pid}/maps", "rb") as f:
        return f.read()


def read_uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def list_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def scan(targets: Iterable[FileId], *, skip_pids: Iterable[int] = (),
         reader: Callable[[int], bytes] | None = None) -> ScanResult:
    """Map each (dev, inode) in ``targets`` to the pids that map it; see the module docstring."""
    wanted = set(targets)
    result = ScanResult()
    if not wanted:
        return result
    read = reader or read_maps
    skip = set(skip_pids)
    by_inode: dict[int, set[str]] = {}
    for dev, ino in wanted:
        by_inode.setdefault(ino, set()).add(f"{os.major(dev):02x}:{os.minor(dev):02x}")
    # One C-speed regex over each maps file: " <dev> <inode>" followed by padding or the end.
    pattern = re.compile(
        rb" ([0-9a-f]+:[0-9a-f]+) (" + b"|".join(str(i).encode() for i in sorted(by_inode)) + rb")(?=[ \n]|$)")
    for pid in list_pids():
        if pid in skip:
            continue
        result.processes += 1
        try:
            data = read(pid)
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited while we looked
        except PermissionError:
            result.unreadable[pid] = read_uid(pid)
            continue
        except OSError:
            continue
        for match in pattern.finditer(data):
            dev_text, ino = match.group(1).decode(), int(match.group(2))
            major, _, minor = dev_text.partition(":")
            normalized = f"{int(major, 16):02x}:{int(minor, 16):02x}"
            if normalized in by_inode.get(ino, ()):
                for dev, i in wanted:
                    if i == ino and f"{os.major(dev):02x}:{os.minor(dev):02x}" == normalized:
                        result.mapped.setdefault((dev, ino), set()).add(pid)
    return result
