"""Recency, the pure part: least-recently-used order of the store's artifacts without sorting
the store per query (the clock and its persistence: ``hwr.daemon.service.recency``).

A publication under eviction pressure asks for the oldest evictable artifacts once per try.
Sorting every artifact each time made that O(n log n) on the event loop: with 3,000 artifacts
it was 62 % of the daemon's interpreter time in a publication loop (py-spy). ``LruIndex`` keeps
a heap of ``(last use, key)``; a query pops entries in order only as far as the caller walks and
the caller puts them back (``restore``), so a round costs O(k log n) for the k entries it walks.

The order is exactly ``sorted((last_use, key))`` over the noted keys. Re-noting a key (a new last
use) pushes a new entry and leaves the old one in the heap as stale: an entry is live only while
its time is the key's current one. Stale entries are skipped when popped and dropped by a rebuild
once they outnumber the live ones (amortised O(1) per note). Not thread-safe: the daemon uses it
on its event loop only.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

__all__ = ["LruIndex"]


class LruIndex:
    """Keys by last use, oldest first (ties by key)."""

    #: A rebuild happens when the heap holds this many entries more than twice the live keys.
    SLACK = 1024

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self._time: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._time)

    def note(self, key: str, when: float) -> None:
        """``key`` was last used at ``when`` (any float; the order follows it, not call order)."""
        if self._time.get(key) == when:
            return
        self._time[key] = when
        heapq.heappush(self._heap, (when, key))
        if len(self._heap) > 2 * len(self._time) + self.SLACK:
            self._heap = [(t, k) for k, t in self._time.items()]
            heapq.heapify(self._heap)

    def forget(self, key: str) -> None:
        self._time.pop(key, None)

    def pop_in_order(self) -> Iterator[tuple[float, str]]:
        """Pop live entries oldest first, lazily, each key at most once per walk. Every entry
        the caller receives is out of the index until it passes it to ``restore`` (which it
        must do, also on errors, after closing the walk). A key noted again while the walk is
        under way keeps its new entry (put back when the walk ends); one noted for the first
        time is popped in its place in the order when still ahead. One walk at a time."""
        yielded: dict[str, float] = {}
        deferred: list[tuple[float, str]] = []
        try:
            while self._heap:  # re-read: a note during the walk may have rebuilt the heap
                when, key = heapq.heappop(self._heap)
                if self._time.get(key) != when:
                    continue  # stale
                if key in yielded:
                    if yielded[key] != when:  # re-noted since we yielded it: keep its new entry
                        deferred.append((when, key))
                    continue  # else a copy of the entry the caller holds (after a rebuild)
                yielded[key] = when
                yield when, key
        finally:
            for entry in deferred:
                heapq.heappush(self._heap, entry)

    def restore(self, entries: Iterable[tuple[float, str]]) -> None:
        """Put back entries ``pop_in_order`` gave out; those re-noted or forgotten meanwhile are
        dropped (their current entry, if any, is already in the heap)."""
        for when, key in entries:
            if self._time.get(key) == when:
                heapq.heappush(self._heap, (when, key))
