"""Process checks shared by the benchmark-harness tests."""

from __future__ import annotations

import os
import signal
import time


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (``/proc/PID/stat`` state field)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def exits_within(pid: int, timeout: float) -> bool:
    """Whether ``pid`` is gone within ``timeout`` seconds; if not, it is SIGKILLed (a failing test
    must not leave a daemon behind) and the answer is False."""
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)
        return False
    return True
