"""The store's usage ledger and recovery decisions, over plain values (no store root)."""

from __future__ import annotations

import pytest

from hwr.daemon.store.recovery import is_legacy_key_lock, stale_trash
from hwr.daemon.store.usage import UsageLedger, listing_changes, merge_listing

A, B, C = "a" * 64, "b" * 64, "c" * 64


def test_a_rescan_result_is_a_snapshot_that_later_moves_do_not_change() -> None:
    """Regression (flaky under churn): the rescan's difference was computed from the live table
    after its lock was released, so a retirement landing then was logged as "vanished"."""
    ledger = UsageLedger()
    ledger.reset({A: 1, B: 2})
    result = ledger.rescan(lambda: {A: 1, B: 2})
    with ledger.moved(A, None):  # a retirement right after the rescan installed its listing
        pass
    with ledger.moved(C, 3):  # and a commit
        pass
    assert listing_changes(result.before, result.after) == ([], [])
    assert dict(result.after) == {A: 1, B: 2}
    assert ledger.by_key() == {B: 2, C: 3} and ledger.total() == 5


def test_renames_during_a_rescan_keep_their_in_memory_state() -> None:
    ledger = UsageLedger()
    ledger.reset({A: 1})

    def listing() -> dict[str, int]:
        with ledger.moved(A, None):  # retired while the listing runs: the listing still saw it
            pass
        with ledger.moved(B, 2):  # committed while it runs: the listing missed it
            pass
        return {A: 1}

    result = ledger.rescan(listing)
    assert dict(result.after) == {B: 2} and ledger.total() == 2


def test_a_failed_scan_changes_nothing() -> None:
    ledger = UsageLedger()
    ledger.reset({A: 1})

    def failing() -> dict[str, int]:
        raise OSError(5, "EIO")

    with pytest.raises(OSError):
        ledger.rescan(failing)
    assert ledger.by_key() == {A: 1} and ledger.rescan(lambda: {A: 1}).after == {A: 1}


def test_merge_listing_prefers_memory_for_touched_keys_only() -> None:
    assert merge_listing({A: 1, B: 9}, {B: 2, C: 3}, {B, C}) == {A: 1, B: 2, C: 3}
    assert merge_listing({A: 1, B: 9}, {C: 3}, {B}) == {A: 1}


def test_stale_trash_is_retirement_names_of_no_open_staging() -> None:
    entries = [f"{A}.removed.x1", f"{A}.123.abc", f"{B}.removed.x2", "junk"]
    assert stale_trash(entries, {f"{B}.removed.x2"}) == [f"{A}.removed.x1"]
    assert is_legacy_key_lock(f"{A}.artifact") and not is_legacy_key_lock("daemon.lock")
    assert not is_legacy_key_lock("unrelated.artifact")
