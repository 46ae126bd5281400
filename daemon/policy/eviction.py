"""Eviction order: which artifacts may go, and which go first (pure).

An artifact is *evictable* only when nothing on the node uses it::

    leased   a live session holds a lease on it
    pinned   an operator pinned it (``hwrctl pin``)
    channel  a channel points to it (its current key, or the last durable key a restart would
             fall back to)
    held     the lease journal says a process that leased it before a daemon restart is still
             alive (and has not reattached yet)
    mapped   some process maps one of its payload files (``/proc/<pid>/maps``, by dev:inode)
    busy     a publication of the same key is in flight, or it is being evicted already

``plan`` takes ``Candidate`` values (flags already gathered by the adapter) and returns the
least-recently-used evictable keys whose sizes cover ``shortfall``; ``fits`` says whether they
do. Ties in ``last_access`` break by key so the order is deterministic.

Limit: the flags are a snapshot; the evictor (``hwr.daemon.service.evictor``) makes them hold by
marking the chosen keys as being evicted (new leases on them are refused) before it scans the
mappings, and by re-checking leases right before each removal.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Candidate", "Plan", "blocking_reason", "plan"]

REASONS = ("leased", "pinned", "channel", "held", "busy", "mapped")


@dataclass(frozen=True)
class Candidate:
    key: str
    size_bytes: int
    last_access: float
    leased: bool = False
    pinned: bool = False
    channel: bool = False
    held: bool = False
    busy: bool = False
    mapped: bool = False


@dataclass(frozen=True)
class Plan:
    keys: tuple[str, ...]
    freed_bytes: int
    fits: bool
    skipped: tuple[tuple[str, str], ...]  # (key, reason) of artifacts that could not be chosen


def blocking_reason(candidate: Candidate) -> str | None:
    """Why ``candidate`` may not be evicted, or None when it may."""
    for reason in REASONS:
        if getattr(candidate, reason):
            return reason
    return None


def lru_order(candidates: Iterable[Candidate]) -> list[Candidate]:
    return sorted(candidates, key=lambda c: (c.last_access, c.key))


def plan(candidates: Sequence[Candidate], shortfall: int) -> Plan:
    """The LRU evictable keys that free at least ``shortfall`` bytes (fewest from the LRU end)."""
    chosen: list[str] = []
    skipped: list[tuple[str, str]] = []
    freed = 0
    for candidate in lru_order(candidates):
        if freed >= shortfall:
            break
        reason = blocking_reason(candidate)
        if reason is not None:
            skipped.append((candidate.key, reason))
            continue
        chosen.append(candidate.key)
        freed += candidate.size_bytes
    return Plan(tuple(chosen), freed, freed >= shortfall, tuple(skipped))
