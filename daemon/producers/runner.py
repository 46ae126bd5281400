"""Running one producer job in its own process: timeout, progress, cancellation.

``run_job`` starts ``python -m hwr.daemon.producers.worker`` in a new session (its own process
group), hands it the job on stdin and the descriptors with ``pass_fds``, relays each progress
event to ``on_progress`` and returns the final ``done`` event. On timeout it kills the process
group and raises ``ProducerTimeout``; on cancellation of the awaiting task (the client went
away) it kills the group and re-raises ``CancelledError``; a crash, a signal or an ``error``
event raises ``ProducerFailed`` (or the typed error the worker reported). In every case the
process is reaped before ``run_job`` returns, so no writer outlives it: the caller may then
abort the staging knowing nobody still writes into it.

Spare process: starting Python and importing torch takes 1.5-3 s, often more than the transform
of a small checkpoint. ``ensure_spare()`` starts one worker ahead of time (when a checkpoint is
registered, and between the ranks of a multi-rank build); it imports everything and then waits on
a Unix socket, and ``run_job`` hands it the job and the descriptors (``SCM_RIGHTS``) instead of
spawning. The spare serves ONE job and exits like any worker, so no state is carried from one
build to the next, and kill, timeout and cancellation work on it exactly as on a fresh process.
An idle spare exits after ``SPARE_IDLE_S`` (or when the daemon exits: its socket reaches EOF).
At most one spare exists; its cost while idle is one interpreter with torch imported (~230 MiB
RSS) for up to ``SPARE_IDLE_S``. A job with more than ``MAX_PASSED_FDS`` descriptors (the kernel's
``SCM_MAX_FD`` is 253) or no live spare starts a fresh process as before.

Limit: a producer that spawns children outside its process group (``setsid``) is not killed with
it; ours never does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from hwr.client.errors import HwrError, ProducerFailed, ProducerTimeout, error_from_code

__all__ = ["ensure_spare", "run_job"]

log = logging.getLogger("hwrd.producers")
STDERR_TAIL = 4000
SPARE_IDLE_S = 300.0
MAX_PASSED_FDS = 250
_WORKER = ("-m", "hwr.daemon.producers.worker")


class _Process:
    """A started worker: its process, the tail of its stderr (drained from the start, so an idle
    spare never blocks on a full pipe), and for a spare the parent end of its job socket."""

    def __init__(self, proc: asyncio.subprocess.Process, job_socket: socket.socket | None) -> None:
        self.proc = proc
        self.job_socket = job_socket
        self.started = time.monotonic()
        self.stderr_tail = bytearray()
        self.stderr_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        assert self.proc.stderr is not None
        while chunk := await self.proc.stderr.read(65536):
            self.stderr_tail.extend(chunk)
            del self.stderr_tail[:-STDERR_TAIL]

    def close_socket(self) -> None:
        sock, self.job_socket = self.job_socket, None
        if sock is not None:
            sock.close()


_spare: _Process | None = None
_spare_starting: asyncio.Task[None] | None = None


def ensure_spare() -> None:
    """Start a spare worker in the background unless one is alive or starting (on the loop)."""
    global _spare_starting
    if (_spare is not None and _spare.proc.returncode is None) or (
            _spare_starting is not None and not _spare_starting.done()):
        return
    _spare_starting = asyncio.get_running_loop().create_task(_start_spare())


async def _start_spare() -> None:
    global _spare
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *_WORKER, "--spare", str(child.fileno()), str(SPARE_IDLE_S),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            pass_fds=(child.fileno(),), start_new_session=True, limit=1 << 20,
        )
    except OSError as exc:
        # A spare only saves the next job its interpreter's start: the job starts its own process
        # and reports the error as its own (a background task must not die unobserved).
        parent.close()
        log.warning("could not start a spare producer process: %s", exc)
        return
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
    old, _spare = _spare, _Process(proc, parent)
    if old is not None:
        old.close_socket()  # an exited spare's leftovers


def _take_spare(nfds: int) -> _Process | None:
    global _spare
    spare = _spare
    if spare is None or nfds > MAX_PASSED_FDS:
        return None
    _spare = None
    # Near its idle deadline the spare might exit while we hand it the job: retire it instead.
    if spare.proc.returncode is not None or time.monotonic() - spare.started > SPARE_IDLE_S - 30:
        spare.close_socket()
        if spare.proc.returncode is None:
            _kill_group(spare.proc.pid)
        return None
    return spare


async def _hand_over(spare: _Process, job: dict[str, Any], fds: Sequence[int]) -> bool:
    """Send the job to a spare; False (spare killed and reaped) when it cannot take it."""
    try:
        assert spare.job_socket is not None
        await asyncio.to_thread(_send_job, spare.job_socket, job, fds)
        return True
    except OSError:
        await _discard(spare)
        return False
    except BaseException:
        await _discard(spare)
        raise
    finally:
        spare.close_socket()


async def _discard(worker: _Process) -> None:
    worker.close_socket()
    if worker.proc.returncode is None:
        _kill_group(worker.proc.pid)
        with contextlib.suppress(ProcessLookupError):
            await asyncio.shield(worker.proc.wait())
    worker.stderr_task.cancel()


def _send_job(sock: socket.socket, job: dict[str, Any], fds: Sequence[int]) -> None:
    payload = json.dumps({**job, "fd_map": list(fds)}).encode()
    sock.setblocking(True)
    socket.send_fds(sock, [struct.pack("<Q", len(payload))], list(fds))
    sock.sendall(payload)


async def _spawn(pass_fds: Sequence[int], program: str | None = None) -> _Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *(_WORKER if program is None else ("-m", program)),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        pass_fds=tuple(pass_fds), start_new_session=True, limit=1 << 20,
    )
    return _Process(proc, None)


async def run_job(
    job: dict[str, Any],
    pass_fds: Sequence[int],
    *,
    timeout: float,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    then_spare: bool = False,
    program: str | None = None,
) -> dict[str, Any]:
    """Run ``job`` (see the module docstring); ``then_spare``: start the next job's spare now.

    ``program``: another producer module speaking the same protocol (``python -m PROGRAM``, job
    on stdin, events on stdout), always in a fresh process: spares run the standard worker.
    """
    worker = None if program is not None else _take_spare(len(pass_fds))
    if then_spare:
        ensure_spare()
    if worker is not None and not await _hand_over(worker, job, pass_fds):
        worker = None
    if worker is None:
        worker = await _spawn(pass_fds, program)
    proc, stderr_tail, stderr_task = worker.proc, worker.stderr_tail, worker.stderr_task
    final: dict[str, Any] | None = None
    try:
        async with asyncio.timeout(timeout):
            assert proc.stdout is not None
            if proc.stdin is not None:  # a fresh process: the job goes to its stdin
                proc.stdin.write(json.dumps(job).encode())
                await proc.stdin.drain()
                proc.stdin.close()
            async for line in proc.stdout:
                event = _parse(line)
                if event.get("event") == "progress":
                    if on_progress is not None:
                        on_progress(event)
                else:
                    final = event
            returncode = await proc.wait()
            await stderr_task
    except TimeoutError:
        raise ProducerTimeout(f"the producer ran past {timeout:.0f} s and was killed",
                              details={"timeout_s": timeout}) from None
    finally:
        worker.close_socket()
        if proc.returncode is None:
            _kill_group(proc.pid)
            with contextlib.suppress(ProcessLookupError):
                await asyncio.shield(proc.wait())
        stderr_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await stderr_task
    if final is not None and final.get("event") == "error":
        raise _typed(final)
    if returncode != 0 or final is None or final.get("event") != "done":
        how = f"signal {-returncode}" if returncode < 0 else f"status {returncode}"
        tail = bytes(stderr_tail).decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        raise ProducerFailed(f"the producer exited with {how}: {tail[0][:300]}",
                             details={"returncode": returncode})
    return final


def _parse(line: bytes) -> dict[str, Any]:
    try:
        event = json.loads(line)
    except ValueError:
        return {"event": "error", "code": ProducerFailed.code, "message": "malformed producer event"}
    return event if isinstance(event, dict) else {"event": "error", "code": ProducerFailed.code,
                                                  "message": "malformed producer event"}


def _typed(event: dict[str, Any]) -> HwrError:
    code = str(event.get("code") or ProducerFailed.code)
    message = str(event.get("message") or "the producer failed")[:2000]
    return error_from_code(code, f"producer: {message}")


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
