"""Running one producer job in its own process: timeout, progress, cancellation.

``run_job`` starts ``python -m hwr.daemon.producers.worker`` in a new session (its own process
group), hands it the job on stdin and the descriptors with ``pass_fds``, relays each progress
event to ``on_progress`` and returns the final ``done`` event. On timeout it kills the process
group and raises ``ProducerTimeout``; on cancellation of the awaiting task (the client went
away) it kills the group and re-raises ``CancelledError``; a crash, a signal or an ``error``
event raises ``ProducerFailed`` (or the typed error the worker reported). In every case the
process is reaped before ``run_job`` returns, so no writer outlives it: the caller may then
abort the staging knowing nobody still writes into it.

Limit: a producer that spawns children outside its process group (``setsid``) is not killed with
it; ours never does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from hwr.client.errors import HwrError, ProducerFailed, ProducerTimeout, error_from_code

__all__ = ["run_job"]

STDERR_TAIL = 4000


async def run_job(
    job: dict[str, Any],
    pass_fds: Sequence[int],
    *,
    timeout: float,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hwr.daemon.producers.worker",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        pass_fds=tuple(pass_fds), start_new_session=True, limit=1 << 20,
    )
    stderr_tail = bytearray()

    async def drain_stderr() -> None:
        assert proc.stderr is not None
        while chunk := await proc.stderr.read(65536):
            stderr_tail.extend(chunk)
            del stderr_tail[:-STDERR_TAIL]

    stderr_task = asyncio.get_running_loop().create_task(drain_stderr())
    final: dict[str, Any] | None = None
    try:
        async with asyncio.timeout(timeout):
            assert proc.stdin is not None and proc.stdout is not None
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
