"""A progress bar for long hwrctl operations (verify, prewarm, ...), drawn on stderr.

Usage::

    with progress_bar("verify", total_bytes, unit="bytes") as bar:
        for done in stream_of_progress:
            bar.update(done)          # absolute position, not an increment

Contract: output goes to stderr only, so ``--json`` documents on stdout stay clean; on a
terminal the bar redraws in place (at most ~10 times a second), elsewhere (a pipe, a log, CI) it
prints nothing until ``close()``, which prints one final line only when ``quiet`` is false.
Sizes are shown in human units (``human_bytes``) when ``unit="bytes"``. Limits: one bar at a
time per stream; the width is fixed (30 cells) rather than read from the terminal.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar", "human_bytes", "progress_bar"]

WIDTH = 30


def human_bytes(n: int | float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def render(label: str, done: float, total: float, unit: str) -> str:
    """One line of the bar (pure: the tests check it)."""
    fraction = min(1.0, done / total) if total > 0 else 0.0
    filled = int(fraction * WIDTH)
    amount = (f"{human_bytes(done)}/{human_bytes(total)}" if unit == "bytes"
              else f"{done:.0f}/{total:.0f}{(' ' + unit) if unit else ''}")
    return f"{label} [{'#' * filled}{'.' * (WIDTH - filled)}] {fraction * 100:5.1f}% {amount}"


class ProgressBar:
    def __init__(self, label: str, total: float, *, unit: str = "", stream: TextIO | None = None,
                 quiet: bool = False) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.stream = sys.stderr if stream is None else stream
        self.quiet = quiet
        self.done = 0.0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_draw = 0.0
        self._closed = False

    def update(self, done: float, total: float | None = None) -> None:
        self.done = done
        if total is not None:
            self.total = total
        now = time.monotonic()
        if self._tty and not self.quiet and now - self._last_draw >= 0.1:
            self._last_draw = now
            self.stream.write("\r" + render(self.label, self.done, self.total, self.unit))
            self.stream.flush()

    def close(self) -> None:
        """Idempotent; draws the final state (and ends the line on a terminal)."""
        if self._closed:
            return
        self._closed = True
        if self.quiet:
            return
        line = render(self.label, self.done, self.total, self.unit)
        self.stream.write(("\r" + line + "\n") if self._tty else line + "\n")
        self.stream.flush()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_bar(label: str, total: float, *, unit: str = "", quiet: bool = False) -> ProgressBar:
    return ProgressBar(label, total, unit=unit, quiet=quiet)
