"""The stalled-publisher deadline of publications (pure).

``overdue`` names the STAGED publications older than the deadline; the daemon's housekeeping
(``hwr.daemon.service.housekeeping``) cancels them (their staging is removed and their
reservation returned; a later commit from the stalled writer fails with ``PublicationFailed``).
A publisher that *dies* is cancelled at once by its session's end.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["overdue"]


def overdue(staged: Iterable[tuple[str, float]], now: float, deadline_s: float) -> list[str]:
    """Ids of publications, given as ``(id, started_at)``, staged for longer than ``deadline_s``."""
    if deadline_s <= 0:
        return []
    return [pub_id for pub_id, started in staged if now - started > deadline_s]
