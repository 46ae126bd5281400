"""The stalled-publisher deadlines of publications (pure).

``overdue`` names the STAGED publications older than the deadline, and, given the time each
last made progress, those that made none for the stall timeout; the daemon's housekeeping
(``hwr.daemon.service.housekeeping``) cancels them (their staging is removed and their
reservation returned; a later write or commit from the stalled writer fails with
``PublicationFailed``). A publisher that *dies* is cancelled at once by its session's end.

``progressed`` decides whether a publication moved: any change of its progress marks (the
staging files' sizes, blocks and modification times, the files handed over) counts.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["overdue", "progressed"]


def overdue(staged: Iterable[tuple[str, float]], now: float, deadline_s: float) -> list[str]:
    """Ids of publications, given as ``(id, started_at)``, staged for longer than ``deadline_s``."""
    if deadline_s <= 0:
        return []
    return [pub_id for pub_id, started in staged if now - started > deadline_s]


def progressed(marks: tuple[int, ...], last: tuple[int, ...] | None, now: float, last_at: float) -> tuple[bool, float]:
    """Whether a publication moved since its ``last`` marks (None: not looked at yet, which
    counts as progress), and the time it last did: ``now`` when it moved, else ``last_at``."""
    moved = last is None or marks != last
    return moved, now if moved else last_at
