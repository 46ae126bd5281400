"""Open client-named files with the caller's rights, never with the daemon's (no confused deputy).

``CallerOpener(cred)`` opens paths on behalf of a caller whose ``PeerCred`` the daemon knows:

- the caller is root or the daemon's own uid: opened directly (the caller already has at least
  the daemon's rights on them);
- hwrd runs as root (it can take another uid): the paths are opened by a helper process (a
  fresh interpreter, not a fork of the threaded daemon) that drops to the caller's
  supplementary groups, gid and uid (``setgroups``, ``setresgid``, ``setresuid``: the kernel
  checks every directory and the file against the caller) and passes the descriptors back over
  a socket pair (SCM_RIGHTS);
- otherwise (hwrd is an ordinary user and cannot take the caller's identity): the daemon opens
  the file and grants it only when the mode bits of the opened file and of every directory on
  its path give the caller read (file) and search (directories) rights; a file or directory
  carrying a POSIX ACL is refused (its rights are not the mode bits).

Every open is ``O_RDONLY|O_NOFOLLOW|O_NONBLOCK|O_CLOEXEC`` (a FIFO or device never blocks the
opener: the caller checks ``S_ISREG`` on the descriptor before reading). Results keep the order
of the paths; an entry is a descriptor or the ``OSError`` its open raised (``EACCES`` for a
refusal by the mode-bit check). Limits: the helper costs one interpreter start (tens of
milliseconds) per call, so callers batch their paths; the mode-bit check reads the directories'
modes after the open, so a directory whose mode changes in between is judged on its new mode.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from hwr.client.errors import PermissionDeniedError
from hwr.daemon.system.peercred import PeerCred

__all__ = ["OPEN_FLAGS", "CallerOpener", "daemon_user", "mode_grants"]

OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
HELPER_TIMEOUT_S = 60.0
_ACL_XATTR = "system.posix_acl_access"
log = logging.getLogger("hwrd.access")

# Run as ``python -I -S -c _HELPER`` (a fresh interpreter: nothing of the daemon's state, such as
# gRPC's threads, crosses into it). It drops to the caller's groups, gid and uid before opening
# anything; stdin: one JSON request; one message per path on the passed SOCK_SEQPACKET socket:
# b"ok" with the descriptor, or b"E<errno>"; b"D<errno>" alone when it cannot drop (a root hwrd
# without CAP_SETUID/CAP_SETGID).
_HELPER = """
import json, os, socket, sys
req = json.loads(sys.stdin.buffer.read())
sock = socket.socket(fileno=req["sock"])
try:
    os.setgroups(req["groups"])
    os.setresgid(req["gid"], req["gid"], req["gid"])
    os.setresuid(req["uid"], req["uid"], req["uid"])
except OSError as exc:
    sock.send(b"D%d" % exc.errno)
    sys.exit(3)
for path in req["paths"]:
    try:
        fd = os.open(path, req["flags"])
    except OSError as exc:
        sock.send(b"E%d" % exc.errno)
        continue
    socket.send_fds(sock, [b"ok"], [fd])
    os.close(fd)
"""


def mode_grants(st: os.stat_result, cred: PeerCred, bits: int) -> bool:
    """Pure: whether ``st``'s owner/group/other mode bits grant ``bits`` (``4`` read, ``1`` search)
    to ``cred``, the way the kernel picks one class (owner, else group, else other); root only
    as its class says (no override: hwrd must not lend root's rights)."""
    if st.st_uid == cred.uid:
        return (st.st_mode >> 6) & bits == bits
    if st.st_gid == cred.gid or st.st_gid in cred.groups:
        return (st.st_mode >> 3) & bits == bits
    return st.st_mode & bits == bits


def daemon_user() -> str:
    """hwrd's own user for messages: ``uid N (NAME)``, or ``uid N`` without a passwd entry."""
    import pwd

    uid = os.geteuid()
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


class CallerOpener:
    """Opens paths with ``cred``'s rights (see the module docstring for the three cases)."""

    def __init__(self, cred: PeerCred) -> None:
        self.cred = cred

    def readers(self) -> str:
        """Who must be able to read a file this opener opens, for a refusal's message (a root
        caller's files are opened with hwrd's own rights: hwrd's user, not root, must read them)."""
        if self.cred.uid in (0, os.geteuid()):
            if os.geteuid() == 0:
                return "root"
            return (f"hwrd's user, {daemon_user()} (hwrd opens the files of root and of its own user with its "
                    f"own rights)")
        if os.geteuid() == 0:
            return f"your uid {self.cred.uid}"
        return f"both hwrd's user, {daemon_user()}, and your uid {self.cred.uid}"

    def open_all(self, paths: Sequence[Path]) -> list[int | OSError]:
        if not paths:
            return []
        if self.cred.uid in (0, os.geteuid()):
            return [_open(p) for p in paths]
        if os.geteuid() == 0:
            return self._open_in_helper(paths)
        return [self._open_checked(p) for p in paths]

    # ------------------------------------------------------------------ hwrd runs as root
    def _open_in_helper(self, paths: Sequence[Path]) -> list[int | OSError]:
        cred = self.cred
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        results: list[int | OSError] = []
        try:
            request = json.dumps({"uid": cred.uid, "gid": cred.gid, "groups": list(cred.groups),
                                  "flags": OPEN_FLAGS, "sock": theirs.fileno(),
                                  "paths": [os.fsdecode(p) for p in paths]})
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _HELPER], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, pass_fds=(theirs.fileno(),),
                cwd="/", env={}, start_new_session=True)
            theirs.close()
            try:
                assert proc.stdin is not None
                proc.stdin.write(request.encode())
                proc.stdin.close()
                mine.settimeout(HELPER_TIMEOUT_S)
                for path in paths:
                    try:
                        data, fds, _flags, _addr = socket.recv_fds(mine, 16, 1, socket.MSG_CMSG_CLOEXEC)
                    except OSError:  # timeout included
                        data, fds = b"", []
                    if data == b"ok" and len(fds) == 1:
                        results.append(fds[0])
                    elif data.startswith(b"E") and data[1:].isdigit():
                        code = int(data[1:])
                        results.append(OSError(code, os.strerror(code), str(path)))
                    elif data.startswith(b"D") and data[1:].isdigit():
                        # Refuse rather than open with hwrd's own rights (it must not lend them).
                        raise PermissionDeniedError(
                            f"hwrd cannot take uid {cred.uid}'s identity to open its files "
                            f"({os.strerror(int(data[1:]))}: hwrd runs as root without CAP_SETUID/CAP_SETGID); "
                            "register it as root or run hwrd as its own user",
                            details={"uid": cred.uid, "reason": "CALLER_IDENTITY"})
                    else:
                        for fd in fds:
                            os.close(fd)
                        raise OSError(errno.EIO, "the access check could not take the caller's identity")
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(HELPER_TIMEOUT_S)
                assert proc.stderr is not None
                err = proc.stderr.read()
                proc.stderr.close()
                if proc.returncode and err:
                    log.warning("access helper exited %s: %s", proc.returncode,
                                err.decode(errors="replace")[-500:])
        except BaseException:
            for fd in results:
                if isinstance(fd, int):
                    os.close(fd)
            raise
        finally:
            mine.close()
            theirs.close()
        return results

    # ------------------------------------------------------------------ hwrd is an ordinary user
    def _open_checked(self, path: Path) -> int | OSError:
        result = _open(path)
        if isinstance(result, OSError):
            return result
        try:
            if not self._path_grants(path, os.fstat(result)) or _has_acl(result):
                os.close(result)
                return OSError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        except OSError as exc:
            os.close(result)
            return exc
        return result

    def _path_grants(self, path: Path, st: os.stat_result) -> bool:
        if not mode_grants(st, self.cred, 4):
            return False
        for parent in path.parents:
            pst = os.stat(parent)
            if not mode_grants(pst, self.cred, 1) or _dir_has_acl(parent):
                return False
        return True


def _open(path: Path) -> int | OSError:
    try:
        return os.open(path, OPEN_FLAGS)
    except OSError as exc:
        return exc


def _has_acl(fd: int) -> bool:
    try:
        os.getxattr(fd, _ACL_XATTR)
    except OSError:
        return False
    return True


def _dir_has_acl(path: Path) -> bool:
    try:
        os.getxattr(path, _ACL_XATTR, follow_symlinks=False)
    except OSError:
        return False
    return True
