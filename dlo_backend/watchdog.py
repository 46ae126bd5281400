"""A watchdog over the AllGather collectives in flight: a stuck gather becomes a typed error.

Why: with gloo a collective that a peer never joins raises in the communication lane's thread
when the group's timeout passes, and the stream is poisoned through ``LaneError``. With NCCL
nothing raises in Python: collectives are enqueued on a CUDA stream and complete (or not)
asynchronously (torch docs, "Distributed communication package", NCCL: the call returns once
the work is enqueued). A dead or idle peer then leaves the gather pending; compute waits on it
on the GPU, the host blocks at the caller's next synchronization, and torch's own NCCL watchdog
finally tears the process down at the group timeout (``TORCH_NCCL_ASYNC_ERROR_HANDLING``'s
default) instead of raising anything the caller could catch.

``CollectiveWatchdog`` polls the completion signal of every gather it is given (``query``, which
never blocks; ``cudaEventQuery`` is callable from any thread). When one has been pending for
longer than ``timeout_s`` it calls ``on_expire`` once with what was pending, and stops. The
backend's ``on_expire`` marks the stream poisoned (the next forward raises
``CollectiveStateError`` naming the gather) and aborts DLO's process group (``abort_group``:
``ProcessGroupNCCL.abort`` -> ``ncclCommAbort``, which ends the communicator's outstanding
operations, so the pending kernels and any host waiting on them return). Its timeout is a
fraction of the group's own, so it acts before torch's watchdog does.

Limits: the outputs of a forward that was in flight when the group was aborted are undefined
(the aborted gathers wrote nothing); the caller sees the error at its next forward. A gather is
only *expected* to finish when every rank issues it: ranks must run forwards in lockstep (see
``group``), so an expiry means a peer died, hung, or skipped a forward.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from hwr.dlo_backend.lanes import Signal

__all__ = ["DEFAULT_GROUP_TIMEOUT_S", "CollectiveWatchdog", "abort_group", "watchdog_timeout_s"]

_log = logging.getLogger(__name__)

# torch's default collective timeout for NCCL groups (``default_pg_nccl_timeout``, 10 minutes).
DEFAULT_GROUP_TIMEOUT_S = 600.0
# Act before the process group's own watchdog would (it may end the process).
_SHARE_OF_GROUP_TIMEOUT = 0.9


def watchdog_timeout_s(group: Any, device: torch.device) -> float:
    """``_SHARE_OF_GROUP_TIMEOUT`` of ``group``'s collective timeout (torch's default if unknown)."""
    timeout: Any = getattr(group, "timeout", None)  # a communicator object that knows its own
    if not isinstance(timeout, timedelta):
        try:  # private in torch: ProcessGroup._get_backend(device).options._timeout
            timeout = group._get_backend(device).options._timeout
        except Exception:
            timeout = None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else DEFAULT_GROUP_TIMEOUT_S
    return max(0.1, seconds * _SHARE_OF_GROUP_TIMEOUT)


def abort_group(group: Any, device: torch.device) -> str | None:
    """Abort ``group``'s communicators where torch can (NCCL); ``None``, or why it could not.

    An object that is not a torch ``ProcessGroup`` but has ``abort()`` (a communicator wrapper)
    is asked to abort itself. For a ``ProcessGroup``, tried in order:
    ``torch.distributed.distributed_c10d._abort_process_group(group)`` (recent torch), then
    ``abort()`` of the group's backend for ``device`` (``ProcessGroupNCCL.abort``). Only NCCL
    groups are aborted: a gloo collective raises by itself at the group timeout.
    """
    import torch.distributed as dist

    if not isinstance(group, dist.ProcessGroup) and callable(getattr(group, "abort", None)):
        result = group.abort()  # a communicator object with its own abort (None, or why not)
        return None if result is None else str(result)
    try:
        kind = str(dist.get_backend(group)).lower()
    except Exception as exc:
        return f"unknown process group ({exc})"
    if kind != "nccl":
        return f"not aborted: a {kind} collective raises by itself at the group timeout"
    candidates: list[Callable[[], Any]] = []
    c10d_abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if c10d_abort is not None:
        candidates.append(lambda: c10d_abort(group))
    try:
        backend = group._get_backend(device)
    except Exception:
        backend = None
    backend_abort = getattr(backend, "abort", None)
    if backend_abort is not None:
        candidates.append(backend_abort)
    errors: list[str] = []
    for abort in candidates:
        try:
            abort()
            return None
        except Exception as exc:  # try the next way; report all if none works
            errors.append(f"{type(exc).__name__}: {exc}")
    return "; ".join(errors) or "this process group has no abort"


def _done(signal: Signal) -> bool:
    """Whether ``signal`` completed; one that cannot be queried (a broken CUDA context) counts as
    done here: its error reaches the caller through the lanes, and the watchdog must not die."""
    try:
        return bool(signal.query())
    except Exception:
        return True


class CollectiveWatchdog:
    """Calls ``on_expire(what)`` once if a watched signal stays pending for ``timeout_s``."""

    def __init__(self, timeout_s: float, on_expire: Callable[[str], None], *, poll_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self._on_expire = on_expire
        self._poll_s = poll_s if poll_s is not None else min(1.0, timeout_s / 10)
        self._pending: list[tuple[Signal, float, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.expired: str | None = None
        self._thread = threading.Thread(target=self._run, name="hwr-dlo-watchdog", daemon=True)
        self._thread.start()

    def watch(self, signal: Signal, what: str) -> None:
        """Watch ``signal`` (a gather's completion) from now on."""
        with self._lock:
            self._pending.append((signal, time.monotonic() + self.timeout_s, what))

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            now = time.monotonic()
            with self._lock:
                self._pending = [entry for entry in self._pending if not _done(entry[0])]
                late = next((entry for entry in self._pending if entry[1] <= now), None)
                if late is None:
                    continue
                self._pending = []
            self.expired = f"{late[2]} did not complete within {self.timeout_s:.1f} s"
            _log.error("AllGather watchdog: %s; aborting the DLO process group", self.expired)
            try:
                self._on_expire(self.expired)
            except Exception:  # the watchdog thread must never die silently with the error
                _log.exception("AllGather watchdog: handling the expiry failed")
            return

    def close(self) -> None:
        """Stop watching; idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
