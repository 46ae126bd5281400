"""Pages of a listing by cursor: the paged ``ListLeases`` and ``ListRemote`` (``hwrctl leases``,
``hwrctl remote ls``), whose full answers can pass gRPC's default 4 MiB message limit.

``cursor_page(items, key, after, limit, page_size)`` sorts nothing itself: ``items`` come sorted
by ``key``. It returns the items whose key is greater than ``after``, at most ``limit`` of them
(0, or more than ``page_size``: ``page_size``), and the cursor of the next page: the last key
returned when more remain, else "". A key makes a cursor, not an offset, so a listing that
changes between pages never repeats an item (it may miss one added behind the cursor).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["cursor_page"]

T = TypeVar("T")


def cursor_page(items: Sequence[T], key: Callable[[T], str], after: str, limit: int,
                page_size: int) -> tuple[list[T], str]:
    """(the page, the next cursor or ""); see the module docstring."""
    size = page_size if limit <= 0 or limit > page_size else limit
    keys = [key(item) for item in items]
    start = bisect.bisect_right(keys, after) if after else 0
    page = list(items[start:start + size])
    return page, (keys[start + size - 1] if start + size < len(items) else "")
