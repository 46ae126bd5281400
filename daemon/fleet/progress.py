"""One pull in flight as everyone waiting for it sees it: bytes, phase, waiters, stall, stop.

A ``PullProgress`` is shared by the pull's task (``hwr.daemon.fleet.pull``), the transfer
threads that receive its bytes (``add``, ``check``), the acquirers that wait for it (their
``waiting`` registration, shown by ``hwrctl status``; the peer socket's progress frames read it)
and ``hwrctl pull``'s progress stream.

Phases: ``documents`` (READY.json, manifest.json), ``admission`` (a staging and its room in the
store: local, bounded by the publication wait timeout), ``download`` (the payloads), ``commit``
(local: the store seals and renames). Only the remote's phases, ``documents`` and ``download``,
can stall: ``stalled_for`` is the time since the last byte (or the phase's start) in those
phases, 0 in the others.

Thread safety: ``add`` and ``check`` are called from transfer threads; an int update and a
reference read are atomic under the GIL, and a reader that sees a value one piece old is fine.
Everything else runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hwr.client.errors import HwrError

if TYPE_CHECKING:
    from hwr.daemon.service.catalog import Waiter
    from hwr.daemon.store.inspection import ArtifactRecord

__all__ = ["REMOTE_PHASES", "PullProgress"]

#: The phases in which the remote must keep sending bytes (the stall timeout applies).
REMOTE_PHASES = frozenset({"documents", "download"})


@dataclass
class PullProgress:
    """One pull in flight (see the module docstring)."""

    key: str
    remote: str = ""
    total_bytes: int = 0
    done_bytes: int = 0
    phase: str = "documents"
    started_at: float = field(default_factory=time.time)  # wall clock, for hwrctl
    advanced_at: float = field(default_factory=time.monotonic)  # last byte or phase change
    stopped: HwrError | None = None  # set once: every transfer of this pull raises it
    waiters: dict[int, Waiter] = field(default_factory=dict, repr=False)
    task: asyncio.Task[tuple[ArtifactRecord, str]] | None = field(default=None, repr=False)

    def add(self, n: int) -> None:
        """Bytes received (from the transfer threads)."""
        self.done_bytes += n
        self.advanced_at = time.monotonic()

    def enter(self, phase: str) -> None:
        self.phase = phase
        self.advanced_at = time.monotonic()

    def stalled_for(self, now: float | None = None) -> float:
        if self.phase not in REMOTE_PHASES:
            return 0.0
        return (time.monotonic() if now is None else now) - self.advanced_at

    def stop(self, error: HwrError) -> None:
        if self.stopped is None:
            self.stopped = error

    def check(self) -> None:
        """Raise the stop error (a fresh copy: each thread gets its own traceback)."""
        error = self.stopped
        if error is not None:
            raise type(error)(error.message, details=error.details)

    @contextlib.contextmanager
    def waiting(self, waiter: Waiter | None) -> Iterator[None]:
        """Register ``waiter`` for as long as the block runs."""
        if waiter is None:
            yield
            return
        token = id(waiter)
        self.waiters[token] = waiter
        try:
            yield
        finally:
            self.waiters.pop(token, None)

    def describe(self) -> str:
        """``"412 of 1024 MiB (40%)"`` for messages and logs."""
        mib = 1 << 20
        if not self.total_bytes:
            return f"{self.phase}"
        share = 100 * self.done_bytes // max(1, self.total_bytes)
        return f"{self.done_bytes // mib} of {self.total_bytes // mib} MiB ({share}%)"
