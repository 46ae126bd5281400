"""Where a store may live: node-local filesystem types and trusted ownership/permissions.

Decisions are pure functions over plain values (``classify_filesystem(magic, allowed)``,
``permission_problem(mode, uid, euid)``); the syscalls sit in one-line helpers (``statfs_magic``,
``os.lstat``) that tests may replace to inject a filesystem type.

Filesystem policy: the kernel's ``statfs`` magic number decides, never a mount table a user can
shadow. Allowed by default: ext2/3/4, xfs, btrfs, zfs, f2fs, bcachefs, tmpfs, ramfs, and
overlayfs (the root filesystem of a container; its upper layer is a node-local disk under every
container runtime we know). Rejected: NFS, SMB/CIFS, Lustre, Ceph, GPFS, 9p, AFS, GFS2/OCFS2,
every FUSE filesystem (FUSE shares one magic number, so a local ``fuseblk`` cannot be told from
s3fs/gcsfuse/virtiofs and is refused with them) and every type not listed. Limits: overlayfs
on top of a remote lower layer is not detected; the check is made once, at open.

Permission policy: the root and its subdirectories must be directories (not symlinks) owned by
the effective uid and not writable by group or others; other users could otherwise swap files
under a daemon that trusts them. A new root is created 0700.

Socket directory policy (``socket_dir_problem``): the directory of the sockets belongs to the
daemon's uid or to root, and others may not write it unless it is sticky (``/tmp`` itself):
otherwise another user could have made it (``/tmp/hwrd-$UID`` before its owner) or could move
the daemon's sockets away and answer in its place. Clients check the same from their side
(``hwr.client.daemon_trust``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hwr.client.errors import StoreIOError, UntrustedStore

__all__ = [
    "DEFAULT_ALLOWED",
    "FS_MAGIC",
    "FilesystemVerdict",
    "check_filesystem",
    "check_socket_dir",
    "check_trusted_dir",
    "classify_filesystem",
    "permission_problem",
    "socket_dir_problem",
    "statfs_magic",
]

#: statfs ``f_type`` -> name (include/uapi/linux/magic.h and the filesystems' own sources).
FS_MAGIC: Mapping[int, str] = {
    0xEF53: "ext4",  # ext2, ext3 and ext4 share one magic number
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0x2FC12FC1: "zfs",
    0xF2F52010: "f2fs",
    0xCA451A4E: "bcachefs",
    0x01021994: "tmpfs",
    0x858458F6: "ramfs",
    0x794C7630: "overlay",
    0x6969: "nfs",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x517B: "smb",
    0x0BD00BD0: "lustre",
    0x00C36400: "ceph",
    0x47504653: "gpfs",
    0x01021997: "9p",
    0x5346414F: "afs",
    0x6B414653: "afs",
    0x01161970: "gfs2",
    0x7461636F: "ocfs2",
    0x65735546: "fuse",
    0x73717368: "squashfs",
}
#: Types a store may live on unless the caller narrows the set.
DEFAULT_ALLOWED: frozenset[str] = frozenset(
    {"ext4", "xfs", "btrfs", "zfs", "f2fs", "bcachefs", "tmpfs", "ramfs", "overlay"}
)
_REMOTE: frozenset[str] = frozenset(
    {"nfs", "cifs", "smb2", "smb", "lustre", "ceph", "gpfs", "9p", "afs", "gfs2", "ocfs2", "fuse"}
)


@dataclass(frozen=True)
class FilesystemVerdict:
    magic: int
    name: str  # "unknown" when the magic number is not in FS_MAGIC
    allowed: bool
    reason: str


def classify_filesystem(magic: int, allowed: Iterable[str] | None = None) -> FilesystemVerdict:
    """Decide whether a filesystem with this statfs magic may hold a store."""
    allow = DEFAULT_ALLOWED if allowed is None else frozenset(allowed)
    name = FS_MAGIC.get(magic & 0xFFFFFFFF, "unknown")
    if name in allow:
        return FilesystemVerdict(magic, name, True, "node-local filesystem")
    if name in _REMOTE:
        reason = "remote or FUSE filesystem"
    elif name == "unknown":
        reason = "unknown filesystem type"
    else:
        reason = "filesystem type not in the allow-list"
    return FilesystemVerdict(magic, name, False, reason)


class _Statfs(ctypes.Structure):
    # Linux 64-bit ``struct statfs``: only f_type (the first word) is read; the padding makes the
    # buffer larger than any architecture's struct so the kernel never writes past it.
    _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_byte * 256)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def statfs_magic(path: Path) -> int:
    """The ``f_type`` of the filesystem holding ``path`` (one syscall; ``OSError`` on failure)."""
    buf = _Statfs()
    if _libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return buf.f_type & 0xFFFFFFFF


def check_filesystem(path: Path, allowed: Iterable[str] | None = None) -> FilesystemVerdict:
    """Raise ``UntrustedStore`` unless ``path`` is on an allowed filesystem; return the verdict."""
    try:
        magic = statfs_magic(path)
    except OSError as exc:
        raise StoreIOError(f"cannot statfs {path}: {exc.strerror}", details={"path": str(path)}) from None
    verdict = classify_filesystem(magic, allowed)
    if not verdict.allowed:
        raise UntrustedStore(
            f"store {path} is on {verdict.name} (0x{magic:x}): {verdict.reason}",
            details={"path": str(path), "filesystem_type": verdict.name, "magic": magic},
        )
    return verdict


def permission_problem(mode: int, uid: int, euid: int) -> str | None:
    """Why a directory with this ``lstat`` mode and owner cannot be trusted, or None."""
    if stat.S_ISLNK(mode):
        return "is a symlink"
    if not stat.S_ISDIR(mode):
        return "is not a directory"
    if uid != euid:
        return f"is owned by uid {uid}, not {euid}"
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.S_IMODE(mode):04o})"
    return None


def check_trusted_dir(path: Path, *, euid: int | None = None) -> os.stat_result:
    """Raise ``UntrustedStore`` unless ``path`` passes ``permission_problem``; return its lstat."""
    st = os.lstat(path)
    problem = permission_problem(st.st_mode, st.st_uid, os.geteuid() if euid is None else euid)
    if problem:
        raise UntrustedStore(f"store directory {path} {problem}", details={"path": str(path)})
    return st


def socket_dir_problem(mode: int, uid: int, euid: int) -> str | None:
    """Why a daemon of uid ``euid`` must not serve from a socket directory with this ``stat``
    mode and owner (module docstring), or None."""
    if not stat.S_ISDIR(mode):
        return "is not a directory"
    if uid not in (euid, 0):
        return f"belongs to uid {uid}, neither this daemon's ({euid}) nor root's"
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
        return f"is writable by group or others (mode {stat.S_IMODE(mode):04o}): they could replace the sockets"
    return None


def check_socket_dir(path: Path) -> None:
    """Raise ``UntrustedStore`` unless the socket directory ``path`` (symlinks followed) passes
    ``socket_dir_problem``."""
    st = os.stat(path)
    problem = socket_dir_problem(st.st_mode, st.st_uid, os.geteuid())
    if problem:
        raise UntrustedStore(f"socket directory {path} {problem}", details={"path": str(path)})
