"""The keys an eviction round has marked: what the read API waits on and eviction sets.

Here, below both, so that the reader (``hwr.daemon.service.catalog``) and eviction
(``hwr.daemon.service.evictor``) share the marks without the reader importing eviction.
Contract: used on the daemon's event loop only.
"""

from __future__ import annotations

import asyncio

__all__ = ["EvictionMarks"]


class EvictionMarks:
    """The keys an eviction round (or an eviction by hand) has marked, and the event set when
    they are unmarked. The read API waits on them (an acquire of a marked key waits for the
    round to end); a round never waits on a reader. ``settled`` is replaced at each ``settle``:
    a waiter waits on the event it read."""

    def __init__(self) -> None:
        self.evicting: set[str] = set()
        self.settled = asyncio.Event()

    def settle(self) -> None:
        self.settled.set()
        self.settled = asyncio.Event()
