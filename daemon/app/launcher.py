"""Start and stop a real ``hwrd`` process from Python: the demo, benchmarks and tests use it.

``DaemonProcess`` runs ``python -m hwr.daemon.app.main`` on a root and socket, waits until the peer
channel and gRPC answer, and stops it with SIGTERM (or SIGKILL on demand). Its output goes to
``<root's parent>/hwrd-<root name>.log``. Limit: for local use (no systemd).

``user=RunAs(uid, gid)`` (the caller must be root) runs the daemon as that user the way the
systemd unit's ``User=``/``Group=`` do: that uid and gid, no supplementary groups, no
capabilities, the unit's umask. The switch happens inside the started interpreter, before it
imports hwrd (``python -m hwr.daemon.app.launcher --as UID:GID -- COMMAND...``), because the
interpreter's own path may not be reachable by that uid (a virtual environment under
``/root``); COMMAND is then run in the same process when it is this interpreter with ``-m
MODULE`` or a script, else executed. The root and the socket's directory must already exist
and belong to that user (the unit's ``CacheDirectory=``/``RuntimeDirectory=``); the log file is
opened by the caller. An interpreter installed where that user cannot search (a pyenv under
``/root``), and an editable install of a checkout in a private directory, keep working: the
entries of ``sys.path`` and the editable finder's package directories the user could not reach
are replaced by directory descriptors opened before the switch (``/proc/self/fd/N``;
``_keep_sys_path_reachable``). Limit: a program the
daemon itself starts with ``sys.executable`` (prewarm's producers) still needs an interpreter
that user can run, as on a real node.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunAs:
    """The user a daemon runs as (``User=``/``Group=``/``UMask=`` of the systemd unit)."""

    uid: int
    gid: int
    umask: int = 0o007


class DaemonProcess:
    def __init__(self, root: Path, sock: Path, *extra: str, env: dict[str, str] | None = None,
                 user: RunAs | None = None) -> None:
        self.root = root
        self.socket = sock
        self.extra = extra
        self.env = {**os.environ, **(env or {})}
        self.user = user
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root.parent / f"hwrd-{root.name}.log"

    def command(self) -> list[str]:
        """The command line that runs the daemon (tests override it to wrap hwrd)."""
        return [sys.executable, "-m", "hwr.daemon.app.main", "--root", str(self.root),
                "--socket", str(self.socket), *self.extra]

    def start(self, timeout: float = 30.0) -> DaemonProcess:
        cmd = self.command() if self.user is None else as_user_command(self.user, self.command())
        self._log = open(self.log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hwrd exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if answers(Path(f"{self.socket}.peer")) and answers(self.socket):
                return self
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"hwrd did not come up: {self.log.read_text()[-2000:]}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        with contextlib.suppress(Exception):
            self._log.close()

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def as_user_command(user: RunAs, command: Sequence[str]) -> list[str]:
    """``command`` run as ``user`` (see the module docstring)."""
    return [sys.executable, "-m", "hwr.daemon.app.launcher", "--as", f"{user.uid}:{user.gid}:{user.umask:o}",
            "--", *command]


def _run_as(argv: list[str]) -> int:
    """``--as UID:GID:UMASK -- COMMAND...``: drop to that user, then run COMMAND."""
    import runpy

    if len(argv) < 4 or argv[0] != "--as" or argv[2] != "--":
        print("usage: python -m hwr.daemon.app.launcher --as UID:GID:UMASK -- COMMAND...", file=sys.stderr)
        return 2
    uid, gid, umask = argv[1].split(":")
    command = argv[3:]
    reachable = _keep_sys_path_reachable(int(uid), int(gid))
    script = None  # a script in a directory the user cannot search is run through its descriptor
    if command[0] == sys.executable and len(command) >= 2 and not command[1].startswith("-"):
        where = Path(command[1]).resolve()
        script = str(Path(reachable(str(where.parent))) / where.name)
    # Groups first, uid last: once the uid is not 0 the process may no longer change the others,
    # and the kernel clears every capability with it.
    os.setgroups([])
    os.setgid(int(gid))
    os.setuid(int(uid))
    os.umask(int(umask, 8))
    _set_dumpable()
    if os.getuid() != int(uid) or os.geteuid() != int(uid) or os.getegid() != int(gid) or os.getgroups():
        print(f"launcher: could not become {uid}:{gid}", file=sys.stderr)
        return 1
    if command[0] == sys.executable and len(command) >= 3 and command[1] == "-m":
        sys.argv = [command[2], *command[3:]]
        runpy.run_module(command[2], run_name="__main__", alter_sys=True)
        return 0
    if command[0] == sys.executable and len(command) >= 3 and command[1] == "-c":
        sys.argv = ["-c", *command[3:]]
        exec(compile(command[2], "<string>", "exec"), {"__name__": "__main__"})  # what python -c does
        return 0
    if script is not None:
        sys.argv = command[1:]
        sys.path[0] = str(Path(script).parent)
        runpy.run_path(script, run_name="__main__")
        return 0
    os.execvp(command[0], command)


def _set_dumpable() -> None:
    """Undo the kernel's "not dumpable" mark of a process that changed its uid, as an exec by the
    new user would: ``/proc/<pid>`` then belongs to that user, as it does under systemd."""
    import ctypes

    pr_set_dumpable = 4
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_dumpable, 1, 0, 0, 0)


def _searchable(path: str, uid: int, gid: int) -> bool:
    """Whether ``uid`` (primary group ``gid``, no others) may search every directory down to ``path``."""
    current = Path(path).resolve()
    for directory in (*reversed(current.parents), current):
        try:
            st = directory.stat()
        except OSError:
            return False
        bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid == gid else 0o001
        if not st.st_mode & bit:
            return False
    return True


def _keep_sys_path_reachable(uid: int, gid: int) -> Callable[[str], str]:
    """Make every place this interpreter imports from reachable by ``uid`` after the switch.

    Before the switch (still root), each directory ``uid`` cannot search is opened, and each
    reference to it is replaced by ``/proc/self/fd/N`` (the descriptor is kept for the process's
    life, and a process may always read its own ``/proc/self/fd``): the entries of ``sys.path``,
    the ``__path__`` of the packages imported already (encodings, hwr, ...), and the package
    directories of setuptools' editable finders (``MAPPING`` of ``__editable___*_finder``, which
    an editable install puts on ``sys.meta_path``: it names the checkout's directories, and a
    checkout in a private directory, ``/root/...`` or a 0700 ``mktemp -d``, is not searchable by
    the daemon's user). Returns the remapping (a directory -> a path ``uid`` can reach) for the
    caller's own paths. Limit: other custom finders that keep paths of their own are not seen.
    """
    moved: dict[str, str] = {}

    def reachable(entry: str) -> str:
        if not entry or not os.path.isdir(entry) or _searchable(entry, uid, gid):
            return entry
        key = entry.rstrip("/") + "/"
        if key not in moved:
            fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # kept for the process's life
            moved[key] = f"/proc/self/fd/{fd}/"
        return moved[key].rstrip("/")

    sys.path[:] = [reachable(entry) for entry in sys.path]
    for finder_module in _editable_finder_modules():
        for table in ("MAPPING", "NAMESPACES"):
            mapping = getattr(finder_module, table, None)
            if not isinstance(mapping, dict):
                continue
            for name, where in list(mapping.items()):
                if isinstance(where, str):
                    mapping[name] = reachable(where)
                elif isinstance(where, list):
                    mapping[name] = [reachable(p) if isinstance(p, str) else p for p in where]
    # Packages imported already find their submodules through their own __path__.
    for module in list(sys.modules.values()):
        paths = getattr(module, "__path__", None)
        if not isinstance(paths, list):
            continue
        for i, entry in enumerate(paths):
            for old, new in moved.items():
                if entry == old.rstrip("/") or entry.startswith(old):
                    paths[i] = (new + entry[len(old):]).rstrip("/")
                    break
            else:
                paths[i] = reachable(entry) if isinstance(entry, str) else entry
    sys.path_importer_cache.clear()
    return reachable


def _editable_finder_modules() -> list[object]:
    """The modules of setuptools' editable finders loaded in this interpreter (their names are
    ``__editable___<dist>_finder``, made by ``pip install -e``)."""
    return [module for name, module in list(sys.modules.items())
            if name.startswith("__editable__") and name.endswith("_finder") and module is not None]


def answers(path: Path, timeout: float = 0.5) -> bool:
    """True when something accepts a connection on the Unix socket ``path``."""
    if not path.exists():
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


if __name__ == "__main__":
    sys.exit(_run_as(sys.argv[1:]))
