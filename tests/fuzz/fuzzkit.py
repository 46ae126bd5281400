"""Counting what the fuzz suite tried (``conftest.py`` prints the totals at the end of the run).

``with checked(target):`` wraps one input's call *and* its checks: the input counts as passed
when the block ends normally (a ``return`` included) and as failed when anything escapes it (a
failed assertion, an untyped error), so a failing run prints a non-zero failure count instead of
a tally taken before the checks ran. Hypothesis replays a failing input while shrinking it; each
replay counts as one more failure.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

COUNTS: dict[str, list[int]] = {}  # target -> [passed, failed]


@contextlib.contextmanager
def checked(target: str) -> Iterator[None]:
    counts = COUNTS.setdefault(target, [0, 0])
    try:
        yield
    except BaseException:
        counts[1] += 1
        raise
    counts[0] += 1
