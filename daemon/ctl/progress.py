"""The progress bar of long hwrctl operations (verify, pull, prewarm), drawn on stderr, and
``human_bytes``, the size format of every hwrctl table.

Usage::

    with ProgressBar(key[:16], unit="bytes", quiet=not wanted) as bar:
        client.verify(key, bar.update)    # update(done, total): absolute position, not an increment

Contract: output goes to stderr only, so ``--json`` documents on stdout stay clean. On a
terminal the bar redraws in place (at most ~10 times a second, and always on reaching the total);
elsewhere (a pipe, a log, CI) it prints one line each time progress enters a new tenth, so a log
shows a long build moving without a line per update. ``close()`` shows the final state and ends
the line; a bar that was never updated prints nothing, and a ``quiet`` one never prints. A new
``label`` in ``update`` (prewarm: the next TP rank) starts a new line. Sizes are in human units
when ``unit="bytes"``. Limits: one bar at a time per stream; the width is fixed (30 cells) rather
than read from the terminal.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar", "human_bytes", "render"]

WIDTH = 30
REDRAW_INTERVAL_S = 0.1
_CLEAR_LINE = "\r\x1b[2K"  # the suffix (a tensor name) varies in length: a shorter line must not leave a tail


def human_bytes(n: int | float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _fraction(done: float, total: float) -> float:
    return min(1.0, done / total) if total > 0 else 0.0


def render(label: str, done: float, total: float, unit: str, suffix: str = "") -> str:
    """One line of the bar (pure: the tests check it)."""
    fraction = _fraction(done, total)
    filled = int(fraction * WIDTH)
    # A finished bar reads "100%" (what logs and scripts look for), a running one shows tenths.
    percent = "  100%" if fraction >= 1.0 else f"{fraction * 100:5.1f}%"
    amount = (f"{human_bytes(done)}/{human_bytes(total)}" if unit == "bytes"
              else f"{done:.0f}/{total:.0f}{(' ' + unit) if unit else ''}")
    return f"{label} [{'#' * filled}{'.' * (WIDTH - filled)}] {percent} {amount}" + (f" {suffix}" if suffix else "")


class ProgressBar:
    def __init__(self, label: str, total: float = 0, *, unit: str = "", stream: TextIO | None = None,
                 quiet: bool = False) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.suffix = ""
        self.stream = sys.stderr if stream is None else stream
        self.quiet = quiet
        self.done = 0.0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._updated = False
        self._last_draw = 0.0
        self._last_tenth = -1
        self._last_line = ""
        self._closed = False

    def update(self, done: float, total: float | None = None, *, label: str | None = None,
               suffix: str | None = None) -> None:
        """Move to ``done`` (of ``total``, when given); ``suffix`` is shown after the amount."""
        if label is not None and label != self.label:
            self._end_line()
            self.label, self._last_tenth = label, -1
        self.done = done
        if total is not None:
            self.total = total
        if suffix is not None:
            self.suffix = suffix
        self._updated = True
        if self.quiet:
            return
        fraction = _fraction(self.done, self.total)
        if self._tty:
            now = time.monotonic()
            if now - self._last_draw >= REDRAW_INTERVAL_S or fraction >= 1.0:
                self._last_draw = now
                self._draw()
        elif int(fraction * 10) != self._last_tenth:
            self._last_tenth = int(fraction * 10)
            self._draw()

    def close(self) -> None:
        """Idempotent; draws the final state (and ends the line on a terminal)."""
        if self._closed:
            return
        self._closed = True
        if self._updated and not self.quiet:
            if self._line() != self._last_line:
                self._draw()
            self._end_line()

    def _line(self) -> str:
        return render(self.label, self.done, self.total, self.unit, self.suffix)

    def _draw(self) -> None:
        self._last_line = self._line()
        self.stream.write(_CLEAR_LINE + self._last_line if self._tty else self._last_line + "\n")
        self.stream.flush()

    def _end_line(self) -> None:
        """On a terminal, leave the drawn line in place and move below it (elsewhere every line
        already ends with a newline)."""
        if self._tty and self._last_line:
            self.stream.write("\n")
            self.stream.flush()
        self._last_line = ""

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
