"""``cursor_page``: the pages of a sorted listing by cursor, over plain values."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hwr.daemon.policy.cursor_pages import cursor_page


def _all_pages(items: list[str], limit: int, page_size: int) -> list[list[str]]:
    pages, after = [], ""
    while True:
        page, after = cursor_page(items, str, after, limit, page_size)
        pages.append(page)
        if not after:
            return pages


@given(st.lists(st.text(alphabet="0123456789abcdef", min_size=1, max_size=6), unique=True, max_size=60),
       st.integers(min_value=0, max_value=10), st.integers(min_value=1, max_value=8))
def test_pages_cover_every_item_once_in_order(keys: list[str], limit: int, page_size: int) -> None:
    items = sorted(keys)
    pages = _all_pages(items, limit, page_size)
    assert [x for page in pages for x in page] == items
    size = page_size if limit == 0 or limit > page_size else limit
    assert all(len(page) == size for page in pages[:-1]) and len(pages[-1]) <= size


def test_a_listing_that_changes_between_pages_repeats_nothing() -> None:
    items = ["b", "d", "f", "h"]
    first, after = cursor_page(items, str, "", 2, 100)
    assert (first, after) == (["b", "d"], "d")
    items = ["a", "c", "f", "g", "h"]  # "b" released, "a" and "c" granted (behind or at the cursor)
    second, after = cursor_page(items, str, after, 2, 100)
    assert (second, after) == (["f", "g"], "g")
    assert cursor_page(items, str, after, 2, 100) == (["h"], "")
