"""Usage accounting: the payload bytes of every ``artifacts/`` entry, kept in memory.

Why in memory: the service reads usage on the event loop, where a ``listdir`` of
``artifacts/`` waits on the directory lock behind commits' renames. Every move into or out of
``artifacts/`` made by the store runs inside ``UsageLedger.moved`` and is counted right after
its rename: an entry is counted from the end of its rename in (the publication's reservation
covers it until its commit returns) until the end of its rename out. Changes made behind the
daemon's back are found by ``UsageLedger.rescan`` (the daemon runs it at every housekeeping
tick, and before admin usage reports).

A rescan lists the directory without a lock, so its listing may predate or straddle a rename
made meanwhile: for every key moved or moving since the rescan began (``_touched``) it keeps the
in-memory state instead of what the listing saw (``merge_listing``). What changed is computed
from two snapshots taken under the lock (``listing_changes``), never from the live table, which
moves on as soon as the lock is released.

Limits: an entry put there behind the daemon's back is counted only at the next rescan (or at its
first lookup); sizes of unknown entries are the bytes of every file in them (``scan_sizes``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from hwr.client.identity import is_key

__all__ = ["Rescan", "UsageLedger", "listing_changes", "merge_listing", "scan_sizes"]


@dataclass(frozen=True)
class Rescan:
    """What one rescan found: the accounting it replaced and the one it installed."""

    before: Mapping[str, int]
    after: Mapping[str, int]


def merge_listing(listed: Mapping[str, int], current: Mapping[str, int], touched: set[str]) -> dict[str, int]:
    """The new accounting: ``listed`` (what a listing saw), except that every ``touched`` key
    (moved or moving while it listed) keeps its ``current`` in-memory state, present or absent."""
    out = dict(listed)
    for key in touched:
        if key in current:
            out[key] = current[key]
        else:
            out.pop(key, None)
    return out


def listing_changes(before: Mapping[str, int], after: Mapping[str, int]) -> tuple[list[str], list[str]]:
    """Keys that appeared in ``after`` and keys that vanished from ``before``, each sorted."""
    return sorted(after.keys() - before.keys()), sorted(before.keys() - after.keys())


def scan_sizes(artifacts: Path, known: Mapping[str, int]) -> dict[str, int]:
    """Sizes of the ``artifacts/`` entries: a ``known`` one (accounted or validated) from memory,
    another key directory as the bytes of every file in it; names that are not keys are skipped."""
    out: dict[str, int] = {}
    for entry in os.listdir(artifacts):
        if entry in known:
            out[entry] = known[entry]
        elif is_key(entry):
            total = 0
            with contextlib.suppress(OSError):
                for name in os.listdir(artifacts / entry):
                    with contextlib.suppress(OSError):
                        total += os.lstat(artifacts / entry / name).st_size
            out[entry] = total
    return out


class UsageLedger:
    """Payload bytes per ``artifacts/`` entry, and their sum (O(1) to read).

    Lock order: ``_lock`` is a leaf, held only for in-memory updates, never across a syscall (the
    event loop retires inline, and a lock whose holder waits for the GIL after a rename stalls
    it). ``_scan_lock`` (one rescan at a time: they share ``_touched``) is held across a rescan's
    listing, and the ``scan`` callable may take other leaf locks under it (the record cache's);
    nothing holding ``_lock`` takes ``_scan_lock``. Readers take no lock: a dict copy and an int
    read are atomic under the interpreter lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._scan_lock = threading.Lock()
        self._sizes: dict[str, int] = {}
        self._total = 0  # sum of _sizes, kept with it under _lock
        self._moving: set[str] = set()  # keys whose rename is under way
        # Keys moved or moving since a rescan began listing; None between rescans.
        self._touched: set[str] | None = None

    def reset(self, sizes: Mapping[str, int]) -> None:
        """Install a first accounting (at open, before anyone else uses the store)."""
        with self._lock:
            self._sizes = dict(sizes)
            self._total = sum(self._sizes.values())

    def by_key(self) -> dict[str, int]:
        return dict(self._sizes)

    def total(self) -> int:
        return self._total

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    @contextlib.contextmanager
    def moved(self, key: str | None, size: int | None, *, keep: bool = False) -> Iterator[None]:
        """Account a rename of ``key`` into (``size``) or out of (None) ``artifacts/`` done in
        the body: counted once the body returns (nothing changes when it raises). ``keep``:
        only when not counted yet. ``key`` None: a rename of something not accounted (a stray
        name), nothing to do. A rescan listing while the body runs keeps this key's in-memory
        state instead of what its listing saw."""
        if key is None:
            yield
            return
        with self._lock:
            self._moving.add(key)
            if self._touched is not None:
                self._touched.add(key)
        try:
            yield
        except BaseException:
            with self._lock:
                self._moving.discard(key)
            raise
        with self._lock:
            self._moving.discard(key)
            if self._touched is not None:
                self._touched.add(key)
            if size is None:
                self._total -= self._sizes.pop(key, 0)
            elif not keep or key not in self._sizes:
                self._total += size - self._sizes.get(key, 0)
                self._sizes[key] = size

    def rescan(self, scan: Callable[[], dict[str, int]]) -> Rescan:
        """Replace the accounting with ``scan()``'s listing, merged with the renames made while
        it ran (``merge_listing``). A failing ``scan`` changes nothing and raises."""
        with self._scan_lock:
            with self._lock:
                self._touched = set(self._moving)
            try:
                listed = scan()
            except BaseException:
                with self._lock:
                    self._touched = None
                raise
            with self._lock:
                touched, self._touched = self._touched, None
                before = self._sizes
                self._sizes = merge_listing(listed, before, touched)
                self._total = sum(self._sizes.values())
                # A snapshot under the lock: the installed dict moves on (moved's updates) the
                # moment the lock is released, and a difference computed from it afterwards
                # would report a retirement or a commit that landed since as "behind the
                # daemon's back" (seen as a spurious "vanished" under concurrent churn).
                after = dict(self._sizes)
        return Rescan(before, after)
