"""Test-only fault injection at the OS boundary of the daemon: failing syscalls, a shifted wall clock.

Off unless the daemon starts with ``HWR_TEST_FAULTS=<control file>`` in its environment (only the
fault tests set it; ``hwr.daemon.app.main`` calls ``install_from_env`` first thing). Then the store's
one-line syscall helpers in ``hwr.daemon.store.fileio`` (``fallocate``, ``pwrite``, ``fsync``,
``rename``; ``fsync_dir``, ``pwrite_all`` and ``write_new_file`` go through them) are wrapped, and
``time.time`` is wrapped to add an offset. Nothing above the syscall helpers is faked: the
store, publications and RPC layers see exactly the ``OSError`` the kernel would raise.

The control file is JSON, re-read whenever it changes (the test rewrites it atomically)::

    {"fail_at": N, "errno": "ENOSPC", "ops": ["fsync", ...], "clock_offset_s": 0.0, "slow_s": 0.0,
     "log": PATH}

- ``fail_at``: the N-th (1-based) wrapped call counted since the file last changed fails with
  ``errno`` (a name from ``errno``), once; 0 or absent: no failure. ``ops`` restricts which
  helpers count (default: all four).
- ``log``: a file the daemon appends ``<n> <op> <FAILED|ok>`` lines to, one per counted call, so a
  test knows which step a fault hit and when the calls ran out (no fault fired).
- ``slow_s``: every counted call sleeps that long first (a slow disk).
- ``clock_offset_s``: added to ``time.time()`` (a wall-clock jump; ``time.monotonic`` and the event
  loop's clock are untouched, which is the point of the clock-jump tests).

Limits: one failure per control-file version; calls are counted across all threads of the
daemon, so a test that wants a deterministic step must run one publication at a time; reads
(``mmap``, ``pread``) are not injected.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["ENV", "install", "install_from_env"]

ENV = "HWR_TEST_FAULTS"
OPS = ("fallocate", "pwrite", "fsync", "rename")


class _Injector:
    def __init__(self, control: Path) -> None:
        self.control = control
        self._lock = threading.Lock()
        self._version: tuple[int, int] | None = None
        self._rules: dict[str, Any] = {}
        self._count = 0
        self._fired = False

    def _refresh(self) -> None:
        try:
            st = os.stat(self.control)
        except OSError:
            self._version, self._rules = None, {}
            return
        version = (st.st_ino, st.st_mtime_ns)
        if version != self._version:
            self._version = version
            try:
                self._rules = json.loads(self.control.read_bytes())
            except (OSError, ValueError):
                self._rules = {}
            self._count = 0
            self._fired = False

    def rules(self) -> dict[str, Any]:
        with self._lock:
            self._refresh()
            return self._rules

    def check(self, op: str) -> None:
        with self._lock:
            self._refresh()
            rules = self._rules
            if op not in rules.get("ops", OPS):
                return
            self._count += 1
            fail = not self._fired and int(rules.get("fail_at", 0) or 0) == self._count
            if fail:
                self._fired = True
            log = rules.get("log")
            if log:
                with open(log, "a") as f:
                    f.write(f"{self._count} {op} {'FAILED' if fail else 'ok'}\n")
        slow = float(rules.get("slow_s", 0.0) or 0.0)
        if slow > 0:
            time.sleep(slow)
        if fail:
            code = getattr(errno, str(rules.get("errno", "EIO")))
            raise OSError(code, f"{os.strerror(code)} (injected by {ENV})")


def install(control: Path) -> None:
    """Wrap the store's syscall helpers and ``time.time`` (see the module docstring)."""
    from hwr.daemon.store import fileio as store_io

    injector = _Injector(Path(control))
    for op in OPS:
        real = getattr(store_io, op)

        def wrapped(*args: Any, _op: str = op, _real: Any = real) -> Any:
            injector.check(_op)
            return _real(*args)

        setattr(store_io, op, wrapped)
    real_time = time.time

    def shifted_time() -> float:
        return real_time() + float(injector.rules().get("clock_offset_s", 0.0) or 0.0)

    time.time = shifted_time


def install_from_env(environ: dict[str, str] | None = None) -> bool:
    control = (os.environ if environ is None else environ).get(ENV)
    if not control:
        return False
    install(Path(control))
    return True
