"""Counting what the fuzz suite tried (``conftest.py`` prints the totals at the end of the run)."""

from __future__ import annotations

COUNTS: dict[str, int] = {}


def count(target: str, n: int = 1) -> None:
    COUNTS[target] = COUNTS.get(target, 0) + n
