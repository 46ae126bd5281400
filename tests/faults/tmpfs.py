"""A small tmpfs for the full-disk tests, with or without host privileges.

``small_tmpfs(where, size)`` mounts a size-limited tmpfs at ``where``:

- **host**: ``mount -t tmpfs`` (root or CAP_SYS_ADMIN); every process sees it at ``where``;
- **userns** (no privilege needed): a keeper process (``unshare -rm``: a new user namespace with
  the caller mapped to root, and a new mount namespace) mounts it and sleeps. The tmpfs exists
  only in that mount namespace, so the daemon is started inside it (``nsenter`` into the
  keeper's namespaces: ``SmallTmpfs.enter``), where it sits at ``where``; this process reaches
  the same files through ``/proc/<keeper>/root`` (``SmallTmpfs.view``). The namespace lives as
  long as the keeper, so a daemon killed and restarted finds its store again.

``HWR_TEST_TMPFS=host|userns`` forces one way (to test the fallback on a privileged machine).
When neither works the test is skipped with both reasons, or fails when ``CI`` is set (``CI=true``,
as CI services set it): there the full-disk promise must be proven, not skipped.
Limits: Linux only; the userns way needs ``unshare``/``nsenter`` (util-linux) and unprivileged
user namespaces enabled (``kernel.unprivileged_userns_clone``, ``user.max_user_namespaces``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hwr.daemon.app.launcher import DaemonProcess


@dataclass
class SmallTmpfs:
    where: Path  # the mount point, as the daemon sees it
    view: Path  # the same directory, as this process reaches it
    enter: list[str] = field(default_factory=list)  # command prefix that runs inside its namespaces
    keeper: subprocess.Popen[str] | None = None

    @property
    def mode(self) -> str:
        return "userns" if self.keeper is not None else "host"

    def close(self) -> None:
        if self.keeper is None:
            subprocess.run(["umount", "-l", str(self.where)], check=False, capture_output=True)
            return
        if self.keeper.poll() is None:
            self.keeper.send_signal(signal.SIGKILL)  # the last process of the namespace: the tmpfs goes
        self.keeper.wait(10)


def _host(where: Path, size: str) -> SmallTmpfs | str:
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        return f"mount -t tmpfs: {result.stderr.strip() or result.returncode}"
    return SmallTmpfs(where, where)


def _userns(where: Path, size: str) -> SmallTmpfs | str:
    script = f'mount -t tmpfs -o size={size},mode=0700 tmpfs "$1" && echo ready && exec sleep 100000'
    try:
        keeper = subprocess.Popen(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script,
                                   "sh", str(where)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        return f"unshare: {exc}"
    assert keeper.stdout is not None and keeper.stderr is not None
    if keeper.stdout.readline().strip() != "ready":
        keeper.wait(10)
        return f"unshare -rm + mount: {keeper.stderr.read().strip() or keeper.returncode}"
    enter = ["nsenter", f"--target={keeper.pid}", "--user", "--mount", "--preserve-credentials", "--"]
    view = Path(f"/proc/{keeper.pid}/root") / where.relative_to("/")
    return SmallTmpfs(where, view, enter, keeper)


def small_tmpfs(where: Path, size: str) -> SmallTmpfs:
    """A ``size`` tmpfs at ``where`` (an absolute path, created here), the first way that works."""
    where.mkdir()
    forced = os.environ.get("HWR_TEST_TMPFS", "")
    ways = {"host": _host, "userns": _userns}
    failures = []
    for name, way in ways.items():
        if forced and name != forced:
            continue
        got = way(where, size)
        if isinstance(got, SmallTmpfs):
            return got
        failures.append(f"{name}: {got}")
    reason = "cannot mount a small tmpfs: " + "; ".join(failures)
    if os.environ.get("CI"):
        pytest.fail(reason + " (CI is set: the full-disk tests must run, not skip)")
    pytest.skip(reason)


class TmpfsDaemon(DaemonProcess):
    """hwrd on a store at ``<tmpfs>/store``, started inside the tmpfs's namespaces. ``root`` is
    the store as the test reaches it; the log stays outside the tmpfs (next to the socket), so
    a full disk never eats it."""

    def __init__(self, fs: SmallTmpfs, sock: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        super().__init__(fs.view / "store", sock, *extra, env=env)
        self.fs = fs
        self.log = sock.parent / "hwrd-tmpfs.log"

    def command(self) -> list[str]:
        return [*self.fs.enter, sys.executable, "-m", "hwr.daemon.app.main", "--root", str(self.fs.where / "store"),
                "--socket", str(self.socket), *self.extra]
