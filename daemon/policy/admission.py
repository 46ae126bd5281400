"""Admission of publications: optional store-wide serialization, and the stalled-publisher deadline.

One build per identity at a time is enforced by ``hwr.daemon.service.publications`` (waiters are answered
JOINED or ``ActiveBuildTimeout``). On top of it:

- ``Admission(serialized=True)`` lets one publication at a time stage and commit in the whole
  store (a node whose disk or page cache cannot take two builds at once); the others wait in
  FIFO order up to their wait timeout, then get ``ActiveBuildTimeout``.
- ``overdue`` (pure) names the STAGED publications older than the deadline; the daemon cancels
  them (their staging is removed and their reservation returned; a later commit from the stalled
  writer fails with ``PublicationFailed``). A publisher that *dies* is cancelled at once by its
  session's end.

Contract: used on the daemon's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from hwr.client.errors import ActiveBuildTimeout

__all__ = ["Admission", "overdue"]


def overdue(staged: Iterable[tuple[str, float]], now: float, deadline_s: float) -> list[str]:
    """Ids of publications, given as ``(id, started_at)``, staged for longer than ``deadline_s``."""
    if deadline_s <= 0:
        return []
    return [pub_id for pub_id, started in staged if now - started > deadline_s]


class Admission:
    def __init__(self, *, serialized: bool = False) -> None:
        self.serialized = serialized
        self._slot = asyncio.Semaphore(1) if serialized else None
        self.waiting = 0

    async def enter(self, key: str, timeout: float) -> bool:
        """Wait for the store-wide slot (no-op unless serialized); True when a slot was taken."""
        if self._slot is None:
            return False
        self.waiting += 1
        try:
            await asyncio.wait_for(self._slot.acquire(), max(0.0, timeout))
        except TimeoutError:
            raise ActiveBuildTimeout("serialized admission: another publication is building",
                                     details={"key": key, "serialized": True}) from None
        finally:
            self.waiting -= 1
        return True

    def leave(self, took_slot: bool) -> None:
        if took_slot and self._slot is not None:
            self._slot.release()
